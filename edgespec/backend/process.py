"""llama.cpp as a process-wide library: what holds once per process, not per model.

The installed llama-cpp-python's version (checked against the tested range on
import) and build (its ggml backends), llama.cpp's log (one callback, a ring
of recent lines that error messages quote, an optional log file), the kernel
settings edgespec chooses for exactness (GGML_CPU_TILED_MM, which llama.cpp
reads once per process; the K cache type's rule, which backend/settings.py's
Loadout.resolve applies with --kernels fast/exact), its one
backend start, and the CPU topology that sets the default thread count.  Every
model and context (backend/llama.py) shares these.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import threading

import llama_cpp as L

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


def llama_cpp_version() -> str:
    return L.__version__


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


def gpu_offload_available() -> bool:
    """Whether this llama-cpp-python build can offload layers to a GPU (CUDA,
    Metal, Vulkan...); a CPU-only build would silently ignore n_gpu_layers."""
    init_backend(_log_verbose)
    # llama_supports_gpu_offload() is also true for a CPU-only build with RPC
    return bool(ggml.local_gpus()) if ggml.backend_names() else bool(L.llama_supports_gpu_offload())


# ---------------------------------------------------------------- llama.cpp's log
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


def clear_recent_log() -> None:
    """Forget the log lines seen so far, so that recent_errors() quotes only
    what llama.cpp says from here on (e.g. while loading one model)."""
    with _log_lock:
        _log_lines.clear()


def recent_errors() -> str:
    """The last few error lines of llama.cpp's log (else its last lines), for
    the message of an error llama.cpp reported only by a return code."""
    with _log_lock:
        lines = [s.strip() for s in _log_lines[-40:] if s.strip()]
    errs = [s for s in lines if "error" in s.lower() or "failed" in s.lower() or "invalid" in s.lower()]
    return "; ".join((errs or lines)[-3:])


# ------------------------------------------------------- kernels and backend start
_backend_ready = False

# llama.cpp's CPU backend multiplies K-quant weights (Q2_K..Q6_K) by a batch of
# 8 or more rows with a tiled kernel that accumulates in integers per block and
# scales once, where the one-row kernel (vec_dot) scales every block in float:
# the sums round differently, so such batches are not bit-identical to
# one-token decoding (BENCHMARKS.md, "Is the output exact?").  The kernel has a
# process-wide switch, the environment variable GGML_CPU_TILED_MM, read once at
# the first matrix product; edgespec turns it off (before llama.cpp computes
# anything) unless the environment already sets it.  What was there before
# edgespec set it:
TILED_MM_ENV = "GGML_CPU_TILED_MM"
USER_TILED_MM = os.environ.get(TILED_MM_ENV)


def tiled_mm_setting() -> str:
    """The GGML_CPU_TILED_MM value llama.cpp sees in this process ("0" = off;
    unset = llama.cpp's default, on)."""
    return os.environ.get(TILED_MM_ENV, "default")


# K-cache types (ggml type ids).  llama.cpp's default is f16; edgespec's default on
# CPU is q8_0: with exact kernels its one-token decodes never take the split-KV
# path (see LlamaBackend._init_state), so every decode can use every thread and
# stay exact; with fast kernels (flash attention off) the prompt's K x Q product
# runs the 8-bit dot kernel instead of the f16 one (docs/exactness.md).
CACHE_TYPES_K = {"f16": 1, "q8_0": 8}


def auto_cache_type_k(exact: bool, n_threads: int, fast_cpu: bool = False) -> str:
    """The K cache type of cache_type_k "auto": q8_0 where exactness needs it
    (see LlamaBackend: f16 takes the split-KV path with several threads) and
    for fast kernels on a CPU (fast_cpu: flash attention off, no layer
    offloaded), whose prefill it makes faster at the same decode speed;
    otherwise (one thread with exact kernels, a GPU) llama.cpp's default, f16.
    With flash attention on, q8_0 would make the prefill slower (its tiled
    attention kernel is f16-only), so exact kernels on one thread keep f16."""
    return "q8_0" if (exact and n_threads > 1) or fast_cpu else "f16"


def init_backend(verbose: bool = False, tiled_mm: str = "0") -> None:
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


# ------------------------------------------------------------------ CPU topology
def default_threads(sysfs: str = "/sys/devices/system/cpu") -> int:
    """Threads for generation: one per physical core the process may run on.

    Two hardware threads of one core (SMT, "hyper-threading") share its
    arithmetic units, and a llama.cpp decode synchronises all its threads after
    every operation, so llama.cpp's own tools default to the physical cores and
    llama-cpp-python to half the logical CPUs for one-token decodes; a default
    of every logical CPU would risk making plain decoding slower than what users
    already run.  On Linux the cores are read from sysfs (hardware threads that
    list the same siblings are one core; only CPUs in the affinity mask count);
    on macOS from ``sysctl hw.perflevel0.physicalcpu`` (performance cores) or
    ``hw.physicalcpu``; elsewhere, or when that fails, every logical CPU."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS/Windows
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
