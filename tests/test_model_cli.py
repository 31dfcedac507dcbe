"""The command line's model naming and llama.cpp habits: `edgespec models` on
hand-made Ollama / LM Studio trees, -m / -hf / the aliases reaching the
library, shell completion of MODEL, --version, and --help's start-up time in
a fresh process.  No model is loaded: load_model is replaced by a recorder."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from test_model_sources import REPO, fake_gguf, hub, ollama_model

from edgespec.app.cli import generate as generate_cmd
from edgespec.backend.process import _check_llama_cpp_version
from edgespec.app.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def invoke(args, env=None):
    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    return runner.invoke(main, args, env=env, prog_name="edgespec")


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """HOME with an Ollama store (a chat model, a base model) and an LM Studio folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path / "zoo"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    root = tmp_path / ".ollama" / "models"
    chat = ollama_model(root, "qwen2.5-coder", "1.5b", fake_gguf("qwen2", file_type=15, ctx=32768))
    ollama_model(root, "basey", "latest", fake_gguf("gemma3", file_type=7, ctx=8192, template=False))
    lms = tmp_path / ".lmstudio" / "models" / "pub" / "Tiny-GGUF"
    lms.mkdir(parents=True)
    (lms / "Tiny-Q4_0.gguf").write_bytes(fake_gguf(file_type=2, pad=2_000_000))
    return {"chat": str(chat), "lms": str(lms / "Tiny-Q4_0.gguf")}


class Recorder:
    """Stands in for load_model: keeps its arguments, answers generate()."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, config):
        self.calls.append(("load", model, config))
        self.exactness = None
        self.model_path = model
        return self

    def generate(self, prompt, **kw):
        self.calls.append(("generate", prompt, kw))

    def close(self):
        pass


def test_models_lists_ollama_and_lmstudio(tree):
    r = invoke(["models"])
    assert r.exit_code == 0, r.output
    lines = {ln.split()[1]: ln.split() for ln in r.stdout.splitlines()[1:]}
    assert r.stdout.splitlines()[0].split() == ["SOURCE", "NAME", "SIZE", "ARCH", "QUANT", "CTX", "CHAT"]
    assert lines["qwen2.5-coder:1.5b"] == ["ollama", "qwen2.5-coder:1.5b", "0MB", "qwen2", "Q4_K_M", "32768", "yes"]
    assert lines["basey:latest"][3:] == ["gemma3", "Q8_0", "8192", "no"]
    assert lines["pub/Tiny-GGUF/Tiny-Q4_0.gguf"][:5] == ["lmstudio", "pub/Tiny-GGUF/Tiny-Q4_0.gguf", "2MB", "llama",
                                                         "Q4_0"]
    rows = [json.loads(x) for x in invoke(["models", "--json"]).stdout.splitlines()]
    assert {r["name"]: r["path"] for r in rows if r["source"] != "bench"} == {
        "qwen2.5-coder:1.5b": tree["chat"], "basey:latest": rows[1]["path"], "pub/Tiny-GGUF/Tiny-Q4_0.gguf": tree["lms"]}


def test_aliases_reach_the_library(tree, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(generate_cmd, "load_model", rec)
    r = invoke(["generate", "-m", "qwen2.5-coder:1.5b", "-c", "512", "-ngl", "3", "-t", "2", "-n", "5",
                "--temp", "0.5", "--seed", "1", "--quiet", "hello"])
    assert r.exit_code == 0, r.output
    (_, model, config), (_, prompt, gen) = rec.calls
    assert model == tree["chat"] and prompt == "hello"
    assert (config.n_ctx, config.n_gpu_layers, config.n_threads, config.calibrate) == (512, 3, 2, True)
    assert gen["max_tokens"] == 5 and gen["sampling"].temperature == 0.5
    # the positional MODEL and -m name the same thing; both at once is refused
    rec.calls.clear()
    assert invoke(["generate", "qwen2.5-coder:1.5b", "hi"]).exit_code == 0 and rec.calls[0][1] == tree["chat"]
    r = invoke(["generate", "-m", "basey", "qwen2.5-coder:1.5b", "hi"])
    assert r.exit_code == 2 and "named twice" in r.stderr
    # chat: -sys is --system, -m the model
    seen = {}
    monkeypatch.setattr("edgespec.app.cli.chat.run_chat", lambda model, **kw: seen.update(kw, model=model))
    r = invoke(["chat", "-m", "Tiny-Q4_0", "-sys", "Be brief.", "-c", "1024"])
    assert r.exit_code == 0, r.output
    assert seen["model"] == tree["lms"] and seen["system"] == "Be brief." and seen["config"].n_ctx == 1024
    r = invoke(["chat", "basey"])                       # a base model: refused before loading
    assert r.exit_code == 1 and "no chat template" in r.stderr


def test_hf_option_downloads_by_quant(tree, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(generate_cmd, "load_model", rec)
    with hub() as url:
        r = invoke(["generate", "-hf", "me/tiny-GGUF:Q8_0", "hi"],
                   env={"HF_ENDPOINT": url, "HF_HOME": os.environ["HOME"] + "/hf"})
    assert r.exit_code == 0, r.output
    assert open(rec.calls[0][1], "rb").read() == REPO["me/tiny-GGUF"]["tiny-Q8_0.gguf"]


def test_unknown_model_lists_close_matches(tree):
    r = invoke(["generate", "qwen2.5-coder:1.5", "hi"])
    assert r.exit_code == 1
    assert "close matches: qwen2.5-coder:1.5b" in r.stderr and "get_models" not in r.stderr and "get-models" not in r.stderr


def test_model_completion_offers_known_names_and_paths(tree):
    env = {"_EDGESPEC_COMPLETE": "bash_complete", "COMP_WORDS": "edgespec chat qwen", "COMP_CWORD": "2"}
    r = invoke([], env=env)
    assert r.stdout.splitlines() == ["plain,qwen2.5-coder:1.5b", "file,qwen"]
    env.update(COMP_WORDS="edgespec generate -m ba", COMP_CWORD="3")
    assert "plain,basey:latest" in invoke([], env=env).stdout.splitlines()


def test_version_names_llama_cpp_python_and_backends():
    r = invoke(["--version"])
    assert r.exit_code == 0
    import llama_cpp
    assert f"llama-cpp-python {llama_cpp.__version__} (backends: CPU" in r.stdout
    from edgespec.backend import ggml
    assert ("RPC" in r.stdout) == ggml.rpc_available()
    assert ("GPU offload: yes" in r.stdout) == bool(ggml.local_gpus())   # RPC alone is no GPU
    assert _check_llama_cpp_version("0.3.36") is None and _check_llama_cpp_version("0.3.99") is None
    assert "outside the tested range >=0.3.36,<0.4" in _check_llama_cpp_version("0.4.0")
    assert "llama-cpp-python 0.3.2 is outside" in _check_llama_cpp_version("0.3.2")


def test_help_starts_fast_in_a_fresh_process():
    env = dict(os.environ, PYTHONPATH=ROOT)
    best = min(_timed([sys.executable, "-m", "edgespec", "--help"], env) for _ in range(2))
    assert best < 1.5, f"edgespec --help took {best:.2f} s"


def _timed(cmd, env) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "edgespec models" in out.stdout, out.stderr
    return time.perf_counter() - t0
