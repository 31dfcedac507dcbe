"""Graft as published (drafters/papers/graft.py, `graft`), sections 3.1-3.2 of
"Draft Less, Retrieve More": pruning checkpoints whose confidence c_d is the
highest cumulative path score at depth d; a calibrated threshold tau_k per
checkpoint, stricter at shallow checkpoints; a prune skips deeper drafting; the
fixed budget B = B_draft(s) + B_retr(s), the stage-matched prefix of the
root-centred retrieval template grafted into the B_retr(s) freed slots."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgespec.drafters.tree import SOURCE_ADJACENCY, SOURCE_CONTEXT, SOURCE_TRIGRAM, DraftTree
from edgespec.drafters import make_drafter, parse_drafter_name
from edgespec.drafters.base import StepResult
from edgespec.drafters.hybrid import HybridConfig, HybridDrafter
from edgespec.drafters.papers.graft import GRAFT_CHECKPOINTS, GRAFT_TAU_FIELDS

I32 = np.int32


def tree(tok, par, pr, src=SOURCE_TRIGRAM):
    n = len(tok)
    return DraftTree(np.array(tok, I32), np.array(par, I32), np.array(pr, np.float32), np.full(n, src, np.int8))


def cur_of(t: DraftTree):
    return t.tokens, t.parents, t.probs, t.source, len(t)


def drafted():
    """A likely chain 10 11 12 13 14 and an unlikely branch 20 21. Cumulative path
    scores: depth 1: 10 .9, 20 .05; depth 2: 11 .45, 21 .025; depth 3: 12 .135;
    depth 4: 13 .0675; depth 5: 14 .03375."""
    return cur_of(tree([10, 11, 12, 13, 14, 20, 21], [-1, 0, 1, 2, 3, -1, 5], [.9, .5, .3, .5, .5, .05, .5]))


def template():
    """The adjacency template from the root, best ranks first: 30, 30 -> 31, 10 (shared
    with the drafted tree), 31 -> 32, 33."""
    return tree([30, 31, 10, 32, 33], [-1, 0, -1, 1, -1], [.4, .4, .14, .3, .08], SOURCE_ADJACENCY)


def as_set(cur):
    tok, par, pr, src, m = cur
    return sorted(int(t) for t in tok[:m])


def graft_drafter(**kw):
    return HybridDrafter(100, config=HybridConfig(graft=True, graft_tail=False, **kw))


def test_thresholds_per_checkpoint_stricter_at_shallow_ones():
    """'At each checkpoint d_k, Graft evaluates this confidence against a calibrated
    threshold tau_k ... We set stricter thresholds at shallow checkpoints.'"""
    c = HybridConfig()
    assert GRAFT_CHECKPOINTS == (2, 4, 6)
    assert GRAFT_TAU_FIELDS == tuple(f.name for f in dataclasses.fields(c) if f.name.startswith("graft_tau"))
    assert c.graft_tau2 > c.graft_tau4 > c.graft_tau6
    with pytest.raises(ValueError, match="must not rise with depth"):
        HybridConfig(graft_tau2=0.05, graft_tau4=0.1)
    assert parse_drafter_name("auto+graft+graft_tau2=0.3")[2]["graft_tau2"] == 0.3
    # the same confidence .15 fails the shallow checkpoint and passes the deeper one
    d = graft_drafter()
    shallow = cur_of(tree([1, 2, 3], [-1, 0, 1], [.5, .3, .9]))                # depth 2: .15
    assert as_set(d.graft.prune_and_graft(shallow, None, 8)) == [1, 2]       # pruned at depth 2
    assert d.graft.stage == 0
    deep = cur_of(tree([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3], [1., 1., .5, .3, .9]))  # depth 2: 1, depth 4: .15
    assert as_set(d.graft.prune_and_graft(deep, None, 8)) == [1, 2, 3, 4, 5]  # kept whole
    assert d.graft.stage is None


