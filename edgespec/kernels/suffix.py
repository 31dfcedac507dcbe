"""Suffix-match kernels: find where the end of the context occurred before, and
merge what followed those occurrences into a draft tree (a trie).

This is "prompt lookup" decoding generalised to a tree: when the last few
tokens of the context already appeared earlier (in the prompt, an earlier chat
turn, or the generation so far), the tokens that followed them are a cheap,
often correct guess of what comes next.  Several earlier occurrences may have
been followed by different tokens; merging all their continuations into a trie
lets one verification batch try every one of them.

The same trie is built from matches in a compiled corpus (``sa_find_matches``
finds them by binary search on its suffix array), and ``merge_trees`` merges
the context's proposal with a corpus's.

All functions are ``numba.njit(cache=True)`` and pure: they read contiguous
numpy arrays, write into arrays preallocated by the caller, and return the
number of entries written.  Defensive clamps (``n`` to ``len(tokens)``, counts
to the output capacities) keep a bad argument from writing out of bounds; they
cost a few comparisons per call.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from edgespec.kernels.topk import push_sorted
from edgespec.kernels.tree import cap_sibling_mass


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
        # Kept sorted by length; when full, a tie with the worst kept entry
        # loses because this occurrence is older.
        count = push_sorted(out_len, out_end, count, max_matches, length, e)
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
    tokens : int32 [>= n]    the context, or a corpus token array (see
                             ``sa_find_matches``); only ``tokens[:n]`` is read.
                             A negative token (a corpus separator, -1) ends a
                             continuation; contexts contain none.
    n : int                  number of valid tokens (clamped to ``len(tokens)``).
    ends, lens : int32 [>= n_matches]  matches as returned by
                             ``find_suffix_matches`` (end position ``e`` and
                             length ``L``); matches with ``L < 1`` or without a
                             continuation (``e + 1 >= n`` or ``e < 0``) are
                             skipped.
    n_matches : int          how many matches to read.
    max_depth : int          each continuation is ``tokens[e+1 : min(e+1+max_depth, n)]``,
                             cut before the first negative token.  A match whose
                             continuation is cut to nothing by a separator still
                             counts in the root's weight (the document ended
                             there: evidence against every child).
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
            if t < 0:
                break  # a corpus separator: the document ended here
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

    p = np.empty(m, np.float64)
    for i in range(m):
        pi = par[i]
        parent_w = root_w if pi < 0 else weight[pi]
        leff = float(mlen[i] + depth[i] - 1)
        p[i] = weight[i] / parent_w * (leff / (leff + 2.0))
    return _emit_by_path_prob(tok, par, p, mlen, m, max_nodes, out_tokens, out_parents, out_probs, out_mlen)


@njit(cache=True)
def _emit_by_path_prob(tok, par, p, extra, m, max_nodes, out_tokens, out_parents, out_probs, out_extra):
    """Write the first max_nodes of m trie nodes (created parents first: par[i] < i,
    -1 = root) in decreasing order of cumulative probability, re-indexing parents;
    ``extra`` (match lengths or sources) travels with each node.  Returns the count."""
    neg_cum = np.empty(m, np.float64)
    for i in range(m):
        pi = par[i]
        # x * p <= x for p <= 1 also after rounding, so the child never
        # outranks its parent.
        neg_cum[i] = -p[i] if pi < 0 else neg_cum[pi] * p[i]
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
        out_extra[r] = extra[i]
    return k_out


# --------------------------------------------------------------------------
# Corpus matches: binary search on a compiled corpus's suffix array.
#
# A compiled corpus (edgespec.corpus.format) holds ``tokens`` (documents concatenated,
# each followed by one -1 separator) and ``sa``: every position p with
# tokens[p] != -1, sorted by the key tokens[p : p + sa_depth] cut at the first
# -1 (a key that is a prefix of another sorts first), ties by p ascending.  So
# for a pattern P of at most sa_depth tokens (none negative) the positions
# where P occurs are one contiguous run of ``sa``: its SA interval.

SA_FILL_LENGTHS = 4
"""sa_find_matches fills up with occurrences of at most this many lengths
below the longest (each length costs two binary searches)."""


@njit(cache=True)
def _sa_cmp(tokens, p, ctx, s, length):
    """Compare the corpus key at position p with the pattern ctx[s : s+length].

    Returns -1 if the key sorts before the pattern, 0 if it starts with the
    pattern, 1 if it sorts after.  Pattern tokens are >= 0, so a separator
    (-1, or the end of the array) compares smaller, which is the spec's "a
    shorter key sorts first"; the comparison stops there anyway.
    """
    n_tok = tokens.shape[0]
    for j in range(length):
        q = p + j
        t = tokens[q] if q < n_tok else -1
        c = ctx[s + j]
        if t != c:
            return -1 if t < c else 1
    return 0


@njit(cache=True)
def _sa_lower(tokens, sa, lo, hi, ctx, s, length):
    """First row r in [lo, hi) of ``sa`` whose key is >= the pattern (hi if none)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if _sa_cmp(tokens, np.int64(sa[mid]), ctx, s, length) < 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True)
