"""The only module that touches llama_cpp's low-level API.

It owns the model, vocabulary and context handles, one reusable batch whose
arrays are numpy buffers (so a whole tree is laid in with a few vectorised
writes), and the KV-cache bookkeeping of tree verification:

* The committed sequence lives in KV sequence 0.  `n_past` is its length.
* A draft tree is laid out in depth-first order (the engine chooses the order);
  every root-to-leaf path gets its own sequence id, the leftmost path seq 0 and
  the others 1..L-1, which first see the committed prefix through
  `seq_cp(0, s)` (that only tags existing cells, it copies no data).  A node
  belongs to the sequences of every leaf below it and sits at position
  `n_past + depth`.
* After verification `keep(k)` keeps the first k batch slots, which must be a
  chain from the root along seq 0 (the engine guarantees it), and drops every
  other cell of the step.  The kept cells are then the first cells the batch
  used, in position order, exactly where plain decoding would have put them:
  that is what keeps greedy output token-identical (see shared/DESIGN.md §2).
* Every llama_memory_seq_* call scans the whole cache (13-17 us at 4096
  cells on the 2-core dev machine; seq_keep 110 us), so the sequences are
  synced lazily: seqs 0.._synced-1 hold exactly seq 0's cells.  A batch gives
  the leftmost path (the first-child chain, the one `keep` commits) every
  already-synced seq beyond its own leaves, `keep(k)` removes the cells past
  the kept chain with one call and empties only the seqs that left the chain
  before slot k-1, and `seq_cp` runs only for seqs not in sync.  A step that
  accepts nothing costs one scan.

Return codes of llama.cpp become `BackendError`s with a clear message.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import threading

import jinja2
import numpy as np

import llama_cpp as L
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from edgespec.errors import BackendError, ConfigError, ModelLoadError  # re-exported
from edgespec.backend import ggml

# the llama-cpp-python versions edgespec is tested with (pyproject.toml allows
# this range, so pip keeps a user's own CUDA or Metal build inside it)
TESTED_LLAMA_CPP = ((0, 3, 36), (0, 4, 0))


def _check_llama_cpp_version(version: str) -> str | None:
    """A one-line warning when `version` is outside TESTED_LLAMA_CPP (None inside)."""
    v = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    lo, hi = TESTED_LLAMA_CPP
    if lo <= v < hi:
        return None
    return (f"edgespec: warning: llama-cpp-python {version} is outside the tested range "
            f">={'.'.join(map(str, lo))},<{'.'.join(map(str, hi[:2]))}; it may work, or fail in llama.cpp")


if (_version_warning := _check_llama_cpp_version(L.__version__)):
    print(_version_warning, file=sys.stderr)


def build_info() -> dict:
    """llama-cpp-python's version and the ggml backends its build has
    (edgespec --version): from ggml's backend registry where the library
    exports it, else from llama.cpp's system info; RPC from llama_supports_rpc."""
    names = ggml.backend_names()
    if not names:
        info = L.llama_print_system_info().decode("utf-8", "replace")
        names = ["CPU"] + [n for n in ("CUDA", "Metal", "Vulkan", "SYCL", "HIP") if f"{n} :" in info]
    if L.llama_supports_rpc() and "RPC" not in names:
        names.append("RPC")
    names.sort(key=lambda n: (n != "CPU", n == "RPC"))      # CPU, the GPUs, then RPC
    return {"llama_cpp_python": L.__version__, "backends": names, "gpu_offload": gpu_offload_available()}


EXACT_MAX_BATCH = 48        # largest batch measured bit-identical to one-token decoding
SPLIT_KV_FREE_CELLS = 256   # a one-token decode up to this many cells avoids split-KV
# llama.cpp rounds every context size up to a multiple of 256 KV cells (the
# padding of its KV cache), so 256 is the smallest context there is; a smaller
# request used to become 256 silently and is refused instead
MIN_CTX = 256
# K-cache types (ggml type ids).  llama.cpp's default is f16; edgespec's default on
# CPU is q8_0, whose one-token decodes never take the split-KV path (see
# LlamaBackend.__init__), so every decode can use every thread and stay exact.
CACHE_TYPES_K = {"f16": 1, "q8_0": 8}


_log_lock = threading.Lock()
_log_lines: list[str] = []
_log_verbose = False
_log_file = None            # a text file llama.cpp's log is also appended to (edgespec --log-file)


