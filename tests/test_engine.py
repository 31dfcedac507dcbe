"""Exactness of the engine on the real model: greedy output must be token-identical
to plain decoding (`none`) through the same backend, for the real drafter and for
forced tree shapes; the KV cache must end up equal to plain decoding's."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.drafters import make_drafter
from edgespec.core.config import EngineConfig
from edgespec.core.engine import Engine, drain
from edgespec.core.params import Request

from conftest import OracleDrafter, dev_prompts

MAX_TOKENS = 96


def prompt_of(model, row):
    return model.prompt_tokens([{"role": "user", "content": row["turns"][0]}])


def plain(model, toks, max_tokens=MAX_TOKENS, **kw):
    return model.generate(toks, max_tokens=max_tokens, drafter="none", **kw)


def final_logits(model, engine, prompt, tokens):
    """Logits of the last generated token decoded on top of the KV cache the run
    left behind (truncated to prompt + all but the last token): equal caches give
    bit-identical logits."""
    be = model.backend
    keep = len(prompt) + len(tokens) - 1
    assert be.n_past >= keep, "the engine lost committed KV cells"
    be.truncate(keep)
    be.decode_tree(np.array([tokens[-1]], np.int32), np.zeros(1, np.int32),
                   np.zeros(1, np.int32), np.ones(1, np.int32), 1)
    out = be.logits()[0].copy()
    be.keep(0)
    engine.reset()
    return out


_PLAIN: dict = {}   # plain-decoding references (and final logits) shared by the tests below


def reference(model, row, max_tokens=MAX_TOKENS, with_logits=False):
    """Plain decoding of a dev prompt (cached per question and length), and
    with_logits the logits final_logits gives on the KV cache it left."""
    key = (row["question_id"], max_tokens)
    if key not in _PLAIN or (with_logits and _PLAIN[key][1] is None):
        toks = prompt_of(model, row)
        ref = plain(model, toks, max_tokens=max_tokens)
        lg = final_logits(model, model.engine_for("none"), toks, ref.tokens) if with_logits else None
        _PLAIN[key] = (ref, lg)
    return _PLAIN[key]


def test_suffix_drafter_identical_on_dev_prompts(model):
    """One dev prompt of each of the 13 categories (the longest, summarization and
    rag, past 512 cells): the suffix drafter's greedy output equals plain
    decoding's, token for token, and drafts were actually verified and accepted."""
    rows = dev_prompts(128, 136, 152, 112, 424, 352, 532, 108, 100, 144, 296, 184, 84)
    assert len({r["category"] for r in rows}) == 13
    suffix = model.engine_for("suffix")
    suffix.config.cost_gate = False       # verify every proposal: the hardest case
    drafted = accepted = 0
    try:
        for row in rows:
            toks = prompt_of(model, row)
            ref = reference(model, row)[0]
            r = model.generate(toks, max_tokens=MAX_TOKENS, drafter="suffix")
            assert r.tokens == ref.tokens, f"question {row['question_id']} ({row['category']}) diverged"
            assert r.stop_reason == ref.stop_reason
            drafted += r.n_draft_nodes
            accepted += r.n_draft_accepted
    finally:
        suffix.config.cost_gate = True
    assert drafted > 100 and accepted > 20, (drafted, accepted)


def test_suffix_drafter_with_cost_gate_identical(model):
    for row in dev_prompts(128, 136, 156, 112, 444, 324):
        toks = prompt_of(model, row)
        ref = reference(model, row)[0]
        r = model.generate(toks, max_tokens=MAX_TOKENS, drafter="suffix")
        assert r.tokens == ref.tokens


