"""Adjacency-table kernels (Token Recycling): a table of likely successors of
every vocabulary token, filled from corpus bi-grams and prompt bi-grams and
overwritten by the model's own top-k rankings, expanded through a fixed tree
template into a draft tree.

The table is two arrays owned by the drafter:

    adj[V, K]  int32    adj[t, j] = the rank-j successor of token t, -1 = none
    origin[V]  int8     where row t came from (ORIGIN_* below)

All functions are ``numba.njit(cache=True)`` and pure apart from writing the
arrays they are given: the table is updated in place, outputs go to arrays the
caller preallocated, and each returns how many entries it wrote.
"""
from __future__ import annotations

import numpy as np
from numba import njit

ORIGIN_EMPTY = 0    # nothing known: the row is all -1
ORIGIN_CORPUS = 1   # seeded from compiled corpora (bi-gram counts)
ORIGIN_PROMPT = 2   # seeded from the bi-grams of a prompt
ORIGIN_MODEL = 3    # the model's own top-k after this token (Token Recycling)
N_ORIGINS = 4


@njit(cache=True)
def merge_seed_rows(nexts, counts, out_adj, out_origin):
    """Merge successor rows of several corpora into the table.

    Parameters
    ----------
    nexts : int32 [V, W]     successor tokens: the corpora's ``adj_next`` rows
                             side by side (W = sum of their widths), -1 = none.
    counts : int64 [V, W]    their counts (``adj_count``); entries with a count
                             <= 0 or a token outside ``[0, V_out)`` are ignored.
    out_adj : int32 [V_out, K]   receives, for each token v < min(V, V_out), the
                             K successors with the largest summed count (equal
                             tokens of different corpora add up), count
                             descending, ties by token ascending, -1 padded.
    out_origin : int8 [V_out]    ORIGIN_CORPUS where the row got a successor,
                             ORIGIN_EMPTY where it did not.

    Rows of ``out_adj`` at and beyond V are left untouched.  Returns the number
    of non-empty rows.  Cost: O(W^2 + K W) per row; once per drafter.
    """
    n_rows = min(nexts.shape[0], counts.shape[0], out_adj.shape[0], out_origin.shape[0])
    w = min(nexts.shape[1], counts.shape[1])
    k = out_adj.shape[1]
    v_out = out_adj.shape[0]
    tok = np.empty(max(w, 1), np.int64)
    cnt = np.empty(max(w, 1), np.int64)
    filled = 0
    for v in range(n_rows):
        m = 0
        for c in range(w):
            t = np.int64(nexts[v, c])
            n = np.int64(counts[v, c])
            if t < 0 or t >= v_out or n <= 0:
                continue
            j = 0
            while j < m and tok[j] != t:
                j += 1
            if j == m:
                tok[m] = t
                cnt[m] = 0
                m += 1
            cnt[j] += n
        # Selection: k passes, each taking the best remaining candidate.
        for r in range(k):
            best = -1
            for j in range(m):
                if cnt[j] < 0:
                    continue   # already taken
                if best < 0 or cnt[j] > cnt[best] or (cnt[j] == cnt[best] and tok[j] < tok[best]):
                    best = j
            if best < 0:
                out_adj[v, r] = -1
            else:
                out_adj[v, r] = tok[best]
                cnt[best] = -1
        out_origin[v] = ORIGIN_CORPUS if m > 0 else ORIGIN_EMPTY
        if m > 0:
            filled += 1
    return filled