def log_to_file(path: str | None) -> None:
    """Append llama.cpp's log (all of it, whatever the verbosity) to `path`; None stops."""
    global _log_file
    with _log_lock:
        if _log_file is not None:
            _log_file.close()
        _log_file = open(path, "a", encoding="utf-8") if path else None


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _log_callback(level, text, user_data):  # pragma: no cover - called from C
    try:
        s = text.decode("utf-8", errors="replace") if text else ""
    except Exception:
        return
    with _log_lock:
        _log_lines.append(s)
        del _log_lines[:-200]
    if _log_verbose:
        os.write(2, text or b"")
    if _log_file is not None:
        with contextlib.suppress(OSError, ValueError):
            _log_file.write(s)
            _log_file.flush()


_backend_ready = False

# llama.cpp's CPU backend multiplies K-quant weights (Q2_K..Q6_K) by a batch of
# 8 or more rows with a tiled kernel that accumulates in integers per block and
# scales once, where the one-row kernel (vec_dot) scales every block in float:
# the sums round differently.  Measured on the 2-core Intel Xeon with
# llama-cpp-python 0.3.36, Gemma-3-270M and Qwen2.5-Coder Q4_K_M: batches of 2-7
# tokens bit-identical to one-token decoding, of 8 and more off by up to 3.2 in
# the logits, with argmax flips.  The kernel has a process-wide switch, the
# environment variable GGML_CPU_TILED_MM, read once at the first matrix product;
# edgespec turns it off (before llama.cpp computes anything) unless the
# environment already sets it.  What was there before edgespec set it:
TILED_MM_ENV = "GGML_CPU_TILED_MM"
USER_TILED_MM = os.environ.get(TILED_MM_ENV)


def kernel_options(fast: bool) -> dict:
    """LlamaBackend's settings for --kernels fast (llama.cpp's fastest CPU
    kernels) or exact (batches bit-identical to one-token decoding)."""
    return {"exact": not fast, "flash_attn": False if fast else None, "tiled_mm": "1" if fast else "0"}


def tiled_mm_setting() -> str:
    """The GGML_CPU_TILED_MM value llama.cpp sees in this process ("0" = off;
    unset = llama.cpp's default, on)."""
    return os.environ.get(TILED_MM_ENV, "default")


def _init_backend(verbose: bool = False, tiled_mm: str = "0") -> None:
    """Start llama.cpp once per process.  tiled_mm: the GGML_CPU_TILED_MM value
    to use unless the environment already has one (the first model a process
    loads decides it: llama.cpp reads it once)."""
    global _backend_ready, _log_verbose
    _log_verbose = verbose
    os.environ.setdefault(TILED_MM_ENV, tiled_mm)
    if not _backend_ready:
        L.llama_log_set(_log_callback, ctypes.c_void_p(0))
        L.llama_backend_init()
        _backend_ready = True


def _recent_errors() -> str:
    with _log_lock:
        lines = [s.strip() for s in _log_lines[-40:] if s.strip()]
    errs = [s for s in lines if "error" in s.lower() or "failed" in s.lower() or "invalid" in s.lower()]
    return "; ".join((errs or lines)[-3:])