@pytest.mark.parametrize("name", ["trigram", "adjacency", "auto"])
def test_other_drafters_identical_on_dev_prompts(model, name):
    """The tri-gram, adjacency and hybrid drafters, cost gate off (every proposed
    node verified, up to 32 per step): greedy output equals plain decoding on 4 prompts of different
    categories, and their drafts are really verified and sometimes accepted."""
    eng = model.engine_for(name)
    eng.config.cost_gate = False
    drafted = accepted = 0
    try:
        for row in dev_prompts(124, 140, 464, 324):
            toks = prompt_of(model, row)
            ref = reference(model, row, 64)[0]
            r = model.generate(toks, max_tokens=64, drafter=name)
            assert r.tokens == ref.tokens, f"{name}: question {row['question_id']} ({row['category']}) diverged"
            drafted += r.n_draft_nodes
            accepted += r.n_draft_accepted
    finally:
        eng.config.cost_gate = True
    assert drafted > 50 and accepted > 5, (drafted, accepted)


SHAPES = ["chain", "fan", "max", "wrong", "ranked"]


@pytest.mark.parametrize("shape", SHAPES)
def test_forced_tree_shapes_identical_and_kv_exact(model, shape):
    """Deep chains, wide fans whose right token is ranked last (so the accepted path
    is not first in batch order), full-budget trees, all-wrong trees: the output is
    token-identical to plain decoding and the final KV cache gives bit-identical
    logits."""
    rows = dev_prompts(128, 132, 156, 112)
    be = model.backend
    for k, row in enumerate(rows):
        toks = prompt_of(model, row)
        ref, ref_logits = reference(model, row, 64, with_logits=True)
        drafter = OracleDrafter(len(toks), ref.tokens, shape, be.n_vocab, width=4, depth=6, seed=k)
        eng = Engine(be, drafter, model.cost, EngineConfig(max_nodes=32, cost_gate=False))
        res = drain(eng.run(eng.resolve(Request(toks, max_tokens=64, reuse_prefix=False))))
        assert res.tokens == ref.tokens, f"{shape}: question {row['question_id']} diverged"
        spec_logits = final_logits(model, eng, toks, res.tokens)
        assert np.array_equal(spec_logits, ref_logits), \
            f"{shape}: KV cache differs (max |dlogit| {np.abs(spec_logits - ref_logits).max()})"
        if shape == "chain":
            assert res.mean_accepted > 3.0
        if shape in ("fan", "max"):
            assert res.n_carried > 0, "the accepted path was never off the first batch path"
            assert res.mean_accepted > 1.5
        if shape == "wrong":
            assert res.n_draft_accepted == 0 and res.n_draft_nodes > 0


def test_eog_inside_accepted_draft_ends_answer(model):
    """A short answer; the oracle drafts the rest of the answer, the end-of-generation
    token and junk after it, all in one chain: nothing after the EOG is emitted."""
    toks = model.prompt_tokens([{"role": "user", "content": "Say only the word: yes"}])
    ref = plain(model, toks, max_tokens=40)
    assert ref.stop_reason == "stop" and len(ref.tokens) < 30
    eos = [t for t in range(model.backend.n_vocab) if model.backend.vocab.is_eog(t)][0]
    drafter = OracleDrafter(len(toks), ref.tokens, "chain", model.backend.n_vocab, depth=40,
                            extra=[eos, 1000, 1001, 1002])
    eng = Engine(model.backend, drafter, model.cost, EngineConfig(max_nodes=48, cost_gate=False))
    res = drain(eng.run(eng.resolve(Request(toks, max_tokens=40, reuse_prefix=False))))
    assert res.tokens == ref.tokens
    assert res.text == ref.text
    assert res.stop_reason == "stop"
    assert res.n_steps == 1, "the whole answer and the EOG should come in one accepted draft"


