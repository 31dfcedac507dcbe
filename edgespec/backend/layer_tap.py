"""One transformer block's output, read out of llama.cpp's graph while
llama_decode runs: the hidden states at a middle layer that AdaPLD's anchor
choice compares (llama.h hands out only the last one, llama_get_embeddings).

llama.cpp names the output of block il (0-based) "l_out-<il>" and, when a
context is created with an eval callback (llama_context_params.cb_eval), its
scheduler asks the callback about every graph node (ask = true) and, for a
node it wants, computes the graph up to that node, synchronises, and calls
it again with the computed tensor (ask = false), whose rows are copied out
with ggml_backend_tensor_get (host or device memory alike).  The graph is
cut there into two computations of the same nodes with the same kernels, so
the logits stay bit-identical (tests/test_papers_adapld.py checks it).

The callback is a numba C function, so no Python runs per graph node (a
graph has tens of nodes per layer, and each is asked about); it reads the
tensor's name and shape straight from its ggml_tensor struct, at the offsets
of a ctypes mirror of ggml.h's struct below (a layout it does not match
finds no tensor of that name, and hidden() says so).  Its state is a small
int64 array per context (the user data): whether to capture, the name
wanted, the destination buffer and the rows written so far.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

import llama_cpp as L

from edgespec.errors import BackendError

GGML_TYPE_F32 = 0
ON, NAME0, NAME1, MASK1, DST, CAP, ROWS, EMBD = range(8)     # the control block's fields


class _GgmlTensor(ctypes.Structure):
    """struct ggml_tensor of ggml.h, for the field offsets (GGML_MAX_DIMS 4,
    GGML_MAX_OP_PARAMS 64 bytes, GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


_NE = _GgmlTensor.ne.offset // 8
_NB = _GgmlTensor.nb.offset // 8
_NAME = _GgmlTensor.name.offset // 8
_WORDS = _NAME + 2
_callback = None


def _make_callback():
    """The eval callback, compiled once per process; None where this build of
    ggml does not export ggml_backend_tensor_get."""
    from numba import carray, cfunc, types
    lib_dir = os.path.join(os.path.dirname(L.__file__), "lib")
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        try:
            lib = ctypes.CDLL(os.path.join(lib_dir, name))
            addr = ctypes.cast(lib.ggml_backend_tensor_get, ctypes.c_void_p).value
            break
        except (OSError, AttributeError):
            continue
    else:
        return None
    assert addr is not None         # a symbol dlsym finds has an address (a missing one raised AttributeError)
    # the destination pointer passed as an integer (the same register in the C ABI)
    get = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t)(addr)

    @cfunc(types.boolean(types.voidptr, types.boolean, types.voidptr))    # a C callback is always nopython
    def tap(t, ask, user_data):
        ctl = carray(user_data, (8,), np.int64)
        if ctl[ON] == 0:
            return False
        w = carray(t, (_WORDS,), np.int64)
        if ask:
            return w[_NAME] == ctl[NAME0] and (w[_NAME + 1] & ctl[MASK1]) == ctl[NAME1]
        ne0, ne1, r = w[_NE], w[_NE + 1], ctl[ROWS]
        # only a contiguous f32 [n_embd, rows] tensor is copied; hidden() reports a shortfall
        if (w[0] & 0xFFFFFFFF) == GGML_TYPE_F32 and ne0 == ctl[EMBD] and w[_NB] == 4 and w[_NB + 1] == 4 * ne0:
            k = min(ne1, ctl[CAP] - r)
            if k > 0:
                get(t, ctl[DST] + r * ne0 * 4, 0, k * ne0 * 4)
                ctl[ROWS] = r + k
        return True

    return tap, get


class LayerTap:
    """The output rows of one block, captured during each decode.

    ``LayerTap(n_embd, rows)``; ``callback`` and ``user_data`` go into the
    context's parameters; ``set_block(b)`` (1-based: block b's output is
    "l_out-<b-1>") or ``set_block(None)`` (off); ``reset()`` before each
    decode; ``rows()`` the rows captured since."""

    def __init__(self, n_embd: int, rows: int):
        global _callback
        if _callback is None:
            _callback = _make_callback()
        if _callback is None:
            raise OSError("ggml_backend_tensor_get is not exported by this llama-cpp-python's ggml")
        self.callback = ctypes.cast(_callback[0].address, L.ggml_backend_sched_eval_callback)
        self._ctl = np.zeros(8, np.int64)
        self._buf = np.zeros((rows, n_embd), np.float32)
        self._ctl[DST], self._ctl[CAP], self._ctl[EMBD] = self._buf.ctypes.data, rows, n_embd
        self.user_data = self._ctl.ctypes.data
        self.block: int | None = None

    def set_block(self, block: int | None) -> None:
        self.block = block
        self._ctl[ON] = 0 if block is None else 1
        if block is not None:
            name = f"l_out-{block - 1}".encode() + b"\0"
            if len(name) > 16:
                raise ValueError(f"layer {block}: name too long for the tap")
            b = name.ljust(16, b"\0")
            self._ctl[NAME0], self._ctl[NAME1] = np.frombuffer(b, np.int64)
            self._ctl[MASK1] = np.frombuffer(bytes(0xFF if i < len(name) - 8 else 0 for i in range(8)), np.int64)[0]

    def reset(self) -> None:
        self._ctl[ROWS] = 0

    def rows(self, start: int, n: int) -> np.ndarray:
        """float32 view [n, n_embd] of rows start.. of those the last decode
        captured."""
        if int(self._ctl[ROWS]) < start + n:
            raise BackendError(f"llama.cpp's graph gave no f32 output of block {self.block}")
        return self._buf[start:start + n]


def tap_block(model, layer: int) -> int | None:
    """The block (1-based) whose output `layer` asks for: layer itself, or
    for 0 round(13/40 of the depth), AdaPLD's layer 13 of Vicuna-13B's 40
    (the paper's other models use other fractions and give no rule; this
    is edgespec's default).  None for the last block or beyond: that one is
    llama.cpp's own output (llama_set_embeddings, after the final norm)."""
    n_layer = int(L.llama_model_n_layer(model))
    block = int(layer) or max(1, round(n_layer * 13 / 40))
    return block if block < n_layer else None


def attach_tap(be) -> bool:
    """Give a LlamaBackend its LayerTap: the eval callback is a parameter of
    the context, so the context is made again with it and the committed
    tokens (be.kv_tokens) are decoded again into its KV cache.  Returns
    False: the new context outputs no final hidden states."""
    be._tap = LayerTap(be.n_embd, be.n_batch)
    kept = be.kv_tokens[:be.n_past].copy()
    L.llama_free(be.ctx)
    be._create_context(be.n_ctx, be.flash_attn)
    be._init_state()
    be.prefill(kept, want_last_logits=False)
    be.kv_tokens = kept
    return False
