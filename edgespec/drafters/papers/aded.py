"""ADED as published: the `trigram` drafter's published form (``trigram+aded``).

Liu et al., "Adaptive Draft-Verification for Efficient Large Language Model
Decoding".  Three parts, each from the paper's own text:

* the LLM representative, a tri-gram matrix P(w3 | w1, w2) = C(w1, w2, w3) /
  C(w1, w2) (Eq. 1) over the corpora, without the tri-grams counted fewer than
  t times (the "threshold for the elimination of tri-gram probability", t = 12);
* Adjust3Gram (Algorithm 2): every tri-gram of the last ``maxLength`` tokens
  raised by ``increment`` up to ``maxProb`` (added with value ``increment``
  when the matrix lacks it), run on the input tokens before each search;
* the draft maker, Monte Carlo tree search (Algorithm 1) with the PUCT score
  of Eqs. (2)-(3), c1 = 32, c2 = 8, s = 150 iterations, search depth l = 4,
  a rollout sampled from the matrix, a path scored 1 + the sum of its
  tri-gram values, and the n = 24 best sentences drafted as one tree.

The kernels are ``edgespec.kernels.aded``; edgespec's own variant is
``edgespec.drafters.trigram`` (the default `trigram`), which imports this
module only with ``aded`` or a ``min_count`` (t) above 1.
"""
from __future__ import annotations

import numpy as np

from edgespec.drafters.tree import SOURCE_TRIGRAM, DraftTree
from edgespec.kernels import aded as _k

ADJUST_SLOTS = 16
"""Successors per context the adjusted table holds (edgespec's bound: the
paper's matrix is unbounded)."""


def drop_rare_trigrams(tables: dict, t: int) -> dict:
    """The tri-gram tables without the successors counted fewer than ``t``
    times; contexts left with none are dropped.  ``tri_ctx_count`` keeps the
    context's full count (Eq. 1's C(w1, w2)).  The bi-gram tables are kept."""
    if t <= 1:
        return tables
    cnt = np.asarray(tables["tri_count"])
    offs = np.asarray(tables["tri_offsets"], np.int64)
    keep = cnt >= t
    cs = np.concatenate(([0], np.cumsum(keep, dtype=np.int64)))
    kept_per_row = cs[offs[1:]] - cs[offs[:-1]]
    rows = kept_per_row > 0
    w1 = np.repeat(np.arange(len(tables["tri_w1_offsets"]) - 1),
                   np.diff(np.asarray(tables["tri_w1_offsets"], np.int64)))
    new_offs = np.zeros(int(rows.sum()) + 1, np.int64)
    np.cumsum(kept_per_row[rows], out=new_offs[1:])
    w1_kept = np.bincount(w1[rows], minlength=len(tables["tri_w1_offsets"]) - 1)
    w1_offs = np.zeros(len(tables["tri_w1_offsets"]), np.int64)
    np.cumsum(w1_kept, out=w1_offs[1:])
    out = dict(tables)
    out.update(
        tri_w1_offsets=w1_offs.astype(np.int32), tri_w2=np.asarray(tables["tri_w2"])[rows],
        tri_ctx_count=np.asarray(tables["tri_ctx_count"])[rows], tri_offsets=new_offs.astype(np.int32),
        tri_next=np.asarray(tables["tri_next"])[keep], tri_count=cnt[keep])
    return out


def _adjusted_table(h: int):
    return (np.full(h, -1, np.int64), np.full((h, ADJUST_SLOTS), -1, np.int32),
            np.zeros((h, ADJUST_SLOTS), np.float64), np.zeros(1, np.int64))


