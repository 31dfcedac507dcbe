"""Drafting from a predicted output (OpenAI's Predicted Outputs).

A request may say what its answer is expected to repeat: the code being
edited, the document being revised.  PredictionDrafter wraps the model's own
drafter and adds, every step, the continuations of the context's suffix found
in that text, from a small suffix array built once per request.  It is one
more source of draft candidates: the engine's cost gate and exact
verification treat them like any other, so the output stays token-identical
to plain decoding, only the number of steps changes.

The index holds the last PROMPT_TAIL prompt tokens followed by the
prediction, so the very first step after the prompt already matches the
prediction's beginning ("...assistant\\n" + the first answer token).  Its nodes
carry SOURCE_CONTEXT: the prediction is text of the request itself, and
matches in it behave like matches in the prompt.
"""
from __future__ import annotations

import numpy as np

from edgespec.kernels import suffix as _k
from edgespec.drafters.tree import SOURCE_CONTEXT, DraftTree
from edgespec.drafters.base import Drafter
from edgespec.drafters.suffix import SuffixConfig

PROMPT_TAIL = 8


class PredictionDrafter(Drafter):
    """`inner`'s proposal merged with matches in a per-request prediction
    (set_prediction before the request; None = inner alone)."""

    @property
    def plain(self) -> bool:
        return self.inner.plain        # a prediction beside plain decoding forces no grammar drafts either

    def __init__(self, inner: Drafter, config: SuffixConfig | None = None):
        self.inner = inner
        self.name = inner.name
        c = self.config = config or SuffixConfig(corpus_min_match=2, max_depth=16)
        self._pred = np.zeros(0, np.int32)
        self._index = None                     # (tokens, suffix array) of prompt tail + prediction
        self._ends = np.zeros(c.max_matches, np.int32)
        self._lens = np.zeros(c.max_matches, np.int32)
        self._mlen = np.zeros(c.max_nodes, np.int32)
        self._b = (np.zeros(c.max_nodes, np.int32), np.zeros(c.max_nodes, np.int32),
                   np.zeros(c.max_nodes, np.float32))
        self._b_src = np.full(c.max_nodes, SOURCE_CONTEXT, np.int8)
        self._out = (np.zeros(c.max_nodes, np.int32), np.zeros(c.max_nodes, np.int32),
                     np.zeros(c.max_nodes, np.float32), np.zeros(c.max_nodes, np.int8))

    def set_prediction(self, tokens) -> None:
        """The predicted output's tokens for the next request (None or empty: none)."""
        self._pred = np.zeros(0, np.int32) if tokens is None else np.asarray(tokens, np.int32)
        self._index = None

    def warmup(self) -> None:
        self.inner.warmup()
        _k.warmup()

    def begin(self, prompt: np.ndarray) -> None:
        self.inner.begin(prompt)
        self._index = None
        if len(self._pred):
            from edgespec.corpus.compile import suffix_array
            toks = np.concatenate([np.asarray(prompt[-PROMPT_TAIL:], np.int32), self._pred,
                                   np.array([-1], np.int32)])
            self._index = (toks, suffix_array(toks, 32).astype(np.int32))

    def needs(self):
        return self.inner.needs()      # the prediction's own matches need nothing of the engine

    def observe_prefill(self, start, topk_tokens, topk_logits) -> None:
        self.inner.observe_prefill(start, topk_tokens, topk_logits)

    def observe_prefill_hidden(self, start: int, hidden: np.ndarray) -> None:
        self.inner.observe_prefill_hidden(start, hidden)

    def observe(self, result) -> None:
        self.inner.observe(result)

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        inner = self.inner.propose(context, budget)
        if self._index is None or budget <= 0:
            return inner
        c = self.config
        toks, sa = self._index
        ctx = np.ascontiguousarray(context, dtype=np.int32)
        k = _k.sa_find_matches(toks, sa, 32, ctx, len(ctx), c.corpus_min_match, c.max_match,
                               c.max_matches, self._ends, self._lens)
        if k == 0:
            return inner
        max_nodes = min(int(budget), c.max_nodes)
        bt, bp, bq = self._b
        m = _k.build_continuation_tree(toks, len(toks), self._ends, self._lens, k, c.max_depth,
                                       max_nodes, bt, bp, bq, self._mlen)
        if m == 0:
            return inner
        # the prediction first: a node both propose keeps the larger probability
        ot, op, oq, os_ = self._out
        n = _k.merge_trees(bt, bp, bq, self._b_src, m, inner.tokens, inner.parents, inner.probs,
                           inner.source, len(inner), max_nodes, ot, op, oq, os_)
        return DraftTree.raw(ot[:n].copy(), op[:n].copy(), oq[:n].copy(), os_[:n].copy())
