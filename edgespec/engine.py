"""The decode loop: propose -> gate -> verify in one batch -> accept -> observe.

Exactness.  Each step decodes the pending token (the root) and the chosen draft
nodes in one llama.cpp batch laid out depth first, likeliest child first.  The
step commits only a *prefix of the batch order*: the chain of slots 0..j that
follows first children, plus the bonus token chosen from slot j's logits.  Those
cells are the first cells the batch used, in position order, so the KV cache
after the step is laid out exactly as plain decoding would lay it out, and every
committed token was chosen from logits computed over such a cache.  When the
accepted path leaves the first-child chain at slot j (a rejected sibling sits
before the accepted node in the batch), the step still commits slots 0..j and
the bonus (the token of the accepted child, read from slot j's exact logits);
what the tree said beyond that point is carried into the next step as a draft
chain (source `carry`) and verified again there, on an exact cache.  No token is
ever committed from logits of a cache with holes, so greedy output is
token-identical to `--drafter none` and sampling keeps the exact distribution.

Cost gate.  Every step the drafter proposes a tree; the acceptance model turns
each node's score into a calibrated probability, and `select_by_rate` keeps the
subtree whose expected tokens per unit of measured verify cost c(T) is best,
or nothing (a plain one-token step) when no subtree beats plain decoding.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field

import numpy as np

from .backend.llama import SPLIT_KV_FREE_CELLS, LlamaBackend
from .costmodel import AcceptanceModel, CostCurve
from .drafters.base import Drafter, StepResult
from .kernels.tree import learn_step, plan_step
from .kernels.tree import warmup as _warmup_tree_kernels
from .tree import SOURCE_CARRY, SOURCE_CONTEXT, SOURCE_CORPUS, DraftTree
from .verify import SamplingConfig, VerifyConfig, relaxed_accepts, sample_token

COST_BUCKET = 128     # the cost gate's table is re-interpolated every 128 context cells


class CostBuckets:
    """The cost table (T = 0..max_t, in units of one plain step) and the plain
    step's seconds for a batch laid after n_past cells, interpolated at the
    centre of n_past's 128-cell bucket and cached per bucket.  The engine's
    gate and the offline replay's time model both cost steps through this."""

    def __init__(self, cost: CostCurve, max_t: int):
        self.cost = cost
        self.max_t = max_t
        self._at: dict = {}

    def at(self, n_past: int) -> tuple[np.ndarray, float]:
        b = n_past // COST_BUCKET
        t = self._at.get(b)
        if t is None:
            n_kv = b * COST_BUCKET + COST_BUCKET // 2
            t = self._at[b] = (self.cost.table(self.max_t, n_kv=n_kv), self.cost.t1_at(n_kv))
        return t


@dataclass
class EngineConfig:
    """Engine settings.

    max_nodes: the most tokens one verification batch holds (root included).
    cost_gate: choose the verified subtree by expected tokens per unit of c(T);
        False verifies every proposed node up to max_nodes (for tests and studies).
    carry_prob: drafter score given to carried tokens (re-verification of tokens
        already accepted once on a batch layout with holes).
    verify: exact (lossless, the default) or one of the lossy opt-ins; see
        verify.VerifyConfig.
    gate_overhead: None (default) lets the gate count the engine's own time per
        step as measured (a moving average, in plain-step units); a number fixes
        it, so that two runs of the same drafter on the same outputs (a real
        one and an offline replay) take the same gate decisions.
    """
    max_nodes: int = 32
    cost_gate: bool = True
    carry_prob: float = 0.95
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    gate_overhead: float | None = None

    def __post_init__(self):
        if not (1 <= self.max_nodes <= 256):
            raise ValueError(f"max_nodes must be in 1..256, got {self.max_nodes}")
        if not (0.0 < self.carry_prob <= 1.0):
            raise ValueError("carry_prob must be in (0, 1]")
        if self.gate_overhead is not None and not (0.0 <= self.gate_overhead < 10.0):
            raise ValueError(f"gate_overhead must be in [0, 10) plain steps, got {self.gate_overhead}")