def default_threads(sysfs: str = "/sys/devices/system/cpu") -> int:
    """Threads for generation: one per physical core the process may run on.

    Two hardware threads of one core (SMT, "hyper-threading") share its
    arithmetic units, and a llama.cpp decode synchronises all its threads after
    every operation, so llama.cpp's own tools default to the physical cores and
    llama-cpp-python to half the logical CPUs for one-token decodes; a default
    of every logical CPU would risk making plain decoding slower than what users
    already run.  On Linux the cores are read from sysfs (hardware threads that
    list the same siblings are one core; only CPUs in the affinity mask count;
    2 on this project's machine, which has no SMT); on macOS from
    ``sysctl hw.perflevel0.physicalcpu`` (performance cores) or
    ``hw.physicalcpu``; elsewhere, or when that fails, every logical CPU."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS/Windows
        import sys
        return (sys.platform == "darwin" and _physical_cores_sysctl()) or max(1, os.cpu_count() or 1)
    cores = set()
    for c in cpus:
        try:
            with open(os.path.join(sysfs, f"cpu{c}", "topology", "thread_siblings_list")) as f:
                cores.add(f.read().strip())
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def _physical_cores_sysctl() -> int:  # pragma: no cover - macOS only
    import subprocess
    for key in ("hw.perflevel0.physicalcpu", "hw.physicalcpu"):
        try:
            out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=2)
            n = int(out.stdout.strip())
            if n > 0:
                return n
        except (OSError, ValueError, subprocess.SubprocessError):
            continue
    return 0


class Vocab:
    """Tokenizer of a model (works on a vocab-only load too)."""

    def __init__(self, model_ptr):
        self._model = model_ptr
        self.ptr = L.llama_model_get_vocab(model_ptr)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.ptr))
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.ptr))
        self._eog = None
        self._piece_cache: dict[int, bytes] = {}
        self._formatters: dict = {}      # add_generation_prompt -> Jinja2ChatFormatter

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"the text is not valid Unicode: an unpaired surrogate at character {e.start} "
                              "(bytes that were not UTF-8, decoded with surrogateescape?)") from None
        cap = len(data) + 8
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.ptr, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.ptr, data, len(data), buf, cap, add_special, parse_special)
            if n < 0:
                raise BackendError("tokenization failed")
        return np.ctypeslib.as_array(buf)[:n].astype(np.int32).copy()

    def piece(self, token: int, special: bool = False) -> bytes:
        if not special:
            p = self._piece_cache.get(token)
            if p is None:
                p = self._piece_cache[token] = self._piece(token, False)
            return p
        return self._piece(token, special)

    def _piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.ptr, int(token), buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.ptr, int(token), buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.ptr, int(token)))

    def eog_mask(self) -> np.ndarray:
        if self._eog is None:
            self._eog = np.array([self.is_eog(t) for t in range(self.n_vocab)], dtype=np.bool_)
        return self._eog

    def token_text(self, token: int) -> str:
        return self.piece(token, special=True).decode("utf-8", errors="replace")

    def eos_token(self) -> int:
        """The end-of-sequence token id (-1 if the model has none)."""
        return int(L.llama_vocab_eos(self.ptr))

    def bos_token(self) -> int:
        """The beginning-of-sequence token id (-1 if the model has none)."""
        return int(L.llama_vocab_bos(self.ptr))

    def chat_template(self) -> str | None:
        """The model's chat template (GGUF key tokenizer.chat_template), or None."""
        t = L.llama_model_chat_template(self._model, None)
        return t.decode("utf-8", errors="replace") if t else None

    def format_chat(self, messages, add_generation_prompt: bool = True) -> str:
        """Messages ({role, content} dicts) rendered with the model's chat
        template, the Jinja rendering llama-cpp-python's create_chat_completion
        uses, with the model's BOS/EOS texts; add_generation_prompt opens the
        assistant's turn at the end.  ConfigError (a ValueError) when a
        message is not a dict with string role and content, the model has no
        template, or the template does not render."""
        messages = list(messages)
        if not messages:
            raise ConfigError("no messages to render")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ConfigError(f"message {i + 1} is not a {{role, content}} object with string values: "
                                  f"{str(m)[:80]}")
        fmt = self._formatters.get(add_generation_prompt)
        if fmt is None:
            template = self.chat_template()
            if not template:
                raise ConfigError("this model has no chat template")
            eos, bos = self.eos_token(), self.bos_token()
            try:
                fmt = Jinja2ChatFormatter(template=template, add_generation_prompt=add_generation_prompt,
                                          eos_token=self.token_text(eos) if eos >= 0 else "",
                                          bos_token=self.token_text(bos) if bos >= 0 else "")
            except jinja2.TemplateError as e:
                raise ConfigError(f"the model's chat template does not parse: {e}") from None
            self._formatters[add_generation_prompt] = fmt
        try:
            return fmt(messages=messages).prompt
        except jinja2.TemplateError as e:
            raise ConfigError(f"the model's chat template failed on these messages: {e}") from None


