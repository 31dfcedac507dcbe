"""Kernels of the anchored drafters: the model's own alternatives beside a
retrieved continuation (AASD alignment sampling, edgespec's depth branching),
AdaPLD's single selected anchor and the draft tree built from it (main copy,
branches, successors), and soft, embedding based anchors when the context has
no exact match (edgespec's pair fallback).

Pure functions over numpy arrays; the drafters in drafters/branch.py,
drafters/papers/adapld.py and drafters/semantic.py own the state.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from edgespec.kernels.topk import push_sorted


@njit(cache=True)
def _child_of(tok, par, m, parent, t):
    """Index of the node among tok/par[:m] with this parent and token, or -1."""
    for i in range(m):
        if par[i] == parent and tok[i] == t:
            return i
    return -1


@njit(cache=True)
def build_branch_tree(ctx, n, ends, n_matches, alt_tok, alt_p, n_known, max_depth, max_alt,
                      max_nodes, out_tokens, out_parents, out_probs, out_src, n_prompt, misaligned_only,
                      src_prompt, src_gen):
    """The model's alternatives at the positions a retrieved continuation copies.

    Parameters
    ----------
    ctx : int32 [>= n]       the context; the root is ``ctx[n-1]``.
    ends : int32 [>= n_matches]   end positions ``e`` of earlier occurrences of
                             the context's suffix (``find_suffix_matches``):
                             retrieval drafts ``ctx[e+1], ctx[e+2], ...``.
    alt_tok : int32 [>= n_known, K]  the model's K most likely next tokens after
                             each context position (most likely first; -1 =
                             unknown); row p is the ranking the model gave when
                             it had read ``ctx[:p+1]``.
    alt_p : float32 [>= n_known, K]  their probabilities.
    n_known : int            rows ``>= n_known`` are treated as unknown.
    max_depth : int          alternatives are offered at depths 1..max_depth of
                             the retrieved continuation.
    max_alt : int            at most this many alternatives per position.
    max_nodes : int          output capacity (clamped to the arrays).
    out_src : int8           each node's source: src_prompt for alternatives at
                             rows p < n_prompt (the prompt's rankings from the
                             prefill), src_gen for the others and for the
                             restated retrieved path.
    misaligned_only : bool   AASD's alignment sampling: at prompt rows offer
                             alternatives only where the model's top choice is
                             not the copied token (the prompt and the model
                             disagree there); rows p >= n_prompt are unaffected.

    For each occurrence ``e`` and depth ``d = 0 .. max_depth-1`` with
    ``p = e + d`` a known row and ``p + 1 <= n - 1``: the retrieved path
    ``ctx[e+1 .. e+d]`` (nodes with probability 0: the retrieval tree already
    holds them, and ``merge_trees`` keeps the larger probability), then as its
    children the tokens of row p other than ``ctx[p+1]`` with the model's
    probability.  Where the model disagreed with the text (its top choice is
    not the copied token) the alternative it preferred comes first.

    Returns the node count; parents precede children, siblings are distinct.
    """
    cap = min(max_nodes, out_tokens.shape[0], out_parents.shape[0], out_probs.shape[0])
    n = min(n, ctx.shape[0])
    n_known = min(n_known, alt_tok.shape[0], alt_p.shape[0])
    k_alt = alt_tok.shape[1]
    m = 0
    for j in range(min(n_matches, ends.shape[0])):
        e = ends[j]
        if e < 0:
            continue
        parent = -1
        for d in range(max_depth):
            p = e + d
            if p + 1 > n - 1 or p >= n_known or alt_tok[p, 0] < 0:
                break
            if d > 0:           # descend along the retrieved token ctx[p]
                c = _child_of(out_tokens, out_parents, m, parent, ctx[p])
                if c < 0:
                    if m >= cap:
                        return m
                    out_tokens[m] = ctx[p]
                    out_parents[m] = parent
                    out_probs[m] = 0.0
                    out_src[m] = src_gen
                    c = m
                    m += 1
                parent = c
            copied = ctx[p + 1]
            if misaligned_only and p < n_prompt and alt_tok[p, 0] == copied:
                continue        # aligned: the copied token is the model's own choice
            src = src_prompt if p < n_prompt else src_gen
            taken = 0
            for r in range(k_alt):
                if taken >= max_alt:
                    break
                t = alt_tok[p, r]
                if t < 0:
                    break
                if t == copied:
                    continue
                taken += 1
                c = _child_of(out_tokens, out_parents, m, parent, t)
                if c >= 0:
                    if alt_p[p, r] > out_probs[c]:
                        out_probs[c] = alt_p[p, r]
                    continue
                if m >= cap:
                    return m
                out_tokens[m] = t
                out_parents[m] = parent
                out_probs[m] = alt_p[p, r]
                out_src[m] = src
                m += 1
    return m


@njit(cache=True)
def best_anchor(ctx, n, tok, sims, tau, H, known, q):
    """AdaPLD's choice of one anchor among the candidates of a query token.

    Candidates are positions ``t`` with ``0 <= t <= n-2`` (so ``ctx[t+1]``
    exists): with ``sims`` empty, those holding ``tok`` itself (lexical
    anchoring); otherwise those whose token ``c`` has ``sims[c] >= tau``
    (semantic fallback; sims[c] is the cosine of c's token embedding to the
    query's, read only for tokens of ``ctx[:n]``).

    Each candidate scores the cosine of the model's hidden states at rows
    ``t - 1`` and ``q`` (``H``: unit rows, row p the state after reading
    ``ctx[:p+1]``; ``known[p]``: row p holds one).  For the query token at the
    end of the context q is ``n - 2``, its preceding context; for a successor
    query (a branch token b drafted after anchor j) q is ``j``, the state that
    predicts b.  A candidate without a known row (``t = 0`` among them), or
    any candidate when row q is unknown, scores -2, below every cosine, so
    without hidden states the choice is the most recent candidate (the order
    among unscored candidates is not given by the paper).

    Returns the highest-scoring candidate, ties to the more recent, or -1.
    """
    n = min(n, ctx.shape[0])
    lexical = sims.shape[0] == 0
    n_rows = min(known.shape[0], H.shape[0])
    scored = 0 <= q < n_rows and known[q]
    best = -1
    best_s = -3.0
    for t in range(n - 2, -1, -1):
        c = ctx[t]
        if lexical:
            if c != tok:
                continue
        elif c < 0 or c >= sims.shape[0] or sims[c] < tau:
            continue
        s = -2.0
        p = t - 1
        if scored and 0 <= p < n_rows and known[p]:
            s = 0.0
            for d in range(H.shape[1]):
                s += H[p, d] * H[q, d]
        if s > best_s:
            best = t
            best_s = s
    return best


@njit(cache=True)
def successor_anchors(ctx, n, branch_tok, n_branch, H, known, q, out_pos):
    """``best_anchor`` with lexical candidates for each branch token:
    out_pos[i] = the chosen earlier occurrence of branch_tok[i] (scored
    against row q, the selected anchor's), or -1 where it never occurred
    with a following token."""
    empty = np.zeros(0, np.float32)
    for i in range(min(n_branch, branch_tok.shape[0], out_pos.shape[0])):
        out_pos[i] = best_anchor(ctx, n, branch_tok[i], empty, 0.0, H, known, q)


@njit(cache=True)
def _common_suffix(ctx, a, b, cap):
    """The largest L <= cap with ctx[a-L+1 .. a] == ctx[b-L+1 .. b]."""
    L = 0
    while L < cap and a - L >= 0 and b - L >= 0 and ctx[a - L] == ctx[b - L]:
        L += 1
    return L


@njit(cache=True)
def _add_node(tok, par, pr, sr, m, cap, t, parent, p, s):
    """Append a node if there is room; returns its index or -1."""
    if m >= cap:
        return -1
    tok[m] = t
    par[m] = parent
    pr[m] = p
    sr[m] = s
    return m


@njit(cache=True)
def build_adapld_tree(ctx, n, anchor, copy_len, branch_tok, branch_p, n_branch, succ_pos, succ_len,
                      max_nodes, out_tokens, out_parents, out_probs, out_src, src_copy, src_branch):
    """AdaPLD's draft tree around one selected anchor ``j = anchor``.

    * the main copy: ``ctx[j+1 .. min(j+copy_len, n-1)]`` as a chain under
      the root (copy_len 0: none, as after a semantic anchor);
    * the branches: ``branch_tok[:n_branch]``, children of the root with the
      model's probabilities branch_p (the caller has left out the copied
      token ``ctx[j+1]``);
    * under branch i, when ``succ_pos[i] >= 0``, its successor: the token
      that followed the chosen occurrence, ``ctx[succ_pos[i] + 1]``, and with
      succ_len > 1 the ones after it, up to succ_len, inside ctx[:n].

    Scores (the engine calibrates them; not given by the paper): a copied
    token at depth d (0 first) after a match of length L gets
    (L + d) / (L + d + 2), as the suffix part scores retrieval; L is the
    length of the common suffix of ctx[:j+1] and ctx[:n] (up to 32), and for
    a successor that of ctx[:succ_pos+1] and ctx[:n] extended by the branch
    token (1 where the successor anchor is a semantic one).

    Nodes come parents first, in the order: the first copied token, the
    branches, their successors, the rest of the copy; so a small max_nodes
    cuts the deep end of the copy first.  Sources: src_copy for the copy,
    src_branch for branches and successors.  Returns the node count.
    """
    cap = min(max_nodes, out_tokens.shape[0], out_parents.shape[0], out_probs.shape[0], out_src.shape[0])
    n = min(n, ctx.shape[0])
    j = anchor
    m = 0
    if j < 0 or j > n - 2:
        return 0
    n_copy = min(copy_len, n - 1 - j)
    L = _common_suffix(ctx, j, n - 1, 32)
    first = -1
    if n_copy > 0:
        first = _add_node(out_tokens, out_parents, out_probs, out_src, m, cap, ctx[j + 1], -1,
                          L / (L + 2.0), src_copy)
        if first < 0:
            return m
        m += 1
    nb = min(n_branch, branch_tok.shape[0], branch_p.shape[0], succ_pos.shape[0])
    b0 = m
    for i in range(nb):
        if _add_node(out_tokens, out_parents, out_probs, out_src, m, cap, branch_tok[i], -1,
                     branch_p[i], src_branch) < 0:
            return m
        m += 1
    for i in range(m - b0):
        e = succ_pos[i]
        if e < 0 or e > n - 2:
            continue
        Ls = 1
        if ctx[e] == branch_tok[i]:
            Ls = 1 + _common_suffix(ctx, e - 1, n - 1, 31)
        parent = b0 + i
        for d in range(min(succ_len, n - 1 - e)):
            if _add_node(out_tokens, out_parents, out_probs, out_src, m, cap, ctx[e + 1 + d], parent,
                         (Ls + d) / (Ls + d + 2.0), src_branch) < 0:
                return m
            parent = m
            m += 1
    parent = first
    for d in range(1, n_copy):
        if _add_node(out_tokens, out_parents, out_probs, out_src, m, cap, ctx[j + 1 + d], parent,
                     (L + d) / (L + d + 2.0), src_copy) < 0:
            return m
        parent = m
        m += 1
    return m


@njit(cache=True)
def mark_copied_from(ctx, n, n_prompt, ends, n_matches, max_depth, tok, par, m, src, from_src, to_src):
    """Re-mark the nodes of a continuation tree (build_continuation_tree over
    ctx with these matches) whose token was copied from a position before
    n_prompt: src[i] = to_src where it was from_src.  A node several matches
    pass through counts as prompt-retrieved when any of them copied it from
    the prompt (AASD relaxes prompt-retrieved tokens)."""
    n = min(n, ctx.shape[0])
    for j in range(min(n_matches, ends.shape[0])):
        e = ends[j]
        if e < 0 or e + 1 >= n_prompt:
            continue
        node = -1
        for pos in range(e + 1, min(e + 1 + max_depth, n, n_prompt)):
            c = _child_of(tok, par, m, node, ctx[pos])
            if c < 0:
                break
            if src[c] == from_src:
                src[c] = to_src
            node = c


@njit(cache=True)
def soft_anchors(ctx, n, sim_last, sim_prev, min_sim, max_out, out_end, out_score):
    """Positions whose last two tokens are *similar* to the context's last two.

    sim_last, sim_prev : float32 [n_vocab]  similarity of every token to
                         ``ctx[n-1]`` and to ``ctx[n-2]`` (cosine of token
                         embeddings; entries of tokens never seen may hold
                         anything below ``min_sim``).
    A position ``i`` (``1 <= i <= n-2``) qualifies when
    ``sim_last[ctx[i]] >= min_sim`` and ``sim_prev[ctx[i-1]] >= min_sim`` and it
    is not an exact match of both tokens (exact matches are retrieval's);
    its score is the mean of the two similarities.  Writes the best
    ``max_out`` (score descending, ties the more recent) to out_end/out_score
    and returns their count.
    """
    n = min(n, ctx.shape[0])
    cap = min(max_out, out_end.shape[0], out_score.shape[0])
    if n < 3 or cap <= 0:
        return 0
    a, b = ctx[n - 1], ctx[n - 2]
    k = 0
    for i in range(n - 2, 0, -1):
        s1 = sim_last[ctx[i]]
        if s1 < min_sim:
            continue
        s0 = sim_prev[ctx[i - 1]]
        if s0 < min_sim:
            continue
        if ctx[i] == a and ctx[i - 1] == b:
            continue
        k = push_sorted(out_score, out_end, k, cap, 0.5 * (s0 + s1), i)
    return k


@njit(cache=True, fastmath=True)
def scatter_sims(vecs, ids, lo, hi, q, out):
    """out[ids[j]] = vecs[j] . q for j in lo..hi-1 (cosines of unit rows).

    A plain loop instead of numpy's matrix-vector product: that one runs in
    OpenBLAS, whose worker threads keep spinning after the call and took the
    cores from llama.cpp's next decode (measured: decode time up 70% on the
    2-core machine)."""
    d = q.shape[0]
    for j in range(lo, hi):
        s = np.float32(0.0)
        for c in range(d):
            s += vecs[j, c] * q[c]
        out[ids[j]] = s


@njit(cache=True)
def softmax_rows(x, out, start, k):
    """out[start + i, :k] = softmax of x[i, :k] for every row i of x (x holds
    the kept top logits of a position, largest first, so x[i, 0] is the max)."""
    for i in range(x.shape[0]):
        s = 0.0
        for j in range(k):
            s += np.exp(np.float64(x[i, j]) - x[i, 0])
        for j in range(k):
            out[start + i, j] = np.exp(np.float64(x[i, j]) - x[i, 0]) / s


@njit(cache=True)
def path_probs(par, pr, m, cum, leaf):
    """cum[i] = product of pr over node i's root path, leaf[i] = i has no child;
    parents precede their children (DraftTree order)."""
    for i in range(m):
        leaf[i] = True
    for i in range(m):
        q = par[i]
        if q >= 0:
            cum[i] = pr[i] * cum[q]
            leaf[q] = False
        else:
            cum[i] = pr[i]


def warmup() -> None:
    ctx = np.array([1, 2, 3, 1, 2, 4, 1, 2], np.int32)
    ends = np.array([1, 4], np.int32)
    alt_tok = np.full((8, 4), -1, np.int32)
    alt_p = np.zeros((8, 4), np.float32)
    out = (np.zeros(8, np.int32), np.zeros(8, np.int32), np.zeros(8, np.float32))
    src = np.zeros(8, np.int8)
    build_branch_tree(ctx, 8, ends, 2, alt_tok, alt_p, 8, 3, 2, 8, *out, src, 4, True, 8, 5)
    sim = np.zeros(8, np.float32)
    soft_anchors(ctx, 8, sim, sim, 0.5, 4, np.zeros(4, np.int32), np.zeros(4, np.float32))
    H = np.zeros((8, 2), np.float32)
    known = np.zeros(8, np.bool_)
    best_anchor(ctx, 8, 2, sim, 0.1, H, known, 6)
    bt, bp, sp = np.array([7, 9], np.int32), np.array([0.5, 0.2], np.float32), np.array([-1, 2], np.int32)
    successor_anchors(ctx, 8, bt, 2, H, known, 1, sp)
    build_adapld_tree(ctx, 8, 1, 4, bt, bp, 2, sp, 1, 8, *out, src, 0, 5)
    mark_copied_from(ctx, 8, 4, ends, 2, 4, out[0], out[1], 0, src, 0, 7)
    scatter_sims(np.zeros((2, 3), np.float32), np.zeros(2, np.int64), 0, 2, np.zeros(3, np.float32), sim)
    softmax_rows(np.zeros((2, 4), np.float32), alt_p, 0, 4)
    path_probs(out[1], out[2], 8, np.zeros(8), np.zeros(8, np.bool_))
