"""A device's per-decode extra (edgespec/replay/steps.py, tools/fit_step_costs.py)
and `edgespec replay --json`, on recorded H200 data in tests/data/h200/ (no
verdict here reads this machine's calibration)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from edgespec.bench.results import read_results
from edgespec.replay.steps import Shapes, StepTerms, counts, edgespec_rows, fit_terms, load_terms, predict_s

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = os.path.join(ROOT, "tests", "data", "h200")
SHAPES = os.path.join(H200, "cost-smollm2")
FIT2 = os.path.join(H200, "cost-smollm2-fit2")
RECORDED = os.path.join(H200, "code-hold-4.jsonl")


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_terms_charge_by_kind_and_round_trip():
    t = StepTerms.from_json({"plain_ms": 0.1, "draft_ms": 1.0, "held_ms": 0.2, "node_ms": 0.05})
    assert t.extra_s(1, False) == pytest.approx(0.1e-3)
    assert t.extra_s(5, False) == pytest.approx(1.0e-3 + 4 * 0.05e-3)
    assert t.extra_s(5, True) == pytest.approx(0.2e-3 + 4 * 0.05e-3)
    assert StepTerms.from_json(t.to_json()) == t
    assert load_terms(SHAPES) is None                   # the bare shapes: charged as before
    assert load_terms(FIT2) == StepTerms.from_json(json.load(open(FIT2 + "-steady.json"))["step"])


def test_fit_recovers_known_terms():
    """Answers timed as the bare shapes plus known terms: the fit finds them."""
    shapes = Shapes.load(SHAPES)
    truth = StepTerms(0.1e-3, 0.8e-3, 0.3e-3, 0.04e-3)
    rows = []
    for i in range(12):
        meth = ("none", "default", "suffix@hold2", "suffix@hold4")[i % 4]
        steps = 40 + 7 * i
        draft = {"none": 0, "default": 5 + i}.get(meth, steps)
        nodes = {"none": 0, "default": draft * (10 + i), "suffix@hold2": steps}.get(meth, 3 * steps)
        r = {"method": meth, "n_steps": steps, "n_draft_steps": draft, "n_draft_nodes": nodes, "decode_call_s": 0.0}
        r["decode_call_s"] = predict_s(r, shapes, truth)
        rows.append(r)
    fitted, info = fit_terms(rows, shapes)
    for a, b in zip(fitted.to_json().values(), truth.to_json().values()):
        assert a == pytest.approx(b, abs=1e-6)
    assert info["answers"] == 12 and info["rms"] < 1e-9
    # without held widths in the run, held_ms is not fitted (0), the others still are
    plain, _ = fit_terms([r for r in rows if "@" not in r["method"]], shapes)
    assert plain.held_s == 0.0 and plain.draft_s == pytest.approx(truth.draft_s, rel=1e-6)


def test_fitted_file_models_the_recorded_answers_better_than_the_bare_shapes():
    """On the recorded H200 answers (a subset of the hold run the terms were
    fitted on), the fitted terms bring every method's modelled total nearer
    its timed total than the bare shapes, and within 15%."""
    _, rows = read_results(RECORDED)
    rows = edgespec_rows(rows)
    shapes, fit = Shapes.load(SHAPES), load_terms(FIT2)
    assert counts(next(r for r in rows if r["method"] == "suffix@hold4"))["held"] > 0
    for meth in ("none", "default", "suffix@hold4"):
        rs = [r for r in rows if r["method"] == meth]
        timed = sum(r["decode_call_s"] for r in rs)
        bare = sum(predict_s(r, shapes, StepTerms()) for r in rs)
        fitted = sum(predict_s(r, shapes, fit) for r in rs)
        assert abs(fitted / timed - 1) < abs(bare / timed - 1), meth
        assert abs(fitted / timed - 1) < 0.15, (meth, fitted / timed)


def test_fit_tool_writes_what_replay_reads(tmp_path):
    out = str(tmp_path / "fit")
    _tool("fit_step_costs").main([RECORDED, "--shapes", SHAPES, "--out", out])
    terms = load_terms(out)
    assert terms is not None and terms.plain_s > 0
    assert json.load(open(out + "-alternating.json")) == json.load(open(SHAPES + "-alternating.json"))


@pytest.mark.model
def test_replay_json_lines(model, tmp_path):
    """`edgespec replay --json` on the recorded H200 code edits: one line per cost
    file, method (the bench's names, default and @hold4 included) and
    category, ALL pooled; the fitted terms are charged (a slower modelled
    time than the bare shapes), the bare shapes as before."""
    from conftest import cli_runner
    from edgespec.app.cli import main
    argv = ["replay", RECORDED, "--prompts", os.path.join(H200, "code-4-prompts.jsonl"), "--model", model.model_path,
            "--methods", "default,suffix@hold4", "--cost", f"{SHAPES},{FIT2}", "--overhead-ms", "0.25",
            "--gate-overhead", "0.1", "--draft-ms", "0.1", "--json"]
    r = cli_runner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    keys = {(x["cost"], x["method"], x["category"]) for x in lines}
    for cost in (SHAPES, FIT2):
        for meth in ("none", "default", "suffix@hold4"):
            for cat in ("ALL", "add_parameter", "convert_loop"):
                assert (cost, meth, cat) in keys
    by = {(x["cost"], x["method"], x["category"]): x for x in lines}
    assert by[(FIT2, "none", "ALL")]["modelled_speedup"] == 1.0
    hold = by[(FIT2, "suffix@hold4", "ALL")]
    assert hold["tokens_per_step"] > 1.5                        # held drafts are accepted on code edits
    assert hold["modelled_s"] > by[(SHAPES, "suffix@hold4", "ALL")]["modelled_s"]     # the terms are charged
    _, rows = read_results(RECORDED)
    timed = sum(r["decode_s"] for r in rows if r.get("method") == "suffix@hold4") / 2      # two passes
    assert hold["bench_s"] == pytest.approx(timed, rel=1e-3)
