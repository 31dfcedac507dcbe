"""ggml's device registry and its RPC backend, through ctypes.

llama-cpp-python binds llama.h only; the devices a model is placed on, the RPC
client (`ggml_backend_rpc_add_server`) and the RPC worker
(`ggml_backend_rpc_start_server`) are ggml functions of the same shared
libraries.  llama-cpp-python's own `rpc_servers` argument does nothing since
the field left llama_model_params upstream: the working path is to ask ggml for
the workers' devices and pass them to llama.cpp in
`llama_model_params.devices` (a NULL-terminated array).

RPC exists only in a llama-cpp-python built with CMAKE_ARGS="-DGGML_RPC=on";
pip's wheel cache keys a built wheel by version, not by CMAKE_ARGS, so a cached
CPU-only build is silently reused: `require_rpc` checks the build itself.

llama.cpp's RPC client aborts the process (GGML_ABORT) when a worker cannot be
reached or goes away.  `rpc_devices` therefore connects to each endpoint itself
first, with a timeout, and `abort_note` installs ggml's abort callback so that
an abort says in one line which workers were in use.
"""
from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
import sys
import threading
import time

import llama_cpp as L

from edgespec.errors import BackendError, ConfigError

DEFAULT_PORT = 50052
CONNECT_TIMEOUT_S = 5.0
DEVICE_CPU, DEVICE_GPU, DEVICE_IGPU = 0, 1, 2      # enum ggml_backend_dev_type
REINSTALL = ('CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-deps --no-cache-dir '
             f'"llama-cpp-python=={L.__version__}"')

_lock = threading.Lock()
_lib = None
_devices: dict[str, list[int]] = {}     # endpoint -> its device handles (ggml keeps them for the process)
_endpoints_in_use: list[str] = []
hello_ms: dict[str, float] = {}         # endpoint -> the round trip of its last HELLO (the link's latency)


def _ggml():
    """libggml (whose dependencies, libggml-base and libggml-rpc where built,
    ctypes searches too), with the signatures used here; None if not found."""
    global _lib
    if _lib is not None:
        return _lib
    lib_dir = os.path.join(os.path.dirname(L.__file__), "lib")
    for name in ("libggml.so", "libggml.dylib", "ggml.dll"):
        try:
            g = ctypes.CDLL(os.path.join(lib_dir, name))
        except OSError:
            continue
        vp, sz, cs = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        for fn, res, args in (("ggml_backend_reg_count", sz, []), ("ggml_backend_reg_get", vp, [sz]),
                              ("ggml_backend_reg_name", cs, [vp]), ("ggml_backend_dev_count", sz, []),
                              ("ggml_backend_dev_get", vp, [sz]), ("ggml_backend_dev_type", ctypes.c_int, [vp]),
                              ("ggml_backend_dev_name", cs, [vp]), ("ggml_backend_dev_description", cs, [vp]),
                              ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]),
                              ("ggml_backend_dev_by_name", vp, [cs]), ("ggml_backend_dev_by_type", vp, [ctypes.c_int]),
                              ("ggml_backend_reg_dev_count", sz, [vp]), ("ggml_backend_reg_dev_get", vp, [vp, sz]),
                              ("ggml_backend_dev_buffer_type", vp, [vp])):
            f = getattr(g, fn)
            f.restype, f.argtypes = res, args
        if hasattr(g, "ggml_backend_rpc_add_server"):
            g.ggml_backend_rpc_add_server.restype = vp
            g.ggml_backend_rpc_add_server.argtypes = [cs]
            g.ggml_backend_rpc_start_server.restype = None
            g.ggml_backend_rpc_start_server.argtypes = [cs, cs, sz, sz, ctypes.POINTER(vp)]
        if hasattr(g, "ggml_set_abort_callback"):
            g.ggml_set_abort_callback.restype = vp
            g.ggml_set_abort_callback.argtypes = [vp]
        _lib = g
        return g
    return None


def backend_names() -> list[str]:
    """The ggml backends this llama-cpp-python build registered (CPU, CUDA, ...)."""
    g = _ggml()
    if g is None:
        return []
    return [g.ggml_backend_reg_name(g.ggml_backend_reg_get(i)).decode() for i in range(g.ggml_backend_reg_count())]


def local_gpus() -> list[int]:
    """The device handles of this machine's GPUs (discrete, else integrated)."""
    g = _ggml()
    if g is None:
        return []
    devs = [g.ggml_backend_dev_get(i) for i in range(g.ggml_backend_dev_count())]
    gpus = [d for d in devs if g.ggml_backend_dev_type(d) == DEVICE_GPU]
    return gpus or [d for d in devs if g.ggml_backend_dev_type(d) == DEVICE_IGPU]


