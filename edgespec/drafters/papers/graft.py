"""The `auto` drafter's `graft` mechanism: Graft's prune-then-graft under a fixed budget.

Graft (Shen et al., 2026, "Draft Less, Retrieve More"), sections 3.1-3.2:
the drafted tree is checked at a small set of pruning checkpoints; at a
checkpoint d_k whose confidence c_d (the highest cumulative path score among
the nodes at depth d, the score being the product of draft probabilities down
the path) is below that checkpoint's calibrated threshold tau_k, the tree is
pruned there and deeper drafting is skipped.  Thresholds are stricter at
shallow checkpoints.  The verification budget B stays fixed:
B = B_draft(s) + B_retr(s), B_draft(s) the nodes kept, and the stage-matched
prefix of a root-centred retrieval template (the adjacency table expanded
from the current token) is grafted into the B_retr(s) freed slots.

edgespec's drafted tree grows part by part (the hybrid's merge order), not
depth by depth, so "skipping deeper drafting" means: a checkpoint is decided
on the tree merged so far as soon as that tree reaches its depth, and once
one prunes, the drafted parts after it are not asked at all (the template's
part is still asked: it is the retrieval side).

Not given by the paper (its text as available stops in section 3.2): the
checkpoint depths, the thresholds' values, how they are calibrated, and the
template's exact shape.  edgespec's choices: checkpoints GRAFT_CHECKPOINTS;
base thresholds HybridConfig.graft_tau2/4/6, non-increasing with depth; each
calibrated online by scaling it with its checkpoint's predicted/observed
reach ratio (edgespec's draft scores are not the model's probabilities); the
template is the adjacency part's own (Token Recycling's) shape rather than
one fitted to the drafted tree's maximum depth and width.

One concern: the checkpoints' calibration, the pruning decision, and the
merge of the template into what the pruning freed.
"""
from __future__ import annotations

import numpy as np

from edgespec.kernels.suffix import merge_trees
from edgespec.drafters.mechanisms import Mechanism

GRAFT_CHECKPOINTS = (2, 4, 6)       # pruning checkpoints (depths of the drafted tree)
GRAFT_TAU_FIELDS = tuple(f"graft_tau{d}" for d in GRAFT_CHECKPOINTS)
"""The HybridConfig fields holding each checkpoint's base threshold, shallowest
first (HybridConfig checks that they do not rise with depth)."""


class PruneGraft(Mechanism):
    """Per checkpoint, predicted best-path confidence and observed reach.

    ``config`` is the HybridConfig (the thresholds are read at each
    proposal); ``bufs`` the hybrid's two merge scratch buffers (tokens,
    parents, probs, source), one of which receives the grafted tree.

    A proposal: ``start_step()``, then ``checkpoint(cur)`` after each drafted
    part is merged (``pruned`` tells the merge to stop asking drafted parts),
    then ``graft(cur, template, budget)``."""

    def __init__(self, config, bufs):
        self.config = config
        self.enabled = bool(config.graft)
        self._buf = bufs
        self._gp_pred = np.zeros(len(GRAFT_CHECKPOINTS))
        self._gp_obs = np.zeros(len(GRAFT_CHECKPOINTS))
        self._gp_last: list[tuple[int, float]] = []     # (checkpoint, raw confidence) of the last proposal
        self._next = 0                                  # the next undecided checkpoint of this proposal
        self.stage: int | None = None                   # the checkpoint this proposal pruned at
        self.stats = np.zeros(len(GRAFT_CHECKPOINTS) + 1, np.int64)   # prunings per stage, none

    @property
    def pruned(self) -> bool:
        """Whether this proposal's drafted tree was pruned (deeper drafting skipped)."""
        return self.stage is not None

    def begin(self, prompt=None) -> None:
        """A new request: no proposal to calibrate on."""
        self._gp_last = []

    def start_step(self) -> None:
        """A proposal starts: no checkpoint decided yet."""
        self._gp_last = []
        self._next = 0
        self.stage = None

    def thresholds(self) -> np.ndarray:
        """tau_k per checkpoint: the base threshold times the checkpoint's
        predicted/observed reach ratio (1 before any evidence)."""
        base = np.array([getattr(self.config, f) for f in GRAFT_TAU_FIELDS])
        return base * (self._gp_pred + 1.0) / (self._gp_obs + 1.0)

    def checkpoint(self, cur):
        """Decide, in order, the undecided checkpoints the drafted tree `cur`
        (tokens, parents, probs, source, m) reaches: c_d >= tau_k passes;
        c_d < tau_k prunes the tree to its nodes at depth <= d_k.  Returns
        `cur`, pruned or not."""
        if cur is None or self.pruned or self._next >= len(GRAFT_CHECKPOINTS):
            return cur
        tok, par, pr, src, m = cur
        depth, cum = _depth_and_cum(par, pr, m)
        taus = self.thresholds()
        while self._next < len(GRAFT_CHECKPOINTS):
            s = self._next
            d = GRAFT_CHECKPOINTS[s]
            at = depth == d
            if not at.any():            # not reached yet: a later part may reach it
                return cur
            conf = float(cum[at].max())
            self._gp_last.append((s, conf))
            self._next += 1
            if conf < taus[s]:
                self.stage = s          # nodes are parents first, so depth <= d is closed under parents
                sel = np.flatnonzero(depth <= d)
                return (*compact(tok, par, pr, src, sel), len(sel))
        return cur

    def graft(self, cur, template, budget):
        """B = B_draft(s) + B_retr(s): the drafted tree keeps
        B_draft = min(its nodes, B) slots, and the template's first
        B_retr = B - B_draft nodes (its stage-matched prefix; parents precede
        children) are merged under the root."""
        self.stats[len(GRAFT_CHECKPOINTS) if self.stage is None else self.stage] += 1
        if cur is None:
            if template is None:
                return None
            return (template.tokens, template.parents, template.probs, template.source, min(len(template), budget))
        tok, par, pr, src, m = cur
        b_draft = min(m, budget)
        b_retr = budget - b_draft
        if template is None or b_retr <= 0:
            return (tok, par, pr, src, b_draft)
        out = self._buf[0] if tok is not self._buf[0][0] else self._buf[1]
        mt = min(len(template), b_retr)
        mm = merge_trees(tok, par, pr, src, b_draft, template.tokens, template.parents, template.probs,
                         template.source, mt, b_draft + mt, out[0], out[1], out[2], out[3])
        return (out[0], out[1], out[2], out[3], mm)

    def prune_and_graft(self, cur, template, budget):
        """The whole mechanism on a tree drafted at once: checkpoints, then the graft."""
        self.start_step()
        return self.graft(self.checkpoint(cur), template, budget)

    def observe(self, result) -> None:
        """Calibrate the checkpoints: at each checkpoint decided in the last
        proposal, did the step accept drafts down to that depth?"""
        if not self._gp_last or len(result.proposed) == 0:
            self._gp_last = []
            return
        n_acc = len(result.accepted) - 1
        for s, conf in self._gp_last:
            self._gp_pred[s] += conf
            self._gp_obs[s] += float(n_acc >= GRAFT_CHECKPOINTS[s])
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
