"""The `auto` drafter's `rerank` mechanism: AdaPLD's hidden-state rerank.

The lexical anchors (suffix matches) are ordered by the cosine of the model's
hidden states (llama.cpp's own) where it predicted the matched token and
where it predicted the root; the ``rerank_top`` most similar are kept.  It
runs as the suffix and AdaPLD parts' ``anchor_hook``.

One concern: the unit hidden states by context position, kept valid across
requests for the shared prefix, and the reordering they drive.
"""
from __future__ import annotations

import numpy as np


class HiddenRerank:
    """Unit hidden states by context position, and the anchor hook that reads them."""

    def __init__(self, config):
        self.config = config
        self._H = np.zeros((0, 0), np.float32)
        self._H_known = np.zeros(0, np.bool_)
        self._H_ctx = np.zeros(0, np.int32)

    def begin(self, prompt: np.ndarray) -> None:
        """Hidden states stay valid for the prefix shared with the last context."""
        m = min(len(prompt), len(self._H_ctx))
        neq = np.nonzero(self._H_ctx[:m] != prompt[:m])[0]
        self._H_known[int(neq[0]) if len(neq) else m:] = False
        self._H_ctx = np.asarray(prompt, np.int32)

    def observe(self, result) -> None:
        """Store the hidden states of the step's committed positions."""
        if result.hidden.ndim == 2 and len(result.hidden):
            self._H_ctx = result.context
            self.store(len(result.context) - len(result.accepted) - 1, result.hidden)

    def store(self, start: int, hidden: np.ndarray) -> None:
        """Normalised rows of `hidden` at context positions start.."""
        r, d = hidden.shape
        if r == 0:
            return
        if self._H.shape[1] != d or len(self._H) < start + r:
            cap = max(start + r, 2 * len(self._H), 1024)
            H = np.zeros((cap, d), np.float32)
            known = np.zeros(cap, np.bool_)
            if self._H.shape[1] == d:
                H[:len(self._H)] = self._H
                known[:len(self._H_known)] = self._H_known
            self._H, self._H_known = H, known
        self._H[start:start + r] = hidden / (np.linalg.norm(hidden, axis=1, keepdims=True) + 1e-9)
        self._H_known[start:start + r] = True

    def rerank(self, ctx, n: int, ends, lens, k: int) -> int:
        """AdaPLD's rerank: order the lexical anchors by the cosine of the
        model's hidden state where it predicted the matched token (position
        e - 1 for an occurrence ending at e) and where it predicted the root
        (position n - 2); keep the rerank_top most similar.  Without the
        hidden states (a replay without them) the order stays."""
        q = n - 2
        H, known = self._H, self._H_known
        if q < 0 or q >= len(known) or not known[q]:
            return k
        e = ends[:k].astype(np.int64) - 1
        ok = (e >= 0) & (e < len(known))
        ok[ok] = known[e[ok]]
        sims = np.full(k, -2.0)
        sims[ok] = H[e[ok]] @ H[q]
        order = np.argsort(-sims, kind="stable")[:self.config.rerank_top]
        j = len(order)
        ends[:j], lens[:j] = ends[:k][order].copy(), lens[:k][order].copy()
        return j
