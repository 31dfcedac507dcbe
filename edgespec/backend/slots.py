"""Several requests in one llama.cpp context: a LlamaBackend's slots (issue 62, docs/scheduler.md).

A LlamaBackend loaded with n_slots > 1 holds that many requests at once in
one context of n_slots * n_ctx cells.  Slot k owns the KV sequences
k*S .. k*S+S-1 (S = max_leaves): its committed prefix in k*S, its tree
paths after it, with the bookkeeping a lone backend keeps (backend/llama.py),
every seq id shifted by the slot's `seq0`.  Slot 0 is the LlamaBackend
itself; slot k > 0 is a shallow copy of it (`LlamaBackend.slot(k)`) that
shares the model, the context, the one batch and these Cells, and has its
own n_past, kv_tokens and sync state.  Each slot reads the logits of its own
last decode.  Stepped by the Cells' Broker (backend/batching.py), the slots'
decodes of one round go into one llama_decode; stepped one after another
(outside a Broker.run), each decodes on its own.

Exactness (docs/scheduler.md, "Exactness", measured with
tools/shared_context.py): a row's logits do not depend on other sequences'
cells or on where its own cells sit, but CPU flash attention visits a
sequence's cells in cell order, and llama.cpp's slot search refills the
lowest holes once the tail was freed: a cell freed below a neighbour's
cells, reused by that neighbour's next token, puts its cells out of position
order and changes its logits.  So with slots no cell is ever freed between
compactions: what a lone backend removes (rejected drafts, a truncated or
reset prefix, a rolled-back step) is moved into the tombstone sequence
(`tomb`, the last id), which no batch row attends.  Before every decode
`reserve` counts the cells it takes (an upper bound on the occupied ones);
when the next decode might not fit, `compact` saves every slot's committed
prefix, clears the cache and restores them, each contiguous and in position
order (measured exact), tombstones gone.

A request may start from another slot's cells (`borrow`): where a
neighbour's committed tokens share a longer prefix with the prompt than
anything this slot holds (an app's title, tags and follow-up requests embed
the same conversation), llama_memory_seq_cp lets this slot's sequence share
those cells (no new cell, nothing decoded).  They are the cells a prefill of
the same tokens would have made, in position order, so the answer is the one
this slot would have given by reading them itself.
"""
from __future__ import annotations

import copy
import ctypes
from typing import Any

import llama_cpp as L
import numpy as np

from edgespec.backend.batching import Broker
from edgespec.errors import BackendError, ConfigError


