"""The bench's reporting of exactness and divergences, its plot, the expert
llama-cpp-python peer's settings, raw prompts, and the code-editing prompt set.
The first tests need no model; those marked `model` run SmolLM2."""
from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from edgespec.bench.divergence import divergence, plain_logits_at
from edgespec.bench.llama_peer import _llama_kwargs
from edgespec.bench.methods import parse_methods
from edgespec.bench.prompts import BenchPrompt, load_prompts
from edgespec.bench.report import divergence_lines, format_report, plot_results
from edgespec.bench.runner import run_bench
from edgespec.errors import BenchError
from edgespec.app.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EDITS = os.path.join(ROOT, "benchmarks", "prompts", "code_edits.jsonl")


def result(qid, cat, method, n, decode_s, **kw):
    r = {"kind": "result", "question_id": qid, "category": cat, "method": method, "n_generated": n,
         "decode_s": decode_s, "tokens": list(range(n)), "n_steps": n if method != "llama-cpp-python" else None,
         "mean_accepted": 1.0 if method != "llama-cpp-python" else None,
         "identical_to_none": None if method == "none" else True, "verify": "exact"}
    r.update(kw)
    return r


EXACT = {"exact": True, "max_t": 48, "contexts": [100, 600], "max_abs_diff": 0.0, "failed": [],
         "argmax_flips": 0, "per_context": {}, "version": 1}
INEXACT = dict(EXACT, exact=False, max_abs_diff=0.25, failed=[8, 16], argmax_flips=3)


def test_header_line_states_the_self_check():
    rows = [result(1, "a", "none", 11, 1.0), result(1, "a", "suffix", 11, 0.5)]
    out = format_report(rows, {"model": "m.gguf", "exact": True, "exactness": EXACT})
    assert "exact: true (self-check: batches of 2..48 tokens gave logits bit-identical" in out
    out = format_report(rows, {"model": "m.gguf", "exact": False, "exactness": INEXACT})
    assert "exact: FALSE (self-check: batches of 8, 16 tokens differ from one-token decoding by up to 0.25" in out
    # an old results file, or a run without calibration: says it was not checked
    assert "exact: not checked" in format_report(rows, {"model": "m.gguf", "exact": True})
    assert "divergences from none: 0 of 1 runs" in out


def test_divergences_are_judged_against_the_self_check():
    """A divergence within twice the self-check's largest |dlogit| is a
    near-tie; a wider one, or any divergence on a model checked exact, or one
    whose re-decoding did not give none's token, is flagged as a likely bug."""
    near = {"index": 5, "none_token": 11, "token": 12, "gap": 0.4, "top2_gap": 0.4, "reproduced": True}
    far = {"index": 9, "none_token": 3, "token": None, "gap": 2.5, "top2_gap": 0.1, "reproduced": True}
    rows = [result(1, "a", "none", 11, 1.0),
            result(1, "a", "suffix", 11, 0.5, identical_to_none=False, divergence=near),
            result(1, "a", "auto", 11, 0.5, identical_to_none=False, divergence=far),
            result(1, "a", "suffix@relaxed", 11, 0.5, identical_to_none=False, verify="relaxed"),
            result(1, "a", "llama-cpp-python", 11, 0.9, identical_to_none=False)]
    lines = divergence_lines(rows, {"exactness": INEXACT})
    text = "\n".join(lines)
    # the lossy method and the llama-cpp-python peer are not counted
    assert "divergences from none: 2 of 2 runs of exact edgespec methods" in text
    suffix = next(ln for ln in lines if ln.strip().startswith("suffix"))
    assert "at token 5 (token 12 instead of 11): gap 0.4" in suffix and "near-tie (<= 2 x the self-check's 0.25)" in suffix
    auto = next(ln for ln in lines if ln.strip().startswith("auto"))
    assert "end of answer instead of 3" in auto and "NOT a near-tie" in auto and "look for a bug" in auto
    # checked exact (max |dlogit| 0): every divergence is a bug
    lines = divergence_lines(rows, {"exactness": EXACT})
    assert sum("NOT a near-tie" in ln for ln in lines) == 2
    bad = dict(near, reproduced=False)
    lines = divergence_lines([rows[0], dict(rows[1], divergence=bad)], {"exactness": INEXACT})
    assert "did not reproduce" in lines[-1]


