"""AdaPLD as published (Liu et al., "AdaPLD: Adaptive Retrieval and Reuse for
Efficient Model-Free Speculative Decoding", §3): `branch`, `semantic` and
`rerank` in `auto`, one proposal around one selected anchor per step.

* **lexical anchors** (Eq. 3): the earlier positions of the context's last
  token, a single token.
* **semantic fallback** (Eqs. 4-5, `semantic`): only when the last token
  never occurred before with a following token, the positions whose token's
  embedding has cosine >= tau (0.1) to the last token's (the model's own
  input embeddings, raw, not centred).
* **one anchor j*** (Eqs. 6-7, `rerank`): the candidate whose preceding
  context's hidden state is closest (cosine) to the last token's preceding
  context's, at one layer of the model (drafters/papers/rerank.py holds
  the states; the backend reads that layer).  Without `rerank` the most recent
  candidate (edgespec's choice).
* from j*: the **main copy** ctx[j*+1 .. j*+copy_len] (Eqs. 8-9, lexical
  anchors only; copy_len 30 in the paper), the **branches** (Eqs. 10-12,
  `branch`): the model's top K (8) after reading ctx[:j*+1] minus the copied
  token (the whole top K after a semantic anchor), and under each branch
  token b one **successor** (Eqs. 13-15): the token that followed b's
  earlier occurrence chosen, among b's own lexical-first/semantic candidates,
  by the cosine of the hidden state before it to the one at j*.

The rankings at every position are the ones the model gave when it read it
(prompt positions: from the prefill; generated ones: from the verification
logits), so nothing is computed per step beyond them.

edgespec's earlier variants stay beside these under their own names:
`branch_depth` (drafters/branch.py) and `semantic_pair` (drafters/semantic.py).
"""
from __future__ import annotations

import numpy as np

from edgespec.kernels import anchor as _a
from edgespec.drafters.tree import SOURCE_BRANCH, SOURCE_CONTEXT, SOURCE_SEMANTIC, DraftTree
from edgespec.drafters.branch import BranchDrafter
from edgespec.drafters.embeddings import SeenTokens
from edgespec.drafters.papers.rerank import HiddenStates

ADAPLD_K = 8               # branch width: the model's top 8 after the anchor
ADAPLD_SUCCESSOR = 1       # one successor token per branch
ADAPLD_TAU = 0.1           # semantic fallback: cosine threshold of token embeddings
ADAPLD_COPY = 30           # the paper's maximum copy length
_NO_SIMS = np.zeros(0, np.float32)


class TokenCosines:
    """Cosine of the model's raw input embeddings (Eq. 4) between a query
    token and every token seen in the context, as a float32 [n_vocab] array
    indexed by token (entries of tokens not in the context are stale).  Only
    tokens that occur are ever read: their unit rows are kept in one growing
    matrix."""

    def __init__(self, embeddings):
        self.emb = embeddings
        nv = int(embeddings.n_vocab)
        self._sims = np.full(nv, -1.0, np.float32)
        self._seen = SeenTokens(embeddings, centred=False)
        self._scanned = 0

    def begin(self) -> None:
        self._scanned = 0        # seen tokens stay (their vectors do not change)

    def of(self, ctx: np.ndarray, n: int, tok: int) -> np.ndarray:
        """Cosines to `tok` of every token of ctx[:n]."""
        if self._scanned > n:
            self._scanned = 0
        self._seen.add(ctx[self._scanned:n])
        self._scanned = n
        seen = self._seen
        s = int(seen.slot[tok]) if 0 <= tok < len(seen.slot) else -1
        q = seen.vecs[s] if s >= 0 else self.emb.rows([tok], centred=False)[0]
        _a.scatter_sims(seen.vecs, seen.ids, 0, seen.n, q, self._sims)
        return self._sims


