"""The held width chosen by cost (edgespec/core/hold.py, issue 51 item 3):
the chooser on hand-written costs, the gate's rule on a CPU-like curve, and
the replay of recorded H200 code edits under the H200 cost files (no verdict
here reads this machine's calibration)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from edgespec.calibration.curve import CostCurve
from edgespec.core.config import EngineConfig
from edgespec.core.gate import Gate
from edgespec.core.hold import MARGIN, PATIENCE, HoldChooser
from edgespec.drafters.tree import DraftTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = os.path.join(ROOT, "tests", "data", "h200")
N = 49                                          # table sizes: T = 0..48
ALT = np.concatenate([[0.0], [1.0], np.full(N - 2, 3.0)])       # changing widths: 3 plain steps (CUDA-like)
FLAT = np.concatenate([[0.0], [1.0], np.full(N - 2, 1.2)])      # steady widths: 1.2


def _step(ch: HoldChooser, steady, alt, matched_run: int, q: float = 0.8, n: int = 12) -> None:
    """One judged step: a chain of n drafts of path probability q**d, of
    which the first matched_run turned out on the model's path."""
    qs = q ** np.arange(1, n + 1)
    ks, cost = ch.plan(qs, steady, alt, 0.1, 48)
    ch.learn(ks, cost, np.arange(n) < matched_run)


def test_flat_steady_curve_holds():
    """Steady widths at 1.2 plain steps, changing ones at 3: drafts of which
    7 are accepted pay most held at 8 (8 tokens for 1.3 against the free
    choice's 8 for 3.1 at best)."""
    ch = HoldChooser(48)
    for _ in range(2 * PATIENCE):
        _step(ch, FLAT, ALT, 7)
    assert ch.held == 8
    v = ch.values()
    assert v[3] > v[0] * (1 + MARGIN)


def test_short_drafts_hold_narrow():
    """One accepted draft a step: a held 2 (2 tokens for 1.3) beats a held 8
    (2 for 1.3 too, but no better) only by its cost being no higher; what
    matters is that the chooser holds and never the free choice (2 for 3.1)."""
    ch = HoldChooser(48)
    steady = FLAT.copy()
    steady[2:] = 1.1 + 0.05 * np.arange(N - 2)       # wider steady batches cost a little more
    for _ in range(3 * PATIENCE):
        _step(ch, steady, ALT, 1)
    assert ch.held == 2


def test_steady_equal_to_alternating_never_holds():
    """A CPU-like chooser input (steady costs equal the alternating ones):
    holding can only tie the free choice, so it never holds, whatever is
    accepted."""
    cpu = np.concatenate([[0.0], 1.0 + 0.1 * np.arange(N - 1)])
    ch = HoldChooser(48)
    for i in range(10 * PATIENCE):
        _step(ch, cpu, cpu, [0, 3, 7, 12][i % 4])
    assert ch.held == 0 and ch.switches == 0


def test_no_flapping_on_alternating_evidence():
    """Evidence that swings every few steps between 'nothing is accepted'
    and 'long runs are' moves the choice at most a few times, not with the
    swings (the margin and the patience)."""
    ch = HoldChooser(48)
    for i in range(40 * PATIENCE):
        _step(ch, FLAT, ALT, 12 if (i // 3) % 2 else 0)
    assert ch.switches <= 2
    ch2 = HoldChooser(48)
    for i in range(40 * PATIENCE):          # every other step
        _step(ch2, FLAT, ALT, 12 if i % 2 else 0)
    assert ch2.switches <= 2


def test_gate_on_a_cpu_curve_never_judges():
    """The gate's rule: on a measured curve whose steady widths cost what
    changing ones do (no steady_rel), judge_hold leaves the chooser alone
    and nothing is held, however well drafts do."""
    ts = [1, 2, 4, 8, 16, 32, 48]
    cost = CostCurve(ts, [1.0, 1.05, 1.1, 1.3, 1.8, 2.9, 4.0], 0.01, {"prefix": 300})
    g = Gate(EngineConfig(hold_choice=True), cost)
    tree = DraftTree(np.arange(10, 20, dtype=np.int32), np.arange(-1, 9), np.full(10, 0.99, np.float32),
                     np.zeros(10, np.int32))
    for i in range(5 * PATIENCE):
        g.observe_decode(8 if i % 2 else 1, 1 if i % 2 else 8, 0.013 if i % 2 else 0.01, 300)
        g.choose(tree, 48, 300, 1)
        g.judge_hold(tree, 48, 300)
        g._hold_step = None
    assert not g.shape_sensitive
    assert g.held_width(48) == 0 and g.hold.n == 0


def test_gate_on_a_shape_curve_judges():
    """The same gate on the H200's shape files (steady widths far cheaper)
    is shape-sensitive and plans each step for the chooser."""
    from edgespec.replay.curves import shape_curve
    g = Gate(EngineConfig(hold_choice=True), shape_curve(os.path.join(H200, "cost-smollm2")))
    tree = DraftTree(np.arange(10, 20, dtype=np.int32), np.arange(-1, 9), np.full(10, 0.99, np.float32),
                     np.zeros(10, np.int32))
    g.choose(tree, 48, 300, 1)
    g.judge_hold(tree, 48, 300)
    assert g.shape_sensitive
    order, ks, cost = g._hold_step
    assert list(ks[1:]) == [1, 3, 7] and len(order) == 10
    assert cost[1] < cost[0]                    # a steady 2 costs less than the free choice's batch


def _replay_code_edits(model) -> dict:
    """`edgespec replay --json` on the recorded H200 code edits (4 prompts,
    two passes) under the H200 shape files: the ALL rows by method."""
    from conftest import cli_runner
    from edgespec.app.cli import main
    shapes = os.path.join(H200, "cost-smollm2")
    argv = ["replay", os.path.join(H200, "code-hold-4.jsonl"), "--prompts", os.path.join(H200, "code-4-prompts.jsonl"),
            "--model", model.model_path, "--methods", "suffix,suffix@holdcost,suffix@hold2,suffix@hold4", "--cost", shapes,
            "--overhead-ms", "0.25", "--gate-overhead", "0.1", "--draft-ms", "0.1", "--json"]
    r = cli_runner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    return {x["method"]: x for x in map(json.loads, r.stdout.splitlines()) if x.get("category") == "ALL"}


@pytest.mark.model
def test_replay_holdcost_chooses_on_code_edits(model):
    """The replay of `suffix@holdcost` (the width chosen by cost) reproduces
    the recorded outputs (replay() checks every token) and runs well ahead of
    `none`.  (Issue 51's target, within 3% of the best fixed hold, is not met:
    on these 4 prompts it models 1.82x against suffix@hold4's 2.00x; the
    chooser credits the free choice's deep batches too well.)"""
    by = _replay_code_edits(model)
    assert by["none"]["modelled_speedup"] == 1.0
    assert by["suffix@holdcost"]["modelled_speedup"] >= 1.5
