"""The `auto` drafter's `trigger` mechanism: ReSpec's entropy trigger.

Retrieve iff min over k <= window of H_k + lambda / k <= theta, H_k the mean
entropy of the model's whole distribution over the last k committed
positions.  When it does not fire, the retrieval parts (suffix, semantic,
AdaPLD, branch) sit the step out; the tri-gram and adjacency parts still draft.

One concern: the entropy window, the decision, and its counters.
"""
from __future__ import annotations

from edgespec.drafters.adapld import AdaPLDDrafter
from edgespec.drafters.branch import BranchDrafter
from edgespec.drafters.semantic import SemanticDrafter
from edgespec.drafters.suffix import SuffixDrafter

RETRIEVAL = (SuffixDrafter, SemanticDrafter, AdaPLDDrafter, BranchDrafter)   # what ReSpec's trigger gates


class RetrievalTrigger:
    """ReSpec's trigger over the HybridConfig's trigger_* settings (read at each use)."""

    def __init__(self, config, parts):
        self.config = config
        self.gated = [isinstance(p, RETRIEVAL) for p in parts]     # per part: does the trigger gate it
        self._trig_h: list[float] = []      # the full entropies of the last committed positions (newest last)
        self.n_triggered = self.n_trigger_checks = 0

    def begin(self) -> None:
        """A new request: no entropy known."""
        self._trig_h = []

    def check(self) -> bool:
        """This step's decision, counted."""
        retrieve = self.triggered()
        self.n_trigger_checks += 1
        self.n_triggered += retrieve
        return retrieve

    def triggered(self) -> bool:
        """ReSpec's entropy trigger: with H_k the mean entropy of the model's
        distribution over the last k committed positions (k = 1 .. window),
        retrieve iff min_k (H_k + lambda / k) <= theta.  The lambda / k term
        asks more of a short window (less evidence).  No entropy known yet
        (the first step of a request): retrieve."""
        h = self._trig_h
        if not h:
            return True
        c = self.config
        best = min(sum(h[-k:]) / k + c.trigger_lambda / k for k in range(1, len(h) + 1))
        return best <= c.trigger_theta

    def observe(self, result) -> None:
        """Keep the newest `trigger_window` entropies the step committed."""
        if len(result.entropy):
            self._trig_h = (self._trig_h + result.entropy.tolist())[-self.config.trigger_window:]
