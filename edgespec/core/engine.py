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
import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from edgespec.backend.llama import SPLIT_KV_FREE_CELLS, LlamaBackend
from edgespec.calibration.costmodel import AcceptanceModel, CostCurve
from edgespec.errors import ConfigError, PromptTooLongError
from edgespec.drafters.base import Drafter, StepResult
from edgespec.kernels.tree import learn_step, plan_step, shadow_learn
from edgespec.kernels.tree import warmup as _warmup_tree_kernels
from edgespec.core.logprobs import check_top, token_logprobs
from edgespec.core.tree import SOURCE_CARRY, SOURCE_GRAMMAR, DraftTree
from edgespec.core.verify import SamplingConfig, VerifyConfig, relaxed_accepts, sample_token

SHADOW_KEEP = 16      # proposals judged at once: deeper than any draft the engine verifies
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
    shadow: the acceptance model also learns from the proposed nodes the gate
        did not verify, judged against the tokens committed afterwards (see
        kernels.tree.shadow_learn); False learns from verified nodes only.
    forced_drafts: under a request's grammar, draft the text it forces next
        (keys, brackets, quotes) as a chain scored forced_prob; the gate's
        acceptance statistics for it start from that score.  Never with the
        drafter `none`, which stays plain decoding (the baseline).
    history_cap: at the start of each request, the fine (source, score,
        depth) acceptance counts of earlier requests are scaled down to at
        most this many tested nodes per cell (AcceptanceModel.shrink), so the
        request's own evidence soon outweighs them there, while the coarse
        counts keep the whole history; None keeps them whole.
    gate_overhead: None (default) lets the gate count the engine's own time per
        step as measured (a moving average, in plain-step units); a number fixes
        it, so that two runs of the same drafter on the same outputs (a real
        one and an offline replay) take the same gate decisions.
    """
    max_nodes: int = 48
    cost_gate: bool = True
    carry_prob: float = 0.95
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    gate_overhead: float | None = None
    shadow: bool = True
    forced_drafts: bool = True
    forced_prob: float = 0.9
    history_cap: float | None = None

    def __post_init__(self):
        if not (1 <= self.max_nodes <= 256):
            raise ConfigError(f"max_nodes must be in 1..256, got {self.max_nodes}")
        if not (0.0 < self.carry_prob <= 1.0):
            raise ConfigError("carry_prob must be in (0, 1]")
        if self.gate_overhead is not None and not (0.0 <= self.gate_overhead < 10.0):
            raise ConfigError(f"gate_overhead must be in [0, 10) plain steps, got {self.gate_overhead}")


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
    constrained: bool = False     # a grammar or JSON schema constrained the answer
    n_forced: int = 0             # steps that drafted text the grammar forced
    topk: list | None = None      # with record_topk: the model's top-k ids at each generated position
    logprobs: list | None = None  # with logprobs=N: a logprobs.TokenLogprob per token of `tokens`

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        if d["topk"] is None:
            del d["topk"]
        if d["logprobs"] is None:
            del d["logprobs"]
        else:
            d["logprobs"] = [dataclasses.asdict(e) for e in d["logprobs"]]
        return d

    def summary(self) -> str:
        return (f"{self.n_generated} tokens in {self.decode_s:.2f}s ({self.tokens_per_s:.1f} tok/s), "
                f"{self.mean_accepted:.2f} tokens/step, prefill {self.n_prompt_tokens} tokens in {self.prefill_s:.2f}s, "
                f"stop: {self.stop_reason}")


class _StopScan:
    """Finds stop strings in a text that arrives in pieces, in time linear in
    the text: one Knuth-Morris-Pratt automaton per string, whose state is the
    length of the longest prefix of the string that ends the text so far.  A
    match must end in the newest piece (an earlier one would have stopped the
    text), so each character is read once per string."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.fail = [_kmp_failure(s) for s in stops]
        self.state = [0] * len(stops)

    def feed(self, piece: str, base: int) -> int:
        """Read `piece`, which starts at index `base` of the text; return where
        the earliest-starting stop string completed in it begins, or -1."""
        best = -1
        for j, s in enumerate(self.stops):
            q, f, n = self.state[j], self.fail[j], len(s)
            if q == 0 and s[0] not in piece:
                continue
            for i, c in enumerate(piece):
                while q and s[q] != c:
                    q = f[q - 1]
                if s[q] == c:
                    q += 1
                if q == n:
                    start = base + i + 1 - n
                    best = start if best < 0 else min(best, start)
                    break
            self.state[j] = q
        return best

    def held(self) -> int:
        """How many characters at the end of the text may begin a stop string."""
        return max(self.state, default=0)


