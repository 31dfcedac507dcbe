"""Tree selection and batch layout kernels (numba, pure functions over arrays)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit


class PlanScratch(NamedTuple):
    """The arrays plan_step writes (the engine allocates them once and reuses them).

    Per draft node of the proposal (length >= the tree's node count):
      cond float64: calibrated P(accepted | parent accepted)
      q float64:    path probability (the product of cond from the root)
    Per selected node (length >= max_nodes):
      sel int64:    chosen node indices, ascending
      spar int32:   their parents, re-indexed into the selection (-1: the root)
    Per batch slot (length >= max_nodes + 1; see layout_preorder):
      order int64, bparent int64, depth int32, leaf_first int32, leaf_count int32
    """
    cond: np.ndarray
    q: np.ndarray
    sel: np.ndarray
    spar: np.ndarray
    order: np.ndarray
    bparent: np.ndarray
    depth: np.ndarray
    leaf_first: np.ndarray
    leaf_count: np.ndarray

    @classmethod
    def zeros(cls, n_nodes: int, n_slots: int) -> PlanScratch:
        return cls(np.zeros(n_nodes), np.zeros(n_nodes), np.zeros(n_slots, np.int64),
                   np.zeros(n_slots, np.int32), np.zeros(n_slots, np.int64), np.zeros(n_slots, np.int64),
                   np.zeros(n_slots, np.int32), np.zeros(n_slots, np.int32), np.zeros(n_slots, np.int32))


@njit(cache=True)
def cap_sibling_mass(par, p, m, sums):
    """Scale down, in place, the probabilities p[:m] of every set of siblings
    that sums to more than 1 (par[i] = -1: a child of the root; sums: float64
    scratch of at least m + 1), so that each node's children stay a
    distribution."""
    for j in range(m + 1):
        sums[j] = 0.0
    for i in range(m):
        sums[par[i] + 1] += p[i]
    for i in range(m):
        s = sums[par[i] + 1]
        if s > 1.0:
            p[i] = p[i] / s


@njit(cache=True)
def select_by_rate(parents, q, cost, overhead, max_nodes, out_sel):
    """Choose how many draft nodes to verify this step.

    cost[T] is the relative time of decoding T tokens in one batch (cost[1] = 1,
    cost[0] unused); overhead is the per-step time outside llama_decode in the
    same unit.  Verifying the root plus the set S of draft nodes yields on
    average 1 + sum(q[S]) tokens (the bonus token is always gained) for
    cost[1 + |S|] + overhead.  For a fixed size the best S is the |S| nodes of
    largest q: q never grows from parent to child (cond <= 1), so with ties
    broken by index (parents come first) the top-k set is closed under
    ancestors, i.e. a valid subtree.  Returns the chosen count k (0 means: do a
    plain step) and writes the chosen node indices, best first, to out_sel.
    """
    m = parents.shape[0]
    order = np.argsort(-q, kind="mergesort")  # stable: ties keep index order
    best_k = 0
    best_rate = 1.0 / (cost[1] + overhead)
    gain = 1.0
    lim = min(m, max_nodes - 1, cost.shape[0] - 2)
    for k in range(1, lim + 1):
        gain += q[order[k - 1]]
        rate = gain / (cost[k + 1] + overhead)
        if rate > best_rate:
            best_rate = rate
            best_k = k
    for k in range(best_k):
        out_sel[k] = order[k]
    return best_k


@njit(cache=True)
def layout_preorder(parents, q, out_order, out_bparent, out_depth, out_leaf_first, out_leaf_count):
    """Lay a tree out for one llama.cpp batch, depth first, likeliest child first.

    Input: m draft nodes with parents[i] < i (-1: child of the root) and their
    path probabilities q.  Output over m+1 batch slots, slot 0 being the root:
      out_order[s]      draft node index in slot s (out_order[0] = -1, the root)
      out_bparent[s]    slot of the parent (-1 for the root)
      out_depth[s]      depth (root 0)
      out_leaf_first[s], out_leaf_count[s]: the leaves below slot s are leaves
                        number leaf_first .. leaf_first+leaf_count-1, numbered
                        in preorder; leaf j gets KV sequence j, so the leftmost
                        path is sequence 0.
    Returns the number of leaves.

    Invariant the engine relies on: slots 0..d of the leftmost path are exactly
    the chain root -> likeliest child -> its likeliest child ..., so if the
    accepted path follows first children its KV cells are the batch's first cells.
    In preorder every subtree occupies a contiguous run of slots, hence its
    leaves form a contiguous run of leaf numbers.
    """
    m = parents.shape[0]
    n = m + 1
    # children lists in CSR form, over "ids" where root = 0 and node i = i + 1
    cnt = np.zeros(n + 1, np.int64)
    for i in range(m):
        cnt[parents[i] + 2] += 1
    for i in range(n):
        cnt[i + 1] += cnt[i]
    child = np.empty(max(m, 1), np.int64)
    fill = cnt[:n].copy()
    for i in range(m):
        pid = parents[i] + 1
        child[fill[pid]] = i + 1
        fill[pid] += 1
    # sort each child list by q descending (insertion sort: lists are short)
    for v in range(n):
        a, b = cnt[v], cnt[v + 1]
        for x in range(a + 1, b):
            c = child[x]
            y = x - 1
            while y >= a and q[child[y] - 1] < q[c - 1]:
                child[y + 1] = child[y]
                y -= 1
            child[y + 1] = c
    # iterative preorder DFS
    stack = np.empty(n, np.int64)
    slot_of = np.empty(n, np.int64)
    sp = 0
    stack[0] = 0
    sp = 1
    s = 0
    out_depth[0] = 0
    while sp > 0:
        sp -= 1
        v = stack[sp]
        slot_of[v] = s
        out_order[s] = v - 1
        if v == 0:
            out_bparent[s] = -1
            out_depth[s] = 0
        else:
            ps = slot_of[parents[v - 1] + 1]
            out_bparent[s] = ps
            out_depth[s] = out_depth[ps] + 1
        s += 1
        # push children in reverse so the likeliest is popped first
        for x in range(cnt[v + 1] - 1, cnt[v] - 1, -1):
            stack[sp] = child[x]
            sp += 1
    # leaves: a slot is a leaf if no slot has it as parent
    is_leaf = np.ones(n, np.bool_)
    for t in range(1, n):
        is_leaf[out_bparent[t]] = False
    nl = 0
    for t in range(n):
        out_leaf_first[t] = nl
        if is_leaf[t]:
            nl += 1
    # leaf_count by reverse preorder accumulation
    for t in range(n):
        out_leaf_count[t] = 1 if is_leaf[t] else 0
    for t in range(n - 1, 0, -1):
        out_leaf_count[out_bparent[t]] += out_leaf_count[t]
    return nl


def warmup() -> None:
    parents = np.array([-1, 0, -1], np.int32)
    cond = np.array([0.9, 0.5, 0.3], np.float32)
    q = np.array([0.9, 0.45, 0.3], np.float64)
    cost = np.array([0.0, 1.0, 1.8, 2.9, 4.0], np.float64)
    sel = np.zeros(3, np.int64)
    select_by_rate(parents, q, cost, 0.01, 8, sel)
    o = np.zeros(4, np.int64); bp = np.zeros(4, np.int64); d = np.zeros(4, np.int32)
    lf = np.zeros(4, np.int32); lc = np.zeros(4, np.int32)
    layout_preorder(parents, q, o, bp, d, lf, lc)
    n_c = np.zeros((5, 10)); n_f = np.zeros((5, 10, 4))
    counts = (n_c, n_c.copy(), n_f, n_f.copy())
    src = np.zeros(3, np.int8)
    out = PlanScratch.zeros(3, 4)
    for gate in (True, False):
        plan_step(parents, cond, src, counts, 4.0, 8.0, cost, 0.01, 4, gate, tuple(out))   # the engine's types
    learn_step(4, out.bparent, out.order, out.sel, cond, src, out.cond, out.depth, 1, -1, n_c, n_c.copy(), n_f,
               n_f.copy(), n_c.copy(), np.zeros(3, np.bool_), np.zeros(3, np.bool_))
    shadow_learn(np.zeros(3, np.int32), parents, cond, src, out.cond, np.zeros(3, np.bool_), np.zeros(3, np.int8),
                 np.zeros(2, np.int32), n_c, n_c.copy(), n_f, n_f.copy(), n_c.copy())


@njit(cache=True)
def plan_step(parents, probs, source, counts, k0, k1, cost, overhead, lim, gate, out):
    """One step's gate and layout in a single call (see select_by_rate and
    layout_preorder for the rules).

    The tree: parents, probs (the drafter's scores) and source per draft node.
    counts: the acceptance counts (n_c, a_c, n_f, a_f) of AcceptanceModel,
    tested and accepted nodes per source x score bucket (coarse) and per
    source x score bucket x depth bucket (fine); k0, k1 their prior weights.
    cost, overhead: the cost table and per-step overhead of select_by_rate;
    lim: the most batch slots; gate: False takes the lim-1 likeliest nodes.
    out: a PlanScratch, written here, or the same arrays as a plain tuple
    (numba's dispatch takes about 10 us longer for a NamedTuple than for a
    plain tuple of arrays: the engine keeps a plain one).

    Calibrates each draft node's score into P(accepted | parent accepted)
    (estimate = (accepted + k * prior) / (tested + k), the prior being the
    drafter's score times its source's accepted/score ratio for the coarse
    level and the coarse estimate for the fine one), multiplies along paths,
    picks the subtree to verify (gate: best expected tokens per unit of cost),
    and lays it out.  Returns (k, n_leaves): k = 0 means a plain one-token
    step.  out.sel[:k] are the chosen node indices (ascending), out.spar their
    parents re-indexed into the selection; the layout arrays cover k+1 slots,
    with out.order[s] an index into the selection.
    """
    n_c, a_c, n_f, a_f = counts
    out_cond, out_q, out_sel, out_spar, out_order, out_bparent, out_depth, out_leaf_first, out_leaf_count = out
    m = parents.shape[0]
    nsb = n_c.shape[1]
    ndb = n_f.shape[2]
    # source level: how the source's scores fared over all its tested nodes
    # (accepted / score mass, the score of a bucket taken at its centre), so a
    # source whose scores run high is discounted in buckets it has rarely been
    # tested in; k0 pseudo-nodes keep the factor at 1 until evidence comes in
    nsrc = n_c.shape[0]
    factor = np.ones(nsrc)
    for s in range(nsrc):
        acc = 0.0
        mass = 0.0
        for b in range(nsb):
            acc += a_c[s, b]
            mass += n_c[s, b] * 0.5 * (SCORE_EDGES[b] + SCORE_EDGES[b + 1])
        factor[s] = (acc + k0) / (mass + k0)
    depth = np.empty(m, np.int64)
    for i in range(m):
        p = parents[i]
        depth[i] = 1 if p < 0 else depth[p] + 1
        sc = probs[i]
        sb = score_bucket(sc)
        db = min(depth[i] - 1, ndb - 1)
        s = source[i]
        prior = min(sc * factor[s], 0.999)
        coarse = (a_c[s, sb] + k0 * prior) / (n_c[s, sb] + k0)
        fine = (a_f[s, sb, db] + k1 * coarse) / (n_f[s, sb, db] + k1)
        fine = min(max(fine, 0.0), 0.999)
        out_cond[i] = fine
        out_q[i] = fine if p < 0 else out_q[p] * fine
    if m == 0 or lim < 2:
        return 0, 1
    if gate:
        k = select_by_rate(parents, out_q[:m], cost, overhead, lim, out_sel)
    else:
        k = min(m, lim - 1)
        order = np.argsort(-out_q[:m], kind="mergesort")
        for j in range(k):
            out_sel[j] = order[j]
    if k == 0:
        return 0, 1
    sel = np.sort(out_sel[:k])
    remap = np.full(m, -1, np.int64)
    for j in range(k):
        out_sel[j] = sel[j]
        remap[sel[j]] = j
    qs = np.empty(k, np.float64)
    for j in range(k):
        p = parents[sel[j]]
        out_spar[j] = -1 if p < 0 else remap[p]
        qs[j] = out_q[sel[j]]
    nl = layout_preorder(out_spar[:k], qs, out_order, out_bparent, out_depth, out_leaf_first, out_leaf_count)
    return k, nl


# Edges of the acceptance model's score buckets: tenths up to 0.9, then
# halving 1 - score, so a copy that has gone on for 40 tokens and one that
# has gone on for 160 (the suffix drafter scores them 0.95 and 0.99) are
# calibrated apart: only near-certain chains pay for a deep batch.
SCORE_EDGES = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9,
                        0.95, 0.975, 0.9875, 0.99375, 1.0])
N_SCORE_BUCKETS = SCORE_EDGES.shape[0] - 1


@njit(cache=True)
def score_bucket(sc):
    """The score bucket of a drafter score (SCORE_EDGES; out-of-range scores
    fall in the first or last)."""
    b = 0
    while b < N_SCORE_BUCKETS - 1 and sc >= SCORE_EDGES[b + 1]:
        b += 1
    return b


@njit(cache=True)
def shadow_learn(tokens, parents, probs, source, cond, verified, state, cont, n_c, a_c, n_f, a_f, pred_sum):
    """Credit the acceptance counts with the draft nodes the gate did not verify,
    judged against the tokens committed after the proposal's root (cont).

    The model's committed continuation is what verification would have found
    (a node is accepted exactly when it carries the committed token at its
    depth and its parent was), so every proposed node is evidence, not only the
    nodes the gate let through: the estimates do not depend on which drafts the
    gate happened to try.  state[i] is 0 (not yet decided: cont is shorter than
    its depth), 1 (matched) or 2 (not matched, or its parent was not); it is
    kept between calls as cont grows.  Verified nodes (verified[i]) were
    counted by learn_step and are only followed here.  Returns how many nodes
    are still undecided."""
    ndb = n_f.shape[2]
    m = tokens.shape[0]
    depth = np.empty(m, np.int64)
    pending = 0
    for i in range(m):
        p = parents[i]
        depth[i] = 1 if p < 0 else depth[p] + 1
        if state[i] != 0:
            continue
        if p >= 0 and state[p] != 1:
            if state[p] == 2:
                state[i] = 2
            else:
                pending += 1
            continue
        d = depth[i]
        if d > cont.shape[0]:
            pending += 1
            continue
        hit = tokens[i] == cont[d - 1]
        state[i] = 1 if hit else 2
        if verified[i]:
            continue
        sb = score_bucket(probs[i])
        db = min(d - 1, ndb - 1)
        src = source[i]
        n_c[src, sb] += 1.0
        n_f[src, sb, db] += 1.0
        pred_sum[src, sb] += cond[i]
        if hit:
            a_c[src, sb] += 1.0
            a_f[src, sb, db] += 1.0
    return pending


@njit(cache=True)
def learn_step(nb, bparent, order, sel, probs, source, cond, depth, path_end, carry_slot,
               n_c, a_c, n_f, a_f, pred_sum, out_acc, out_tested):
    """Update the acceptance counts after a verification step.

    depth[s] is slot s's depth (the layout's out_depth).  Slots 0..path_end are
    the committed chain; carry_slot (or -1) is the accepted
    child that sat after a rejected sibling.  A draft slot was *tested* when its
    parent slot was on the accepted path, and *accepted* when it is on it.
    out_acc / out_tested are indexed by selection position (order[s])."""
    ndb = n_f.shape[2]
    on = np.zeros(nb, np.bool_)
    for s in range(path_end + 1):
        on[s] = True
    if carry_slot >= 0:
        on[carry_slot] = True
    for s in range(1, nb):
        j = order[s]
        i = sel[j]
        tested = on[bparent[s]]
        acc = on[s]
        out_acc[j] = acc
        out_tested[j] = tested
        if not tested:
            continue
        sb = score_bucket(probs[i])
        db = min(depth[s] - 1, ndb - 1)
        src = source[i]
        n_c[src, sb] += 1.0
        n_f[src, sb, db] += 1.0
        pred_sum[src, sb] += cond[i]
        if acc:
            a_c[src, sb] += 1.0
            a_f[src, sb, db] += 1.0
