"""Semantic fallback anchoring, edgespec's pair variant (`semantic_pair` in
`auto`): when the end of the context occurs nowhere earlier, anchor on a
*similar* earlier pair of tokens instead and copy what followed it.  AdaPLD's
published fallback (single tokens at raw cosine 0.1, a branch of the model's
own choices and successor drafts, never a copy) is drafters/papers/adapld.py.

Lexical retrieval needs an exact repeat of at least two tokens.  When there is
none, this part looks for an earlier position whose last two tokens are close
to the context's last two in the model's own input-embedding space (cosine of
centred embeddings, edgespec.drafters.embeddings; " The quick" ~ " the rapid") and
proposes what followed there.  Only tokens that occur in the context are ever
compared: the part keeps their embeddings in one growing matrix, so a step
costs one (distinct tokens x dim) product, in a numba loop rather than BLAS
(OpenBLAS threads spin after a call and slow llama.cpp's next decode), and one
scan of the context.

Its nodes carry SOURCE_SEMANTIC: the engine calibrates them apart from exact
retrieval, and in ``auto`` the schedule idles the part when it does not pay.
"""
from __future__ import annotations

import numpy as np

from edgespec.kernels import anchor as _a
from edgespec.kernels import suffix as _k
from edgespec.drafters.tree import SOURCE_SEMANTIC, DraftTree
from edgespec.drafters.base import Drafter
from edgespec.drafters.embeddings import SeenTokens

SEMANTIC_MIN_SIM = 0.6     # both tokens of an anchor at least this similar
SEMANTIC_ANCHORS = 4
SEMANTIC_DEPTH = 6


class SemanticDrafter(Drafter):
    """Continuations of embedding-similar anchors, when no exact match exists."""

    name = "semantic"
    sources = (SOURCE_SEMANTIC,)
    retrieves = True

    def __init__(self, embeddings, max_nodes: int = 64, min_sim: float = SEMANTIC_MIN_SIM):
        self.emb = embeddings
        self.min_sim = float(min_sim)
        nv = int(embeddings.n_vocab)
        # similarity of every seen token to the context's last / previous token
        self._s_last = np.full(nv, -1.0, np.float32)
        self._s_prev = np.full(nv, -1.0, np.float32)
        self._q = (-1, 0)            # (last token, seen count) of the last call
        self._seen = SeenTokens(embeddings)      # the distinct tokens seen so far, their rows
        self._scanned = 0            # context positions already added
        self._ends = np.zeros(SEMANTIC_ANCHORS, np.int32)
        self._score = np.zeros(SEMANTIC_ANCHORS, np.float32)
        self._lens = np.full(SEMANTIC_ANCHORS, 2, np.int32)
        self._m = np.zeros(2, np.int32)
        self._out = (np.zeros(max_nodes, np.int32), np.zeros(max_nodes, np.int32),
                     np.zeros(max_nodes, np.float32), np.zeros(max_nodes, np.int32))
        self._src = np.full(max_nodes, SOURCE_SEMANTIC, np.int8)

    def warmup(self) -> None:
        _a.warmup()
        _k.warmup()

    def begin(self, prompt: np.ndarray) -> None:
        self._scanned = 0           # seen tokens stay (their vectors do not change)
        self._q = (-1, 0)

    def similarities(self, ctx: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(sim to ctx[n-1], sim to ctx[n-2]) of every token seen so far, as
        float32 [n_vocab] arrays indexed by token (entries of unseen tokens
        hold stale values below any threshold that matters: -1 or an older
        similarity of a token not in ctx[:n]); n >= 2."""
        if self._scanned > n:
            self._scanned = 0
        self._seen.add(ctx[self._scanned:n])
        self._scanned = n
        seen = self._seen
        u, vecs, ids, slot = seen.n, seen.vecs, seen.ids, seen.slot
        last, prev = int(ctx[n - 1]), int(ctx[n - 2])
        if prev == self._q[0]:
            # the last token of the previous call is now the one before: its
            # similarities are known for the tokens seen then (a step that
            # accepted no draft, the usual case where this part is asked)
            self._s_last, self._s_prev = self._s_prev, self._s_last
            if self._q[1] < u:
                _a.scatter_sims(vecs, ids, self._q[1], u, vecs[slot[prev]], self._s_prev)
        else:
            _a.scatter_sims(vecs, ids, 0, u, vecs[slot[prev]], self._s_prev)
        _a.scatter_sims(vecs, ids, 0, u, vecs[slot[last]], self._s_last)
        self._q = (last, u)
        return self._s_last, self._s_prev

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        n = len(context)
        cap = min(int(budget), len(self._src))
        if cap <= 0 or n < 4:
            return DraftTree.empty()
        ctx = np.ascontiguousarray(context, dtype=np.int32)
        if _k.find_suffix_matches(ctx, n, 2, 2, 1, self._m, self._m[1:]):
            return DraftTree.empty()        # an exact match exists: retrieval's case
        s_last, s_prev = self.similarities(ctx, n)
        k = _a.soft_anchors(ctx, n, s_last, s_prev, self.min_sim, SEMANTIC_ANCHORS,
                            self._ends, self._score)
        if k == 0:
            return DraftTree.empty()
        t, par, pr, mlen = self._out
        m = _k.build_continuation_tree(ctx, n, self._ends, self._lens, k, SEMANTIC_DEPTH, cap,
                                       t, par, pr, mlen)
        if m == 0:
            return DraftTree.empty()
        pr[:m][par[:m] == -1] *= float(self._score[0])
        return DraftTree.raw(t[:m].copy(), par[:m].copy(), pr[:m].copy(), self._src[:m].copy())