RPC_OUTPUTS = ("local", "remote")
# the output layer's weights (tied models read theirs from token_embd), for
# llama_model_params.tensor_buft_overrides
OUTPUT_WEIGHTS = rb"^output\.(weight|bias)$|^token_embd\.weight$"


class BuftOverride(ctypes.Structure):
    """llama.h's llama_model_tensor_buft_override (tensors whose name matches
    `pattern` go to buffer type `buft`; an array ends with pattern NULL)."""
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def output_on_cpu():
    """A tensor_buft_overrides array that keeps the output layer's weights in
    this machine's RAM, so that llama.cpp computes the logits here: over
    RPC a worker holding them would send n_vocab floats back per token of a
    batch (608 KB for a 152k vocabulary), where with them here a layer's
    output of n_embd floats crosses the link."""
    g = _ggml()
    cpu = g.ggml_backend_dev_buffer_type(g.ggml_backend_dev_by_type(DEVICE_CPU))
    return (BuftOverride * 2)(BuftOverride(OUTPUT_WEIGHTS, cpu), BuftOverride(None, None))


def needs_output_override(rpc_output: str) -> bool:
    """Whether keeping the output layer here takes a tensor override: llama.cpp
    puts it on the last device, this machine's GPU when it has one, else a
    worker."""
    return rpc_output == "local" and not local_gpus()


def place_on_workers(mp, endpoints: list[str], rpc_output: str) -> list:
    """Set llama_model_params `mp` to place the model on these workers, then
    this machine's GPUs; return the ctypes arrays llama.cpp reads while it
    loads (keep them alive until then).  rpc_output "local" keeps the output
    layer here (needs_output_override)."""
    if rpc_output not in RPC_OUTPUTS:
        raise ConfigError(f"rpc_output must be one of {', '.join(RPC_OUTPUTS)}, not {rpc_output!r}")
    keep = [device_array(rpc_devices(endpoints) + local_gpus())]
    mp.devices = ctypes.cast(keep[-1], ctypes.c_void_p).value
    if needs_output_override(rpc_output):
        keep.append(output_on_cpu())
        mp.tensor_buft_overrides = ctypes.cast(keep[-1], ctypes.c_void_p).value
    return keep


def rpc_available() -> bool:
    g = _ggml()
    return bool(L.llama_supports_rpc()) and g is not None and hasattr(g, "ggml_backend_rpc_add_server")


def require_rpc() -> None:
    """Raise ConfigError naming the reinstall command unless this build has RPC."""
    if not rpc_available():
        raise ConfigError(f"this llama-cpp-python {L.__version__} was built without RPC support (llama.cpp's "
                          f"workers); reinstall it with: {REINSTALL}")


def parse_endpoints(spec) -> list[str]:
    """'HOST:PORT,HOST:PORT' (or a list of them) -> ['HOST:PORT', ...]; a
    missing port is DEFAULT_PORT."""
    items = spec.split(",") if isinstance(spec, str) else list(spec or [])
    out = []
    for item in (str(x).strip() for x in items):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"an RPC worker is HOST:PORT, not {item!r}")
        out.append(f"{host}:{int(port)}")
    if len(set(out)) != len(out):
        raise ConfigError(f"an RPC worker is named twice in {','.join(out)}")
    return out


RPC_HELLO = 14                   # the protocol's first command (fixed across versions)
RPC_CAPS = 24                    # bytes of connection capabilities in HELLO (protocol 7)
RPC_PROTO_MAJOR = 7


