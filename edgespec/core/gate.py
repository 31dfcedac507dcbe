"""The cost gate: each step, which of the drafter's proposed nodes are worth
verifying.  The acceptance model turns each node's drafter score into a
calibrated probability; plan_step (kernels/tree.py) keeps the subtree whose
expected tokens per unit of measured verify cost c(T) is best, or nothing (a
plain one-token step) when no subtree beats plain decoding, and lays it out
as a batch.  After the step the model learns from what the verified nodes
did, and from the unverified ones once the committed tokens decide them.

The Gate owns what those decisions read and write: the cost tables (the
calibrated curve as the prior, corrected by the timed decodes the engine
runs: core/stepcost.py), the acceptance counts, the engine's own time per
step and the batch layout.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from edgespec.calibration.curve import CostCurve
from edgespec.core.config import SPLIT_KV_FREE_CELLS, EngineConfig
from edgespec.core.hold import HoldChooser
from edgespec.core.plan import StepPlan
from edgespec.core.stepcost import Prior, StepCosts
from edgespec.drafters.tree import N_SOURCES, SOURCE_FILLER, DraftTree, source_name
from edgespec.kernels.tree import N_SCORE_BUCKETS, SCORE_EDGES, learn_step, plan_step, shadow_learn

SHADOW_KEEP = 16      # proposals judged at once: deeper than any draft the engine verifies


class ShadowRecord(NamedTuple):
    """One step's whole proposal, kept until the committed tokens decide its
    nodes (Gate.record_shadow, Gate.learn_shadow; kernels/tree.py's shadow_learn)."""
    root: int                 # context index of the step's pending token
    tokens: np.ndarray        # the tree's arrays (copies)
    parents: np.ndarray
    probs: np.ndarray
    source: np.ndarray
    cond: np.ndarray          # the gate's conditional probabilities of the nodes then
    verified: np.ndarray      # the nodes the step verified (learn_step counted those)
    state: np.ndarray         # per node: 0 undecided, 1 matched, 2 not (shadow_learn keeps it)
    hold_step: tuple | None = None    # the hold chooser's plan of this step (judge_hold), if any


COST_BUCKET = 128     # the cost gate's table is re-interpolated every 128 context cells


class CostBuckets:
    """The cost table (T = 0..max_t, in units of one plain step) and the plain
    step's seconds for a batch laid after n_past cells, interpolated at the
    centre of n_past's 128-cell bucket and cached per bucket.  The engine's
    gate and the offline replay's time model both cost steps through this."""

    def __init__(self, cost: CostCurve, max_t: int):
        self.cost = cost
        self.max_t = max_t
        self._at: dict = {}

    def at(self, n_past: int) -> tuple[np.ndarray, float]:
        b = n_past // COST_BUCKET
        t = self._at.get(b)
        if t is None:
            n_kv = b * COST_BUCKET + COST_BUCKET // 2
            t = self._at[b] = (self.cost.table(self.max_t, n_kv=n_kv), self.cost.t1_at(n_kv))
        return t


def cost_table_at(n_past: int, short: np.ndarray, buckets: CostBuckets) -> tuple[np.ndarray, float]:
    """The cost table and the plain step's seconds for a batch laid after
    n_past cells: ``short`` (the short regime's table: one-token steps with
    every thread, no split-KV) with the curve's own t1 while the batch starts
    within SPLIT_KV_FREE_CELLS, else n_past's 128-cell bucket.  The gate, the
    replay's time model and tools/copy_chains.py pick tables by this rule."""
    if n_past + 1 <= SPLIT_KV_FREE_CELLS:
        return short, buckets.cost.t1_s
    return buckets.at(n_past)


def prior_at(cost: CostCurve, n_past: int, max_t: int, cache: dict) -> Prior:
    """The calibrated costs (stepcost.Prior, T = 0..max_t) of a decode laid
    after n_past cells, by the rule of cost_table_at: the short regime's up
    to SPLIT_KV_FREE_CELLS, else n_past's 128-cell bucket; kept in `cache`."""
    short = n_past + 1 <= SPLIT_KV_FREE_CELLS
    key = -1 if short else n_past // COST_BUCKET
    p = cache.get(key)
    if p is None:
        n_kv = None if short else key * COST_BUCKET + COST_BUCKET // 2
        alt = cost.table(max_t, short=short, n_kv=n_kv, after=False)
        t1 = cost.t1_s if short else cost.t1_at(n_kv)
        p = cache[key] = Prior(alt, alt * cost.steady_factor(max_t), cost.after_rel(short, n_kv), t1)
    return p


N_DEPTH_BUCKETS = 4


class AcceptanceModel:
    """Online estimate of P(draft node accepted | parent accepted).

    Two levels of counts: coarse (source, score bucket) and fine (source, score
    bucket, depth bucket).  The estimate backs off from fine to coarse to the
    drafter's own score:  coarse = (acc + K0 * score) / (n + K0), and
    fine = (acc + K1 * coarse) / (n + K1).  The arithmetic runs in
    kernels/tree.py (plan_step predicts, learn_step counts); this class owns the
    counts and reports predicted against observed acceptance.
    """

    K0 = 4.0
    K1 = 8.0

    def __init__(self):
        shape = (N_SOURCES, N_SCORE_BUCKETS)
        self.n_c = np.zeros(shape)
        self.a_c = np.zeros(shape)
        self.n_f = np.zeros(shape + (N_DEPTH_BUCKETS,))
        self.a_f = np.zeros(shape + (N_DEPTH_BUCKETS,))
        # calibration report: predicted vs observed per bucket
        self.pred_sum = np.zeros(shape)

    def shrink(self, cap: float) -> None:
        """Scale each fine (source, score, depth) cell down to at most `cap`
        tested nodes, its accepted fraction kept.  The coarse cells keep every
        request's evidence (the source's calibration and each bucket's rate);
        the fine ones, which the estimate consults first and which back off to
        the coarse, then soon hold mostly the current request's own evidence."""
        f = np.minimum(1.0, cap / np.maximum(self.n_f, 1e-9))
        self.n_f *= f
        self.a_f *= f

    def report(self) -> list[dict]:
        """Rows of (source, score bucket, tested nodes, predicted and observed acceptance)."""
        rows = []
        for s in range(N_SOURCES):
            for b in range(N_SCORE_BUCKETS):
                n = self.n_c[s, b]
                if n > 0:
                    rows.append({"source": source_name(s), "score": f"{SCORE_EDGES[b]:g}-{SCORE_EDGES[b + 1]:g}",
                                 "tested": int(n), "predicted": round(float(self.pred_sum[s, b] / n), 3),
                                 "observed": round(float(self.a_c[s, b] / n), 3)})
        return rows


class Gate:
    """One engine's gate: the cost tables of its curve, the acceptance model,
    the overhead it counts per step, and the scratch arrays plan_step fills
    (kernels/tree.PlanScratch: the chosen nodes and the batch layout, every
    proposed node's calibrated probability) and learn_step (what each chosen
    node did).  The engine and the feedback read the step through the
    StepPlan that choose() returns (core/plan.py), never the scratch."""

    def __init__(self, config: EngineConfig, cost: CostCurve | None):
        self.config = config
        self.set_cost(cost)
        self.acceptance = AcceptanceModel()
        self.shape_sensitive = False             # the last table's (StepCosts.table)
        self.overhead_rel = 0.02                 # EMA of engine time per step / t1
        n = config.max_nodes + 1
        self._o = np.zeros(n, np.int64)
        self._bp = np.zeros(n, np.int64)
        self._d = np.zeros(n, np.int32)
        self._lf = np.zeros(n, np.int32)
        self._lc = np.zeros(n, np.int32)
        self._sel = np.zeros(n, np.int64)
        self._spar = np.zeros(n, np.int32)
        self._nacc = np.zeros(n, np.bool_)      # learn_step's, per chosen node
        self._ntest = np.zeros(n, np.bool_)
        self._planned = 0                        # nodes plan_step judged in the last choose()
        self._hold_step: tuple | None = None     # the hold chooser's plan of this step (judge_hold)
        self._overhead = self.overhead_rel
        self._plain = StepPlan.plain()
        self._laid = StepPlan.plain()           # refilled with views of the scratch by every drafting choose()
        self._m = 0
        self._alloc(256)

    def _alloc(self, m: int) -> None:
        """Per-node scratch arrays, grown to the largest proposal seen."""
        if m > self._m:
            self._m = m
            self._cond = np.zeros(m, np.float64)
            self._q = np.zeros(m, np.float64)
            # plan_step's PlanScratch as a plain tuple (numba dispatches it faster)
            self._scratch = (self._cond, self._q, self._sel, self._spar, self._o, self._bp, self._d, self._lf, self._lc)

    def set_cost(self, cost: CostCurve | None) -> None:
        self.cost = cost
        # a built-in curve's t1 is a placeholder: no step time is measured against it
        self.timed = cost is not None and not cost.builtin
        n = self.config.max_nodes + 1
        self._buckets = None if cost is None else CostBuckets(cost, n)
        # no measurement: assume verification costs like plain decoding, everywhere
        self.cost_table_short = np.arange(n + 1, dtype=np.float64) if cost is None else cost.table(n, short=True)
        # the learned costs start afresh with a new curve (their ratios are to it)
        self.steps = StepCosts(cost.ts if cost is not None else [1], n) if self.timed and self.config.learn_costs else None
        self._priors: dict = {}
        self.hold = HoldChooser(self.config.max_nodes)      # its evidence is in these costs' units

    def prior(self, n_past: int) -> Prior:
        """The calibrated costs of a decode laid after n_past cells (needs a
        curve): the short regime's up to SPLIT_KV_FREE_CELLS, else n_past's
        128-cell bucket, as cost_table_at picks them."""
        assert self.cost is not None
        return prior_at(self.cost, n_past, self.config.max_nodes + 1, self._priors)

    def observe_decode(self, width: int, prev: int, seconds: float, n_past: int) -> None:
        """A decode of `width` tokens after one of `prev` took `seconds`
        (learned where the curve is measured)."""
        if self.steps is not None:
            self.steps.observe(width, prev, seconds, self.prior(n_past))

    def plain_s(self, n_past: int) -> float:
        """Seconds of a plain one-token decode here, as learned (0 unknown)."""
        return self.steps.plain_s(self.prior(n_past)) if self.steps is not None else 0.0

    def cost_at(self, n_past: int, prev: int = 0) -> np.ndarray:
        """The cost table for a batch laid after n_past committed cells, the
        decode before it `prev` tokens wide: the short regime's (one-token
        steps with every thread) up to 256 cells, then interpolated between
        the calibrated contexts in 128-cell buckets; corrected by the learned
        step costs where they are learned, in units of the learned plain step."""
        if self.cost is None:
            return self.cost_table_short
        if self.steps is not None:
            prior = self.prior(n_past)
            table, self.shape_sensitive = self.steps.table(prior, prev)
            return table / self.steps.ratios()[2]
        assert self._buckets is not None        # set_cost makes them with the curve
        return cost_table_at(n_past, self.cost_table_short, self._buckets)[0]

    def t1(self, n_past: int) -> float:
        """Seconds of one plain one-token step at this context (as calibrated);
        needs a curve (the engine asks only when `timed`)."""
        assert self._buckets is not None
        return self._buckets.at(n_past)[1]

    def choose(self, tree: DraftTree, budget: int, n_past: int, prev: int = 0, gated: bool = True) -> StepPlan:
        """Gate and lay out this step's tree (the decode before it `prev`
        tokens wide): the plan of its batch, n_nodes = 0 a plain one-token
        step.  gated=False takes the budget-1 likeliest nodes (a held width)."""
        m = len(tree)
        self._planned = 0
        if m == 0 or budget < 2:
            return self._plain
        self._alloc(m)
        acc = self.acceptance
        cfg = self.config
        lim = min(budget, cfg.max_nodes)
        gated = gated and cfg.cost_gate
        if self.steps is not None and gated:
            lim = min(lim, self.steps.widest_allowed(self.prior(n_past)))
        self._table = self.cost_at(n_past, prev)
        self._overhead = self.overhead_rel if cfg.gate_overhead is None else cfg.gate_overhead
        k, nl = plan_step(tree.parents, tree.probs, tree.source, (acc.n_c, acc.a_c, acc.n_f, acc.a_f),
                          acc.K0, acc.K1, self._table, self._overhead, lim, gated, self._scratch)
        self._planned = m
        return self._lay(k, nl) if k else self._plain

    def held_width(self, budget: int) -> int:
        """The width the hold chooser holds now with `budget` slots left (0:
        none; always 0 with EngineConfig.hold_choice off)."""
        return self.hold.width(budget) if self.config.hold_choice else 0

    def judge_hold(self, tree: DraftTree, budget: int, n_past: int) -> None:
        """Show the hold chooser (core/hold.py) this step's proposal, just
        gated by choose(), with the learned costs of alternating and steady
        widths (StepCosts.widths).  Nothing where the costs are not
        shape-sensitive (it then holds nothing), a width is fixed
        (EngineConfig.hold_width) or hold_choice is off."""
        cfg = self.config
        if (not self.shape_sensitive or self.steps is None or cfg.hold_width or not cfg.hold_choice
                or not self.prior(n_past).shape_sensitive):
            # learned costs alone, noisy on a loaded CPU, never make the engine
            # hold a width where the quiet calibration found none
            if self.hold.held:
                self.hold.drop()
            return
        m = self._planned
        order = np.flatnonzero(tree.source[:m] != SOURCE_FILLER) if m else np.zeros(0, np.int64)
        order = order[np.argsort(-self._q[order], kind="stable")]      # the likeliest first, as plan_step ranks
        alt, steady = self.steps.widths(self.prior(n_past))
        overhead = self.overhead_rel if cfg.gate_overhead is None else cfg.gate_overhead
        ks, cost = self.hold.plan(self._q[order], steady, alt, overhead, min(budget, cfg.max_nodes))
        if len(order):
            self._hold_step = (order, ks, cost)      # decided with the shadow record (learn_shadow)
        else:
            self.hold.learn(ks, cost, np.zeros(0, np.bool_))

    def _lay(self, k: int, nl: int) -> StepPlan:
        """The drafting plan, refilled with views of plan_step's selection of
        k nodes and its layout over k + 1 slots and nl leaves."""
        nb = k + 1
        p = self._laid
        sel, pos = self._sel[:k], self._o[:nb]
        p.n_nodes, p.width, p.n_leaves = k, nb, nl
        p.nodes, p.node_parent, p.node_accepted, p.node_tested = sel, self._spar[:k], self._nacc[:k], self._ntest[:k]
        p.slot_pos, p.slot_parent, p.depth = pos, self._bp[:nb], self._d[:nb]
        p.leaf_first, p.leaf_count, p.batch_nodes = self._lf[:nb], self._lc[:nb], sel[pos[1:]]
        return p

    def plain(self) -> StepPlan:
        """A plain one-token step's plan (whatever was chosen)."""
        return self._plain

    def chosen_cost(self, k: int) -> float:
        """What the last choice of k draft nodes would cost, in plain steps
        (its decode and the engine's work, over a plain step's)."""
        return (float(self._table[k + 1]) + self._overhead) / (float(self._table[1]) + self._overhead)

    def note_step_time(self, other_s: float, n_past: int) -> None:
        """Fold a step's engine time outside llama_decode into the overhead
        the gate counts (in plain steps), where the curve's t1 is measured."""
        if self.timed:
            unit = self.plain_s(n_past) or self.t1(n_past)
            self.overhead_rel = 0.9 * self.overhead_rel + 0.1 * (other_s / unit)

    def learn(self, tree: DraftTree, plan: StepPlan, slot: int, carried) -> None:
        """Credit the acceptance model with what this step's verified draft
        nodes did (slot: the last committed batch slot; carried: the slots
        carried past a batch hole, or None); fills the plan's node_accepted
        and node_tested."""
        acc = self.acceptance
        learn_step(plan.width, plan.slot_parent, plan.slot_pos, plan.nodes, tree.probs, tree.source, self._cond,
                   plan.depth, slot, carried[0] if carried is not None else -1,
                   acc.n_c, acc.a_c, acc.n_f, acc.a_f, acc.pred_sum, plan.node_accepted, plan.node_tested)

    def record_shadow(self, shadow: list, root: int, tree: DraftTree, plan: StepPlan) -> None:
        """Keep this step's whole proposal (copies: a drafter may reuse its
        arrays) to be judged against the tokens committed after its root, the
        pending token at context index `root`; the plan's nodes are verified."""
        m = len(tree)
        verified = np.zeros(m, np.bool_)
        verified[plan.nodes] = True
        shadow.append(ShadowRecord(root, tree.tokens.copy(), tree.parents.copy(), tree.probs.copy(),
                                   tree.source.copy(), self._cond[:m].copy(), verified, np.zeros(m, np.int8),
                                   self._hold_step))
        self._hold_step = None
        if len(shadow) > SHADOW_KEEP:
            self._hold_decided(shadow.pop(0))       # judged on what is decided of it

    def learn_shadow(self, shadow: list, ctx: np.ndarray, n: int) -> list:
        """Credit the acceptance model with the recorded proposals' nodes that
        the committed tokens ctx[:n] now decide; return the proposals not yet
        fully decided."""
        acc = self.acceptance
        keep = []
        for rec in shadow:
            if shadow_learn(rec.tokens, rec.parents, rec.probs, rec.source, rec.cond, rec.verified, rec.state,
                            ctx[rec.root + 1:n], acc.n_c, acc.a_c, acc.n_f, acc.a_f, acc.pred_sum):
                keep.append(rec)
            else:
                self._hold_decided(rec)
        return keep

    def _hold_decided(self, rec) -> None:
        """Show the hold chooser what a shadow record's proposal turned out
        to be worth under each candidate (where judge_hold planned it)."""
        if rec.hold_step is not None:
            order, ks, cost = rec.hold_step
            self.hold.learn(ks, cost, rec.state[order] == 1)
