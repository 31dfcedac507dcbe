"""The calibration cache: where it lives, the key a measurement is filed
under (a loaded backend's: its identity, backend/identity.py, with its
threads; the kernel price's, before a model loads: the model file by content,
the machine and the llama.cpp build), and reading, writing and locking its entries.

The cost curve, the exactness verdict and the kernel choice all keep their
measurements here, one JSON file per key and kind; a file is written whole or
not at all, and one process measures a key while the others wait for it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
import warnings

from edgespec.backend.identity import cpu_name, identity, model_fingerprint
from edgespec.paths import cache_dir

CALIBRATION_VERSION = 6
log = logging.getLogger("edgespec.calibration")


class CalibrationCacheWarning(UserWarning):
    """The calibration cache could not be read or written: the measurement is
    used (or redone) in this process only."""


class CalibrationStopped(Exception):
    """A background measurement was stopped (the model is closing, or a
    synchronous calibration takes over)."""


def calibration_key(model_path: str, n_gpu_layers: int, n_threads: int, extra: str = "") -> str:
    """The key of a measurement made before a backend loads (the kernel price):
    the model file by content, the placement, threads and machine."""
    from edgespec.backend.process import llama_cpp_version

    parts = [model_fingerprint(model_path),
             f"ngl={n_gpu_layers}", f"threads={n_threads}", platform.machine(), cpu_name(),
             str(os.cpu_count()), llama_cpp_version(), f"v{CALIBRATION_VERSION}", extra]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def backend_key(backend) -> str:
    """The key of a loaded backend's calibration (c(T), the exactness
    verdict): its identity (backend/identity.py: everything that changes its
    numbers, the prompt disk's key hashes the same) and what changes only the
    time: the threads, the CPU count, where the output layer runs over RPC."""
    be = backend
    parts = [identity(be), f"threads={be.n_threads}", f"cpus={os.cpu_count()}",
             f"out={be.rpc_output if be.rpc else ''}", f"v{CALIBRATION_VERSION}"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def curve_path(key: str) -> str:
    """The cache file of the cost curve under `key`; its lock file guards
    every entry of the key."""
    return os.path.join(cache_dir(), "calibration", key + ".json")


def read_cached(path: str, parse, warn: bool):
    """parse(the JSON in path), or None when the file is missing; a file that
    cannot be read or parsed (NaN included) is None too, with a warning."""
    try:
        with open(path) as f:
            return parse(json.load(f))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        if warn:
            warnings.warn(f"ignoring the calibration cache file {path}, which is unreadable or malformed ({e}); "
                          "measuring again", CalibrationCacheWarning, stacklevel=3)
        return None


@contextlib.contextmanager
def cache_lock(path: str, pacer=None):
    """Hold the exclusive lock of a cache entry (fcntl.flock on path + ".lock",
    beside it; the lock file stays).  Another process, or another model in
    this one, that measures the same entry waits here (polling, so that a
    pacer's stopped() ends the wait).  Without fcntl (Windows), or where the
    lock file cannot be created (a read-only cache, where nothing can be
    cached either), it runs unlocked."""
    try:
        import fcntl
    except ImportError:          # pragma: no cover - Windows
        fcntl = None
    fd = None
    if fcntl is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            fd = None
    if fd is None:
        yield
        return
    try:
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    log.warning("waiting for another edgespec process that is calibrating this model "
                                "(lock %s); its result is used", path + ".lock")
                    said = True
                if pacer is not None and pacer.stopped():
                    raise CalibrationStopped() from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)             # releases the lock


def write_cache(path: str, obj) -> bool:
    """Write a cache entry whole or not at all; a failure (a read-only or full
    cache folder) is a CalibrationCacheWarning and leaves no temporary file."""
    try:
        _write_json_atomic(path, obj)
        return True
    except (OSError, ValueError) as e:
        warnings.warn(f"could not write the calibration cache {path} ({e}); the measurement is used by this "
                      "process only (EDGESPEC_CACHE_DIR chooses another folder)", CalibrationCacheWarning,
                      stacklevel=3)
        return False


def _write_json_atomic(path: str, obj) -> None:
    """A temporary file beside path, then a rename; no NaN or infinity."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
