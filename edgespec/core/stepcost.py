"""Learned step costs: what the decodes the engine runs actually cost.

The calibrated curve c(T) (calibration/curve.py) is measured apart from the
work: chains, each after one-token decodes, on a quiet machine.  The steps
the engine runs are trees, follow whatever step came before, and share the
machine with whatever else runs.  StepCosts times every decode with its
shape and corrects the gate's cost table from those timings; the calibrated
curve is only the prior.

What it learns, each as a ratio of the measured seconds to the prior's
seconds for the same decode (so a context length not seen yet is costed from
what was seen at others):
  alternating  a batch of T tokens after a decode of another width, or the
               second of a width (llama.cpp's CUDA backend runs the first
               decode of a new shape without its graph and captures the
               graph on the second: ggml_backend_cuda_graph_compute)
  steady       a batch of T tokens after two of the same width
  plain        a one-token decode after one-token decodes
  after        the two one-token decodes after a batch: their extra time
               over two plain ones is charged to the batch that caused it
Batch widths share a cell per bucket of the curve's measured sizes.  A cell
backs off to the ratio pooled over all widths of its kind while it has few
observations of its own, and the pooled ratio to the plain step's (what
slows every decode slows batches too); every cell forgets at rate 1/WINDOW,
so a change of the machine's load shows within tens of steps.

On a CPU steady and alternating widths cost the same, within noise.  On
CUDA llama.cpp replays a captured graph only while consecutive decodes keep
their shape, so a steady width costs much less than a changing one
(BENCHMARKS.md, GPU).  Where the learned steady cost is markedly lower
(`shape_sensitive`), a batch that keeps the previous step's width is
charged its steady cost; elsewhere steady and alternating are one cost.
Each run of batches pays once for the return to plain decoding: the batch
that starts a run from a plain step is charged its alternating cost over
the steady one plus the return, spread over the run length seen so far; a
batch inside a run, nothing for the return.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

PRIOR_WEIGHT = 2.0     # pseudo-observations of the prior (pooled) in each cell
PLAIN_PRIOR = 0.1      # the plain step's: timed every plain step, it is the scale of everything else
WINDOW = 32.0          # a cell's memory, in observations
SENSITIVE = 0.10       # steady this much cheaper than alternating (T = 2..16): keep widths steady
RUN_PRIOR = 2.0        # batch steps per run of batches before any run is seen
TRUSTED = 1.5          # batches timed within this factor of the calibration: no ramp
FIRST_COST = 4.0       # the dearest batch (prior plain steps) before any was timed; then twice the dearest timed
ALT, STEADY = 0, 1


@dataclass
class Prior:
    """The calibrated costs at one context, in units of one plain step's
    prior seconds t1_s: alt[T] and steady[T] the decode of T tokens without
    the after-batch charge (alt[1] the plain step), after the extra of the
    two one-token decodes after a batch."""
    alt: np.ndarray
    steady: np.ndarray
    after: float
    t1_s: float

    @cached_property
    def shape_sensitive(self) -> bool:
        """The calibration's steady widths markedly cheaper than its changing
        ones (StepCosts.shape_sensitive); once per Prior, which the gate keeps
        per context bucket."""
        return StepCosts.shape_sensitive(self.alt, self.steady)


class _Mean:
    """A forgetting mean over at most WINDOW observations."""
    __slots__ = ("n", "m")

    def __init__(self):
        self.n, self.m = 0.0, 1.0

    def add(self, x: float) -> None:
        self.n = min(self.n + 1.0, WINDOW)
        self.m += (x - self.m) / self.n

    def backed(self, prior: float, k: float = PRIOR_WEIGHT) -> float:
        return (self.n * self.m + k * prior) / (self.n + k)


class StepCosts:
    """One engine's learned step costs over the widths 1..max_t (see the module doc)."""

    def __init__(self, ts, max_t: int):
        ts = [t for t in sorted(set(int(t) for t in ts)) if t >= 1] or [1]
        # the cell of width T: the smallest measured size >= T (the tables step there too)
        self.bucket = np.minimum(np.searchsorted(np.asarray(ts), np.arange(max_t + 1)), len(ts) - 1)
        # per kind (ALT, STEADY) and bucket: observations (at most WINDOW) and their forgetting mean
        self.cell_n = np.zeros((2, len(ts)))
        self.cell_m = np.ones((2, len(ts)))
        self.pooled = [_Mean(), _Mean()]
        self.plain, self.after = _Mean(), _Mean()
        self._first: tuple | None = None     # (seconds, prior) of the one-token decode right after a batch
        self._same = 0                       # decodes of the current width in a row
        self.run, self.n_runs, self.cur_run = RUN_PRIOR, 0.0, 0
        self.widest = 0
        self.max_t = max_t
        self._ratios: tuple | None = None

    # ------------------------------------------------------------ learning
    def observe(self, width: int, prev: int, seconds: float, prior: Prior) -> None:
        """A decode of `width` tokens after one of `prev` (0: none yet this
        request) took `seconds`; prior: the calibrated costs at its context."""
        if seconds <= 0 or width < 1 or width > self.max_t:
            return
        self._same = self._same + 1 if width == prev else 1
        first, self._first = self._first, None
        if first is not None:
            # the pair of one-token decodes after a batch, against two plain decodes and the
            # return; a batch right after it stands in a plain decode for the second
            s1, p1 = first
            s2 = seconds if width == 1 else p1.alt[1] * p1.t1_s
            self.after.add((s1 + s2) / ((2.0 * p1.alt[1] + p1.after) * p1.t1_s))
        if width == 1:
            if prev >= 2:
                self._first = (seconds, prior)
                self._end_run()
            elif first is None:
                self.plain.add(seconds / (prior.alt[1] * prior.t1_s))
        else:
            kind = STEADY if width == prev and self._same >= 3 else ALT
            base = prior.steady[width] if kind == STEADY else prior.alt[width]
            x = seconds / (base * prior.t1_s)
            b = self.bucket[width]
            self.cell_n[kind, b] = n = min(self.cell_n[kind, b] + 1.0, WINDOW)
            self.cell_m[kind, b] += (x - self.cell_m[kind, b]) / n     # as _Mean.add, kept in arrays
            self.pooled[kind].add(x)
            self.cur_run += 1
            self.widest = max(self.widest, width)
        self._ratios = None

    def _end_run(self) -> None:
        if self.cur_run:
            self.n_runs = min(self.n_runs + 1.0, WINDOW)
            self.run += (self.cur_run - self.run) / (self.n_runs + 1.0)
            self.cur_run = 0

    def ratios(self) -> tuple[np.ndarray, np.ndarray, float, float]:
        """(alternating[T], steady[T], plain, after): measured over prior."""
        if self._ratios is None:
            # what slows every decode (another program on the cores) slows batches too:
            # widths not timed yet take the plain step's ratio
            r1 = self._plain_ratio()
            pa = self.pooled[ALT].backed(r1)
            ps = self.pooled[STEADY].backed(pa)
            n, m = self.cell_n, self.cell_m
            alt = ((n[ALT] * m[ALT] + PRIOR_WEIGHT * pa) / (n[ALT] + PRIOR_WEIGHT))[self.bucket]
            steady = ((n[STEADY] * m[STEADY] + PRIOR_WEIGHT * ps) / (n[STEADY] + PRIOR_WEIGHT))[self.bucket]
            self._ratios = (alt, steady, r1, self.after.backed(r1))
        return self._ratios

    # -------------------------------------------------------------- costing
    def widest_allowed(self, prior: Prior) -> int:
        """The widest batch the gate may lay now: any, once timed batches
        have confirmed the calibration (within TRUSTED of it, relative to the
        plain step); else the widest whose prior cost is at most twice that
        of the widest timed so far (at first FIRST_COST plain steps), so a
        batch far dearer than calibrated is found out on a small one."""
        ra, _, r1, _ = self.ratios()
        if self.widest and self.pooled[ALT].n and self.pooled[ALT].m <= TRUSTED * r1:
            return len(prior.alt) - 1
        limit = max(FIRST_COST, 2.0 * prior.alt[min(self.widest, len(prior.alt) - 1)]) if self.widest else FIRST_COST
        return max(2, int(np.searchsorted(prior.alt[1:], limit, side="right")))

    def plain_s(self, prior: Prior) -> float:
        """Seconds of a plain one-token step at this context, as learned
        (ratios()[2], without computing the batch widths' ratios: the engine
        asks every step)."""
        return prior.alt[1] * prior.t1_s * self._plain_ratio()

    def _plain_ratio(self) -> float:
        """The plain step's measured over prior seconds (what slows every decode)."""
        return self.plain.backed(1.0, PLAIN_PRIOR)

    def table(self, prior: Prior, prev: int) -> tuple[np.ndarray, bool]:
        """The gate's cost table (T = 0..max_t, in units of the prior's t1)
        for a step after a decode of `prev` tokens, and whether the costs are
        shape-sensitive (the module doc).  Each run of batches pays once for
        the return to plain decoding: a batch after a plain step is charged
        its share of it (spread over the run length seen), a batch after a
        batch nothing more."""
        ra, rs, r1, raf = self.ratios()
        n = len(prior.alt)
        alt = prior.alt * ra[:n]
        sens = self.shape_sensitive(alt, prior.steady * rs[:n])
        steady = prior.steady * rs[:n] if sens else alt       # within noise of each other: one cost
        one = prior.alt[1] * r1
        back = max(0.0, (2.0 * prior.alt[1] + prior.after) * raf - 2.0 * one)     # the return to plain decoding
        if prev >= 2:
            out = alt.copy()
            if prev < n:
                out[prev] = steady[prev]
        else:
            out = steady + (alt - steady + back) / max(1.0, self.run)
        out[0], out[1] = 0.0, one
        return out, sens

    def widths(self, prior: Prior) -> tuple[np.ndarray, np.ndarray]:
        """The learned costs of a batch of T tokens (T = 0..max_t) that
        changes width (alternating, with its share of the return to plain
        decoding: the run of batches pays it once) and of one that keeps it
        (steady, which never returns), in units of the learned plain step
        (index 1: the plain step in both)."""
        ra, rs, r1, raf = self.ratios()
        n = len(prior.alt)
        back = max(0.0, (2.0 * prior.alt[1] + prior.after) * raf - 2.0 * prior.alt[1] * r1)
        alt = (prior.alt * ra[:n] + back / max(1.0, self.run)) / r1
        steady = prior.steady * rs[:n] / r1
        alt[:2] = steady[:2] = (0.0, prior.alt[1])
        return alt, steady

    @staticmethod
    def shape_sensitive(alt: np.ndarray, steady: np.ndarray) -> bool:
        """Steady widths markedly cheaper than changing ones (over T = 2..16)."""
        hi = min(len(alt), 17)
        if hi <= 2:
            return False
        return float(np.mean((alt[2:hi] - steady[2:hi]) / alt[2:hi])) > SENSITIVE

    def report(self) -> dict:
        """The learned ratios, for --stats and the bench."""
        ra, rs, r1, raf = self.ratios()
        return {"plain": round(r1, 3), "after": round(raf, 3), "alternating": round(float(np.median(ra[2:])), 3),
                "steady": round(float(np.median(rs[2:])), 3), "run": round(self.run, 2)}
