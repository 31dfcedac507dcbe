"""The model's own alternatives beside retrieved text (AASD, AdaPLD branches).

Retrieval copies what followed an earlier occurrence of the context's end.
Where that earlier text was read by the model, the model also said what *it*
expected next there: its top-K ranking at that position.  This part keeps
that ranking for every context position and, beside each retrieved token,
proposes the model's other choices (with their probabilities):

* ``aasd`` (alignment sampling, AASD as published): rankings at *prompt*
  positions, from the prefill (the engine asks llama.cpp for every prompt
  row's logits chunk by chunk and keeps only the top-K ids, never an
  n_prompt x n_vocab buffer).  Only where the prompt says one thing and the
  model would have said another (the copied token is not the model's top
  choice: a *misaligned* position) does the model's word stand beside the
  copied one; those nodes carry SOURCE_ALIGN, which AASD's conditional
  verification (VerifyConfig "entropy") may relax.
* ``aasd_all`` (edgespec's earlier variant): the same at *every* copied prompt
  position, as SOURCE_BRANCH.
* ``branch`` (edgespec's depth branching, `branch_depth` in `auto`): rankings
  at *generated* positions, from the verification logits every step computes
  anyway.  There the copied token was the model's first choice; its
  runners-up become sibling branches.  (AdaPLD's own branch drafting, the
  top 8 at the anchor's next position with successor drafts, is
  drafters/papers/adapld.py.)

Other nodes carry SOURCE_BRANCH, so the engine calibrates them on their own,
and the cost gate keeps one only when its calibrated chance pays for its
batch slot.  A chain of retrieved tokens is re-stated with probability 0 to
anchor the alternatives; in ``auto`` the retrieval tree already holds it
(merge_trees keeps the larger probability).
"""
from __future__ import annotations

import numpy as np

from edgespec.kernels import anchor as _a
from edgespec.kernels import suffix as _k
from edgespec.drafters.tree import SOURCE_ALIGN, SOURCE_BRANCH, DraftTree
from edgespec.drafters.base import Drafter

BRANCH_K = 4          # rankings kept per position
BRANCH_DEPTH = 4      # alternatives at depths 1..4 of a retrieved continuation
BRANCH_ALT = 2        # at most 2 alternatives per position
BRANCH_MATCHES = 4    # occurrences of the context's end that anchor branches
BRANCH_MIN_MATCH = 2


class BranchDrafter(Drafter):
    """Alternatives the model ranked at the positions retrieval copies.

    ``BranchDrafter(aasd=False, branch=True, max_nodes=64, aasd_all=False, k=4)``:
    ``aasd`` / ``aasd_all`` keep the prefill's rankings at prompt positions
    (misaligned positions only, as SOURCE_ALIGN / every position, as
    SOURCE_BRANCH), ``branch`` the verification's at generated positions;
    ``k`` rankings are kept per position."""

    name = "branch"
    sources = (SOURCE_BRANCH, SOURCE_ALIGN)
    retrieves = True

    def __init__(self, aasd: bool = False, branch: bool = True, max_nodes: int = 64, aasd_all: bool = False,
                 k: int = BRANCH_K):
        if not (aasd or branch or aasd_all):
            raise ValueError("BranchDrafter: enable aasd, aasd_all or branch")
        self.aasd, self.aasd_all, self.branch, self.k = aasd, aasd_all, branch, int(k)
        self.prefill_topk = self.k if (aasd or aasd_all) else 0
        self.topk = self.k if branch else 0
        self.observes = branch
        self._tok = np.full((0, self.k), -1, np.int32)
        self._p = np.zeros((0, self.k), np.float32)
        self._ctx = np.zeros(0, np.int32)    # the tokens the rankings belong to
        self._n_prompt = 0
        self._ends = np.zeros(BRANCH_MATCHES, np.int32)
        self._lens = np.zeros(BRANCH_MATCHES, np.int32)
        self._out = (np.zeros(max_nodes, np.int32), np.zeros(max_nodes, np.int32),
                     np.zeros(max_nodes, np.float32), np.zeros(max_nodes, np.int8))

    def warmup(self) -> None:
        _a.warmup()
        _k.warmup()

    def _grow(self, n: int) -> None:
        if len(self._tok) < n:
            cap = max(n, 2 * len(self._tok), 1024)
            tok = np.full((cap, self.k), -1, np.int32)
            p = np.zeros((cap, self.k), np.float32)
            tok[:len(self._tok)] = self._tok
            p[:len(self._p)] = self._p
            self._tok, self._p = tok, p

    def _store(self, start: int, tok: np.ndarray, logits: np.ndarray) -> None:
        r = len(tok)
        if r == 0:
            return
        k = min(self.k, tok.shape[1])
        self._grow(start + r)
        self._tok[start:start + r, :k] = tok[:, :k]
        self._tok[start:start + r, k:] = -1
        if logits.shape[0] == r and logits.ndim == 2 and logits.shape[1] >= k:
            # softmax over the K kept logits of each row: an upper bound of the
            # full-vocabulary probability, good enough for a score the engine calibrates
            _a.softmax_rows(np.ascontiguousarray(logits[:, :k], dtype=np.float32), self._p, start, k)
        else:        # ids without logits: a rank-based guess (the engine calibrates it)
            self._p[start:start + r, :k] = 1.0 / (np.arange(k, dtype=np.float32) + 2.0)

    def begin(self, prompt: np.ndarray) -> None:
        # rankings stay valid for the prefix this prompt shares with the last
        # context (a chat's earlier turns); the rest is forgotten
        m = min(len(prompt), len(self._ctx))
        neq = np.nonzero(self._ctx[:m] != prompt[:m])[0]
        keep = int(neq[0]) if len(neq) else m
        self._grow(len(prompt))
        self._tok[keep:] = -1
        self._ctx = np.asarray(prompt, np.int32)
        self._n_prompt = len(prompt)

    def observe_prefill(self, start: int, topk_tokens: np.ndarray, topk_logits: np.ndarray) -> None:
        if self.prefill_topk:
            self._store(start, topk_tokens, topk_logits)

    def observe(self, result) -> None:
        # a view of the engine's context buffer: never rewritten for positions
        # already committed (a new request gets a new buffer)
        self._ctx = result.context
        tk = result.topk_tokens
        if self.branch and tk.ndim == 2 and tk.shape[0] and tk.shape[1]:
            p0 = len(result.context) - len(result.accepted) - 1
            self._store(p0, result.topk_tokens, result.topk_logits)

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        n = len(context)
        cap = min(int(budget), len(self._out[3]))
        if cap <= 0 or n < BRANCH_MIN_MATCH + 1:
            return DraftTree.empty()
        ctx = np.ascontiguousarray(context, dtype=np.int32)
        k = _k.find_suffix_matches(ctx, n, BRANCH_MIN_MATCH, 32, BRANCH_MATCHES, self._ends, self._lens)
        if k == 0:
            return DraftTree.empty()
        self._grow(n)
        t, par, pr, src = self._out
        m = _a.build_branch_tree(ctx, n, self._ends, k, self._tok, self._p, n - 1, BRANCH_DEPTH,
                                 BRANCH_ALT, cap, t, par, pr, src, self._n_prompt, not self.aasd_all,
                                 SOURCE_BRANCH if self.aasd_all else SOURCE_ALIGN, SOURCE_BRANCH)
        if m == 0:
            return DraftTree.empty()
        return DraftTree.raw(t[:m].copy(), par[:m].copy(), pr[:m].copy(), src[:m].copy())