def test_stop_string_and_max_tokens_inside_accepted_draft(model):
    toks = model.prompt_tokens([{"role": "user", "content": "List the days of the week, comma separated."}])
    ref = plain(model, toks, max_tokens=40)
    words = ref.text.split()
    assert len(words) >= 4
    stop = words[3]
    cut = ref.text.index(stop)
    drafter = OracleDrafter(len(toks), ref.tokens, "chain", model.backend.n_vocab, depth=40)
    eng = Engine(model.backend, drafter, model.cost, EngineConfig(max_nodes=48, cost_gate=False))
    res = drain(eng.run(eng.resolve(Request(toks, max_tokens=40, stop=[stop], reuse_prefix=False))))
    assert res.stop_reason == "stop"
    assert res.text == ref.text[:cut]
    assert stop not in res.text
    assert res.tokens == ref.tokens[:len(res.tokens)]
    assert model.detokenize(res.tokens) == res.text[:len(model.detokenize(res.tokens))]
    # streaming never shows the stop string either
    pieces = [c.text for c in model.stream(toks, max_tokens=40, stop=[stop], drafter="none")]
    assert "".join(pieces) == ref.text[:cut]
    # max_tokens inside an accepted chain
    drafter = OracleDrafter(len(toks), ref.tokens, "chain", model.backend.n_vocab, depth=30)
    eng = Engine(model.backend, drafter, model.cost, EngineConfig(max_nodes=48, cost_gate=False))
    res = drain(eng.run(eng.resolve(Request(toks, max_tokens=7, reuse_prefix=False))))
    assert res.tokens == ref.tokens[:7] and res.stop_reason == "length"


def test_full_context_stops_with_length(model):
    """A context that fills up ends with stop reason 'length', never a crash, and
    the tree drafter still matches plain decoding."""
    from edgespec import SpecModel
    small = SpecModel(model.model_path, drafter="none", n_ctx=256)     # the smallest context
    try:
        toks = small.prompt_tokens("Repeat the word cat twenty times: cat cat cat cat")
        ref = small.generate(toks, max_tokens=500, drafter="none")
        assert ref.stop_reason == "length"
        n_ctx = small.backend.n_ctx      # llama.cpp may round the request up
        assert len(toks) + ref.n_generated <= n_ctx + 1
        assert len(toks) + ref.n_generated >= n_ctx - 1
        drafter = make_drafter("suffix")
        eng = Engine(small.backend, drafter, small.cost, EngineConfig(max_nodes=32, cost_gate=False))
        res = drain(eng.run(eng.resolve(Request(toks, max_tokens=500, reuse_prefix=False))))
        assert res.tokens == ref.tokens and res.stop_reason == "length"
        with pytest.raises(ValueError, match="does not fit the context"):
            small.generate("word " * (small.backend.n_ctx + 10), max_tokens=5)
    finally:
        small.close()


def test_chat_turns_reuse_cache_and_stay_identical(model):
    msgs = [{"role": "user", "content": "Name three colors."}]
    outs = {}
    for d in ("none", "suffix"):
        model.use_drafter(d)
        r1 = model.chat(msgs, max_tokens=40)
        m2 = msgs + [{"role": "assistant", "content": r1.text},
                     {"role": "user", "content": "Now repeat them in reverse order."}]
        r2 = model.chat(m2, max_tokens=40)
        assert r2.n_reused_tokens > r1.n_prompt_tokens - 1
        outs[d] = (r1.tokens, r2.tokens)
    model.use_drafter("none")
    assert outs["none"] == outs["suffix"]


def test_fit_messages_drops_the_oldest_turns_first(model):
    """A conversation longer than the context loses whole turns from its start
    (after the system message), keeps its last message, and then fits."""
    long = "The quick brown fox jumps over the lazy dog. " * 40          # ~400 tokens
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(4):
        msgs += [{"role": "user", "content": f"Turn {i}: {long}"}, {"role": "assistant", "content": long}]
    msgs.append({"role": "user", "content": "And now?"})
    n_ctx = model.backend.n_ctx
    assert len(model.prompt_tokens(msgs)) > n_ctx - 100          # the whole list does not fit
    kept, dropped = model.fit_messages(msgs, reserve=100)
    assert len(model.prompt_tokens(kept)) <= n_ctx - 100
    assert dropped > 0 and len(kept) == len(msgs) - dropped and dropped % 2 == 0
    assert kept[0] == msgs[0] and kept[1]["role"] == "user" and kept[-1] == msgs[-1]
    assert kept[1:] == msgs[1 + dropped:]                             # the newest turns, in order
    # one turn fewer would not have fitted: nothing was dropped needlessly
    assert len(model.prompt_tokens([msgs[0]] + msgs[dropped - 1:])) > n_ctx - 100
    assert len(msgs) == 10                                            # the input list is untouched
    assert model.fit_messages(msgs[-3:], reserve=100) == (msgs[-3:], 0)
    # a last message that alone does not fit is kept (chat() then says it is too long)
    huge = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": long * 6}]
    assert model.fit_messages(huge) == ([huge[-1]], 2)