def _kmp_failure(s: str) -> list[int]:
    """f[i]: the length of the longest proper prefix of s[:i+1] that is also its suffix."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class _TextStream:
    """Incremental detokenizer with stop strings and stream hold-back.  It also
    keeps where each token's text ends and whether the token was an accepted
    draft, so streamed text can say which of its characters came from drafts."""

    def __init__(self, vocab, stop: list[str]):
        self.vocab = vocab
        self.stop = [s for s in stop if s]
        self._scan = _StopScan(self.stop)
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.char_end: list[int] = []   # len(text) after each token
        self.drafted: list[bool] = []   # each token came from an accepted draft
        self.emitted = 0
        self._span_tok = 0              # first token whose text is not all streamed
        self.stopped_at = -1

    def push(self, token: int, drafted: bool = False) -> bool:
        """Add a token; return True if a stop string is now complete."""
        base = len(self.text)
        piece = self.dec.decode(self.vocab.piece(token))
        self.text += piece
        self.char_end.append(len(self.text))
        self.drafted.append(drafted)
        if self.stop:
            best = self._scan.feed(piece, base)
            if best >= 0:
                self.stopped_at = best
                self.text = self.text[:best]
                return True
        return False

    def push_many(self, tokens: list[int], n_drafted: int = 0) -> bool:
        """push() each token (the first n_drafted were accepted drafts); stop at
        the first completed stop string, as one-token steps would."""
        for i, t in enumerate(tokens):
            if self.push(t, i < n_drafted):
                return True
        return False

    def finish(self) -> None:
        if self.stopped_at < 0:
            self.text += self.dec.decode(b"", final=True)

    def n_tokens_before_stop(self) -> int:
        """Tokens whose text lies entirely before the stop string."""
        return sum(1 for e in self.char_end if e <= self.stopped_at)

    def delta(self, final: bool = False) -> tuple[str, list]:
        """Text not yet streamed, holding back a tail that may start a stop
        string, and the same text cut into runs of (text, from_draft)."""
        end = len(self.text)
        if not final and self.stop and self.stopped_at < 0:
            end -= self._scan.held()
        if end <= self.emitted:
            return "", []
        a, self.emitted = self.emitted, end
        return self.text[a:end], self._spans(a, end)

    def _spans(self, a: int, b: int) -> list:
        ce, dr, i = self.char_end, self.drafted, self._span_tok
        spans: list = []
        pos = a
        while i < len(ce) and pos < b:
            e = min(ce[i], b)
            if e > pos:
                if spans and spans[-1][1] == dr[i]:
                    spans[-1] = (spans[-1][0] + self.text[pos:e], dr[i])
                else:
                    spans.append((self.text[pos:e], dr[i]))
                pos = e
            if ce[i] > b:
                break
            i += 1
        self._span_tok = i
        if pos < b:          # the decoder's final flush belongs to no token
            spans.append((self.text[pos:b], False))
        return spans


@dataclass
class Chunk:
    """What Engine.run yields after the first token and after every step.

    text:      new text to show (a tail that may begin a stop string is held
               back until it is known not to be one)
    tokens:    the token ids this step committed to the answer
    n_drafted: how many of them came from accepted drafts (the first ones; the
               last token of a step is the model's own bonus token)
    spans:     `text` cut into runs of (text, from_draft): which characters
               arrived as accepted drafts
    logprobs:  with run(logprobs=N): a logprobs.TokenLogprob per token of
               `tokens` that lies before a stop string, else None
    """
    text: str
    tokens: list
    n_drafted: int = 0
    spans: list = field(default_factory=list)
    logprobs: list | None = None


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


# what a plain (draft-free) step hands to observe(): read-only, shared by every step
_EMPTY_BOOL = _readonly(np.zeros(0, np.bool_))
_EMPTY_I32 = _readonly(np.zeros(0, np.int32))
_EMPTY_TOPK = _readonly(np.zeros((0, 0), np.int32))
_EMPTY_TOPK_VAL = _readonly(np.zeros((0, 0), np.float32))
_EMPTY_F32 = _readonly(np.zeros(0, np.float32))


def _child(bparent: list, btok: list, slot: int, tok: int) -> int:
    """Batch slot of the child of `slot` that carries `tok`, or -1 (plain lists:
    the first child directly follows its parent in the layout, siblings later)."""
    for t in range(slot + 1, len(btok)):
        if bparent[t] == slot and btok[t] == tok:
            return t
    return -1


def _merge_chain(tree: DraftTree, chain: np.ndarray, prob: float, source: int = SOURCE_CARRY) -> DraftTree:
    """Insert a chain below the root into a proposal, sharing existing nodes
    (which then count as `source`, with at least `prob`)."""
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
            src[nxt] = source
        else:
            toks.append(t); pars.append(cur); probs.append(prob); src.append(source)
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
            raise ConfigError(f"max_nodes {self.config.max_nodes} exceeds the backend's {backend.max_nodes}")
        self.cost = cost
        self.set_cost(cost)
        self.acceptance = AcceptanceModel()
        self.overhead_rel = 0.02                 # EMA of engine time per step / t1
        self.eog = backend.vocab.eog_mask()
        n = self.config.max_nodes + 1
        self._observes = drafter.wants_observe()
        self._plain = getattr(drafter, "name", "") == "none"     # plain decoding drafts nothing, forced text included
        self._topk = int(getattr(drafter, "topk", 0) or 0) if self._observes else 0
        if self._topk:
            from edgespec.kernels.topk import topk_rows_vals
            self._topk_rows = topk_rows_vals
            self._tk = np.zeros((n, self._topk), np.int32)
            self._tv = np.zeros((n, self._topk), np.float32)
            self._rows = np.arange(n, dtype=np.int64)
        # ReSpec's trigger wants every committed row's entropy, AdaPLD's rerank its hidden state
        self._want_entropy = self._observes and bool(getattr(drafter, "wants_entropy", False))
        self._want_hidden = self._observes and bool(getattr(drafter, "wants_hidden", False))
        if self._want_entropy:
            from edgespec.kernels.topk import row_entropy
            self._row_entropy = row_entropy
            self._ent = np.zeros(n, np.float32)
        self._o = np.zeros(n, np.int64)
        self._bp = np.zeros(n, np.int64)
        self._d = np.zeros(n, np.int32)
        self._lf = np.zeros(n, np.int32)
        self._lc = np.zeros(n, np.int32)
        self._sel = np.zeros(n, np.int64)
        self._spar = np.zeros(n, np.int32)
        self._m = 0
        self._alloc(256)

    def _alloc(self, m: int) -> None:
        """Per-node scratch arrays, grown to the largest proposal seen."""
        if m > self._m:
            self._m = m
            self._cond = np.zeros(m, np.float64)
            self._q = np.zeros(m, np.float64)
            self._nacc = np.zeros(m, np.bool_)
            self._ntest = np.zeros(m, np.bool_)
            # plan_step's PlanScratch as a plain tuple (numba dispatches it faster)
            self._plan = (self._cond, self._q, self._sel, self._spar, self._o, self._bp, self._d, self._lf, self._lc)

    # ------------------------------------------------------------------ helpers
    def set_cost(self, cost: CostCurve | None) -> None:
        self.cost = cost
        # a built-in curve's t1 is a placeholder: no step time is measured against it
        self._timed = cost is not None and not cost.builtin
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
        return plan_step(tree.parents, tree.probs, tree.source, (acc.n_c, acc.a_c, acc.n_f, acc.a_f),
                         acc.K0, acc.K1, table,
                         self.overhead_rel if self.config.gate_overhead is None else self.config.gate_overhead,
                         min(budget, self.config.max_nodes), self.config.cost_gate, self._plan)

    def _relaxed_child(self, logits, slot: int, bpl: list, btl: list, tree: DraftTree, sel, order) -> int:
        """Lossy verification (VerifyConfig): the best retrieved child of `slot`
        that the relaxed rule accepts and whose subtree continues with
        `lookahead` greedy matches, or -1."""
        cfg = self.config.verify
        relaxable = cfg.relax_sources
        best, best_c = -np.inf, -1
        for t in range(slot + 1, len(btl)):
            if bpl[t] != slot:
                continue
            if tree.source[sel[order[t]]] not in relaxable:
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
            stop: list[str] | None = None, reuse_prefix: bool = False, record_topk: int = 0,
            cancel=None, logprobs: int | None = None, grammar=None):
        """Generator: yields a Chunk after the first token and after every step;
        its return value (StopIteration.value) is the GenerationResult.  Closing
        the generator early (or an exception such as KeyboardInterrupt) leaves
        the KV cache consistent.

        record_topk: K > 0 stores the model's K most likely tokens at every
        generated position in GenerationResult.topk (for the offline replay).
        cancel: a threading.Event or a callable, checked between prefill chunks
        and before every step; once set the answer ends with stop_reason
        "cancelled" and the KV cache holds exactly what was committed.
        logprobs: N in 0..20 also reports every generated token's
        log-probability and the N likeliest tokens there (edgespec.core.logprobs),
        in the chunks and in GenerationResult.logprobs.
        grammar: a backend Grammar (edgespec.backend.grammar) the answer must
        follow: every committed token is the model's choice among the tokens
        it admits, drafts included; its state advances with the answer."""
        is_cancelled = _cancel_check(cancel)
        check_top(logprobs)
        st = self._start(prompt, max_tokens, sampling or SamplingConfig(), stop, reuse_prefix, record_topk,
                         is_cancelled, logprobs, grammar)
        be = self.backend
        try:
            yield from self._chunk(st, 0)
            while st.stop_reason is None:
                if is_cancelled is not None and is_cancelled():
                    st.stop_reason = "cancelled"
                elif be.n_ctx - be.n_past < 1:
                    st.stop_reason = "length"
                else:
                    yield from self._chunk(st, self._step(st))
        except BaseException:
            be.rollback()
            raise
        finally:
            self.kv_tokens = st.ctx[:be.n_past].copy()
        return (yield from self._finish(st))

    def check_request(self, n_prompt: int, max_tokens: int, sampling: SamplingConfig,
                      constrained: bool = False) -> None:
        """Raise a ConfigError (PromptTooLongError for a prompt that does not
        fit the context) for a request this engine cannot run; run() checks
        this first, callers may check before queueing a request.
        constrained: the request has a grammar."""
        n_ctx = self.backend.n_ctx
        if n_prompt == 0:
            raise ConfigError("empty prompt")
        if n_prompt >= n_ctx:
            raise PromptTooLongError(f"the prompt has {n_prompt} tokens, which does not fit the context of "
                                     f"{n_ctx} tokens (raise it with --ctx / n_ctx)", n_prompt, n_ctx)
        if max_tokens < 1:
            raise ConfigError("max_tokens must be >= 1")
        vcfg = self.config.verify
        if not vcfg.exact and not sampling.greedy:
            raise ConfigError(f"--verify {vcfg.mode} applies to greedy decoding only (temperature 0)")
        if not vcfg.exact and constrained:
            raise ConfigError(f"--verify {vcfg.mode} cannot be combined with a grammar")

    def _start(self, prompt, max_tokens: int, sampling: SamplingConfig, stop, reuse_prefix: bool,
               record_topk: int, is_cancelled, logprobs: int | None = None, grammar=None) -> "_RunState":
        """Check the request, reuse the common prefix of the KV cache, prefill
        the rest and choose the first token."""
        be = self.backend
        ids = np.asarray(prompt)
        # checked before the cast to int32, which would wrap large ids: a
        # drafter indexes its tables with them, llama.cpp refuses them
        if ids.ndim != 1 or (ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= be.n_vocab)):
            raise ConfigError(f"a prompt of token ids must be a flat list of integers in 0..{be.n_vocab - 1}")
        prompt = np.ascontiguousarray(ids, dtype=np.int32)
        self.check_request(len(prompt), max_tokens, sampling, grammar is not None)
        st = _RunState(prompt=prompt, sampling=sampling, max_tokens=max_tokens, record_topk=record_topk,
                       out=_TextStream(be.vocab, stop or []), t_start=time.perf_counter())
        if self.config.history_cap is not None:
            self.acceptance.shrink(self.config.history_cap)
        st.rng = np.random.default_rng(sampling.seed) if not sampling.greedy else None
        if logprobs is not None:
            st.n_logprobs, st.lp = logprobs, []
        st.grammar = grammar
        st.topk_walk = bool(self._topk) and sampling.greedy and grammar is None
        if reuse_prefix and len(self.kv_tokens):
            m = min(len(self.kv_tokens), len(prompt) - 1)
            neq = np.nonzero(self.kv_tokens[:m] != prompt[:m])[0]
            st.n_common = int(neq[0]) if len(neq) else m
        if st.n_common == 0:
            be.reset()
        else:
            be.truncate(st.n_common)
        self.kv_tokens = prompt[:st.n_common].copy()
        k_pre = int(getattr(self.drafter, "prefill_topk", 0) or 0)
        m_pre = len(prompt) - st.n_common
        pre = hid = None
        if k_pre:
            pre = (np.full((m_pre, k_pre), -1, np.int32), np.zeros((m_pre, k_pre), np.float32))
        if self._want_hidden or getattr(be, "hidden_on", False):
            be.set_hidden(self._want_hidden)      # the backend may be shared with other engines
        if self._want_hidden:
            hid = np.zeros((m_pre, be.n_embd), np.float32)
        try:
            be.prefill(prompt[st.n_common:], topk_out=pre, cancel=is_cancelled, hidden_out=hid)
        except BaseException:
            self.reset()
            raise
        st.ctx = np.empty(be.n_ctx + self.config.max_nodes + 2, np.int32)
        st.ctx[:len(prompt)] = prompt
        st.n = len(prompt)
        if be.n_past < st.n_common + len(prompt[st.n_common:]):     # cancelled during the prefill
            st.stop_reason = "cancelled"
            st.n = be.n_past
            st.t_prefill = time.perf_counter()
            return st
        self.kv_tokens = prompt.copy()
        self.drafter.begin(prompt)
        if pre is not None:
            self.drafter.observe_prefill(st.n_common, pre[0], pre[1])
        if hid is not None:
            self.drafter.observe_prefill_hidden(st.n_common, hid)
        first = self._pick(st, be.logits(), 0)
        if record_topk:
            from edgespec.kernels.topk import topk_rows
            st.rec_rows = np.arange(self.config.max_nodes + 1, dtype=np.int64)
            st.rec_buf = np.zeros((self.config.max_nodes + 1, record_topk), np.int32)
            topk_rows(be.logits(), st.rec_rows, 1, record_topk, st.rec_buf)
            st.topk_log.append(st.rec_buf[:1].copy())
        st.t_prefill = time.perf_counter()
        st.ctx[st.n] = first
        st.n += 1
        st.pending = first
        if st.lp is not None:
            st.lp.extend(token_logprobs(be.logits()[:1], [first], st.n_logprobs))
        self._commit(st, [first])
        return st

    def _commit(self, st: "_RunState", toks: list[int], n_drafted: int = 0) -> None:
        """Append committed tokens to the answer in order, stopping at the first
        end-of-generation token, at max_tokens or at a completed stop string
        (st.stop_reason is set then); the first n_drafted were drafts."""
        cut = len(toks)
        eog = self.eog
        for i, tok in enumerate(toks):
            if eog[tok]:
                cut = i
                st.stop_reason = "stop"
                break
        room_left = st.max_tokens - len(st.generated)
        if room_left <= cut:      # max_tokens is reached before any EOG
            cut = room_left
            st.stop_reason = "length"
        toks = toks[:cut]
        st.generated.extend(toks)
        if st.lp is not None:       # the caller added one entry per token of toks before the cut
            del st.lp[len(st.generated):]
        if st.out.push_many(toks, n_drafted):
            st.stop_reason = "stop"

    def _chunk(self, st: "_RunState", n_drafted: int):
        """Yield what a step added to the answer (nothing when it added nothing)."""
        text, spans = st.out.delta()
        a = st.n_streamed
        toks = st.generated[a:]
        st.n_streamed = len(st.generated)
        lp = None
        if st.lp is not None:       # none for tokens at or past a stop string
            lp = st.lp[a:st.out.n_tokens_before_stop() if st.out.stopped_at >= 0 else len(st.lp)]
        if text or toks:
            yield Chunk(text, toks, min(n_drafted, len(toks)), spans, lp)

    def _step(self, st: "_RunState") -> int:
        """One step: propose, gate, verify the batch, keep the accepted cells,
        learn, commit.  Returns how many committed tokens were drafts."""
        be = self.backend
        t_step = time.perf_counter()
        budget = min(self.config.max_nodes, be.n_ctx - be.n_past)
        tree = self.drafter.propose(st.ctx[:st.n], budget - 1) if budget > 1 else DraftTree.empty()
        if len(st.carry):
            tree = _merge_chain(tree, st.carry, self.config.carry_prob)
            st.carry = np.zeros(0, np.int32)
        if st.grammar is not None and budget > 1:
            forced = self._forced(st)
            if len(forced):
                tree = _merge_chain(tree, forced[:budget - 1], self.config.forced_prob, SOURCE_GRAMMAR)
        k, nl = self._choose(tree, budget)
        if self.config.shadow and len(tree) and budget > 1:
            self._shadow_record(st, tree, k)
        nb = k + 1
        if k == 0:
            btok = np.array([st.pending], np.int32)
            self._bp[0] = -1
            self._d[0] = 0; self._lf[0] = 0; self._lc[0] = 1
        else:
            btok = np.empty(nb, np.int32)
            btok[0] = st.pending
            btok[1:] = tree.tokens[self._sel[:k][self._o[1:nb]]]
        t0 = time.perf_counter()
        be.decode_tree(btok, self._d[:nb], self._lf[:nb], self._lc[:nb], nl)
        logits = be.logits()
        t1 = time.perf_counter()
        st.t_decode_calls += t1 - t0
        st.n_steps += 1
        slot, accepted, carried = self._verify(st, logits, tree, btok, k)
        be.keep(slot + 1)
        if st.record_topk:
            from edgespec.kernels.topk import topk_rows
            topk_rows(logits, st.rec_rows, slot + 1, st.record_topk, st.rec_buf)
            st.topk_log.append(st.rec_buf[:slot + 1].copy())
        if carried is not None:
            st.n_carried += 1
        if k:
            self._learn(st, tree, nb, k, slot, carried)
        if st.lp is not None:       # accepted[i] was chosen from row i
            st.lp.extend(token_logprobs(logits, accepted, st.n_logprobs))
        # every accepted token enters the context (its KV cell may already be kept)
        na = len(accepted)
        st.ctx[st.n:st.n + na] = accepted
        st.n += na
        self._commit(st, accepted, slot)
        st.pending = accepted[-1]
        if st.shadow:
            self._shadow_learn(st)
        if self._observes:
            self._observe(st, logits, tree, btok, k, slot, accepted, t1 - t0)
        step_other = (time.perf_counter() - t_step) - (t1 - t0)
        if self._timed:
            self.overhead_rel = 0.9 * self.overhead_rel + 0.1 * (step_other / self._t1(st.n))
        return slot

    def _verify(self, st: "_RunState", logits, tree: DraftTree, btok: np.ndarray, k: int):
        """Walk the batch from the root along children that carry the model's own
        token.  Returns (last committed slot, committed tokens: accepted drafts
        then the bonus, the slots carried past a batch hole or None)."""
        nb = k + 1
        sel, order = self._sel[:k], self._o[:nb]
        slot = 0
        accepted: list[int] = []
        carried = None
        bpl, btl = self._bp[:nb].tolist(), btok.tolist()
        relax = not self.config.verify.exact
        cap = self.config.verify.max_relaxed or (1 << 30)      # ReSpec's Phi: relaxed tokens per step
        n_relaxed = 0
        while True:
            tok = self._pick(st, logits, slot)
            accepted.append(tok)
            c = _child(bpl, btl, slot, tok)
            if c < 0 and relax and k and n_relaxed < cap:
                c = self._relaxed_child(logits, slot, bpl, btl, tree, sel, order)
                if c >= 0:          # LOSSY: commit the retrieved token instead
                    accepted[-1] = btl[c]
                    st.n_relaxed += 1
                    n_relaxed += 1
            if c < 0:
                return slot, accepted, carried
            if c != slot + 1:
                # accepted child sits after a rejected sibling in the batch:
                # commit up to here, carry the rest into the next step
                carried = [c]
                s2 = c
                while True:
                    t2 = int(logits[s2].argmax())
                    c2 = _child(bpl, btl, s2, t2)
                    if c2 < 0:
                        st.carry = np.array([btok[x] for x in carried[1:]] + [t2], np.int32)
                        return slot, accepted, carried
                    carried.append(c2)
                    s2 = c2
            slot = c

    def _forced(self, st: "_RunState") -> np.ndarray:
        """Tokens for the text the grammar forces after the committed answer
        (jump-forward decoding, drafted: verification still decides), or none
        when nothing is forced or its tokens do not spell it back."""
        if not self.config.forced_drafts or self._plain:
            return _EMPTY_I32
        text = st.grammar.forced_text(st.out.text)
        if not text:
            return _EMPTY_I32
        vocab = self.backend.vocab
        toks = vocab.tokenize(text, add_special=False)
        if vocab.detokenize(toks) != text:
            return _EMPTY_I32
        st.n_forced += 1
        return toks

    def _pick(self, st: "_RunState", logits, slot: int) -> int:
        """The model's token at batch row `slot`: its argmax (greedy) or a draw,
        under the request's grammar when it has one (which then advances)."""
        g = st.grammar
        if g is not None:
            if st.rng is None:
                tok = g.argmax(logits[slot])
            else:
                tok = sample_token(g.mask(logits[slot]), st.sampling, st.rng.random())
            g.accept(tok)
            return tok
        if st.topk_walk:
            # the drafter wants this committed slot's ranking anyway: its
            # first entry is the argmax (ties: lowest id, as argmax), so
            # the row is read once (right after a decode it is not in cache)
            self._topk_rows(logits, self._rows[slot:], 1, self._topk, self._tk[slot:], self._tv[slot:])
            return int(self._tk[slot, 0])
        if st.rng is None:
            return int(logits[slot].argmax())   # = sample_token(..., greedy), without the call
        return sample_token(logits[slot], st.sampling, st.rng.random())

    def _shadow_record(self, st: "_RunState", tree: DraftTree, k: int) -> None:
        """Keep this step's whole proposal (copies: a drafter may reuse its
        arrays) to be judged against the tokens committed after its root."""
        m = len(tree)
        verified = np.zeros(m, np.bool_)
        verified[self._sel[:k]] = True
        st.shadow.append((st.n - 1, tree.tokens.copy(), tree.parents.copy(), tree.probs.copy(), tree.source.copy(),
                          self._cond[:m].copy(), verified, np.zeros(m, np.int8)))
        if len(st.shadow) > SHADOW_KEEP:
            st.shadow.pop(0)

    def _shadow_learn(self, st: "_RunState") -> None:
        """Credit the acceptance model with the recorded proposals' nodes that
        the committed tokens now decide; drop the proposals fully decided."""
        acc = self.acceptance
        keep = []
        for rec in st.shadow:
            root, tokens, parents, probs, source, cond, verified, state = rec
            if shadow_learn(tokens, parents, probs, source, cond, verified, state, st.ctx[root + 1:st.n],
                            acc.n_c, acc.a_c, acc.n_f, acc.a_f, acc.pred_sum):
                keep.append(rec)
        st.shadow = keep

    def _learn(self, st: "_RunState", tree: DraftTree, nb: int, k: int, slot: int, carried) -> None:
        """Credit the acceptance model with what this step's draft nodes did."""
        st.n_draft_steps += 1
        st.n_draft_nodes += k
        st.n_draft_accepted += slot
        acc = self.acceptance
        learn_step(nb, self._bp, self._o[:nb], self._sel[:k], tree.probs, tree.source, self._cond, self._d,
                   slot, carried[0] if carried is not None else -1,
                   acc.n_c, acc.a_c, acc.n_f, acc.a_f, acc.pred_sum, self._nacc, self._ntest)

    def _observe(self, st: "_RunState", logits, tree: DraftTree, btok, k: int, slot: int, accepted: list[int],
                 decode_s: float) -> None:
        """Hand the step to the drafter: the verified tree, what was accepted and
        (when it asks for them) the model's top-k after every committed slot."""
        if k == 0:      # shared empty arrays: observe() must not write to a StepResult
            proposed, nacc, ntest = DraftTree.empty(), _EMPTY_BOOL, _EMPTY_BOOL
        else:
            sel = self._sel[:k]
            proposed = DraftTree.raw(tree.tokens[sel], self._spar[:k].copy(), tree.probs[sel], tree.source[sel])
            nacc, ntest = self._nacc[:k].copy(), self._ntest[:k].copy()
        if self._topk:
            # the model's ranking after every committed slot's token: it is in
            # the logits already, so this costs one partial sort per row (the
            # greedy walk has done it, values included)
            if not st.topk_walk:
                self._topk_rows(logits, self._rows, slot + 1, self._topk, self._tk, self._tv)
            tk_in, tk_tok, tk_val = btok[:slot + 1].copy(), self._tk[:slot + 1].copy(), self._tv[:slot + 1].copy()
        else:
            tk_in, tk_tok, tk_val = _EMPTY_I32, _EMPTY_TOPK, _EMPTY_TOPK_VAL
        ent, hid = _EMPTY_F32, _EMPTY_TOPK_VAL
        if self._want_entropy:
            self._row_entropy(logits, slot + 1, self._ent)
            ent = self._ent[:slot + 1].copy()
        if self._want_hidden:
            hid = self.backend.hidden()[:slot + 1].copy()
        self.drafter.observe(StepResult(
            st.ctx[:st.n], np.array(accepted, np.int32), proposed, nacc, ntest, tk_in, tk_tok, tk_val,
            self._t1(st.n) if self._timed else 0.0, decode_s, {}, ent, hid))

    def _finish(self, st: "_RunState"):
        """Flush the held-back text and build the GenerationResult (the
        generator's return value)."""
        out = st.out
        out.finish()
        generated = st.generated
        if out.stopped_at >= 0:
            generated = generated[:out.n_tokens_before_stop()]
        tail, spans = out.delta(final=True)
        if tail:
            yield Chunk(tail, [], 0, spans, [] if st.lp is not None else None)
        decode_s = time.perf_counter() - st.t_prefill
        n_gen = len(generated)
        return GenerationResult(
            text=out.text, tokens=generated, n_prompt_tokens=len(st.prompt), n_generated=n_gen,
            n_steps=st.n_steps, mean_accepted=sum_accepted(st.n_steps, st.n_draft_accepted),
            prefill_s=st.t_prefill - st.t_start, decode_s=decode_s,
            tokens_per_s=(n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else 0.0,
            stop_reason=st.stop_reason or "length", n_reused_tokens=st.n_common,
            n_draft_steps=st.n_draft_steps, n_draft_nodes=st.n_draft_nodes, n_draft_accepted=st.n_draft_accepted,
            n_carried=st.n_carried, decode_call_s=st.t_decode_calls, engine_s=decode_s - st.t_decode_calls,
            drafter=getattr(self.drafter, "name", "?"), verify=self.config.verify.mode, n_relaxed=st.n_relaxed,
            constrained=st.grammar is not None, n_forced=st.n_forced,
            topk=np.concatenate(st.topk_log)[:n_gen + 1].tolist() if st.topk_log else None,
            logprobs=st.lp[:n_gen] if st.lp is not None else None)


@dataclass(eq=False)
class _RunState:
    """One request's state between the engine's phases (Engine.run)."""
    prompt: np.ndarray
    sampling: SamplingConfig
    max_tokens: int
    record_topk: int
    out: _TextStream
    t_start: float
    rng: np.random.Generator | None = None
    topk_walk: bool = False
    n_common: int = 0                 # prompt tokens reused from the KV cache
    ctx: np.ndarray = None            # prompt + committed tokens (first n)
    n: int = 0
    pending: int = -1                 # the last committed token, not yet decoded
    carry: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    generated: list = field(default_factory=list)
    n_streamed: int = 0               # tokens of `generated` already handed out in chunks
    stop_reason: str | None = None
    t_prefill: float = 0.0
    t_decode_calls: float = 0.0
    n_steps: int = 0
    n_draft_steps: int = 0
    n_draft_nodes: int = 0
    n_draft_accepted: int = 0
    n_carried: int = 0
    n_relaxed: int = 0
    n_forced: int = 0                 # steps that drafted grammar-forced text
    topk_log: list = field(default_factory=list)
    shadow: list = field(default_factory=list)   # proposals still being judged (Engine._shadow_record)
    rec_rows: np.ndarray = None
    rec_buf: np.ndarray = None
    grammar: object = None            # a backend Grammar the answer follows (Engine.run)
    n_logprobs: int | None = None     # alternatives per token when logprobs are asked for
    lp: list | None = None            # a TokenLogprob per token of `generated` (then)


def _cancel_check(cancel):
    """A threading.Event (or anything with is_set()) or a callable -> a callable; None stays None."""
    if cancel is None:
        return None
    if hasattr(cancel, "is_set"):
        return cancel.is_set
    if callable(cancel):
        return cancel
    raise TypeError("cancel must be a threading.Event or a callable returning True to stop")


def drain(gen, on_text=None, on_chunk=None) -> GenerationResult:
    """Run an Engine.run generator to the end: hand each chunk's text to on_text
    and each Chunk to on_chunk (if given) and return the GenerationResult."""
    while True:
        try:
            chunk = next(gen)
        except StopIteration as e:
            return e.value
        if on_text is not None and chunk.text:
            on_text(chunk.text)
        if on_chunk is not None:
            on_chunk(chunk)


def sum_accepted(n_steps: int, n_draft_accepted: int) -> float:
    """Mean tokens committed per verification step (each step commits its bonus)."""
    return (n_steps + n_draft_accepted) / n_steps if n_steps else 0.0
