"""Top-k of logits rows: the model's k most likely next tokens at chosen batch
slots, read straight from llama.cpp's logits buffer.

Drafters that learn from the model's own ranking (``Drafter.topk > 0``, e.g.
the adjacency drafter) get, for every committed slot of a step, the indices of
its k largest logits.  A full argsort of a 50k-entry row would cost far more
than the verification step saves, so each row is scanned once while a small
sorted buffer holds the best k seen so far.
"""
from __future__ import annotations

import numpy as np
from numba import njit

MAX_K = 32
"""Largest k supported (the insertion buffer is sized for it)."""

_BLOCK = 64
"""Entries per block of the pre-check in ``topk_rows`` (measured: 64 lets the
compiler vectorise the check; 16 and 32 were 3-4x slower on the dev machine)."""


@njit(cache=True, inline="always")
def push_sorted(keys, items, k, cap, key, item):
    """Insert (key, item) into the buffer keys[:k] / items[:k], kept sorted by
    key descending with at most cap entries; return the new count.  Ties keep
    the earlier entry first, and when the buffer is full an entry that does
    not beat the worst kept key is dropped.  The bounded "best n so far"
    step of the drafters' kernels (suffix matches, soft anchors, MCTS nodes).
    Inlined into the callers at numba's IR level: as a separate call, soft
    anchors took 9.6 us instead of 5.7 on a 4,000-token context."""
    if k == cap and key <= keys[k - 1]:
        return k
    j = k if k < cap else cap - 1
    while j > 0 and keys[j - 1] < key:
        keys[j] = keys[j - 1]
        items[j] = items[j - 1]
        j -= 1
    keys[j] = key
    items[j] = item
    return k + 1 if k < cap else k


@njit(cache=True, inline="always")
def push_ranked(probs, toks, k, cap, p, t):
    """push_sorted for (probability, token) pairs: probs[:k] descending,
    ties by token ascending (so the order does not depend on the order the
    candidates came in); return the new count.  The tri-gram kernels' top
    successors of a context."""
    if k == cap and (p < probs[k - 1] or (p == probs[k - 1] and t > toks[k - 1])):
        return k
    j = k if k < cap else cap - 1
    while j > 0 and (probs[j - 1] < p or (probs[j - 1] == p and toks[j - 1] > t)):
        probs[j] = probs[j - 1]
        toks[j] = toks[j - 1]
        j -= 1
    probs[j] = p
    toks[j] = t
    return k + 1 if k < cap else k


@njit(cache=True)
def _scan(row, lo, hi, vals, idx, k):
    """Insert every entry of ``row[lo:hi]`` that beats the buffer's smallest
    value ``vals[k-1]`` into the sorted buffer (values descending)."""
    worst = vals[k - 1]
    for j in range(lo, hi):
        x = row[j]
        if x > worst:                   # the buffer is full: push_sorted with cap = k
            push_sorted(vals, idx, k, k, x, j)
            worst = vals[k - 1]


@njit(cache=True)
def topk_rows(logits, rows, n_rows, k, out_tok):
    """Write the indices of the k largest logits of selected rows (see
    ``_topk_rows``)."""
    return _topk_rows(logits, rows, n_rows, k, out_tok, np.zeros((0, 0), np.float32), False)


@njit(cache=True)
def topk_rows_vals(logits, rows, n_rows, k, out_tok, out_val):
    """``topk_rows`` that also writes the k largest logits of each row, largest
    first, to ``out_val`` (float32 [>= n_rows, >= k]): the values come from the
    scan's buffer, so a drafter that wants them costs no second read of the
    rows (right after a decode, a gather from the logits buffer cost ~20 us
    on the 2-core machine, cold caches)."""
    if out_val.shape[0] < min(n_rows, rows.shape[0], out_tok.shape[0]) or out_val.shape[1] < min(k, out_tok.shape[1]):
        raise ValueError("topk_rows_vals: out_val is smaller than out_tok's used part")
    return _topk_rows(logits, rows, n_rows, k, out_tok, out_val, True)


