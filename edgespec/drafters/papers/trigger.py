"""The `auto` drafter's `trigger` mechanism: ReSpec's entropy-guided adaptive trigger.

For each suffix length k = 1 .. l (l = `trigger_window`, 3 in the paper),
H_k is the mean entropy of the model's whole distribution over the key's k
positions and C_k = H_k + lambda / k; k* = argmin_k C_k (the first on ties)
and retrieval runs iff H_{k*} <= theta (1.5 in the paper).  When it does
not, the retrieval parts (suffix, semantic, AdaPLD, branch) sit the step
out; the tri-gram and adjacency parts (ReSpec's Drafter Module) still
draft.  k* is also the retrieval key: the hybrid hands `key` to its
RETRIEVAL part (SuffixDrafter.use_key), with which ReSpec's `feedback`
selection retrieves (every earlier occurrence of the last k* tokens);
without `feedback` the suffix part keeps its own longest matches.  The
trigger only decides: it writes into no part.

The entropy of a key token is that of the distribution it was drawn from:
the distribution after the context's last token is computed only by the
next verification, so edgespec's window is the paper's shifted by one.

One concern: the entropy window, the decision, the key, and the counters.
"""
from __future__ import annotations

from edgespec.drafters.mechanisms import Mechanism


def select_key(h: list, lam: float, window: int) -> tuple[int, float]:
    """ReSpec eqs. (2)-(3) over the entropies h of the last committed
    positions (newest last): (k*, H_{k*}) with k* the k in 1 .. min(window,
    len(h)) that minimises C_k = H_k + lam / k, the smallest such k on ties
    (Algorithm 1 keeps a strictly smaller C_k only).  h must not be empty."""
    best_c, best_k, best_h = float("inf"), 0, float("inf")
    for k in range(1, min(window, len(h)) + 1):
        hk = sum(h[-k:]) / k
        ck = hk + lam / k
        if ck < best_c:
            best_c, best_k, best_h = ck, k, hk
    return best_k, best_h


class RetrievalTrigger(Mechanism):
    """ReSpec's trigger over the HybridConfig's trigger_* settings (read at each use)."""

    def __init__(self, config, parts):
        self.config = config
        self.enabled = bool(config.trigger)
        self.gated = [p.retrieves for p in parts]     # per part: does the trigger gate it
        self._trig_h: list[float] = []      # the full entropies of the last committed positions (newest last)
        self.key = 0                        # k* of the last decision (0: none known)
        self.n_triggered = self.n_trigger_checks = 0

    def begin(self, prompt=None) -> None:
        """A new request: no entropy known."""
        self._trig_h = []
        self.key = 0

    def check(self) -> bool:
        """This step's decision, counted (k* is then in `key`)."""
        retrieve = self.triggered()
        self.n_trigger_checks += 1
        self.n_triggered += retrieve
        return retrieve

    def triggered(self) -> bool:
        """Retrieve iff H_{k*} <= theta (Algorithm 1, line 14), k* = argmin_k
        C_k.  No entropy known yet (the first step of a request): retrieve,
        with no key (k* = 0: the suffix part's own longest match; not given
        by the paper)."""
        h = self._trig_h
        if not h:
            self.key = 0
            return True
        c = self.config
        self.key, h_best = select_key(h, c.trigger_lambda, c.trigger_window)
        return h_best <= c.trigger_theta

    def observe(self, result) -> None:
        """Keep the newest `trigger_window` entropies the step committed."""
        if len(result.entropy):
            self._trig_h = (self._trig_h + result.entropy.tolist())[-self.config.trigger_window:]
