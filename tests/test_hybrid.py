"""The `auto` drafter merges suffix, trigram and adjacency proposals (no model)."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.drafters import make_drafter
from edgespec.drafters.base import StepResult
from edgespec.drafters.hybrid import HybridConfig, HybridDrafter
from edgespec.tree import SOURCE_ADJACENCY, SOURCE_CONTEXT, SOURCE_TRIGRAM, DraftTree

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
    only_tri = make_drafter("auto", n_vocab=V, suffix=False, adjacency=False)
    assert only_tri.topk == 0 and len(only_tri.parts) == 1
    ctx = np.array([1, 2, 3, 1, 2, 3, 1, 2], np.int32)
    only_tri.begin(ctx)
    t = only_tri.propose(ctx, 8)
    assert len(t) and set(t.source.tolist()) == {SOURCE_TRIGRAM}
    with pytest.raises(ValueError):
        HybridConfig(suffix=False, trigram=False, adjacency=False)