def test_interrupted_generation_leaves_consistent_cache(model):
    """Closing the stream mid-way (what Ctrl-C in chat does) keeps the KV cache equal
    to the committed tokens, so the next request is still exact."""
    toks = model.prompt_tokens("Write a long story about a dragon.")
    ref = plain(model, toks, max_tokens=48)
    gen = model.stream(toks, max_tokens=48, drafter="suffix")
    for i, _ in enumerate(gen):
        if i == 5:
            break
    gen.close()
    eng = model.engine_for("suffix")
    assert len(eng.kv_tokens) == model.backend.n_past
    r = model.generate(toks, max_tokens=48, drafter="suffix", reuse_prefix=True)
    assert r.tokens == ref.tokens


def test_plan_step_ignores_stale_scratch_entries():
    """Regression: the gate once ranked the whole scratch buffer, so a small tree
    after a large one could select node indices beyond the tree."""
    from edgespec.kernels.tree import N_SCORE_BUCKETS as NSB, PlanScratch, plan_step
    n_c = np.zeros((5, NSB)); n_f = np.zeros((5, NSB, 4))
    cost = 1.0 + 0.01 * np.arange(40, dtype=np.float64)   # a flat, GPU-like curve: take all
    cost[0] = 0.0
    out = PlanScratch.zeros(64, 33)
    out.q[:] = 0.99                                 # stale, better than any real node
    parents = np.array([-1, 0, 1], np.int32)        # a chain of three
    probs = np.array([0.5, 0.5, 0.5], np.float32)
    k, nl = plan_step(parents, probs, np.zeros(3, np.int8), (n_c, n_c.copy(), n_f, n_f.copy()), 4.0, 8.0,
                      cost, 0.0, 16, True, out)
    assert k == 3 and sorted(out.sel[:k]) == [0, 1, 2]
    assert list(out.spar[:3]) == [-1, 0, 1] and nl == 1


def test_plan_step_discounts_a_source_whose_scores_run_high():
    """A source whose nodes were accepted at half their score (in buckets 0.8-0.9)
    gets half its score as the prior in a bucket it was never tested in; an
    untested source keeps its score."""
    from edgespec.kernels.tree import N_SCORE_BUCKETS as NSB, PlanScratch, plan_step
    n_c = np.zeros((5, NSB)); a_c = np.zeros((5, NSB)); n_f = np.zeros((5, NSB, 4))
    n_c[2, 8] = 1000.0; a_c[2, 8] = 425.0             # score mass 850 -> factor (425+4)/(850+4) ~ 0.502
    cost = np.arange(40, dtype=np.float64)             # a CPU-like curve; only the estimates matter here
    out = PlanScratch.zeros(8, 9)
    parents = np.array([-1, -1], np.int32)
    probs = np.array([0.35, 0.35], np.float32)          # bucket 3: no counts for either source
    plan_step(parents, probs, np.array([2, 1], np.int8), (n_c, a_c, n_f, n_f.copy()), 4.0, 8.0,
              cost, 0.0, 8, True, tuple(out))           # as the engine passes it: a plain tuple
    assert out.cond[0] == pytest.approx(0.35 * 429 / 854, rel=1e-5)
    assert out.cond[1] == pytest.approx(0.35, rel=1e-5)