def load_model(path: str, n_gpu_layers: int = 0, vocab_only: bool = False, verbose: bool = False,
               cpu_repack: bool = False, tiled_mm: str = "0", rpc: list[str] | None = None,
               tensor_split: list[float] | None = None, load_progress=None):
    """Load a GGUF file; return the model pointer or raise ModelLoadError.

    cpu_repack: let llama.cpp's CPU backend move weights into its "extra buffer
    types" (weights repacked into interleaved blocks for its AVX2/AVX-512 gemv
    and gemm kernels, or into AMX tiles on Intel CPUs that have AMX).  Off by
    default: with repacking a batch of T tokens and T one-token decodes run
    different kernels, whose sums differ in the last bits (measured: Q4_K_M
    models' logits differ by up to 0.3-2.3 between the two, so greedy output
    of verified drafts left plain decoding's), and on a KVM guest with AMX
    (2-core Intel Xeon, llama-cpp-python 0.3.36) the AMX kernel crashed the
    process on the first multi-token batch.

    rpc: llama.cpp RPC workers (HOST:PORT) whose devices take the offloaded
    layers, before this machine's GPUs; n_gpu_layers 0 then means all layers.
    tensor_split: the proportions of the offloaded layers per device, in that
    order (None: by the devices' free memory).
    load_progress: called with the fraction loaded (0..1) while llama.cpp
    loads the weights (over RPC: while it sends them to the workers)."""
    _init_backend(verbose, tiled_mm)
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = int(n_gpu_layers)
    mp.vocab_only = bool(vocab_only)
    mp.use_extra_bufts = bool(cpu_repack)
    keep = []       # ctypes arrays llama.cpp reads while loading
    if rpc and not vocab_only:
        devs = ggml.rpc_devices(rpc) + ggml.local_gpus()
        keep.append(ggml.device_array(devs))
        mp.devices = ctypes.cast(keep[-1], ctypes.c_void_p).value
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
    with _log_lock:
        _log_lines.clear()
    model = L.llama_model_load_from_file(os.fsencode(path), mp)
    if not model:
        detail = _recent_errors()
        raise ModelLoadError(f"llama.cpp could not load {path}" + (f": {detail}" if detail else ""))
    return model


@contextlib.contextmanager
def llama_cpp_python_repack(cpu_repack: bool):
    """While active, llama_cpp.Llama loads models with CPU weight repacking on
    or off (its constructor has no argument for it: it starts from
    llama_model_default_params(), which this wraps).  The bench runs
    llama-cpp-python beside edgespec with the same setting (see load_model)."""
    import llama_cpp.llama_cpp as C

    orig = C.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = bool(cpu_repack)
        return p

    C.llama_model_default_params = params
    try:
        yield
    finally:
        C.llama_model_default_params = orig


def gpu_offload_available() -> bool:
    """Whether this llama-cpp-python build can offload layers to a GPU (CUDA,
    Metal, Vulkan...); a CPU-only build would silently ignore n_gpu_layers."""
    _init_backend(_log_verbose)
    # llama_supports_gpu_offload() is also true for a CPU-only build with RPC
    return bool(ggml.local_gpus()) if ggml.backend_names() else bool(L.llama_supports_gpu_offload())


def free_model(model_ptr) -> None:
    """Free a model loaded with load_model (a vocab-only one too)."""
    L.llama_model_free(model_ptr)


def llama_cpp_version() -> str:
    return L.__version__


def model_metadata(model_ptr, key: str) -> str | None:
    buf = ctypes.create_string_buffer(1 << 16)
    n = L.llama_model_meta_val_str(model_ptr, key.encode(), buf, len(buf))
    if n < 0:
        return None
    return buf.value.decode("utf-8", errors="replace")


def auto_cache_type_k(exact: bool, n_threads: int) -> str:
    """The K cache type of cache_type_k "auto": q8_0 where exactness needs it
    (see LlamaBackend: f16 takes the split-KV path with several threads);
    one thread never takes that path: llama.cpp's default, f16."""
    return "q8_0" if (exact and n_threads > 1) else "f16"