class AdaPLDDrafter(BranchDrafter):
    """AdaPLD's tree around one anchor per step (module docstring).

    ``AdaPLDDrafter(branch=True, embeddings=None, rerank=False, hidden=None,
    k=8, successor_len=1, tau=0.1, copy_len=30, max_nodes=64)``:
    ``branch`` adds the branches and successors after a lexical anchor;
    ``embeddings`` (a TokenEmbeddings) turns on the semantic fallback, for
    the anchor and for successors; ``rerank`` chooses anchors by the hidden
    states, read from ``hidden`` (a HiddenStates someone else feeds, as
    `auto` does) or, when None, from a store this drafter feeds itself
    (``wants_hidden``).  The main copy is drafted after a lexical anchor when
    ``branch`` or ``rerank`` is on (with the semantic fallback alone, lexical
    anchors are left to the suffix part)."""

    name = "adapld"
    # its copy path is SOURCE_CONTEXT too, which the schedule credits to suffix (always on)
    sources = (SOURCE_BRANCH, SOURCE_SEMANTIC)
    retrieves = True
    hidden_layer = 0        # the block whose hidden states `rerank` compares (0: the backend's middle one)

    def __init__(self, branch: bool = True, embeddings=None, rerank: bool = False, hidden: HiddenStates | None = None,
                 k: int = ADAPLD_K, successor_len: int = ADAPLD_SUCCESSOR, tau: float = ADAPLD_TAU,
                 copy_len: int = ADAPLD_COPY, max_nodes: int = 64):
        # the rankings of every position: prompt ones from the prefill, generated ones from the steps
        super().__init__(aasd=False, aasd_all=True, branch=True, max_nodes=max_nodes, k=k)
        self.lexical = bool(branch)
        self.cosines = TokenCosines(embeddings) if embeddings is not None else None
        self.copy = self.lexical or bool(rerank)
        if not (self.copy or self.cosines):
            raise ValueError("AdaPLDDrafter: enable branch drafting or the rerank, or give embeddings for the "
                             "semantic fallback")
        if not (self.lexical or self.cosines):      # the copy alone reads no rankings
            self.prefill_topk = self.topk = 0
        self.successor_len = int(successor_len)
        self.tau = float(tau)
        self.copy_len = int(copy_len)
        self._own_hidden = bool(rerank) and hidden is None
        self.hidden = HiddenStates() if self._own_hidden else (hidden if rerank else None)
        self.wants_hidden = self._own_hidden
        self.observes = bool(self.topk) or self._own_hidden
        self._succ = np.zeros(self.k, np.int32)
        self._no_h = (np.zeros((0, 1), np.float32), np.zeros(0, np.bool_))

    def begin(self, prompt: np.ndarray) -> None:
        super().begin(prompt)
        if self.cosines is not None:
            self.cosines.begin()
        if self._own_hidden:
            self.hidden.begin(prompt)

    def observe_prefill_hidden(self, start: int, hidden: np.ndarray) -> None:
        if self._own_hidden:
            self.hidden.store(start, hidden)

    def observe(self, result) -> None:
        if self.topk:
            super().observe(result)
        if self._own_hidden:
            self.hidden.observe(result)

    def _anchor(self, ctx: np.ndarray, n: int, tok: int, H, known, q: int) -> tuple[int, bool]:
        """(position, lexical) of the anchor chosen for query token `tok`
        scored against row q: lexical candidates first, the semantic ones
        only when there are none (Eq. 5); (-1, True) when neither exists."""
        j = _a.best_anchor(ctx, n, tok, _NO_SIMS, 0.0, H, known, q)
        if j >= 0 or self.cosines is None:
            return j, True
        return _a.best_anchor(ctx, n, tok, self.cosines.of(ctx, n, tok), self.tau, H, known, q), False

    def _branches(self, ctx: np.ndarray, n: int, j: int, lexical: bool) -> tuple[np.ndarray, np.ndarray]:
        """Eqs. 10-11: the model's top K after reading ctx[:j+1] (row j of the
        rankings), minus the copied token ctx[j+1] after a lexical anchor."""
        if (lexical and not self.lexical) or j >= len(self._tok):
            return self._succ[:0], self._p[0, :0]
        tok, p = self._tok[j], self._p[j]
        keep = tok >= 0
        if lexical:
            keep &= tok != ctx[j + 1]
        return tok[keep], p[keep]

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        n = len(context)
        cap = min(int(budget), len(self._out[3]))
        if cap <= 0 or n < 2:
            return DraftTree.empty()
        ctx = np.ascontiguousarray(context, dtype=np.int32)
        H, known = self.hidden.arrays() if self.hidden is not None else self._no_h
        j, lexical = self._anchor(ctx, n, int(ctx[n - 1]), H, known, n - 2)
        if j < 0 or (lexical and not self.copy):
            return DraftTree.empty()
        self._grow(n)
        bt, bp = self._branches(ctx, n, j, lexical)
        nb = len(bt)
        succ = self._succ[:nb]
        succ[:] = -1
        if nb and self.successor_len > 0:
            _a.successor_anchors(ctx, n, bt, nb, H, known, j, succ)
            if self.cosines is not None:
                for i in np.flatnonzero(succ < 0):
                    succ[i] = self._anchor(ctx, n, int(bt[i]), H, known, j)[0]
        t, par, pr, sr = self._out
        m = _a.build_adapld_tree(ctx, n, j, self.copy_len if lexical else 0, bt, bp, nb, succ, self.successor_len,
                                 cap, t, par, pr, sr, SOURCE_CONTEXT, SOURCE_BRANCH if lexical else SOURCE_SEMANTIC)
        if m == 0:
            return DraftTree.empty()
        return DraftTree.raw(t[:m].copy(), par[:m].copy(), pr[:m].copy(), sr[:m].copy())
