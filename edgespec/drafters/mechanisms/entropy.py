"""The `auto` drafter's `entropy` mechanism: a soft, calibrated retrieval trigger.

A ReSpec-inspired variant of edgespec.  The model's recent uncertainty is the
mean entropy of its top-8 distribution over the last 4 committed positions
(read from logits the verification computed anyway: the full-vocabulary
entropy would cost a pass over the vocabulary per row).  Per entropy bucket
the drafter counts how its depth-1 retrieved drafts fared against their
scores, and scales those drafts' scores by the bucket's rate relative to the
overall rate (at most 1): where the model is too unsure for copying to work,
retrieved drafts score low and the engine's cost gate drops them.

One concern: the recent-entropy window, the per-bucket calibration, and the
scaling it implies.
"""
from __future__ import annotations

import numpy as np

from edgespec.drafters.tree import SOURCE_CORPUS
from edgespec.kernels.topk import push_entropy
from edgespec.drafters.mechanisms import Mechanism

ENTROPY_TOPK = 8                    # entropy of the model's top-8 distribution
ENTROPY_MAX = float(np.log(ENTROPY_TOPK))
ENTROPY_BUCKETS = 5
ENTROPY_WINDOW = 4                  # committed positions in the recent mean


class EntropyScaler(Mechanism):
    """Recent entropy and per-bucket calibration of the retrieved drafts."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._hring = np.zeros(ENTROPY_WINDOW, np.float64)   # the last committed positions' entropies
        self._hn = 0                                          # how many were pushed this request
        self._hmean = 0.0                                     # their mean over the window
        self._ent_pred = [0.0] * ENTROPY_BUCKETS     # per bucket: predicted and accepted
        self._ent_acc = [0.0] * ENTROPY_BUCKETS      # depth-1 retrieved drafts
        self._ent_tot = [0.0, 0.0]                   # their sums over the buckets
        self._ent_last = (-1, 1.0)       # (bucket, factor) of the last proposal

    def begin(self, prompt=None) -> None:
        """A new request: no recent entropy yet."""
        self._hn = 0
        self._hmean = 0.0
        self._ent_last = (-1, 1.0)

    def start_step(self) -> None:
        """A proposal starts: nothing scaled yet."""
        self._ent_last = (-1, 1.0)

    def scale(self, tree) -> None:
        """Scale the retrieved tree's depth-1 scores (in place) by the current factor."""
        self._ent_last = self.factor()
        if self._ent_last[1] < 1.0:
            top = tree.parents == -1
            tree.probs[top] *= self._ent_last[1]

    def factor(self) -> tuple[int, float]:
        """(bucket, score factor) for the current recent entropy."""
        if not self._hn:
            return -1, 1.0
        h = self._hmean
        b = min(int(h / ENTROPY_MAX * ENTROPY_BUCKETS), ENTROPY_BUCKETS - 1)
        rate_b = (self._ent_acc[b] + 1.0) / (self._ent_pred[b] + 1.0)
        rate = (self._ent_tot[1] + 1.0) / (self._ent_tot[0] + 1.0)
        return b, min(1.0, max(0.05, rate_b / rate))

    def observe(self, result) -> None:
        """Count the last proposal's depth-1 retrieved drafts in their bucket; push the step's entropies."""
        b, f = self._ent_last
        pr = result.proposed
        if b >= 0 and len(pr):
            m = (pr.parents == -1) & (pr.source <= SOURCE_CORPUS) & result.node_tested
            if m.any():
                p, a = float(pr.probs[m].sum()) / f, float(result.node_accepted[m].sum())
                self._ent_pred[b] += p
                self._ent_acc[b] += a
                self._ent_tot[0] += p
                self._ent_tot[1] += a
        x = result.topk_logits
        r = len(x)
        if r:
            self._hmean = push_entropy(x, r, self._hring, self._hn)
            self._hn += r
