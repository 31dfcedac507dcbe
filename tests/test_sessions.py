"""`edgespec bench-sessions`: the recorded app traces (benchmarks/sessions/), the
replay's pure parts, and the replay against a real `edgespec serve` and,
where one is built, llama-server (docs/sessions.md)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgespec.bench import session_targets as T
from edgespec.bench import sessions as S
from edgespec.bench.session_report import format_sessions
from edgespec.errors import BenchError

REPO = Path(__file__).resolve().parents[1]
TRACES = sorted((REPO / "benchmarks" / "sessions").glob("*.jsonl"))
TINY = Path(__file__).resolve().parent / "data" / "session_tiny.jsonl"
RESTART = Path(__file__).resolve().parent / "data" / "session_restart.jsonl"     # TINY, its title request longer
LATENCY = REPO / "benchmarks" / "sessions" / "latency" / "chat-gaps.jsonl"


# ------------------------------------------------------------------ the traces
def test_the_repository_has_the_apps_traces():
    apps = {S.load_session(str(p)).header.get("app") for p in TRACES}
    assert {"aider", "open-webui-shape", "continue-shape"} <= apps, apps


@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_a_trace_has_the_documented_shape(path):
    s = S.load_session(str(path))
    h = s.header
    assert h["trace"] == S.TRACE_MARK and h["app"] and h["recorded"] and "date" in h
    assert len(s.requests) >= 2
    for r in s.requests:
        assert r["path"] in S.PATHS and isinstance(r["role"], str)
        body = r["body"]
        if r["path"] == "/v1/chat/completions":
            assert body["messages"] and all(m["role"] in ("system", "user", "assistant") for m in body["messages"])
            assert all(isinstance(m["content"], str) for m in body["messages"])
        else:
            assert isinstance(body["prompt"], str) and body["prompt"]
    # a session is multi-turn: some chat request carries an earlier answer in its history
    chats = [r["body"]["messages"] for r in s.requests if r["role"] == "chat"]
    assert any(m["role"] == "assistant" for ms in chats[1:] for m in ms) or h["app"] == "aider"


def test_the_aider_traces_are_aiders_shape():
    """Aider streams its turns, sends no max_tokens, and starts every turn with
    the same long system prompt: the prefix a server may keep; the history
    summaries it sends in the background (role `summary`) are two messages,
    not streamed."""
    aider = [S.load_session(str(p)) for p in TRACES if S.load_session(str(p)).header["app"] == "aider"]
    assert len(aider) >= 3
    for s in aider:
        turns = [r for r in s.requests if r["role"] == "chat"]
        firsts = {r["body"]["messages"][0]["content"] for r in turns}
        assert len(turns) >= 3 and len(firsts) == 1 and len(firsts.pop()) > 500
        assert all(r["body"].get("stream") is True and "max_tokens" not in r["body"] for r in turns)
        summaries = [r for r in s.requests if r["role"] == "summary"]
        assert all(len(r["body"]["messages"]) == 2 and not r["body"].get("stream") for r in summaries)
        assert {r["role"] for r in s.requests} <= {"chat", "summary"}


def test_side_requests_follow_the_turns_in_the_webui_trace():
    s = next(S.load_session(str(p)) for p in TRACES if S.load_session(str(p)).header["app"] == "open-webui-shape")
    roles = [r["role"] for r in s.requests]
    assert roles[:3] == ["chat", "title", "tags"] and roles.count("chat") >= 2
    assert not any(r["body"].get("stream") for r in s.requests if r["role"] != "chat")


def test_a_broken_trace_says_which_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"trace": "edgespec-session", "app": "a"}\n{"path": "/v1/embeddings", "body": {}}\n')
    with pytest.raises(BenchError, match=r"x.jsonl:2: path '/v1/embeddings'"):
        S.load_session(str(p))
    p.write_text('{"app": "a"}\n')
    with pytest.raises(BenchError, match="first line must be the header"):
        S.load_session(str(p))
    p.write_text('{"trace": "edgespec-session"}\n{"path": "/v1/completions", "body": {"messages": []}}\n')
    with pytest.raises(BenchError, match="needs `prompt`"):
        S.load_session(str(p))

    p.write_text('{"trace": "edgespec-session"}\n{"path": "/v1/completions", "gap_s": -1, "body": {"prompt": "a"}}\n')
    with pytest.raises(BenchError, match=r"x.jsonl:2: `gap_s` is a number of seconds"):
        S.load_session(str(p))


def test_the_latency_trace_is_sixteen_short_turns_with_pauses():
    """benchmarks/sessions/latency/chat-gaps.jsonl (issue 64 item 4, docs/sessions.md): one chat of 16
    streamed eight-token turns, each resending the conversation so far, after a pause of 0.5-4 s; kept
    out of benchmarks/sessions/ itself, so the default replay leaves it out."""
    s = S.load_session(str(LATENCY))
    assert LATENCY not in TRACES and s.header["date"] and len(s.requests) == 16
    assert all(r["role"] == "chat" and r["body"]["stream"] and r["body"]["max_tokens"] == 8 for r in s.requests)
    gaps = [r["gap_s"] for r in s.requests]
    assert all(0.5 <= g <= 4 for g in gaps) and min(gaps) < 1 and max(gaps) > 3
    msgs = [r["body"]["messages"] for r in s.requests]
    assert all(b[:len(a)] == a and b[len(a)]["role"] == "assistant" for a, b in zip(msgs, msgs[1:]))


# ------------------------------------------------------------------ replay's pure parts
def test_replay_body_is_greedy_capped_and_names_the_served_model():
    body = {"model": "openai/qwen", "temperature": 0.7, "messages": [{"role": "user", "content": "x"}]}
    out = S.replay_body(body, "served", 99)
    assert out == {"model": "served", "temperature": 0.0, "max_tokens": 99, "messages": body["messages"]}
    assert body["model"] == "openai/qwen"                  # the trace's own body is untouched
    assert S.replay_body({"max_tokens": 5, "prompt": "a"}, "m", 99)["max_tokens"] == 5
    assert "max_tokens" not in S.replay_body({"max_completion_tokens": 5, "prompt": "a"}, "m", 99)


def test_session_row_and_identical_counts():
    s = S.load_session(str(TINY))

    def got(text, ttft, prompt_n, cache_n, status=200):
        return {"status": status, "wall_ms": 1000.0, "ttft_ms": ttft, "text": text, "finish_reason": "stop",
                "timings": {"prompt_n": prompt_n, "prompt_ms": 10.0 * prompt_n, "cache_n": cache_n,
                            "predicted_n": 10, "predicted_ms": 500.0, "predicted_per_second": 20.0}}
    a = [S.request_row("a", s, i, got(t, f, p, c)) for i, (t, f, p, c) in
         enumerate([("x", 100.0, 30, 0), ("t", None, 20, 0), ("y", 50.0, 10, 30), ("z", 40.0, 5, 0)])]
    row = S.session_row("a", s, a)
    assert row["n_requests"] == 4 and row["wall_s"] == 4.0 and row["ttft_first_ms"] == 100.0
    assert row["ttft_followup_ms"] == 50.0            # the chat turns after the first (not the completion)
    assert row["prompt_tokens"] == 95 and row["cache_n"] == 30 and row["prefill_ms"] == 650.0
    assert row["decode_tok_s"] == pytest.approx(20.0)
    b = [S.request_row("b", s, i, got(t, 1.0, 1, 0, st)) for i, (t, st) in
         enumerate([("x", 200), ("T", 200), ("y", 200), ("z", 500)])]
    assert S.identical_counts(a + b, "a") == {"b": (2, 3)}
    text = format_sessions(a + [row] + b + [S.session_row("b", s, b)])
    assert "2/3" in text and "30/95 (32%)" in text and "(1 failed)" in text


def test_targets_parse():
    assert T.parse_target("edgespec") == T.Target("edgespec", "edgespec")
    assert T.parse_target("edgespec-exact=--kernels exact").extra == ("--kernels", "exact")
    assert T.parse_target("llama-server-ngram-mod").method == "llama-server-ngram-mod"
    assert T.parse_target("mine=http://127.0.0.1:9").url == "http://127.0.0.1:9"
    with pytest.raises(BenchError, match="target 'vllm'"):
        T.parse_target("vllm")
    with pytest.raises(BenchError, match="same name"):
        T.parse_targets(["edgespec", "edgespec=--no-gate"])
    # a new user's start: the bench's own options, taken out of serve's
    new = T.parse_target("edgespec-new=--fresh-cache --no-gate")
    assert (new.cache, new.extra) == ("fresh", ("--no-gate",))
    assert T.parse_targets(["edgespec-new=--fresh-cache", "edgespec-next=--same-cache"])[1].cache == "same"
    with pytest.raises(BenchError, match="none comes before it"):
        T.parse_targets(["edgespec-next=--same-cache"])
    with pytest.raises(BenchError, match="not both"):
        T.parse_target("edgespec-x=--fresh-cache --same-cache")
    with pytest.raises(BenchError, match="for edgespec targets"):
        T.parse_target("llama-server=--fresh-cache")


def _invoke(args):
    from click.testing import CliRunner
    from edgespec.app.cli import main
    return CliRunner().invoke(main, args)


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"app": "x"}\n')
    for args, fragment in ((["bench-sessions", "--sessions", str(TINY), "--target", "vllm"], "target 'vllm'"),
                           (["bench-sessions", "--sessions", str(bad)], "first line must be the header"),
                           (["bench-sessions-report", str(bad)], "no session rows")):
        r = _invoke(args)
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (args, r.output)
        assert fragment in r.output and "Traceback" not in r.output


def test_the_default_traces_are_found_from_any_working_directory(tmp_path, monkeypatch):
    """Without --sessions, bench-sessions reads the clone's benchmarks/sessions,
    found from the package's path: from another folder the traces still load
    (the run then stops at the unknown target, after reading them)."""
    from edgespec.paths import source_data
    assert source_data("sessions") == str(REPO / "benchmarks" / "sessions")
    monkeypatch.chdir(tmp_path)
    r = _invoke(["bench-sessions", "--target", "vllm"])
    assert r.exit_code == 1 and "target 'vllm'" in r.output, r.output


def test_without_a_clone_the_default_traces_are_a_usage_error(tmp_path, monkeypatch):
    """An installed package (paths.py outside a source tree) has no traces:
    source_data says so, and bench-sessions asks for --sessions PATH."""
    import importlib.util
    (tmp_path / "site" / "edgespec").mkdir(parents=True)
    copy = tmp_path / "site" / "edgespec" / "paths.py"
    copy.write_text((REPO / "edgespec" / "paths.py").read_text(encoding="utf-8"), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("installed_paths", copy)
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    assert installed.source_data("sessions") is None
    monkeypatch.setattr("edgespec.paths.source_data", installed.source_data)
    r = _invoke(["bench-sessions"])
    assert r.exit_code == 2 and "--sessions PATH" in r.output, r.output


def test_cli_report_prints_a_saved_run(tmp_path):
    s = S.load_session(str(TINY))
    got = {"status": 200, "wall_ms": 250.0, "ttft_ms": 80.0, "text": "x",
           "timings": {"prompt_n": 12, "prompt_ms": 40.0, "cache_n": 36, "predicted_n": 9, "predicted_ms": 300.0}}
    rows = [S.request_row("edgespec", s, i, got) for i in range(len(s.requests))]
    head = {"kind": "header", "model": "m.gguf", "max_tokens": 8, "targets": {"edgespec": ["edgespec", "serve"]}}
    out = tmp_path / "r.jsonl"
    out.write_text("\n".join(json.dumps(r) for r in [head] + rows + [S.session_row("edgespec", s, rows)]))
    r = _invoke(["bench-sessions-report", str(out)])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("edgespec") and "session_tiny" in x)
    assert line.split()[2:] == ["4", "1.00", "80", "80", "160", "144/192", "(75%)", "30.0", "-"]
    assert "model: m.gguf" in r.output and "edgespec: edgespec serve" in r.output


# ------------------------------------------------------------------ against real servers
def _check_rows(rows, targets, n):
    reqs = [r for r in rows if r["kind"] == "request"]
    assert len(reqs) == n * len(targets)
    for r in reqs:
        assert r["status"] == 200, r
        assert r["predicted_n"] >= 1 and r["prompt_n"] >= 0 and r["cache_n"] >= 0 and r["prompt_ms"] >= 0
        assert r["predicted_per_second"] is not None
        assert (r["ttft_ms"] is not None) == r["stream"] and r["text"]
    assert [r["target"] for r in rows if r["kind"] == "session"] == list(targets)


def test_replay_on_edgespec_serve(model_path, tmp_path, monkeypatch):
    """Two `edgespec serve` targets (the default and --no-gate started as a
    new user, with an empty cache folder; both exact as the tests run): a row
    per request with the timings, one session row each, and the same greedy
    answers; the new user's calibration is not waited for (no --same-cache
    target follows to read it), so the header has no calibrated_after_s."""
    monkeypatch.setattr(T, "CALIBRATION_TIMEOUT_S", 1.0)
    sessions = S.load_sessions(str(TINY))
    targets = T.parse_targets(["edgespec", "edgespec-nogate=--no-gate --fresh-cache"])
    out = tmp_path / "r.jsonl"
    head, rows = T.run_sessions(sessions, targets, model_path, 2048, None, 8, str(out))
    assert head["cache"] == {"edgespec": "as found", "edgespec-nogate": "fresh"}
    assert "calibrated_after_s" not in head and set(head["started_s"]) == {t.name for t in targets}
    _check_rows(rows, ["edgespec", "edgespec-nogate"], 4)
    assert S.identical_counts(rows, "edgespec") == {"edgespec-nogate": (4, 4)}
    saved = [json.loads(x) for x in out.read_text().splitlines()]
    assert saved[0]["kind"] == "header" and saved[0]["targets"]["edgespec-nogate"][-1] == "--no-gate"
    assert saved[1:] == json.loads(json.dumps(rows))
    assert "4/4" in format_sessions(rows, head)


def test_restarts_keep_the_prompt_cache_folder(model_path, tmp_path, monkeypatch):
    """--restart session: a server started again before each session, with
    no warm-up; an edgespec target keeps its own folder across them (a copy
    of the calibration, no saved prompts: nothing of the environment's
    prompts folder can serve these prompts) with the disk tier on, and its
    greedy answers equal those of a server that ran straight through.
    Whether a background calibration slice ran between two requests changes
    nothing here: the slice's conversation is put back before the next one."""
    import shutil
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("a", "b"):
        shutil.copy(RESTART, folder / f"{name}.jsonl")
    home = tmp_path / "home"
    (home / "prompts").mkdir(parents=True)
    (home / "prompts" / "junk.kv").write_bytes(b"not an entry")
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(home))
    sessions = S.load_sessions(str(folder))
    targets = T.parse_targets(["edgespec-disk=--prompt-cache-disk-mib 64"])
    head, rows = T.run_sessions(sessions, targets, model_path, 2048, None, 8, str(tmp_path / "r.jsonl"),
                                restart="session")
    assert head["restart"] == "session" and len(head["restarts_s"]["edgespec-disk"]) == 2
    assert head["cache"] == {"edgespec-disk": "own, calibration copied"}
    _check_rows(rows, ["edgespec-disk", "edgespec-disk"], 4)
    reqs = [r for r in rows if r["kind"] == "request"]
    assert [r["text"] for r in reqs[:4]] == [r["text"] for r in reqs[4:]]
    # the second request (the title, ~250 tokens) shares only the template's head with the first: in
    # the first session it was prefilled but for that head, after the restart the first session's
    # cells came from disk (the first requests after a start weigh a read by built-in rates: no
    # timing decides it)
    first, again = reqs[1]["cache_n"], reqs[5]["cache_n"]
    assert first < 16 and again >= first + 128, [(r["prompt_n"], r["cache_n"]) for r in reqs]
    assert (home / "prompts" / "junk.kv").exists() and len(list((home / "prompts").iterdir())) == 1
    with pytest.raises(BenchError):
        T.run_sessions(sessions, targets, model_path, 2048, None, 8, str(tmp_path / "x.jsonl"), restart="hourly")