class AdedSearch:
    """The matrix (corpus bundle already thresholded), its adjustments and the
    search, for one TrigramDrafter; ``config`` is its TrigramConfig."""

    def __init__(self, corpus, n_vocab: int, config):
        self.corpus = corpus
        self.n_vocab = int(n_vocab)
        self.config = c = config
        self.adj = _adjusted_table(self._size_for(0))
        self._search = (c.iterations, c.max_depth, c.candidates, c.c1, c.c2, c.sequences,
                        int(c.rollout), c.seed)
        row_len = np.diff(corpus[3])
        n_scratch = (int(row_len.max()) if len(row_len) else 0) + ADJUST_SLOTS
        cap = 1 + c.iterations * c.candidates
        self._nodes = (np.zeros(cap, np.int32), np.zeros(cap, np.int32), np.zeros(cap, np.int32),
                       np.zeros(cap, np.int32), np.zeros(cap, np.float64), np.zeros(cap, np.float64),
                       np.zeros(cap, np.int32))
        self._cand = (np.zeros(c.candidates, np.int32), np.zeros(c.candidates, np.float64),
                      np.zeros(n_scratch, np.int32), np.zeros(n_scratch, np.float64))
        self._state = (np.zeros(c.max_depth + 1, np.int32), np.zeros(c.max_depth + 1, np.float64))
        self._rng = np.zeros(1, np.uint64)
        self._stats = np.zeros(2, np.int64)
        self._sel = (np.zeros(c.sequences, np.int32), np.zeros(c.sequences, np.float64))
        self._new_index = np.zeros(cap, np.int32)
        self._out = (np.zeros(c.max_nodes, np.int32), np.zeros(c.max_nodes, np.int32),
                     np.zeros(c.max_nodes, np.float32), np.zeros(c.max_nodes + 1, np.float64))
        self._source = np.full(c.max_nodes, SOURCE_TRIGRAM, np.int8)

    def _size_for(self, keys: int) -> int:
        """A power of two holding ``keys`` plus one call's tri-grams at load <= 1/2."""
        h = 64
        while h < 2 * (keys + self.config.adjust_length):
            h *= 2
        return h

    def propose(self, w1: int, w2: int, max_out: int) -> DraftTree:
        tok, par, p, group = self._out
        m = _k.aded_draft(self.corpus, self.adj, self.n_vocab, w1, w2, self._search, self._nodes,
                          self._cand, self._state, self._rng, self._stats, max_out, tok, par, p, self._sel[0],
                          self._sel[1], self._new_index, group)
        if m == 0:
            return DraftTree.empty()
        return DraftTree(tok[:m].copy(), par[:m].copy(), p[:m].copy(), self._source[:m].copy())

    def adjust(self, tokens: np.ndarray) -> None:
        """Adjust3Gram over the last ``adjust_length`` of ``tokens`` (no-op with
        ``adjust`` off)."""
        c = self.config
        if not c.adjust or len(tokens) < 3:
            return
        h = self._size_for(int(self.adj[3][0]))
        if h > self.adj[0].shape[0]:
            grown = _adjusted_table(h)
            _k.adjust_grow(self.adj, grown)
            self.adj = grown
        t = np.ascontiguousarray(tokens[-c.adjust_length:], dtype=np.int32)
        _k.adjust3gram(self.corpus, self.adj, t, len(t), c.adjust_length, c.adjust_increment,
                       c.adjust_max_prob, self.n_vocab)

    def reset(self) -> None:
        self.adj = _adjusted_table(self._size_for(0))

    def warmup(self) -> None:
        """Compile every kernel with this instance's argument types, on a
        scratch adjusted table (the real one is left untouched)."""
        c = self.config
        toks = np.array([1, 2, 3, 1, 2, 3, 1, 2, 4, 1], np.int32) % self.n_vocab
        adj = _adjusted_table(self._size_for(0))
        _k.adjust3gram(self.corpus, adj, toks, len(toks), c.adjust_length, c.adjust_increment,
                       c.adjust_max_prob, self.n_vocab)
        _k.adjust_grow(adj, _adjusted_table(2 * adj[0].shape[0]))
        real, self.adj = self.adj, adj
        try:
            self.propose(int(toks[-2]), int(toks[-1]), c.max_nodes)
        finally:
            self.adj = real

    def distribution(self, w1: int, w2: int, k: int) -> dict[int, float]:
        """The matrix's k largest entries after (w1, w2), as {token: value}."""
        out_tok = np.zeros(max(k, 1), np.int32)
        out_p = np.zeros(max(k, 1), np.float64)
        s_tok, s_p = self._cand[2], self._cand[3]
        m = _k.matrix_successors(self.corpus, self.adj, int(w1), int(w2), self.n_vocab, k, out_tok, out_p,
                                 np.zeros_like(s_tok), np.zeros_like(s_p))
        return {int(t): float(p) for t, p in zip(out_tok[:m], out_p[:m])}

    def search_tree(self) -> dict:
        """The last search's tree (tests, debugging): token, parent, visits and
        accumulated score of each node (node 0 the root), and the iterations run."""
        m = int(self._stats[0])
        tok, par, _, _, prior, score, visits = self._nodes
        return dict(tok=tok[:m].copy(), par=par[:m].copy(), prior=prior[:m].copy(),
                    visits=visits[:m].copy(), score=score[:m].copy(), iterations=int(self._stats[1]))

    def adjusted(self) -> dict:
        """What Adjust3Gram wrote: {(w1, w2): {w3: value}}."""
        V = self.n_vocab
        a_key, a_tok, a_p, _ = self.adj
        return {(int(k) // V, int(k) % V): {int(t): float(p) for t, p in zip(a_tok[i], a_p[i]) if t >= 0}
                for i, k in ((i, a_key[i]) for i in np.flatnonzero(a_key >= 0))}
