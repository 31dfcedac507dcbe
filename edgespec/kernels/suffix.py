"""Suffix-match kernels: find where the end of the context occurred before, and
merge what followed those occurrences into a draft tree (a trie).

This is "prompt lookup" decoding generalised to a tree: when the last few
tokens of the context already appeared earlier (in the prompt, an earlier chat
turn, or the generation so far), the tokens that followed them are a cheap,
often correct guess of what comes next.  Several earlier occurrences may have
been followed by different tokens; merging all their continuations into a trie
lets one verification batch try every one of them.

All functions are ``numba.njit(cache=True)`` and pure: they read contiguous
numpy arrays, write into arrays preallocated by the caller, and return the
number of entries written.  Defensive clamps (``n`` to ``len(tokens)``, counts
to the output capacities) keep a bad argument from writing out of bounds; they
cost a few comparisons per call.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def find_suffix_matches(tokens, n, min_len, max_len, max_matches, out_end, out_len):
    """Find earlier occurrences of the suffix of ``tokens[:n]``.

    Parameters
    ----------
    tokens : int32 [>= n]   the context; only ``tokens[:n]`` is read.
    n : int                 number of valid tokens (clamped to ``len(tokens)``).
    min_len : int           keep occurrences whose match length is >= min_len
                            (values < 1 act as 1: an occurrence must at least
                            repeat the last token).
    max_len : int           stop extending a match at this length.
    max_matches : int       keep at most this many occurrences (clamped to the
                            output capacity).
    out_end : int32 [>= max_matches]  receives the end position ``e`` of each kept
                            occurrence.
    out_len : int32 [>= max_matches]  receives its match length ``L``.

    An occurrence ends at ``e`` with ``0 <= e <= n - 2`` (``e = n - 1`` is the
    suffix itself).  Its length ``L`` is the largest ``L <= min(max_len, e + 1)``
    with ``tokens[e-L+1 .. e] == tokens[n-L .. n-1]``.  The two windows may
    overlap (self-repetition such as ``1 1 1 1``); that is fine because both are
    read from the same immutable array.  Since ``e <= n - 2`` every occurrence
    has at least one continuation token ``tokens[e + 1]``.

    Returns the count ``k`` written.  Invariant on the output: entries are
    ordered by ``L`` descending, ties by ``e`` descending (more recent first),
    and they are the best ``k`` of all qualifying occurrences in that order.

    Cost: one comparison per position where ``tokens[e] != tokens[n-1]`` (the
    common case), plus ``L`` comparisons per candidate.  The scan stops early
    once the output is full of ``max_len`` matches, since no later (older)
    occurrence can outrank them.
    """
    if n > tokens.shape[0]:
        n = tokens.shape[0]
    cap = out_end.shape[0]
    if out_len.shape[0] < cap:
        cap = out_len.shape[0]
    if max_matches > cap:
        max_matches = cap
    if min_len < 1:
        min_len = 1
    if n < 2 or max_len < 1 or max_matches < 1 or min_len > max_len:
        return 0

    last = tokens[n - 1]
    count = 0
    # Scan from the most recent candidate backwards.  Because of this order, an
    # occurrence found later never beats an earlier-found one of equal length
    # (it is older), so it is inserted *after* all entries with L >= its own:
    # that yields exactly "L descending, then e descending".
    for e in range(n - 2, -1, -1):
        if tokens[e] != last:
            continue
        lim = e + 1  # the match cannot extend before position 0
        if lim > max_len:
            lim = max_len
        length = 1
        while length < lim and tokens[e - length] == tokens[n - 1 - length]:
            length += 1
        if length < min_len:
            continue
        if count == max_matches and length <= out_len[count - 1]:
            # Full, and not strictly better than the worst kept entry; a tie
            # loses because this occurrence is older.
            continue
        # Insertion sort step.  j starts at the slot that is free (or, when
        # full, at the last slot, whose entry is being evicted).
        j = count if count < max_matches else max_matches - 1
        while j > 0 and out_len[j - 1] < length:
            out_end[j] = out_end[j - 1]
            out_len[j] = out_len[j - 1]
            j -= 1
        out_end[j] = e
        out_len[j] = length
        if count < max_matches:
            count += 1
        if count == max_matches and out_len[count - 1] >= max_len:
            # Every kept entry already has the maximal length; older
            # occurrences can at best tie and ties go to the more recent.
            break
    return count


@njit(cache=True)
def build_continuation_tree(tokens, n, ends, lens, n_matches, max_depth, max_nodes,
                            out_tokens, out_parents, out_probs, out_mlen):
    """Merge the continuations of suffix matches into a draft trie.

    Parameters
    ----------
    tokens : int32 [>= n]    the context; only ``tokens[:n]`` is read.
    n : int                  number of valid tokens (clamped to ``len(tokens)``).
    ends, lens : int32 [>= n_matches]  matches as returned by
                             ``find_suffix_matches`` (end position ``e`` and
                             length ``L``); matches with ``L < 1`` or without a
                             continuation (``e + 1 >= n`` or ``e < 0``) are
                             skipped.
    n_matches : int          how many matches to read.
    max_depth : int          each continuation is ``tokens[e+1 : min(e+1+max_depth, n)]``.
    max_nodes : int          emit at most this many nodes (clamped to the output
                             capacity).
    out_tokens : int32 [>= max_nodes]    token of each draft node.
    out_parents : int32 [>= max_nodes]   parent index, -1 for children of the root.
    out_probs : float32 [>= max_nodes]   estimate of P(node accepted | parent accepted).
    out_mlen : int32 [>= max_nodes]      longest match length among the matches
                             whose continuation passes through the node.

    The root is the implicit end of the context.  A trie node stands for one
    distinct continuation prefix, so shared prefixes are merged and siblings
    carry distinct tokens.

    Weights: a match of length ``L`` has weight ``w = L * L`` (long matches are
    much more predictive than short ones; squaring lets one long match outvote a
    few 2-token matches).  A node's weight is the sum over matches through it;
    the root's is the sum over all used matches.

    Probabilities: ``p = w(node) / w(parent) * conf(L_eff)`` with
    ``L_eff = mlen(node) + depth(node) - 1`` (depth 1 for children of the root;
    each accepted draft token lengthens the match by one) and
    ``conf(L) = L / (L + 2)``.  Since the children's weights sum to at most the
    parent's (a match may end at the parent when its continuation hits ``n``)
    and ``conf < 1``, sibling probabilities sum to less than 1 and every
    ``p`` is in ``[0, 1)``.  These are starting heuristics that the engine
    calibrates online.

    Output order: the full trie is built in scratch space, then its nodes are
    emitted in decreasing order of cumulative probability (product of ``p`` from
    the root), ties by creation order.  A child's cumulative probability is
    ``cum(parent) * p <= cum(parent)`` and a child is always created after its
    parent, so a stable sort keeps every parent before its children
    (``out_parents[i] < i``) and truncating to ``max_nodes`` keeps the most
    probable nodes as a valid tree.

    Returns the number of nodes written.
    """
    n = min(n, tokens.shape[0])
    n_matches = min(n_matches, ends.shape[0], lens.shape[0])
    max_nodes = min(max_nodes, out_tokens.shape[0], out_parents.shape[0],
                    out_probs.shape[0], out_mlen.shape[0])
    if n_matches <= 0 or max_depth <= 0 or max_nodes <= 0:
        return 0

    # Scratch trie.  Each match adds at most max_depth nodes.
    cap = n_matches * max_depth
    tok = np.empty(cap, np.int64)
    par = np.empty(cap, np.int64)
    first_child = np.empty(cap, np.int64)
    next_sib = np.empty(cap, np.int64)
    depth = np.empty(cap, np.int64)
    mlen = np.empty(cap, np.int64)
    weight = np.empty(cap, np.float64)
    root_first = -1
    root_w = 0.0
    m = 0

    for k in range(n_matches):
        e = np.int64(ends[k])
        L = np.int64(lens[k])
        if L < 1 or e < 0 or e + 1 >= n:
            continue
        w = float(L) * float(L)
        root_w += w
        stop = e + 1 + max_depth
        if stop > n:
            stop = n
        node = np.int64(-1)
        for pos in range(e + 1, stop):
            t = np.int64(tokens[pos])
            # Look for an existing child of `node` carrying t (siblings are a
            # linked list; fan-out is at most n_matches, so this is short).
            c = root_first if node < 0 else first_child[node]
            while c >= 0 and tok[c] != t:
                c = next_sib[c]
            if c < 0:
                c = np.int64(m)
                m += 1
                tok[c] = t
                par[c] = node
                first_child[c] = -1
                weight[c] = 0.0
                mlen[c] = 0
                if node < 0:
                    depth[c] = 1
                    next_sib[c] = root_first
                    root_first = c
                else:
                    depth[c] = depth[node] + 1
                    next_sib[c] = first_child[node]
                    first_child[node] = c
            weight[c] += w
            if L > mlen[c]:
                mlen[c] = L
            node = c

    if m == 0:
        return 0

    # Probabilities; nodes were created parents-first, so cum[par] is ready.
    p = np.empty(m, np.float64)
    neg_cum = np.empty(m, np.float64)
    for i in range(m):
        pi = par[i]
        parent_w = root_w if pi < 0 else weight[pi]
        leff = float(mlen[i] + depth[i] - 1)
        p[i] = weight[i] / parent_w * (leff / (leff + 2.0))
        if pi < 0:
            neg_cum[i] = -p[i]
        else:
            # x * p <= x for p <= 1 also after rounding, so the child never
            # outranks its parent.
            neg_cum[i] = neg_cum[pi] * p[i]

    # Stable sort: ties keep creation order, in which parents come first.
    order = np.argsort(neg_cum, kind="mergesort")
    new_index = np.empty(m, np.int64)
    k_out = m if m < max_nodes else max_nodes
    for r in range(k_out):
        i = order[r]
        new_index[i] = r
        out_tokens[r] = tok[i]
        pi = par[i]
        out_parents[r] = -1 if pi < 0 else new_index[pi]
        out_probs[r] = p[i]
        out_mlen[r] = mlen[i]
    return k_out


def warmup() -> None:
    """Compile (or load from the cache) both kernels for the dtypes the
    drafter uses: int32 tokens/ends/lens/parents/mlen, float32 probs, and
    Python ints for the scalar arguments."""
    tokens = np.array([1, 2, 3, 1, 2, 4, 1, 2], dtype=np.int32)
    ends = np.zeros(4, np.int32)
    lens = np.zeros(4, np.int32)
    k = find_suffix_matches(tokens, len(tokens), 1, 8, 4, ends, lens)
    out_tokens = np.zeros(8, np.int32)
    out_parents = np.zeros(8, np.int32)
    out_probs = np.zeros(8, np.float32)
    out_mlen = np.zeros(8, np.int32)
    build_continuation_tree(tokens, len(tokens), ends, lens, k, 4, 8,
                            out_tokens, out_parents, out_probs, out_mlen)
