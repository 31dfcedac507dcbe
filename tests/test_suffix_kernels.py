"""Tests of edgespec.kernels.suffix against hand-worked cases and a pure-Python
reference implementation."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from edgespec.kernels.suffix import (
    build_continuation_tree,
    find_suffix_matches,
    warmup,
)


# --------------------------------------------------------------------------
# helpers

def matches(tokens, min_len=1, max_len=32, max_matches=8):
    """Run the kernel; return [(e, L), ...]."""
    t = np.asarray(tokens, dtype=np.int32)
    ends = np.full(max(max_matches, 1), -7, np.int32)
    lens = np.full(max(max_matches, 1), -7, np.int32)
    k = find_suffix_matches(t, len(t), min_len, max_len, max_matches, ends, lens)
    return list(zip(ends[:k].tolist(), lens[:k].tolist()))


def tree(tokens, found, max_depth=12, max_nodes=256):
    """Run the tree kernel on matches `found`; return (tokens, parents, probs, mlen)."""
    t = np.asarray(tokens, dtype=np.int32)
    ends = np.array([e for e, _ in found] or [0], np.int32)
    lens = np.array([L for _, L in found] or [0], np.int32)
    cap = max(max_nodes, 1)
    ot = np.full(cap, -7, np.int32)
    op = np.full(cap, -7, np.int32)
    opr = np.full(cap, -7, np.float32)
    om = np.full(cap, -7, np.int32)
    m = build_continuation_tree(t, len(t), ends, lens, len(found), max_depth, max_nodes,
                                ot, op, opr, om)
    return ot[:m].tolist(), op[:m].tolist(), opr[:m].tolist(), om[:m].tolist()


def paths(toks, pars):
    """Token path (root excluded) of every node."""
    out = []
    for i, (t, p) in enumerate(zip(toks, pars)):
        out.append((out[p] if p >= 0 else ()) + (t,))
    return out


def check_tree_shape(toks, pars, probs):
    for i, p in enumerate(pars):
        assert -1 <= p < i, "parents must come before children"
    kids = {}
    for i, (t, p) in enumerate(zip(toks, pars)):
        kids.setdefault(p, []).append(i)
    for p, ch in kids.items():
        assert len({toks[c] for c in ch}) == len(ch), "siblings must carry distinct tokens"
        assert sum(probs[c] for c in ch) <= 1.0 + 1e-6, "sibling probs must sum to <= 1"
    assert all(0.0 <= q <= 1.0 for q in probs)


def conf(L):
    return L / (L + 2.0)


def test_warmup_runs():
    warmup()


# --------------------------------------------------------------------------
# find_suffix_matches: hand-worked cases

def test_two_equal_matches_recent_first():
    # Suffix [5,6,7] (positions 8..10) also ends at e=6 (preceded by 1 vs 2:
    # mismatch after 3 tokens) and at e=2 (the match runs into position 0, so
    # L is capped at e+1 = 3).  Equal L, so the more recent e=6 comes first.
    assert matches([5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7]) == [(6, 3), (2, 3)]


def test_longer_older_match_beats_shorter_recent():
    # tokens: 1 2 3 9 2 3 8 1 2 3 ; suffix ends in "1 2 3".
    # e=5: "2 3" matches, then 9 != 1 -> L=2.  e=2: "1 2 3" -> L=3 (touches start).
    t = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    assert matches(t) == [(2, 3), (5, 2)]
    # min_len=3 drops the L=2 occurrence.
    assert matches(t, min_len=3) == [(2, 3)]
    # min_len above max_len can never be met.
    assert matches(t, min_len=5, max_len=4) == []


def test_tiny_inputs():
    assert matches([]) == []             # n=0
    assert matches([3]) == []            # n=1: only the suffix itself
    assert matches([3, 3]) == [(0, 1)]   # n=2: e=0 repeats the last token, L capped at e+1=1
    assert matches([3, 4]) == []         # n=2, different tokens
    assert matches([3, 3], min_len=2) == []


def test_no_match():
    assert matches([1, 2, 3, 4, 5]) == []


def test_n_smaller_than_array():
    # Only tokens[:n] count: with n=4 the suffix is [.., 1, 2] of [1,2,1,2].
    t = np.array([1, 2, 1, 2, 9, 9, 9], np.int32)
    ends = np.zeros(4, np.int32)
    lens = np.zeros(4, np.int32)
    k = find_suffix_matches(t, 4, 1, 32, 4, ends, lens)
    assert list(zip(ends[:k], lens[:k])) == [(1, 2)]


def test_max_len_cut():
    # 1 2 3 1 2 3: e=2 would match 3 tokens, but max_len=2 caps it.
    assert matches([1, 2, 3, 1, 2, 3]) == [(2, 3)]
    assert matches([1, 2, 3, 1, 2, 3], max_len=2) == [(2, 2)]


def test_max_matches_cut():
    # Suffix [1]; it occurs at e=5, 3, 1, each preceded by a different token
    # than the one before the suffix (3, 2, 9 vs 4), so all have L=1.  With
    # max_matches=2 the two most recent survive.
    t = [9, 1, 2, 1, 3, 1, 4, 1]
    assert matches(t) == [(5, 1), (3, 1), (1, 1)]
    assert matches(t, max_matches=2) == [(5, 1), (3, 1)]
    assert matches(t, max_matches=0) == []


def test_overlapping_self_repetition():
    # 1 1 1 1: e=2 matches 3 tokens (windows 0..2 and 1..3 overlap), e=1 two,
    # e=0 one (each capped by e+1).
    assert matches([1, 1, 1, 1]) == [(2, 3), (1, 2), (0, 1)]
    # A long run with a small max_len: the scan may stop once the output is
    # full of max_len matches; the two most recent are the right answer.
    assert matches([1] * 50, max_len=4, max_matches=2) == [(48, 4), (47, 4)]


def test_eviction_keeps_best():
    # The best match is the oldest: make sure a full output still admits it.
    # 7 8 9 | 0 9 | 0 9 | 0 9 | 7 8 9 : suffix "7 8 9"
    t = [7, 8, 9, 0, 9, 0, 9, 0, 9, 7, 8, 9]
    # e=8,6,4 have L=1 ("9" preceded by 0 vs 8); e=2 has L=3.
    assert matches(t, max_matches=2) == [(2, 3), (8, 1)]


# --------------------------------------------------------------------------
# build_continuation_tree: hand-worked cases

def test_tree_two_branches_from_root():
    t = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7]
    found = matches(t)  # [(6, 3), (2, 3)]
    toks, pars, probs, mlen = tree(t, found)
    check_tree_shape(toks, pars, probs)
    # Continuations: after e=6: 2 5 6 7 (stops at n); after e=2: 1 5 6 7 2 5 6 7.
    # They differ at once, so the trie is two chains of 4 + 8 nodes.
    assert len(toks) == 12
    assert set(paths(toks, pars)) == {
        (2,), (2, 5), (2, 5, 6), (2, 5, 6, 7),
        (1,), (1, 5), (1, 5, 6), (1, 5, 6, 7), (1, 5, 6, 7, 2), (1, 5, 6, 7, 2, 5),
        (1, 5, 6, 7, 2, 5, 6), (1, 5, 6, 7, 2, 5, 6, 7),
    }
    # Both first-level nodes carry weight 9 of 18 and L_eff=3:
    # p = 0.5 * 3/5 = 0.3.  Equal cumulative probability: the node of the
    # first match (e=6, token 2) is created first and so emitted first.
    assert toks[:2] == [2, 1] and pars[:2] == [-1, -1]
    assert probs[0] == pytest.approx(0.3) and probs[1] == pytest.approx(0.3)
    # Deeper nodes have a single match: ratio 1, L_eff = 3 + depth - 1.
    for (path, q) in zip(paths(toks, pars), probs):
        if len(path) > 1:
            assert q == pytest.approx(conf(3 + len(path) - 1))
    assert all(x == 3 for x in mlen)


def test_tree_shared_prefix_merged():
    # 1 2 4 5 6 | 1 2 4 5 7 | 1 2 : the suffix "1 2" ends at e=6 and e=1 (L=2
    # each).  With max_depth=3 the continuations are 4 5 7 and 4 5 6, which
    # share "4 5": trie 4 -> 5 -> {7, 6}.
    t = [1, 2, 4, 5, 6, 1, 2, 4, 5, 7, 1, 2]
    found = matches(t)
    assert found == [(6, 2), (1, 2)]
    toks, pars, probs, mlen = tree(t, found, max_depth=3)
    check_tree_shape(toks, pars, probs)
    assert toks == [4, 5, 7, 6]
    assert pars == [-1, 0, 1, 1]
    # 4: weight 8/8 * conf(2) = 0.5 ; 5: 8/8 * conf(3) = 0.6 ;
    # 7 and 6: 4/8 * conf(4) = 1/3 each (7 first: its match ranks first).
    assert probs == pytest.approx([0.5, 0.6, 1 / 3, 1 / 3])
    assert mlen == [2, 2, 2, 2]


def test_tree_weights_favour_long_matches():
    # Matches (e, L) given by hand: e=0 with L=3 continues with t[1]=8, e=1
    # with L=2 continues with t[2]=9 (max_depth=1).  Weights 9 and 4, root 13:
    # p(8) = 9/13 * conf(3), p(9) = 4/13 * conf(2).
    t = [0, 8, 9, 0]
    toks, pars, probs, mlen = tree(t, [(0, 3), (1, 2)], max_depth=1)
    assert toks == [8, 9] and pars == [-1, -1]
    assert probs == pytest.approx([9 / 13 * 0.6, 4 / 13 * 0.5])
    assert mlen == [3, 2]


def test_tree_truncated_to_max_nodes_is_prefix():
    t = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7]
    found = matches(t)
    full = tree(t, found)
    for k in range(0, len(full[0]) + 2):
        part = tree(t, found, max_nodes=k)
        assert part == tuple(x[:k] for x in full)


def test_tree_no_continuation_or_empty():
    t = [1, 2, 3]
    assert tree(t, []) == ([], [], [], [])
    # e = n-1 has no continuation; L=0 and e<0 are skipped.
    assert tree(t, [(2, 2), (0, 0), (-1, 3)]) == ([], [], [], [])
    assert tree(t, [(0, 1)], max_depth=0) == ([], [], [], [])


def test_tree_match_ends_at_parent():
    # Hand-given matches: e=3 continues with [7] only (cut by n=5), e=0 with
    # [7, 3, 0, 7].  Node "7" holds both (weight 8 of 8, p = conf(2)); its
    # child "3" only the second: p(3) = 4/8 * conf(2 + 1), so the siblings
    # under "7" sum to less than 1 because one match ended there.
    t = [0, 7, 3, 0, 7]
    toks, pars, probs, _ = tree(t, [(3, 2), (0, 2)], max_depth=4)
    assert toks == [7, 3, 0, 7] and pars == [-1, 0, 1, 2]
    assert probs[0] == pytest.approx(conf(2))
    assert probs[1] == pytest.approx(0.5 * conf(3))
    assert probs[2] == pytest.approx(conf(4))


# --------------------------------------------------------------------------
# property tests against pure-Python references

def ref_matches(tokens, min_len, max_len, max_matches):
    n = len(tokens)
    found = []
    for e in range(n - 1):
        L = 0
        while L < min(max_len, e + 1) and tokens[e - L] == tokens[n - 1 - L]:
            L += 1
        if L >= max(min_len, 1):
            found.append((e, L))
    found.sort(key=lambda x: (-x[1], -x[0]))
    return found[:max(max_matches, 0)]


def ref_tree(tokens, found, max_depth):
    """{path: (prob, mlen)} of the trie of continuations."""
    n = len(tokens)
    conts = [(tuple(tokens[e + 1:min(e + 1 + max_depth, n)]), L) for e, L in found]
    conts = [(c, L) for c, L in conts if c and L >= 1]
    root_w = sum(L * L for _, L in conts)
    weight, mlen = {(): root_w}, {}
    for c, L in conts:
        for d in range(1, len(c) + 1):
            p = c[:d]
            weight[p] = weight.get(p, 0) + L * L
            mlen[p] = max(mlen.get(p, 0), L)
    return {p: (weight[p] / weight[p[:-1]] * conf(mlen[p] + len(p) - 1), mlen[p])
            for p in mlen}


token_lists = st.lists(st.integers(0, 3), min_size=0, max_size=60)


@settings(max_examples=300, deadline=None)
@given(token_lists, st.integers(0, 5), st.integers(1, 10), st.integers(0, 10))
def test_matches_agree_with_reference(tokens, min_len, max_len, max_matches):
    assert matches(tokens, min_len, max_len, max_matches) == \
        ref_matches(tokens, min_len, max_len, max_matches)


@settings(max_examples=200, deadline=None)
@given(token_lists, st.integers(1, 4), st.integers(1, 12), st.integers(1, 8),
       st.integers(1, 10))
def test_tree_agrees_with_reference(tokens, min_len, max_len, max_matches, max_depth):
    found = ref_matches(tokens, min_len, max_len, max_matches)
    toks, pars, probs, mlen = tree(tokens, found, max_depth=max_depth, max_nodes=1000)
    check_tree_shape(toks, pars, probs)
    ref = ref_tree(tokens, found, max_depth)
    got = paths(toks, pars)
    # Exactly the continuation prefixes, each once.
    assert len(got) == len(set(got)) and set(got) == set(ref)
    for path, q, ml in zip(got, probs, mlen):
        assert q == pytest.approx(ref[path][0], rel=1e-5)
        assert ml == ref[path][1]
    # Emitted by non-increasing cumulative probability.
    cum = []
    for q, p in zip(probs, pars):
        cum.append(q * (cum[p] if p >= 0 else 1.0))
    assert all(a >= b * (1 - 1e-5) for a, b in zip(cum, cum[1:]))


@settings(max_examples=100, deadline=None)
@given(token_lists, st.integers(1, 6), st.integers(0, 20))
def test_truncated_tree_is_prefix_of_full(tokens, max_depth, max_nodes):
    found = ref_matches(tokens, 1, 8, 6)
    full = tree(tokens, found, max_depth=max_depth, max_nodes=1000)
    part = tree(tokens, found, max_depth=max_depth, max_nodes=max_nodes)
    assert part == tuple(x[:max_nodes] for x in full)