def test_rounds_run_every_target_again(model_path, tmp_path):
    """--rounds 2: every target twice in the same order, rows labelled with
    their round, the header's start-up per round, answers compared within a
    round (exact kernels: the same answers both rounds)."""
    sessions = S.load_sessions(str(TINY))
    targets = T.parse_targets(["edgespec", "edgespec-nogate=--no-gate"])
    head, rows = T.run_sessions(sessions, targets, model_path, 2048, None, 8, str(tmp_path / "r.jsonl"), rounds=2)
    assert head["rounds"] == 2
    assert set(head["started_s"]) == {"edgespec", "edgespec-nogate", "edgespec (round 2)", "edgespec-nogate (round 2)"}
    assert [(r["target"], r["round"]) for r in rows if r["kind"] == "session"] == [
        ("edgespec", 1), ("edgespec-nogate", 1), ("edgespec", 2), ("edgespec-nogate", 2)]
    assert S.identical_counts(rows, "edgespec") == {"edgespec-nogate": (8, 8)}
    first = [r["text"] for r in rows if r["kind"] == "request" and r["round"] == 1 and r["target"] == "edgespec"]
    assert first == [r["text"] for r in rows if r["kind"] == "request" and r["round"] == 2 and r["target"] == "edgespec"]


def test_replay_on_llama_server(server_binary, model_path, tmp_path):
    """llama-server plain and ngram-simple as the bench starts them: the same
    rows, and the same greedy answers from both."""
    sessions = S.load_sessions(str(TINY))
    targets = T.parse_targets(["llama-server", "llama-server-ngram-simple"])
    head, rows = T.run_sessions(sessions, targets, model_path, 2048, None, 8, str(tmp_path / "r.jsonl"),
                                binary=server_binary.path)
    _check_rows(rows, ["llama-server", "llama-server-ngram-simple"], 4)
    assert S.identical_counts(rows, "llama-server") == {"llama-server-ngram-simple": (4, 4)}
    assert head["targets"]["llama-server-ngram-simple"][0] == server_binary.path