def test_confidence_is_the_highest_scoring_path_at_the_checkpoint_depth():
    """'For a node at draft depth d, we define its cumulative path score ... The
    highest-scoring path defines the confidence at depth d.'  The greedy first
    node 1 (.6) leads to .6 x .2 = .12 at depth 2, below tau_2 = .2; the path
    through the weaker first node 2 (.3 x .9 = .27) clears it: no pruning."""
    d = graft_drafter()
    t = cur_of(tree([1, 2, 3, 4, 5], [-1, -1, 0, 1, 2], [.6, .3, .2, .9, .1]))
    assert as_set(d.graft.prune_and_graft(t, None, 8)) == [1, 2, 3, 4, 5]
    assert d.graft.stage is None and [s for s, _ in d.graft._gp_last] == [0]


def test_prune_at_the_first_unconfident_checkpoint_and_graft_into_the_freed_slots():
    """'Graft decomposes this fixed budget as B = B_draft(s) + B_retr(s)' and
    'selects the stage-matched prefix of this retrieved template and grafts it
    into the released slots'."""
    d = graft_drafter()
    # depth 2: .45 >= tau_2 .2, go on; depth 4: .0675 < tau_4 .1 (no evidence yet,
    # calibration ratio 1): prune below depth 4.  14 goes; B = 10 splits into
    # B_draft = 6 (10 11 12 13 20 21) and B_retr = 4 (the template's first four,
    # 30 31 10 32; 10 is shared, so 30 31 32 are grafted); 33 does not fit
    out = d.graft.prune_and_graft(drafted(), template(), 10)
    assert as_set(out) == [10, 11, 12, 13, 20, 21, 30, 31, 32]
    assert d.graft.stats.tolist() == [0, 1, 0, 0]            # pruned at the second checkpoint
    tok, par, pr, src, m = out
    t = DraftTree(tok[:m], par[:m], pr[:m], src[:m])
    t.validate(100)
    assert set(t.source[np.isin(t.tokens, [30, 31, 32])].tolist()) == {SOURCE_ADJACENCY}
    assert t.source[t.tokens == 10][0] == SOURCE_TRIGRAM     # the drafted node keeps its source
    # B = 7 leaves B_retr = 1: only 30 is grafted; B = 6: nothing is grafted
    assert as_set(d.graft.prune_and_graft(drafted(), template(), 7)) == [10, 11, 12, 13, 20, 21, 30]
    assert as_set(d.graft.prune_and_graft(drafted(), template(), 6)) == [10, 11, 12, 13, 20, 21]


def test_shallower_stages_keep_fewer_draft_nodes_and_give_retrieval_more():
    """'Shallower pruning stages allocate fewer draft nodes and grant a larger
    budget to retrieval.'  A stricter tau_2 (.5 > .45) prunes the same tree at
    depth 2: B_draft(0) = 4 (10 11 20 21), B_retr(0) = 6 against 6 and 4 at depth 4."""
    big = tree([30, 31, 32, 33, 34, 35, 36], [-1, -1, -1, 0, 0, 1, 1], [.3, .2, .1, .5, .4, .5, .4],
               SOURCE_ADJACENCY)
    d = graft_drafter(graft_tau2=0.5)
    out = d.graft.prune_and_graft(drafted(), big, 10)
    assert d.graft.stage == 0
    assert as_set(out) == [10, 11, 20, 21, 30, 31, 32, 33, 34, 35]       # 4 drafted + 6 retrieved = B
    d = graft_drafter()
    out = d.graft.prune_and_graft(drafted(), big, 10)
    assert d.graft.stage == 1
    assert as_set(out) == [10, 11, 12, 13, 20, 21, 30, 31, 32, 33]       # 6 drafted + 4 retrieved = B