def test_plot_draws_categories_and_methods(tmp_path):
    rows = [result(q, c, m, 20, t) for q, c in ((1, "rename"), (2, "fix_bug")) for m, t in
            (("none", 1.0), ("suffix", 0.5), ("llama-cpp-python", 1.5))]
    path = tmp_path / "speed.png"
    plot_results(rows, str(path), {"model": "/x/qwen.gguf", "cpu": "cpu", "n_threads": 2,
                                   "cache_type_k": "q8_0", "max_tokens": 128})
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    # the same through bench-report --plot, from a results file
    res = tmp_path / "r.jsonl"
    res.write_text("\n".join(json.dumps(r) for r in [{"kind": "header", "model": "m"}] + rows) + "\n")
    r = CliRunner().invoke(main, ["bench-report", str(res), "--plot", str(tmp_path / "b.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_report_pools_runs_of_the_same_settings(tmp_path):
    """A bench stopped part way and completed on the remaining prompts: the
    two files report as one (every prompt once, the header lists both runs);
    files of another model or setting, or holding the same prompt twice, are
    refused with one line."""
    head = {"kind": "header", "model": "/m/qwen.gguf", "max_tokens": 128, "raw": False, "n_threads": 2,
            "cache_type_k": "q8_0", "n_ctx": 4096, "date": "2026-11-23T06:44:00+00:00"}

    def write(name, h, rows):
        path = tmp_path / name
        path.write_text("\n".join(json.dumps(r) for r in [h] + rows) + "\n")
        return str(path)

    a = write("a.jsonl", head, [result(q, "rename", m, 21, t) for q in (1, 2) for m, t in (("none", 1.0), ("suffix", 0.5))])
    b = write("b.jsonl", dict(head, date="2026-11-23T13:40:00+00:00"),
              [result(3, "docstrings", m, 21, t) for m, t in (("none", 1.0), ("suffix", 0.25))])
    r = CliRunner().invoke(main, ["bench-report", a, b])
    assert r.exit_code == 0, r.output
    assert "pooled from 2 runs" in r.output and "a.jsonl (2026-11-23T06:44" in r.output and "b.jsonl (2026-11-23T13:40" in r.output
    all_rows = r.output.split("\nall (3 prompts)")[1]
    suffix = next(ln for ln in all_rows.splitlines() if ln.startswith("suffix"))
    assert "2.40x" in suffix          # 60 tokens in 1.25 s against 60 in 3 s
    assert "docstrings (1 prompt)" in r.output and "rename (2 prompts)" in r.output
    # a file from before --kernels (no such header field) was an exact run
    r = CliRunner().invoke(main, ["bench-report", a, write("f.jsonl", dict(head, kernels="exact"),
                                                           [result(5, "rename", "none", 21, 1.0)])])
    assert r.exit_code == 0 and "pooled from 2 runs" in r.output, r.output
    one = [result(4, "rename", "none", 21, 1.0)]
    for other, what in ((write("c.jsonl", dict(head, model="/m/llama.gguf"), one), "differ in model"),
                        (write("d.jsonl", dict(head, kernels="fast"), one), "differ in kernels"),
                        (write("e.jsonl", head, [result(3, "docstrings", "none", 21, 1.0)]), "also in an earlier file")):
        r = CliRunner().invoke(main, ["bench-report", b, other])
        assert r.exit_code == 1 and what in r.output and "Traceback" not in r.output, r.output


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import fails
    with pytest.raises(BenchError, match=r"pip install 'edgespec\[plot\]'"):
        plot_results([result(1, "a", "none", 5, 1.0)], str(tmp_path / "x.png"))
    res = tmp_path / "r.jsonl"
    res.write_text(json.dumps(result(1, "a", "none", 5, 1.0)) + "\n")
    r = CliRunner().invoke(main, ["bench-report", str(res), "--plot", str(tmp_path / "x.png")])
    assert r.exit_code == 1 and "edgespec[plot]" in r.output and "Traceback" not in r.output


def test_expert_peer_settings():
    """The expert runs llama-cpp-python with one thread per physical core for
    single tokens and batches, flash attention, and edgespec's K cache; the
    default peer keeps the library's own defaults (no arguments)."""
    from edgespec.backend.process import default_threads
    n = default_threads()
    kw = _llama_kwargs("llama-cpp-python-expert", None, "q8_0")
    assert kw == {"n_threads": n, "n_threads_batch": n, "flash_attn": True, "type_k": 8}
    assert _llama_kwargs("llama-cpp-python-expert", 3, "f16")["type_k"] == 1
    assert _llama_kwargs("llama-cpp-python", None, "q8_0") == {}
    assert _llama_kwargs("llama-cpp-python", 4, "q8_0") == {"n_threads": 4, "n_threads_batch": 4}
    assert _llama_kwargs("llama-cpp-python-pld", None, "q8_0") == {"logits_all": True}
    assert parse_methods("none,llama-cpp-python-expert") == ["none", "llama-cpp-python-expert"]


def test_code_edit_prompts():
    """24 code-editing prompts in the bench's format: five kinds of edit, six
    or more languages, realistic code (20-80 lines) in one fenced block, and an
    instruction to return the whole edited code."""
    prompts = load_prompts(EDITS)
    assert len(prompts) == 24
    assert len({p.question_id for p in prompts}) == 24
    cats = {p.category for p in prompts}
    assert cats == {"rename", "add_parameter", "fix_bug", "docstrings", "convert_loop"}
    with open(EDITS, encoding="utf-8") as f:
        langs = {json.loads(line)["language"] for line in f}
    assert {"python", "javascript", "rust", "go", "c", "sql"} <= langs
    for p in prompts:
        blocks = re.findall(r"```\w+\n(.*?)```", p.turn, flags=re.S)
        assert len(blocks) == 1, p.question_id
        assert 20 <= blocks[0].count("\n") <= 80, p.question_id
        assert "Return the whole edited code" in p.turn


# ------------------------------------------------------------------ with SmolLM2
@pytest.fixture(scope="module")
def smol():
    from edgespec import SpecModel
    from edgespec.models.sources import ModelFileError, default_model_path
    try:
        path = default_model_path()
    except ModelFileError as e:
        pytest.skip(str(e))
    m = SpecModel(path, drafter="none", n_ctx=1024, calibrate=False)
    yield m
    m.close()


@pytest.mark.model
def test_divergence_re_decodes_plain_logits(smol):
    """divergence() recomputes the logits `none` had at the first differing
    position: an answer that takes the second-best token there has a gap equal
    to the top-2 gap; one that ends there is measured against the best
    end-of-generation token; equal answers have no divergence."""
    toks = smol.prompt_tokens("List three colors.")
    ref = smol.generate(toks, max_tokens=12, drafter="none").tokens
    assert divergence(smol, toks, ref, list(ref)) is None
    i = 4
    lg = plain_logits_at(smol, toks, ref[:i])
    assert int(lg.argmax()) == ref[i]          # re-decoding reproduces none's choice
    second = int(np.argsort(lg)[-2])
    d = divergence(smol, toks, ref, ref[:i] + [second] + ref[i + 1:])
    assert d["index"] == i and d["none_token"] == ref[i] and d["token"] == second and d["reproduced"]
    assert d["gap"] == pytest.approx(d["top2_gap"]) and d["gap"] >= 0
    d = divergence(smol, toks, ref, ref[:i])
    eog = smol.backend.vocab.eog_mask()
    assert d["token"] is None and d["gap"] == pytest.approx(lg.max() - lg[eog].max())
    assert smol.backend.n_past == 0           # the cache is left empty


@pytest.mark.model
def test_bench_raw_and_expert_peer(smol, tmp_path):
    """--raw sends the text without the chat template (edgespec and
    llama-cpp-python's create_completion alike); the expert peer runs in its
    own process with the settings in the header."""
    prompts = [BenchPrompt(1, "raw", "Once upon a time, there was a")]
    head, rows = run_bench(smol, prompts, ["none", "llama-cpp-python-expert"], max_tokens=6, raw=True,
                           out_path=str(tmp_path / "r.jsonl"))
    assert head["raw"] is True
    peer = head["llama_cpp_python"]["llama-cpp-python-expert"]
    assert peer["flash_attn"] is True and peer["cache_type_k"] == smol.backend.cache_type_k
    res = {r["method"]: r for r in rows if r["kind"] == "result"}
    assert res["none"]["n_prompt_tokens"] == len(smol.prompt_tokens("Once upon a time, there was a", raw=True))
    assert "<|im_start|>" not in smol.detokenize(smol.prompt_tokens(prompts[0].turn, raw=True))
    assert res["llama-cpp-python-expert"]["text"] and res["llama-cpp-python-expert"]["n_generated"] >= 1


def test_replay_flat_cost_curve():
    """`edgespec replay --flat`: a GPU-like curve, c(T) = 1 + slope (T - 1) at every
    context and in the short regime, no after-batch cost, one-token times kept."""
    from edgespec.bench import replay_results as tool
    from edgespec.calibration.curve import CostCurve
    ts = [1, 2, 4, 8]
    measured = CostCurve(ts, [1.0, 1.9, 3.0, 5.5], 0.01, {"prefix": 300}, 0.008,
                         [{"n_kv": 1000, "t1_s": 0.012, "rel": [1.0, 2.0, 3.3, 6.0], "after_s": 0.0005}],
                         [1.0, 1.8, 2.9, 5.0], 0.0004, 0.0003)
    flat = CostCurve.from_json(tool.flat_curve(measured, 0.05).to_json())     # still a valid curve
    assert flat.t1_s == 0.01 and flat.t1_at(1000) == pytest.approx(0.012)
    for n_kv in (None, 300, 1000, 1500):
        assert flat.table(8, n_kv=n_kv)[1:] == pytest.approx([1 + 0.05 * (t - 1) for t in range(1, 9)])
    short = flat.table(8, short=True)
    assert short[2] / short[1] == pytest.approx(1.05)