def _sa_upper(tokens, sa, lo, hi, ctx, s, length):
    """End of the run of rows starting at ``lo`` (whose key starts with the
    pattern) that start with the pattern.  Gallops from lo, so the cost grows
    with the log of the run's length, not of the whole array."""
    a = lo          # last row known to match
    step = 1
    b = lo + 1      # probe
    while b < hi and _sa_cmp(tokens, np.int64(sa[b]), ctx, s, length) == 0:
        a = b
        step *= 2
        b = a + step
    if b > hi:
        b = hi
    lo2 = a + 1     # rows in (a, b): unknown; row b (if < hi) is past the run
    while lo2 < b:
        mid = (lo2 + b) >> 1
        if _sa_cmp(tokens, np.int64(sa[mid]), ctx, s, length) == 0:
            lo2 = mid + 1
        else:
            b = mid
    return lo2


@njit(cache=True)
def _sa_take(tokens, sa, lo, hi, length, prev_tok, n_exact, need, out_pos, out_len, count):
    """Append up to ``need`` occurrences from the SA rows [lo, hi) of a pattern
    of ``length`` tokens to out_pos / out_len (from index ``count``).

    Rows whose position p has ``tokens[p-1] == prev_tok`` are skipped (they
    extend to a longer match already taken); prev_tok < 0 skips none.
    ``n_exact`` is the number of rows not skipped.  If it is at most ``need``
    all of them are taken, in SA order; otherwise ``need`` rows are taken at
    evenly spaced ranks of the interval (row lo + (2i+1)*size/(2*need), moved
    forward past skipped or already taken rows).  The SA orders an interval by
    what follows the pattern, so equal continuations form runs and evenly
    spaced samples represent each continuation about in proportion to how
    often it occurs.  Returns the new count.
    """
    size = hi - lo
    if n_exact <= need:
        r = lo
        while r < hi and need > 0:
            p = np.int64(sa[r])
            if prev_tok < 0 or p == 0 or tokens[p - 1] != prev_tok:
                out_pos[count] = p + length - 1
                out_len[count] = length
                count += 1
                need -= 1
            r += 1
        return count
    nxt = lo
    for i in range(need):
        r = lo + ((2 * i + 1) * size) // (2 * need)
        if r < nxt:
            r = nxt
        while r < hi:
            p = np.int64(sa[r])
            if prev_tok < 0 or p == 0 or tokens[p - 1] != prev_tok:
                break
            r += 1
        if r >= hi:
            break
        out_pos[count] = p + length - 1
        out_len[count] = length
        count += 1
        nxt = r + 1
    return count


