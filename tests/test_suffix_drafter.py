"""Tests of the suffix drafter (edgespec.drafters.suffix) and the factory."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.drafters import (
    Drafter,
    SuffixConfig,
    SuffixDrafter,
    make_drafter,
)
from edgespec.tree import SOURCE_CONTEXT, DraftTree


@pytest.fixture(scope="module")
def drafter():
    d = SuffixDrafter()
    d.warmup()
    return d


def children(tree: DraftTree, parent: int) -> list[int]:
    return [int(t) for t, p in zip(tree.tokens, tree.parents) if p == parent]


def first_path(tree: DraftTree) -> list[int]:
    """Follow the most probable child from the root down."""
    path, node = [], -1
    while True:
        kids = [i for i in range(len(tree)) if tree.parents[i] == node]
        if not kids:
            return path
        node = max(kids, key=lambda i: tree.probs[i])
        path.append(int(tree.tokens[node]))


def test_valid_tree_and_budget(drafter):
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 4, size=500).astype(np.int32)   # many repeats
    for budget in (1, 2, 5, 17, 64, 200):
        tree = drafter.propose(ctx, budget)
        tree.validate(n_vocab=4)
        assert 0 < len(tree) <= min(budget, drafter.config.max_nodes)
        assert tree.tokens.dtype == np.int32 and tree.parents.dtype == np.int32
        assert tree.probs.dtype == np.float32 and tree.source.dtype == np.int8
        assert np.all(tree.source == SOURCE_CONTEXT)
        assert np.all((tree.probs >= 0) & (tree.probs <= 1))
    # A smaller budget gives the most probable part of the larger proposal.
    big = drafter.propose(ctx, 64)
    small = drafter.propose(ctx, 10)
    assert np.array_equal(small.tokens, big.tokens[:10])
    assert np.array_equal(small.parents, big.parents[:10])


def test_empty_for_zero_budget_and_no_repeats(drafter):
    ctx = np.array([1, 2, 3, 1, 2, 3, 1, 2], np.int32)
    assert len(drafter.propose(ctx, 0)) == 0
    assert len(drafter.propose(ctx, -3)) == 0
    assert len(drafter.propose(np.arange(100, dtype=np.int32), 16)) == 0
    assert len(drafter.propose(np.zeros(0, np.int32), 16)) == 0
    assert len(drafter.propose(np.array([5], np.int32), 16)) == 0
    # "1 2" repeats only as "... 9 2" -> a 1-token match, below min_match=2.
    assert len(drafter.propose(np.array([9, 2, 7, 1, 2], np.int32), 16)) == 0


def test_repeated_phrase_gives_obvious_continuation(drafter):
    phrase = list(range(10, 30))
    ctx = np.array([1, 2, 3] + phrase + [7, 8] + phrase[:5], np.int32)
    tree = drafter.propose(ctx, 64)
    tree.validate()
    # One earlier occurrence of "10 11 12 13 14": a single chain of the next
    # max_depth=12 tokens of the phrase.
    assert tree.tokens.tolist() == phrase[5:17]
    assert tree.parents.tolist() == list(range(-1, 11))
    # Deeper nodes are more confident (each accepted token lengthens the match).
    assert np.all(np.diff(tree.probs) > 0)


def test_branching_tree_for_two_continuations(drafter):
    a = [50, 51, 52]
    ctx = np.array([1] + a + [60, 61] + [2] + a + [70, 71] + [3] + a, np.int32)
    tree = drafter.propose(ctx, 64)
    tree.validate()
    assert sorted(children(tree, -1)) == [60, 70]
    # 70 followed the more recent occurrence, so it ranks first on a tie.
    assert int(tree.tokens[0]) == 70
    kids = [i for i in range(len(tree)) if tree.parents[i] == -1]
    assert tree.probs[kids].sum() <= 1.0
    # Each branch continues with its own follower.
    i60 = kids[[int(tree.tokens[i]) for i in kids].index(60)]
    i70 = kids[[int(tree.tokens[i]) for i in kids].index(70)]
    assert children(tree, i60) == [61]
    assert children(tree, i70) == [71]


def test_accepts_lists_and_int64_and_keeps_no_reference(drafter):
    ctx = [4, 5, 6, 9, 4, 5]
    t1 = drafter.propose(ctx, 8)
    t2 = drafter.propose(np.array(ctx, np.int64), 8)
    assert t1.tokens.tolist() == t2.tokens.tolist() == [6, 9, 4, 5]
    # Proposals own their arrays: a later call must not change an earlier one.
    before = t1.tokens.copy()
    drafter.propose([7, 7, 7, 7, 7], 8)
    assert np.array_equal(t1.tokens, before)


def test_begin_observe_are_noops(drafter):
    drafter.begin(np.array([1, 2, 3], np.int32))
    drafter.observe(None)


def test_small_config_limits():
    d = SuffixDrafter(SuffixConfig(max_depth=3, max_nodes=4, max_matches=1))
    ctx = np.array([1, 2, 3, 4, 5, 6, 1, 2], np.int32)
    tree = d.propose(ctx, 100)
    assert tree.tokens.tolist() == [3, 4, 5]
    assert len(d.propose(np.array([1, 2] * 20, np.int32), 100)) <= 4


@pytest.mark.parametrize("kw", [
    dict(min_match=0), dict(max_match=0), dict(max_matches=0), dict(max_depth=-1),
    dict(max_nodes=0), dict(min_match=5, max_match=4), dict(max_nodes=2.5),
    dict(min_match=True),
])
def test_config_validation(kw):
    with pytest.raises(ValueError):
        SuffixConfig(**kw)


def test_make_drafter():
    d = make_drafter("none")
    assert type(d) is Drafter and d.name == "none"
    assert len(d.propose(np.array([1, 2, 1, 2], np.int32), 8)) == 0
    s = make_drafter("suffix", max_nodes=16)
    assert isinstance(s, SuffixDrafter) and s.name == "suffix"
    assert s.config.max_nodes == 16
    with pytest.raises(ValueError, match="none.*suffix"):
        make_drafter("eagle")