@njit(cache=True)
def seed_bigrams(adj, origin, tokens, n):
    """Seed table rows from the bi-grams of ``tokens[:n]`` (a prompt).

    Only rows whose origin is ORIGIN_EMPTY or ORIGIN_PROMPT are written: what
    the model or a corpus said about a token is kept.  Pairs are read left to
    right and each successor ``b`` of ``a`` moves to the front of row ``a``
    (removing an equal entry further down, dropping the last one when the row
    is full), so a row ends up holding a's most recent distinct successors,
    most recent first.  Tokens outside ``[0, V)`` are skipped.

    Returns the number of pairs written.  Cost: O(K) per pair (about 12 us for
    a 4000-token prompt).
    """
    n = min(n, tokens.shape[0])
    v_max = min(adj.shape[0], origin.shape[0])
    k = adj.shape[1]
    written = 0
    if k <= 0:
        return 0
    for i in range(n - 1):
        a = np.int64(tokens[i])
        b = tokens[i + 1]
        if a < 0 or a >= v_max or b < 0 or b >= adj.shape[0]:
            continue
        o = origin[a]
        if o != ORIGIN_EMPTY and o != ORIGIN_PROMPT:
            continue
        # Position of b in the row; if absent, the first empty slot, or the
        # last slot (its entry is evicted) when the row is full.
        j = 0
        while j < k - 1 and adj[a, j] != b and adj[a, j] >= 0:
            j += 1
        while j > 0:
            adj[a, j] = adj[a, j - 1]
            j -= 1
        adj[a, 0] = b
        origin[a] = ORIGIN_PROMPT
        written += 1
    return written


@njit(cache=True)
def update_rows(adj, origin, inputs, topk, n):
    """Token Recycling's update: the model's ranking replaces the row.

    For i < n (clamped to ``len(inputs)`` and ``topk.shape[0]``): row
    ``inputs[i]`` of ``adj`` becomes ``topk[i, :K]`` (K = adj's width; missing
    columns and tokens outside ``[0, V)`` become -1) and its origin
    ORIGIN_MODEL.  A later row for the same input token wins.  Inputs outside
    ``[0, V)`` are skipped.  Returns the number of rows written.
    """
    n = min(n, inputs.shape[0], topk.shape[0])
    v_max = min(adj.shape[0], origin.shape[0])
    k = adj.shape[1]
    kin = min(k, topk.shape[1])
    written = 0
    for i in range(n):
        a = np.int64(inputs[i])
        if a < 0 or a >= v_max:
            continue
        for j in range(kin):
            t = topk[i, j]
            adj[a, j] = t if 0 <= t < adj.shape[0] else -1
        for j in range(kin, k):
            adj[a, j] = -1
        origin[a] = ORIGIN_MODEL
        written += 1
    return written


