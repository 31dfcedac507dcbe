"""Offline replay: run a drafter and the real engine against recorded model output.

Greedy decoding is deterministic, so once the model's output for a prompt is
known (the `none` rows of an `edgespec bench` results file), every question a
drafter study asks -- which drafts would be proposed, which the cost gate would
keep, how many the model would accept -- can be answered without the model.
`ReplayBackend` stands in for `LlamaBackend`: its "logits" put all mass on the
recorded next token wherever the batch follows the recorded text, so the
unchanged `Engine` (gate, batch layout, carry, acceptance learning) runs on top
of it in microseconds per step instead of milliseconds.

Time is modelled, not measured: a decode of T tokens at a KV position p costs
c(T) of the calibrated curve (the short-context entry for single tokens within
the first 256 cells, as the engine's gate assumes), plus the engine's own
measured work per step.  `tools/replay.py` is the command-line front end.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .backend.llama import SPLIT_KV_FREE_CELLS
from .drafters.base import Drafter
from .engine import CostBuckets, drain
from .tree import DraftTree

_OFF_TEXT = 0
"""Token the fake logits favour after a slot that left the recorded text (only
its being different from the recorded token matters)."""


class ReplayBackend:
    """A stand-in for LlamaBackend whose model "predicts" a recorded sequence.

    truth: the whole token sequence of one request (prompt, then the recorded
    greedy output, then an end-of-generation token when the output stopped on
    one).  vocab: the model's Vocab (for detokenization and EOG ids).
    cost: a CostCurve; every decode adds its modelled time to `model_s`.
    """

    exact = True

    def __init__(self, vocab, n_ctx: int, max_nodes: int, cost, eog_token: int):
        self.vocab = vocab
        self.n_vocab = vocab.n_vocab
        self.n_ctx = n_ctx
        self.max_nodes = max_nodes
        self.eog_token = int(eog_token)
        self.n_past = 0
        self.kv_tokens = np.zeros(0, np.int32)
        self.n_outputs = 0
        self._logits = np.zeros((max_nodes, self.n_vocab), np.float32)
        self._dirty: list = []                       # (row, col) entries set non-zero
        self.topk = None
        self.n_prompt = 0
        self.truth = np.zeros(0, np.int32)
        self.cost = cost
        self.table_short = cost.table(max_nodes + 1, short=True) * cost.t1_s
        self._buckets = CostBuckets(cost, max_nodes + 1)
        self.model_s = 0.0
        self.n_decodes = 0

    def set_truth(self, truth: np.ndarray, topk=None, n_prompt: int = 0) -> None:
        """truth: prompt + output tokens; topk: optionally the model's recorded top-k
        ids at each output position (row j ranks output token j), which then
        shape the fake logits' lower ranks as well."""
        self.truth = np.asarray(truth, np.int32)
        self.n_prompt = n_prompt
        self.topk = None
        if topk is not None and len(topk):
            self.topk = np.asarray(topk, np.int32)

    def _next(self, pos: int) -> int:
        """The recorded token at position pos (EOG beyond the record)."""
        return int(self.truth[pos]) if pos < len(self.truth) else self.eog_token

    def _set_rows(self, hot: np.ndarray, pos=None) -> None:
        """Row i favours hot[i]; where pos[i] >= 0 (the row predicts the token at
        position pos[i], on the recorded text) and a recorded top-k covers it, the
        recorded lower ranks get smaller, decreasing values."""
        lg = self._logits
        for i, c in self._dirty:          # undo the last call's entries
            lg[i, c] = 0.0
        self._dirty = []
        for i in range(len(hot)):
            lg[i, hot[i]] = 1.0
            self._dirty.append((i, int(hot[i])))
            if pos is not None and self.topk is not None and pos[i] >= self.n_prompt:
                j = pos[i] - self.n_prompt
                if j < len(self.topk):
                    row = self.topk[j]
                    k = len(row)
                    for r in range(1, k):
                        c = int(row[r])
                        if c >= 0 and c != hot[i]:
                            lg[i, c] = 0.5 * (k - r) / k
                            self._dirty.append((i, c))
        self.n_outputs = len(hot)

    # -- the LlamaBackend methods the engine calls
    def reset(self) -> None:
        self.n_past = 0

    def truncate(self, n: int) -> None:
        self.n_past = n

    def rollback(self) -> None:
        pass

    def prefill(self, tokens, want_last_logits: bool = True, topk_out=None, cancel=None) -> None:
        n = len(tokens)
        if topk_out is not None:     # the replay knows no rankings at prompt positions
            topk_out[0][:] = -1
            topk_out[1][:] = 0.0
        self.n_past += n                    # prefill time is not part of decode speed
        self._set_rows(np.array([self._next(self.n_past)], np.int64), np.array([self.n_past], np.int64))

    def decode_tree(self, tokens, depth, leaf_first, leaf_count, n_leaves) -> None:
        n = len(tokens)
        base = self.n_past
        on = np.zeros(n, np.bool_)
        hot = np.full(n, _OFF_TEXT, np.int64)
        pos = np.full(n, -1, np.int64)
        last_at_depth = np.full(n + 1, -1, np.int64)
        for s in range(n):           # preorder: a slot's parent is the latest slot one level up
            d = int(depth[s])
            last_at_depth[d] = s
            if s == 0:
                on[s] = True
            else:
                p = last_at_depth[d - 1]
                on[s] = on[p] and int(tokens[s]) == self._next(base + d)
            if on[s]:
                hot[s] = self._next(base + d + 1)
                pos[s] = base + d + 1
        self._set_rows(hot, pos)
        if base + 1 <= SPLIT_KV_FREE_CELLS:      # the short regime's own curve, as the gate uses
            self.model_s += self.table_short[n]
        else:
            self.model_s += self.seconds(base)[n]
        self.n_decodes += 1

    def seconds(self, n_past: int) -> np.ndarray:
        """Modelled seconds of a batch of T tokens after n_past cells, T = 0..max_nodes + 1
        (the engine's context buckets)."""
        table, t1 = self._buckets.at(n_past)
        return table * t1

    def logits(self) -> np.ndarray:
        return self._logits[:self.n_outputs]

    def keep(self, k: int) -> None:
        self.n_past += k