SLOT_PREFILL_CHUNK = 128    # in a Broker's run, a slot's prompt is read this many tokens per round


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit`."""
    m = max(0, min(len(a), len(b), limit))
    neq = np.nonzero(a[:m] != b[:m])[0]
    return int(neq[0]) if len(neq) else m


def seqs_needed(n_slots: int, max_leaves: int) -> int:
    """KV sequences a context of n_slots slots needs: one per tree path per slot, and the tombstone."""
    return max(1, max_leaves) if n_slots == 1 else n_slots * max(1, max_leaves) + 1


def check_slots(n_slots: int, max_leaves: int) -> None:
    """Refuse a slot count llama.cpp cannot hold (ConfigError)."""
    if n_slots < 1:
        raise ConfigError(f"the number of parallel requests (--parallel) must be at least 1, not {n_slots}")
    limit = int(L.llama_max_parallel_sequences())
    if seqs_needed(n_slots, max_leaves) > limit:
        raise ConfigError(f"{n_slots} parallel requests of up to {max_leaves} tree paths need "
                          f"{seqs_needed(n_slots, max_leaves)} KV sequences; llama.cpp holds {limit} "
                          "(lower --parallel or --max-nodes)")


class Cells:
    """The KV cells a backend's slots share (see the module doc)."""

    def __init__(self, backend, n_slots: int, capacity: int):
        """capacity: the rows the Broker may combine into one decode."""
        self.per_slot = max(1, backend.max_leaves)
        self.tomb = n_slots * self.per_slot
        self.used = 0           # cells occupied at most (tombstones included) since the last compaction
        self.compactions = 0
        self.borrowed = 0       # prompt tokens requests took from other slots' cells (borrow)
        self.size = backend.n_cells
        self.views = [backend]
        for k in range(1, n_slots):
            v = copy.copy(backend)
            v._owner = False            # only slot 0 frees the context
            v.seq0 = k * self.per_slot
            v._init_seq_state()
            self.views.append(v)
        for v in self.views:
            v._cells = self
        self.broker = Broker(self, capacity)

    def room(self, view, n: int, solo: bool = False, rows: bool = True) -> int:
        """Before view lays n rows into the batch (rows False: restores n cells): their cells reserved;
        the batch row they start at (0 unless the Broker gathers the slots' rows; solo: decoded alone)."""
        if self.broker.driving():
            return self.broker.claim(view, n, solo, rows)
        self.reserve(n)
        return 0

    def batched(self) -> bool:
        """Whether this thread's decodes go through the Broker (a Broker.run's job)."""
        return self.broker.driving()

    def chunk(self, n_batch: int) -> int:
        """The prompt tokens a view's prefill decodes at once: SLOT_PREFILL_CHUNK in a Broker's run."""
        return min(n_batch, SLOT_PREFILL_CHUNK) if self.batched() else n_batch

    def between_chunks(self, view, read: np.ndarray) -> None:
        """Between two prompt chunks of view's prefill (`read`: its tokens decoded so far): in a Broker's
        run, they become its committed tokens (a neighbour may borrow them while it waits) and it parks
        until the next round (the other slots step, a request may be admitted: app/scheduler.py)."""
        if self.batched():
            view.kv_tokens = np.concatenate([view.kv_tokens[:view.n_past - len(read)], read])
            self.broker.park(view)

    def best_prefix(self, prompt: np.ndarray, limit: int, other_than=None) -> tuple[int, Any]:
        """The longest prefix of prompt (at most limit tokens) some slot's committed cells hold, and that
        slot's view (0, None where none shares a token)."""
        best, src = 0, None
        for v in self.views:
            if v is other_than or not v.n_past:
                continue
            # kv_tokens may lag n_past while a request decodes (the engine lays it down at its end)
            n = common_prefix(v.kv_tokens[:v.n_past], prompt, limit)
            if n > best:
                best, src = n, v
        return best, src

    def borrow(self, view, prompt: np.ndarray, have: int, min_gain: int) -> int:
        """Before view's request reads prompt, holding its first `have` tokens: where another slot holds
        at least min_gain more of them, view drops its own cells and shares that slot's instead (the
        module doc).  The prefix view now holds."""
        n, src = self.best_prefix(prompt, len(prompt) - 1, other_than=view)
        if src is None or n < have + min_gain:
            return have
        view.reset()
        L.llama_memory_seq_cp(view.mem, src.seq0, view.seq0, 0, n)
        view.n_past, view.kv_tokens = n, np.array(prompt[:n], np.int32)
        self.borrowed += n
        return n

    def free(self, mem, seqs, p0: int) -> None:
        """Take sequences `seqs`' cells from position p0 on out of them, into the tombstone."""
        for s in seqs:
            L.llama_memory_seq_cp(mem, s, self.tomb, p0, -1)
            L.llama_memory_seq_rm(mem, s, p0, -1)

    def reserve(self, n: int) -> None:
        """Before a decode of n cells: compact first when they might not fit."""
        if self.used + n > self.size:
            self.compact()
        if self.used + n > self.size:
            raise BackendError(f"the KV cache is full: the slots' {self.used} committed tokens and "
                               f"{n} more do not fit its {self.size} cells")
        self.used += n

    def compact(self) -> None:
        """Every slot's committed prefix saved, the cache cleared, each prefix restored (module doc)."""
        saved = [(v, _seq_bytes(v)) for v in self.views]
        self.compactions += 1
        be = self.views[0]
        L.llama_memory_clear(be.mem, True)
        self.used = 0
        for v, buf in saved:
            v._synced, v._n_leaves = 1, 1
            v._dirty[:] = False
            if v.n_past and int(L.llama_state_seq_set_data(
                    v.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), buf.nbytes, v.seq0)) == 0:
                raise BackendError(f"llama.cpp could not restore slot {v.seq0 // self.per_slot}'s KV cells")
            self.used += v.n_past


def _seq_bytes(v) -> np.ndarray:
    """Slot view v's committed cells (sequence v.seq0) as llama.cpp's per-sequence state."""
    if not v.n_past:
        return np.zeros(0, np.uint8)
    size = int(L.llama_state_seq_get_size(v.ctx, v.seq0))
    buf = np.empty(size, np.uint8)
    n = int(L.llama_state_seq_get_data(v.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, v.seq0))
    if n == 0:
        raise BackendError("llama.cpp could not save a slot's KV cells")
    return buf[:n]
