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

Cost gate.  Every step the drafter proposes a tree and the gate (gate.py)
chooses the subtree worth verifying, or nothing (a plain one-token step).
Every decode is timed with its width and the width before it; the gate's
costs learn from those timings (stepcost.py), and the speed guard (guard.py)
stops drafting in a request that drafting has made slower than plain
decoding would have been, until probes show it would pay again.

Here: the request's start (prefix reuse, prefill, first token), the step loop, the verification walk and the
commit.  A request's state and what it yields are in request.py, the answer's text in stream.py, the drafter's in feedback.py.
"""
from __future__ import annotations

import time

import numpy as np

from edgespec.backend.protocol import Backend
from edgespec.calibration.curve import CostCurve
from edgespec.core.config import EngineConfig
from edgespec.core.feedback import DrafterFeedback
from edgespec.core.gate import AcceptanceModel, Gate
from edgespec.core.guard import SpeedGuard
from edgespec.core.logprobs import token_logprobs
from edgespec.core.params import Request, Resolved, resolve
from edgespec.core.plan import StepPlan
from edgespec.core.cache_reuse import splice_request
from edgespec.core.prefix_cache import PrefixCache, common_prefix
from edgespec.core.request import RunState, chunks, count_sources, finish, over_time
from edgespec.core.result import GenerationResult
from edgespec.core.stream import TextStream
from edgespec.core.grammar_drafts import SOURCE_LABEL, SOURCE_VALUE, GrammarDrafts
from edgespec.drafters.tree import SOURCE_GRAMMAR, DraftTree, merge_chain, pad_tree
from edgespec.core.relaxed import relaxed_path
from edgespec.core.verify import sample_token
from edgespec.drafters.base import Drafter
from edgespec.errors import ConfigError
from edgespec.kernels.tree import warmup as _warmup_tree_kernels


def _child(bparent: list, btok: list, slot: int, tok: int) -> int:
    """Batch slot of the child of `slot` that carries `tok`, or -1 (plain lists:
    the first child directly follows its parent in the layout, siblings later)."""
    for t in range(slot + 1, len(btok)):
        if bparent[t] == slot and btok[t] == tok:
            return t
    return -1


class Engine:
    """Runs requests on one backend with one drafter; keeps the KV cache and the
    acceptance statistics between requests (a chat session)."""

    def __init__(self, backend: Backend, drafter: Drafter, cost: CostCurve | None,
                 config: EngineConfig | None = None):
        _warmup_tree_kernels()
        self.backend = backend
        self.drafter = drafter
        self.config = config or EngineConfig()
        if self.config.max_nodes > backend.max_nodes:
            raise ConfigError(f"max_nodes {self.config.max_nodes} exceeds the backend's {backend.max_nodes}")
        self.gate = Gate(self.config, cost)
        self.eog = backend.vocab.eog_mask()
        self._feedback = DrafterFeedback(drafter, backend, self.config.max_nodes + 1)
        self._plain = drafter.plain     # plain decoding drafts nothing, forced text included
        self.guard = SpeedGuard()
        self._clock = backend.clock
        self._prev_width = 0                    # the last decode's width (0: a prefill came between)
        self._plain_other = 0.0                 # EMA: seconds of a plain step outside decode and drafting
        self.memory = None
        """A store every request's answer is added to when it ends (edgespec.memory.MemoryStore)."""
        self.prefix_cache: PrefixCache | None = None     # saved KV prefixes, shared by a backend's engines

    # ------------------------------------------------------------------ helpers
    @property
    def cost(self) -> CostCurve | None:
        """The verify cost curve c(T) the gate uses."""
        return self.gate.cost

    def set_cost(self, cost: CostCurve | None) -> None:
        self.gate.set_cost(cost)

    @property
    def acceptance(self) -> AcceptanceModel:
        """The gate's acceptance statistics (kept between requests)."""
        return self.gate.acceptance

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

    def _relaxed_child(self, logits, bpl: list, btl: list, tree: DraftTree, plan: StepPlan) -> dict:
        """Lossy verification (VerifyConfig): the path of drafts the relaxed
        mode accepts (relaxed.relaxed_path), as {slot: its accepted child}."""
        src = [-1] + tree.source[plan.batch_nodes].tolist()
        path = relaxed_path(logits, bpl, btl, src, self.config.verify)
        return dict(zip([0] + path[:-1], path))

    # --------------------------------------------------------------------- run
    def run(self, resolved: Resolved):
        """Generator: yields a Chunk after the first token and after every step;
        its return value (StopIteration.value) is the GenerationResult.  Closing
        the generator early (or an exception such as KeyboardInterrupt) leaves
        the KV cache consistent.

        resolved: a request resolved against this engine's model
        (core.params.resolve, through SpecModel.resolve or self.resolve),
        which checked it: the engine checks nothing.  Its prompt is token ids,
        its grammar, if any, a backend Grammar (edgespec.backend.grammar):
        every committed token is the model's choice among the tokens it
        admits, drafts included; its state advances with the answer.  The
        engine reads the resolved prompt, limit, grammar and cancel, and the
        request's sampling, stop, n_indent, reuse_prefix, record_topk and logprobs; the
        request stays in the state (RunState.request)."""
        is_cancelled = cancel_check(resolved.cancel)
        st = self._start(resolved, is_cancelled)
        be = self.backend
        try:
            yield from chunks(st, 0)
            while st.stop_reason is None:
                if is_cancelled is not None and is_cancelled():
                    st.stop_reason = "cancelled"
                elif be.n_ctx - be.n_past < 1 or over_time(st):
                    st.stop_reason = "length"
                else:
                    yield from chunks(st, self._step(st))
        except BaseException:
            be.rollback()
            raise
        finally:
            self.kv_tokens = st.ctx[:be.n_past].copy()
            if self.memory is not None and st.generated:
                self.memory.add(st.generated, st.prompt)
        return (yield from finish(st, self.drafter.name, self.config.verify.mode))

    def resolve(self, request: Request) -> Resolved:
        """A request whose prompt and prediction are token ids and whose
        grammar, if any, is a compiled backend Grammar, resolved for this
        engine (the one check, core.params.resolve, with this engine's context
        and verification mode): for callers that drive an engine directly
        (the replay, tests); SpecModel.resolve resolves text, messages and schemas."""
        be = self.backend
        return resolve(request, request.prompt, n_ctx=be.n_ctx, n_vocab=be.n_vocab, verify=self.config.verify,
                       grammar=request.grammar, prediction=request.prediction,
                       splice_refusal=be.splice_refusal() if request.cache_reuse else None)

    def _start(self, resolved: Resolved, is_cancelled) -> RunState:
        """Reuse the common prefix of the KV cache, prefill the rest and
        choose the first token."""
        request, prompt, grammar = resolved.request, resolved.prompt, resolved.grammar
        st = RunState(request=request, prompt=prompt, max_tokens=resolved.limit, t_start=time.perf_counter(),
                      out=TextStream(self.backend.vocab, list(request.stop), request.n_indent))
        if self.config.history_cap is not None:
            self.acceptance.shrink(self.config.history_cap)
        sampling = request.sampling
        st.rng = np.random.default_rng(sampling.seed) if not sampling.greedy else None
        if request.logprobs is not None:
            st.n_logprobs, st.lp = request.logprobs, []
        st.grammar = grammar
        if request.stop_tokens:
            st.eog = self.eog.copy()
            st.eog[list(request.stop_tokens)] = True
        if grammar is not None and self.config.forced_drafts and not self._plain:
            st.gdrafts = GrammarDrafts(grammar, self.backend.vocab, self.backend.vocab.detokenize(prompt))
        st.topk_walk = bool(self._feedback.topk) and sampling.greedy and grammar is None
        self._reuse_prefix(st, request.reuse_prefix)
        pre, hid = self._prefill(st, is_cancelled)
        if st.stop_reason is not None:      # cancelled during the prefill
            return st
        self.kv_tokens = prompt.copy()
        self.drafter.begin(prompt)
        self.guard.begin()
        self._prev_width = 0
        self._feedback.prefilled(st.n_common, pre, hid)
        self._first_token(st)
        return st

    def _reuse_prefix(self, st: RunState, reuse_prefix: bool) -> None:
        """With reuse_prefix, keep the KV cells of the longest prefix the cache (or a saved one:
        core/prefix_cache.py) and the prompt share (all but the prompt's last token at most, whose
        logits choose the first token); drop every other cell.  With cache_reuse too, splice instead
        where a chunk after an edit can be kept (core/cache_reuse.py).  An exact request (cache_reuse
        0) never reads a cell a splice made: the cache is cut before the first."""
        be, prompt, pc = self.backend, st.prompt, self.prefix_cache
        min_chunk = st.request.cache_reuse if reuse_prefix else 0
        if be.spliced_from is not None and not min_chunk:
            be.truncate(be.spliced_from)
        if pc is not None:
            st.n_common = pc.choose(be, prompt, reuse_prefix)
        elif reuse_prefix:
            st.n_common = common_prefix(self.kv_tokens, prompt, len(prompt) - 1)
        if reuse_prefix and not min_chunk:      # another request slot may hold more of it
            st.n_common = be.borrow(prompt, st.n_common)
        if min_chunk and splice_request(be, st, min_chunk):
            pass                # the cells of A + X + B are held: st.n_common of them
        elif st.n_common == 0:
            be.reset()
        else:
            be.truncate(st.n_common)
        self.kv_tokens = prompt[:st.n_common].copy()

    def _prefill(self, st: RunState, is_cancelled):
        """Prefill the prompt past the reused prefix and lay it into st.ctx;
        returns the drafter's prefill buffers (DrafterFeedback.prefill_buffers).
        A cancel during the prefill ends the request (stop_reason "cancelled")."""
        be, prompt, t0 = self.backend, st.prompt, self._clock()     # a slot's clock skips its waits for others
        pre, hid = self._feedback.prefill_buffers(len(prompt) - st.n_common)
        try:
            be.prefill(prompt[st.n_common:], topk_out=pre, cancel=is_cancelled, hidden_out=hid)
        except BaseException:
            self.reset()
            raise
        if self.prefix_cache is not None:       # the rate a disk read is weighed against
            self.prefix_cache.observe_prefill(be.n_past - st.n_common, self._clock() - t0)
        st.ctx = np.empty(be.n_ctx + self.config.max_nodes + 2, np.int32)
        st.ctx[:len(prompt)] = prompt
        st.n = len(prompt)
        if be.n_past < st.n_common + len(prompt[st.n_common:]):     # cancelled during the prefill
            st.stop_reason = "cancelled"
            st.n = be.n_past
            st.t_prefill = time.perf_counter()
        return pre, hid

    def _first_token(self, st: RunState) -> None:
        """Choose the first token from the prompt's last logits and commit it."""
        be = self.backend
        first = self._pick(st, be.logits(), 0)
        if st.record_topk:
            from edgespec.kernels.topk import topk_rows
            st.rec_rows = np.arange(self.config.max_nodes + 1, dtype=np.int64)
            st.rec_buf = np.zeros((self.config.max_nodes + 1, st.record_topk), np.int32)
            topk_rows(be.logits(), st.rec_rows, 1, st.record_topk, st.rec_buf)
            st.topk_log.append(st.rec_buf[:1].copy())
        st.t_prefill = time.perf_counter()
        st.ctx[st.n] = first
        st.n += 1
        st.pending = first
        if st.lp is not None:
            st.lp.extend(token_logprobs(be.logits()[:1], [first], st.n_logprobs))
        self._commit(st, [first])

    def _commit(self, st: RunState, toks: list[int], n_drafted: int = 0) -> None:
        """Append committed tokens to the answer in order, stopping at the first
        end-of-generation token, at max_tokens or at a completed stop string
        (st.stop_reason is set then); the first n_drafted were drafts."""
        cut = len(toks)
        eog = st.eog if st.eog is not None else self.eog
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
            st.stop_reason = "length" if st.out.indent_cut else "stop"     # llama-server's stop_type limit

    def _step(self, st: RunState) -> int:
        """One step: propose, gate, verify the batch, keep the accepted cells,
        learn, commit.  Returns how many committed tokens were drafts."""
        be, g = self.backend, self.gate
        t_step = self._clock()
        budget = min(self.config.max_nodes, be.n_ctx - be.n_past)
        n_past = be.n_past
        hold = 0 if self._plain else (self.config.held_width(budget) or g.held_width(budget))
        drafting = bool(hold) or self._may_draft()
        probe = not drafting and self.guard.probing(st.n - 1)
        tree = self._propose(st, budget) if (drafting or probe) else self._no_drafts(st)
        tree = pad_tree(tree, st.ctx[:st.n], hold - 1)      # a held width: at least hold-1 nodes
        t_prop = self._clock()
        plan = g.choose(tree, hold or budget, n_past, self._prev_width, gated=not hold)
        if (drafting or probe) and not self._plain:     # the hold chooser's evidence (core/hold.py)
            g.judge_hold(tree, budget, n_past)
        if probe and plan.n_nodes:         # blocked by the guard: judged, not verified
            self.guard.start_probe(st.n - 1, tree.tokens[plan.nodes], plan.node_parent, g.chosen_cost(plan.n_nodes))
            plan = g.plain()
        k = plan.n_nodes
        if self.config.shadow and len(tree) and budget > 1:
            g.record_shadow(st.shadow, st.n - 1, tree, plan)
        btok = np.full(plan.width, st.pending, np.int32)
        if k:
            btok[1:] = tree.tokens[plan.batch_nodes]
        t0 = self._clock()
        be.decode_tree(btok, plan.depth, plan.leaf_first, plan.leaf_count, plan.n_leaves)
        logits = be.logits()
        t1 = self._clock()
        g.observe_decode(plan.width, self._prev_width, t1 - t0, n_past)
        self._prev_width = plan.width
        st.t_decode_calls += t1 - t0
        st.n_steps += 1
        slot, accepted, carried = self._verify(st, logits, tree, btok, plan)
        be.keep(slot + 1)
        if st.record_topk:
            from edgespec.kernels.topk import topk_rows
            assert st.rec_buf is not None       # _first_token made it
            topk_rows(logits, st.rec_rows, slot + 1, st.record_topk, st.rec_buf)
            st.topk_log.append(st.rec_buf[:slot + 1].copy())
        self._count(st, tree, plan, slot, carried)
        if st.lp is not None:       # accepted[i] was chosen from row i
            st.lp.extend(token_logprobs(logits, accepted, st.n_logprobs))
        # every accepted token enters the context (its KV cell may already be kept)
        na = len(accepted)
        st.ctx[st.n:st.n + na] = accepted
        st.n += na
        self._commit(st, accepted, slot)
        st.pending = accepted[-1]
        if st.shadow:
            st.shadow = g.learn_shadow(st.shadow, st.ctx, st.n)
        self.guard.judge(st.ctx, st.n)
        if self._feedback.observes:
            self._feedback.observe(st.ctx[:st.n], accepted, logits, tree, btok, plan, slot, st.topk_walk,
                                   g.t1(st.n) if g.timed else 0.0, t1 - t0)
        self._account(st, k, n_past, na, self._clock() - t_step, t1 - t0, t_prop - t_step)
        return slot

    def _count(self, st: RunState, tree: DraftTree, plan: StepPlan, slot: int, carried) -> None:
        """A verified step's counts, and what the acceptance model learns from it."""
        if carried is not None:
            st.n_carried += 1
        if plan.n_nodes:
            st.n_draft_steps += 1
            st.n_draft_nodes += plan.n_nodes
            st.n_draft_accepted += slot
            if slot:
                count_sources(st.by_source, tree.source[plan.batch_nodes[:slot]])
            self.gate.learn(tree, plan, slot, carried)

    def _may_draft(self) -> bool:
        """Whether the guard lets this step draft (always where it is off, costs are unmeasured or --no-gate)."""
        return not (self.config.guard and self.config.cost_gate and self.gate.steps is not None) or self.guard.allows()

    @staticmethod
    def _no_drafts(st: RunState) -> DraftTree:
        st.carry = np.zeros(0, np.int32)       # a carried chain is a draft too
        return DraftTree.empty()

    def _account(self, st: RunState, k: int, n_past: int, n_committed: int, step_s: float, decode_s: float,
                 propose_s: float) -> None:
        """Book a step's time: the gate's overhead term, the plain step's
        own work outside its decode (what plain decoding spends there) and
        the guard's balance against a plain step."""
        other = step_s - decode_s
        self.gate.note_step_time(other, st.n)
        if k == 0:
            self._plain_other += 0.1 * (max(0.0, other - propose_s) - self._plain_other)
        plain = self.gate.plain_s(n_past)
        if plain > 0:
            self.guard.account(step_s, n_committed, plain + self._plain_other)

    def _propose(self, st: RunState, budget: int) -> DraftTree:
        """The drafter's tree for this step, with the chain carried over from
        the last step and the text the grammar forces merged in."""
        tree = self.drafter.propose(st.ctx[:st.n], budget - 1) if budget > 1 else DraftTree.empty()
        if len(st.carry):
            tree = merge_chain(tree, st.carry, self.config.carry_prob)
            st.carry = np.zeros(0, np.int32)
        if st.gdrafts is not None and budget > 1:
            tree = self._grammar_drafts(st, tree, budget - 1)
        return tree

    def _verify(self, st: RunState, logits, tree: DraftTree, btok: np.ndarray, plan: StepPlan):
        """Walk the batch from the root along children that carry the model's own
        token.  Returns (last committed slot, committed tokens: accepted drafts
        then the bonus, the slots carried past a batch hole or None)."""
        slot = 0
        accepted: list[int] = []
        carried = None
        bpl, btl = plan.slot_parent.tolist(), btok.tolist()
        # relaxed modes: the accepted path is decided over the whole tree first
        nxt = self._relaxed_child(logits, bpl, btl, tree, plan) if plan.n_nodes and not self.config.verify.exact else None
        while True:
            tok = self._pick(st, logits, slot)
            accepted.append(tok)
            if nxt is None:
                c = _child(bpl, btl, slot, tok)
            else:
                c = nxt.get(slot, -1)
                if c >= 0 and btl[c] != tok:    # LOSSY: commit the draft token the relaxed rule accepted
                    accepted[-1] = btl[c]
                    st.n_relaxed += 1
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

    def _grammar_drafts(self, st: RunState, tree: DraftTree, room: int) -> DraftTree:
        """The proposal with the text the grammar forces next merged in (and
        under it the value a prompt label gives its key), or, where nothing
        is forced, the prompt text the answer is copying (core/grammar_drafts.py)."""
        gd, text = st.gdrafts, st.out.text
        assert gd is not None                   # _propose calls this only with them
        ftext, forced = gd.forced(text)
        if len(forced):
            st.n_forced += 1
            forced = forced[:room]
            tree = merge_chain(tree, forced, self.config.forced_prob, SOURCE_GRAMMAR)
            label = gd.labelled(text + ftext, forced, room - len(forced))
            if len(label):
                tree = merge_chain(tree, np.concatenate([forced, label]), self.config.copy_prob, SOURCE_LABEL,
                                    start=len(forced))
            return tree
        for chain in gd.copied(text, room):
            tree = merge_chain(tree, chain, self.config.copy_prob, SOURCE_VALUE)
        return tree

    def _pick(self, st: RunState, logits, slot: int) -> int:
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
            return self._feedback.walk_argmax(logits, slot)
        if st.rng is None:
            return int(logits[slot].argmax())   # = sample_token(..., greedy), without the call
        return sample_token(logits[slot], st.sampling, st.rng.random())


def cancel_check(cancel):
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

