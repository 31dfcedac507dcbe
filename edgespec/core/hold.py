"""Which batch width to hold, chosen by cost (issue 51).

Where consecutive decodes of one width cost markedly less than decodes that
change width (the learned steady costs against the alternating ones,
StepCosts.shape_sensitive: llama.cpp's CUDA backend replays a captured graph
only while the shape stays), a step that verifies a fixed width every time
(EngineConfig.hold_width) may beat the gate's free choice, which pays the
alternating cost each time it drafts.  HoldChooser compares, from the same
evidence every step, what each way of stepping would yield:

  free (0)    the gate's own choice: the k likeliest drafts that maximise
              expected tokens per unit of cost, each batch charged the
              learned cost of a width that changes (alternating), k = 0 a
              plain step
  hold w      w in HOLD_WIDTHS: the w - 1 likeliest drafts every step,
              charged the learned steady cost of width w

Each candidate verifies the likeliest nodes of the proposal by the
acceptance model's path probabilities, as the gate ranks them (filler nodes
that pad a held width left out, so the evidence is the same whichever way
the engine steps).  Its cost is the decode's plus the engine's work per step
(the gate's overhead term); its tokens are 1 plus the nodes of its selection
that the model's committed text turned out to follow, judged in hindsight
with the acceptance model's shadow records (kernels/tree.shadow_learn): what
each candidate would really have gained on this step, not the acceptance
model's estimate, which runs low on the shallow nodes of long copies and
high on their deep ones.  Each candidate keeps forgetting
means of its tokens and its cost per judged step; its value is their ratio
(tokens per plain step's time).  The chooser moves to another candidate only
after it has beaten the current one by MARGIN on PATIENCE judged steps in a
row, so noisy evidence does not make it flap.  Where the costs are not
shape-sensitive (every CPU curve: steady and alternating widths cost the
same), by the learned costs or by the calibration's (Gate.judge_hold asks
both), it holds nothing and judges nothing, so the engine steps as it did
before this existed.  The rule reads costs only, never a device's name.
"""
from __future__ import annotations

import numpy as np

HOLD_WIDTHS = (2, 4, 8)
MARGIN = 0.05       # a candidate must beat the current choice by 5% ...
PATIENCE = 8        # ... on this many judged steps in a row
WINDOW = 32.0       # the candidates' means forget at 1 / WINDOW per judged step


class HoldChooser:
    """The held width (0: none, the gate decides) one engine steps with; see the module doc."""

    def __init__(self, max_width: int):
        self.widths = np.array([w for w in HOLD_WIDTHS if w <= max_width], np.int64)
        n = 1 + len(self.widths)              # candidate 0: free; then one per held width
        self.tokens = np.ones(n)
        self.cost = np.ones(n)
        self.n = 0.0                          # judged steps (at most WINDOW)
        self.held = 0
        self._lead = -1                       # the candidate beating the current one, and for how long
        self._streak = 0
        self.switches = 0

    def width(self, budget: int) -> int:
        """The width to hold with `budget` slots left, or 0."""
        return self.held if self.held <= budget else 0

    def drop(self) -> None:
        """The costs are not shape-sensitive (any more): hold nothing."""
        self.held, self._lead, self._streak = 0, -1, 0

    def plan(self, qs: np.ndarray, steady: np.ndarray, free: np.ndarray, overhead: float,
             lim: int) -> tuple[np.ndarray, np.ndarray]:
        """What each candidate would verify this step and what it would cost:
        (drafts per candidate, the likeliest first; cost in plain steps).
        qs: the path probabilities of the proposal's nodes (fillers left
        out), descending; steady[T]: a steady batch of T tokens, and
        free[T]: one that changes width, both in plain steps (free[1] the
        plain step: StepCosts.widths); overhead: the engine's work per step
        in plain steps; lim: the most batch slots the gate may lay."""
        return candidate_steps(qs, steady, free, overhead, lim, self.widths)

    def learn(self, ks: np.ndarray, cost: np.ndarray, matched: np.ndarray) -> None:
        """One step's evidence, once the committed text has decided its
        proposal: ks and cost as plan() gave them, matched[i] whether the
        i-th likeliest node turned out on the model's path."""
        cm = np.concatenate([[0], np.cumsum(matched, dtype=np.int64)])
        tok = 1.0 + cm[np.minimum(ks, len(matched))]
        self.n = min(self.n + 1.0, WINDOW)
        self.tokens += (tok - self.tokens) / self.n
        self.cost += (cost - self.cost) / self.n
        self._decide()

    def values(self) -> np.ndarray:
        """Expected tokens per plain step's time of each candidate (free first)."""
        return self.tokens / self.cost

    def _decide(self) -> None:
        v = self.values()
        cur = 0 if self.held == 0 else 1 + int(np.nonzero(self.widths == self.held)[0][0])
        best = int(np.argmax(v))
        if best == cur or v[best] <= v[cur] * (1.0 + MARGIN):
            self._lead, self._streak = -1, 0
            return
        self._streak = self._streak + 1 if best == self._lead else 1
        self._lead = best
        if self._streak >= PATIENCE and self.n >= PATIENCE:
            self.held = 0 if best == 0 else int(self.widths[best - 1])
            self._lead, self._streak = -1, 0
            self.switches += 1

    def report(self) -> dict:
        """The current choice and each candidate's value, for --stats and the bench."""
        v = self.values()
        return {"held": self.held, "switches": self.switches,
                "value": {str(w): round(float(x), 3) for w, x in zip([0] + self.widths.tolist(), v)}}


def candidate_steps(qs: np.ndarray, steady: np.ndarray, free: np.ndarray, overhead: float, lim: int,
                    widths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drafts verified and cost (plain steps) of this step under each
    candidate, free first (module doc); qs: path probabilities, descending."""
    kmax = max(0, int(min(len(qs), lim - 1, len(free) - 2)))
    ftok = 1.0 + np.concatenate([[0.0], np.cumsum(qs[:kmax])])
    fcost = free[1:kmax + 2] + overhead
    k = int(np.argmax(ftok / fcost))
    ks = np.concatenate([[k], np.minimum(widths - 1, len(qs))])
    cost = np.concatenate([[fcost[k]], steady[widths] + overhead])
    return ks, cost