def probe(endpoint: str, timeout: float = CONNECT_TIMEOUT_S) -> tuple[int, int, int]:
    """Say HELLO to a worker and close again: its protocol version, or a
    BackendError naming it (unreachable, busy with another client: a worker
    serves one client at a time, or not a compatible RPC worker), where
    llama.cpp would abort the process or wait forever."""
    host, _, port = endpoint.rpartition(":")
    try:
        s = socket.create_connection((host, int(port)), timeout=timeout)
    except OSError as e:
        why = f"no answer within {timeout:g} s" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise BackendError(f"the RPC worker {endpoint} cannot be reached ({why}); start one there with "
                           "`edgespec rpc-worker` (or llama.cpp's rpc-server)") from None
    try:
        with s:
            t0 = time.perf_counter()
            s.sendall(bytes([RPC_HELLO]) + struct.pack("<Q", RPC_CAPS) + bytes(RPC_CAPS))
            (n,) = struct.unpack("<Q", _recv(s, 8))
            rsp = _recv(s, n) if 0 < n <= 256 else b""
            hello_ms[endpoint] = round((time.perf_counter() - t0) * 1e3, 3)
    except TimeoutError:
        raise BackendError(f"the RPC worker {endpoint} accepted but did not answer within {timeout:g} s (it "
                           "serves one client at a time: is another one connected?)") from None
    except OSError:
        rsp = b""
    if len(rsp) < 3:
        raise BackendError(f"{endpoint} does not answer as a llama.cpp RPC worker")
    version = (rsp[0], rsp[1], rsp[2])
    if version[0] != RPC_PROTO_MAJOR:
        raise BackendError(f"the RPC worker {endpoint} speaks protocol {'.'.join(map(str, version))}, this "
                           f"llama-cpp-python {L.__version__} speaks {RPC_PROTO_MAJOR}.x: run the same version "
                           "on both sides")
    return version


def _recv(s, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("the worker closed the connection")
        buf += chunk
    return buf


def rpc_devices(endpoints: list[str]) -> list[int]:
    """The device handles of these workers, in order (each worker may serve
    several devices); connects to each, once per process."""
    require_rpc()
    g = _ggml()
    out = []
    with _lock:
        for ep in endpoints:
            if ep not in _devices:
                probe(ep)
                abort_note(ep)
                reg = g.ggml_backend_rpc_add_server(ep.encode())
                n = g.ggml_backend_reg_dev_count(reg) if reg else 0
                if n == 0:
                    raise BackendError(f"the RPC worker {ep} offers no device")
                _devices[ep] = [g.ggml_backend_reg_dev_get(reg, i) for i in range(n)]
            out += _devices[ep]
    return out


def device_memory(dev: int) -> tuple[int, int]:
    """(free, total) bytes of a device."""
    g = _ggml()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def device_array(devs: list[int]):
    """A NULL-terminated array of device handles for llama_model_params.devices
    (the caller keeps it alive until the model has loaded)."""
    return (ctypes.c_void_p * (len(devs) + 1))(*devs, None)


@ctypes.CFUNCTYPE(None, ctypes.c_char_p)
def _on_abort(msg):  # pragma: no cover - called from C just before abort()
    text = (msg or b"").decode("utf-8", "replace").strip()
    workers = ", ".join(_endpoints_in_use)
    os.write(2, (f"edgespec: llama.cpp stopped the process: {text}"
                 + (f" (RPC workers in use: {workers}; one of them was lost or refused the request)"
                    if workers else "") + "\n").encode())


def abort_note(endpoint: str) -> None:
    """Remember an endpoint in use; the first makes ggml's abort name the workers."""
    g = _ggml()
    if not _endpoints_in_use and hasattr(g, "ggml_set_abort_callback"):
        g.ggml_set_abort_callback(ctypes.cast(_on_abort, ctypes.c_void_p))
    if endpoint not in _endpoints_in_use:
        _endpoints_in_use.append(endpoint)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def worker_device(name: str | None) -> int:
    """The local device a worker serves: by ggml name (CPU, CUDA0, ...), else
    the first GPU, else the CPU."""
    g = _ggml()
    if name:
        dev = g.ggml_backend_dev_by_name(name.encode())
        if not dev:
            names = [g.ggml_backend_dev_name(g.ggml_backend_dev_get(i)).decode()
                     for i in range(g.ggml_backend_dev_count())]
            raise ConfigError(f"no device {name!r} here; devices: {', '.join(names)}")
        return dev
    gpus = local_gpus()
    return gpus[0] if gpus else g.ggml_backend_dev_by_type(DEVICE_CPU)


def device_label(dev: int) -> str:
    g = _ggml()
    return f"{g.ggml_backend_dev_name(dev).decode()} ({g.ggml_backend_dev_description(dev).decode()})"


def serve_forever(endpoint: str, dev: int, n_threads: int, cache: str | None) -> None:
    """Serve `dev` to RPC clients on `endpoint`; returns only if the server
    cannot start (ggml says why on stderr).  Blocks in C: run it in a thread."""
    require_rpc()
    _ggml().ggml_backend_rpc_start_server(endpoint.encode(), os.fsencode(cache) if cache else None,
                                          int(n_threads), 1, device_array([dev]))
    sys.stderr.flush()
