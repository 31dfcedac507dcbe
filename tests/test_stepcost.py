"""The learned step costs (core/stepcost.py) and the speed guard (core/guard.py)
on hand-made timing sequences: no model."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.core import guard as G
from edgespec.core.stepcost import FIRST_COST, RUN_PRIOR, Prior, StepCosts

MAX_T = 49
TS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 48, 64)
T1 = 0.005


def prior(c=lambda t: 1.0 + 0.5 * (t - 1), after=0.1, steady_factor=1.0) -> Prior:
    alt = np.array([0.0] + [c(t) for t in range(1, MAX_T + 1)])
    steady = alt.copy()
    steady[2:] *= steady_factor
    return Prior(alt, steady, after, T1)


def feed(sc: StepCosts, p: Prior, seq, seconds) -> None:
    """Decodes of the widths in seq, each timed by seconds(width, prev)."""
    prev = 0
    for w in seq:
        sc.observe(w, prev, seconds(w, prev), p)
        prev = w


def test_untimed_costs_are_the_prior():
    p = prior()
    table, sens = StepCosts(TS, MAX_T).table(p, 0)
    assert not sens
    assert table[1] == pytest.approx(1.0)
    # a batch that starts a run carries its share of the return to a plain step
    assert table[8] == pytest.approx(p.alt[8] + p.after / RUN_PRIOR)
    assert StepCosts(TS, MAX_T).table(p, 4)[0][8] == pytest.approx(p.alt[8])    # inside a run: paid


def test_converges_to_the_true_costs_and_charges_the_after_cost_to_the_batch():
    """The machine's batches cost 1.6x what the curve says and a one-token
    decode after a batch 0.3 plain steps more than one after a one-token
    decode: the table converges to the true cost of a batch, return included."""
    p = prior()
    true_after = 0.3

    def seconds(w, prev):
        if w == 1:
            return T1 * (1.0 + (true_after if prev >= 2 else 0.0))
        return T1 * 1.6 * p.alt[w]

    sc = StepCosts(TS, MAX_T)
    rng = np.random.default_rng(0)
    feed(sc, p, [int(x) for x in rng.choice([1, 1, 4, 8, 16], size=600)], seconds)
    table, _ = sc.table(p, 1)
    for w in (4, 8, 16):
        assert table[w] == pytest.approx(1.6 * p.alt[w] + true_after / sc.run, rel=0.03)
    assert 1.0 < sc.run < 3.5        # runs of batches in a random sequence, 3 in 5 steps a batch: 2.5 long on average
    assert table[1] == pytest.approx(1.0, rel=0.01)
    assert sc.plain_s(p) == pytest.approx(T1, rel=0.01)


def test_a_width_never_seen_backs_off_to_the_pooled_ratio():
    p = prior()
    sc = StepCosts(TS, MAX_T)
    feed(sc, p, [1, 4] * 200, lambda w, prev: T1 * (2.0 * p.alt[w] if w > 1 else 1.0))
    table, _ = sc.table(p, 1)
    assert table[32] > 1.7 * p.alt[32]          # never timed at 32, but batches here cost double


def test_adapts_when_the_costs_change_mid_run():
    p = prior()
    sc = StepCosts(TS, MAX_T)
    feed(sc, p, [1, 8] * 300, lambda w, prev: T1 * (p.alt[w] if w > 1 else 1.0))
    assert sc.table(p, 1)[0][8] == pytest.approx(p.alt[8], rel=0.05)     # a one-token decode after a batch costs nothing more
    # another program takes the cores: batches now cost 3x (one-token decodes as before)
    feed(sc, p, [1, 8] * 100, lambda w, prev: T1 * (3.0 * p.alt[w] if w > 1 else 1.0))
    assert sc.table(p, 1)[0][8] > 2.7 * p.alt[8]


def test_shape_sensitive_costs_favour_keeping_the_width():
    """Steady widths at a third of the alternating cost (CUDA graphs): the
    table marks the costs shape-sensitive; after a batch of 8 another batch
    of 8 is charged its steady cost, another width its alternating cost,
    and a run of batches started from a plain step its entry spread over
    the runs seen."""
    p = prior()
    sc = StepCosts(TS, MAX_T)
    seen = [0, 0]               # llama.cpp's CUDA rule: the third decode of a width on replays its graph

    def seconds(w, prev):
        seen[0] = seen[0] + 1 if w == seen[1] else 1
        seen[1] = w
        if w == 1:
            return T1 * (2.5 if prev >= 2 else 1.0)
        return T1 * p.alt[w] * (0.35 if seen[0] >= 3 else 1.0)

    feed(sc, p, ([1] * 3 + [8] * 6) * 40, seconds)
    table, sens = sc.table(p, 8)
    assert sens
    assert table[8] == pytest.approx(0.35 * p.alt[8], rel=0.05)
    assert table[4] == pytest.approx(p.alt[4], rel=0.05)
    entry, _ = sc.table(p, 1)
    assert sc.run == pytest.approx(6.0, rel=0.1)
    assert entry[8] == pytest.approx(0.35 * p.alt[8] + (0.65 * p.alt[8] + 1.5) / sc.run, rel=0.05)
    # on a CPU (steady = alternating) nothing of this applies
    cpu = StepCosts(TS, MAX_T)
    feed(cpu, p, ([1] * 3 + [8] * 6) * 40, lambda w, prev: T1 * (p.alt[w] if w > 1 else 1.0))
    assert not cpu.table(p, 8)[1]


def test_cuda_graph_captures_are_charged_to_the_batch_not_to_plain_steps():
    """Under llama.cpp's CUDA rule every change of width costs an uncaptured
    decode and then a capture, one-token decodes included: the plain step is
    learned as the replayed one, the return to plain decoding as both extra
    decodes, and a width as steady only from its third decode."""
    p = prior(after=0.0)
    sc = StepCosts(TS, MAX_T)
    seen = [0, 0]
    eager, capture = 1.5, 2.5             # plain steps

    def seconds(w, prev):
        seen[0] = seen[0] + 1 if w == seen[1] else 1
        seen[1] = w
        extra = eager if seen[0] == 1 else capture if seen[0] == 2 else 0.0
        return T1 * (0.4 * p.alt[w] + extra)

    feed(sc, p, ([1] * 6 + [8] * 5) * 60, seconds)
    alt, steady, plain, after = sc.ratios()
    assert plain == pytest.approx(0.4, rel=0.02)
    assert sc.plain_s(p) == pytest.approx(0.4 * T1, rel=0.02)
    table, sens = sc.table(p, 8)
    assert sens
    assert table[8] == pytest.approx(0.4 * p.alt[8], rel=0.02)          # the replayed batch
    back = (2.0 * p.alt[1] + p.after) * after - 2.0 * p.alt[1] * plain
    # within the pull of the prior's two pseudo-observations (of no extra) on a window of 32
    assert 0.92 * (eager + capture) < back <= eager + capture


def test_the_widest_batch_ramps_up_with_what_was_timed():
    """At first a batch may cost FIRST_COST plain steps (by the prior: c(T) =
    1 + 0.5 (T - 1) here, so 7 tokens); while batches run dearer than
    calibrated, twice the dearest timed; once they confirm the calibration,
    any."""
    p = prior()
    sc = StepCosts(TS, MAX_T)
    assert p.alt[7] <= FIRST_COST < p.alt[8]
    assert sc.widest_allowed(p) == 7

    def dear(w, prev):
        return T1 * (3.0 * p.alt[w] if w > 1 else 1.0)
    feed(sc, p, [1, 6], dear)
    assert sc.widest_allowed(p) == 13          # c(13) = 7 = 2 c(6)
    feed(sc, p, [13], dear)
    assert sc.widest_allowed(p) == 27
    calibrated = StepCosts(TS, MAX_T)
    feed(calibrated, p, [1, 6], lambda w, prev: T1 * p.alt[w])
    assert calibrated.widest_allowed(p) == MAX_T


def test_guard_stops_drafting_after_a_loss_and_lets_it_try_again_later():
    g = G.SpeedGuard()
    g.begin()
    assert g.allows()
    lost = G.SLACK + 1
    g.account(step_s=(lost + 1) * T1, n_committed=1, plain_s=T1)    # a failed batch
    assert not g.allows()
    n = 0
    while not g.allows():
        g.account(step_s=T1, n_committed=1, plain_s=T1)           # plain steps: the balance stays
        n += 1
    # room comes back at EPS per token: the loss beyond SLACK over EPS
    assert n == pytest.approx((lost - G.SLACK) / G.EPS, abs=2)


def test_guard_carries_part_of_a_request_into_the_next():
    g = G.SpeedGuard()
    g.begin()
    g.account(step_s=30 * T1, n_committed=1, plain_s=T1)       # lost 29 plain steps
    g.begin()
    assert g.balance == -G.SLACK / 2                           # the next request starts on a shorter leash
    g.account(step_s=(G.SLACK / 2 + 1.5) * T1, n_committed=1, plain_s=T1)
    assert not g.allows()
    g.balance = 20.0                                           # a request that gained a lot
    g.begin()
    assert g.balance == G.SLACK


class _CudaLike:
    """A backend with llama.cpp's CUDA graph rule (ggml-cuda.cu,
    ggml_backend_cuda_graph_compute): a decode whose shape differs from the
    last one runs uncaptured (EAGER), the second of a shape captures the graph
    (CAPTURE), the third on replays it (cost(T)); a clock, no model."""
    EAGER, CAPTURE = 2.5e-3, 3.5e-3
    n_vocab, n_ctx = 30000, 4096

    def __init__(self):
        self.now, self.n_past, self.last, self.seen = 0.0, 0, None, 0

    @staticmethod
    def cost(t: int) -> float:
        return 1e-3 * (1.0 + 0.1 * (t - 1))

    def clock(self) -> float:
        return self.now

    def reset(self) -> None:
        self.n_past, self.last = 0, None

    def prefill(self, toks, want_last_logits=True) -> None:
        self.n_past += len(toks)
        self.last = None

    def decode_tree(self, toks, depth, leaf_first, leaf_count, n_leaves) -> None:
        t = len(toks)
        self.seen = self.seen + 1 if t == self.last else 1
        self.last = t
        self.now += self.cost(t) + (self.EAGER if self.seen == 1 else self.CAPTURE if self.seen == 2 else 0.0)

    def logits(self):
        return None

    def keep(self, k: int) -> None:
        self.n_past += k


def test_calibration_times_plain_steps_as_plain_decoding_runs_them():
    """Under CUDA's graph rule a one-token decode right after a batch runs
    uncaptured and the next captures: t1 is the replayed plain step, the
    after-batch cost both extra decodes, and the steady widths the replayed
    batches (the alternating ones pay the uncaptured run)."""
    from edgespec.calibration.curve import measure_at

    be = _CudaLike()
    ts = [1, 2, 4, 8]
    steady: list = []
    t1, rel, after_s = measure_at(be, ts, 300, 3, np.random.default_rng(0), lambda: None, steady=steady)
    c1 = be.cost(1)
    assert t1 == pytest.approx(c1)
    assert after_s == pytest.approx(be.EAGER + be.CAPTURE)
    assert rel[1:] == pytest.approx([(be.cost(t) + be.EAGER) / c1 for t in ts[1:]])
    assert steady == pytest.approx([1.0] + [be.cost(t) / c1 for t in ts[1:]])