def test_score_buckets_resolve_near_certain_scores():
    """Tenths up to 0.9, then halving 1 - score: a copy scored 0.96 and one
    scored 0.995 are calibrated apart, and each bucket's counts move only its
    own estimate."""
    from edgespec.kernels.tree import N_SCORE_BUCKETS as NSB, SCORE_EDGES, PlanScratch, plan_step, score_bucket
    assert [score_bucket(x) for x in (0.0, 0.05, 0.55, 0.89, 0.9, 0.96, 0.98, 0.99, 0.995, 1.0, 1.5)] == \
        [0, 0, 5, 8, 9, 10, 11, 12, 13, 13, 13]
    assert NSB == len(SCORE_EDGES) - 1 and score_bucket(-1.0) == 0
    n_c = np.zeros((5, NSB)); a_c = np.zeros((5, NSB)); n_f = np.zeros((5, NSB, 4))
    n_c[0, 10] = 1000.0; a_c[0, 10] = 800.0             # scored ~0.96, accepted 80%
    n_c[0, 13] = 1000.0; a_c[0, 13] = 999.0             # scored ~0.995, accepted 99.9%
    out = PlanScratch.zeros(8, 9)
    plan_step(np.array([-1, -1], np.int32), np.array([0.96, 0.995], np.float32), np.zeros(2, np.int8),
              (n_c, a_c, n_f, n_f.copy()), 4.0, 8.0, np.arange(40, dtype=np.float64), 0.0, 8, True, tuple(out))
    assert out.cond[0] == pytest.approx(0.8, abs=0.02) and out.cond[1] == pytest.approx(0.999, abs=0.002)


def _long_context_tokens(model, n):
    text = dev_prompts(532)[0]["turns"][0]         # a rag prompt of 793 tokens
    toks = model.vocab.tokenize(text)
    assert len(toks) >= n
    return np.asarray(toks[:n], np.int32)


def _singles_and_batch(be, prefix, chain):
    """Logits of `chain` decoded one token at a time after `prefix`, and the
    same tokens decoded as one batch (threads as the backend chooses)."""
    be.reset()
    be.prefill(prefix, want_last_logits=False)
    singles = []
    for t in chain:
        be.decode_tree(np.array([t], np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32), np.ones(1, np.int32), 1)
        singles.append(be.logits()[0].copy())
        be.keep(1)
    threads_single = be._single_threads
    be.reset()
    be.prefill(prefix, want_last_logits=False)
    n = len(chain)
    be.decode_tree(np.asarray(chain, np.int32), np.arange(n, dtype=np.int32), np.zeros(n, np.int32),
                   np.ones(n, np.int32), 1)
    batch = be.logits().copy()
    be.reset()
    return np.array(singles), batch, threads_single


def test_q8_k_cache_is_exact_with_every_thread_past_512_cells(model):
    """The default CPU cache (q8_0 K) lets one-token decodes past 512 KV cells run
    on every thread (llama.cpp's split-KV path is f16/f32 only) and still give
    logits bit-identical to a verification batch of the same tokens."""
    be = model.backend
    assert be.cache_type_k == "q8_0" and be.one_thread_after is None
    toks = _long_context_tokens(model, 720)
    singles, batch, threads = _singles_and_batch(be, toks[:700], toks[700:716])
    assert threads == be.n_threads
    assert np.array_equal(singles, batch), f"max |dlogit| {np.abs(singles - batch).max()}"


def test_f16_k_cache_decodes_single_tokens_on_one_thread_past_256_cells(model):
    """With llama.cpp's default f16 K cache the backend keeps exactness by decoding
    one token on one thread past 256 cells (batches on every thread)."""
    from edgespec.backend.llama import LlamaBackend

    be = LlamaBackend(model.model_path, n_ctx=1024, max_nodes=16, max_leaves=4, cache_type_k="f16")
    try:
        assert be.one_thread_after == 256
        toks = _long_context_tokens(model, 720)
        singles, batch, threads = _singles_and_batch(be, toks[:700], toks[700:712])
        assert threads == (1 if be.n_threads > 1 else be.n_threads)
        assert np.array_equal(singles, batch), f"max |dlogit| {np.abs(singles - batch).max()}"
    finally:
        be.close()
    with pytest.raises(ValueError, match="cache_type_k"):
        LlamaBackend(model.model_path, n_ctx=256, cache_type_k="q4_0")


def _fake_sysfs(root, siblings: dict) -> str:
    for cpu, sib in siblings.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(sib + "\n")
    return str(root)


