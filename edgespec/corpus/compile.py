"""Compiling token arrays into a corpus: n-gram counting, successor tables, the suffix array.

Everything between a token array (documents, each followed by one -1) and the
arrays of a `Corpus` (edgespec.corpus.format), with no model involved:
`compile_tokens` compiles token ids given in memory, and `compile_arrays` is
what `edgespec.corpus.build` runs over a build's tokens, in bounded memory:
n-grams are counted block by block and the counts merged, and the suffix array
is built by prefix doubling.
"""
from __future__ import annotations

import math
import time

import numpy as np

from edgespec.corpus.format import FORMAT, FORMAT_VERSION, Corpus
from edgespec.kernels.corpus import assign_ranks, merge_counts, pair_keys, run_lengths, top_successors
from edgespec.progress import progress_bar as _bar

COUNT_BLOCK = 1 << 20        # tokens per n-gram counting block


def suffix_array(tokens: np.ndarray, depth: int = 32, bar=None) -> np.ndarray:
    """Every position p with tokens[p] != -1, sorted by tokens[p : p + depth] cut
    at the first -1 (a key that is a prefix of another sorts first), ties by p.

    Prefix doubling: rank[p] orders the keys of length k; the keys of length 2k
    are the pairs (rank[p], rank[p + k]) (the second 0 when the key stops at a
    separator first), sorted with a stable numpy argsort so equal keys stay in
    position order.  log2(depth) rounds, fewer once every key is distinct.
    `depth` must be a power of two.  Memory: about 40 bytes per token.
    """
    if depth < 1 or depth & (depth - 1):
        raise ValueError(f"sa_depth must be a power of two, got {depth}")
    tokens = np.asarray(tokens)
    N = len(tokens)
    if N >= 1 << 31:
        raise ValueError("corpora of 2**31 tokens or more are not supported")
    pos = np.flatnonzero(tokens >= 0).astype(np.int32)
    M = len(pos)
    rank = np.zeros(N, np.int32)
    rank[pos] = tokens[pos] + 1
    if M == 0:
        return pos
    d = run_lengths(tokens)
    order = None
    k = 1
    while k < depth:
        keys = pair_keys(pos, rank, d, k)
        order = np.argsort(keys, kind="stable")
        distinct = assign_ranks(keys, order, pos, rank)
        del keys
        k *= 2
        if bar is not None:
            bar.update(1)
        if distinct == M:   # every key distinct: longer keys cannot change the order
            if bar is not None:
                bar.update(int(math.log2(depth // k)))
            break
    if order is None:   # depth 1: sort by the token alone
        order = np.argsort(rank[pos], kind="stable")
    return pos[order]


def _count_runs(tokens: np.ndarray, V: int, bar):
    """Bi-gram and tri-gram counts over tokens (never across a -1), counted block
    by block with np.unique and merged in a stack of runs whose sizes at least
    double downwards (each count is merged O(log blocks) times).
    Returns (bi_keys, bi_counts, tri_keys, tri_counts), keys sorted ascending."""
    stacks = {2: [], 3: []}

    def push(n, keys):
        if not len(keys):
            return
        st = stacks[n]
        st.append(np.unique(keys, return_counts=True))
        while len(st) >= 2 and len(st[-2][0]) <= 2 * len(st[-1][0]):
            b, a = st.pop(), st.pop()
            st.append(merge_counts(a[0], a[1].astype(np.int64, copy=False), b[0], b[1].astype(np.int64, copy=False)))

    N = len(tokens)
    V = np.int64(V)
    for s in range(0, N, COUNT_BLOCK):
        n = min(COUNT_BLOCK, N - s)
        t = np.asarray(tokens[s:min(N, s + n + 2)], dtype=np.int64)
        m = len(t)
        nb = min(n, m - 1)
        if nb > 0:
            a, b = t[:nb], t[1:nb + 1]
            ok = (a >= 0) & (b >= 0)
            push(2, (a * V + b)[ok])
        nt = min(n, m - 2)
        if nt > 0:
            a, b, c = t[:nt], t[1:nt + 1], t[2:nt + 2]
            ok = (a >= 0) & (b >= 0) & (c >= 0)
            push(3, ((a * V + b) * V + c)[ok])
        bar.update(n)
    out = []
    for n in (2, 3):
        st = stacks[n]
        if not st:
            out += [np.zeros(0, np.int64), np.zeros(0, np.int64)]
            continue
        while len(st) > 1:
            b, a = st.pop(), st.pop()
            st.append(merge_counts(a[0], a[1].astype(np.int64), b[0], b[1].astype(np.int64)))
        out += [st[0][0], st[0][1].astype(np.int64)]
    return tuple(out)


def _u32(x: np.ndarray) -> np.ndarray:
    """Counts as uint32, saturating."""
    return np.minimum(x, np.iinfo(np.uint32).max).astype(np.uint32)


def compile_arrays(tokens: np.ndarray, n_vocab: int, max_successors: int, k_adj: int, sa_depth: int,
                    progress=False) -> dict:
    """Every array but `tokens` from a token array with its separators."""
    V = int(n_vocab)
    with _bar(progress, total=len(tokens), desc="counting", unit="tok", unit_scale=True) as bar:
        bi_k, bi_c, tri_k, tri_c = _count_runs(tokens, V, bar)

    # tri-grams: contexts w1 * V + w2, successors w3
    ctx, tot, ptr, nxt, cnt = top_successors(tri_k, tri_c, np.int64(V), int(max_successors))
    del tri_k, tri_c
    w1 = ctx // V
    out = {
        "tri_w1_offsets": np.searchsorted(w1, np.arange(V + 1), side="left").astype(np.int32),
        "tri_w2": (ctx % V).astype(np.int32),
        "tri_ctx_count": _u32(tot),
        "tri_offsets": ptr.astype(np.int32),
        "tri_next": nxt,
        "tri_count": _u32(cnt),
    }
    del ctx, tot, ptr, nxt, cnt, w1

    # bi-grams: each token's k_adj most frequent successors
    ctx, _, ptr, nxt, cnt = top_successors(bi_k, bi_c, np.int64(V), int(k_adj))
    adj_next = np.full((V, k_adj), -1, np.int32)
    adj_count = np.zeros((V, k_adj), np.uint32)
    sizes = np.diff(ptr)
    rows = np.repeat(ctx, sizes)
    cols = np.arange(len(nxt)) - np.repeat(ptr[:-1], sizes)
    adj_next[rows, cols] = nxt
    adj_count[rows, cols] = _u32(cnt)
    out["adj_next"], out["adj_count"] = adj_next, adj_count

    rounds = int(math.log2(sa_depth))
    with _bar(progress, total=rounds, desc="suffix array", unit="round") as bar:
        out["sa"] = suffix_array(tokens, sa_depth, bar)
    return out


def check_params(n_vocab, max_successors, k_adj, sa_depth):
    if not isinstance(n_vocab, (int, np.integer)) or not 1 <= n_vocab < 1 << 21:
        raise ValueError(f"n_vocab must be in 1..2**21, got {n_vocab!r}")
    if max_successors < 1 or k_adj < 1:
        raise ValueError("max_successors and k_adj must be at least 1")
    if sa_depth < 1 or sa_depth & (sa_depth - 1):
        raise ValueError(f"sa_depth must be a power of two, got {sa_depth}")


def base_header(n_vocab, n_tokens, n_docs, max_successors, k_adj, sa_depth) -> dict:
    from edgespec.version import __version__
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "edgespec_version": __version__,
        "n_vocab": int(n_vocab),
        "n_tokens": int(n_tokens),
        "n_docs": int(n_docs),
        "params": {"max_successors": int(max_successors), "k_adj": int(k_adj), "sa_depth": int(sa_depth)},
        "tokenizer": None,
        "sources": [],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def compile_tokens(docs, n_vocab: int, max_successors: int = 8, k_adj: int = 8, sa_depth: int = 32,
                   progress=None) -> Corpus:
    """Compile documents (sequences of token ids in 0..n_vocab-1) into an in-memory
    Corpus.  No model is involved; header["tokenizer"] is None (set it before
    saving to pin the corpus to a tokenizer)."""
    check_params(n_vocab, max_successors, k_adj, sa_depth)
    t0 = time.perf_counter()
    docs = [np.asarray(d).reshape(-1) for d in docs]
    for d in docs:
        if len(d) and (d.min() < 0 or d.max() >= n_vocab):
            raise ValueError(f"token ids must be in 0..{n_vocab - 1}")
    n_tok = sum(len(d) for d in docs)
    tokens = np.full(n_tok + len(docs), -1, np.int32)
    i = 0
    for d in docs:
        tokens[i:i + len(d)] = d
        i += len(d) + 1
    arrays = compile_arrays(tokens, n_vocab, max_successors, k_adj, sa_depth, progress)
    arrays["tokens"] = tokens
    header = base_header(n_vocab, n_tok, len(docs), max_successors, k_adj, sa_depth)
    header["build_seconds"] = round(time.perf_counter() - t0, 3)
    return Corpus(arrays, header)
