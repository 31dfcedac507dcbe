"""The bench's peers: llama.cpp's llama-server (built by `edgespec
build-peers`), the llama-cpp-python prompt-lookup variants, thread suffixes
and method `default`.

Without a built llama-server: finding it (not built, wrong version, a binary
that does not run or start), its command lines, the build's helpers and the
parsing of a /completion response recorded from the real server
(tests/data/llama_server_completion.json).  With one (found as the bench
finds it): llama-server and its ngram-simple speculation on SmolLM2 give
none's tokens."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from edgespec.bench.llama_peer import _llama_kwargs, llama_peer_settings
from edgespec.bench import methods as M
from edgespec.bench.prompts import BenchPrompt
from edgespec.bench.report import format_report, peer_header_lines
from edgespec.bench.runner import run_bench
from edgespec.bench import peer_server as S
from edgespec.bench import peers as P
from edgespec.app.cli import main
from edgespec.errors import BenchError, PeerError

DATA = Path(__file__).resolve().parent / "data"
RECORDED = DATA / "llama_server_completion.json"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty edgespec cache and no EDGESPEC_LLAMA_SERVER."""
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(P.SERVER_ENV, raising=False)
    return tmp_path / "cache"


def fake_server(directory: Path, script: str, manifest: dict | None = None) -> Path:
    """An executable shell script standing in for llama-server (and its build.json)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "llama-server"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    if manifest is not None:
        (directory / P.MANIFEST).write_text(json.dumps(manifest))
    return path


VERSION_OK = 'if [ "$1" = "--version" ]; then echo "version: 1 (0c1e57098)" >&2; exit 0; fi\n'


def test_not_built_says_how_to_build(cache, tmp_path):
    with pytest.raises(PeerError) as e:
        P.find_llama_server()
    msg = str(e.value)
    assert "not built" in msg and "`edgespec build-peers`" in msg and P.SERVER_ENV in msg and "\n" not in msg
    # the bench says so in one line before it loads the model
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["hi"]}) + "\n")
    r = CliRunner().invoke(main, ["bench", "/nonexistent.gguf", "--prompts", str(prompts),
                                  "--methods", "none,llama-server-ngram-simple"])
    assert r.exit_code == 1 and "edgespec build-peers" in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert M.server_binary(["none", "llama-cpp-python-pld-cpu"]) is None     # no llama-server method: no lookup


def test_env_binary_missing_or_not_running(cache, tmp_path, monkeypatch):
    monkeypatch.setenv(P.SERVER_ENV, str(tmp_path / "nope"))
    with pytest.raises(PeerError, match=r"EDGESPEC_LLAMA_SERVER=.*nope: no such file"):
        P.find_llama_server()
    broken = fake_server(tmp_path / "b", "echo 'error while loading shared libraries' >&2; exit 127\n")
    monkeypatch.setenv(P.SERVER_ENV, str(broken))
    with pytest.raises(PeerError, match=r"--version failed \(exit code 127: error while loading shared libraries\)"):
        P.find_llama_server()
    # a binary of the user's own, without a manifest: runs unchecked, its version recorded
    own = fake_server(tmp_path / "own", VERSION_OK)
    monkeypatch.setenv(P.SERVER_ENV, str(own))
    b = P.find_llama_server()
    assert b.path == str(own) and b.version == "version: 1 (0c1e57098)" and not b.checked


def test_wrong_version_is_refused(cache):
    have = P.installed_version()
    fake_server(Path(P.peers_dir(have)), VERSION_OK, {"llama_cpp_python": "0.0.1", "llama_cpp_commit": "abc"})
    with pytest.raises(PeerError) as e:
        P.find_llama_server()
    assert f"built from llama-cpp-python 0.0.1's llama.cpp, but {have} is installed" in str(e.value)
    assert "`edgespec build-peers`" in str(e.value)
    fake_server(Path(P.peers_dir(have)), VERSION_OK, {"llama_cpp_python": have, "llama_cpp_commit": "abc"})
    b = P.find_llama_server()
    assert b.checked and b.describe()["llama_cpp_commit"] == "abc"


def test_server_that_fails_to_start(tmp_path):
    """A llama-server that exits while loading: one line with its last error."""
    binary = fake_server(tmp_path, VERSION_OK + "echo 'loading model'\n"
                                   "echo 'error: failed to load model /m.gguf' >&2; exit 1\n")
    with pytest.raises(PeerError) as e:
        S.LlamaServerRunner("llama-server", str(binary), "/m.gguf", 1024, 0, None, start_timeout=30)
    assert str(e.value) == ("llama-server: llama-server exited with code 1 before it was ready: "
                            "error: failed to load model /m.gguf")
    hangs = fake_server(tmp_path / "h", "sleep 30\n")
    with pytest.raises(PeerError, match="did not become ready in 1 s"):
        S.LlamaServerRunner("llama-server", str(hangs), "/m.gguf", 1024, 0, None, start_timeout=1)


def test_server_command_lines():
    args = S.server_args("llama-server", "/b/llama-server", "/m.gguf", 4096, 0, None, 8123)
    assert args == ["/b/llama-server", "-m", "/m.gguf", "-c", "4096", "-ngl", "0", "-np", "1",
                    "--host", "127.0.0.1", "--port", "8123", "--no-webui", "--no-repack"]
    simple = S.server_args("llama-server-ngram-simple", "b", "m", 2048, 0, 2, 1)
    assert simple[-8:] == ["-t", "2", "-tb", "2", "--spec-type", "ngram-simple", "--spec-draft-n-max", "64"]
    mod = S.server_args("llama-server-ngram-mod", "b", "m", 2048, 0, None, 1)
    assert mod[mod.index("--spec-type"):] == ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "24",
                                              "--spec-ngram-mod-n-min", "48", "--spec-ngram-mod-n-max", "64"]
    rpc = S.server_args("llama-server", "b", "m", 2048, 0, None, 1, ["h:1", "h:2"], [3, 1])
    assert rpc[rpc.index("-ngl") + 1] == "999" and rpc[-6:] == ["--rpc", "h:1,h:2", "-ot", S.OUTPUT_ON_CPU,
                                                                   "-ts", "3,1"]
    remote = S.server_args("llama-server", "b", "m", 2048, 0, None, 1, ["h:1"], rpc_output="remote")
    assert remote[-2:] == ["--rpc", "h:1"] and "-ot" not in remote
    with pytest.raises(PeerError):
        S.server_args("llama-server-eagle", "b", "m", 2048, 0, None, 1)
    body = S.completion_request([1, 2, 3], 16)
    assert body["prompt"] == [1, 2, 3] and body["temperature"] == 0 and body["return_tokens"]
    assert body["cache_prompt"] is False and body["n_predict"] == 16


def test_parse_recorded_completion():
    """A response recorded from the real llama-server (SmolLM2, ngram-simple):
    the answer's tokens without the end-of-generation token, decode time from
    the server's predicted_ms, the bench's tokens/s convention."""
    rec = json.loads(RECORDED.read_text())
    resp, n_prompt = rec["response"], rec["n_prompt_tokens"]
    r = S.parse_completion(resp, n_prompt)
    t = resp["timings"]
    assert r["decode_s"] == pytest.approx(t["predicted_ms"] / 1000)
    assert r["prefill_s"] == pytest.approx(t["prompt_ms"] / 1000)
    if resp["stop_type"] == "eos":
        assert r["tokens"] == resp["tokens"][:-1] and r["stop_reason"] == "stop"
        assert r["n_generated"] == t["predicted_n"] - 1
    assert r["tokens_per_s"] == pytest.approx((r["n_generated"] - 1) / r["decode_s"])
    assert r["text"] == resp["content"] and r["server_timings"]["predicted_n"] == t["predicted_n"]
    assert r["server_timings"]["draft_n"] >= r["server_timings"]["draft_n_accepted"] > 0
    # a length stop keeps every token
    r = S.parse_completion(dict(resp, stop_type="limit"), n_prompt)
    assert r["tokens"] == resp["tokens"] and r["stop_reason"] == "length"
    # what the bench cannot use is an error naming it
    for bad, what in ((dict(resp, timings=None), "no timings.predicted_ms"),
                      (dict(resp, tokens=[]), "no generated token ids"),
                      ([resp], "not a JSON object")):
        with pytest.raises(PeerError, match=what):
            S.parse_completion(bad, n_prompt)
    with pytest.raises(PeerError, match=f"evaluated {n_prompt} prompt tokens, the bench sent {n_prompt + 1}"):
        S.parse_completion(resp, n_prompt + 1)


def test_peer_methods_and_thread_suffixes():
    assert M.parse_methods("none,default,llama-server@t1,llama-cpp-python-pld-cpu@t2,llama-server-ngram-mod") == \
        ["none", "default", "llama-server@t1", "llama-cpp-python-pld-cpu@t2", "llama-server-ngram-mod"]
    assert M.split_peer("llama-server-ngram-map-k@t3") == ("llama-server-ngram-map-k", 3)
    assert M.split_peer("suffix@relaxed") is None and M.split_peer("llama-server") == ("llama-server", None)
    for bad in ("llama-server@t0", "llama-server@x2", "llama-cpp-python@relaxed"):
        with pytest.raises(BenchError, match="@tN"):
            M.parse_methods(bad)
    with pytest.raises(BenchError, match="llama-server-ngram-simple"):
        M.parse_methods("llama-server-ngram")
    # prompt lookup at its README's CPU draft length, beside its default
    assert _llama_kwargs("llama-cpp-python-pld-cpu", None, "q8_0") == {"logits_all": True}
    assert llama_peer_settings("llama-cpp-python-pld-cpu@t2", None, "q8_0")["draft"] == \
        "LlamaPromptLookupDecoding(num_pred_tokens=2)"
    pld = llama_peer_settings("llama-cpp-python-pld", None, "q8_0")
    assert pld["draft"] == "LlamaPromptLookupDecoding()" and pld["n_threads"] == max(os.cpu_count() // 2, 1)
    assert llama_peer_settings("llama-cpp-python@t3", None, "q8_0")["n_threads_batch"] == 3


def fake_model(**over):
    from edgespec.backend.process import default_threads
    from edgespec.core.verify import VerifyConfig
    n = default_threads()
    be = SimpleNamespace(n_threads=n, n_ctx=4096, n_gpu_layers=0, cache_type_k="q8_0" if n > 1 else "f16")
    for k in ("n_threads", "n_ctx", "cache_type_k", "n_gpu_layers"):
        if k in over:
            setattr(be, k, over.pop(k))
    cfg = SimpleNamespace(max_nodes=over.pop("max_nodes", 48), cost_gate=True, verify=VerifyConfig("exact"))
    return SimpleNamespace(backend=be, config=cfg, kernels=over.pop("kernels", "exact"), corpora=over.pop("corpora", []),
                           model_path="/no/such/model.gguf")


def test_default_resolves_generate_defaults():
    """`default` is what `edgespec generate MODEL PROMPT` runs: its option
    defaults, resolved here with the bench model's placement (threads,
    context, GPU layers); a bench model whose other settings differ is
    refused with the differences named."""
    d = M.resolve_default(fake_model())
    assert d["drafter"] == d["generate_drafter"] == "suffix" and d["kernels"] == "exact" and d["cost_gate"]
    assert d["n_ctx"] == 4096 and d["max_nodes"] == 48
    # the bench's corpora are not generate's: default runs without them
    assert M.resolve_default(fake_model(corpora=["c.esc"]))["drafter"] == "suffix-nocorpus"
    # another context, or every layer on a GPU (K cache f16 there), is the defaults with that placement
    assert M.resolve_default(fake_model(n_ctx=2048))["n_ctx"] == 2048
    gpu = M.resolve_default(fake_model(n_gpu_layers=-1, cache_type_k="f16"))
    assert gpu["n_gpu_layers"] == -1 and gpu["cache_type_k"] == "f16"
    with pytest.raises(BenchError) as e:
        M.resolve_default(fake_model(kernels="fast", max_nodes=16))
    assert "kernels fast (generate's default: exact)" in str(e.value)
    assert "max_nodes 16 (generate's default: 48)" in str(e.value)
    head = {"default": d}
    line = peer_header_lines(head)[0]
    assert line.startswith("default = `edgespec generate` with no options: drafter suffix, kernels exact")


def test_build_helpers(tmp_path, monkeypatch):
    log = tmp_path / "CHANGELOG.md"
    log.write_text("# Changelog\n\n## [Unreleased]\n\n- feat: x\n\n## [0.3.36]\n\n"
                   "- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098\n\n## [0.3.35]\n\n"
                   "- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f\n")
    assert P.changelog_commit(str(log)) == "0c1e57098"
    assert P.changelog_commit(str(tmp_path / "none.md")) is None
    assert P.progress_fraction("[12/48] Building CXX object common/arg.cpp.o") == 0.25
    assert P.progress_fraction("[ 35%] Building CXX object") == 0.35
    assert P.progress_fraction("-- Configuring done") is None
    src = tmp_path / "llama.cpp"
    (src / "ggml").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text('option(LLAMA_BUILD_SERVER "server" ON)\noption(BUILD_SHARED_LIBS "x" ON)\n')
    (src / "ggml" / "CMakeLists.txt").write_text('option(GGML_RPC "rpc" OFF)\n')
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=on")
    args = P.cmake_args(str(src), str(tmp_path / "b"), "0c1e57098")
    assert {"-DGGML_RPC=ON", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_BUILD_COMMIT=0c1e57098"} <= set(args)
    assert not any("LLAMA_CURL" in a or "LLAMA_OPENSSL" in a for a in args)   # options this source lacks
    assert args[-1] == "-DGGML_CUDA=on"
    (src / "tools" / "rpc").mkdir(parents=True)
    (src / "tools" / "rpc" / "CMakeLists.txt").write_text("set(TARGET ggml-rpc-server)\n")
    assert P.rpc_target(str(src)) == "ggml-rpc-server"
    with pytest.raises(PeerError, match="holds no vendor/llama.cpp"):
        import tarfile
        bad = tmp_path / "x.tar.gz"
        with tarfile.open(bad, "w:gz") as t:
            t.add(log, arcname="pkg-1.0/CHANGELOG.md")
        P.extract_llama_cpp(str(bad), str(tmp_path / "out"))


# ------------------------------------------------------------------ with a built llama-server
@pytest.mark.model
def test_llama_server_gives_nones_tokens(server_binary, tmp_path):
    """llama-server plain and with ngram-simple, on the same chat-templated
    prompt tokens: the same greedy answers as edgespec's `none`, timings from
    the server, the header naming the binary."""
    prompts = [BenchPrompt(1, "copy", "Repeat exactly: the quick brown fox jumps over the lazy dog. "
                                        "the quick brown fox jumps over the lazy dog."),
               BenchPrompt(2, "qa", "What is the capital of France?")]
    # llama-server's default K cache is f16: edgespec's `none` on the same
    # cache type gives bit-comparable logits (with q8_0, SmolLM2's near-ties
    # part the two answers within 32 tokens)
    from edgespec import SpecModel
    with SpecModel(drafter="none", n_ctx=2048, cache_type_k="f16", calibrate=False) as m:
        head, rows = run_bench(m, prompts, ["none", "llama-server", "llama-server-ngram-simple"],
                               max_tokens=32, out_path=str(tmp_path / "r.jsonl"))
    srv = head["llama_server"]
    assert srv["binary"]["path"] == server_binary.path and srv["binary"]["version"].startswith("version:")
    assert srv["methods"]["llama-server-ngram-simple"]["spec_args"][:2] == ["--spec-type", "ngram-simple"]
    res = [r for r in rows if r["kind"] == "result"]
    assert len(res) == 6
    for r in res:
        assert r["n_generated"] > 1 and r["decode_s"] > 0
        if r["method"] != "none":
            assert r["identical_to_none"] is True, (r["method"], r["question_id"], r["text"])
            assert r["server_timings"]["predicted_ms"] == pytest.approx(r["decode_s"] * 1000)
    for r in res:
        if r["method"] != "none":
            assert r["server_timings"]["predicted_n"] in (r["n_generated"], r["n_generated"] + 1)
    assert "llama-server: version:" in format_report(rows, head)


@pytest.mark.model
def test_default_method_runs_generates_defaults(tmp_path):
    """On a model loaded as `edgespec generate` loads it, `default` runs
    generate's drafter on an engine of its own (beside `suffix`, the same
    drafter), gives none's tokens, and the header and report name what it
    resolved to."""
    from edgespec import SpecModel
    prompts = [BenchPrompt(1, "qa", "Name three primary colors.")]
    with SpecModel(drafter="none") as m:
        head, rows = run_bench(m, prompts, ["none", "suffix", "default"], max_tokens=24)
    d = head["default"]
    assert d["drafter"] == "suffix" and d["kernels"] == "exact" and d["n_ctx"] == 4096
    res = {r["method"]: r for r in rows if r["kind"] == "result"}
    assert res["default"]["tokens"] == res["none"]["tokens"] and res["default"]["identical_to_none"]
    assert res["default"]["drafter"] == "suffix"
    assert {r["method"] for r in rows if r["kind"] == "calibration"} == {"suffix", "default"}
    assert "default = `edgespec generate` with no options: drafter suffix" in format_report(rows, head)


def test_prompt_lookup_at_the_cpu_draft_length(model):
    """llama-cpp-python-pld-cpu runs LlamaPromptLookupDecoding(num_pred_tokens=2)
    in its own process, at the threads its @tN suffix asks for."""
    prompts = [BenchPrompt(1, "copy", "Repeat exactly: one two three four five six seven eight.")]
    head, rows = run_bench(model, prompts, ["none", "llama-cpp-python-pld-cpu@t1"], max_tokens=12)
    peer = head["llama_cpp_python"]["llama-cpp-python-pld-cpu@t1"]
    assert peer["draft"] == "LlamaPromptLookupDecoding(num_pred_tokens=2)" and peer["n_threads"] == 1
    r = next(r for r in rows if r["method"] == "llama-cpp-python-pld-cpu@t1")
    assert r["text"] and r["n_generated"] >= 1 and isinstance(r["identical_to_none"], bool)