def test_the_recorder_marks_aiders_summaries():
    """`edgespec record-session` labels a request without X-Trace-Role as the
    recorded Aider traces are labelled: their summaries `summary`, their turns
    (the lint-fix request too) `chat`."""
    from edgespec.bench import recorder as rec
    aider = [S.load_session(str(p)) for p in TRACES if S.load_session(str(p)).header["app"] == "aider"]
    roles = [(r["role"], rec.role_of(r["body"])) for s in aider for r in s.requests]
    assert {"summary", "chat"} <= {r for r, _ in roles}
    assert all(r == got for r, got in roles), roles



def test_record_session_writes_what_the_app_sent(tmp_path):
    """`edgespec record-session` (a real process, canned answers): the trace's
    header names the command, each request is kept as sent, with its role,
    and the app gets an answer, streamed when it asks; SIGTERM ends it."""
    import http.client
    import subprocess
    import sys
    import time

    from edgespec.bench.peer_server import free_port
    port, out = free_port(), tmp_path / "t.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "record-session", "--out", str(out), "--app", "test",
                             "--canned", "Hi there.", "--port", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/v1/models")
                assert json.loads(conn.getresponse().read())["data"][0]["id"] == "recorded"
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline and proc.poll() is None, "the recorder did not start"
                time.sleep(0.2)
        chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
        for body, headers in ((chat, {}), (dict(chat, stream=True), {"X-Trace-Role": "title"})):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json", **headers})
            answer = conn.getresponse().read().decode()
            assert "Hi there." in answer and (("data: [DONE]" in answer) == bool(body.get("stream")))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr.read()
    trace = S.load_session(str(out))
    assert trace.header["recorder"] == "edgespec record-session" and trace.header["app"] == "test"
    assert [(r["role"], r["body"]) for r in trace.requests] == [("chat", chat), ("title", dict(chat, stream=True))]