class LlamaBackend:
    """A loaded GGUF model with one context sized for tree verification.

    max_nodes: the most tokens one verification batch may hold (root + drafts).
    max_leaves: the most root-to-leaf paths one tree may have (KV sequences);
        None: as many as a tree of max_nodes can have (max_nodes - 1), within
        llama.cpp's limit.
    """

    def __init__(self, model_path: str, *, n_ctx: int = 4096, n_gpu_layers: int = 0,
                 n_threads: int | None = None, n_batch: int = 512, max_nodes: int = 64,
                 max_leaves: int | None = 32, exact: bool = True, cache_type_k: str | None = None,
                 cpu_repack: bool = False, flash_attn: bool | None = None, tiled_mm: str = "0",
                 verbose: bool = False, rpc: list[str] | None = None, tensor_split: list[float] | None = None,
                 load_progress=None):
        if max_leaves is None:
            max_leaves = max(1, min(max_nodes - 1, L.llama_max_parallel_sequences()))
        if max_leaves > L.llama_max_parallel_sequences():
            raise ConfigError(f"max_leaves must be <= {L.llama_max_parallel_sequences()}")
        if n_ctx < MIN_CTX:
            raise ConfigError(f"the context size (--ctx, n_ctx) must be at least {MIN_CTX} tokens, not {n_ctx}: "
                              f"llama.cpp's KV cache holds a multiple of {MIN_CTX} cells")
        if n_gpu_layers and not rpc and not gpu_offload_available():
            raise ConfigError(f"GPU offload (--n-gpu-layers, n_gpu_layers={n_gpu_layers}) was asked for, but this "
                              "llama-cpp-python was built without a GPU backend: reinstall it with "
                              "CMAKE_ARGS=\"-DGGML_CUDA=on\" (see the README's GPU section), or leave "
                              "--n-gpu-layers out to run on the CPU")
        self.model_path = model_path
        self.n_gpu_layers = n_gpu_layers
        self.n_threads = n_threads or default_threads()
        self.max_nodes = max_nodes
        self.max_leaves = max_leaves
        self.n_batch = max(n_batch, max_nodes)
        self.rpc = list(rpc or [])
        self.tensor_split = list(tensor_split or [])
        # over RPC the workers' CPUs run the layers: exact as asked, and the
        # self-check (costmodel.check_exactness) says whether it holds there
        self.exact = exact and (n_gpu_layers == 0 or bool(self.rpc))
        if cache_type_k in (None, "auto"):
            cache_type_k = auto_cache_type_k(self.exact, self.n_threads)
        if cache_type_k not in CACHE_TYPES_K:
            raise ConfigError(f"cache_type_k must be one of {', '.join(CACHE_TYPES_K)} (or auto), not {cache_type_k!r}")
        self.cache_type_k = cache_type_k
        self.cpu_repack = bool(cpu_repack)
        self.model = load_model(model_path, n_gpu_layers, verbose=verbose, cpu_repack=self.cpu_repack,
                                tiled_mm=tiled_mm, rpc=self.rpc, tensor_split=self.tensor_split,
                                load_progress=load_progress)
        self.vocab = Vocab(self.model)
        self.n_vocab = self.vocab.n_vocab

        cp = L.llama_context_default_params()
        cp.n_ctx = int(n_ctx)
        cp.n_batch = self.n_batch
        cp.n_ubatch = self.n_batch
        cp.n_seq_max = max(1, max_leaves)
        # outputs per ubatch: a tree needs max_nodes, a prefill that ranks every
        # prompt position (prefill(topk_out=...)) a whole chunk.  llama.cpp grows
        # its output buffer only when a batch asks for that many rows.
        cp.n_outputs_max = self.n_batch
        cp.n_outputs_max_per_seq = 0
        cp.n_threads = self.n_threads
        cp.n_threads_batch = self.n_threads
        cp.kv_unified = True
        cp.type_k = CACHE_TYPES_K[cache_type_k]
        # flash attention: llama.cpp's "auto" (None) turns it on here, and
        # exactness needs it: without it a batch's attention products (KQ, KQV)
        # run other kernels than a one-token decode's and the logits differ
        # (every batch size, tests/test_models_exact.py); it costs
        # one-token decodes time at long contexts (BENCHMARKS, "What does
        # exactness cost?").  False is for measuring that (tools/kernel_cost.py).
        if flash_attn is not None:
            cp.flash_attn_type = 1 if flash_attn else 0
        self.flash_attn = flash_attn
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            self.model = None
            raise BackendError(f"llama.cpp could not create a context (n_ctx={n_ctx}): {_recent_errors()}")
        self.n_ctx = int(L.llama_n_ctx(self.ctx))
        # llama.cpp caps the batch at the context it was asked for (n_ctx may be
        # rounded up); feed it no more than that, or it aborts the process
        self.n_batch = int(L.llama_n_batch(self.ctx))
        if self.n_batch < max_nodes:
            self.max_nodes = max_nodes = self.n_batch
        self.mem = L.llama_get_memory(self.ctx)

        # One batch, owned by numpy.  seq_id rows are one contiguous matrix.
        nb, S = max(self.n_batch, max_nodes), max(1, max_leaves)
        self._tok = np.zeros(nb, np.int32)
        self._pos = np.zeros(nb, np.int32)
        self._nseq = np.ones(nb, np.int32)
        self._seq = np.zeros((nb, S), np.int32)
        self._logits = np.zeros(nb, np.int8)
        self._seq_rows = (ctypes.POINTER(L.llama_seq_id) * nb)(
            *[self._seq[i].ctypes.data_as(ctypes.POINTER(L.llama_seq_id)) for i in range(nb)])
        self._batch = L.llama_batch()
        self._batch.token = self._tok.ctypes.data_as(ctypes.POINTER(L.llama_token))
        self._batch.embd = ctypes.POINTER(ctypes.c_float)()
        self._batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(L.llama_pos))
        self._batch.n_seq_id = self._nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._batch.seq_id = ctypes.cast(self._seq_rows, ctypes.POINTER(ctypes.POINTER(L.llama_seq_id)))
        self._batch.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._arange_s = np.arange(S, dtype=np.int32)
        self._synced = 1                       # seqs 0.._synced-1 equal seq 0
        self._dirty = np.zeros(S, np.bool_)    # seq has cells but is not in sync
        self._step_lc = np.ones(1, np.int32)   # seqs through each slot of the last batch
        self._n_leaves = 1
        # Exactness on CPU (measured, llama.cpp in llama-cpp-python 0.3.36): a
        # one-token decode over >= 512 KV cells with more than one thread and an
        # f16 K cache takes ggml's split-KV flash-attention path, which sums
        # attention in another order than a multi-token batch does, so batched
        # verification would not be bit-identical to plain decoding (logits
        # differ by up to ~1.0).  That path is taken only for f16/f32 caches:
        # with a q8_0 K cache (the default on CPU) one-token decodes and batches
        # run the same kernel and are bit-identical with every thread.  With an
        # f16 K cache and `exact`, one-token decodes use one thread once more
        # than 256 cells are in use (below that the KV view is 256 cells and the
        # split path is not taken); batches always use every thread.  Batches
        # of 64 or more tokens take a tiled kernel that differs too, hence
        # EXACT_MAX_BATCH.
        # one-token decodes after this many cells use one thread (exact, f16 K)
        self.one_thread_after = SPLIT_KV_FREE_CELLS if (self.exact and cache_type_k == "f16") else None
        self._single_threads = self.n_threads
        self.n_past = 0           # committed tokens in seq 0
        self.kv_tokens = np.zeros(0, np.int32)  # their ids (kept by the engine)
        self.n_outputs = 0        # rows of logits from the last decode
        self._out_off = 0         # first of them in llama.cpp's output buffer
        self._logits_addr = None
        self._logits_view = None
        self.n_embd = int(L.llama_model_n_embd(self.model))
        self.hidden_on = False    # set_hidden(True): llama.cpp also outputs hidden states
        self._hidden_addr = None
        self._hidden_view = None

    # ------------------------------------------------------------------ basics
    def close(self) -> None:
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    def metadata(self, key: str) -> str | None:
        return model_metadata(self.model, key)

    def chat_template(self) -> str | None:
        return self.vocab.chat_template()

    def _decode(self, n: int) -> None:
        self._batch.n_tokens = n
        self._out_off = 0
        rc = L.llama_decode(self.ctx, self._batch)
        if rc != 0:
            if rc == 1:
                raise BackendError("llama_decode: no KV cache slot for the batch (context full?)")
            if rc == 2:
                raise BackendError("llama_decode aborted")
            raise BackendError(f"llama_decode failed with code {rc}: {_recent_errors()}")

    # -------------------------------------------------------------- KV / decode
    def reset(self) -> None:
        L.llama_memory_clear(self.mem, True)
        self._synced, self._n_leaves = 1, 1
        self._dirty[:] = False
        if self.exact and self._single_threads != self.n_threads:
            self.set_single_threads(self.n_threads)
        self.n_past = 0
        self.kv_tokens = np.zeros(0, np.int32)

    def set_single_threads(self, n: int) -> None:
        """Threads for one-token decodes (batches keep every thread).  In exact
        mode decode_tree chooses them itself; with exact=False they stay as set
        (tools/kcache_numerics.py compares thread counts this way)."""
        L.llama_set_n_threads(self.ctx, n, self.n_threads)
        self._single_threads = n

    def truncate(self, n: int) -> None:
        """Forget committed tokens from position n on (used for chat prefix reuse)."""
        if n < self.n_past:
            L.llama_memory_seq_rm(self.mem, -1, n, -1)
            self.n_past = n
            self.kv_tokens = self.kv_tokens[:n]

    def prefill(self, tokens: np.ndarray, want_last_logits: bool = True,
                topk_out: tuple[np.ndarray, np.ndarray] | None = None, cancel=None,
                hidden_out: np.ndarray | None = None) -> None:
        """Decode tokens after the committed prefix, in chunks of n_batch, into seq 0;
        logits only at the very last token.

        cancel: a callable checked before every chunk after the first; when it
        returns True the prefill stops there (n_past tells how far it got, and
        the KV cache holds exactly those tokens).

        topk_out: (ids int32 [len(tokens), K], logits float32 [len(tokens), K]):
        also rank the model's K most likely next tokens after every one of these
        tokens (AASD).  Each chunk then asks llama.cpp for the logits of all its
        rows, which costs the output layer once per token (measured on the
        2-core machine with SmolLM2-135M: a 512-token chunk 2.28 s instead of
        1.97 s) and a 512-row logits buffer; the chunks stay the same, so the
        KV cache and the last position's logits are those of a plain prefill.

        hidden_out: float32 [len(tokens), n_embd]: also copy the model's final
        hidden state at every one of these tokens (needs set_hidden(True));
        like topk_out it makes every row of a chunk an output row."""
        tokens = np.asarray(tokens, dtype=np.int32)
        every_row = topk_out is not None or hidden_out is not None
        if hidden_out is not None and not self.hidden_on:
            raise ValueError("prefill(hidden_out=...) needs set_hidden(True)")
        n = len(tokens)
        if topk_out is not None:
            from edgespec.kernels.topk import topk_rows
            ids, vals = topk_out
            rows = np.arange(self.n_batch, dtype=np.int64)
        if n:          # cells go to seq 0 only: the other synced seqs fall behind
            self._dirty[1:self._synced] = True
            self._synced = 1
        if self.n_past + n > self.n_ctx:
            raise BackendError(f"{self.n_past + n} tokens do not fit the context of {self.n_ctx}")
        i = 0
        while i < n:
            if i and cancel is not None and cancel():
                self.n_outputs = 0
                return
            m = min(self.n_batch, n - i)
            self._tok[:m] = tokens[i:i + m]
            self._pos[:m] = np.arange(self.n_past, self.n_past + m, dtype=np.int32)
            self._nseq[:m] = 1
            self._seq[:m, 0] = 0
            self._logits[:m] = 1 if every_row else 0
            if want_last_logits and i + m == n:
                self._logits[m - 1] = 1
            self._decode(m)
            if topk_out is not None:
                self.n_outputs = m
                lg = self.logits()
                topk_rows(lg, rows, m, ids.shape[1], ids[i:i + m])
                vals[i:i + m] = np.take_along_axis(lg, ids[i:i + m].astype(np.int64), axis=1)
            if hidden_out is not None:
                self.n_outputs = m
                hidden_out[i:i + m] = self.hidden()
            self.n_past += m
            i += m
        self.n_outputs = 1 if (want_last_logits and n) else 0
        if every_row and n:
            # logits() shows the last token's row alone, as after a plain prefill
            self._out_off = m - 1

    def decode_tree(self, tokens: np.ndarray, depth: np.ndarray, leaf_first: np.ndarray,
                    leaf_count: np.ndarray, n_leaves: int) -> None:
        """Decode one verification batch after the committed prefix.

        tokens[i], depth[i] (root = slot 0 at depth 0), and the sequences of slot i
        are leaf_first[i] .. leaf_first[i]+leaf_count[i]-1.  Logits are requested
        at every slot; read them with logits().
        """
        n = len(tokens)
        if n > self.max_nodes:
            raise ValueError(f"tree of {n} nodes exceeds max_nodes={self.max_nodes}")
        if n_leaves > self.max_leaves:
            raise ValueError(f"tree of {n_leaves} leaves exceeds max_leaves={self.max_leaves}")
        if self.n_past + n > self.n_ctx:
            raise BackendError("verification batch does not fit the context")
        if self.exact:
            if n > EXACT_MAX_BATCH:
                raise ValueError(f"exact mode verifies at most {EXACT_MAX_BATCH} tokens per batch")
            lim = self.one_thread_after
            want = self.n_threads if (n > 1 or lim is None or self.n_past + 1 <= lim) else 1
            if want != self._single_threads:
                self.set_single_threads(want)
        e = self._synced - n_leaves
        if e > 0:
            # seqs already in sync ride along the leftmost path (the nodes whose
            # first leaf is 0), so they stay in sync when that chain is kept
            left = leaf_first == 0
            leaf_count = leaf_count + e * left
            leaf_first = leaf_first + e * ~left
            n_leaves += e
        for s in range(self._synced, n_leaves):
            if self._dirty[s]:
                L.llama_memory_seq_rm(self.mem, s, -1, -1)
                self._dirty[s] = False
            L.llama_memory_seq_cp(self.mem, 0, s, -1, -1)
        self._tok[:n] = tokens
        self._pos[:n] = self.n_past + depth
        self._nseq[:n] = leaf_count
        self._seq[:n] = leaf_first[:, None] + self._arange_s[None, :]
        self._logits[:n] = 1
        self._synced = self._n_leaves = n_leaves
        self._step_lc = leaf_count
        self._decode(n)
        self.n_outputs = n

    def logits(self) -> np.ndarray:
        """float32 view [n_outputs, n_vocab] of the last decode's logits (no copy;
        valid until the next decode)."""
        ptr = L.llama_get_logits(self.ctx)
        addr = ctypes.cast(ptr, ctypes.c_void_p).value
        if addr != self._logits_addr:   # the output buffer moved: rebuild the view
            buf = (ctypes.c_float * (self.n_batch * self.n_vocab)).from_address(addr)
            self._logits_view = np.frombuffer(buf, dtype=np.float32).reshape(self.n_batch, self.n_vocab)
            self._logits_addr = addr
        return self._logits_view[self._out_off:self._out_off + self.n_outputs]

    def set_hidden(self, on: bool) -> None:
        """Ask llama.cpp for the final hidden state (the input of the output
        layer) of every output row as well (llama_set_embeddings; the logits
        are unchanged, measured bit-identical).  Read them with hidden()."""
        on = bool(on)
        if on != self.hidden_on:
            L.llama_set_embeddings(self.ctx, on)
            self.hidden_on = on

    def hidden(self) -> np.ndarray:
        """float32 view [n_outputs, n_embd] of the last decode's hidden states
        (no copy; valid until the next decode); needs set_hidden(True)."""
        if not self.hidden_on:
            raise BackendError("hidden() needs set_hidden(True) before the decode")
        ptr = L.llama_get_embeddings(self.ctx)
        addr = ctypes.cast(ptr, ctypes.c_void_p).value
        if not addr:
            raise BackendError("llama.cpp returned no hidden states")
        if addr != self._hidden_addr:   # the output buffer moved: rebuild the view
            buf = (ctypes.c_float * (self.n_batch * self.n_embd)).from_address(addr)
            self._hidden_view = np.frombuffer(buf, dtype=np.float32).reshape(self.n_batch, self.n_embd)
            self._hidden_addr = addr
        return self._hidden_view[self._out_off:self._out_off + self.n_outputs]

    def keep(self, k: int) -> None:
        """After decode_tree: commit the first k slots (a seq-0 chain from the root)
        and free every other cell of the step."""
        base = self.n_past
        L.llama_memory_seq_rm(self.mem, -1, base + k, -1)
        through = int(self._step_lc[k - 1]) if k > 0 else self._n_leaves   # seqs 0..through-1 pass slot k-1
        for s in range(through, self._n_leaves):              # seqs that left the chain earlier
            L.llama_memory_seq_rm(self.mem, s, -1, -1)
        self._synced = through
        self._n_leaves = 1
        self.n_past = base + k

    def rollback(self) -> None:
        """Drop every cell beyond the committed prefix, in every sequence (used when
        a step is interrupted)."""
        L.llama_memory_seq_rm(self.mem, -1, self.n_past, -1)
        # the batch's seqs now hold only committed cells, but which of them got
        # seq_cp before an interruption is unknown: treat all as behind
        self._dirty[1:] = True
        self._synced = self._n_leaves = 1
