"""Who computes a backend's numbers: the model file by content, the CPU, and
one backend identity that both the calibration cache (calibration/cache.py)
and the prompt cache's disk tier (core/prompt_disk.py) hash.

Here, in backend/, so that the calibration and the engine's core both import
it without one package reaching into the other.
"""
from __future__ import annotations

import hashlib
import os
import platform


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_fingerprint(model_path: str, span: int = 1 << 20) -> str:
    """The model file by content, not by place: its size and a hash of its
    first and last MiB (the GGUF header with the tensor layout, and the last
    tensor's data).  A copy, a move or a reinstall of the same file keeps its
    calibration and its saved prompts; another file (a different quantization
    or fine-tune) gets its own."""
    size = os.path.getsize(model_path)
    h = hashlib.sha256(str(size).encode())
    with open(model_path, "rb") as f:
        h.update(f.read(span))
        f.seek(max(0, size - span))
        h.update(f.read(span))
    return h.hexdigest()[:32]


def identity(backend) -> str:
    """Everything that changes the numbers a loaded backend computes (its KV
    cells and logits), as one text: the model file by content, the llama.cpp
    version, the K cache type and the V cache's (f16: edgespec never changes
    it), flash attention, exactness (the one-thread policy), the tiled K-quant
    product as this process runs it, the CPU weight repacking, the layers
    offloaded, the RPC workers and the split over them, the machine's
    architecture and CPU model.  Not in it: what changes only the time
    (threads, where the output layer runs over RPC), which the calibration
    key adds.  The text is the prompt disk's key text of FORMAT 1, kept
    byte for byte so that saved prompts stay valid."""
    from edgespec.backend.process import llama_cpp_version, tiled_mm_setting

    be = backend
    parts = [f"model={model_fingerprint(be.model_path)}", f"llama.cpp={llama_cpp_version()}",
             f"k={be.cache_type_k}", "v=f16", f"fa={be.flash_attn}", f"exact={int(be.exact)}",
             f"tiled_mm={tiled_mm_setting()}", f"repack={int(be.cpu_repack)}", f"ngl={be.n_gpu_layers}",
             f"rpc={'+'.join(be.rpc)}", f"split={':'.join(f'{x:g}' for x in be.tensor_split)}",
             platform.machine(), cpu_name()]
    return "|".join(parts)
