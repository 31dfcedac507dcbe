"""Corpus compilation kernels: counting n-grams and sorting suffixes.

What `edgespec.corpus.compile` runs over token arrays too large for Python
loops: merging sorted runs of n-gram counts, cutting each context's counts to
its most frequent successors, and the steps of the prefix-doubling suffix sort.
Unlike the drafting kernels these allocate and return their results: they run
once per build, not per drafted token.
"""
import numpy as np
from numba import njit


@njit(cache=True)
def merge_counts(ka, ca, kb, cb):
    """Merge two runs of (sorted unique key, count) into one, summing counts of equal keys."""
    na, nb = len(ka), len(kb)
    k = np.empty(na + nb, np.int64)
    c = np.empty(na + nb, np.int64)
    i = j = n = 0
    while i < na and j < nb:
        if ka[i] < kb[j]:
            k[n] = ka[i]
            c[n] = ca[i]
            i += 1
        elif kb[j] < ka[i]:
            k[n] = kb[j]
            c[n] = cb[j]
            j += 1
        else:
            k[n] = ka[i]
            c[n] = ca[i] + cb[j]
            i += 1
            j += 1
        n += 1
    while i < na:
        k[n] = ka[i]
        c[n] = ca[i]
        i += 1
        n += 1
    while j < nb:
        k[n] = kb[j]
        c[n] = cb[j]
        j += 1
        n += 1
    return k[:n].copy(), c[:n].copy()


@njit(cache=True)
def top_successors(keys, counts, V, k):
    """Rows of successors from sorted unique keys ctx * V + next with their counts.

    For each context (a run of equal keys // V) keep the k most frequent nexts,
    count descending, ties by next ascending (the keys are ascending, and a
    later entry only passes entries with a strictly smaller count).
    Returns row_ctx int64[R], row_total int64[R] (every successor, unpruned),
    row_ptr int64[R+1], nxt int32[E], cnt int64[E].
    """
    n = len(keys)
    R = 0
    E = 0
    i = 0
    while i < n:
        c = keys[i] // V
        j = i
        while j < n and keys[j] // V == c:
            j += 1
        R += 1
        E += min(k, j - i)
        i = j
    row_ctx = np.empty(R, np.int64)
    row_total = np.empty(R, np.int64)
    row_ptr = np.empty(R + 1, np.int64)
    nxt = np.empty(E, np.int32)
    cnt = np.empty(E, np.int64)
    buf = np.empty(max(k, 1), np.int64)
    i = 0
    r = 0
    e = 0
    while i < n:
        c = keys[i] // V
        j = i
        tot = 0
        m = 0
        while j < n and keys[j] // V == c:
            x = counts[j]
            tot += x
            p = m
            while p > 0 and counts[buf[p - 1]] < x:
                p -= 1
            if p < k:
                q = min(m, k - 1)
                while q > p:
                    buf[q] = buf[q - 1]
                    q -= 1
                buf[p] = j
                if m < k:
                    m += 1
            j += 1
        row_ctx[r] = c
        row_total[r] = tot
        row_ptr[r] = e
        for q in range(m):
            nxt[e + q] = keys[buf[q]] % V
            cnt[e + q] = counts[buf[q]]
        e += m
        r += 1
        i = j
    row_ptr[R] = e
    return row_ctx, row_total, row_ptr, nxt, cnt


@njit(cache=True)
def run_lengths(tokens):
    """d[p] = tokens from p up to (not including) the next separator; 0 at a separator."""
    n = len(tokens)
    d = np.empty(n, np.int32)
    run = 0
    for p in range(n - 1, -1, -1):
        if tokens[p] < 0:
            run = 0
        else:
            run += 1
        d[p] = run
    return d


@njit(cache=True)
def pair_keys(pos, rank, d, k):
    """Prefix-doubling key of each position: (rank of its first k tokens) << 32 |
    (rank of the next k tokens, or 0 when the key ends at a separator before them)."""
    out = np.empty(len(pos), np.int64)
    for i in range(len(pos)):
        p = pos[i]
        second = rank[p + k] if d[p] > k else 0
        out[i] = (np.int64(rank[p]) << 32) | np.int64(second)
    return out


@njit(cache=True)
def assign_ranks(keys, order, pos, rank):
    """Dense ranks from 1 in sorted order (equal keys share a rank); returns the
    number of distinct keys."""
    r = 0
    prev = np.int64(-1)
    for i in range(len(order)):
        kk = keys[order[i]]
        if i == 0 or kk != prev:
            r += 1
            prev = kk
        rank[pos[order[i]]] = r
    return r