@njit(cache=True)
def _topk_rows(logits, rows, n_rows, k, out_tok, out_val, want_val):
    """The indices (and with want_val the values) of the k largest logits of
    selected rows.

    Parameters
    ----------
    logits : float32 [n_batch, n_vocab], C-contiguous   llama.cpp's logits buffer
                            (a read-only view works too).
    rows : int32 or int64 [>= n_rows]   batch slot (row of ``logits``) of each
                            wanted ranking; a row out of range gives -1s.
    n_rows : int            how many entries of ``rows`` to read (clamped to
                            ``len(rows)`` and ``out_tok.shape[0]``).
    k : int                 ranking width, clamped to ``out_tok.shape[1]``,
                            ``n_vocab`` and ``MAX_K`` (32).
    out_tok : int32 [>= n_rows, >= k]   row i receives the indices of the k
                            largest logits of row ``rows[i]``, largest first;
                            equal logits rank the lower index first (the order
                            of a stable ``np.argsort(-row)``).  Columns past k
                            are left untouched.

    Returns the number of rows written.  ``topk_rows_vals`` also writes the
    logits themselves.

    Method: a buffer of the best k (value, index) pairs seen so far, sorted by
    value descending, starts as the first k entries.  The rest of the row is
    read in blocks of 64: a block is first checked with a branch-free count of
    its entries above the buffer's smallest value (vectorised by the
    compiler); almost every block has none once the buffer holds good values
    and is skipped.  The other blocks are scanned entry by entry, inserting
    each entry that beats the smallest value.  Entries are visited by
    increasing index and must be strictly larger to enter or to pass another,
    so ties keep the lower index in front.  NaN logits never enter (unless they
    are among the first k, which a working model does not produce).

    Cost (warm, 2-core dev sandbox, numba 0.68, n_vocab 49152, k 8, Gaussian
    logits): about 5 us per row (a plain entry-by-entry scan: 15 us).  The
    worst case, a row sorted ascending (every entry enters the buffer), takes
    about 250 us; real logits are not ordered by token id.
    """
    n_batch = logits.shape[0]
    n_vocab = logits.shape[1]
    n_rows = min(n_rows, rows.shape[0], out_tok.shape[0])
    k = min(k, out_tok.shape[1], n_vocab, MAX_K)
    if n_rows <= 0 or k <= 0:
        return 0
    vals = np.empty(MAX_K, np.float32)
    idx = np.empty(MAX_K, np.int32)
    # Entries 0..k-1 fill the buffer, k.._BLOCK-1 go one by one, then whole
    # blocks 1..nb-1, then the tail one by one.
    first = min(_BLOCK, n_vocab)
    nb = n_vocab // _BLOCK
    tail = max(nb, 1) * _BLOCK
    for i in range(n_rows):
        r = rows[i]
        if r < 0 or r >= n_batch:
            for j in range(k):
                out_tok[i, j] = -1
            continue
        row = logits[r]
        for j in range(k):
            x = row[j]
            q = j
            while q > 0 and vals[q - 1] < x:
                vals[q] = vals[q - 1]
                idx[q] = idx[q - 1]
                q -= 1
            vals[q] = x
            idx[q] = j
        _scan(row, k, first, vals, idx, k)
        # The literal 1 as the start matters: with a computed start (even
        # min(1, nb)) LLVM no longer vectorises the count, which is 5x slower.
        for b in range(1, nb):
            s = b * _BLOCK
            worst = vals[k - 1]
            c = 0
            for t in range(s, s + _BLOCK):
                c += row[t] > worst
            if c > 0:
                _scan(row, s, s + _BLOCK, vals, idx, k)
        _scan(row, tail, n_vocab, vals, idx, k)
        for j in range(k):
            out_tok[i, j] = idx[j]
        if want_val:
            for j in range(k):
                out_val[i, j] = vals[j]
    return n_rows


@njit(cache=True)
def push_entropy(x, n_rows, ring, start):
    """Entropy window: the entropy (nats) of the softmax of each of the first
    n_rows rows of ``x`` goes into the ring buffer ``ring`` (float64) at
    ``(start + i) % len(ring)``, the ``start + i``-th entry ever pushed.
    Returns the mean over the entries the ring holds after the push (the last
    ``min(start + n_rows, len(ring))``); 0 when it holds none."""
    w = ring.shape[0]
    for i in range(n_rows):
        m = x[i, 0]
        for j in range(1, x.shape[1]):
            if x[i, j] > m:
                m = x[i, j]
        s = 0.0
        t = 0.0
        for j in range(x.shape[1]):
            z = x[i, j] - m
            e = np.exp(z)
            s += e
            t += e * z
        ring[(start + i) % w] = np.log(s) - t / s
    n = min(start + n_rows, w)
    if n <= 0:
        return 0.0
    tot = 0.0
    for j in range(n):
        tot += ring[j]
    return tot / n


@njit(cache=True)
def row_entropy(logits, n_rows, out):
    """out[i] = entropy (nats) of softmax(logits[i]) over the whole row, for the
    first n_rows rows (ReSpec's trigger reads it at every committed slot; one
    pass of exp over the vocabulary, ~0.1 ms a row for a 49k vocabulary on
    the 2-core machine).  H = log Z - sum(e * z) / Z with z = x - max x and
    e = exp(z), Z = sum(e)."""
    for i in range(n_rows):
        row = logits[i]
        m = row[0]
        for j in range(1, row.shape[0]):
            if row[j] > m:
                m = row[j]
        s = 0.0
        t = 0.0
        for j in range(row.shape[0]):
            z = np.float64(row[j]) - m
            e = np.exp(z)
            s += e
            t += e * z
        out[i] = np.log(s) - t / s


def warmup() -> None:
    """Compile (or load from the cache) ``topk_rows``, ``topk_rows_vals``,
    ``row_entropy`` and ``push_entropy`` for the argument types the
    engine passes: float32 C-contiguous logits, writable and read-only, with
    int32 and int64 row indices, Python ints and an int32 output."""
    logits = np.arange(64, dtype=np.float32).reshape(2, 32)
    out = np.zeros((2, 4), np.int32)
    ro = logits.copy()
    ro.setflags(write=False)
    val = np.zeros((2, 4), np.float32)
    for lg in (logits, ro):
        for dt in (np.int32, np.int64):
            topk_rows(lg, np.array([1, 0], dt), 2, 4, out)
            topk_rows_vals(lg, np.array([1, 0], dt), 2, 4, out, val)
        row_entropy(lg, 2, np.zeros(2, np.float32))
    push_entropy(val, 2, np.zeros(4, np.float64), 0)