def test_checkpoint_thresholds_calibrate_on_what_the_model_accepted():
    """The calibrated threshold (how is not given by the text): tau_k times the
    checkpoint's predicted / observed reach, (sum of c_d + 1) / (reached + 1)."""
    d = graft_drafter()
    proposed = tree([10], [-1], [.9], SOURCE_CONTEXT)
    np.testing.assert_allclose(d.graft.thresholds(), [.2, .1, .05])
    for _ in range(10):
        d.graft.prune_and_graft(drafted(), template(), 10)
        # the model accepted 4 drafts each time: the path reached depths 2 and 4
        d.observe(StepResult(np.arange(20, dtype=I32), np.array([10, 11, 12, 13, 14], I32), proposed,
                             np.ones(1, bool), np.ones(1, bool)))
    # depth 4: tau = .1 x (10 x .0675 + 1) / (10 + 1) = .0152 <= .0675: no pruning there;
    # depth 6 has no node: keep all, B_retr = 10 - 7 = 3 (30 31 10): 30 and 31 are grafted
    np.testing.assert_allclose(d.graft.thresholds()[:2], [.2 * 5.5 / 11, .1 * 1.675 / 11])
    out = d.graft.prune_and_graft(drafted(), template(), 10)
    assert as_set(out) == [10, 11, 12, 13, 14, 20, 21, 30, 31]
    # pruned once (the first proposal, before any evidence), unpruned the ten times after
    assert d.graft.stats.tolist() == [0, 1, 0, 10]


def _stub_parts(d, first: DraftTree):
    """auto's parts (suffix, trigram, adjacency) with fixed proposals; returns the
    list of the parts asked, in order."""
    asked = []
    trees = {"suffix": first, "trigram": tree([50, 51, 52], [-1, 0, 1], [.9, .9, .9]),
             "adjacency": template()}
    for p in d.parts:
        def propose(context, budget, name=p.name):
            asked.append(name)
            return trees[name]
        p.propose = propose
    return asked


def test_a_prune_skips_the_deeper_drafting():
    """'If c_d < tau_k, Graft prunes the draft tree at this checkpoint and skips
    deeper draft expansion': once the tree merged so far is pruned, the drafted
    parts after it are not asked; the retrieval template still is."""
    kw = dict(graft=True, graft_tail=False, entropy=False, branch_depth=False, semantic_pair=False)
    ctx = np.arange(40, dtype=I32)
    d = make_drafter("auto", n_vocab=100, **kw)
    assert [p.name for p in d.parts] == ["suffix", "trigram", "adjacency"]
    # the suffix part's tree reaches depth 2 at .5 x .3 = .15 < tau_2: pruned there
    asked = _stub_parts(d, tree([1, 2, 3, 4], [-1, 0, 1, 2], [.5, .3, .9, .9], SOURCE_CONTEXT))
    d.begin(ctx)
    t = d.propose(ctx, 8)
    assert asked == ["suffix", "adjacency"]                    # no tri-gram drafting
    assert sorted(t.tokens.tolist()) == [1, 2, 10, 30, 31, 32, 33]   # B_draft 2 + the template's 5 (B_retr 6)
    # confident at depth 2 (.45): the tri-gram part drafts as usual
    asked = _stub_parts(d, tree([1, 2], [-1, 0], [.9, .5], SOURCE_CONTEXT))
    t = d.propose(ctx, 8)
    assert asked == ["suffix", "trigram", "adjacency"]
    assert {50, 51, 52} <= set(t.tokens.tolist())
    # a first tree that does not reach depth 2 decides nothing: the next part is asked
    asked = _stub_parts(d, tree([1], [-1], [.1], SOURCE_CONTEXT))
    d.propose(ctx, 8)
    assert asked == ["suffix", "trigram", "adjacency"]


def test_auto_with_graft_keeps_the_budget():
    d = make_drafter("auto", n_vocab=100, graft=True, graft_tail=False)
    d.warmup()
    rng = np.random.default_rng(1)
    ctx = rng.integers(0, 8, size=300).astype(I32)
    d.begin(ctx)
    for budget in (4, 12, 31):
        t = d.propose(ctx, budget)
        t.validate(100)
        assert 0 < len(t) <= budget
    # without the adjacency part there is nothing to graft: the drafted tree is left as is
    d2 = make_drafter("auto", n_vocab=100, graft=True, graft_tail=False, adjacency=False)
    d2.begin(ctx)
    assert len(d2.propose(ctx, 12)) <= 12
