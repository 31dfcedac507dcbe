"""Copy alignment with learned edits (numba, pure functions over arrays).

Where an answer is a rewritten copy of its prompt (a rename, an added
parameter, a fixed line), plain prompt lookup breaks at every edited spot and
needs a few plain steps to find the copy again.  These kernels keep the
answer aligned to the prompt: they walk the answer once (incrementally, as it
grows), follow the prompt token by token, and at a divergence look for the
smallest pair of gaps (old tokens skipped, new tokens written) after which the
two agree again on `anchor` tokens.  Each such pair with old tokens is
recorded as an edit (old span -> new span, both as positions in the context).
A later divergence where a recorded edit fits is crossed at once, and the
draft chain from the aligned prompt position applies the edits whose old span
it meets: after the answer renamed `C` to `Server` once, the copy proposes
`Server` wherever the prompt has `C`.

State (int64[4]): next answer position to align, its prompt position (-1:
lost), the number of edits recorded, and where the current aligned run began
(after the last divergence).
Edits: int64[E, 6] rows (old start, old length, new start, new length,
hits, misses): hits counts the times the answer made the edit (its recording
included), misses the times it copied the old span unchanged; the draft's
score for an edited token is discounted by (hits + 1) / (hits + misses + 2).
"""
from __future__ import annotations

import numpy as np
from numba import njit

STATE_SIZE = 4
EDIT_COLS = 6


@njit(cache=True)
def _same(ctx, a, b, m):
    for j in range(m):
        if ctx[a + j] != ctx[b + j]:
            return False
    return True


@njit(cache=True)
def _relocate(ctx, n, n_prompt, i, anchor):
    """The prompt position whose tokens agree longest with the answer from i
    (at least `anchor` of them; ties: the later position), or -1."""
    best, best_len = -1, anchor - 1
    if i + anchor > n:
        return -1
    for p in range(n_prompt - anchor + 1):
        L = 0
        while p + L < n_prompt and i + L < n and ctx[p + L] == ctx[i + L]:
            L += 1
        if L >= best_len and L >= anchor:
            best, best_len = p, L
    return best


@njit(cache=True)
def _known_edit(ctx, n, n_prompt, i, s, edits, ne):
    """The latest recorded edit whose old span starts at prompt position s and
    whose new span the answer wrote at i, or -1."""
    for e in range(ne - 1, -1, -1):
        os_, ol, ns, nl = edits[e, 0], edits[e, 1], edits[e, 2], edits[e, 3]
        if s + ol <= n_prompt and i + nl <= n and _same(ctx, os_, s, ol) and _same(ctx, ns, i, nl):
            return e
    return -1


@njit(cache=True)
def _count_misses(ctx, n, n_prompt, i, s, edits, ne):
    """The answer at i copies the prompt at s: every recorded edit whose old
    span starts there and which the answer leaves out (it copies the whole old
    span, which differs from the new) counts a miss."""
    for e in range(ne):
        os_, ol, ns, nl = edits[e, 0], edits[e, 1], edits[e, 2], edits[e, 3]
        if ctx[os_] != ctx[s] or s + ol > n_prompt or i + ol > n:
            continue
        if _same(ctx, os_, s, ol) and _same(ctx, s, i, ol) and not (nl == ol and _same(ctx, ns, os_, ol)):
            edits[e, 5] += 1


@njit(cache=True)
def _trust(edits, e):
    return (edits[e, 4] + 1.0) / (edits[e, 4] + edits[e, 5] + 2.0)


