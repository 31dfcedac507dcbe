"""Loading a GGUF file into llama.cpp: the model handle, its metadata (LlamaBackend's half that needs no context)."""
from __future__ import annotations

import contextlib
import ctypes
import os

import llama_cpp as L

from edgespec.backend import ggml
from edgespec.backend.process import clear_recent_log, init_backend, recent_errors
from edgespec.errors import ConfigError, ModelLoadError


def load_model(path: str, n_gpu_layers: int = 0, vocab_only: bool = False, verbose: bool = False,
               cpu_repack: bool = False, tiled_mm: str = "0", rpc: list[str] | None = None,
               tensor_split: list[float] | None = None, load_progress=None, rpc_output: str = "local"):
    """Load a GGUF file; return the model pointer or raise ModelLoadError.

    cpu_repack: let llama.cpp's CPU backend move weights into its "extra buffer
    types" (weights repacked into interleaved blocks for its AVX2/AVX-512 gemv
    and gemm kernels, or into AMX tiles on Intel CPUs that have AMX).  Off by
    default: with repacking a batch of T tokens and T one-token decodes run
    different kernels, whose sums differ (so greedy output of verified drafts
    can leave plain decoding's), and its AMX kernel has crashed the process on
    the first multi-token batch (docs/exactness.md).

    rpc: llama.cpp RPC workers (HOST:PORT) whose devices take the offloaded
    layers, before this machine's GPUs; n_gpu_layers 0 then means all layers;
    rpc_output "local" computes the logits here, "remote" on the last worker.
    tensor_split: the proportions of the offloaded layers per device, in that
    order (None: by the devices' free memory).
    load_progress: called with the fraction loaded (0..1) while llama.cpp
    loads the weights (over RPC: while it sends them to the workers)."""
    init_backend(verbose, tiled_mm)
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = int(n_gpu_layers)
    mp.vocab_only = bool(vocab_only)
    mp.use_extra_bufts = bool(cpu_repack)
    keep = []       # ctypes arrays llama.cpp reads while loading
    if rpc and not vocab_only:
        keep += ggml.place_on_workers(mp, rpc, rpc_output)
        mp.n_gpu_layers = int(n_gpu_layers) or -1
    if load_progress is not None:
        def on_progress(fraction, user_data):  # pragma: no cover - called from C
            with contextlib.suppress(Exception):
                load_progress(float(fraction))
            return True
        keep.append(L.llama_progress_callback(on_progress))
        mp.progress_callback = keep[-1]
    if tensor_split and not vocab_only:
        n_dev = int(L.llama_max_devices())
        if len(tensor_split) > n_dev or any(x < 0 for x in tensor_split) or not sum(tensor_split) > 0:
            raise ConfigError(f"--tensor-split takes at most {n_dev} non-negative proportions, not {tensor_split}")
        keep.append((ctypes.c_float * n_dev)(*tensor_split))
        mp.tensor_split = keep[-1]
    clear_recent_log()
    model = L.llama_model_load_from_file(os.fsencode(path), mp)
    if not model:
        detail = recent_errors()
        raise ModelLoadError(f"llama.cpp could not load {path}" + (f": {detail}" if detail else ""))
    return model


def free_model(model_ptr) -> None:
    """Free a model loaded with load_model (a vocab-only one too)."""
    L.llama_model_free(model_ptr)


def model_metadata(model_ptr, key: str) -> str | None:
    buf = ctypes.create_string_buffer(1 << 16)
    n = L.llama_model_meta_val_str(model_ptr, key.encode(), buf, len(buf))
    return None if n < 0 else buf.value.decode("utf-8", errors="replace")
