"""Tri-gram kernels: edgespec's variant of the ADED method (a tri-gram model
that adapts online, and a Monte Carlo tree search that turns it into a draft
tree).  ADED as published (Eq. 1 with the count threshold, Adjust3Gram,
Algorithm 1 with its rollout) is ``edgespec.kernels.aded``.

Three parts, all ``numba.njit(cache=True)`` pure functions over numpy arrays
preallocated by the caller:

1. The *overlay*: tri-gram and bi-gram counts of the most recent ``W`` tokens
   the drafter was shown (prompt and accepted tokens), kept in fixed-capacity
   arrays so that updates and look-ups allocate nothing.
2. ``successors``: the next-token distribution after a context ``(w1, w2)``,
   mixing corpus counts and overlay counts.
3. ``mcts_draft``: the PUCT tree search over that distribution, which returns
   the draft tree.

Array bundles (tuples, so that the signatures stay short; numba unpacks them):

corpus = (tri_w1_offsets, tri_w2, tri_ctx_count, tri_offsets, tri_next,
          tri_count, adj_next, adj_count, bi_total)
    The tri-gram CSR tables and bi-gram rows of a compiled corpus (see the
    corpus spec; several corpora are merged into one such bundle by the
    drafter), plus ``bi_total`` float64 [V]: how often each token was followed
    by any token (the denominator of the bi-gram rows).  With no corpus every
    table is empty (``tri_w1_offsets`` all zeros, ``adj_*`` of shape [V, 0]).

ov = (h_key, h_total, h_succ, h_cnt)       the overlay hash table, H entries
    h_key   int64 [H]     context key, -1 = empty.  Tri-gram context (w1, w2)
                          has key ``w1 * V + w2``; bi-gram context w2 has key
                          ``V * V + w2`` (disjoint ranges, one table).
    h_total int32 [H]     occurrences of the context in the window (each
                          followed by some token)
    h_succ  int32 [H, S]  successor slots: token, -1 = free
    h_cnt   int32 [H, S]  occurrences of (context, successor) in the window
    Open addressing with linear probing and backward-shift deletion (no
    tombstones).  H is a power of two of at least 4 W: the window holds at
    most 2 W distinct keys, so the load stays at most 1/2 and probes are short.

ring = (r_key3, r_key2, r_tok, r_flag)     one entry per window position
    The tri-gram key, bi-gram key (-1 = none) and token of each of the last W
    positions, and bit flags: bit 0 set if the tri-gram was counted in a
    successor slot, bit 1 the same for the bi-gram.

state int64 [3] = (tokens fed so far, second-to-last token, last token); the
    last two are -1 when unknown (at the start of a stream).

Overlay semantics (what the tests' pure-Python reference implements): every
fed token t at stream position i, preceded by a and b, adds one occurrence of
bi-gram context b with successor t and of tri-gram context (a, b) with
successor t.  The occurrence counts toward the context's total; it also counts
in a successor slot if t already has one or a slot is free (no eviction: a
successor that finds all S slots taken counts only in the total).  When
position i leaves the window (after W more tokens), exactly the counts it
added are taken back, and a slot whose count drops to 0 is freed.  So slot
counts are exact window counts of the occurrences that found a slot (which
successors hold slots depends on the order of arrival); with at most S
distinct successors per context they are plain window counts.  The
*effective* overlay count of a successor is ``min(cap, increment * count)``.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from edgespec.kernels.topk import push_ranked, push_sorted

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


# --------------------------------------------------------------------------
# overlay hash table


@njit(cache=True)
def _home(key, mask):
    """Home slot of a key: Fibonacci hashing (multiply by 2^64 / golden ratio,
    take bits from the upper half of the product)."""
    h = np.uint64(key) * _GOLDEN
    return np.int64(h >> np.uint64(32)) & mask


@njit(cache=True)
def overlay_find(h_key, key):
    """Index of ``key`` in the hash table, or -1."""
    mask = h_key.shape[0] - 1
    i = _home(key, mask)
    for _ in range(h_key.shape[0]):
        k = h_key[i]
        if k == key:
            return i
        if k < 0:
            return -1
        i = (i + 1) & mask
    return -1


@njit(cache=True)
def overlay_add(ov, key, tok):
    """Add one occurrence of (context ``key``, successor ``tok``).

    Returns 1 if it was counted in a successor slot, 0 if it counts only in
    the context total (all slots held by other successors), -1 if the table
    is full (cannot happen at the capacity the drafter allocates)."""
    h_key, h_total, h_succ, h_cnt = ov
    mask = h_key.shape[0] - 1
    n_slots = h_succ.shape[1]
    i = _home(key, mask)
    probes = 0
    while h_key[i] != key and h_key[i] >= 0:
        probes += 1
        if probes == h_key.shape[0]:
            return -1
        i = (i + 1) & mask
    if h_key[i] < 0:
        h_key[i] = key
        h_total[i] = 0
        for s in range(n_slots):
            h_succ[i, s] = -1
            h_cnt[i, s] = 0
    h_total[i] += 1
    free = -1
    for s in range(n_slots):
        if h_succ[i, s] == tok:
            h_cnt[i, s] += 1
            return 1
        if free < 0 and h_succ[i, s] < 0:
            free = s
    if free >= 0:
        h_succ[i, free] = tok
        h_cnt[i, free] = 1
        return 1
    return 0


@njit(cache=True)
def _delete(ov, i):
    """Empty entry ``i`` by backward shift: later entries of the same probe
    run move up into the hole when the hole lies between their home slot and
    their current slot, so every remaining key stays reachable."""
    h_key, h_total, h_succ, h_cnt = ov
    mask = h_key.shape[0] - 1
    hole = i
    j = i
    while True:
        j = (j + 1) & mask
        k = h_key[j]
        if k < 0:
            break
        if ((j - _home(k, mask)) & mask) >= ((j - hole) & mask):
            h_key[hole] = k
            h_total[hole] = h_total[j]
            for s in range(h_succ.shape[1]):
                h_succ[hole, s] = h_succ[j, s]
                h_cnt[hole, s] = h_cnt[j, s]
            hole = j
    h_key[hole] = -1


@njit(cache=True)
def overlay_remove(ov, key, tok, slotted):
    """Take back one occurrence added by ``overlay_add`` (which returned
    ``slotted``); the entry is deleted when its total reaches 0."""
    h_key, h_total, h_succ, h_cnt = ov
    i = overlay_find(h_key, key)
    if i < 0:
        return
    h_total[i] -= 1
    if slotted:
        for s in range(h_succ.shape[1]):
            if h_succ[i, s] == tok:
                h_cnt[i, s] -= 1
                if h_cnt[i, s] <= 0:
                    h_cnt[i, s] = 0
                    h_succ[i, s] = -1
                break
    if h_total[i] <= 0:
        _delete(ov, i)


@njit(cache=True)
def overlay_feed(ov, ring, state, tokens, n, n_vocab):
    """Append ``tokens[:n]`` to the overlay's stream (see the module doc).

    Tokens outside ``[0, n_vocab)`` take a window position but add nothing and
    break the n-grams around them.  Returns the number of tokens fed."""
    r_key3, r_key2, r_tok, r_flag = ring
    window = r_tok.shape[0]
    n = min(n, tokens.shape[0])
    bigram_base = np.int64(n_vocab) * np.int64(n_vocab)
    for idx in range(n):
        t = np.int64(tokens[idx])
        pos = state[0] % window
        if state[0] >= window:  # position state[0] - window leaves the window
            f = r_flag[pos]
            if r_key3[pos] >= 0:
                overlay_remove(ov, r_key3[pos], r_tok[pos], f & 1)
            if r_key2[pos] >= 0:
                overlay_remove(ov, r_key2[pos], r_tok[pos], (f >> 1) & 1)
        a = state[1]
        b = state[2]
        k3 = np.int64(-1)
        k2 = np.int64(-1)
        f = 0
        if 0 <= t < n_vocab:
            if 0 <= b < n_vocab:
                k2 = bigram_base + b
                if overlay_add(ov, k2, t) == 1:
                    f |= 2
                if 0 <= a < n_vocab:
                    k3 = a * n_vocab + b
                    if overlay_add(ov, k3, t) == 1:
                        f |= 1
        else:
            t = -1
        r_key3[pos] = k3
        r_key2[pos] = k2
        r_tok[pos] = t
        r_flag[pos] = f
        state[0] += 1
        state[1] = b
        state[2] = t
    return n


# --------------------------------------------------------------------------
# the mixed next-token distribution


@njit(cache=True)
def corpus_row(tri_w1_offsets, tri_w2, w1, w2):
    """Row of context (w1, w2) in the corpus CSR tables, or -1 (binary search
    over the w2 of w1's block)."""
    if w1 < 0 or w1 + 1 >= tri_w1_offsets.shape[0]:
        return -1
    lo = np.int64(tri_w1_offsets[w1])
    hi = np.int64(tri_w1_offsets[w1 + 1])
    while lo < hi:
        mid = (lo + hi) // 2
        if tri_w2[mid] < w2:
            lo = mid + 1
        else:
            hi = mid
    if lo < tri_w1_offsets[w1 + 1] and tri_w2[lo] == w2:
        return lo
    return -1


@njit(cache=True, inline="always")
def corpus_successors(corpus, w1, w2, cand_tok, cand_p):
    """The corpus tri-gram row of context (w1, w2) into cand_tok / cand_p
    (each successor's share of the context's count, at most cand_tok's size);
    return how many, or -1 when the corpus does not know the context."""
    tri_w1_offsets, tri_w2, tri_ctx_count, tri_offsets, tri_next, tri_count = corpus[:6]
    row = corpus_row(tri_w1_offsets, tri_w2, w1, w2)
    if row < 0 or tri_ctx_count[row] <= 0:
        return -1
    total = float(tri_ctx_count[row])
    n = 0
    for e in range(tri_offsets[row], tri_offsets[row + 1]):
        if n >= cand_tok.shape[0]:
            break
        cand_tok[n] = tri_next[e]
        cand_p[n] = float(tri_count[e]) / total
        n += 1
    return n


@njit(cache=True)
def _cand(cand_tok, n, tok):
    """Index of ``tok`` among the first n candidates, or -1."""
    for i in range(n):
        if cand_tok[i] == tok:
            return i
    return -1


@njit(cache=True)
def _overlay_into(ov, e, inc, cap, cand_tok, cand_a, cand_b, n):
    """Add the effective counts ``min(cap, inc * count)`` of overlay entry e's
    slots to the candidates' ``cand_b`` (appending new tokens with
    ``cand_a = cand_b = 0``).  Returns
    (new candidate count, effective context total), where the total is the
    slots' effective counts plus ``inc`` per occurrence held by no slot."""
    _, h_total, h_succ, h_cnt = ov
    total = 0.0
    slotted = 0
    for s in range(h_succ.shape[1]):
        t = h_succ[e, s]
        if t < 0:
            continue
        c = h_cnt[e, s]
        slotted += c
        o = min(float(cap), float(inc) * c)
        total += o
        j = _cand(cand_tok, n, t)
        if j < 0:
            if n >= cand_tok.shape[0]:
                continue
            j = n
            cand_tok[j] = t
            cand_a[j] = 0.0
            cand_b[j] = 0.0
            n += 1
        cand_b[j] += o
    total += float(inc) * (h_total[e] - slotted)
    return n, total


@njit(cache=True)
def successors(corpus, ov, w1, w2, mix, max_out, out_tok, out_p, cand_tok, cand_a, cand_b):
    """The ``max_out`` most probable successors of context (w1, w2).

    mix = (n_vocab, kappa, beta, increment, cap).  Writes tokens and
    probabilities, probability descending (ties token ascending), into
    ``out_tok`` / ``out_p``; cand_* are scratch of capacity >= the longest
    corpus row + K_adj + 2 S.  w1 = -1 means the context has only one token.
    Returns the number written (probabilities 0 are left out).

    Formula.  With c(w3) / C the corpus tri-gram counts / context total and
    o(w3) / O the overlay's effective tri-gram counts / context total:

        P(w3 | w1, w2) = (o(w3) + kappa * base(w3)) / (O + kappa)

    a Dirichlet posterior: the overlay's observations on top of a prior of
    strength kappa (in overlay count units) centred on ``base``:

        base(w3) = c(w3) / C                      if the corpus knows (w1, w2)
                 = beta * B(w3 | w2)              otherwise (bi-gram backoff)
        B(w3 | w2) = (ob(w3) + kappa * a(w3) / A) / (OB + kappa)

    the same mix one order down: ob / OB the overlay's bi-gram counts / total
    for context w2, a(w3) the corpus bi-gram row of w2 and A = bi_total[w2]
    (times w2 was followed by any token).  ``base`` may sum to less than 1 (a
    pruned corpus row, or no prior at all): the missing mass is on tokens the
    drafter cannot name, so it does not propose them.  With no corpus and one
    overlay occurrence of (w1, w2, w3), P(w3) = 1 / (1 + kappa).
    """
    adj_next, adj_count, bi_total = corpus[6:]
    n_vocab, kappa, beta, inc, cap = mix
    max_out = min(max_out, out_tok.shape[0], out_p.shape[0])
    if w2 < 0 or w2 >= n_vocab or max_out <= 0:
        return 0
    has_w1 = 0 <= w1 < n_vocab
    ncap = cand_tok.shape[0]

    # base distribution: the corpus tri-gram row ...
    n = corpus_successors(corpus, w1, w2, cand_tok, cand_a) if has_w1 else -1
    if n >= 0:
        cand_b[:n] = 0.0
    else:
        n = 0
        # ... or the bi-gram backoff: corpus row of w2 and overlay bi-grams.
        a_total = bi_total[w2]
        for k in range(adj_next.shape[1]):
            t = adj_next[w2, k]
            if t < 0 or n >= ncap:
                break
            cand_tok[n] = t
            cand_a[n] = float(adj_count[w2, k]) / a_total if a_total > 0 else 0.0
            cand_b[n] = 0.0
            n += 1
        ob_total = 0.0
        e2 = overlay_find(ov[0], np.int64(n_vocab) * n_vocab + w2)
        if e2 >= 0:
            n, ob_total = _overlay_into(ov, e2, inc, cap, cand_tok, cand_a, cand_b, n)
        for i in range(n):
            cand_a[i] = beta * (cand_b[i] + kappa * cand_a[i]) / (ob_total + kappa)
            cand_b[i] = 0.0

    # overlay tri-gram counts on top
    o_total = 0.0
    if has_w1:
        e3 = overlay_find(ov[0], np.int64(w1) * n_vocab + w2)
        if e3 >= 0:
            n, o_total = _overlay_into(ov, e3, inc, cap, cand_tok, cand_a, cand_b, n)

    # top max_out by insertion (candidate lists are short)
    k = 0
    for i in range(n):
        p = min((cand_b[i] + kappa * cand_a[i]) / (o_total + kappa), 1.0)
        if not p > 0.0:
            continue
        t = cand_tok[i]
        k = push_ranked(out_p, out_tok, k, max_out, p, t)
    return k


# --------------------------------------------------------------------------
# Monte Carlo tree search


@njit(cache=True)
def exploration(sum_n, c1, c2):
    """ADED/PUCT exploration weight E = C1 + log((sum N + C2 + 1) / C2)."""
    return c1 + math.log((sum_n + c2 + 1.0) / c2)


@njit(cache=True, inline="always")
def puct_child(node, first, nch, prior, visits, value, c1, c2):
    """The child of `node` with the highest PUCT score
    Q + E P sqrt(sum_b N) / (1 + N), Q its mean backed-up value (0 while
    unvisited), E the exploration weight; ties: the earlier child."""
    f = first[node]
    sum_n = 0.0
    for c in range(f, f + nch[node]):
        sum_n += visits[c]
    coef = exploration(sum_n, c1, c2) * math.sqrt(sum_n)
    best = f
    best_s = -1.0
    for c in range(f, f + nch[node]):
        q = value[c] / visits[c] if visits[c] > 0 else 0.0
        s = q + coef * prior[c] / (1.0 + visits[c])
        if s > best_s:
            best_s = s
            best = c
    return best


@njit(cache=True)
def puct_score(q, p, n, sum_n, c1, c2):
    """PUCT score of a child: Q + E * P * sqrt(sum N) / (1 + N), with Q its
    mean backed-up value, P its prior (conditional tri-gram probability), N its
    visits and sum N the visits of all its siblings (itself included)."""
    return q + exploration(sum_n, c1, c2) * p * math.sqrt(sum_n) / (1.0 + n)


@njit(cache=True)
def mcts_draft(corpus, ov, mix, w1, w2, search, nodes, cand, path,
               max_out, out_tok, out_par, out_p, sel_idx, sel_key, new_index):
    """Search the draft tree after context (..., w1, w2) and emit its best nodes.

    search = (iterations, max_depth, candidates, c1, c2).
    nodes = (tok int32, par int32, first int32, nch int32, depth int32,
             prior float64, cum float64, visits int32, value float64), each of
             capacity >= 1 + iterations * candidates: the search tree, node 0
             the root (token w2).  ``first``/``nch``: children are the
             ``nch`` consecutive nodes from ``first``; nch = -1 means not
             expanded yet, 0 a leaf (no successors, or at max_depth).
    cand = (tok int32, p float64, scratch_tok int32, scratch_a float64,
            scratch_b float64): ``tok``/``p`` of capacity >= candidates, the
            scratch of ``successors``.
    path int32 [>= max_depth + 1]; sel_idx int32 / sel_key float64
    [>= max_out]; new_index int32 like nodes.

    Each simulation (``iterations`` of them, fewer when no expandable node is
    left):
      select   from the root, move to the child of highest ``puct_score``
               (ties: the earlier child, i.e. the more probable) while the
               node is expanded and has children;
      expand   an unexpanded leaf above max_depth gets its ``candidates``
               most probable successors as children, in probability order
               (prior P = the conditional probability of ``successors``);
      value    v = the sum of the cumulative (path) probabilities of the nodes
               on the simulated path below the root, i.e. the expected number
               of accepted tokens if that chain alone were drafted (no
               rollout: the leaf is valued by its own path.  This is
               edgespec's variant: ADED's Algorithm 1 rolls out to depth l
               and scores 1 + the sum of the tri-gram values, kernels/aded.py;
               the PUCT score and E are the published ones);
      backup   every node on the path gets visits + 1 and value + v.

    Output: at most ``max_out`` nodes other than the root, ranked by visits,
    then cumulative probability, then creation order (key 2 N + cum).  A
    parent has strictly more visits than its child, so it ranks strictly
    higher: parents come before children and any prefix is a valid tree.
    out_p is the node's conditional probability.  Returns the count.
    """
    iterations, max_depth, candidates, c1, c2 = search
    tok, par, first, nch, depth, prior, cum, visits, value = nodes
    c_tok, c_p, s_tok, s_a, s_b = cand
    n_vocab = mix[0]
    cap_nodes = tok.shape[0]
    max_out = min(max_out, out_tok.shape[0], out_par.shape[0], out_p.shape[0],
                  sel_idx.shape[0], sel_key.shape[0])
    candidates = min(candidates, c_tok.shape[0], c_p.shape[0])
    max_depth = min(max_depth, path.shape[0] - 1)
    if w2 < 0 or w2 >= n_vocab or max_out <= 0 or max_depth <= 0 or cap_nodes < 1:
        return 0

    tok[0] = w2
    par[0] = -1
    first[0] = -1
    nch[0] = -1
    depth[0] = 0
    prior[0] = 1.0
    cum[0] = 1.0
    visits[0] = 0
    value[0] = 0.0
    m = 1
    frontier = 1  # unexpanded nodes above max_depth

    for _ in range(iterations):
        if frontier == 0:
            break
        # select
        node = 0
        plen = 1
        path[0] = 0
        while nch[node] > 0:
            node = puct_child(node, first, nch, prior, visits, value, c1, c2)
            path[plen] = node
            plen += 1
        # expand
        if nch[node] < 0:
            frontier -= 1
            a = tok[par[node]] if node > 0 else w1
            k = successors(corpus, ov, a, tok[node], mix, candidates, c_tok, c_p, s_tok, s_a, s_b)
            k = min(k, cap_nodes - m)
            first[node] = m
            nch[node] = k
            d = depth[node] + 1
            for i in range(k):
                c = m + i
                tok[c] = c_tok[i]
                par[c] = node
                first[c] = -1
                nch[c] = -1 if d < max_depth else 0
                depth[c] = d
                prior[c] = c_p[i]
                cum[c] = cum[node] * c_p[i]
                visits[c] = 0
                value[c] = 0.0
            if d < max_depth:
                frontier += k
            m += k
        # value and backup
        v = 0.0
        for i in range(1, plen):
            v += cum[path[i]]
        for i in range(plen):
            visits[path[i]] += 1
            value[path[i]] += v

    # best max_out nodes by key 2 N + cum (insertion; ties keep creation order)
    k = 0
    for i in range(1, m):
        k = push_sorted(sel_key, sel_idx, k, max_out, 2.0 * visits[i] + cum[i], i)
    for r in range(k):
        i = sel_idx[r]
        new_index[i] = r
        out_tok[r] = tok[i]
        out_par[r] = -1 if par[i] == 0 else new_index[par[i]]
        out_p[r] = prior[i]
    return k
