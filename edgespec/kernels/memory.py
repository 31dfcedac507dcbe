"""Memory-store kernels: index past requests' tokens by hashes of their last
k tokens, and find where the end of the current context occurred in them.

The store (edgespec/memory/store.py) is one flat int32 array: the entries
(past requests' text) one after another, each followed by a -1 separator.
Two chained hash indexes cover it, one over windows of K_SHORT tokens and
one over windows of K_LONG tokens:

    heads[h]   the most recent position p whose window tokens[p-k+1 .. p]
               hashes to slot h, or -1
    prev[p]    the next older position in the same slot, or -1

A window that holds a separator (or starts before position 0) is not
indexed, so a match never spans two entries.  Positions go into a chain in
increasing order, so every chain runs from the most recent position to the
oldest.  Hash collisions put different windows into one chain; a lookup
compares the tokens, so they cost a comparison, never a wrong match.

Lookup: the long index first (its chains hold only positions that share the
last K_LONG tokens, so the long matches are found however common their last
K_SHORT tokens are), then the short one; each chain is walked for at most
`max_chain` positions, which bounds a step's cost whatever the store holds.

All functions are ``numba.njit(cache=True)`` and pure over the caller's arrays.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from edgespec.kernels.suffix import build_continuation_tree
from edgespec.kernels.topk import push_sorted

K_SHORT = 3
"""Window of the short index: the shortest match the store can find."""
K_LONG = 12
"""Window of the long index."""

_HASH_MUL = 6017489            # odd; (h ^ t) * _HASH_MUL stays below 2**63 for h, t < 2**40
_HASH_MASK = (1 << 40) - 1


@njit(cache=True)
def window_hash(tokens, end, k):
    """A hash (>= 0) of tokens[end-k+1 .. end]; -1 when the window starts
    before 0 or holds a negative token (a separator)."""
    start = end - k + 1
    if start < 0 or end >= tokens.shape[0]:
        return np.int64(-1)
    h = np.int64(0)
    for j in range(start, end + 1):
        t = np.int64(tokens[j])
        if t < 0:
            return np.int64(-1)
        h = ((h ^ t) * _HASH_MUL) & _HASH_MASK
    return h


@njit(cache=True)
def hash_slot(h, mask):
    """The heads slot of hash h (mask = len(heads) - 1, a power of two minus 1)."""
    return (h ^ (h >> 17)) & mask


@njit(cache=True)
def index_range(tokens, start, end, k, heads, prev):
    """Index the windows ending at positions start .. end-1 (in increasing
    order, after every position before `start` was indexed): prev[p] links p
    to the slot's previous head.  Positions whose window is not indexable
    get prev[p] = -1 and stay out of the chains.  Returns how many went in."""
    mask = heads.shape[0] - 1
    end = min(end, tokens.shape[0], prev.shape[0])
    count = 0
    for p in range(max(start, 0), end):
        h = window_hash(tokens, p, k)
        if h < 0:
            prev[p] = -1
            continue
        s = hash_slot(h, mask)
        prev[p] = heads[s]
        heads[s] = p
        count += 1
    return count


@njit(cache=True)
def _contains(out_end, count, e):
    for i in range(count):
        if out_end[i] == e:
            return True
    return False


@njit(cache=True)
def _walk(tokens, n_store, heads, prev, k, ctx, n, min_len, max_len, max_matches, max_chain,
          out_end, out_len, count):
    """Walk one index's chain for the context's last k tokens, pushing each
    new occurrence of at least min_len matching tokens into out_end /
    out_len (best first: longer, then more recent).  Returns the new count,
    negative (-count - 1) once the output is full of max_len matches."""
    h = window_hash(ctx, n - 1, k)
    if h < 0:
        return count
    p = np.int64(heads[hash_slot(h, heads.shape[0] - 1)])
    steps = 0
    last = ctx[n - 1]
    while p >= 0 and steps < max_chain:
        steps += 1
        if p + 1 < n_store and tokens[p] == last:
            lim = min(max_len, p + 1, n)
            length = 1
            while length < lim and tokens[p - length] == ctx[n - 1 - length]:
                length += 1
            if length >= min_len and not _contains(out_end, count, p):
                count = push_sorted(out_len, out_end, count, max_matches, length, p)
                if count == max_matches and out_len[count - 1] >= max_len:
                    return -count - 1
        p = np.int64(prev[p])
    return count


@njit(cache=True)
def find_matches(tokens, n_store, heads_s, prev_s, heads_l, prev_l, ctx, n, min_len, max_len,
                 max_matches, max_chain, out_end, out_len):
    """Find occurrences in the store of the end of the context.

    tokens : int32 [>= n_store]  the store (entries separated by -1).
    heads_s, prev_s / heads_l, prev_l : the K_SHORT / K_LONG indexes of
        tokens[:n_store] (module doc).
    ctx : int32 [>= n]  the context; only ctx[:n] is read (no negative tokens).
    min_len : shortest match kept (below K_SHORT it acts as K_SHORT).
    max_len : a match is not extended past this many tokens.
    max_matches : at most this many occurrences (clamped to the outputs).
    max_chain : at most this many positions walked per index.
    out_end, out_len : int32; the end position e of each occurrence (its
        continuation starts at e + 1, which may be a separator) and its
        match length L: tokens[e-L+1 .. e] == ctx[n-L .. n-1].

    Returns the count k written, ordered by L descending, then e descending.
    When no chain walk was cut by max_chain these are exactly the best k of
    all occurrences in that order (every occurrence of at least K_LONG
    tokens is in the long chain, every one of at least K_SHORT tokens in the
    short one; a position found in both is taken once)."""
    n = min(n, ctx.shape[0])
    n_store = min(n_store, tokens.shape[0])
    max_matches = min(max_matches, out_end.shape[0], out_len.shape[0])
    if min_len < K_SHORT:
        min_len = K_SHORT
    if max_matches < 1 or max_len < min_len or n < min_len or n_store < 2:
        return 0
    count = 0
    if n >= K_LONG and max_len >= K_LONG:
        count = _walk(tokens, n_store, heads_l, prev_l, K_LONG, ctx, n, max(min_len, K_LONG), max_len,
                      max_matches, max_chain, out_end, out_len, count)
        if count < 0:
            return -count - 1
        if count == max_matches and out_len[count - 1] >= K_LONG:
            return count        # the short index only has shorter matches to add
    count = _walk(tokens, n_store, heads_s, prev_s, K_SHORT, ctx, n, min_len, max_len,
                  max_matches, max_chain, out_end, out_len, count)
    return count if count >= 0 else -count - 1


@njit(cache=True)
def propose_tree(tokens, n_store, heads_s, prev_s, heads_l, prev_l, ctx, n, min_len, max_len, max_matches,
                 max_chain, max_depth, max_nodes, ends, lens, out_tokens, out_parents, out_probs, out_source,
                 out_mlen, source):
    """find_matches, then the continuation tree of what followed them
    (kernels/suffix.build_continuation_tree) with every node's source set to
    `source`, in one call; ends / lens are scratch.  Returns the node count."""
    k = find_matches(tokens, n_store, heads_s, prev_s, heads_l, prev_l, ctx, n, min_len, max_len,
                     max_matches, max_chain, ends, lens)
    if k == 0:
        return 0
    m = build_continuation_tree(tokens, n_store, ends, lens, k, max_depth, max_nodes,
                                out_tokens, out_parents, out_probs, out_mlen)
    for i in range(m):
        out_source[i] = source
    return m


@njit(cache=True)
def compact(tokens, n, start, heads_s, prev_s, heads_l, prev_l):
    """Drop tokens[:start] (the oldest entries): move tokens[start:n] and their
    chain links to the front, every position shifted down by `start`; links
    to a dropped position end their chain (chains run from the most recent
    position to the oldest, so nothing after such a link is kept).  The
    index stays that of the moved tokens, without hashing them again.
    Returns the new length."""
    m = n - start
    for i in range(m):
        tokens[i] = tokens[start + i]
    for prev in (prev_s, prev_l):
        for i in range(m):
            v = prev[start + i]
            prev[i] = v - start if v >= start else -1
    for heads in (heads_s, heads_l):
        for h in range(heads.shape[0]):
            v = heads[h]
            heads[h] = v - start if v >= start else -1
    return m


def warmup() -> None:
    """Compile (or load from the cache) the kernels with the store's dtypes."""
    tokens = np.array([1, 2, 3, 4, -1, 1, 2, 3, 5, -1], np.int32)
    heads = np.full(16, -1, np.int32)
    prev = np.full(10, -1, np.int32)
    heads_l = np.full(16, -1, np.int32)
    prev_l = np.full(10, -1, np.int32)
    index_range(tokens, 0, 10, K_SHORT, heads, prev)
    index_range(tokens, 0, 10, K_LONG, heads_l, prev_l)
    ctx = np.array([7, 1, 2, 3], np.int32)
    ends, lens = np.zeros(4, np.int32), np.zeros(4, np.int32)
    find_matches(tokens, 10, heads, prev, heads_l, prev_l, ctx, 4, 3, 32, 4, 64, ends, lens)
    out = (np.zeros(8, np.int32), np.zeros(8, np.int32), np.zeros(8, np.float32), np.zeros(8, np.int8),
           np.zeros(8, np.int32))
    propose_tree(tokens, 10, heads, prev, heads_l, prev_l, ctx, 4, 3, 32, 4, 64, 4, 8, ends, lens, *out, 11)
    compact(tokens.copy(), 10, 5, heads.copy(), prev.copy(), heads_l.copy(), prev_l.copy())