@dataclass
class GenerationResult:
    text: str
    tokens: list
    n_prompt_tokens: int
    n_generated: int
    n_steps: int
    mean_accepted: float
    prefill_s: float
    decode_s: float
    tokens_per_s: float
    stop_reason: str
    n_reused_tokens: int = 0
    n_draft_steps: int = 0        # steps that verified at least one draft node
    n_draft_nodes: int = 0        # draft nodes verified in all
    n_draft_accepted: int = 0     # draft tokens committed
    n_carried: int = 0            # steps that carried tokens past a batch hole
    decode_call_s: float = 0.0    # time inside llama_decode (+ logits fetch)
    engine_s: float = 0.0         # decode_s - decode_call_s: drafting, gate, verify, bookkeeping
    drafter: str = "none"
    verify: str = "exact"         # exact = lossless; relaxed / entropy change the output
    n_relaxed: int = 0            # tokens accepted by a relaxed rule (not the model's own choice)
    topk: list | None = None      # with record_topk: the model's top-k ids at each generated position

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        if d["topk"] is None:
            del d["topk"]
        return d

    def summary(self) -> str:
        return (f"{self.n_generated} tokens in {self.decode_s:.2f}s ({self.tokens_per_s:.1f} tok/s), "
                f"{self.mean_accepted:.2f} tokens/step, prefill {self.n_prompt_tokens} tokens in {self.prefill_s:.2f}s, "
                f"stop: {self.stop_reason}")


class _TextStream:
    """Incremental detokenizer with stop strings and stream hold-back."""

    def __init__(self, vocab, stop: list[str]):
        self.vocab = vocab
        self.stop = [s for s in stop if s]
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.char_end: list[int] = []
        self.emitted = 0
        self.stopped_at = -1

    def push(self, token: int) -> bool:
        """Add a token; return True if a stop string is now complete."""
        self.text += self.dec.decode(self.vocab.piece(token))
        self.char_end.append(len(self.text))
        if self.stop:
            lo = max(0, self.emitted - max(len(s) for s in self.stop))
            best = -1
            for s in self.stop:
                i = self.text.find(s, lo)
                if i >= 0 and (best < 0 or i < best):
                    best = i
            if best >= 0:
                self.stopped_at = best
                self.text = self.text[:best]
                return True
        return False

    def push_many(self, tokens: list[int]) -> bool:
        """push() each token; stop at the first completed stop string.  Without
        stop strings the pieces are joined and decoded in one call."""
        if self.stop:
            for t in tokens:
                if self.push(t):
                    return True
            return False
        if tokens:
            piece = self.vocab.piece
            self.text += self.dec.decode(b"".join([piece(t) for t in tokens]))
        return False

    def finish(self) -> None:
        if self.stopped_at < 0:
            self.text += self.dec.decode(b"", final=True)

    def n_tokens_before_stop(self) -> int:
        """Tokens whose text lies entirely before the stop string (char_end is
        kept only when there are stop strings, the only case with a stop)."""
        return sum(1 for e in self.char_end if e <= self.stopped_at)

    def delta(self, final: bool = False) -> str:
        """Text not yet streamed, holding back a tail that may start a stop string."""
        end = len(self.text)
        if not final and self.stop and self.stopped_at < 0:
            for s in self.stop:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        if end <= self.emitted:
            return ""
        d = self.text[self.emitted:end]
        self.emitted = end
        return d


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


# what a plain (draft-free) step hands to observe(): read-only, shared by every step
_EMPTY_BOOL = _readonly(np.zeros(0, np.bool_))
_EMPTY_I32 = _readonly(np.zeros(0, np.int32))
_EMPTY_TOPK = _readonly(np.zeros((0, 0), np.int32))
_EMPTY_TOPK_VAL = _readonly(np.zeros((0, 0), np.float32))


def _child(bparent: list, btok: list, slot: int, tok: int) -> int:
    """Batch slot of the child of `slot` that carries `tok`, or -1 (plain lists:
    the first child directly follows its parent in the layout, siblings later)."""
    for t in range(slot + 1, len(btok)):
        if bparent[t] == slot and btok[t] == tok:
            return t
    return -1