def test_default_threads_counts_physical_cores(tmp_path, monkeypatch):
    """One thread per physical core in the affinity mask: hardware threads that
    list the same siblings are one core; without sysfs, every allowed CPU."""
    import os

    from edgespec.backend.process import default_threads
    # 4 cores with 2 hardware threads each, numbered as Linux does (0-3, then 4-7)
    sysfs = _fake_sysfs(tmp_path / "smt", {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert default_threads(sysfs) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 4, 1})   # two threads of core 0, one of core 1
    assert default_threads(sysfs) == 2
    # no SMT (this project's machine): every CPU is a core
    plain = _fake_sysfs(tmp_path / "plain", {0: "0", 1: "1"})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert default_threads(plain) == 2
    # no topology to read: every allowed CPU
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert default_threads(str(tmp_path / "missing")) == 3


def test_chunks_carry_tokens_and_which_text_came_from_drafts(model):
    """Engine.run yields Chunks: their texts join to the answer, their tokens to
    the answer's tokens, the drafted counts to n_draft_accepted, and each
    chunk's spans cover its text exactly, drafted text only where drafts were
    accepted."""
    from edgespec.core.stream import Chunk
    toks = model.prompt_tokens("Write a long story about a dragon.")
    ref = plain(model, toks, max_tokens=48)
    drafter = OracleDrafter(len(toks), ref.tokens, "chain", model.backend.n_vocab, depth=5)
    eng = Engine(model.backend, drafter, model.cost, EngineConfig(max_nodes=32, cost_gate=False))
    chunks = []
    res = drain(eng.run(eng.resolve(Request(toks, max_tokens=48, reuse_prefix=False))), on_chunk=chunks.append)
    assert res.tokens == ref.tokens
    assert all(isinstance(c, Chunk) for c in chunks)
    assert "".join(c.text for c in chunks) == res.text
    assert sum((c.tokens for c in chunks), []) == res.tokens
    assert sum(c.n_drafted for c in chunks) == res.n_draft_accepted > 10
    for c in chunks:
        assert "".join(s for s, _ in c.spans) == c.text
        assert 0 <= c.n_drafted < max(2, len(c.tokens) + 1)
        if c.n_drafted == 0:
            assert not any(d for _, d in c.spans)
    drafted_text = "".join(s for c in chunks for s, d in c.spans if d)
    assert 0 < len(drafted_text) < len(res.text)
    # plain decoding: one token a chunk, nothing drafted
    plain_chunks = []
    none = model.engine_for("none")
    drain(none.run(none.resolve(Request(toks, max_tokens=12, reuse_prefix=False))), on_chunk=plain_chunks.append)
    assert all(len(c.tokens) <= 1 and c.n_drafted == 0 for c in plain_chunks)


@pytest.mark.parametrize("kind", ["event", "callable"])
def test_cancel_stops_within_a_step_and_keeps_the_cache_exact(model, kind):
    """cancel= (an Event or a callable) set from the consumer ends the answer at
    the next step with stop_reason 'cancelled'; the KV cache holds exactly the
    committed tokens, so the next request is identical to a fresh one."""
    import threading
    toks = model.prompt_tokens("Write a long story about a dragon.")
    ref = plain(model, toks, max_tokens=48)
    ev = threading.Event()
    cancel = ev if kind == "event" else ev.is_set
    # without the memory of earlier requests: from it (ref's answer is there)
    # the whole answer would come in fewer than three steps
    eng = model.engine_for("suffix-nomemory")
    gen = eng.run(eng.resolve(Request(toks, max_tokens=48, cancel=cancel, reuse_prefix=False)))
    n_chunks = 0
    while True:
        try:
            next(gen)
        except StopIteration as e:
            res = e.value
            break
        n_chunks += 1
        if n_chunks == 3:
            ev.set()
    assert n_chunks == 3, "no chunk may follow the one after which cancel was set"
    assert res.stop_reason == "cancelled"
    assert 3 <= len(res.tokens) < 48 and res.tokens == ref.tokens[:len(res.tokens)]
    assert len(eng.kv_tokens) == model.backend.n_past
    r = model.generate(toks, max_tokens=48, drafter="suffix", reuse_prefix=True)
    assert r.tokens == ref.tokens
    # cancelled before the first step: only the first token
    ev2 = threading.Event(); ev2.set()
    r0 = drain(eng.run(eng.resolve(Request(toks, max_tokens=48, cancel=ev2, reuse_prefix=False))))
    assert r0.stop_reason == "cancelled" and r0.tokens == ref.tokens[:1]
    with pytest.raises(TypeError):
        drain(eng.run(eng.resolve(Request(toks, max_tokens=4, cancel=3, reuse_prefix=False))))


