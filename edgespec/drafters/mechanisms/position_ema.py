"""The suffix drafter's position EMA (`position_ema`; `ema` inside `auto`,
where it is on): edgespec's own variant of ReSpec's feedback.

Each occurrence end ``e`` in the context whose first continuation token was
verified gets an exponential moving average of "that token was the model's
choice" (start 1, decay ``ema_decay``); occurrences whose average fell below
``ema_min`` are no longer proposed, so an anchor that keeps failing stops
costing batch slots.  A plug-in of the suffix drafter (drafters/registry.py):
without it the drafter is stateless.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.drafters.suffix import SuffixPlugIn


@dataclass
class EmaConfig:
    """ema_decay: the average's decay per verified step; ema_min: the score
    under which an occurrence is no longer proposed."""
    ema_decay: float = 0.5
    ema_min: float = 0.3

    def __post_init__(self):
        if not (0.0 <= self.ema_decay < 1.0) or not (0.0 <= self.ema_min <= 1.0):
            raise ValueError("EmaConfig: ema_decay must be in [0, 1) and ema_min in [0, 1]")


class PositionEma(SuffixPlugIn):
    """Scores per context position, the filter of the suffix drafter's
    context matches, and the update from what the model chose."""

    name = "position_ema"
    observes = True

    def __init__(self, config: EmaConfig | None = None):
        self.config = config if config is not None else EmaConfig()
        self._ema = np.ones(0, np.float32)
        self._last: list[tuple[int, int]] = []   # (occurrence end, its first continuation token) proposed

    def begin(self, prompt) -> None:
        self._ema[:] = 1.0
        self._last = []

    def select(self, ctx: np.ndarray, n: int, k: int, ends: np.ndarray, lens: np.ndarray, key: int) -> int:
        """Drop the k matches whose position score fell below ema_min (ends and
        lens compacted in place); remember the kept ones for observe()."""
        self._last = []
        if not k:
            return 0
        if len(self._ema) < n:
            grown = np.ones(max(2 * len(self._ema), n, 256), np.float32)
            grown[:len(self._ema)] = self._ema
            self._ema = grown
        ema, lo = self._ema, self.config.ema_min
        j = 0
        last = []
        for i in range(k):
            e = int(ends[i])
            if ema[e] < lo:
                continue
            ends[j], lens[j] = e, lens[i]
            j += 1
            last.append((e, int(ctx[e + 1])))
        self._last = last
        return j

    def observe(self, result) -> None:
        if not self._last:
            return
        pr = result.proposed
        verified = set(pr.tokens[pr.parents == -1].tolist()) if len(pr) else set()
        got = int(result.accepted[0])
        d = self.config.ema_decay
        for e, tok in self._last:
            if tok in verified:     # the model decided on this occurrence's draft
                self._ema[e] = d * self._ema[e] + (1.0 - d) * (tok == got)
        self._last = []
