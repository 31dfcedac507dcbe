"""The offline replay (edgespec/replay/simulator.py, edgespec replay) reproduces the real
engine: the same output tokens, and the same step counts as a real run of the
same drafter on the same prompts, to within the gate's timing noise."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.drafters import make_drafter
from edgespec.core.config import EngineConfig
from edgespec.core.engine import Engine, drain
from edgespec.replay.simulator import ReplayBackend, ReplayRequest, replay
from edgespec.core.params import Request

from conftest import AMD, XEON, dev_prompts

pytestmark = pytest.mark.model

MAX_TOKENS = 64


def _requests(model, rows):
    reqs = []
    for i, row in enumerate(rows):
        toks = model.prompt_tokens([{"role": "user", "content": row["turns"][0]}])
        # recorded past MAX_TOKENS: drafts that reach beyond the cut are judged
        # by the recorded continuation, as the real model judges them
        r = model.generate(toks, max_tokens=MAX_TOKENS + 48, drafter="none", record_topk=8)
        assert len(r.topk) >= len(r.tokens) and all(len(x) == 8 for x in r.topk)
        assert [x[0] for x in r.topk[:len(r.tokens)]] == list(r.tokens)   # greedy = rank 0
        reqs.append(ReplayRequest(str(i), row["category"], toks, np.asarray(r.tokens, np.int32),
                                  r.stop_reason == "stop", r.topk))
    return reqs


@pytest.fixture(scope="module")
def recorded(model):
    rows = dev_prompts(128, 136, 532)    # coding, extraction, rag
    return _requests(model, rows)


@pytest.mark.parametrize("name", ["suffix", "adjacency"])
def test_replay_matches_real_engine(model, recorded, name):
    """With the gate's overhead term fixed in both (EngineConfig.gate_overhead),
    the replay takes exactly the real engine's decisions: the same steps and the
    same accepted drafts on every request.  (With the live, measured overhead
    the two differ where a tree sits at the gate's break-even: on short
    contexts a 2-token batch costs about 1.9 one-token steps, so a single
    retrieved node with an estimated 0.87 acceptance flips with the timing.
    For the same reason the learned step costs and the guard, which read
    timings, are off: the gate decides from the calibrated curve alone.)"""
    reqs = recorded
    eog = int(np.nonzero(model.vocab.eog_mask())[0][0])
    config = EngineConfig(max_nodes=model.config.max_nodes, gate_overhead=0.02, learn_costs=False, guard=False)

    def drafter():
        return make_drafter(name, n_vocab=model.vocab.n_vocab)

    # the real engine on these prompts, fresh acceptance statistics
    real_eng = Engine(model.backend, drafter(), AMD, config)
    real = []
    for rq in reqs:
        res = drain(real_eng.run(real_eng.resolve(Request(rq.prompt, max_tokens=MAX_TOKENS, reuse_prefix=False))))
        assert res.tokens == [int(t) for t in rq.output[:MAX_TOKENS]]
        real.append((res.n_steps, res.n_draft_nodes, res.n_draft_accepted))
    real_eng.reset()

    be = ReplayBackend(model.vocab, model.backend.n_ctx, model.backend.max_nodes, AMD, eog)
    eng = Engine(be, drafter(), AMD, config)
    rows_out = replay(eng, be, reqs, MAX_TOKENS)         # raises if an output diverges
    rep = [(r["n_steps"], r["n_draft_nodes"], r["n_draft_accepted"]) for r in rows_out]
    if name == "suffix":
        assert sum(x[2] for x in rep) > 0, "the suffix drafter found nothing on the rag and extraction prompts"
    assert rep == real

    # plain decoding in the replay: one step per token, modelled time = that many c(1)
    be2 = ReplayBackend(model.vocab, model.backend.n_ctx, model.backend.max_nodes, AMD, eog)
    eng2 = Engine(be2, make_drafter("none"), AMD, EngineConfig(max_nodes=model.config.max_nodes))
    out2 = replay(eng2, be2, reqs[:1], MAX_TOKENS)
    n = len(reqs[0].output)
    assert out2[0]["n_steps"] == (n if reqs[0].stopped_on_eog and n < MAX_TOKENS else MAX_TOKENS - 1)
    n0, c = len(reqs[0].prompt), AMD
    # a curve with its own short-regime rounds times short singles itself (with a
    # q8_0 K cache they may come out a hair dearer than t1_s); old caches: min
    t1_short = c.t1_short_s if c.short_rel else min(c.t1_short_s, c.t1_s)
    assert out2[0]["model_s"] == pytest.approx(sum(
        t1_short if n0 + j + 1 <= 256 else c.t1_at((n0 + j) // 128 * 128 + 64)
        for j in range(out2[0]["n_steps"])))


def test_oracle_keeps_only_what_the_model_accepts(model, recorded):
    """OracleDrafter (edgespec replay's oracle-NAME) passes on only the path of
    the inner drafter's proposal that the record follows: every node it lets
    through is accepted, and with perfect estimates the gate's modelled time
    is within 2% of the learned ones' or better (the gate chooses step by
    step, under the learned costs' ramp: perfect estimates do not make it
    optimal; on the calibration of 2026-11-27 the oracle took 0.6% longer)."""
    from edgespec.replay.simulator import OracleDrafter
    eog = int(np.nonzero(model.vocab.eog_mask())[0][0])
    out = {}
    for oracle in (False, True):
        # a fixed clock: the learned costs and the guard decide from the modelled time alone
        be = ReplayBackend(model.vocab, model.backend.n_ctx, model.backend.max_nodes, AMD, eog, overhead_s=0.0)
        d = make_drafter("suffix", n_vocab=model.vocab.n_vocab)
        if oracle:
            d = OracleDrafter(d, be)
        eng = Engine(be, d, AMD, EngineConfig(max_nodes=model.config.max_nodes, gate_overhead=0.02))
        out[oracle] = replay(eng, be, recorded, MAX_TOKENS)        # raises if an output diverges
    o, s = out[True], out[False]
    assert sum(r["n_draft_accepted"] for r in o) > 0
    assert all(r["n_draft_nodes"] == r["n_draft_accepted"] for r in o)
    assert any(r["n_draft_nodes"] > r["n_draft_accepted"] for r in s)   # the learned gate does miss
    assert sum(r["model_s"] for r in o) <= 1.02 * sum(r["model_s"] for r in s)


def _copy_chains():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parent.parent / "tools" / "copy_chains.py"
    spec = importlib.util.spec_from_file_location("copy_chains", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_copy_chains_walks_and_fits_by_hand():
    """tools/copy_chains.py: a step verifying k drafts commits min(g, k) + 1
    tokens for c(k + 1); the fit takes the depth with the best expected rate per
    group, and none where no depth beats a plain step."""
    cc = _copy_chains()
    cost = np.array([0.0, 1.0, 1.9, 2.4, 2.8] + [2.8 + 0.8 * j for j in range(1, 10)])
    cost_at = lambda n_past: cost                                     # noqa: E731

    def pos(g, score_b, depth=12):
        return {"g": g, "depth": depth, "n_past": 500, "score_b": score_b}

    # position 0 proposes a chain the answer follows for 5 tokens: verifying 3 of
    # it commits 4 tokens (positions 0-3) for c(4); positions 4-7 take plain steps
    answer = [pos(5, 9), None, None, None, None, None, None, None]
    plain, t = cc.walk(answer, lambda f: 3, cost_at)
    assert plain == 8 and t == pytest.approx(2.8 + 4 * 1.0)           # 4 tokens for c(4), then 4 plain steps
    plain, t = cc.walk(answer, lambda f: 0, cost_at)
    assert t == pytest.approx(8.0)
    # a wrong first draft still commits the bonus token
    plain, t = cc.walk([pos(0, 9), None], lambda f: 2, cost_at)
    assert t == pytest.approx(2.4 + 1.0)
    # the fit: bucket 9 always copies >= 3 tokens -> 3 drafts (4 tokens for 2.8);
    # bucket 5 copies nothing -> plain
    key = lambda f: (f["score_b"],)                                   # noqa: E731
    choose = cc.fit([[pos(3, 9), pos(3, 9), pos(0, 5), pos(0, 5)]], key, cost_at)
    assert choose(pos(0, 9)) == 3 and choose(pos(0, 5)) == 0 and choose(pos(0, 7)) == 0


def test_llama_and_replay_backends_satisfy_the_backend_protocol(model):
    """The engine and the calibration are written against backend/protocol.py's
    Backend: the real backend and the replay one both have every member."""
    from edgespec.backend.protocol import Backend
    eog = int(np.nonzero(model.vocab.eog_mask())[0][0])
    be = ReplayBackend(model.vocab, model.backend.n_ctx, model.backend.max_nodes, AMD, eog)
    assert isinstance(model.backend, Backend) and isinstance(be, Backend)


def _scaled(cost, factor: float):
    """`cost` with every batch (T >= 2) `factor` times dearer, in every regime."""
    from dataclasses import replace

    def up(rel):
        return [r if t == 1 else r * factor for t, r in zip(cost.ts, rel)]
    return replace(cost, rel=up(cost.rel), short_rel=up(cost.short_rel) if cost.short_rel else [],
                   longer=[dict(d, rel=up(d["rel"])) for d in cost.longer])


def _clocked(model, reqs, name, backend_cost, prior, **config):
    """Replay `reqs` with drafter `name` on a backend whose decodes cost
    `backend_cost`, under the engine's prior `prior`, with a fixed engine time
    per step (5% of the prior's plain step); the modelled seconds and the rows."""
    eog = int(np.nonzero(model.vocab.eog_mask())[0][0])
    be = ReplayBackend(model.vocab, model.backend.n_ctx, model.backend.max_nodes, backend_cost, eog,
                       overhead_s=0.05 * prior.t1_s)
    eng = Engine(be, make_drafter(name, n_vocab=model.vocab.n_vocab), prior,
                 EngineConfig(max_nodes=model.config.max_nodes, **config))
    t0 = be.clock()
    rows = replay(eng, be, reqs, MAX_TOKENS)
    return be.clock() - t0, rows


@pytest.mark.parametrize("name", ["suffix", "trigram", "adjacency", "auto"])
def test_guard_keeps_every_drafter_within_2_percent_of_none_when_batches_cost_10x(model, recorded, name):
    """Batches cost ten times what the calibration says (another program on
    the cores, a backend unlike the one calibrated): the learned step costs
    and the guard keep every drafter within 2% of plain decoding over a
    stream of requests (42 answers here, about 2,000 tokens): the first
    batch, at most FIRST_COST plain steps by the calibration, is found out,
    and the learned costs keep the gate from drafting after it; without them
    the drafters lose far more."""
    stream = recorded * 14
    dear = _scaled(AMD, 10.0)
    none_s, _ = _clocked(model, stream, "none", dear, AMD)
    drafted_s, rows = _clocked(model, stream, name, dear, AMD)
    assert drafted_s <= 1.02 * none_s, (name, drafted_s / none_s)
    if name == "suffix":
        blind_s, _ = _clocked(model, stream, name, dear, AMD, learn_costs=False, guard=False)
        assert blind_s > 1.1 * none_s


@pytest.mark.parametrize("curve,factor", [(AMD, 0.6), (XEON, 1.0)], ids=["amd-x0.6", "xeon"])
def test_learned_costs_and_guard_keep_drafting_where_it_pays(model, recorded, curve, factor):
    """Where the calibration is right, the learned costs agree with it and the
    guard never binds: the suffix drafter gains as much as before.  On flat
    curves, where drafting pays on these three short dev answers: the AMD
    EPYC's with every batch at 0.6 of its price (on its own curve, c(2) about
    2, these answers are at the edge of paying at all) and the AMX Xeon's as
    measured (c(2) 1.47).  The curves are fixed files, not this machine's
    calibration: scaled by 0.6, an already flat curve would make a batch
    cheaper than one token, and the verdict would depend on the machine."""
    stream = recorded * 2
    flat = _scaled(curve, factor)
    none_s, _ = _clocked(model, stream, "none", flat, flat)
    before_s, before = _clocked(model, stream, "suffix", flat, flat, learn_costs=False, guard=False)
    after_s, after = _clocked(model, stream, "suffix", flat, flat)
    assert before_s < none_s                    # drafting pays on these prompts
    assert after_s <= 1.02 * before_s
    # it keeps drafting (on three fresh calibrations of 2026-11-27 it accepted 110-173 drafts against
    # the static gate's 145-173, in 0.2% more to 5% less time: fewer, cheaper batches)
    assert sum(r["n_draft_accepted"] for r in after) >= 0.5 * sum(r["n_draft_accepted"] for r in before)
