"""Tests of edgespec.kernels.suffix against hand-worked cases and a pure-Python
reference implementation."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from edgespec.kernels.suffix import (
    SA_FILL_LENGTHS,
    build_continuation_tree,
    find_suffix_matches,
    merge_trees,
    sa_find_matches,
    warmup,
)
from edgespec.drafters.tree import SOURCE_CONTEXT as C, SOURCE_CORPUS as K, DraftTree


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


# --------------------------------------------------------------------------
# corpus kernels: sa_find_matches, separators in build_continuation_tree,
# merge_trees



def ref_sa(tokens, depth=32):
    """The spec's suffix array: every non-separator position, sorted by
    tokens[p:p+depth] cut at the first -1 (a prefix sorts first), ties by p."""
    def key(p):
        k = []
        for x in tokens[p:p + depth]:
            if x < 0:
                break
            k.append(x)
        return tuple(k)
    return sorted((p for p in range(len(tokens)) if tokens[p] >= 0), key=lambda p: (key(p), p))


def corpus_of(docs):
    """Documents -> corpus token list, each document followed by one -1."""
    out = []
    for d in docs:
        out += list(d) + [-1]
    return out


def sa_matches(tokens, ctx, min_len=1, max_len=32, max_matches=8, depth=32, sa=None):
    """Run sa_find_matches; return [(end, L), ...]."""
    t = np.asarray(tokens, np.int32)
    s = np.asarray(ref_sa(list(tokens), depth) if sa is None else sa, np.int32)
    c = np.asarray(ctx, np.int32)
    cap = max(max_matches, 1)
    pos = np.full(cap, -7, np.int32)
    lens = np.full(cap, -7, np.int32)
    k = sa_find_matches(t, s, depth, c, len(c), min_len, max_len, max_matches, pos, lens)
    return list(zip(pos[:k].tolist(), lens[:k].tolist()))


def ref_sa_matches(tokens, ctx, min_len, max_len, max_matches, depth):
    """Brute force, following the documented selection rule."""
    n = len(ctx)
    cap = min(max_len, depth, n)
    j = 0
    while j < cap and ctx[n - 1 - j] >= 0:
        j += 1
    cap = j
    min_len = max(min_len, 1)
    sa = ref_sa(tokens, depth)

    def rows(L):  # the SA interval of ctx[n-L:], in SA order
        pat = list(ctx[n - L:])
        return [p for p in sa if tokens[p:p + L] == pat]

    if max_matches < 1 or min_len > cap or not rows(min_len):
        return []
    best = max(L for L in range(min_len, cap + 1) if rows(L))

    def take(r, L, prev, need):
        ok = [i for i, p in enumerate(r) if prev is None or p == 0 or tokens[p - 1] != prev]
        if len(ok) <= need:
            return [(r[i] + L - 1, L) for i in ok]
        got, nxt = [], 0
        for i in range(need):
            x = max((2 * i + 1) * len(r) // (2 * need), nxt)
            while x < len(r) and x not in ok:
                x += 1
            if x >= len(r):
                break
            got.append((r[x] + L - 1, L))
            nxt = x + 1
        return got

    out = take(rows(best), best, None, max_matches)
    L = best - 1
    while len(out) < max_matches and L >= max(min_len, best - SA_FILL_LENGTHS):
        out += take(rows(L), L, ctx[n - L - 1], max_matches - len(out))
        L -= 1
    return out


def test_ref_sa_order():
    # docs "1 2 4" and "1 2 3": keys 1 2 3 < 1 2 4 < 2 3 < 2 4 < 3 < 4.
    assert ref_sa(corpus_of([[1, 2, 4], [1, 2, 3]])) == [4, 0, 5, 1, 6, 2]
    # a key cut by a separator sorts before its extensions; depth cuts keys
    # too, and equal keys keep position order.
    assert ref_sa([5, -1, 5, 6, -1]) == [0, 2, 3]
    assert ref_sa([5, 6, 5, 7, -1], depth=1) == [0, 2, 1, 3]


def test_sa_longest_match_and_end_positions():
    docs = [[7, 1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [2, 3, 4, 8, 8]]
    t = corpus_of(docs)          # doc starts at 0, 7, 13
    # context ends in "1 2 3 4": only doc 0 holds all four (ending at 4);
    # with max_matches=1 nothing else.
    assert sa_matches(t, [0, 1, 2, 3, 4], min_len=2, max_matches=1) == [(4, 4)]
    # More room: filled with the "2 3 4" occurrences that are not part of it
    # (length 3, ends at 10 and 15, SA order: followed by 6, then by 8).
    assert sa_matches(t, [0, 1, 2, 3, 4], min_len=2) == [(4, 4), (10, 3), (15, 3)]
    # "3 4" of length 2 exists nowhere else, so min_len=2 adds nothing.
    # min_len above the longest match: nothing.
    assert sa_matches(t, [0, 1, 2, 3, 4], min_len=5) == []
    # max_len caps the length: three occurrences of "3 4" (all length 2, SA
    # order by continuation 5, 6, 8).
    assert sa_matches(t, [0, 1, 2, 3, 4], max_len=2) == [(4, 2), (10, 2), (15, 2)]
    # sa_depth caps it too.
    assert sa_matches(t, [0, 1, 2, 3, 4], depth=2) == [(4, 2), (10, 2), (15, 2)]


def test_sa_fill_stops_after_fill_lengths():
    # The context ends in 10..17.  Doc 0 holds all 8 tokens (L=8), doc 1 only
    # the last 4, doc 2 only the last 3.  Filling goes down to 8 - 4 = 4.
    assert SA_FILL_LENGTHS == 4
    ctx = list(range(10, 18))
    t = corpus_of([ctx + [99], [5, 14, 15, 16, 17, 51], [6, 15, 16, 17, 50]])
    assert sa_matches(t, ctx) == [(7, 8), (14, 4)]
    # With a longest match of 7 the 3-token one is in reach.
    assert sa_matches(t, ctx, max_len=7) == [(7, 7), (14, 4), (20, 3)]


def test_sa_separators_never_match():
    # "5 6" ends doc 0 and starts doc 1: "5 6 -1 5 6" must not match across.
    t = corpus_of([[5, 6], [5, 6, 7]])
    assert sa_matches(t, [5, 6, 5, 6]) == [(1, 2), (4, 2)]   # "5 6" twice, SA order
    assert sa_matches(t, [6, 5, 6], min_len=3) == []
    # A negative context token never matches a separator.
    assert sa_matches(t, [6, -1, 5], min_len=2) == []
    assert sa_matches(t, [6, -1, 5, 6]) == [(1, 2), (4, 2)]


def test_sa_no_match_and_empty():
    t = corpus_of([[1, 2, 3]])
    assert sa_matches(t, [4, 5]) == []
    assert sa_matches(t, []) == []
    assert sa_matches(t, [1, 2], max_matches=0) == []
    assert sa_matches([-1], [1, 2]) == []    # an empty corpus (one empty document)


def test_sa_many_occurrences_spread_over_interval():
    # "1 2" is followed by 3 in 6 documents and by 4 in 2: 8 occurrences,
    # taken 4 at a time at evenly spaced SA rows -> 3 of 3-continuations, 1 of 4.
    docs = [[1, 2, 3]] * 6 + [[1, 2, 4]] * 2
    t = corpus_of(docs)
    got = sa_matches(t, [1, 2], max_matches=4)
    follow = [t[e + 1] for e, _ in got]
    assert sorted(follow) == [3, 3, 3, 4]
    assert all(L == 2 for _, L in got)


corpus_tokens = st.lists(st.integers(-1, 2), min_size=1, max_size=50).map(lambda x: x + [-1])


@settings(max_examples=300, deadline=None)
@given(corpus_tokens, st.lists(st.integers(0, 2), max_size=12), st.integers(0, 4),
       st.integers(1, 8), st.integers(0, 6), st.integers(1, 5))
def test_sa_matches_agree_with_reference(tokens, ctx, min_len, max_len, max_matches, depth):
    got = sa_matches(tokens, ctx, min_len, max_len, max_matches, depth)
    assert got == ref_sa_matches(tokens, ctx, min_len, max_len, max_matches, depth)
    # Semantic checks independent of the selection rule.
    n = len(ctx)
    ends = [e for e, _ in got]
    assert len(set(ends)) == len(ends)
    assert all(a[1] >= b[1] for a, b in zip(got, got[1:]))
    for e, L in got:
        assert max(min_len, 1) <= L <= min(max_len, depth)
        assert tokens[e - L + 1:e + 1] == ctx[n - L:]
        if L < got[0][1]:   # a fill: exactly this long
            assert e - L < 0 or tokens[e - L] != ctx[n - L - 1]


def test_tree_stops_at_separator():
    t = corpus_of([[1, 2, 3, 4], [1, 2, 5]])   # 1 2 3 4 -1 1 2 5 -1
    found = sa_matches(t, [1, 2])
    assert sorted(found) == [(1, 2), (6, 2)]
    toks, pars, probs, _ = tree(t, found, max_depth=5)
    check_tree_shape(toks, pars, probs)
    assert set(paths(toks, pars)) == {(3,), (3, 4), (5,)}
    # A match right before a separator adds weight but no node.
    toks, pars, probs, _ = tree(t, [(3, 2), (1, 2)], max_depth=5)
    assert paths(toks, pars) == [(3,), (3, 4)]
    assert probs[0] == pytest.approx(0.5 * conf(2))


# merge_trees

def mk_tree(paths_probs, source):
    """[(path tuple, prob)] in parents-first order -> arrays."""
    index, toks, pars, probs = {}, [], [], []
    for path, q in paths_probs:
        index[path] = len(toks)
        toks.append(path[-1])
        pars.append(index[path[:-1]] if len(path) > 1 else -1)
        probs.append(q)
    m = len(toks)
    return (np.array(toks, np.int32), np.array(pars, np.int32),
            np.array(probs, np.float32), np.full(m, source, np.int8))


def merge(a, b, max_nodes=64):
    cap = max(max_nodes, 1)
    out = (np.full(cap, -7, np.int32), np.full(cap, -7, np.int32),
           np.full(cap, -7, np.float32), np.full(cap, -7, np.int8))
    m = merge_trees(*a, len(a[0]), *b, len(b[0]), max_nodes, *out)
    return tuple(x[:m].tolist() for x in out)


def test_merge_hand_worked():
    a = mk_tree([((1,), 0.6), ((1, 2), 0.5)], C)
    b = mk_tree([((1,), 0.8), ((3,), 0.1), ((1, 4), 0.5), ((1, 2), 0.3)], K)
    toks, pars, probs, src = merge(a, b)
    got = {path: (q, s) for path, q, s in zip(paths(toks, pars), probs, src)}
    # (1,): shared -> context source, larger prob 0.8.  (3,): root's A children
    # sum to 0.6, so 0.1 * 0.4.  (1, 2): shared, 0.5.  (1, 4): A's children of
    # (1,) sum to 0.5 -> 0.5 * 0.5.
    assert got[(1,)] == (pytest.approx(0.8), C)
    assert got[(1, 2)] == (pytest.approx(0.5), C)
    assert got[(1, 4)] == (pytest.approx(0.25), K)
    assert got[(3,)] == (pytest.approx(0.04), K)
    assert toks == [1, 2, 4, 3]   # by cumulative prob: .8, .4, .2, .04
    # Budget: a prefix.
    assert merge(a, b, max_nodes=2) == tuple(x[:2] for x in (toks, pars, probs, src))
    # Empty B gives A back; empty A gives B back.
    assert merge(a, mk_tree([], K)) == tuple(x.tolist() for x in a)
    assert merge(mk_tree([], C), b)[0] == [1, 4, 2, 3]
    assert merge(mk_tree([], C), mk_tree([], K)) == ([], [], [], [])


def test_merge_scales_oversubscribed_siblings():
    a = mk_tree([((1,), 0.5), ((2,), 0.4)], 0)
    b = mk_tree([((1,), 0.9)], 1)
    toks, _, probs, src = merge(a, b)
    assert toks == [1, 2] and src == [0, 0]
    assert probs == pytest.approx([0.9 / 1.3, 0.4 / 1.3])


def random_trie(draw_ints, n, vocab):
    """A random trie from a flat list of ints: (paths, probs), parents first."""
    paths_, seen = [], set()
    for i in range(n):
        parent = draw_ints[2 * i] % (len(paths_) + 1) - 1
        t = draw_ints[2 * i + 1] % vocab
        path = (paths_[parent] if parent >= 0 else ()) + (t,)
        if path not in seen:
            seen.add(path)
            paths_.append(path)
    return paths_


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=60, max_size=60),
       st.lists(st.integers(0, 1000), min_size=60, max_size=60),
       st.integers(0, 30), st.integers(0, 30), st.integers(0, 70))
def test_merge_properties(ia, ib, na, nb, max_nodes):
    pa = random_trie(ia, na, 3)
    pb = random_trie(ib, nb, 3)
    # Probabilities from a sibling-normalised random weight.
    def with_probs(ps, seed):
        rng = np.random.default_rng(seed)
        w = {p: rng.random() for p in ps}
        tot = {}
        for p in ps:
            tot[p[:-1]] = tot.get(p[:-1], 0.0) + w[p]
        return [(p, 0.9 * w[p] / tot[p[:-1]]) for p in ps]
    a = mk_tree(with_probs(pa, na), 0)
    b = mk_tree(with_probs(pb, nb), 1)
    toks, pars, probs, src = merge(a, b, max_nodes)
    DraftTree(np.array(toks, np.int32), np.array(pars, np.int32),
              np.array(probs, np.float32), np.array(src, np.int8)).validate()
    assert len(toks) == min(max_nodes, len(set(pa) | set(pb)))
    check_tree_shape(toks, pars, probs)
    got = paths(toks, pars)
    set_a = set(pa)
    for path, s in zip(got, src):
        assert s == (0 if path in set_a else 1)
        assert path in set_a or path in set(pb)
    cum = []
    for q, p in zip(probs, pars):
        cum.append(q * (cum[p] if p >= 0 else 1.0))
    assert all(x >= y * (1 - 1e-5) for x, y in zip(cum, cum[1:]))
