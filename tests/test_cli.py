"""The `edgespec` command line, driven through click's CliRunner with the real
default model (SmolLM2-135M) and llama.cpp.  Generations are kept short."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from edgespec.bench.prompts import load_prompts
from edgespec.bench.report import format_report
from edgespec.bench.runner import RESULT_FIELDS
from edgespec.bench.stats import method_stats, speedup_ci
from edgespec.app.cli import main
from edgespec.models.sources import ModelFileError, default_model_path

pytestmark = pytest.mark.model

REPEAT_PROMPT = "Copy this list exactly: 1. apples, 2. bananas, 3. cherries, 4. dates, 5. figs, 6. grapes"
PATTERN_PROMPT = "red, green, blue, yellow, red, green, blue, yellow, red, green, blue, yellow, red,"
REQUIRED_JSON = ("text", "tokens", "n_prompt_tokens", "n_generated", "n_steps", "mean_accepted",
                 "prefill_s", "decode_s", "tokens_per_s", "stop_reason", "drafter")


@pytest.fixture(scope="module")
def model_path():
    try:
        return default_model_path()
    except ModelFileError as e:
        pytest.skip(str(e))


def invoke(args, input=None, env=None):
    # stdout and stderr apart (click >= 8.2 always keeps them apart; 8.1 needs the flag)
    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    return runner.invoke(main, args, input=input, env=env)


def assert_clean_error(result, *fragments):
    """Exit code != 0 through SystemExit, one 'Error: ...' line at the end, no traceback."""
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    # the error is the last line (a first-run calibration note may precede it)
    lines = result.stderr.strip().splitlines()
    err = lines[-1]
    assert err.startswith("Error:") and not any(ln.startswith("Error") for ln in lines[:-1]), lines
    for f in fragments:
        assert f in err, err


def gen_json(*args):
    r = invoke(["generate", "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# ---------------------------------------------------------------- generate
def test_generate_json(model_path):
    d = gen_json("--max-tokens", "16", "Name three colors.")
    for k in REQUIRED_JSON:
        assert k in d, k
    assert 1 <= d["n_generated"] <= 16
    assert d["n_generated"] == len(d["tokens"])
    assert d["stop_reason"] in ("stop", "length")
    assert d["drafter"] == "suffix" and d["model"] == model_path
    assert d["decode_s"] >= 0 and d["prefill_s"] > 0


def test_drafters_give_the_same_tokens(model_path):
    none = gen_json("--drafter", "none", "--max-tokens", "24", REPEAT_PROMPT)
    suffix = gen_json("--drafter", "suffix", "--max-tokens", "24", REPEAT_PROMPT)
    ungated = gen_json("--drafter", "suffix", "--no-gate", "--max-tokens", "24", REPEAT_PROMPT)
    assert none["n_draft_nodes"] == 0
    assert suffix["tokens"] == none["tokens"]
    assert ungated["tokens"] == none["tokens"]


def test_accepted_drafts_keep_the_tokens(model_path):
    # a raw repeating pattern: the suffix drafter's copies of it are accepted
    none = gen_json("--raw", "--drafter", "none", "--max-tokens", "24", PATTERN_PROMPT)
    ungated = gen_json("--raw", "--drafter", "suffix", "--no-gate", "--max-tokens", "24", PATTERN_PROMPT)
    assert ungated["tokens"] == none["tokens"]
    assert ungated["n_draft_accepted"] > 0
    assert ungated["n_steps"] < none["n_steps"]


def test_generate_streams_text_and_stats(model_path):
    r = invoke(["generate", "--max-tokens", "12", "--stats", "Say hello."])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip()
    assert r.stdout.endswith("\n")
    assert "tokens/step" in r.stderr and "llama_decode" in r.stderr and "acceptance" in r.stderr


def test_generate_raw_and_stdin(model_path):
    templated = gen_json("--max-tokens", "8", "Once upon a time")
    raw = gen_json("--raw", "--max-tokens", "8", "Once upon a time")
    assert raw["n_generated"] >= 1
    assert raw["n_prompt_tokens"] < templated["n_prompt_tokens"]
    r = invoke(["generate", "--raw", "--json", "--max-tokens", "8", "-"], input="Once upon a time")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == raw["tokens"]


def test_generate_usage_errors():
    r = invoke(["generate", "a.gguf", "prompt", "extra"])
    assert r.exit_code == 2 and "[MODEL] PROMPT" in r.output
    r = invoke(["generate", "   "])
    assert r.exit_code == 2 and "empty" in r.output
    r = invoke(["generate", "--drafter", "sufix", "prompt"])
    assert r.exit_code == 2 and "unknown drafter 'sufix'" in r.output
    r = invoke(["generate", "--drafter", "auto-nofoo", "prompt"])
    assert r.exit_code == 2 and "not a switch of 'auto'" in r.output


def test_drafter_spec_with_switches(model_path):
    none = gen_json("--drafter", "none", "--max-tokens", "16", REPEAT_PROMPT)
    d = gen_json("--drafter", "auto-notrigram-noadjacency", "--max-tokens", "16", REPEAT_PROMPT)
    assert d["drafter"] == "auto" and d["tokens"] == none["tokens"]


@pytest.mark.parametrize("kind", ["missing", "text", "truncated"])
def test_bad_model_file(model_path, tmp_path, kind):
    p = tmp_path / "model.gguf"
    if kind == "text":
        p.write_text("this is not a model\n")
    elif kind == "truncated":
        with open(model_path, "rb") as f:
            p.write_bytes(f.read(1 << 20))
    r = invoke(["generate", str(p), "hello"])
    assert_clean_error(r, str(p))


def test_bad_cache_type_option():
    r = invoke(["generate", "--cache-type-k", "q4_0", "hi"])
    assert r.exit_code == 2 and "cache-type-k" in r.output


def test_bad_sampling_option(model_path):
    assert_clean_error(invoke(["generate", "--temperature", "-1", "hi"]), "temperature")


def test_prompt_longer_than_context(model_path):
    r = invoke(["generate", "--ctx", "512", "word " * 700])
    assert_clean_error(r, "does not fit the context")


def test_prompt_longer_than_small_context(model_path):
    # in a subprocess: a llama.cpp abort would kill the test run
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    p = subprocess.run([sys.executable, "-m", "edgespec.app.cli", "generate", "--ctx", "256", "word " * 400],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 1, p.stderr[-500:]
    assert p.stderr.strip().startswith("Error:") and "context" in p.stderr


def test_ctx_below_the_minimum(model_path):
    """llama.cpp rounds a context up to a multiple of 256 cells: a smaller --ctx
    is refused with the minimum, instead of silently becoming 256."""
    r = invoke(["generate", "--ctx", "64", "hi"])
    assert r.exit_code == 2 and "x>=256" in r.output, r.output
    from edgespec import SpecModel
    with pytest.raises(ValueError, match="at least 256 tokens, not 64"):
        SpecModel(model_path, n_ctx=64, calibrate=False)


def test_gpu_layers_need_a_gpu_build(model_path):
    """--n-gpu-layers on a llama-cpp-python built without a GPU backend is one
    clear error (llama.cpp itself would run on the CPU without a word)."""
    from edgespec.backend.process import gpu_offload_available
    r = invoke(["generate", "--n-gpu-layers", "-1", "--max-tokens", "4", "hi"])
    if gpu_offload_available():
        assert r.exit_code == 0, r.output
    else:
        assert_clean_error(r, "built without a GPU backend", "CMAKE_ARGS")


# ---------------------------------------------------------------- calibrate
def test_calibrate(model_path, tmp_path, monkeypatch):
    """A run that names its own cache (EDGESPEC_CACHE_DIR, as .ci/run does with
    an empty directory) calibrates there, and conftest runs this test before
    every other model test, so the session model reuses this curve and
    self-check instead of measuring them again (the same key: model, threads,
    K cache; at the default --ctx, 4096, it measures every context the later
    runs need: a curve measured with --ctx 2048 stops at 1000 cells, and the
    first `generate` at the default context measured again).
    Otherwise a directory of its own: a test run must not replace the cached
    curve of the user's default cache."""
    cache = os.environ.get("EDGESPEC_CACHE_DIR") or str(tmp_path)
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", cache)
    r = invoke(["calibrate", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["ts"][0] == 1 and d["rel"][0] == 1.0 and len(d["ts"]) == len(d["rel"]) > 4
    assert [c["n_kv"] for c in d["longer"]] == [1000, 2000]
    assert d["meta"]["cache_file"].startswith(cache)
    assert os.path.isfile(d["meta"]["cache_file"])
    assert d["exactness"]["exact"] in (True, False) and d["exactness"]["max_t"] >= 2
    assert d["kernels"] == {"setting": "exact", "resolved": "exact", "price": None}    # EDGESPEC_KERNELS (conftest)


# ---------------------------------------------------------------- bench
def write_prompts(path, lines):
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return path


PROMPTS = [
    {"question_id": 1, "category": "copy", "turns": [REPEAT_PROMPT, "second turn is ignored"]},
    {"question_id": 2, "category": "chat", "turns": ["What is the capital of France?"]},
]


def test_bench_writes_results_and_table(model_path, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "results.jsonl"
    r = invoke(["bench", "--prompts", str(prompts), "--methods", "none,suffix,suffix@relaxed", "--max-tokens", "16",
                "--out", str(out)])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    head, rows = lines[0], [x for x in lines[1:] if x["kind"] == "result"]
    relaxed = [x for x in rows if x["method"] == "suffix@relaxed"]
    rows = [x for x in rows if x["method"] != "suffix@relaxed"]
    assert len(relaxed) == 2 and all(x["verify"] == "relaxed" and 0.0 <= x["rouge_l_to_none"] <= 1.0
                                     for x in relaxed)
    calib = {x["method"]: x for x in lines[1:] if x["kind"] == "calibration"}
    assert set(calib) == {"suffix", "suffix@relaxed"}
    assert sum(row["tested"] for row in calib["suffix"]["rows"]) > 0   # the copy prompt drafts
    assert "acceptance calibration" in r.stdout
    assert head["kind"] == "header" and head["model"] == model_path
    for k in ("n_threads", "n_ctx", "llama_cpp_version", "date", "hostname", "cpu", "cost_curve"):
        assert k in head, k
    # CPU with 2+ threads: q8_0 K cache, every one-token decode on every thread
    if head["n_threads"] > 1:
        assert head["cache_type_k"] == "q8_0" and head["single_token_threads"] == str(head["n_threads"])
    assert "K cache " + head["cache_type_k"] in r.stdout
    assert len(rows) == 4
    assert [(x["question_id"], x["method"]) for x in rows] == [(1, "none"), (1, "suffix"), (2, "none"), (2, "suffix")]
    for x in rows:
        for k in RESULT_FIELDS:
            assert k in x, k
        assert x["n_generated"] <= 16 and x["n_steps"] >= 1
        assert x["identical_to_none"] is True
    # progress on stderr, tables on stdout
    assert "[1/2] copy" in r.stderr and "[2/2] chat" in r.stderr
    for word in ("copy", "chat", "all", "tok/s", "speedup", "identical", "2/2", "1.00x"):
        assert word in r.stdout, word
    assert "note: 2 categories have fewer than 5 prompts (copy, chat)" in r.stdout
    # the same tables again from the file
    r2 = invoke(["bench-report", str(out)])
    assert r2.exit_code == 0, r2.output
    assert r2.stdout.strip() == r.stdout.strip()


def test_bench_llama_cpp_python_methods(model_path, tmp_path):
    # a prompt longer than n_batch (512): llama-cpp-python's prompt lookup needs
    # logits_all=True for it
    long = {"question_id": 3, "category": "long",
            "turns": ["Summarize in one sentence: " + "The cat sat on the mat and looked at the dog. " * 50]}
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS + [long])
    out = tmp_path / "r.jsonl"
    r = invoke(["bench", "--prompts", str(prompts), "--category", "long", "--methods",
                "none,llama-cpp-python,llama-cpp-python-pld", "--max-tokens", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in out.read_text().splitlines()][1:]
    assert [x["method"] for x in rows] == ["none", "llama-cpp-python", "llama-cpp-python-pld"]
    assert rows[0]["n_prompt_tokens"] > 512
    for x in rows[1:]:
        assert x["n_steps"] is None and x["mean_accepted"] is None
        assert x["text"] and x["n_generated"] == len(x["tokens"]) >= 1
        assert isinstance(x["identical_to_none"], bool)


@pytest.mark.parametrize("content, fragment", [
    ([PROMPTS[0], "{not json"], ":2: not valid JSON"),
    ([PROMPTS[0], {"question_id": 3, "category": "x"}], ":2: needs `turns`"),
    ([PROMPTS[0], {"question_id": 3, "turns": []}], ":2: needs `turns`"),
    ([], "no prompts"),
])
def test_bench_malformed_prompts(tmp_path, content, fragment):
    prompts = write_prompts(tmp_path / "bad.jsonl", content)
    r = invoke(["bench", "--prompts", str(prompts), "--methods", "none", "--out", str(tmp_path / "o.jsonl")])
    assert_clean_error(r, fragment)
    assert not (tmp_path / "o.jsonl").exists()


def test_bench_input_errors(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    assert_clean_error(invoke(["bench", "--prompts", str(tmp_path / "nope.jsonl")]), "not found")
    assert_clean_error(invoke(["bench", "--prompts", str(prompts), "--methods", "none,medusa"]), "medusa")
    assert_clean_error(invoke(["bench", "--prompts", str(prompts), "--category", "poetry"]), "poetry")
    r = invoke(["bench"])
    assert r.exit_code == 2 and "--prompts" in r.output
    assert_clean_error(invoke(["bench-report", str(tmp_path / "missing.jsonl")]), "not found")


# ---------------------------------------------------------------- report (no model)
def _row(cat, method, n, dec, steps=None, acc=None, same=None, eng=None):
    return {"kind": "result", "category": cat, "method": method, "n_generated": n, "decode_s": dec,
            "n_steps": steps, "mean_accepted": acc, "identical_to_none": same, "engine_s": eng,
            "decode_call_s": None if eng is None else dec - eng}


def test_format_report_arithmetic():
    rows = [
        _row("a", "none", 11, 1.0, 10, 1.0, True, 0.01),
        _row("a", "suffix", 11, 0.5, 5, 2.0, True, 0.02),
        _row("b", "none", 21, 1.0, 20, 1.0, True, 0.02),
        _row("b", "suffix", 21, 2.0, 10, 2.0, False, 0.04),
        _row("b", "llama-cpp-python", 21, 4.0, None, None, True),
    ]
    st = method_stats([r for r in rows if r["method"] == "suffix"])
    assert st["tokens_per_s"] == pytest.approx(30 / 2.5)
    assert st["mean_accepted"] == pytest.approx(2.0)
    assert (st["identical"], st["n_compared"]) == (1, 2)
    assert st["engine_ms_per_step"] == pytest.approx(4.0)   # 0.02/5 and 0.04/10 s per step
    text = format_report(rows)
    lines = text.splitlines()
    a = lines.index("a (1 prompt)")
    # rows without question_id cannot be paired: no confidence interval ("-")
    assert lines[a + 3].split()[:6] == ["none", "10.0", "1.00", "1.00x", "-", "-"]
    assert lines[a + 4].split()[:6] == ["suffix", "20.0", "2.00", "2.00x", "-", "1/1"]
    al = lines.index("all (2 prompts)")
    assert lines[al + 4].split()[:6] == ["suffix", "12.0", "2.00", "0.80x", "-", "1/2"]
    assert lines[al + 5].split()[:6] == ["llama-cpp-python", "5.0", "-", "0.33x", "-", "1/1"]


def _pair(q, rep, dec_none, dec_m, n=101):
    return [dict(_row("c", "none", n, dec_none), question_id=q, repeat=rep),
            dict(_row("c", "suffix", n, dec_m), question_id=q, repeat=rep)]


def test_speedup_ci():
    # one pass, prompts resampled: four prompts at 2x, 2x, 1x, 1x (equal decode time
    # of none) -> pooled 4/3x; resamples range from all-1x to all-2x
    rows = [x for q, d in enumerate([0.5, 0.5, 1.0, 1.0]) for x in _pair(q, 0, 1.0, d)]
    lo, hi = speedup_ci(rows, "suffix")
    assert 1.0 <= lo < 4 / 3 < hi <= 2.0
    assert speedup_ci(rows[:6], "suffix") is None            # 3 units: too few
    assert speedup_ci(rows, "auto") is None                  # method not in the rows
    # several passes: resampled within each prompt, so a prompt that is 2x in
    # every pass and one that is 1x in every pass give no spread at all
    rows = [x for rep in range(3) for q, d in ((0, 0.5), (1, 1.0)) for x in _pair(q, rep, 1.0, d)]
    lo, hi = speedup_ci(rows, "suffix")
    assert lo == pytest.approx(4 / 3) and hi == pytest.approx(4 / 3)
    # ... while noise between passes widens it around the pooled figure
    rows = [x for rep, d in enumerate((0.9, 1.0, 1.1, 0.95, 1.05)) for x in _pair(0, rep, 1.0, d)]
    lo, hi = speedup_ci(rows, "suffix")
    assert lo < 1.0 < hi and hi - lo > 0.05
    text = format_report(rows)
    line = [x for x in text.splitlines() if x.startswith("suffix")][0]
    assert f"{lo:.2f}-{hi:.2f}" in line.split()


def test_load_prompts_filters(tmp_path):
    p = write_prompts(tmp_path / "p.jsonl", PROMPTS + [{"question_id": 9, "category": "chat", "turns": ["Hi"]}, ""])
    assert [x.question_id for x in load_prompts(str(p))] == [1, 2, 9]
    assert [x.question_id for x in load_prompts(str(p), categories=["chat"])] == [2, 9]
    assert [x.question_id for x in load_prompts(str(p), categories=["chat"], limit=1)] == [2]
    assert load_prompts(str(p))[0].turn == REPEAT_PROMPT


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_ci_script_runs_the_readme_test_command():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ci = open(os.path.join(root, ".ci", "run")).read()
    readme = open(os.path.join(root, "README.md")).read()
    assert "set -euo pipefail" in ci
    # the README's test command, run in a fresh virtualenv, then the wheel smoke job
    assert "pip install -e '.[test]' && python -m pytest -q" in readme
    for step in ("-m venv", "pip install -e '.[test]'", "python -m pytest -q", "unset PYTHONPATH",
                 "pip wheel", "edgespec generate", "edgespec build-corpus --preset stdlib"):
        assert step in ci, step
    assert os.access(os.path.join(root, ".ci", "run"), os.X_OK)


def test_bench_repeat_runs_fresh_passes(model_path, tmp_path, monkeypatch):
    """--repeat 2: every (prompt, method) twice, tagged by pass, each pass from a
    fresh session; the report pools them and shows the per-pass range."""
    from edgespec.app.api import SpecModel
    fresh = []
    orig = SpecModel.new_session

    def new_session(self):
        fresh.append(len(self._engines))
        orig(self)
        fresh.append(len(self._engines))

    monkeypatch.setattr(SpecModel, "new_session", new_session)
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    out = tmp_path / "results.jsonl"
    r = invoke(["bench", "--prompts", str(prompts), "--methods", "none,suffix", "--max-tokens", "12",
                "--repeat", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["repeat"] == 2
    rows = [x for x in lines[1:] if x["kind"] == "result"]
    assert sorted((x["repeat"], x["method"]) for x in rows) == [(0, "none"), (0, "suffix"), (1, "none"), (1, "suffix")]
    assert all(x["identical_to_none"] for x in rows)
    assert rows[0]["tokens"] == rows[2]["tokens"]          # greedy: both passes give the same answer
    calib = [x for x in lines[1:] if x["kind"] == "calibration"]
    assert [x["repeat"] for x in calib] == [0, 1]
    # the second pass started from a fresh session: the engines of none and
    # suffix (and the model's own) were dropped, one fresh engine remained
    assert fresh == [2, 1]
    assert "[pass 2/2] [1/1] copy" in r.stderr
    assert "copy (1 prompt x 2 passes)" in r.stdout and "passes" in r.stdout.splitlines()[5]
    assert "2 passes (each a fresh session)" in r.stdout and "fewer than 5 prompts" not in r.stdout


def test_new_session_forgets_learned_statistics(model):
    model.generate(REPEAT_PROMPT, max_tokens=8, drafter="suffix")
    old = model.engine_for("suffix")
    old.acceptance.n_c[0, 9] += 5.0          # what a session learned (drafting itself is timing-dependent)
    model.new_session()
    new = model.engine_for("suffix")
    assert new is not old and new.acceptance.n_c.sum() == 0
    assert model.backend.n_past == 0 and model.engine is model.engine_for("none")


def test_generate_options_make_the_run_config(monkeypatch):
    """Every default is held once (run/settings.py): generate's options,
    untouched, make RunConfig's defaults, and reach the command as one
    `config` in their place."""
    import dataclasses
    from edgespec.app.cli.generate import generate
    from edgespec.app.cli.options import RUN_OPTIONS, run_config_options
    from edgespec.run.settings import RunConfig
    from edgespec.run.kernels import ENV

    monkeypatch.delenv(ENV, raising=False)
    d = generate.make_context("generate", ["hello"]).params      # the values click hands the command
    seen = []
    command = run_config_options(lambda **kw: seen.append(kw))
    command(**{k: d[k] for k in (*RUN_OPTIONS, "no_gate", "memory_file", "no_memory")}, raw=True)
    assert seen == [{"config": RunConfig.defaults(), "raw": True}]
    assert set(RUN_OPTIONS) <= {f.name for f in dataclasses.fields(RunConfig)}
    command(**{**{k: d[k] for k in RUN_OPTIONS}, "n_ctx": 1024, "no_gate": True, "memory_file": None,
               "no_memory": True})
    assert seen[1]["config"] == RunConfig.defaults().but(n_ctx=1024, cost_gate=False, memory=False)


def test_rpc_and_verbose_options_reach_the_run_config(monkeypatch):
    """--rpc, --tensor-split, --rpc-output and --verbose are run settings
    like the others, and generate, calibrate and bench make their RunConfig
    from the same shared options (run_config_options)."""
    from click import BadParameter

    from edgespec.app.cli.bench import bench
    from edgespec.app.cli.calibrate import calibrate
    from edgespec.app.cli.generate import generate
    from edgespec.app.cli.options import RUN_OPTIONS, run_config_options
    from edgespec.run.kernels import ENV

    monkeypatch.delenv(ENV, raising=False)
    args = ["--rpc", "h:1,h:2", "-ts", "1/3", "--rpc-output", "remote", "--ctx", "1024", "--verbose"]
    configs = []
    for cmd, extra in ((generate, ["hello"]), (calibrate, []), (bench, ["--prompts", "p.jsonl"])):
        with cmd.make_context(cmd.name, args + extra) as ctx:
            run_config_options(lambda **kw: configs.append(kw["config"]))(
                **{k: v for k, v in ctx.params.items() if k in RUN_OPTIONS})
    c = configs[0]
    assert (c.rpc, c.tensor_split, c.rpc_output, c.n_ctx, c.verbose) == (["h:1", "h:2"], [1.0, 3.0], "remote",
                                                                          1024, True)
    assert configs[1] == c and configs[2] == c
    with pytest.raises(BadParameter, match="HOST:PORT"):
        generate.make_context("generate", ["--rpc", "h:x", "hello"])


def test_run_config_refuses_what_is_no_setting():
    from edgespec.run.settings import RunConfig
    from edgespec.errors import ConfigError

    with pytest.raises(TypeError, match="unknown setting 'ctx'"):
        RunConfig().but(ctx=1024)
    with pytest.raises(ConfigError, match="calibrate must be"):
        RunConfig(calibrate="later")
    with pytest.raises(ConfigError, match="a list of corpus paths"):
        RunConfig(corpora="a.corpus")
    assert RunConfig(corpora=["a", "b"]).corpora == ("a", "b")


def test_run_config_makes_the_engine_config():
    """EngineConfig comes from RunConfig in one place (engine_config), which
    checks its ranges once, when the RunConfig is made: --max-nodes 300 is
    refused before a model loads."""
    from edgespec.run.settings import RunConfig
    from edgespec.core.config import EngineConfig
    from edgespec.errors import ConfigError

    with pytest.raises(ConfigError, match=r"max_nodes must be in 1\.\.256"):
        RunConfig(max_nodes=300)
    with pytest.raises(ConfigError, match="verify mode"):
        RunConfig(verify="bogus")
    e = RunConfig(max_nodes=40, cost_gate=False, verify="relaxed").engine_config(batch_cap=32)
    assert (e.max_nodes, e.cost_gate, e.verify.mode) == (32, False, "relaxed")
    assert RunConfig().engine_config() == EngineConfig()


def test_run_config_makes_the_backend_settings():
    """The backend's settings come from RunConfig in one value
    (backend_settings), whose defaults RunConfig reads (n_ctx's once)."""
    from edgespec.run.settings import RunConfig
    from edgespec.backend.llama import EXACT_MAX_BATCH
    from edgespec.backend.settings import BackendSettings, Loadout

    assert RunConfig().n_ctx == BackendSettings().n_ctx
    run = RunConfig(n_ctx=1024, n_threads=3, max_nodes=16, rpc="h:1,h:2", rpc_output="remote", verbose=True,
                    kernels="fast")
    load = run.resolve_kernels("no.gguf")
    b = run.backend_settings(load)
    assert b.load is load                   # taken as it is
    assert (b.n_ctx, b.n_threads, b.max_nodes, b.max_leaves, b.verbose) == (1024, 3, EXACT_MAX_BATCH, None, True)
    assert (b.rpc, b.rpc_output, load.exact, load.flash_attn, load.tiled_mm) == (["h:1", "h:2"], "remote", False,
                                                                               False, "1")
    assert load.cache_type_k == "f16" and load.offloaded      # fast kernels over RPC: not a CPU's fast path
    gpu = RunConfig(n_gpu_layers=-1, kernels="fast")
    g = gpu.resolve_kernels("no.gguf")          # fast changes nothing on a GPU
    # not exact with layers on a GPU: the backend's own rule before the Loadout held it (backend.exact was False)
    assert (g.exact, g.flash_attn, g.tiled_mm, g.cache_type_k, g.offloaded) == (False, None, "0", "f16", True)
    # fast asked over RPC with a layer count: the exact options load, so the K cache follows exact kernels
    r = RunConfig(n_gpu_layers=8, rpc="h:1", kernels="fast", n_threads=3).resolve_kernels("no.gguf")
    assert (r.exact, r.flash_attn, r.cache_type_k) == (True, None, "q8_0")
    assert BackendSettings().but(cache_type_k="f16", exact=False).load == Loadout(cache_type_k="f16", exact=False)
    with pytest.raises(TypeError):
        BackendSettings().but(ctx=1)


def test_auto_k_cache_is_q8_0_for_exact_threads_and_for_fast_kernels_on_cpu():
    """K cache "auto": q8_0 where exactness needs it (2+ threads) and for fast
    kernels on a CPU (flash attention off: the prompt's K x Q product then runs
    the 8-bit kernel, which reads prompts faster); f16 for exact kernels on one
    thread (flash attention's tiled prompt kernel is f16-only) and on a GPU."""
    from edgespec.backend.process import auto_cache_type_k
    assert auto_cache_type_k(True, 2) == auto_cache_type_k(True, 16) == "q8_0"
    assert auto_cache_type_k(True, 1) == "f16"
    assert auto_cache_type_k(False, 1, fast_cpu=True) == auto_cache_type_k(False, 2, fast_cpu=True) == "q8_0"
    assert auto_cache_type_k(False, 2) == "f16"          # offloaded: not exact, not fast on a CPU


def test_run_config_resolves_the_kernels(monkeypatch, tmp_path):
    """The kernels and the K cache are resolved in one place
    (RunConfig.resolve_kernels -> edgespec.run.kernels.loadout): auto timed
    only on a CPU and fast until timed, llama.cpp's defaults ("exact") with
    layers on a GPU or on RPC workers, a named setting as named; the K cache
    follows what loads."""
    from edgespec.run.settings import RunConfig
    from edgespec.run.kernels import ENV

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))       # nothing measured here

    def got(**kw):
        lo = RunConfig(**{"n_threads": 2, **kw}).resolve_kernels("no.gguf", measure=False)
        return lo.setting, lo.kernels, lo.cache_type_k, lo.price, lo.source
    assert RunConfig(kernels="auto").times_kernels() and RunConfig(kernels=None).times_kernels()
    assert not RunConfig(kernels="auto", rpc="h:1").times_kernels()
    assert not RunConfig(kernels="auto", n_gpu_layers=-1).times_kernels()
    assert got(kernels="auto") == ("auto", "fast", "q8_0", None, "untimed")
    assert got(kernels="auto", n_gpu_layers=-1) == ("auto", "exact", "f16", None, "offloaded")
    assert got(kernels="auto", rpc="h:1") == ("auto", "exact", "q8_0", None, "offloaded")
    assert got(kernels="exact") == ("exact", "exact", "q8_0", None, "asked")
    assert got(kernels="exact", n_threads=1)[2] == "f16"
    assert got(kernels="fast", cache_type_k="f16") == ("fast", "fast", "f16", None, "asked")
    monkeypatch.setenv(ENV, "fast")
    assert not RunConfig(kernels=None).times_kernels()
    assert got(kernels=None) == ("fast", "fast", "q8_0", None, "asked")
