"""ReSpec's feedback-driven candidate selection (section 3.3, Algorithm 1,
lines 15-28), for the suffix drafter's context matches.

Every match position (an occurrence end ``e`` in the context) has a score S,
starting at S_0.  Each step every earlier occurrence of the retrieval key is
retrieved; those scored below theta_score are dropped, the best ``top`` of
the rest are drafted, and when none is left there is no context retrieval
(ReSpec: "decoding directly fallbacks").  After verification every selected
position is updated, S <- (1 - rate) S + rate R: the winner (the occurrence
whose continuation the model followed furthest) with R = L_acc / L_draft,
every other selected one with R = 0.

One concern: the scores per position, the selection, and the update.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.kernels import suffix as _k
from edgespec.drafters.suffix import SuffixPlugIn


@dataclass
class FeedbackConfig:
    """ReSpec's settings, as the paper gives them where it does."""
    feedback_init: float = 0.5
    """S_0, the paper's "e.g. 0.5"."""
    feedback_rate: float = 0.5
    """The EMA rate alpha; not given by the paper: 0.5 is edgespec's choice."""
    feedback_top: int = 3
    """Top-3, the paper's."""
    feedback_min: float = 0.2
    """theta_score; not given by the paper ("a learned threshold"): 0.2 is
    edgespec's choice, so that with rate 0.5 a new position is dropped after
    two losses in a row."""

    def __post_init__(self):
        if not (0.0 <= self.feedback_init <= 1.0) or not (0.0 < self.feedback_rate <= 1.0) \
                or not (0.0 <= self.feedback_min <= 1.0):
            raise ValueError("FeedbackConfig: feedback_init and feedback_min must be in [0, 1] and "
                             "feedback_rate in (0, 1]")
        v = self.feedback_top
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"FeedbackConfig.feedback_top must be an integer >= 1, got {v!r}")
        self.feedback_top = int(v)


class PositionFeedback(SuffixPlugIn):
    """Scores per context position over a FeedbackConfig: a plug-in of the
    suffix drafter (drafters/registry.py), whose context matches it selects."""

    name = "feedback"
    observes = True

    def __init__(self, config: FeedbackConfig | None = None):
        self.config = config if config is not None else FeedbackConfig()
        self.max_depth = 32                         # the suffix drafter's (attach)
        self.scores = np.zeros(0, np.float32)       # S per match position
        self.selected: list[tuple[int, list]] = []  # (end, continuation) of this step's drafted occurrences

    def attach(self, suffix_config) -> None:
        self.max_depth = suffix_config.max_depth

    def begin(self, prompt=None) -> None:
        self.scores[:] = self.config.feedback_init
        self.selected = []

    def select(self, ctx: np.ndarray, n: int, k: int, ends: np.ndarray, lens: np.ndarray, key: int) -> int:
        """The suffix drafter's hook: with a key (k* from ReSpec's trigger, else
        the longest of the k matches, as SAM-Decoding's) the positions chosen
        by `choose`; none without matches or key."""
        self.selected = []
        if not (k or key):
            return 0
        return self.choose(ctx, n, key or (int(lens[0]) if k else 0), ends, lens)

    def choose(self, ctx: np.ndarray, n: int, key: int, out_ends: np.ndarray, out_lens: np.ndarray) -> int:
        """Lines 15-17: every earlier occurrence of the last `key` tokens, those
        scored at least feedback_min, of them the feedback_top best (ties: the
        more recent first), written to out_ends / out_lens; returns how many
        (0: fall back) and remembers their continuations."""
        c = self.config
        if len(self.scores) < n:
            grown = np.full(max(2 * len(self.scores), n, 256), c.feedback_init, np.float32)
            grown[:len(self.scores)] = self.scores
            self.scores = grown
        ends, lens = np.zeros(max(n, 1), np.int32), np.zeros(max(n, 1), np.int32)
        m = _k.find_suffix_matches(ctx, n, key, key, n, ends, lens) if key else 0   # most recent first
        ends = ends[:m][self.scores[ends[:m]] >= c.feedback_min]
        order = np.argsort(-self.scores[ends], kind="stable")[:min(c.feedback_top, len(out_ends))]
        j = len(order)
        out_ends[:j], out_lens[:j] = ends[order], key
        self.selected = [(int(e), ctx[e + 1:e + 1 + self.max_depth].tolist()) for e in out_ends[:j]]
        return j

    def observe(self, result) -> None:
        """Lines 20-28, for the occurrences select() drafted this step: L_draft
        is the tokens of an occurrence's continuation that were verified, so
        one the cost gate left out accepted nothing and gets R = 0 (ties for
        the winner: the selection order)."""
        if not self.selected:
            return
        pr = result.proposed
        child = {(int(p), int(t)): i for i, (p, t) in enumerate(zip(pr.parents.tolist(), pr.tokens.tolist()))}
        acc = result.accepted.tolist()
        scored = []                     # (end, L_acc, L_draft) of the selected occurrences
        for e, cont in self.selected:
            node, l_draft = -1, 0
            for t in cont:              # how much of the continuation was verified
                node = child.get((node, t), -2)
                if node == -2:
                    break
                l_draft += 1
            l_acc = 0
            while l_acc < min(l_draft, len(acc)) and cont[l_acc] == acc[l_acc]:
                l_acc += 1
            scored.append((e, l_acc, l_draft))
        best = max(a for _, a, _ in scored)
        win = next(i for i, (_, a, _) in enumerate(scored) if a == best) if best > 0 else -1
        r = self.config.feedback_rate
        for i, (e, l_acc, l_draft) in enumerate(scored):
            reward = l_acc / l_draft if i == win else 0.0
            self.scores[e] = (1.0 - r) * self.scores[e] + r * reward
        self.selected = []