@njit(cache=True)
def align(ctx, n, n_prompt, state, edits, max_gap, anchor):
    """Advance the alignment of the answer ctx[n_prompt:n] to the prompt
    ctx[:n_prompt] (see the module doc).  Stops early at a divergence that the
    answer is still too short to resolve; the next call resumes there."""
    i, s, ne, run = state[0], state[1], state[2], state[3]
    if i < n_prompt:
        i, s, ne, run = n_prompt, -1, 0, n_prompt
    cap = edits.shape[0]
    while i < n:
        if s < 0:
            s = _relocate(ctx, n, n_prompt, i, anchor)
            if s < 0:
                if i + anchor > n:
                    break
                i += 1
                continue
            run = i
        if s < n_prompt and ctx[s] == ctx[i]:
            _count_misses(ctx, n, n_prompt, i, s, edits, ne)
            i += 1
            s += 1
            continue
        if s >= n_prompt:
            s = -1
            continue
        e = _known_edit(ctx, n, n_prompt, i, s, edits, ne)
        if e >= 0:
            edits[e, 4] += 1
            s += edits[e, 1]
            i += edits[e, 3]
            run = i
            continue
        found = False
        waiting = False
        for tot in range(1, 2 * max_gap + 1):
            for di in range(max(0, tot - max_gap), min(tot, max_gap) + 1):
                ds = tot - di
                if s + ds + anchor > n_prompt:
                    continue
                if i + di + anchor > n:
                    waiting = True
                    continue
                if _same(ctx, s + ds, i + di, anchor):
                    if ds > 0 and ne < cap:
                        edits[ne, 0], edits[ne, 1], edits[ne, 2], edits[ne, 3] = s, ds, i, di
                        edits[ne, 4], edits[ne, 5] = 1, 0
                        ne += 1
                    s += ds
                    i += di
                    run = i
                    found = True
                    break
            if found:
                break
        if found:
            continue
        if waiting:
            break
        s = -1
        i += 1
    state[0], state[1], state[2], state[3] = i, s, ne, run
    return ne


@njit(cache=True)
def edited_chain(ctx, n, n_prompt, state, edits, max_depth, min_trust, out_tokens, out_probs):
    """The draft chain from the aligned prompt position, with the recorded
    edits whose trust is at least min_trust applied where their old span
    starts (the latest edit first).
    Scores: conf(L) = L / (L + 2), L the aligned run since the last divergence
    plus the depth, as for a suffix match (so where the chain is a plain copy
    its scores stay at or below the suffix match's, which the merge keeps);
    an edited span's first token's times its edit's trust.
    Returns (the chain's length, how many edits it applied, the index of its
    first edited token); (0, 0, 0) when the answer is not aligned up to its
    end."""
    i, s, ne, run = state[0], state[1], state[2], state[3]
    if i != n or s < 0:
        return 0, 0, 0
    m = 0
    first = -1
    applied = 0
    lim = min(max_depth, out_tokens.shape[0], out_probs.shape[0])
    while m < lim and s < n_prompt:
        e = -1
        for k in range(ne - 1, -1, -1):
            ol = edits[k, 1]
            if _trust(edits, k) >= min_trust and s + ol <= n_prompt and _same(ctx, edits[k, 0], s, ol):
                e = k
                break
        if e >= 0:
            ns, nl = edits[e, 2], edits[e, 3]
            if first < 0:
                first = m
            for j in range(nl):
                if m >= lim:
                    break
                out_tokens[m] = ctx[ns + j]
                out_probs[m] = _trust(edits, e) if j == 0 else 1.0     # times conf below
                m += 1
            s += edits[e, 1]
            applied += 1
        else:
            out_tokens[m] = ctx[s]
            out_probs[m] = 1.0
            m += 1
            s += 1
    base = n - run
    for j in range(m):
        L = float(base + j + 1)
        out_probs[j] *= L / (L + 2.0)
    return m, applied, first if first >= 0 else m


def warmup() -> None:
    """Compile (or load from the cache) for the drafter's dtypes."""
    ctx = np.array([1, 2, 3, 4, 5, 6, 1, 9, 3, 4, 5], np.int32)
    state = np.zeros(STATE_SIZE, np.int64)
    edits = np.zeros((4, EDIT_COLS), np.int64)
    align(ctx, len(ctx), 6, state, edits, 4, 2)
    edited_chain(ctx, len(ctx), 6, state, edits, 8, 0.5, np.zeros(8, np.int32), np.zeros(8, np.float32))
