"""Tests of the suffix drafter (edgespec.drafters.suffix) and the factory."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from edgespec.drafters import (
    Drafter,
    SuffixConfig,
    SuffixDrafter,
    make_drafter,
)
from edgespec.drafters.tree import SOURCE_CONTEXT, SOURCE_CORPUS, DraftTree


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
    # One earlier occurrence of "10 11 12 13 14": a single chain of the rest
    # of the phrase and what followed it (max_depth=32 tokens, up to the end)
    cont = phrase[5:] + [7, 8] + phrase[:5]
    assert tree.tokens.tolist() == cont
    assert tree.parents.tolist() == list(range(-1, len(cont) - 1))
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


# --------------------------------------------------------------------------
# corpora

def make_corpus(docs, depth=32, readonly=False):
    """A stand-in for edgespec.corpus.format.Corpus with the arrays the suffix
    drafter reads, built by a pure-Python reference of the spec's order."""
    toks = []
    for d in docs:
        toks += list(d) + [-1]

    def key(p):
        k = []
        for x in toks[p:p + depth]:
            if x < 0:
                break
            k.append(x)
        return tuple(k)
    sa = sorted((p for p in range(len(toks)) if toks[p] >= 0), key=lambda p: (key(p), p))
    tokens = np.array(toks, np.int32)
    sa = np.array(sa, np.int32)
    if readonly:
        tokens.setflags(write=False)
        sa.setflags(write=False)
    return SimpleNamespace(tokens=tokens, sa=sa, sa_depth=depth)


def paths_of(tree: DraftTree) -> list[tuple]:
    out = []
    for t, p in zip(tree.tokens.tolist(), tree.parents.tolist()):
        out.append((out[p] if p >= 0 else ()) + (t,))
    return out


PASSAGE = list(range(100, 130))


def test_positional_config_still_works():
    d = SuffixDrafter(SuffixConfig(max_nodes=8))
    assert d.config.max_nodes == 8 and d.n_corpora == 0
    d = SuffixDrafter(None, [make_corpus([[1, 2, 3]])])
    assert d.n_corpora == 1


def test_corpus_fills_when_context_has_no_match():
    corpus = make_corpus([[1, 2] + PASSAGE + [3], [4, 5, 6]])
    d = SuffixDrafter(corpora=[corpus])
    d.warmup()
    ctx = np.array([7, 8, 9] + PASSAGE[:6], np.int32)   # no repeat in the context
    assert len(SuffixDrafter().propose(ctx, 64)) == 0
    tree = d.propose(ctx, 64)
    tree.validate()
    # One occurrence: a chain of the rest of its document (up to max_depth=32
    # tokens; the separator after the document ends it)
    cont = PASSAGE[6:] + [3]
    assert tree.tokens.tolist() == cont
    assert tree.parents.tolist() == list(range(-1, len(cont) - 1))
    assert np.all(tree.source == SOURCE_CORPUS)
    # Budget respected, and a prefix of the larger proposal.
    small = d.propose(ctx, 5)
    assert small.tokens.tolist() == PASSAGE[6:11]


def test_corpus_continuation_stops_at_document_end():
    corpus = make_corpus([PASSAGE[:8], PASSAGE[8:]])
    d = SuffixDrafter(corpora=[corpus])
    tree = d.propose(np.array([1] + PASSAGE[:5], np.int32), 64)
    assert tree.tokens.tolist() == PASSAGE[5:8]   # the document ends after PASSAGE[7]


def test_corpus_min_match():
    corpus = make_corpus([[50, 51, 52, 53]])
    ctx = np.array([9, 51, 52], np.int32)          # a 2-token corpus match
    assert len(SuffixDrafter(corpora=[corpus]).propose(ctx, 16)) == 0
    d = SuffixDrafter(SuffixConfig(corpus_min_match=2), corpora=[corpus])
    assert d.propose(ctx, 16).tokens.tolist() == [53]
    assert d.propose(np.array([50, 51, 52], np.int32), 16).tokens.tolist() == [53]


def test_corpus_adds_branches_beside_the_context():
    # The context saw "10 11 12" followed by 20 21; the corpus has it followed
    # by 30 31 and, with the context's own continuation, 20 22.
    ctx = np.array([1, 10, 11, 12, 20, 21, 2, 3, 10, 11, 12], np.int32)
    corpus = make_corpus([[10, 11, 12, 30, 31], [10, 11, 12, 20, 22]])
    tree = SuffixDrafter(corpora=[corpus]).propose(ctx, 64)
    tree.validate()
    p = paths_of(tree)
    src = dict(zip(p, tree.source.tolist()))
    assert src[(20,)] == SOURCE_CONTEXT and src[(20, 21)] == SOURCE_CONTEXT
    assert src[(30,)] == SOURCE_CORPUS and src[(20, 22)] == SOURCE_CORPUS
    # The context's branch ranks first; corpus-only nodes share what it leaves.
    assert p[0] == (20,)
    kids = [i for i in range(len(tree)) if tree.parents[i] == -1]
    assert tree.probs[kids].sum() <= 1.0
    assert tree.probs[p.index((30,))] < tree.probs[p.index((20,))]
    # A budget of 2 keeps the best two nodes, a valid tree.
    two = SuffixDrafter(corpora=[corpus]).propose(ctx, 2)
    two.validate()
    assert paths_of(two)[0] == (20,) and len(two) == 2