@njit(cache=True)
def sa_find_matches(tokens, sa, sa_depth, ctx, n, min_len, max_len, max_matches,
                    out_pos, out_len):
    """Find occurrences of the end of the context in a compiled corpus.

    Parameters
    ----------
    tokens : int32 [N]      the corpus tokens, documents separated by -1.
    sa : int32 [N - n_docs] its suffix array, sorted on at most ``sa_depth``
                            tokens (module comment above).
    sa_depth : int          the depth ``sa`` is sorted on.
    ctx : int32 [>= n]      the context; only ``ctx[:n]`` is read.
    n : int                 number of valid context tokens (clamped to len(ctx)).
    min_len : int           shortest match kept (values < 1 act as 1).
    max_len : int           longest match looked for; also capped by sa_depth
                            and n (and by a negative context token, which never
                            matches).
    max_matches : int       keep at most this many occurrences (clamped to the
                            output capacity).
    out_pos : int32 [>= max_matches]  END position of each kept occurrence: the
                            corpus index of the match's last token, so its
                            continuation starts at out_pos + 1 (which may be a
                            separator: the document ended there).
    out_len : int32 [>= max_matches]  its match length L.

    First the longest L in [min_len, cap] such that ctx[n-L:n] occurs is found
    by binary search over L (if ctx[n-L:n] occurs so does every shorter suffix
    of it), each probe a binary search on ``sa``.  Then up to max_matches
    occurrences of that length are written (evenly spaced over its SA interval
    when there are more: see ``_sa_take``; this favours the most common
    continuations at no extra cost).  If there are fewer, the output is filled
    with occurrences of the next shorter lengths L-1, L-2, ... (at most
    SA_FILL_LENGTHS of them, none below min_len), each occurrence once with its
    exact match length: an occurrence of ctx[n-L':n] that is preceded by
    ctx[n-L'-1] belongs to a longer length and has been written already
    (filling only happens once every occurrence of the longer lengths is in).

    Returns the count k written.  Output order: L descending; within a length,
    SA order, i.e. by continuation.

    Cost: about log2(cap) + 2 binary searches of log2(N) steps each (each step
    one or two cache misses on a big corpus), two more per fill length, plus
    the written occurrences.
    """
    if n > ctx.shape[0]:
        n = ctx.shape[0]
    max_matches = min(max_matches, out_pos.shape[0], out_len.shape[0])
    if min_len < 1:
        min_len = 1
    cap = min(max_len, sa_depth, n)
    j = 0
    while j < cap and ctx[n - 1 - j] >= 0:
        j += 1
    cap = j
    n_sa = sa.shape[0]
    if max_matches < 1 or min_len > cap or n_sa == 0:
        return 0

    # Longest matching length: lo_len is known to occur (at row best_row).
    best_row = _sa_lower(tokens, sa, 0, n_sa, ctx, n - min_len, min_len)
    if best_row >= n_sa or _sa_cmp(tokens, np.int64(sa[best_row]), ctx, n - min_len, min_len) != 0:
        return 0
    lo_len = min_len
    hi_len = cap
    while lo_len < hi_len:
        mid = (lo_len + hi_len + 1) >> 1
        r = _sa_lower(tokens, sa, 0, n_sa, ctx, n - mid, mid)
        if r < n_sa and _sa_cmp(tokens, np.int64(sa[r]), ctx, n - mid, mid) == 0:
            lo_len = mid
            best_row = r
        else:
            hi_len = mid - 1
    length = lo_len

    end_row = _sa_upper(tokens, sa, best_row, n_sa, ctx, n - length, length)
    size = end_row - best_row
    count = _sa_take(tokens, sa, best_row, end_row, length, -1, size, max_matches,
                     out_pos, out_len, 0)

    short = length - 1
    stop = max(min_len, length - SA_FILL_LENGTHS)
    while count < max_matches and short >= stop:
        r0 = _sa_lower(tokens, sa, 0, n_sa, ctx, n - short, short)
        r1 = _sa_upper(tokens, sa, r0, n_sa, ctx, n - short, short)
        count = _sa_take(tokens, sa, r0, r1, short, np.int64(ctx[n - short - 1]),
                         (r1 - r0) - size, max_matches - count, out_pos, out_len, count)
        size = r1 - r0
        short -= 1
    return count


# --------------------------------------------------------------------------
# Merging two proposals.

