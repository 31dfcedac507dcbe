"""Saving and restoring the committed sequence's KV cells (llama.cpp's per-sequence state).

LlamaBackend's save_state / restore_state (backend/protocol.py): the cells
of KV sequence 0, which holds the committed prefix, copied into a uint8 numpy
array in host memory and back.  The bytes are llama.cpp's own per-sequence
format (positions, then every layer's K and V rows, in the cache's types),
so a restored cache holds bit for bit the cells that were saved.  Restoring
clears the whole cache first, so the cells land in cells 0..n-1, where a
prefill from an empty cache would put them (the layout exactness relies on:
backend/llama.py).  With slots (backend/slots.py) the slot's own sequences
are cleared and its cells land contiguous, in position order, wherever
llama.cpp finds room: what exactness needs there.  The prefix cache of core/prefix_cache.py keeps these.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

import llama_cpp as L
import numpy as np

from edgespec.errors import BackendError


class SeqState:
    """The save_state / restore_state half of LlamaBackend (a mixin over its
    ctx, n_past, kv_tokens and reset())."""

    ctx: Any
    seq0: int               # the slot's committed sequence (backend/slots.py; 0 without slots)
    _cells: Any
    n_past: int
    kv_tokens: np.ndarray
    reset: Callable[[], None]

    def save_state(self) -> np.ndarray:
        """Sequence 0's cells (the committed prefix) as uint8 bytes."""
        size = int(L.llama_state_seq_get_size(self.ctx, self.seq0))
        buf = np.empty(size, np.uint8)
        n = int(L.llama_state_seq_get_data(self.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size,
                                           self.seq0))
        if n == 0 and self.n_past:
            raise BackendError("llama.cpp could not save the KV cache's sequence state")
        return buf[:n]

    def restore_state(self, state: np.ndarray, tokens: np.ndarray) -> None:
        """Replace the cache with a save_state() result whose tokens are `tokens`."""
        self.reset()
        state = np.ascontiguousarray(state, np.uint8)
        if len(tokens):
            if self._cells is not None:
                self._cells.room(self, len(tokens), rows=False)
            ptr = state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            if int(L.llama_state_seq_set_data(self.ctx, ptr, state.nbytes, self.seq0)) == 0:
                self.reset()
                raise BackendError("llama.cpp could not restore a saved KV sequence state")
        self.n_past = len(tokens)
        self.kv_tokens = np.array(tokens, np.int32)