class OracleDrafter(Drafter):
    """A drafter's candidates judged with hindsight: each step it asks `inner`
    for its proposal and keeps only the path that the recorded output follows
    (from the root, as deep as the proposal agrees with the record), with
    probability 1.  The cost gate then verifies that path whenever its length
    pays, so the replay's speed is the best any acceptance estimate could get
    from this drafter's candidates on this machine's c(T): the headroom left
    for better scoring, as opposed to better candidates."""

    def __init__(self, inner, backend: ReplayBackend):
        self.inner = inner
        self.backend = backend
        self.name = "oracle-" + getattr(inner, "name", "drafter")
        self.topk = getattr(inner, "topk", 0)
        self.prefill_topk = getattr(inner, "prefill_topk", 0)
        self.observes = inner.wants_observe()

    def warmup(self) -> None:
        self.inner.warmup()

    def begin(self, prompt) -> None:
        self.inner.begin(prompt)

    def observe_prefill(self, start, topk_tokens, topk_logits) -> None:
        self.inner.observe_prefill(start, topk_tokens, topk_logits)

    def observe(self, result) -> None:
        self.inner.observe(result)

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        tree = self.inner.propose(context, budget)
        truth, n = self.backend.truth, len(context)
        keep: list[int] = []
        parent = -1
        while n + len(keep) < len(truth):
            want = truth[n + len(keep)]
            hit = np.nonzero((tree.parents == parent) & (tree.tokens == want))[0]
            if len(hit) == 0:
                break
            parent = int(hit[0])
            keep.append(parent)
        if not keep:
            return DraftTree.empty()
        k = len(keep)
        return DraftTree(tree.tokens[keep], np.arange(-1, k - 1), np.ones(k, np.float32), tree.source[keep])


@dataclass
class ReplayRequest:
    """One recorded request: prompt tokens, recorded output, how it stopped."""
    key: str
    category: str
    prompt: np.ndarray
    output: np.ndarray
    stopped_on_eog: bool
    topk: list | None = None   # the model's recorded top-k at each output position


def replay(engine, backend: ReplayBackend, requests, max_tokens: int, check: bool = True) -> list[dict]:
    """Run `engine` (an Engine over `backend`) on every request in order; return
    one row per request with the engine's counts and the modelled decode time.
    With check, an output that differs from the record raises AssertionError (the
    replay must reproduce the model exactly, or its figures mean nothing).  A
    record longer than max_tokens is compared on its first max_tokens tokens;
    the rest still tells the replay whether drafts past the cut would have been
    accepted, as the real model does."""
    rows = []
    for r in requests:
        truth = np.concatenate([r.prompt, r.output])
        backend.set_truth(truth, r.topk, len(r.prompt))
        backend.model_s = 0.0
        t0 = time.perf_counter()
        res = drain(engine.run(r.prompt, max_tokens=max_tokens))
        wall = time.perf_counter() - t0
        if check and list(res.tokens) != [int(t) for t in r.output[:max_tokens]]:
            raise AssertionError(f"replay of {r.key} diverged from the recorded output")
        rows.append({"key": r.key, "category": r.category, "n_generated": res.n_generated,
                     "n_steps": res.n_steps, "n_draft_steps": res.n_draft_steps,
                     "n_draft_nodes": res.n_draft_nodes, "n_draft_accepted": res.n_draft_accepted,
                     "model_s": backend.model_s, "engine_s": wall})
    return rows
