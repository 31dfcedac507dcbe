"""Kernels of the anchored drafters: the model's own alternatives beside a
retrieved continuation (AASD / AdaPLD branch drafting) and soft, embedding
based anchors when the context has no exact match (AdaPLD semantic fallback).

Pure functions over numpy arrays; the drafters in drafters/branch.py and
drafters/semantic.py own the state.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from edgespec.kernels.suffix import find_suffix_matches
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
def single_anchors(ctx, n, sim_last, min_sim, max_out, out_end, out_score):
    """AdaPLD's semantic fallback anchors: positions ``i`` (``0 <= i <= n-2``)
    whose token is similar to the context's last token, ``sim_last[ctx[i]] >=
    min_sim`` (a single token, not a pair).  Writes the best ``max_out``
    (similarity descending, ties the more recent) to out_end/out_score and
    returns their count."""
    n = min(n, ctx.shape[0])
    cap = min(max_out, out_end.shape[0], out_score.shape[0])
    k = 0
    if cap <= 0:
        return 0
    for i in range(n - 2, -1, -1):
        s = sim_last[ctx[i]]
        if s >= min_sim:
            k = push_sorted(out_score, out_end, k, cap, s, i)
    return k


@njit(cache=True)
def _successors(buf, n, node, depth, m, cap, succ_len, src, out_tokens, out_parents, out_probs, out_src,
                ends1, lens1):
    """Successor drafting under draft node `node` (depth `depth`), whose path
    from the root is buf[n : n + depth]: the longest earlier occurrence of
    the end of buf[:n + depth] (at least 1 token) and up to succ_len tokens
    that followed it there, inside the real context (positions < n), as a
    chain under the node; each with the confidence L / (L + 2) of the match
    length L it extends (as build_continuation_tree).  Returns the new m."""
    if succ_len <= 0 or m >= cap:
        return m
    k = find_suffix_matches(buf, n + depth, 1, 32, 1, ends1, lens1)
    if k == 0:
        return m
    e = ends1[0]
    L = lens1[0]
    parent = node
    for d in range(succ_len):
        pos = e + 1 + d
        if pos >= n:
            break
        t = buf[pos]
        c = _child_of(out_tokens, out_parents, m, parent, t)
        if c < 0:
            if m >= cap:
                break
            c = m
            out_tokens[m] = t
            out_parents[m] = parent
            leff = float(L + d)
            out_probs[m] = leff / (leff + 2.0)
            out_src[m] = src
            m += 1
        parent = c
    return m


@njit(cache=True)
def build_adapld_tree(buf, n, ends, scale, n_anchors, exclude_copied, alt_tok, alt_p, n_known, k_branch,
                      succ_len, max_nodes, out_tokens, out_parents, out_probs, out_src, src, ends1, lens1):
    """AdaPLD's branch drafting and successor drafting around anchors.

    Parameters
    ----------
    buf : int32 [>= n + 1]   the context in buf[:n] (the root is buf[n-1]);
                             buf[n] is scratch (the branch token being extended).
    ends : int32 [>= n_anchors]  anchor positions e: lexical anchors end an
                             earlier occurrence of the context's suffix
                             (retrieval copies buf[e+1], buf[e+2], ...);
                             semantic anchors are positions similar to the root.
    scale : float32 [>= n_anchors]  factor on each anchor's branch probabilities
                             (1 for lexical anchors, the similarity for semantic).
    exclude_copied : bool    lexical anchors: leave out the copied token buf[e+1]
                             (the retrieval tree holds it); semantic anchors copy
                             nothing, so their whole ranking is offered.
    alt_tok, alt_p : [>= n_known, K]  the model's ranking after every context
                             position (row e: what the model expected at e + 1).
    k_branch : int           branch width: the model's top k_branch at the
                             anchor's next position (AdaPLD: 8).
    succ_len : int           successor drafting: under each branch token t, up to
                             succ_len tokens that followed t's latest earlier
                             occurrence (the longest match of the context
                             extended by t).
    out_src : int8           every node gets `src`.

    Branch tokens are children of the root with the model's probability at
    the anchor times the anchor's scale (a token several anchors offer keeps
    the largest).  Nodes come parents first; returns the node count.
    """
    cap = min(max_nodes, out_tokens.shape[0], out_parents.shape[0], out_probs.shape[0], out_src.shape[0])
    n = min(n, buf.shape[0] - 1)
    n_known = min(n_known, alt_tok.shape[0], alt_p.shape[0])
    kb = min(k_branch, alt_tok.shape[1])
    m = 0
    for j in range(min(n_anchors, ends.shape[0], scale.shape[0])):
        e = ends[j]
        if e < 0 or e >= n_known or e > n - 2:
            continue
        copied = buf[e + 1] if exclude_copied else -1
        for r in range(kb):
            t = alt_tok[e, r]
            if t < 0:
                break
            if t == copied:
                continue
            q = alt_p[e, r] * scale[j]
            c = _child_of(out_tokens, out_parents, m, -1, t)
            if c >= 0:
                if q > out_probs[c]:
                    out_probs[c] = q
                continue
            if m >= cap:
                return m
            c = m
            out_tokens[m] = t
            out_parents[m] = -1
            out_probs[m] = q
            out_src[m] = src
            m += 1
            buf[n] = t
            m = _successors(buf, n, c, 1, m, cap, succ_len, src, out_tokens, out_parents, out_probs,
                            out_src, ends1, lens1)
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
    single_anchors(ctx, 8, sim, 0.1, 4, np.zeros(4, np.int32), np.zeros(4, np.float32))
    buf = np.zeros(9, np.int32)
    buf[:8] = ctx
    one = np.zeros(1, np.int32)
    build_adapld_tree(buf, 8, ends, np.ones(2, np.float32), 2, True, alt_tok, alt_p, 8, 8, 4, 8, *out, src, 5,
                      one, one.copy())
    mark_copied_from(ctx, 8, 4, ends, 2, 4, out[0], out[1], 0, src, 0, 7)
    scatter_sims(np.zeros((2, 3), np.float32), np.zeros(2, np.int64), 0, 2, np.zeros(3, np.float32), sim)
    softmax_rows(np.zeros((2, 4), np.float32), alt_p, 0, 4)
    path_probs(out[1], out[2], 8, np.zeros(8), np.zeros(8, np.bool_))
