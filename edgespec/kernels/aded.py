"""ADED as published (Liu et al., "Adaptive Draft-Verification for Efficient
Large Language Model Decoding"): the tri-gram matrix of Eq. (1), its online
adjustment (Algorithm 2, Adjust3Gram) and the Monte Carlo tree search of
Algorithm 1 with the PUCT score of Eqs. (2)-(3).  edgespec's own variant (a
Dirichlet mix with a windowed overlay, no rollout, nodes ranked by visits) is
``edgespec.kernels.trigram``; this module reuses its corpus look-up, hashing
and PUCT weight.

Array bundles (numba unpacks the tuples):

corpus: the tri-gram bundle of ``edgespec.kernels.trigram`` (only its tri_*
    arrays are read here).  The drafter has already dropped the tri-grams
    counted fewer than t times (ADED's elimination threshold), so a row holds
    the matrix entries P(w3 | w1, w2) = C(w1, w2, w3) / C(w1, w2) (Eq. 1) with
    C(w1, w2) the context's full count, ``tri_ctx_count``.

adj = (a_key int64 [H], a_tok int32 [H, S], a_p float64 [H, S], a_n int64 [1])
    The entries Adjust3Gram has written, which replace the corpus value of
    the same tri-gram: a hash table (the overlay's hashing, linear probing, no
    deletion) keyed by the context ``w1 * V + w2``, S successor slots each
    (token, -1 = free; its matrix value), ``a_n[0]`` the keys held.  The
    caller keeps H >= 2 (a_n + the tokens of one call) by ``adjust_grow``, so
    an insertion always finds a free entry.

The matrix value of (w1, w2, w3) is its adjusted value if Adjust3Gram wrote
one, else its corpus value, else absent.  There is no bi-gram backoff: a
context the matrix does not know has no successors.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from edgespec.kernels.topk import push_ranked, push_sorted
from edgespec.kernels.tree import cap_sibling_mass
from edgespec.kernels.trigram import _home, corpus_row, corpus_successors, overlay_find, puct_child


# --------------------------------------------------------------------------
# the matrix and Adjust3Gram


@njit(cache=True)
def corpus_prob(corpus, w1, w2, w3):
    """The corpus matrix value C(w1, w2, w3) / C(w1, w2), or -1 if absent."""
    tri_w1_offsets, tri_w2, tri_ctx_count, tri_offsets, tri_next, tri_count = corpus[:6]
    row = corpus_row(tri_w1_offsets, tri_w2, w1, w2)
    if row < 0 or tri_ctx_count[row] == 0:
        return -1.0
    for e in range(tri_offsets[row], tri_offsets[row + 1]):
        if tri_next[e] == w3:
            return float(tri_count[e]) / float(tri_ctx_count[row])
    return -1.0


@njit(cache=True)
def _insert_key(a_key, a_tok, a_n, key):
    """Index of ``key`` in the adjusted table, inserted (slots free) if absent."""
    mask = a_key.shape[0] - 1
    i = _home(key, mask)
    while a_key[i] >= 0 and a_key[i] != key:
        i = (i + 1) & mask
    if a_key[i] < 0:
        a_key[i] = key
        for s in range(a_tok.shape[1]):
            a_tok[i, s] = -1
        a_n[0] += 1
    return i


@njit(cache=True)
def adjust3gram(corpus, adj, tokens, n, max_length, increment, max_prob, n_vocab):
    """Algorithm 2 over ``tokens[:n]``: every tri-gram of the last
    ``max_length`` tokens gets min(current + increment, max_prob) if the matrix
    has it, else the value ``increment``.  A tri-gram whose context already
    holds S other adjusted successors is left out (the paper's matrix has no
    such bound).  Tokens outside [0, n_vocab) form no tri-gram.  Returns the
    number of tri-grams written."""
    a_key, a_tok, a_p, a_n = adj
    n = min(n, tokens.shape[0])
    start = max(0, n - max_length)
    written = 0
    for i in range(start + 2, n):
        w1 = np.int64(tokens[i - 2])
        w2 = np.int64(tokens[i - 1])
        w3 = tokens[i]
        if not (0 <= w1 < n_vocab and 0 <= w2 < n_vocab and 0 <= w3 < n_vocab):
            continue
        e = _insert_key(a_key, a_tok, a_n, w1 * n_vocab + w2)
        slot = -1
        free = -1
        for s in range(a_tok.shape[1]):
            if a_tok[e, s] == w3:
                slot = s
                break
            if free < 0 and a_tok[e, s] < 0:
                free = s
        if slot >= 0:
            a_p[e, slot] = min(a_p[e, slot] + increment, max_prob)
        elif free >= 0:
            cur = corpus_prob(corpus, w1, w2, w3)
            a_tok[e, free] = w3
            a_p[e, free] = min(cur + increment, max_prob) if cur >= 0.0 else increment
        else:
            continue
        written += 1
    return written


@njit(cache=True)
def adjust_grow(old, new):
    """Copy every entry of the adjusted table ``old`` into the empty, larger
    table ``new`` (its a_key all -1, a_n 0)."""
    o_key, o_tok, o_p, _ = old
    n_key, n_tok, n_p, n_n = new
    for i in range(o_key.shape[0]):
        if o_key[i] < 0:
            continue
        j = _insert_key(n_key, n_tok, n_n, o_key[i])
        for s in range(o_tok.shape[1]):
            n_tok[j, s] = o_tok[i, s]
            n_p[j, s] = o_p[i, s]


@njit(cache=True)
def gather(corpus, adj, w1, w2, n_vocab, cand_tok, cand_p):
    """Every successor the matrix has for context (w1, w2), unordered: the
    corpus row, with adjusted values replacing corpus ones and adjusted-only
    successors appended.  Returns the count (at most cand_tok's capacity)."""
    if not (0 <= w1 < n_vocab and 0 <= w2 < n_vocab):
        return 0
    a_key, a_tok, a_p, _ = adj
    ncap = cand_tok.shape[0]
    n = max(corpus_successors(corpus, w1, w2, cand_tok, cand_p), 0)
    i = overlay_find(a_key, np.int64(w1) * n_vocab + w2)
    if i >= 0:
        for s in range(a_tok.shape[1]):
            t = a_tok[i, s]
            if t < 0:
                continue
            j = -1
            for c in range(n):
                if cand_tok[c] == t:
                    j = c
                    break
            if j < 0:
                if n >= ncap:
                    continue
                j = n
                cand_tok[j] = t
                n += 1
            cand_p[j] = a_p[i, s]
    return n


@njit(cache=True)
def matrix_successors(corpus, adj, w1, w2, n_vocab, max_out, out_tok, out_p, cand_tok, cand_p):
    """The ``max_out`` largest matrix entries of context (w1, w2), value
    descending (ties token ascending), into out_tok / out_p; entries of value
    0 are left out.  Returns the count."""
    n = gather(corpus, adj, w1, w2, n_vocab, cand_tok, cand_p)
    max_out = min(max_out, out_tok.shape[0], out_p.shape[0])
    k = 0
    for i in range(n):
        p = cand_p[i]
        t = cand_tok[i]
        if not p > 0.0 or max_out <= 0:
            continue
        k = push_ranked(out_p, out_tok, k, max_out, p, t)
    return k


# --------------------------------------------------------------------------
# Algorithm 1


@njit(cache=True)
def _uniform(rng):
    """A float in [0, 1) from the xorshift64* generator whose state is rng[0]."""
    x = rng[0]
    x ^= x >> np.uint64(12)
    x ^= x << np.uint64(25)
    x ^= x >> np.uint64(27)
    rng[0] = x
    return float((x * np.uint64(2685821657736338717)) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(cache=True)
def _rollout(corpus, adj, n_vocab, w1, st_tok, st_p, slen, length, rng, s_tok, s_p):
    """Algorithm 1's simulation: extend the state by tokens sampled in
    proportion to their matrix values after its last two tokens until it holds
    ``length`` tokens or the matrix has no successor (line 27 reads the matrix
    "using last_word"; a tri-gram matrix row is named by the last two, which
    is what is used: not given by the paper).  Returns the new length."""
    while slen < length:
        a = st_tok[slen - 2] if slen >= 2 else w1
        k = gather(corpus, adj, a, st_tok[slen - 1], n_vocab, s_tok, s_p)
        total = 0.0
        for i in range(k):
            if s_p[i] > 0.0:
                total += s_p[i]
        if not total > 0.0:
            break
        r = _uniform(rng) * total
        pick = -1
        for i in range(k):
            if s_p[i] > 0.0:
                pick = i
                r -= s_p[i]
                if r < 0.0:
                    break
        st_tok[slen] = s_tok[pick]
        st_p[slen] = s_p[pick]
        slen += 1
    return slen


@njit(cache=True)
def aded_draft(corpus, adj, n_vocab, w1, w2, search, nodes, cand, state, rng, stats,
               max_out, out_tok, out_par, out_p, sel_idx, sel_key, new_index, group):
    """Algorithm 1 after context (..., w1, w2), then its best sentences as one tree.

    search = (iterations s, depth l, candidates, c1, c2, sequences n, rollout
             (1/0), seed).
    nodes = (tok, par, first, nch int32; prior, score float64; visits int32),
            capacity >= 1 + iterations * candidates; node 0 is the root
            (token w2, its previous word w1).  nch = -1: not expanded yet, 0: the
            matrix has no successor (no untried words).
    cand = (tok int32, p float64) of capacity >= candidates, then the scratch
           (tok int32, p float64) of ``gather`` (>= the longest corpus row + S).
    state = (tok int32, p float64) of capacity >= l + 1; rng uint64 [1];
    stats int64 [2] gets (search-tree nodes, iterations run).
    sel_idx int32 / sel_key float64 of capacity >= n; new_index int32 like the
    nodes; group float64 [>= max_out + 1].

    Each iteration (re-seeded from ``seed`` per call, as line 1 re-initialises
    the generator): *selection* descends by ``puct_child`` (Eq. 2, E of Eq. 3) while the node has
    children and the state (the root's token and the selected ones) is shorter
    than l + 1 tokens (l drafted tokens: whether the paper's sentence length
    counts the root's token is not given by the paper); *expansion* gives a
    childless node its matrix successors (at most ``candidates``, value
    descending) as children, P(s, a) their matrix values, and moves to the
    last of them (line 22); *simulation* (with ``rollout``) samples to l + 1
    tokens; *backpropagation*: score = 1 + the sum of the matrix values of the
    state's tokens after the root, added to the score of every node from the
    last tree node up to the root, each visit + 1.

    Output: the sentences (root-to-leaf paths of the search tree) ranked by
    their leaf's accumulated score (ties: creation order), the best n merged
    into a tree (shared prefixes once), at most ``max_out`` nodes, parents
    first.  out_p is min(1, matrix value), divided by its siblings' sum where
    that exceeds 1 (Adjust3Gram's values need not sum to 1; a DraftTree's
    siblings must).  Returns the node count.
    """
    iterations, depth_l, candidates, c1, c2, n_seq, rollout, seed = search
    tok, par, first, nch, prior, score, visits = nodes
    c_tok, c_p, s_tok, s_p = cand
    st_tok, st_p = state
    cap_nodes = tok.shape[0]
    length = min(depth_l, st_tok.shape[0] - 1) + 1
    candidates = min(candidates, c_tok.shape[0])
    n_seq = min(n_seq, sel_idx.shape[0], sel_key.shape[0])
    max_out = min(max_out, out_tok.shape[0], out_par.shape[0], out_p.shape[0], group.shape[0] - 1)
    stats[0] = 0
    stats[1] = 0
    if not (0 <= w2 < n_vocab) or max_out <= 0 or length < 2 or n_seq <= 0 or cap_nodes < 1:
        return 0
    rng[0] = np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x2545F4914F6CDD1D)
    if rng[0] == 0:
        rng[0] = np.uint64(1)
    tok[0] = w2
    par[0] = -1
    nch[0] = -1
    prior[0] = 1.0
    score[0] = 0.0
    visits[0] = 0
    m = 1
    st_tok[0] = w2
    st_p[0] = 1.0
    for _ in range(iterations):
        if nch[0] == 0:         # no successor of the root: no sentence, whatever is left to run
            break
        stats[1] += 1
        node = 0
        slen = 1
        while nch[node] > 0 and slen < length:             # selection
            node = puct_child(node, first, nch, prior, visits, score, c1, c2)
            st_tok[slen] = tok[node]
            st_p[slen] = prior[node]
            slen += 1
        if slen < length and nch[node] < 0:                 # expansion
            a = tok[par[node]] if node > 0 else w1
            k = matrix_successors(corpus, adj, a, tok[node], n_vocab, candidates, c_tok, c_p,
                                  s_tok, s_p)
            k = min(k, cap_nodes - m)
            first[node] = m
            nch[node] = k
            for i in range(k):
                c = m + i
                tok[c] = c_tok[i]
                par[c] = node
                nch[c] = -1
                prior[c] = c_p[i]
                score[c] = 0.0
                visits[c] = 0
            m += k
            if k > 0:
                node = m - 1
                st_tok[slen] = tok[node]
                st_p[slen] = prior[node]
                slen += 1
        if rollout:                                         # simulation
            slen = _rollout(corpus, adj, n_vocab, w1, st_tok, st_p, slen, length, rng, s_tok, s_p)
        v = 1.0                                             # backpropagation
        for i in range(1, slen):
            v += st_p[i]
        while node >= 0:
            visits[node] += 1
            score[node] += v
            node = par[node]
    stats[0] = m
    return _emit(tok, par, nch, prior, score, m, n_seq, max_out, out_tok, out_par, out_p,
                 sel_idx, sel_key, new_index, group, st_tok)


@njit(cache=True)
def _emit(tok, par, nch, prior, score, m, n_seq, max_out, out_tok, out_par, out_p,
          sel_idx, sel_key, new_index, group, path):
    """The best ``n_seq`` leaves' paths merged into the output (see aded_draft);
    ``path`` is scratch of capacity >= the tree's depth + 1."""
    k = 0
    for i in range(1, m):
        new_index[i] = -1
        if nch[i] <= 0:
            k = push_sorted(sel_key, sel_idx, k, n_seq, score[i], i)
    r = 0
    for q in range(k):
        if r == max_out:
            break
        plen = 0
        i = sel_idx[q]
        while i > 0 and plen < path.shape[0]:
            path[plen] = i
            plen += 1
            i = par[i]
        for j in range(plen - 1, -1, -1):
            i = path[j]
            if new_index[i] >= 0:
                continue
            if r == max_out:
                break
            new_index[i] = r
            out_tok[r] = tok[i]
            out_par[r] = -1 if par[i] == 0 else new_index[par[i]]
            out_p[r] = min(prior[i], 1.0)
            r += 1
    cap_sibling_mass(out_par, out_p, r, group)
    return r