@njit(cache=True)
def expand_template(adj, origin, origin_scale, root, tpl_parent, tpl_rank, rank_prob,
                    max_nodes, out_tokens, out_parents, out_probs):
    """Expand the tree template from ``root`` through the table.

    Parameters
    ----------
    adj : int32 [V, K], origin : int8 [V]   the table.
    origin_scale : float32 [N_ORIGINS]   score factor by the origin of the row
                             a node was read from (0 for ORIGIN_EMPTY).
    root : int               the last context token; out of ``[0, V)`` -> 0 nodes.
    tpl_parent : int32 [T]   template node i's parent template node, -1 = the
                             root; always ``tpl_parent[i] < i``.
    tpl_rank : int32 [T]     which successor (column of the parent's row) node i is.
    rank_prob : float32 [>= K]   score by rank (P(accepted | parent accepted)).
    max_nodes : int          emit at most this many nodes (clamped to the
                             output capacity and T).
    out_tokens, out_parents : int32 [>= max_nodes];  out_probs : float32 [>= max_nodes]

    Template node i with parent node P (token t, or ``root`` for -1) and rank
    r carries ``adj[t, r]`` with score ``rank_prob[r] * origin_scale[origin[t]]``.
    It is skipped, with all its template descendants, when its parent was
    skipped, the entry is -1 (or out of range), the score is 0 (a scale of 0
    switches an origin off), or an earlier sibling already carries that token
    (a row with repeated entries).

    Output order: by decreasing path score (product of scores from the root),
    ties in template order.  A child's path score is its parent's times a
    factor <= 1 and a child comes after its parent in the template, so parents
    precede children and truncating to ``max_nodes`` keeps the best nodes as a
    valid tree (the same proposal for every budget, cut).

    Returns the number of nodes written.  Cost: O(T) plus sibling checks and
    an insertion sort, both O(T^2) in the worst case; T is a few dozen.
    """
    t_n = min(tpl_parent.shape[0], tpl_rank.shape[0])
    max_nodes = min(max_nodes, t_n, out_tokens.shape[0], out_parents.shape[0],
                    out_probs.shape[0])
    v_max = min(adj.shape[0], origin.shape[0])
    k = min(adj.shape[1], rank_prob.shape[0])
    if max_nodes <= 0 or root < 0 or root >= v_max:
        return 0
    node_at = np.empty(t_n, np.int64)   # expanded index of each template node, -1 skipped
    e_tok = np.empty(t_n, np.int64)
    e_par = np.empty(t_n, np.int64)
    e_p = np.empty(t_n, np.float32)
    e_cum = np.empty(t_n, np.float64)
    m = 0
    for i in range(t_n):
        node_at[i] = -1
        tp = tpl_parent[i]
        if tp >= i:
            continue   # malformed template entry
        if tp >= 0:
            pe = node_at[tp]
            if pe < 0:
                continue
            pt = e_tok[pe]
            pc = e_cum[pe]
        else:
            pe = np.int64(-1)
            pt = np.int64(root)
            pc = 1.0
        r = tpl_rank[i]
        if r < 0 or r >= k:
            continue
        t = np.int64(adj[pt, r])
        if t < 0 or t >= v_max:
            continue
        o = origin[pt]
        if o < 0 or o >= origin_scale.shape[0]:
            continue
        p = rank_prob[r] * origin_scale[o]
        if not p > 0:
            continue
        # Siblings are expanded after their parent: scan from there.
        dup = False
        for j in range(pe + 1, m):
            if e_par[j] == pe and e_tok[j] == t:
                dup = True
                break
        if dup:
            continue
        e_tok[m] = t
        e_par[m] = pe
        e_p[m] = p
        e_cum[m] = pc * p
        node_at[i] = m
        m += 1
    if m == 0:
        return 0

    # Stable insertion sort of the expanded nodes by path score, descending.
    order = np.empty(m, np.int64)
    for i in range(m):
        j = i
        while j > 0 and e_cum[order[j - 1]] < e_cum[i]:
            order[j] = order[j - 1]
            j -= 1
        order[j] = i
    new_index = np.empty(m, np.int64)
    n_out = min(m, max_nodes)
    for r in range(n_out):
        i = order[r]
        new_index[i] = r
        out_tokens[r] = e_tok[i]
        pe = e_par[i]
        out_parents[r] = -1 if pe < 0 else new_index[pe]
        out_probs[r] = e_p[i]
    return n_out


def warmup() -> None:
    """Compile (or load from the cache) every kernel for the dtypes the drafter
    passes: int32 tables and tokens, int8 origins, int64 counts, float32 scores
    and Python ints."""
    v, k = 6, 3
    adj = np.full((v, k), -1, np.int32)
    origin = np.zeros(v, np.int8)
    nexts = np.array([[1, 2], [2, -1], [-1, -1], [0, 1], [-1, -1], [5, -1]], np.int32)
    counts = np.array([[3, 1], [2, 0], [0, 0], [1, 1], [0, 0], [4, 0]], np.int64)
    merge_seed_rows(nexts, counts, adj, origin)
    seed_bigrams(adj, origin, np.array([4, 1, 4, 2], np.int32), 4)
    update_rows(adj, origin, np.array([0], np.int32), np.array([[1, 2, 3]], np.int32), 1)
    tpl_parent = np.array([-1, -1, 0], np.int32)
    tpl_rank = np.array([0, 1, 0], np.int32)
    rank_prob = np.array([0.4, 0.2, 0.1], np.float32)
    scale = np.array([0.0, 0.5, 0.7, 1.0], np.float32)
    out_t = np.zeros(3, np.int32)
    out_p = np.zeros(3, np.int32)
    out_q = np.zeros(3, np.float32)
    expand_template(adj, origin, scale, 0, tpl_parent, tpl_rank, rank_prob, 3,
                    out_t, out_p, out_q)
