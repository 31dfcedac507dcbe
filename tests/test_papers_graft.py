"""Graft as published (drafters/mechanisms/graft.py, `graft`): calibrated pruning
checkpoints on the drafted tree's best path, a fixed budget B split into
B_draft(s) + B_retr(s), and the root-centred adjacency template grafted into
exactly the freed slots: a worked example, the calibration, and the drafter."""
from __future__ import annotations

import numpy as np

from edgespec.drafters import make_drafter
from edgespec.drafters.base import StepResult
from edgespec.drafters.hybrid import HybridConfig, HybridDrafter
from edgespec.drafters.mechanisms.graft import GRAFT_CHECKPOINTS
from edgespec.core.tree import SOURCE_ADJACENCY, SOURCE_TRIGRAM, DraftTree

I32 = np.int32


def drafted():
    """A drafted tree: a likely chain 10 11 12 13 14 and an unlikely branch 20 21.
    Cumulative probabilities: 10 .9, 11 .45, 12 .135, 13 .0675, 14 .03375, 20 .05, 21 .025."""
    tok = np.array([10, 11, 12, 13, 14, 20, 21], I32)
    par = np.array([-1, 0, 1, 2, 3, -1, 5], I32)
    pr = np.array([.9, .5, .3, .5, .5, .05, .5], np.float32)
    src = np.full(7, SOURCE_TRIGRAM, np.int8)
    return tok, par, pr, src, 7


def template():
    """The adjacency template from the root, best ranks first: 30, 30 -> 31, 10 (shared
    with the drafted tree), 31 -> 32, 33."""
    return DraftTree(np.array([30, 31, 10, 32, 33], I32), np.array([-1, 0, -1, 1, -1], I32),
                     np.array([.4, .4, .14, .3, .08], np.float32), np.full(5, SOURCE_ADJACENCY, np.int8))


def as_set(cur):
    tok, par, pr, src, m = cur
    return sorted(int(t) for t in tok[:m])


def test_prune_at_the_first_unconfident_checkpoint_and_graft_into_the_freed_slots():
    assert GRAFT_CHECKPOINTS == (2, 4, 6)
    d = HybridDrafter(100, config=HybridConfig(graft=True, graft_tail=False))
    # checkpoint depth 2: best path .45 >= tau 0.1, go on; depth 4: .0675 < 0.1 (no
    # evidence yet, calibration ratio 1): prune below depth 4.  14 goes; B = 10 splits
    # into B_draft = 6 (10 11 12 13 20 21) and B_retr = 4 (the template's first four,
    # 30 31 10 32; 10 is shared, so 30 31 32 are grafted); 33 does not fit
    out = d.graft.prune_and_graft(drafted(), template(), 10)
    assert as_set(out) == [10, 11, 12, 13, 20, 21, 30, 31, 32]
    assert d.graft.stats.tolist() == [0, 1, 0, 0]            # pruned at the second checkpoint
    tok, par, pr, src, m = out
    tree = DraftTree(tok[:m], par[:m], pr[:m], src[:m])
    tree.validate(100)
    assert set(tree.source[np.isin(tree.tokens, [30, 31, 32])].tolist()) == {SOURCE_ADJACENCY}
    assert tree.source[tree.tokens == 10][0] == SOURCE_TRIGRAM     # the drafted node keeps its source
    # a smaller budget: B = 7 leaves B_retr = 1: only 30 is grafted
    assert as_set(d.graft.prune_and_graft(drafted(), template(), 7)) == [10, 11, 12, 13, 20, 21, 30]
    # B = 6: the pruned tree takes every slot, nothing is grafted
    assert as_set(d.graft.prune_and_graft(drafted(), template(), 6)) == [10, 11, 12, 13, 20, 21]


def test_checkpoints_calibrate_on_what_the_model_accepted():
    d = HybridDrafter(100, config=HybridConfig(graft=True, graft_tail=False))
    proposed = DraftTree(np.array([10], I32), np.array([-1], I32), np.array([.9], np.float32),
                         np.zeros(1, np.int8))
    for _ in range(10):
        d.graft.prune_and_graft(drafted(), template(), 10)
        # the model accepted 4 drafts each time: the path reached both checkpoints
        d.observe(StepResult(np.arange(20, dtype=I32), np.array([10, 11, 12, 13, 14], I32), proposed,
                             np.ones(1, bool), np.ones(1, bool)))
    # depth 4: predicted 10 x .0675, reached 10 times: ratio (10 + 1) / (0.675 + 1) = 6.6,
    # calibrated confidence .44 >= 0.1: no pruning there; depth 6 has no node: keep all,
    # B_retr = 10 - 7 = 3 (30 31 10): 30 and 31 are grafted
    out = d.graft.prune_and_graft(drafted(), template(), 10)
    assert as_set(out) == [10, 11, 12, 13, 14, 20, 21, 30, 31]
    # pruned once (the first proposal, before any evidence), unpruned the ten times after
    assert d.graft.stats.tolist() == [0, 1, 0, 10]


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
