"""AdaPLD's retrieval and reuse as published: branch drafting, successor
drafting and the semantic fallback (`branch`, `successor_len`, `semantic` in
`auto`).

AdaPLD (Liu et al., 2026, "Adaptive Retrieval and Reuse for Efficient
Model-Free Speculative Decoding") keeps prompt lookup's lexical anchors and
adds, as this project's issue 19 reads the paper (its method section was not
reachable from the sessions that wrote this; the description and the
parameter values below are the issue's):

* **branch drafting**: a copied span is one hypothesis; beside it the model's
  own top K (K = 8) at the anchor's next position, minus the copied token,
  become sibling branches.  The ranking is the one the model gave when it
  read the anchor (prompt positions: from the prefill; generated ones: from
  the verification logits), so nothing extra is computed per step.
* **successor drafting**: under each branch token t, what followed t's latest
  earlier occurrence (the longest match of the context extended by t), up to
  `successor_len` tokens (the paper's length was not available: 4).
* **semantic fallback**: only when the lexical anchor set is empty, positions
  whose single token is similar to the root (cosine >= tau = 0.1 of the
  model's centred input embeddings, edgespec.drafters.embeddings) anchor a branch of
  the model's ranking there and successor drafts, never a copy of the text
  that followed.
* the copy itself (length 30 in the paper) is the suffix part's
  (`copy_len` in `auto`), and the hidden-state rerank of the lexical anchors
  is the hybrid's (`rerank`, drafters/mechanisms/rerank.py), since both act on the suffix part's anchors.

edgespec's earlier variants stay beside these under their own names:
`branch_depth` (2 alternatives at depths 1-4, drafters/branch.py) and
`semantic_pair` (token pairs at cosine 0.6, copying, drafters/semantic.py).
"""
from __future__ import annotations

import numpy as np

from edgespec.kernels import anchor as _a
from edgespec.kernels import suffix as _k
from edgespec.core.tree import SOURCE_BRANCH, SOURCE_SEMANTIC, DraftTree
from edgespec.drafters.branch import BranchDrafter
from edgespec.drafters.semantic import SemanticDrafter

ADAPLD_K = 8               # branch width: the model's top 8 at the anchor's next position
ADAPLD_SUCCESSOR = 4       # successor drafts under each branch token (edgespec's choice)
ADAPLD_TAU = 0.1           # semantic fallback: single-token cosine threshold
ADAPLD_ANCHORS = 2         # lexical anchors that get branches (the best two)
ADAPLD_SEMANTIC_ANCHORS = 1


class AdaPLDDrafter(BranchDrafter):
    """Branch and successor drafting around lexical anchors, and the semantic
    fallback when there is none.

    ``AdaPLDDrafter(branch=True, embeddings=None, k=8, successor_len=4,
    tau=0.1, max_nodes=64)``: ``branch`` drafts around lexical anchors; the
    semantic fallback runs when ``embeddings`` (a TokenEmbeddings) is given.
    ``anchor_hook(ctx, n, ends, lens, k) -> k`` (set by the hybrid's rerank, mechanisms/rerank.py)
    may reorder and cut the lexical anchors."""

    name = "adapld"

    def __init__(self, branch: bool = True, embeddings=None, k: int = ADAPLD_K,
                 successor_len: int = ADAPLD_SUCCESSOR, tau: float = ADAPLD_TAU, max_nodes: int = 64):
        # the rankings of every position: prompt ones from the prefill, generated ones from the steps
        super().__init__(aasd=False, aasd_all=True, branch=True, max_nodes=max_nodes, k=k)
        self.lexical = bool(branch)
        self.semantic = SemanticDrafter(embeddings, max_nodes=max_nodes) if embeddings is not None else None
        if not (self.lexical or self.semantic):
            raise ValueError("AdaPLDDrafter: enable branch drafting or give embeddings for the semantic fallback")
        self.successor_len = int(successor_len)
        self.tau = float(tau)
        self.anchor_hook = None
        self._buf = np.zeros(1024, np.int32)
        self._scale = np.ones(max(ADAPLD_ANCHORS, ADAPLD_SEMANTIC_ANCHORS), np.float32)
        self._one = (np.zeros(1, np.int32), np.zeros(1, np.int32))

    def warmup(self) -> None:
        super().warmup()
        if self.semantic is not None:
            self.semantic.warmup()

    def begin(self, prompt: np.ndarray) -> None:
        super().begin(prompt)
        if self.semantic is not None:
            self.semantic.begin(prompt)

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        n = len(context)
        cap = min(int(budget), len(self._out[3]))
        if cap <= 0 or n < 3:
            return DraftTree.empty()
        if len(self._buf) < n + 1:
            self._buf = np.zeros(max(2 * len(self._buf), n + 1), np.int32)
        buf = self._buf
        buf[:n] = context
        ends, lens, scale = self._ends, self._lens, self._scale
        k = _k.find_suffix_matches(buf, n, 2, 32, ADAPLD_ANCHORS, ends, lens)
        if k and self.anchor_hook is not None:
            k = self.anchor_hook(buf, n, ends, lens, k)
        if k:                        # lexical anchors: branches beside the copied token
            if not self.lexical:
                return DraftTree.empty()
            scale[:k] = 1.0
            exclude, src = True, SOURCE_BRANCH
        elif self.semantic is not None and n >= 2:
            sims = self.semantic.similarities(buf, n)[0]
            k = _a.single_anchors(buf, n, sims, self.tau, ADAPLD_SEMANTIC_ANCHORS, ends, scale)
            exclude, src = False, SOURCE_SEMANTIC
        if k == 0:
            return DraftTree.empty()
        self._grow(n)
        t, par, pr, sr = self._out
        m = _a.build_adapld_tree(buf, n, ends, scale, k, exclude, self._tok, self._p, n - 1, self.k,
                                 self.successor_len, cap, t, par, pr, sr, src, *self._one)
        if m == 0:
            return DraftTree.empty()
        return DraftTree.raw(t[:m].copy(), par[:m].copy(), pr[:m].copy(), sr[:m].copy())
