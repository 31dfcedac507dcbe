"""The `auto` drafter's `graft` mechanism: Graft's prune-then-graft under a fixed budget.

Graft (Shen et al., 2026, "Draft Less, Retrieve More"), as the project's
description of it has it rather than the paper's own text: calibrated
pruning checkpoints on the drafted tree's best path, a fixed budget split
between the pruned tree and a root-centred adjacency template grafted into the
freed slots.

One concern: the checkpoints' calibration, the pruning decision, and the
merge of the template into what the pruning freed.
"""
from __future__ import annotations

import numpy as np

from edgespec.kernels.suffix import merge_trees

GRAFT_CHECKPOINTS = (2, 4, 6)       # graft: pruning checkpoints (depths of the drafted tree)


class PruneGraft:
    """Per checkpoint, predicted best-path confidence and observed reach.

    ``config`` is the HybridConfig (``graft_tau`` is read at each proposal);
    ``bufs`` the hybrid's two merge scratch buffers (tokens, parents, probs,
    source), one of which receives the grafted tree."""

    def __init__(self, config, bufs):
        self.config = config
        self._buf = bufs
        self._gp_pred = np.zeros(len(GRAFT_CHECKPOINTS))
        self._gp_obs = np.zeros(len(GRAFT_CHECKPOINTS))
        self._gp_last: list[tuple[int, float]] = []     # (checkpoint, raw confidence) of the last proposal
        self.stats = np.zeros(len(GRAFT_CHECKPOINTS) + 1, np.int64)   # prunings per stage, none

    def begin(self) -> None:
        """A new request: no proposal to calibrate on."""
        self._gp_last = []

    def prune_and_graft(self, cur, template, budget):
        """The verification budget B is fixed; the drafted tree `cur`
        (tokens, parents, probs, source, m: every part but adjacency, merged)
        is pruned at the first checkpoint depth d_s (GRAFT_CHECKPOINTS) whose
        calibrated best-path confidence (the largest product of node
        probabilities down to depth d_s, times that checkpoint's
        observed/predicted reach ratio) is below graft_tau: its nodes deeper
        than d_s go, B_draft(s) = what stays and B_retr(s) = B - B_draft(s).
        The retrieval template, the adjacency table expanded from the root
        (Token Recycling's tree, best ranks first), fills exactly those B_retr
        slots, merged under the root."""
        self._gp_last = []
        if cur is None:
            if template is None:
                return None
            return (template.tokens, template.parents, template.probs, template.source, min(len(template), budget))
        tok, par, pr, src, m = cur
        depth, cum = _depth_and_cum(par, pr, m)
        keep = m
        stage = len(GRAFT_CHECKPOINTS)
        for s, d in enumerate(GRAFT_CHECKPOINTS):
            at = depth == d
            if not at.any():
                break
            conf = float(cum[at].max())
            self._gp_last.append((s, conf))
            ratio = (self._gp_obs[s] + 1.0) / (self._gp_pred[s] + 1.0)
            if conf * ratio < self.config.graft_tau:
                keep = int(np.count_nonzero(depth <= d))
                stage = s
                break
        self.stats[stage] += 1
        b_draft = min(keep, budget)
        if keep < m:        # pruned: keep the nodes down to depth d_s (parents precede children)
            sel = np.flatnonzero(depth <= GRAFT_CHECKPOINTS[stage])[:b_draft]
            tok, par, pr, src = compact(tok, par, pr, src, sel)
            m = len(sel)
        b_retr = budget - b_draft
        if template is None or b_retr <= 0:
            return (tok, par, pr, src, min(m, budget))
        out = self._buf[0] if tok is not self._buf[0][0] else self._buf[1]
        mt = min(len(template), b_retr)
        mm = merge_trees(tok, par, pr, src, m, template.tokens, template.parents, template.probs, template.source,
                         mt, b_draft + mt, out[0], out[1], out[2], out[3])
        return (out[0], out[1], out[2], out[3], mm)

    def observe(self, result) -> None:
        """Calibrate the checkpoints: at each checkpoint reached by the last
        proposal, did the step accept drafts down to that depth?"""
        if not self._gp_last:
            return
        pr = result.proposed
        n_acc = len(result.accepted) - 1
        for s, conf in self._gp_last:
            d = GRAFT_CHECKPOINTS[s]
            if len(pr) == 0:
                continue
            self._gp_pred[s] += conf
            self._gp_obs[s] += float(n_acc >= d)
        self._gp_last = []


def _depth_and_cum(par, pr, m):
    """Per node of a tree (parents first): its depth (roots 1) and its path's probability."""
    depth = np.empty(m, np.int64)
    cum = np.empty(m, np.float64)
    for i in range(m):
        q = par[i]
        depth[i] = 1 if q < 0 else depth[q] + 1
        cum[i] = pr[i] * (1.0 if q < 0 else cum[q])
    return depth, cum


def compact(tok, par, pr, src, sel):
    """The nodes `sel` (ascending, closed under parents) as a tree of their own."""
    remap = np.full(len(tok), -1, np.int64)
    remap[sel] = np.arange(len(sel))
    p = par[sel]
    newp = np.where(p < 0, -1, remap[np.maximum(p, 0)]).astype(np.int32)
    return tok[sel].copy(), newp, pr[sel].copy(), src[sel].copy()
