"""Interrupting a llama_decode in progress, from another thread, within one
node of the compute graph.

llama.cpp's CPU backend asks an abort callback after every node of the
graph (thread 0); when it answers true, llama_decode returns 2 and removes
the cells of the unfinished batch (LlamaBackend then drops every cell past
the committed prefix too and raises Interrupted).  The callback here is a
numba cfunc that reads one byte: native code, so asking it costs nothing
and needs no GIL, and any thread sets the byte.  The background calibration
uses it: a request that arrives during a measurement's decode sets the flag,
instead of waiting for the decode (up to a 64-token batch) to finish.  Other
backends (CUDA, Metal) do not ask the callback: there a request waits for
the decode, which is short.
"""
from __future__ import annotations

import ctypes

import numpy as np

_CALLBACK = None       # the cfunc's ctypes pointer, built on first use (numba compiles it then)


def _callback():
    global _CALLBACK
    if _CALLBACK is None:
        import llama_cpp as L
        from numba import carray, cfunc, types

        @cfunc(types.boolean(types.voidptr), cache=True)
        def flag_is_set(data):          # data: the address of one uint8
            return carray(data, (1,), np.uint8)[0] != 0
        addr = flag_is_set.address
        assert addr is not None         # a compiled cfunc has an address
        _CALLBACK = L.ggml_abort_callback(addr)
    return _CALLBACK


def new_flag() -> np.ndarray:
    """The byte a callback reads: flag[0] = 1 interrupts, 0 lets decodes run."""
    return np.zeros(1, np.uint8)


def attach(backend, flag: np.ndarray | None) -> None:
    """Make `backend`'s decodes stop when flag[0] is set (None: never).  The
    flag must outlive the attachment: llama.cpp keeps its address."""
    import llama_cpp as L

    if flag is None:
        L.llama_set_abort_callback(backend.ctx, L.ggml_abort_callback(), None)
        backend.interrupt_flag = None
        return
    if flag.dtype != np.uint8 or flag.size != 1:
        raise ValueError("an interrupt flag is one uint8 (new_flag())")
    backend.interrupt_flag = flag      # keeps it alive while llama.cpp holds its address
    L.llama_set_abort_callback(backend.ctx, _callback(), ctypes.c_void_p(flag.ctypes.data))