def test_pad_tree_fills_a_held_width_with_the_last_successors():
    """pad_tree (hand-written context): the tokens that followed the last
    token where it occurred before, then that token repeated; a proposal
    already big enough is left as it is; nodes the chain shares are reused."""
    from edgespec.drafters.tree import FILLER_PROB, SOURCE_CONTEXT, SOURCE_FILLER, DraftTree, pad_tree
    ctx = np.array([5, 7, 8, 9, 1, 5], np.int32)
    t = pad_tree(DraftTree.empty(), ctx, 3)
    assert t.tokens.tolist() == [7, 8, 9] and t.parents.tolist() == [-1, 0, 1]
    assert set(t.source.tolist()) == {SOURCE_FILLER} and np.allclose(t.probs, FILLER_PROB)
    t = pad_tree(DraftTree.empty(), np.array([3, 4, 5], np.int32), 2)      # 5 never occurred before
    assert t.tokens.tolist() == [5, 5] and t.parents.tolist() == [-1, 0]
    big = DraftTree(np.array([7, 8], np.int32), np.array([-1, 0], np.int32),
                    np.array([0.9, 0.8], np.float32), np.array([SOURCE_CONTEXT] * 2, np.int8))
    assert pad_tree(big, ctx, 2) is big
    t = pad_tree(big, ctx, 4)          # shares 7, 8 with the chain 7 8 9 (5 5): then a node below 8
    assert len(t) >= 4 and t.tokens[:2].tolist() == [7, 8] and t.tokens[2] == 9 and t.parents[2] == 1
    assert t.source[:2].tolist() == [SOURCE_CONTEXT] * 2 and (t.probs[:2] >= 0.8).all()


@pytest.mark.parametrize("width", [2, 4])
def test_held_width_verifies_every_step_at_that_width_and_stays_identical(model, width):
    """EngineConfig.hold_width (`suffix@holdN`): every decode after the first
    token is a batch of exactly `width` tokens, padded where the drafter has
    fewer, and the greedy output equals plain decoding's."""
    be = model.backend
    widths: list[int] = []
    eng = Engine(be, make_drafter("suffix"), model.cost, EngineConfig(max_nodes=32, hold_width=width))
    orig = be.decode_tree

    def record(tokens, *a):
        widths.append(len(tokens))
        return orig(tokens, *a)
    be.decode_tree = record
    try:
        for row in dev_prompts(124, 140):
            toks = prompt_of(model, row)
            ref = reference(model, row, 64)[0]
            widths.clear()
            res = drain(eng.run(eng.resolve(Request(toks, max_tokens=64, reuse_prefix=False))))
            assert res.tokens == ref.tokens, f"hold {width}: question {row['question_id']} diverged"
            assert widths and set(widths) == {width}, sorted(set(widths))
            assert res.n_draft_nodes == (width - 1) * len(widths)
    finally:
        del be.decode_tree


def test_hold_width_is_checked_and_named_by_the_spec():
    from edgespec.run.specs import hold_width, split_verify
    from edgespec.errors import ConfigError
    assert split_verify("suffix@hold4") == ("suffix", "hold4") and hold_width("hold4") == 4
    assert hold_width("relaxed") == 0 and hold_width("hold1") == 0 and hold_width(None) == 0
    with pytest.raises(ConfigError):
        split_verify("suffix@hold1")
    with pytest.raises(ConfigError):
        EngineConfig(max_nodes=8, hold_width=9)
