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
measured work per step.  A curve with steady widths (CostCurve.steady_rel,
as measured on a GPU) is charged by shape: a batch after two of its width
its steady cost (llama.cpp's CUDA backend replays its captured graph from
the third decode of a shape on), any other batch its alternating cost, and
a one-token decode right after a batch its after-batch cost (the second,
which captures the graph again, is charged as a plain one: tools/gpu's
shapes did not time it apart), each plus a device's fitted extra where the
cost file has one (replay/steps.py).  The backend's clock() is that modelled
time plus the engine's own time (real, or a fixed figure per step), so the
engine learns its step costs and keeps its guard's account as it would on
that machine.
`edgespec replay` is the command-line front end.

The model's own numbers beyond its greedy tokens -- its top-k and their
logits, the entropy of its distribution and its hidden state at every
position, prompt positions included -- come from one teacher-forced pass of
the real model over prompt + recorded output (`teacher_pass`), so drafters
that read them (branch drafting from the prefill's rankings, ReSpec's entropy
trigger, AdaPLD's hidden-state rerank) replay as they would run.  The fake
logits of a row on the recorded text then carry the recorded top-k values and
a flat tail set so that the row's entropy is the recorded one.

`replay/curves.py` builds the published GPU cost curves the papers' regimes stand
for (`--cost rtx3090`, `--cost m2`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from edgespec.drafters.base import Drafter
from edgespec.core.engine import drain
from edgespec.core.gate import CostBuckets, cost_table_at, prior_at
from edgespec.drafters.tree import DraftTree
from edgespec.core.params import Request
from edgespec.replay.steps import StepTerms
from edgespec.errors import BackendError

_OFF_TEXT = 0
"""Token the fake logits favour after a slot that left the recorded text (only
its being different from the recorded token matters)."""


def tail_for_entropy(top: np.ndarray, h: np.ndarray, n_vocab: int) -> np.ndarray:
    """Per row, the logit t that the n_vocab - K tokens outside a row's top-K
    logits `top` [N, K] must share so that the row's entropy is h [N] (nats).
    The entropy rises with t up to t = min(top) (the tail cannot exceed the
    top-K), so t is found by bisection between max(top) - 60 and min(top);
    entropies outside that range clamp to its ends."""
    top = np.asarray(top, np.float64)
    mx = top.max(axis=1, keepdims=True)
    a = np.exp(top - mx)
    sa = a.sum(axis=1)
    sz = (a * (top - mx)).sum(axis=1)
    m = float(n_vocab - top.shape[1])

    def ent(t):
        b = m * np.exp(t - mx[:, 0])
        z = sa + b
        return np.log(z) - (sz + b * (t - mx[:, 0])) / z

    lo = mx[:, 0] - 60.0
    hi = top.min(axis=1)
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        up = ent(mid) < h
        lo = np.where(up, mid, lo)
        hi = np.where(up, hi, mid)
    return (0.5 * (lo + hi)).astype(np.float32)


@dataclass
class Teacher:
    """The model's numbers at every position of one request (row p: after
    reading tokens[:p + 1]): top-k ids and logits, entropy, the tail logit
    that reproduces the entropy (tail_for_entropy), optionally hidden states."""
    ids: np.ndarray
    logits: np.ndarray
    entropy: np.ndarray
    tail: np.ndarray
    hidden: np.ndarray | None = None


def teacher_pass(backend, tokens: np.ndarray, n_prompt: int, k: int = 8, hidden: bool = False,
                 chunk: int = 512, gen_chunk: int = 32) -> Teacher:
    """Decode `tokens` (prompt + recorded output) once as plain chains, every
    row an output, and keep per position the model's top-k (ids, logits),
    the entropy of its distribution and, with `hidden`, its hidden state.
    The prompt goes in chunks of `chunk` tokens, as the engine's prefill lays
    it (n_batch), the output in chunks of `gen_chunk` (on the CPU backend a
    batch of up to 48 tokens gives the logits of one-token decoding), so the
    numbers are those the real engine sees.  `backend` must allow batches of
    `chunk` tokens (a LlamaBackend with exact=False and max_nodes=chunk); its
    KV cache is reset."""
    from edgespec.kernels.topk import row_entropy, topk_rows_vals
    tokens = np.asarray(tokens, np.int32)
    n = len(tokens)
    ids = np.zeros((n, k), np.int32)
    vals = np.zeros((n, k), np.float32)
    ent = np.zeros(n, np.float32)
    hid = None
    if hidden:
        backend.set_hidden(True)
        hid = np.zeros((n, backend.n_embd), np.float16)
    backend.reset()
    rows = np.arange(chunk, dtype=np.int64)
    i = 0
    while i < n:
        m = min(chunk, n_prompt - i) if i < n_prompt else min(gen_chunk, n - i)
        backend.decode_tree(tokens[i:i + m], np.arange(m, dtype=np.int32), np.zeros(m, np.int32),
                            np.ones(m, np.int32), 1)
        lg = backend.logits()
        topk_rows_vals(lg, rows, m, k, ids[i:i + m], vals[i:i + m])
        row_entropy(lg, m, ent[i:i + m])
        if hid is not None:         # with `hidden`
            hid[i:i + m] = backend.hidden()[:m]
        backend.keep(m)
        i += m
    backend.reset()
    if hidden:
        backend.set_hidden(False)
    return Teacher(ids, vals, ent, tail_for_entropy(vals, ent, backend.n_vocab), hid)


class ReplayBackend:
    """A stand-in for LlamaBackend whose model "predicts" a recorded sequence.

    truth: the whole token sequence of one request (prompt, then the recorded
    greedy output, then an end-of-generation token when the output stopped on
    one).  vocab: the model's Vocab (for detokenization and EOG ids).
    cost: a CostCurve; every decode adds its modelled time to `model_s`.
    """

    exact = True
    spliced_from: int | None = None     # a replay never splices: its cells are its recorded tokens

    def __init__(self, vocab, n_ctx: int, max_nodes: int, cost, eog_token: int, overhead_s: float | None = None,
                 terms: StepTerms | None = None):
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
        self.topk: np.ndarray | None = None
        self.n_prompt = 0
        self.truth = np.zeros(0, np.int32)
        self.cost = cost
        self.table_short = cost.table(max_nodes + 1, short=True)
        self._buckets = CostBuckets(cost, max_nodes + 1)
        self.model_s = 0.0
        self.n_decodes = 0
        # the clock: modelled decodes, plus the engine's real time outside them
        # or, with overhead_s, that many seconds a step (deterministic)
        self.overhead_s = overhead_s
        self._clock_s = 0.0
        self._real_in_decode = 0.0
        self._prev_n = 0
        self._same_n = 0                    # decodes of width _prev_n in a row
        self._priors: dict = {}
        self.shapes = bool(cost.steady_rel)
        self.terms = terms                  # a device's fitted extra per decode (replay/steps.py), or None
        self.n_width_changes = 0            # decodes whose width differs from the decode before
        self.teacher: Teacher | None = None
        self._dense: list = []                       # rows filled whole (teacher rows)
        self.hidden_on = False
        self.n_embd = 0
        self._hid = np.zeros((max_nodes, 0), np.float32)

    def set_truth(self, truth: np.ndarray, topk=None, n_prompt: int = 0, teacher: Teacher | None = None) -> None:
        """truth: prompt + output tokens; topk: optionally the model's recorded top-k
        ids at each output position (row j ranks output token j), which then
        shape the fake logits' lower ranks as well; teacher: the model's numbers
        at every position (teacher_pass), which then shape rows on the recorded
        text wholly (top-k logits, entropy) and give the prefill's rankings and
        the hidden states."""
        self.truth = np.asarray(truth, np.int32)
        self.n_prompt = n_prompt
        self.topk = None
        if topk is not None and len(topk):
            self.topk = np.asarray(topk, np.int32)
        self.teacher = teacher
        if teacher is not None and teacher.hidden is not None:
            self.n_embd = teacher.hidden.shape[1]
            if self._hid.shape[1] != self.n_embd:
                self._hid = np.zeros((self.max_nodes, self.n_embd), np.float32)

    def set_hidden(self, on: bool, layer: int | None = None) -> None:
        self.hidden_on = bool(on)       # the teacher's hidden states, whatever layer they were read at

    def hidden(self) -> np.ndarray:
        """The teacher's hidden states of the last decode's rows on the recorded
        text (zeros elsewhere, and everywhere without a teacher's)."""
        return self._hid[:self.n_outputs]

    def _teacher_row(self, i: int, hot: int, p: int) -> None:
        """Row i is the model after reading truth[:p + 1]: the teacher's top-k
        logits over a flat tail (its entropy), the recorded next token on top."""
        tch, lg = self.teacher, self._logits
        assert tch is not None              # _set_rows calls this only with one
        lg[i, :] = tch.tail[p]
        lg[i, tch.ids[p]] = tch.logits[p]
        top = float(tch.logits[p].max())
        if lg[i, hot] < top:            # the record wins (numerics may differ by a hair)
            lg[i, hot] = top + 1e-3
        self._dense.append(i)
        if self.hidden_on and tch.hidden is not None:
            self._hid[i] = tch.hidden[p]

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
        for i in self._dense:
            lg[i, :] = 0.0
        self._dirty = []
        self._dense = []
        if self.hidden_on and self.n_embd:
            self._hid[:len(hot)] = 0.0
        for i in range(len(hot)):
            if pos is not None and pos[i] >= 1 and self.teacher is not None and pos[i] - 1 < len(self.teacher.ids):
                self._teacher_row(i, int(hot[i]), int(pos[i]) - 1)
                continue
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

    def borrow(self, prompt: np.ndarray, have: int, min_gain: int = 16) -> int:
        return have             # a replay has one request slot

    def splice_refusal(self) -> str | None:
        return "a replay models exact decoding only: it does not splice cells (cache_reuse)"

    def splice(self, n_prefix: int, cache_start: int, n_chunk: int, inserted: np.ndarray) -> None:
        raise BackendError(self.splice_refusal())

    def save_state(self) -> np.ndarray:      # a replay has no cells: its tokens stand for them
        return self.kv_tokens[:self.n_past].view(np.uint8).copy()

    def restore_state(self, state: np.ndarray, tokens: np.ndarray) -> None:
        self.n_past, self.kv_tokens = len(tokens), np.array(tokens, np.int32)

    def prefill(self, tokens, want_last_logits: bool = True, topk_out=None, cancel=None, hidden_out=None) -> None:
        n = len(tokens)
        a, tch = self.n_past, self.teacher
        if topk_out is not None:     # the prompt's rankings: the teacher's, else unknown
            topk_out[0][:] = -1
            topk_out[1][:] = 0.0
            if tch is not None:
                k = min(topk_out[0].shape[1], tch.ids.shape[1])
                topk_out[0][:, :k] = tch.ids[a:a + n, :k]
                topk_out[1][:, :k] = tch.logits[a:a + n, :k]
        if hidden_out is not None:
            hidden_out[:] = 0.0
            if tch is not None and tch.hidden is not None:
                hidden_out[:] = tch.hidden[a:a + n]
        self.n_past += n                    # prefill time is not part of decode speed
        self._prev_n = 0
        self._set_rows(np.array([self._next(self.n_past)], np.int64), np.array([self.n_past], np.int64))

    def clock(self) -> float:
        if self.overhead_s is not None:
            return self._clock_s
        return time.perf_counter() - self._real_in_decode + self._clock_s

    def modelled_s(self, n: int, base: int) -> float:
        """Seconds of a decode of n tokens after base cells, following one of
        self._prev_n (see the module doc)."""
        if not self.shapes:
            table, t1 = cost_table_at(base, self.table_short, self._buckets)     # as the gate picks it
            return float(table[n] * t1)
        p = prior_at(self.cost, base, self.max_nodes + 1, self._priors)
        # llama.cpp's CUDA graphs: the third decode of a shape on replays the captured graph
        steady = n == self._prev_n and self._same_n >= 2
        extra = self.terms.extra_s(n, steady) if self.terms is not None else 0.0
        if n == 1:
            return float((p.alt[1] + (p.after if self._prev_n >= 2 else 0.0)) * p.t1_s) + extra
        return float((p.steady[n] if steady else p.alt[n]) * p.t1_s) + extra

    def decode_tree(self, tokens, depth, leaf_first, leaf_count, n_leaves) -> None:
        r0 = time.perf_counter()
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
        dt = self.modelled_s(n, base)
        self.n_width_changes += n != self._prev_n
        self._same_n = self._same_n + 1 if n == self._prev_n else 1
        self._prev_n = n
        self.model_s += dt
        self._clock_s += dt
        self.n_decodes += 1
        self._real_in_decode += time.perf_counter() - r0

    def seconds(self, n_past: int) -> np.ndarray:
        """Modelled seconds of a batch of T tokens after n_past cells, T = 0..max_nodes + 1
        (the engine's context buckets)."""
        table, t1 = self._buckets.at(n_past)
        return table * t1

    def logits(self) -> np.ndarray:
        return self._logits[:self.n_outputs]

    def keep(self, k: int) -> None:
        self.n_past += k
        if self.overhead_s is not None:     # the engine's work of a step, as a fixed figure
            self._clock_s += self.overhead_s


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
        self.name = "oracle-" + inner.name

    def needs(self):
        return self.inner.needs()

    def warmup(self) -> None:
        self.inner.warmup()

    def begin(self, prompt) -> None:
        self.inner.begin(prompt)

    def observe_prefill(self, start, topk_tokens, topk_logits) -> None:
        self.inner.observe_prefill(start, topk_tokens, topk_logits)

    def observe_prefill_hidden(self, start, hidden) -> None:
        self.inner.observe_prefill_hidden(start, hidden)

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
    teacher: Teacher | None = None   # the model's numbers at every position (teacher_pass)


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
        backend.set_truth(truth, r.topk, len(r.prompt), r.teacher)
        backend.model_s = 0.0
        w0, d0 = backend.n_width_changes, backend.n_decodes
        t0 = time.perf_counter()
        res = drain(engine.run(engine.resolve(Request(r.prompt, max_tokens=max_tokens, reuse_prefix=False))))
        wall = time.perf_counter() - t0
        if check and list(res.tokens) != [int(t) for t in r.output[:max_tokens]]:
            raise AssertionError(f"replay of {r.key} diverged from the recorded output")
        rows.append({"key": r.key, "category": r.category, "n_generated": res.n_generated,
                     "n_steps": res.n_steps, "n_draft_steps": res.n_draft_steps,
                     "n_draft_nodes": res.n_draft_nodes, "n_draft_accepted": res.n_draft_accepted,
                     "model_s": backend.model_s, "engine_s": wall,
                     "n_width_changes": backend.n_width_changes - w0, "n_decodes": backend.n_decodes - d0})
    return rows
