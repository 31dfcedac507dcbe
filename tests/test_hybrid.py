"""The `auto` drafter merges suffix, trigram and adjacency proposals (no model)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import edgespec

from edgespec.drafters import make_drafter
from edgespec.drafters.base import StepResult
from edgespec.drafters.hybrid import HybridConfig, HybridDrafter
from edgespec.drafters.tree import SOURCE_ADJACENCY, SOURCE_CONTEXT, SOURCE_TRIGRAM, DraftTree

V = 100


def _observe_topk(d, ctx, rows):
    """Feed the drafter a step whose model top-k rows are given by hand."""
    inp = np.array([r[0] for r in rows], np.int32)
    tk = np.array([r[1] for r in rows], np.int32)
    d.observe(StepResult(ctx, ctx[-1:], DraftTree.empty(), np.zeros(0, bool), np.zeros(0, bool),
                         topk_input=inp, topk_tokens=tk))


def test_sources_merge_with_retrieval_first():
    d = HybridDrafter(V)
    d.warmup()
    ctx = np.array([1, 2, 3, 4, 5, 9, 8, 1, 2, 3], np.int32)
    d.begin(ctx)
    # the model said 3 is followed by 77 then 78 (adjacency rows)
    _observe_topk(d, ctx, [(3, [77, 4, 5, 6, 7, 10, 11, 12]), (77, [78, 1, 2, 5, 6, 7, 10, 11])])
    t = d.propose(ctx, 32)
    t.validate(V)
    src = set(t.source.tolist())
    assert SOURCE_CONTEXT in src and SOURCE_ADJACENCY in src
    # the retrieved continuation (4 after "1 2 3") is the first node, and its source
    # is the context even though the tri-gram overlay proposes it too
    assert t.tokens[0] == 4 and t.parents[0] == -1 and t.source[0] == SOURCE_CONTEXT
    roots = t.tokens[t.parents == -1].tolist()
    assert 77 in roots
    assert len(t) <= 32


def test_budget_and_prefix_order():
    d = HybridDrafter(V)
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 6, size=400).astype(np.int32)
    d.begin(ctx)
    for budget in (1, 3, 8, 20):
        t = d.propose(ctx, budget)
        assert 0 < len(t) <= budget
        t.validate(V)
        # cumulative probability never rises from parent to child
        cum = np.zeros(len(t))
        for i in range(len(t)):
            p = t.parents[i]
            cum[i] = t.probs[i] * (1.0 if p < 0 else cum[p])
            if p >= 0:
                assert cum[i] <= cum[p] + 1e-6
    assert len(d.propose(ctx, 0)) == 0


def test_components_switch():
    only_tri = make_drafter("auto", n_vocab=V, suffix=False, adjacency=False, branch_depth=False, aasd=False,
                            graft_tail=False)
    assert only_tri.topk == 0 and len(only_tri.parts) == 1
    ctx = np.array([1, 2, 3, 1, 2, 3, 1, 2], np.int32)
    only_tri.begin(ctx)
    t = only_tri.propose(ctx, 8)
    assert len(t) and set(t.source.tolist()) == {SOURCE_TRIGRAM}
    with pytest.raises(ValueError):
        HybridConfig(suffix=False, trigram=False, adjacency=False, branch_depth=False, aasd=False, semantic_pair=False)
    # without a model path the semantic part is left out; branch/aasd are one part
    d = make_drafter("auto", n_vocab=V, trigram=False, adjacency=False)
    assert [p.name for p in d.parts] == ["suffix", "branch"] and d.prefill_topk == 0
    assert make_drafter("auto", n_vocab=V, aasd=True).prefill_topk == 4


def _step(d, ctx, proposed: DraftTree, got: int, topk_logits=None):
    """Feed an observe(): the model chose `got` at the root; depth-1 nodes were tested."""
    top = proposed.parents == -1
    acc = top & (proposed.tokens == got)
    x = np.zeros((0, 0), np.float32) if topk_logits is None else np.asarray(topk_logits, np.float32)
    d.observe(StepResult(np.append(ctx, got).astype(np.int32), np.array([got], np.int32), proposed,
                         acc, top.copy(), topk_logits=x))


def test_entropy_trigger_scales_retrieval_where_it_fails():
    d = HybridDrafter(V, config=HybridConfig(trigram=False, adjacency=False, ema=False))
    assert d.topk == 8            # top-k rows are needed for the entropy
    ctx = np.array([1, 2, 3, 4, 5, 9, 8, 1, 2, 3], np.int32)
    d.begin(ctx)
    sure = [[10.0] + [0.0] * 7]              # low entropy: one clear favourite
    unsure = [[1.0] * 8]                     # high entropy: log(8)
    for _ in range(30):
        # confident model: the retrieved 4 is accepted
        _step(d, ctx, d.propose(ctx, 8), 4, topk_logits=sure * 4)
        t_sure = d.propose(ctx, 8)
        _step(d, ctx, t_sure, 4, topk_logits=unsure * 4)
        # unsure model: the retrieved 4 is rejected
        t_unsure = d.propose(ctx, 8)
        _step(d, ctx, t_unsure, 50, topk_logits=sure * 4)
    p_sure = t_sure.probs[(t_sure.parents == -1) & (t_sure.tokens == 4)][0]
    p_unsure = t_unsure.probs[(t_unsure.parents == -1) & (t_unsure.tokens == 4)][0]
    assert p_unsure < 0.5 * p_sure
    # without the switch the scores do not depend on the entropy
    d2 = HybridDrafter(V, config=HybridConfig(trigram=False, adjacency=False, ema=False, entropy=False, branch_depth=False, aasd=False))
    assert d2.topk == 0
    d2.begin(ctx)
    assert np.allclose(d2.propose(ctx, 8).probs, HybridDrafter(V, config=HybridConfig(
        trigram=False, adjacency=False, ema=False, entropy=False, branch_depth=False, aasd=False)).propose(ctx, 8).probs)


def test_position_ema_drops_failing_occurrences():
    from edgespec.drafters import SuffixDrafter
    d = make_drafter("suffix", position_ema=True, ema_decay=0.5, ema_min=0.3)    # the plug-in, through the registry
    assert d.observes
    # "7 8" occurs twice before the end; continuations 20 (at 2) and 30 (at 6)
    ctx = np.array([7, 8, 20, 1, 2, 7, 8, 30, 3, 4, 7, 8], np.int32)
    d.begin(ctx)
    t = d.propose(ctx, 16)
    assert set(t.tokens[t.parents == -1].tolist()) == {20, 30}
    for _ in range(2):         # the model keeps choosing 20: the occurrence before 30 fails
        t = d.propose(ctx, 16)
        top = t.parents == -1
        d.observe(StepResult(np.append(ctx, 20).astype(np.int32), np.array([20], np.int32), t,
                             top & (t.tokens == 20), top.copy()))
    t = d.propose(ctx, 16)
    assert t.tokens[t.parents == -1].tolist() == [20]
    d.begin(ctx)               # a new request starts with fresh scores
    t = d.propose(ctx, 16)
    assert set(t.tokens[t.parents == -1].tolist()) == {20, 30}
    # off by default: the plain suffix drafter is stateless
    assert not SuffixDrafter().observes


def test_drafter_spec_switches():
    from edgespec.drafters import parse_drafter_name
    assert parse_drafter_name("auto") == ("auto", True, {})
    assert parse_drafter_name("suffix-nocorpus") == ("suffix", False, {})
    assert parse_drafter_name("auto-notrigram-noentropy-nocorpus") == \
        ("auto", False, {"trigram": False, "entropy": False})
    assert parse_drafter_name("auto-noema+ema") == ("auto", True, {"ema": True})
    for bad in ("auto-nofoo", "suffx", "suffix+trigram", "auto-"):
        with pytest.raises(ValueError):
            parse_drafter_name(bad)
    d = make_drafter("auto", n_vocab=V, **parse_drafter_name("auto-notrigram-noema")[2])
    assert [p.name for p in d.parts] == ["suffix", "branch", "adjacency"]
    assert "position_ema" not in d.parts[0].plugins
    assert list(make_drafter("auto", n_vocab=V, feedback=True).parts[0].plugins) == ["position_ema", "feedback"]


def test_schedule_idles_a_part_whose_tokens_do_not_pay_for_its_time():
    ctx = np.array([1, 2, 3, 1, 2, 3, 1, 2, 4, 5, 6, 1, 2], np.int32)

    def run(plain_step_s):
        d = HybridDrafter(V, config=HybridConfig(suffix=False, adjacency=False, entropy=False, branch_depth=False,
                                                 aasd=False))
        d.warmup()
        d.begin(ctx)
        kinds = []
        for _ in range(40):
            t = d.propose(ctx, 8)
            kinds.append(len(t) > 0)
            # the model never takes a tri-gram draft
            d.observe(StepResult(np.append(ctx, 99).astype(np.int32), np.array([99], np.int32), t,
                                 np.zeros(len(t), bool), t.parents == -1, plain_step_s=plain_step_s))
        return d, kinds

    d, kinds = run(1e-5)            # worthless tokens: the part goes idle, then probes after 8, 16, 32 steps
    (name, gain, ms, idle), = d.schedule.report()
    assert name == "trigram" and idle and gain < 0.9 and ms > 0     # decayed from 1.0 with every try
    steps = [i for i, k in enumerate(kinds) if k]
    first_idle = next(i for i in range(len(kinds)) if not kinds[i])
    probes = [i for i in steps if i > first_idle]
    assert probes and probes[0] - first_idle == 7          # 8 steps after the last proposal
    assert [b - a for a, b in zip(probes, probes[1:])] == [16, 32][:len(probes) - 1]
    d, kinds = run(0.0)             # no plain-step time from the engine: no scheduling
    assert all(kinds) and not d.schedule.report()[0][3]


def test_the_schedule_weighs_the_guess_parts_and_never_the_retrieval_one():
    """Roles, not identities: the RETRIEVAL part keeps proposing and is never
    weighed, while a GUESS part whose drafts the model never takes goes idle."""
    ctx = np.array([1, 2, 3, 1, 2, 3, 1, 2, 4, 5, 6, 1, 2], np.int32)
    d = HybridDrafter(V, config=HybridConfig(adjacency=False, entropy=False, branch_depth=False, aasd=False,
                                             graft_tail=False, ema=False))
    assert [p.name for p in d.parts] == ["suffix", "trigram"] and d.roles == ["retrieval", "guess"]
    assert make_drafter("auto", n_vocab=V).roles == ["retrieval", "guess", "guess", "template"]
    d.begin(ctx)
    for _ in range(20):
        t = d.propose(ctx, 8)
        assert (t.source == SOURCE_CONTEXT).any()
        d.observe(StepResult(np.append(ctx, 99).astype(np.int32), np.array([99], np.int32), t,
                             np.zeros(len(t), bool), t.parents == -1, plain_step_s=1e-5))
    (_, gain_s, _, idle_s), (_, gain_t, _, idle_t) = d.schedule.report()
    assert not idle_s and gain_s == 1.0 and idle_t and gain_t < 0.9


def test_graft_continues_retrieval_from_a_confident_drafted_leaf():
    from edgespec.drafters.tree import SOURCE_CONTEXT
    d = HybridDrafter(V, config=HybridConfig(trigram=False, adjacency=False, branch_depth=False, aasd=False))
    d.warmup()
    ctx = np.array([7, 8, 9, 10, 11, 5, 6, 7], np.int32)
    # one tri-gram leaf "8" after the root 7 (likely), one retrieved leaf "3"
    tok = np.array([8, 3], np.int32)
    par = np.array([-1, -1], np.int32)
    pr = np.array([0.8, 0.1], np.float32)
    src = np.array([SOURCE_TRIGRAM, SOURCE_CONTEXT], np.int8)
    t, p, q, s = d.graft_tail.graft(ctx, tok, par, pr, src, 16)
    # "7 8" occurred at the start: what followed (9 10 11 5) hangs under the tri-gram leaf
    assert t.tolist() == [8, 3, 9, 10, 11, 5] and p.tolist() == [-1, -1, 0, 2, 3, 4]
    assert s[2:].tolist() == [SOURCE_CONTEXT] * 4 and (q[2:] > 0).all()
    DraftTree(t, p, q, s)            # a valid tree (parents first, distinct siblings)
    # a retrieved or unlikely leaf is no graft point; a tiny budget leaves no room
    src2 = np.array([SOURCE_CONTEXT, SOURCE_TRIGRAM], np.int8)
    assert len(d.graft_tail.graft(ctx, tok, par, pr, src2, 16)[0]) == 2
    assert len(d.graft_tail.graft(ctx, tok, par, pr, src, 3)[0]) == 2


PAPERS = ("edgespec.drafters.papers", "edgespec.kernels.aded")


def _papers_loaded(spec: str) -> list:
    """The paper modules a fresh interpreter holds after building make_drafter(spec) (the defaults, and
    the switches the name sets)."""
    code = ("import sys, edgespec.drafters.hybrid\n"
            "from edgespec.drafters import make_drafter, parse_drafter_name\n"
            f"name, _, sw = parse_drafter_name({spec!r})\n"
            "make_drafter(name, n_vocab=100, **sw)\n"
            f"print(' '.join(sorted(m for m in sys.modules if m.startswith({PAPERS!r}))))")
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(edgespec.__file__).resolve().parent.parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split()


def test_the_papers_mechanisms_are_imported_only_when_switched_on():
    assert _papers_loaded("auto") == []
    assert _papers_loaded("trigram") == []
    assert _papers_loaded("suffix+max_depth=12+edits-nomemory") == []      # edits is edgespec's own
    assert _papers_loaded("suffix+feedback") == ["edgespec.drafters.papers", "edgespec.drafters.papers.feedback"]
    assert _papers_loaded("auto+graft") == ["edgespec.drafters.papers", "edgespec.drafters.papers.graft"]
    assert "edgespec.drafters.papers.trigger" in _papers_loaded("auto+trigger")
    assert "edgespec.kernels.aded" in _papers_loaded("auto+aded")
