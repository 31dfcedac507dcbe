"""The `auto` drafter's schedule: which parts propose this step.

Graft's fixed budget, applied to drafting time: the engine's gate already
keeps only nodes whose verification pays, but *making* a proposal costs time
too (the tri-gram MCTS is the expensive part), and the gate's estimates are
only estimates.  For the parts other than the RETRIEVAL one (suffix) the
schedule keeps a moving average, per step in which the part proposed, of its net value (draft tokens
it added to the accepted path, minus the verification time of its verified
nodes, in plain-step units) and of its propose() time.  A part whose value is
worth less than its time goes idle: it proposes again after ``SCHEDULE_PROBE``
steps (a probe), and each probe that leaves it idle doubles the wait, up to
``SCHEDULE_PROBE_MAX`` steps; a probe that pays makes it active again.  An
idle part also skips observe() except in the step before a probe and in the
probe itself (its tables then miss the steps between), since observing costs
time too.  The RETRIEVAL part (suffix) is always on (it is the cheap one).

One concern: the per-part timing, value and idle state, and the decisions
drawn from them.
"""
from __future__ import annotations

import time

import numpy as np

from edgespec.drafters.tree import N_SOURCES
from edgespec.drafters.mechanisms import RETRIEVAL, Mechanism

clock = time.perf_counter
"""What times a part's propose(); edgespec replay --draft-ms puts a fixed
step in its place, so a replay's schedule decides the same under any load."""

SCHEDULE_PROBE = 8                  # an idle part proposes again after 8 steps,
SCHEDULE_PROBE_MAX = 64             # doubling the wait after each failed probe, to 64
SCHEDULE_ALPHA = 0.1                # weight of the newest step in the moving averages
SCHEDULE_GAIN0 = 1.0                # parts start trusted (1 accepted token per step)


class PartSchedule(Mechanism):
    """Per part: sources, moving averages of net value and propose time, idle state.

    ``config`` is the HybridConfig (its ``schedule`` switch is read at each
    observation); ``roles`` the parts' roles (the RETRIEVAL one is always on,
    and not weighed)."""

    def __init__(self, config, parts, roles):
        self.config = config
        self.parts = parts
        self._weighed = [r != RETRIEVAL for r in roles]
        self._sources = [p.sources for p in parts]       # what the schedule credits to each part
        self._gain = np.full(len(parts), SCHEDULE_GAIN0)
        self._cost = np.zeros(len(parts))
        self._idle = [False] * len(parts)
        self._proposed = [False] * len(parts)
        self._extra_proposed = False        # a weighed part proposed this step
        self._wants = [p.wants_observe() for p in parts]
        self._wait = [SCHEDULE_PROBE] * len(parts)     # current probe interval
        self._next_probe = [0] * len(parts)            # step of the next probe
        self._n_steps = 0

    def start_step(self) -> None:
        """A proposal starts."""
        self._extra_proposed = False
        self._n_steps += 1

    def resting(self, i: int) -> bool:
        """Whether part i is idle and its next probe is still ahead."""
        return self._idle[i] and self._n_steps < self._next_probe[i]

    def skip(self, i: int) -> None:
        """Part i does not propose this step."""
        self._proposed[i] = False

    def propose(self, i: int, context, budget: int):
        """Part i's proposal, its time folded into the part's moving average."""
        p = self.parts[i]
        t0 = clock()
        t = p.propose(context, budget)
        self._cost[i] = (1 - SCHEDULE_ALPHA) * self._cost[i] + SCHEDULE_ALPHA * (clock() - t0)
        self._proposed[i] = True
        if self._weighed[i]:
            self._extra_proposed = True
        return t

    def observes(self, i: int) -> bool:
        """Whether part i observes this step: an idle part observes only around its probes."""
        return self._wants[i] and not (self._idle[i] and not self._proposed[i]
                                       and self._n_steps + 1 < self._next_probe[i])

    def observe(self, result) -> None:
        """Learn the parts' value from the step (only the parts other than the RETRIEVAL one are weighed)."""
        if self._extra_proposed and self.config.schedule and result.plain_step_s > 0:
            self._learn(result)

    def _learn(self, result) -> None:
        pr = result.proposed
        k = len(pr)
        if k:
            acc_n = np.bincount(pr.source[result.node_accepted], minlength=N_SOURCES)
            node_n = np.bincount(pr.source, minlength=N_SOURCES)
        # what each verified draft node added to this step's decode time
        per_node = max(0.0, result.step_decode_s - result.plain_step_s) / k if k else 0.0
        a = SCHEDULE_ALPHA
        for i in range(len(self.parts)):
            if not self._proposed[i] or not self._weighed[i]:
                continue
            g = nodes = 0
            if k:
                for s in self._sources[i]:
                    g += int(acc_n[s])
                    nodes += int(node_n[s])
            # net value in plain-step units: accepted tokens minus verify time of its nodes
            self._gain[i] = (1 - a) * self._gain[i] + a * (g - nodes * per_node / result.plain_step_s)
            was_idle = self._idle[i]
            self._idle[i] = self._gain[i] * result.plain_step_s < self._cost[i]
            if not self._idle[i]:
                self._wait[i] = SCHEDULE_PROBE
            else:
                if was_idle:            # a probe that did not pay: wait longer
                    self._wait[i] = min(2 * self._wait[i], SCHEDULE_PROBE_MAX)
                self._next_probe[i] = self._n_steps + self._wait[i]

    def report(self) -> list[tuple[str, float, float, bool]]:
        """(part, net value per proposing step in plain-step units, propose ms, idle) per part."""
        return [(p.name, float(self._gain[i]), float(self._cost[i] * 1e3), self._idle[i])
                for i, p in enumerate(self.parts)]