@njit(cache=True)
def merge_trees(a_tokens, a_parents, a_probs, a_source, ma,
                b_tokens, b_parents, b_probs, b_source, mb, max_nodes,
                out_tokens, out_parents, out_probs, out_source):
    """Merge proposal B into proposal A as one trie.

    A and B are draft trees in the DraftTree layout (parents[i] < i, -1 = child
    of the root, distinct sibling tokens), of ``ma`` and ``mb`` nodes.  A has
    priority (the drafter passes the context tree as A, a corpus tree as B):

    * a node both propose (same token path) keeps A's source and the larger
      of the two probabilities;
    * a node only B proposes, whose parent is in A, gets B's probability
      times ``max(0, 1 - s)``, s being the sum of the probabilities of A's
      children of that parent: B's branches share the mass A leaves over;
      deeper in a B-only branch B's own conditional probabilities stand;
    * siblings whose probabilities then sum to more than 1 (possible only
      through the "larger of the two" rule) are scaled down to sum to 1.

    Output: at most ``max_nodes`` nodes (clamped to the output capacity) in
    decreasing order of cumulative probability (the product of probs from the
    root), ties by creation order (A's nodes in A's order, then B's new ones in
    B's order).  A child's cumulative probability never exceeds its parent's
    (probs are <= 1) and is created after it, so parents precede children and
    any prefix is a valid tree.  With mb = 0 the output is A itself when A is
    in that order (as build_continuation_tree emits it).  Returns the count.
    """
    ma = min(ma, a_tokens.shape[0], a_parents.shape[0], a_probs.shape[0], a_source.shape[0])
    mb = min(mb, b_tokens.shape[0], b_parents.shape[0], b_probs.shape[0], b_source.shape[0])
    max_nodes = min(max_nodes, out_tokens.shape[0], out_parents.shape[0],
                    out_probs.shape[0], out_source.shape[0])
    if ma < 0:
        ma = 0
    if mb < 0:
        mb = 0
    cap = ma + mb
    if cap == 0 or max_nodes <= 0:
        return 0

    tok = np.empty(cap, np.int64)
    par = np.empty(cap, np.int64)
    p = np.empty(cap, np.float64)
    src = np.empty(cap, np.int8)
    first_child = np.full(cap, -1, np.int64)
    next_sib = np.empty(cap, np.int64)
    a_sum = np.zeros(cap, np.float64)   # sum of A's children's probs per node
    root_first = -1
    root_a_sum = 0.0

    for i in range(ma):
        pi = np.int64(a_parents[i])
        tok[i] = a_tokens[i]
        par[i] = pi
        p[i] = a_probs[i]
        src[i] = a_source[i]
        if pi < 0:
            next_sib[i] = root_first
            root_first = i
            root_a_sum += p[i]
        else:
            next_sib[i] = first_child[pi]
            first_child[pi] = i
            a_sum[pi] += p[i]

    m = ma
    b_map = np.empty(max(mb, 1), np.int64)
    for j in range(mb):
        bp = np.int64(b_parents[j])
        node = np.int64(-1) if bp < 0 else b_map[bp]
        t = np.int64(b_tokens[j])
        c = root_first if node < 0 else first_child[node]
        while c >= 0 and tok[c] != t:
            c = next_sib[c]
        q = np.float64(b_probs[j])
        if c >= 0:
            # B's siblings are distinct, so c is one of A's nodes.
            if q > p[c]:
                p[c] = q
        else:
            c = m
            m += 1
            left = 1.0 - (root_a_sum if node < 0 else a_sum[node])
            if left < 0.0:
                left = 0.0
            tok[c] = t
            par[c] = node
            p[c] = q * left
            src[c] = b_source[j]
            if node < 0:
                next_sib[c] = root_first
                root_first = c
            else:
                next_sib[c] = first_child[node]
                first_child[node] = c
        b_map[j] = c

    cap_sibling_mass(par, p, m, np.zeros(m + 1, np.float64))

    return _emit_by_path_prob(tok, par, p, src, m, max_nodes, out_tokens, out_parents, out_probs, out_source)


def warmup() -> None:
    """Compile (or load from the cache) the kernels for the dtypes the drafter
    uses: int32 tokens/ends/lens/parents/mlen, float32 probs, int8 sources,
    Python ints for the scalar arguments, and corpus arrays both writable and
    read-only (a corpus loaded from disk is a read-only memmap)."""
    tokens = np.array([1, 2, 3, 1, 2, 4, 1, 2], dtype=np.int32)
    ends = np.zeros(4, np.int32)
    lens = np.zeros(4, np.int32)
    k = find_suffix_matches(tokens, len(tokens), 1, 8, 4, ends, lens)
    out_tokens = np.zeros(8, np.int32)
    out_parents = np.zeros(8, np.int32)
    out_probs = np.zeros(8, np.float32)
    out_mlen = np.zeros(8, np.int32)
    m = build_continuation_tree(tokens, len(tokens), ends, lens, k, 4, 8,
                                out_tokens, out_parents, out_probs, out_mlen)
    source = np.zeros(8, np.int8)
    merged = (np.zeros(16, np.int32), np.zeros(16, np.int32), np.zeros(16, np.float32),
              np.zeros(16, np.int8))
    merge_trees(out_tokens, out_parents, out_probs, source, m,
                out_tokens, out_parents, out_probs, source, m, 16, *merged)
    corpus = np.array([1, 2, 4, -1, 1, 2, 3, -1], dtype=np.int32)
    sa = np.array([4, 0, 5, 1, 6, 2], dtype=np.int32)
    for writable in (True, False):
        c_tok = corpus.copy()
        c_sa = sa.copy()
        c_tok.setflags(write=writable)
        c_sa.setflags(write=writable)
        k = sa_find_matches(c_tok, c_sa, 32, tokens, len(tokens), 1, 8, 4, ends, lens)
        build_continuation_tree(c_tok, len(c_tok), ends, lens, k, 4, 8,
                                out_tokens, out_parents, out_probs, out_mlen)
