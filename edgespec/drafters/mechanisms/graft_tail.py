"""The `auto` drafter's `graft_tail` mechanism: retrieval continued from the best drafted leaves.

edgespec's variant (Graft's TAIL strawman rather than Graft).  Retrieval alone
anchors at the root.  A confident tri-gram, adjacency, branch or semantic leaf
is a position retrieval never looked from: with its path appended to the
context, the end of that hypothetical context may occur earlier, and what
followed there is grafted under the leaf (source context).  The slots come from
the tail of the merged proposal (its least probable nodes, pruned), at most
GRAFT_RESERVE of the budget; the engine's gate then judges grafted nodes like
any other.

One concern: choosing the graft points, the suffix search from them, and
splicing the grafts into the proposal.
"""
from __future__ import annotations

import numpy as np

from edgespec.drafters.tree import N_SOURCES, SOURCE_CONTEXT, sources_with
from edgespec.kernels import anchor as _ak
from edgespec.kernels import suffix as _sk

GRAFT_RESERVE = 8                   # graft_tail: at most 8 slots of a proposal go to grafts
GRAFT_POINTS = 2                    # from the 2 most probable drafted leaves
GRAFT_MIN_CUM = 0.05                # whose path is at least this likely
GRAFT_DEPTH = 4


class TailGraft:
    """Scratch buffers for proposals of up to ``max_nodes`` nodes."""

    def __init__(self, max_nodes: int):
        self._g_ends = np.zeros(4, np.int32)
        self._g_lens = np.zeros(4, np.int32)
        self._g_buf = (np.zeros(GRAFT_RESERVE, np.int32), np.zeros(GRAFT_RESERVE, np.int32),
                       np.zeros(GRAFT_RESERVE, np.float32), np.zeros(GRAFT_RESERVE, np.int32))
        self._g_cum = np.zeros(max_nodes, np.float64)
        self._g_leaf = np.zeros(max_nodes, np.bool_)
        # the leaves retrieval continues from: those of the model-free guesses
        self._from = np.isin(np.arange(N_SOURCES), sources_with("guess"))

    @staticmethod
    def warmup() -> None:
        _ak.warmup()

    def graft(self, context, tok, par, pr, src, budget):
        """The merged proposal (tok, par, pr, src) with retrieval grafted under
        its best drafted leaves, in at most `budget` nodes; unchanged when
        nothing can be grafted."""
        m = len(tok)
        reserve = min(GRAFT_RESERVE, budget // 4)
        lim = min(m, budget - reserve)
        if reserve <= 0 or lim <= 0:
            return tok, par, pr, src
        drafted = self._from[src[:lim]]
        if not drafted.any():                           # retrieval alone: nothing to graft under
            return tok, par, pr, src
        cum, leaf = self._g_cum[:m], self._g_leaf[:m]
        _ak.path_probs(par, pr, m, cum, leaf)
        ok = leaf[:lim] & drafted & (cum[:lim] >= GRAFT_MIN_CUM)
        cand = np.flatnonzero(ok)
        if len(cand) == 0:
            return tok, par, pr, src
        points = cand[np.argsort(-cum[cand], kind="stable")[:GRAFT_POINTS]]
        grafts, room = self._retrieve(context, tok, par, points, reserve)
        if not grafts:
            return tok, par, pr, src
        return _splice(tok, par, pr, src, grafts, reserve - room, budget)

    def _retrieve(self, context, tok, par, points, reserve):
        """Per graft point, the continuation tree retrieved after its path:
        [(point, tokens, parents, probs)] in at most `reserve` nodes, and the room left."""
        ctx = np.ascontiguousarray(context, dtype=np.int32)
        grafts = []
        room = reserve
        for i in points:
            path = []
            q = i
            while q >= 0:
                path.append(tok[q])
                q = par[q]
            ext = np.concatenate([ctx, np.array(path[::-1], np.int32)])
            k = _sk.find_suffix_matches(ext, len(ext), 2, 32, 4, self._g_ends, self._g_lens)
            if k == 0:
                continue
            g = self._g_buf
            mc = _sk.build_continuation_tree(ext, len(ext), self._g_ends, self._g_lens, k, GRAFT_DEPTH,
                                             room, g[0], g[1], g[2], g[3])
            if mc:
                grafts.append((i, g[0][:mc].copy(), g[1][:mc].copy(), g[2][:mc].copy()))
                room -= mc
            if room <= 0:
                break
        return grafts, room


def _splice(tok, par, pr, src, grafts, total, budget):
    """The proposal cut to leave `total` slots, the grafts appended under their points."""
    m = len(tok)
    keep = min(m, budget - total)          # every graft point is < lim <= keep
    toks, pars, probs = [tok[:keep]], [par[:keep]], [pr[:keep]]
    base = keep
    for i, gt, gp, gq in grafts:
        toks.append(gt)
        pars.append(np.where(gp < 0, i, gp + base).astype(np.int32))
        probs.append(gq)
        base += len(gt)
    srcs = np.concatenate([src[:keep], np.full(total, SOURCE_CONTEXT, np.int8)])
    return np.concatenate(toks), np.concatenate(pars), np.concatenate(probs), srcs