def test_corpus_probs_follow_agreement():
    # "7 8 9" is followed by 1 in four documents and by 2 in one.
    corpus = make_corpus([[7, 8, 9, 1]] * 4 + [[7, 8, 9, 2]])
    tree = SuffixDrafter(corpora=[corpus]).propose(np.array([0, 7, 8, 9], np.int32), 8)
    probs = dict(zip(tree.tokens.tolist(), tree.probs.tolist()))
    assert tree.tokens.tolist() == [1, 2]
    assert probs[1] == pytest.approx(4 * probs[2])


def test_several_corpora_and_readonly_arrays():
    c1 = make_corpus([[10, 11, 12, 40, 41]], readonly=True)
    c2 = make_corpus([[10, 11, 12, 50], [5, 11, 12, 60]], readonly=True)
    d = SuffixDrafter(SuffixConfig(corpus_min_match=2), corpora=[c1, c2])
    tree = d.propose(np.array([0, 10, 11, 12], np.int32), 64)
    tree.validate()
    p = paths_of(tree)
    # c2's "10 11 12" occurrence (and its "11 12" fill) add 50 and 60 beside c1's 40.
    assert set(p) == {(40,), (40, 41), (50,), (60,)}
    assert p[0] == (40,) and np.all(tree.source == SOURCE_CORPUS)
    # Budget over several merges.
    for budget in range(0, 6):
        t = d.propose(np.array([0, 10, 11, 12], np.int32), budget)
        t.validate()
        assert len(t) == min(budget, 4)
        assert paths_of(t) == p[:len(t)]


def test_random_contexts_with_corpus_give_valid_trees():
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 5, size=int(rng.integers(1, 40))).tolist() for _ in range(20)]
    d = SuffixDrafter(SuffixConfig(max_nodes=32), corpora=[make_corpus(docs, depth=8)])
    for _ in range(50):
        ctx = rng.integers(0, 5, size=int(rng.integers(0, 60))).astype(np.int32)
        budget = int(rng.integers(0, 40))
        tree = d.propose(ctx, budget)
        tree.validate(n_vocab=5)
        assert len(tree) <= min(budget, 32)
        assert np.all((tree.probs >= 0) & (tree.probs <= 1))
        cum = []
        for q, p in zip(tree.probs.tolist(), tree.parents.tolist()):
            cum.append(q * (cum[p] if p >= 0 else 1.0))
        assert all(a >= b * (1 - 1e-5) for a, b in zip(cum, cum[1:]))


@pytest.mark.parametrize("kw", [dict(corpus_min_match=0), dict(corpus_min_match=40)])
def test_corpus_config_validation(kw):
    with pytest.raises(ValueError):
        SuffixConfig(**kw)


def test_the_suffix_config_holds_the_product_and_plug_ins_hold_the_research():
    """Issue 63: SuffixConfig holds what the default uses and what a user
    tunes (at most 10 fields); the position EMA, ReSpec's feedback and the
    learned edits plug in through the registry with their own settings, and
    the spec strings results files record keep their meaning."""
    import dataclasses
    from edgespec.drafters import parse_drafter_name
    from edgespec.errors import ConfigError
    assert len(dataclasses.fields(SuffixConfig)) <= 10
    assert parse_drafter_name("suffix-noedits") == ("suffix", True, {"edits": False})
    assert parse_drafter_name("suffix+edits+edit_gap=4") == ("suffix", True, {"edits": True, "edit_gap": 4})
    assert parse_drafter_name("suffix+feedback+feedback_min=0.3") == ("suffix", True, {"feedback": True,
                                                                                     "feedback_min": 0.3})
    assert parse_drafter_name("suffix+max_depth=12-nomemory") == ("suffix", True, {"max_depth": 12, "memory": False})
    with pytest.raises(ValueError, match="not a numeric setting"):
        parse_drafter_name("suffix+edit_gapp=4")
    with pytest.raises(ValueError, match="not a switch"):
        parse_drafter_name("suffix+edit")
    assert make_drafter("suffix", edits=False).plugins == {} and not make_drafter("suffix-noedits".split("-")[0]).observes
    d = make_drafter("suffix", edits=True, position_ema=True, feedback=True, edit_gap=4, ema_min=0.2, max_depth=9)
    assert list(d.plugins) == ["position_ema", "feedback", "edits"] and d.observes
    assert (d.plugins["edits"].config.edit_gap, d.plugins["position_ema"].config.ema_min) == (4, 0.2)
    assert d.plugins["edits"].max_depth == d.plugins["feedback"].max_depth == 9 == d.config.max_depth
    for bad in (dict(edit_trust=2.0), dict(feedback_rate=0.0), dict(ema_decay=1.0), dict(edit_gap=0)):
        with pytest.raises(ConfigError):       # checked even with the plug-in off
            make_drafter("suffix", **bad)
    with pytest.raises(TypeError):
        make_drafter("suffix", no_such_setting=1)