def _merge_chain(tree: DraftTree, chain: np.ndarray, prob: float) -> DraftTree:
    """Insert a chain below the root into a proposal, sharing existing nodes."""
    toks, pars = list(tree.tokens), list(tree.parents)
    probs, src = list(tree.probs), list(tree.source)
    cur = -1
    for t in chain.tolist():
        nxt = -1
        for i in range(len(toks)):
            if pars[i] == cur and toks[i] == t:
                nxt = i
                break
        if nxt >= 0:
            probs[nxt] = max(probs[nxt], prob)
            src[nxt] = SOURCE_CARRY
        else:
            toks.append(t); pars.append(cur); probs.append(prob); src.append(SOURCE_CARRY)
            nxt = len(toks) - 1
        cur = nxt
    return DraftTree(np.array(toks, np.int32), np.array(pars, np.int32),
                     np.array(probs, np.float32), np.array(src, np.int8))


class Engine:
    """Runs requests on one backend with one drafter; keeps the KV cache and the
    acceptance statistics between requests (a chat session)."""

    def __init__(self, backend: LlamaBackend, drafter: Drafter, cost: CostCurve | None,
                 config: EngineConfig | None = None):
        _warmup_tree_kernels()
        self.backend = backend
        self.drafter = drafter
        self.config = config or EngineConfig()
        if self.config.max_nodes > backend.max_nodes:
            raise ValueError(f"max_nodes {self.config.max_nodes} exceeds the backend's {backend.max_nodes}")
        self.cost = cost
        self.set_cost(cost)
        self.acceptance = AcceptanceModel()
        self.overhead_rel = 0.02                 # EMA of engine time per step / t1
        self.eog = backend.vocab.eog_mask()
        n = self.config.max_nodes + 1
        self._observes = drafter.wants_observe()
        self._topk = int(getattr(drafter, "topk", 0) or 0) if self._observes else 0
        if self._topk:
            from .kernels.topk import topk_rows_vals
            self._topk_rows = topk_rows_vals
            self._tk = np.zeros((n, self._topk), np.int32)
            self._tv = np.zeros((n, self._topk), np.float32)
            self._rows = np.arange(n, dtype=np.int64)
        self._m = 0
        self._alloc(256)
        self._o = np.zeros(n, np.int64)
        self._bp = np.zeros(n, np.int64)
        self._d = np.zeros(n, np.int32)
        self._lf = np.zeros(n, np.int32)
        self._lc = np.zeros(n, np.int32)
        self._sel = np.zeros(n, np.int64)
        self._spar = np.zeros(n, np.int32)

    def _alloc(self, m: int) -> None:
        """Per-node scratch arrays, grown to the largest proposal seen."""
        if m > self._m:
            self._m = m
            self._cond = np.zeros(m, np.float64)
            self._q = np.zeros(m, np.float64)
            self._nacc = np.zeros(m, np.bool_)
            self._ntest = np.zeros(m, np.bool_)

    # ------------------------------------------------------------------ helpers
    def set_cost(self, cost: CostCurve | None) -> None:
        self.cost = cost
        n = self.config.max_nodes + 1
        self._buckets = None if cost is None else CostBuckets(cost, n)
        # no measurement: assume verification costs like plain decoding, everywhere
        self.cost_table_short = np.arange(n + 1, dtype=np.float64) if cost is None else cost.table(n, short=True)

    def _cost_at(self, n_past: int) -> np.ndarray:
        """The cost table for a batch laid after n_past committed cells: the
        short regime's (one-token steps with every thread) up to 256 cells,
        then interpolated between the calibrated contexts in 128-cell buckets."""
        if n_past + 1 <= SPLIT_KV_FREE_CELLS or self.cost is None:
            return self.cost_table_short
        return self._buckets.at(n_past)[0]

    def _t1(self, n_past: int) -> float:
        """Seconds of one plain one-token step at this context (as calibrated)."""
        return self._buckets.at(n_past)[1]

    @property
    def kv_tokens(self) -> np.ndarray:
        """Tokens whose KV cells are committed in seq 0 (owned by the backend, which
        several engines may share)."""
        return self.backend.kv_tokens

    @kv_tokens.setter
    def kv_tokens(self, value) -> None:
        self.backend.kv_tokens = value

    def reset(self) -> None:
        self.backend.reset()

    def _choose(self, tree: DraftTree, budget: int) -> tuple[int, int]:
        """Gate and lay out this step's tree: returns (k draft nodes, n_leaves);
        k = 0 means a plain one-token step.  Results sit in the scratch arrays."""
        m = len(tree)
        if m == 0 or budget < 2:
            return 0, 1
        self._alloc(m)
        acc = self.acceptance
        table = self._cost_at(self.backend.n_past)
        return plan_step(tree.parents, tree.probs, tree.source, acc.n_c, acc.a_c, acc.n_f, acc.a_f,
                         acc.K0, acc.K1, table,
                         self.overhead_rel if self.config.gate_overhead is None else self.config.gate_overhead,
                         min(budget, self.config.max_nodes),
                         self.config.cost_gate, self._cond, self._q, self._sel, self._spar, self._o,
                         self._bp, self._d, self._lf, self._lc)

    def _relaxed_child(self, logits, slot: int, bpl: list, btl: list, tree: DraftTree, sel, order) -> int:
        """Lossy verification (VerifyConfig): the best retrieved child of `slot`
        that the relaxed rule accepts and whose subtree continues with
        `lookahead` greedy matches, or -1."""
        cfg = self.config.verify
        best, best_c = -np.inf, -1
        for t in range(slot + 1, len(btl)):
            if bpl[t] != slot:
                continue
            if tree.source[sel[order[t]]] not in (SOURCE_CONTEXT, SOURCE_CORPUS):
                continue
            sc = relaxed_accepts(logits[slot], btl[t], cfg)
            if sc > best:
                best, best_c = sc, t
        if best_c < 0:
            return -1
        s2 = best_c
        for _ in range(cfg.lookahead):
            s2 = _child(bpl, btl, s2, int(logits[s2].argmax()))
            if s2 < 0:
                return -1
        return best_c

    # --------------------------------------------------------------------- run
    def run(self, prompt: np.ndarray, *, max_tokens: int = 256, sampling: SamplingConfig | None = None,
            stop: list[str] | None = None, reuse_prefix: bool = False, record_topk: int = 0):
        """Generator: yields text pieces as tokens are committed; its return value
        (StopIteration.value) is the GenerationResult.  Closing the generator early
        (or an exception such as KeyboardInterrupt) leaves the KV cache consistent.

        record_topk: K > 0 stores the model's K most likely tokens at every
        generated position in GenerationResult.topk (for the offline replay)."""
        sampling = sampling or SamplingConfig()
        prompt = np.ascontiguousarray(prompt, dtype=np.int32)
        be = self.backend
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        if len(prompt) >= be.n_ctx:
            raise ValueError(f"the prompt has {len(prompt)} tokens, which does not fit the context of "
                             f"{be.n_ctx} tokens (raise it with --ctx / n_ctx)")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        greedy = sampling.greedy
        rng = np.random.default_rng(sampling.seed) if not greedy else None
        vcfg = self.config.verify
        relax = not vcfg.exact
        if relax and not greedy:
            raise ValueError(f"--verify {vcfg.mode} applies to greedy decoding only (temperature 0)")
        n_relaxed = 0

        t_start = time.perf_counter()
        n_common = 0
        if reuse_prefix and len(self.kv_tokens):
            m = min(len(self.kv_tokens), len(prompt) - 1)
            neq = np.nonzero(self.kv_tokens[:m] != prompt[:m])[0]
            n_common = int(neq[0]) if len(neq) else m
        if n_common == 0:
            be.reset()
        else:
            be.truncate(n_common)
        self.kv_tokens = prompt[:n_common].copy()
        k_pre = int(getattr(self.drafter, "prefill_topk", 0) or 0)
        pre = None
        if k_pre:
            m_pre = len(prompt) - n_common
            pre = (np.full((m_pre, k_pre), -1, np.int32), np.zeros((m_pre, k_pre), np.float32))
        try:
            be.prefill(prompt[n_common:], topk_out=pre)
        except BaseException:
            self.reset()
            raise
        self.kv_tokens = prompt.copy()
        self.drafter.begin(prompt)
        if pre is not None:
            self.drafter.observe_prefill(n_common, pre[0], pre[1])
        first = sample_token(be.logits()[0], sampling, rng.random() if rng is not None else 0.0)
        topk_log: list = []
        if record_topk:
            from .kernels.topk import topk_rows
            rec_rows = np.arange(self.config.max_nodes + 1, dtype=np.int64)
            rec_buf = np.zeros((self.config.max_nodes + 1, record_topk), np.int32)
            topk_rows(be.logits(), rec_rows, 1, record_topk, rec_buf)
            topk_log.append(rec_buf[:1].copy())
        t_prefill = time.perf_counter()

        ctx = np.empty(be.n_ctx + self.config.max_nodes + 2, np.int32)
        ctx[:len(prompt)] = prompt
        n = len(prompt)
        out = _TextStream(be.vocab, stop or [])
        generated: list[int] = []
        stop_reason = None
        n_steps = n_draft_steps = n_draft_nodes = n_draft_accepted = n_carried = 0
        t_decode_calls = 0.0
        carry = np.zeros(0, np.int32)
        pending = -1

        eog = self.eog
        topk_walk = bool(self._topk) and greedy

        def emit(toks: list[int]) -> bool:
            """Append committed tokens in order, stopping at the first end-of-
            generation token, at max_tokens or at a completed stop string; return
            True when generation must stop."""
            nonlocal stop_reason
            cut = len(toks)
            for i, tok in enumerate(toks):
                if eog[tok]:
                    cut = i
                    stop_reason = "stop"
                    break
            room_left = max_tokens - len(generated)
            if room_left <= cut:      # max_tokens is reached before any EOG
                cut = room_left
                stop_reason = "length"
            toks = toks[:cut]
            generated.extend(toks)
            if out.push_many(toks):
                stop_reason = "stop"
            return stop_reason is not None

        ctx[n] = first
        n += 1
        pending = first
        done = emit([first])
        d = out.delta()
        if d:
            yield d
        try:
            while not done:
                room = be.n_ctx - be.n_past
                if room < 1:
                    stop_reason = "length"
                    break
                t_step = time.perf_counter()
                budget = min(self.config.max_nodes, room)
                tree = self.drafter.propose(ctx[:n], budget - 1) if budget > 1 else DraftTree.empty()
                if len(carry):
                    tree = _merge_chain(tree, carry, self.config.carry_prob)
                    carry = np.zeros(0, np.int32)
                k, nl = self._choose(tree, budget)
                bparent = self._bp
                nb = k + 1
                if k == 0:
                    btok = np.array([pending], np.int32)
                    bparent[0] = -1
                    self._d[0] = 0; self._lf[0] = 0; self._lc[0] = 1
                else:
                    sel = self._sel[:k]
                    order = self._o[:nb]
                    btok = np.empty(nb, np.int32)
                    btok[0] = pending
                    btok[1:] = tree.tokens[sel[order[1:]]]
                t0 = time.perf_counter()
                be.decode_tree(btok, self._d[:nb], self._lf[:nb], self._lc[:nb], nl)
                logits = be.logits()
                t1 = time.perf_counter()
                t_decode_calls += t1 - t0
                n_steps += 1

                # ---- verify: walk from the root along matching children
                slot = 0
                accepted = []            # committed tokens this step (drafts, then bonus)
                carried = None
                bpl, btl = bparent[:nb].tolist(), btok.tolist()
                while True:
                    if topk_walk:
                        # the drafter wants this committed slot's ranking anyway: its
                        # first entry is the argmax (ties: lowest id, as argmax), so
                        # the row is read once (right after a decode it is not in cache)
                        self._topk_rows(logits, self._rows[slot:], 1, self._topk, self._tk[slot:], self._tv[slot:])
                        tok = int(self._tk[slot, 0])
                    elif greedy:
                        tok = int(logits[slot].argmax())   # = sample_token(..., greedy), without the call
                    else:
                        tok = sample_token(logits[slot], sampling, rng.random())
                    accepted.append(tok)
                    c = _child(bpl, btl, slot, tok)
                    if c < 0 and relax and k:
                        c = self._relaxed_child(logits, slot, bpl, btl, tree, sel, order)
                        if c >= 0:          # LOSSY: commit the retrieved token instead
                            accepted[-1] = btl[c]
                            n_relaxed += 1
                    if c < 0:
                        break
                    if c != slot + 1:
                        # accepted child sits after a rejected sibling in the batch:
                        # commit up to here, carry the rest into the next step
                        carried = [c]
                        s2 = c
                        while True:
                            t2 = int(logits[s2].argmax())
                            c2 = _child(bpl, btl, s2, t2)
                            if c2 < 0:
                                carry = np.array([btok[x] for x in carried[1:]] + [t2], np.int32)
                                break
                            carried.append(c2)
                            s2 = c2
                        break
                    slot = c
                be.keep(slot + 1)
                if record_topk:
                    topk_rows(logits, rec_rows, slot + 1, record_topk, rec_buf)
                    topk_log.append(rec_buf[:slot + 1].copy())
                if carried is not None:
                    n_carried += 1

                # ---- learn
                if k:
                    n_draft_steps += 1
                    n_draft_nodes += k
                    n_draft_accepted += slot
                    acc = self.acceptance
                    learn_step(nb, bparent, order, sel, tree.probs, tree.source, self._cond, self._d,
                               slot, carried[0] if carried is not None else -1,
                               acc.n_c, acc.a_c, acc.n_f, acc.a_f, acc.pred_sum, self._nacc, self._ntest)
                # ---- commit: every accepted token enters the context (its KV cell may
                # already be kept), emission stops at EOG / stop string / max_tokens
                na = len(accepted)
                ctx[n:n + na] = accepted
                n += na
                done = emit(accepted)
                pending = accepted[-1]
                if self._observes:
                    if k == 0:      # shared empty arrays: observe() must not write to a StepResult
                        proposed, nacc, ntest = DraftTree.empty(), _EMPTY_BOOL, _EMPTY_BOOL
                    else:
                        proposed = DraftTree.raw(tree.tokens[sel], self._spar[:k].copy(), tree.probs[sel],
                                                 tree.source[sel])
                        nacc, ntest = self._nacc[:k].copy(), self._ntest[:k].copy()
                    if self._topk:
                        # the model's ranking after every committed slot's token: it is
                        # in the logits already, so this costs one partial sort per row
                        # (the greedy walk has done it, values included)
                        if not topk_walk:
                            self._topk_rows(logits, self._rows, slot + 1, self._topk, self._tk, self._tv)
                        tk_in, tk_tok, tk_val = btok[:slot + 1].copy(), self._tk[:slot + 1].copy(), \
                            self._tv[:slot + 1].copy()
                    else:
                        tk_in, tk_tok, tk_val = _EMPTY_I32, _EMPTY_TOPK, _EMPTY_TOPK_VAL
                    self.drafter.observe(StepResult(
                        ctx[:n], np.array(accepted, np.int32), proposed, nacc, ntest, tk_in, tk_tok, tk_val,
                        self._t1(n) if self.cost is not None else 0.0, t1 - t0, {}))
                d = out.delta()
                step_other = (time.perf_counter() - t_step) - (t1 - t0)
                if self.cost is not None:
                    self.overhead_rel = 0.9 * self.overhead_rel + 0.1 * (step_other / self._t1(n))
                if d:
                    yield d
        except BaseException:
            be.rollback()
            raise
        finally:
            self.kv_tokens = ctx[:be.n_past].copy()

        out.finish()
        if out.stopped_at >= 0:
            generated = generated[:out.n_tokens_before_stop()]
        tail = out.delta(final=True)
        if tail:
            yield tail
        t_end = time.perf_counter()
        decode_s = t_end - t_prefill
        n_gen = len(generated)
        return GenerationResult(
            text=out.text, tokens=generated, n_prompt_tokens=len(prompt), n_generated=n_gen,
            n_steps=n_steps, mean_accepted=(sum_accepted(n_steps, n_draft_accepted)),
            prefill_s=t_prefill - t_start, decode_s=decode_s,
            tokens_per_s=(n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else 0.0,
            stop_reason=stop_reason or "length", n_reused_tokens=n_common,
            n_draft_steps=n_draft_steps, n_draft_nodes=n_draft_nodes, n_draft_accepted=n_draft_accepted,
            n_carried=n_carried, decode_call_s=t_decode_calls, engine_s=decode_s - t_decode_calls,
            drafter=getattr(self.drafter, "name", "?"), verify=vcfg.mode, n_relaxed=n_relaxed,
            topk=np.concatenate(topk_log)[:n_gen + 1].tolist() if topk_log else None)


def drain(gen, on_text=None) -> GenerationResult:
    """Run an Engine.run generator to the end: hand each text piece to on_text
    (if given) and return the GenerationResult."""
    while True:
        try:
            piece = next(gen)
        except StopIteration as e:
            return e.value
        if on_text is not None:
            on_text(piece)


def sum_accepted(n_steps: int, n_draft_accepted: int) -> float:
    """Mean tokens committed per verification step (each step commits its bonus)."""
    return (n_steps + n_draft_accepted) / n_steps if n_steps else 0.0
