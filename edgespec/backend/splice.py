"""Splicing the committed sequence's cells: the backend half of the inexact cache reuse (core/cache_reuse.py).

LlamaBackend.splice(n_prefix, cache_start, n_chunk, inserted) turns the
committed cells of C = A + Y + B + R into those of A + X + B: A's cells
(positions 0..n_prefix-1) stay, Y's and R's are dropped, B's (n_chunk cells
from cache_start) move to positions n_prefix + len(X) on
(llama_memory_seq_add: llama.cpp rotates their keys by the shift, through
f32 for a quantized K cache, before the next decode), and X is decoded at
positions n_prefix.. between them.  llama.cpp requires a sequence's new
tokens to follow its last position, and B already stands there in seq 0, so
X is decoded in seq 1, which holds A's cells and nothing else (causal: X
sees A and itself, never B), and then tagged into seq 0.  Afterwards seq 0
holds positions 0..n_past-1 with no hole, as everywhere else in the backend,
the other seqs hold nothing, and `spliced_from` is the first position whose
cell is not what a plain prefill of kv_tokens computes (None: every cell
is).  Nothing exact reads a spliced cell: the engine cuts the cache there
before an exact request (core/engine.py), the prompt cache saves no spliced
cache (core/prefix_cache.py), and reset / truncate below it / restore_state
clear the mark.
"""
from __future__ import annotations

from typing import Any, Callable

import llama_cpp as L
import numpy as np

from edgespec.errors import BackendError

SPLICE_SEQ = 1      # the sequence X is decoded in (it holds A's cells meanwhile)


class Splicer:
    """The splice half of LlamaBackend (a mixin over its context, batch and KV bookkeeping)."""

    mem: Any
    n_past: int
    n_ctx: int
    n_batch: int
    n_outputs: int
    max_leaves: int
    kv_tokens: np.ndarray
    spliced_from: int | None
    _synced: int
    _dirty: np.ndarray
    _n_leaves: int
    _tok: np.ndarray
    _pos: np.ndarray
    _nseq: np.ndarray
    _seq: np.ndarray
    _logits: np.ndarray
    reset: Callable[[], None]
    _decode: Callable[[int], None]

    def splice_refusal(self) -> str | None:
        """Why this backend cannot splice (None: it can)."""
        if getattr(self, "n_slots", 1) > 1:       # slots shift sequence ids and tombstone cells: not built together
            return "cache reuse by shifting runs with one request at a time (not with --parallel > 1)"
        if self.max_leaves < SPLICE_SEQ + 1:
            return "splicing decodes in a second KV sequence: load the model with max_leaves >= 2"
        if not L.llama_memory_can_shift(self.mem):
            return "this model's KV cache cannot shift positions (llama_memory_can_shift)"
        return None

    def seq_positions(self, seq: int = 0) -> tuple[int, int]:
        """(first, last) position of a sequence's cells; (-1, -1) when it has none (for checks)."""
        return int(L.llama_memory_seq_pos_min(self.mem, seq)), int(L.llama_memory_seq_pos_max(self.mem, seq))

    def splice(self, n_prefix: int, cache_start: int, n_chunk: int, inserted: np.ndarray) -> None:
        """Keep the cells of positions 0..n_prefix-1, move the n_chunk cells
        from cache_start to n_prefix + len(inserted), decode `inserted`
        between them, drop every other cell (see the module's doc); kv_tokens
        becomes A + inserted + B.  Any failure empties the cache (reset) and
        raises."""
        a, c0, x = int(n_prefix), int(cache_start), np.asarray(inserted, np.int32)
        if not (0 <= a <= c0 and n_chunk >= 1 and c0 + n_chunk <= self.n_past
                and a + len(x) + n_chunk < self.n_ctx):
            raise ValueError(f"splice({a}, {c0}, {n_chunk}, {len(x)} tokens) does not fit {self.n_past} cells")
        why = self.splice_refusal()
        if why is not None:
            raise BackendError(why)
        chunk = self.kv_tokens[c0:c0 + n_chunk].copy()
        before = self.spliced_from
        try:
            self._clear_other_seqs()
            L.llama_memory_seq_rm(self.mem, 0, c0 + n_chunk, -1)
            L.llama_memory_seq_rm(self.mem, 0, a, c0)
            if a + len(x) != c0:
                L.llama_memory_seq_add(self.mem, 0, c0, c0 + n_chunk, a + len(x) - c0)
            self._decode_between(a, x)
        except BaseException:
            self.reset()
            raise
        self.n_past, self.n_outputs = a + len(x) + n_chunk, 0
        self.kv_tokens = np.concatenate([self.kv_tokens[:a], x, chunk]).astype(np.int32)
        # X's cells are exact where A's are; B's never are
        self.spliced_from = before if before is not None and before < a else a + len(x)

    def _clear_other_seqs(self) -> None:
        """Empty every sequence but 0 (the synced ones hold seq 0's cells, the dirty ones old cells)."""
        for s in range(1, len(self._dirty)):
            if s < self._synced or self._dirty[s]:
                L.llama_memory_seq_rm(self.mem, s, -1, -1)
        self._dirty[:] = False
        self._synced = self._n_leaves = 1

    def _decode_between(self, a: int, x: np.ndarray) -> None:
        """Decode x at positions a.. in SPLICE_SEQ over A's cells, then tag its cells into seq 0."""
        if not len(x):
            return
        s = SPLICE_SEQ
        if a:
            L.llama_memory_seq_cp(self.mem, 0, s, 0, a)
        for i in range(0, len(x), self.n_batch):
            m = min(self.n_batch, len(x) - i)
            self._tok[:m] = x[i:i + m]
            self._pos[:m] = np.arange(a + i, a + i + m, dtype=np.int32)
            self._nseq[:m] = 1
            self._seq[:m, 0] = s
            self._logits[:m] = 0
            self._decode(m)
        L.llama_memory_seq_cp(self.mem, s, 0, a, a + len(x))
        L.llama_memory_seq_rm(self.mem, s, -1, -1)
