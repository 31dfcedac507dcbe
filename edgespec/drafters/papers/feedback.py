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

import numpy as np

from edgespec.kernels import suffix as _k


class PositionFeedback:
    """Scores per context position over a SuffixConfig's feedback_* settings."""

    def __init__(self, config):
        self.config = config
        self.scores = np.zeros(0, np.float32)       # S per match position
        self.selected: list[tuple[int, list]] = []  # (end, continuation) of this step's drafted occurrences

    def begin(self) -> None:
        self.scores[:] = self.config.feedback_init
        self.selected = []

    def select(self, ctx: np.ndarray, n: int, key: int, out_ends: np.ndarray, out_lens: np.ndarray) -> int:
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
        self.selected = [(int(e), ctx[e + 1:e + 1 + c.max_depth].tolist()) for e in out_ends[:j]]
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
