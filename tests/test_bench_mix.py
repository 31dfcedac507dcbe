"""`edgespec bench-mix`: mixes of requests sent at once (benchmarks/mixes/),
their checks, the replay's start times on a stub server written here (no
model), the report's figures from hand-written rows, and one replay on a
real `edgespec serve --parallel 2` (docs/sessions.md, "Several requests at once")."""
from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from edgespec.bench import mix as M
from edgespec.bench import session_targets as T
from edgespec.bench.mix_report import figures, format_mix
from edgespec.bench.peer_server import server_args
from edgespec.bench.sessions import Client
from edgespec.errors import BenchError

REPO = Path(__file__).resolve().parents[1]
MIXES = REPO / "benchmarks" / "mixes"


def _req(rid, **kw):
    r = {"id": rid, "kind": "title", "messages": [{"role": "user", "content": rid}], "max_tokens": 4,
         "temperature": 0, "at_s": 0}
    r.update(kw)
    return {k: v for k, v in r.items() if v is not None}


def _mix(*reqs):
    return {"mix": M.MIX_MARK, "requests": list(reqs)}


# ------------------------------------------------------------------ the mixes
def test_the_side_requests_mix_is_the_issues():
    """A long edit at 0 s, then four side requests from 1 s after its first
    token, 1.5 s apart; its code held out, with where it came from."""
    m = M.load_mix(str(MIXES / "side-requests.json"))
    assert [(r.id, r.kind) for r in m.requests] == [("edit", "long"), ("title", "title"), ("tags", "tags"),
                                                    ("follow_up", "follow_up"), ("edit2", "edit")]
    first, side = m.requests[0], m.requests[1:]
    assert first.at_s == 0 and first.body["max_tokens"] == 384 and first.path == "/v1/chat/completions"
    assert [(r.after, r.delay_s) for r in side] == [("edit", 1.0), ("edit", 2.5), ("edit", 4.0), ("edit", 5.5)]
    assert all(r.body["temperature"] == 0 for r in m.requests)
    assert all(s["license"] for s in m.header["source"]) and "join_options" in first.body["messages"][0]["content"]


def test_the_four_edits_start_together_and_their_code_is_held_out():
    m = M.load_mix(str(MIXES / "four-edits.json"))
    assert len(m.requests) == 4 and {r.at_s for r in m.requests} == {0.0}
    assert {r.body["max_tokens"] for r in m.requests} == {256} and len({r.id for r in m.requests}) == 4
    assert {s["request"] for s in m.header["source"]} == {r.id for r in m.requests}
    # held out: no function of the mixes is in the repository's prompts
    prompts = "".join(p.read_text(encoding="utf-8") for p in (REPO / "benchmarks" / "prompts").glob("*.jsonl"))
    for path in MIXES.glob("*.json"):
        for r in M.load_mix(str(path)).requests:
            if r.kind in ("long", "edit"):
                code = r.body["messages"][-1]["content"].split("```python\n")[1]
                name = code.split("(")[0].removeprefix("def ")
                assert f"def {name}(" not in prompts, name


@pytest.mark.parametrize("change, field", [
    (lambda m: m["requests"][0].pop("max_tokens"), "`max_tokens`"),
    (lambda m: m["requests"][0].update(max_tokens=0), "`max_tokens`"),
    (lambda m: m["requests"][0].update(temperature=0.7), "`temperature`"),
    (lambda m: m["requests"][0].update(at_s=-1), "`at_s`"),
    (lambda m: m["requests"][0].pop("at_s"), "`at_s`, or `after_first_token_of`"),
    (lambda m: m["requests"][0].update(prompt="x"), "`messages`"),
    (lambda m: m["requests"][0].update(messages=[]), "`messages`"),
    (lambda m: m["requests"][0].update(kind=""), "`kind`"),
    (lambda m: m["requests"][0].update(at=1), "unknown field `at`"),
    (lambda m: m["requests"][1].update(id="a"), "`id` 'a' is taken"),
    (lambda m: m["requests"][1].update(after_first_token_of="c"), "names no earlier request"),
    (lambda m: m["requests"][1].update(delay_s="soon"), "`delay_s`"),
    (lambda m: m["requests"][0].update(delay_s=1), "`delay_s` goes with"),
    (lambda m: m.update(mix="other"), "\"mix\": \"edgespec-mix\""),
    (lambda m: m.update(requests=[]), "`requests`"),
])
def test_a_bad_mix_names_the_field(change, field):
    good = _mix(_req("a"), _req("b", at_s=None, after_first_token_of="a", delay_s=0.5),
                _req("c", at_s=None, messages=None, prompt="def f(", after_first_token_of="b"))
    parsed = M.parse_mix("m", good)
    assert [r.path for r in parsed.requests] == ["/v1/chat/completions"] * 2 + ["/v1/completions"]
    assert parsed.requests[2].delay_s == 0.0
    bad = copy.deepcopy(good)
    change(bad)
    with pytest.raises(BenchError) as e:
        M.parse_mix("m", bad)
    assert field in str(e.value), str(e.value)


def test_a_mix_file_that_is_not_json_says_so(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{")
    with pytest.raises(BenchError, match="not JSON"):
        M.load_mix(str(p))


def test_start_times():
    m = M.parse_mix("m", _mix(_req("a", at_s=0.5), _req("b", at_s=None, after_first_token_of="a", delay_s=1.5)))
    assert M.start_at(m.requests[0], 100.0, {}) == 100.5
    assert M.start_at(m.requests[1], 100.0, {"a": 101.25}) == 102.75


def test_parallel_options_of_the_targets():
    """edgespec targets get --parallel N unless they set it; llama-server
    gets -np N (session_targets.started then gives it -c N * ctx)."""
    assert T.with_parallel((), 4) == ("--parallel", "4")
    assert T.with_parallel(("--kernels", "exact"), 2) == ("--parallel", "2", "--kernels", "exact")
    queue = T.parse_target("edgespec-queue=--parallel 1").extra
    assert T.with_parallel(queue, 4) == ("--parallel", "1") and T.with_parallel(("--parallel=3",), 4) == ("--parallel=3",)
    args = server_args("llama-server", "b", "m", 4 * 2048, 0, None, 1, n_parallel=4)
    assert args[args.index("-np") + 1] == "4" and args[args.index("-c") + 1] == "8192"


# ------------------------------------------------------------------ the replay on a stub server
class _Stub(BaseHTTPRequestHandler):
    """Streams three chunks per request.  "long" holds its stream after the
    first chunk until "side" has arrived (so the side request is sent while
    the long one streams, or the test fails on the timeout); "tags" answers
    with a count of its calls (beside and alone then differ)."""
    side_came = threading.Event()
    calls = {"tags": 0}

    def log_message(self, *a):
        pass

    def do_GET(self):
        self._send(200, "application/json", json.dumps({"data": [{"id": "stub"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        who = body["messages"][0]["content"]
        assert body["stream"] is True and body["model"] == "stub" and body["temperature"] == 0
        if who == "side":
            self.side_came.set()
        if who == "tags":
            self.calls["tags"] += 1
        words = [f"n{self.calls['tags']} ", "b ", "c"] if who == "tags" else [f"{who} ", "b ", "c"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, w in enumerate(words):
            ev = {"choices": [{"delta": {"content": w}, "finish_reason": "stop" if i == 2 else None}]}
            self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
            self.wfile.flush()
            if who == "long" and i == 0:
                assert self.side_came.wait(10), "the side request never came while the long one streamed"
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, code, ctype, data):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def stub():
    _Stub.side_came.clear()
    _Stub.calls["tags"] = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Client(f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()
    server.server_close()


def test_replay_sends_each_request_at_its_time(stub):
    """side starts 0.3 s after long's first token, while long streams (the
    stub holds long until side came); tags at 0.1 s; rows complete, tokens
    counted from the chunks (the stub sends no timings); alone: the same
    text, except tags, whose stub answer counts its calls."""
    m = M.parse_mix("stubmix", _mix(_req("long", kind="long", max_tokens=8),
                                    _req("side", at_s=None, after_first_token_of="long", delay_s=0.3),
                                    _req("tags", kind="tags", at_s=0.1)))
    rows = M.replay_mix(stub, "stub", m)
    long, side, tags = rows
    assert [r["id"] for r in rows] == ["long", "side", "tags"] and all(r["status"] == 200 for r in rows)
    assert side["sent_s"] >= long["sent_s"] + long["ttft_s"] + 0.3 - 1e-3
    assert long["done_s"] >= side["sent_s"] and tags["sent_s"] >= 0.1 - 1e-3 and long["sent_s"] < 0.1
    for r in rows:
        assert r["tokens"] == 3 and r["tokens_from"] == "chunks" and r["finish_reason"] == "stop"
        assert r["ttft_s"] is not None and r["done_s"] >= r["sent_s"] + r["ttft_s"] - 1e-3
        assert r["wall_s"] == pytest.approx(r["done_s"] - r["sent_s"], abs=1e-3)
    assert long["text"] == "long b c" and tags["text"] == "n1 b c"
    M.replay_alone(stub, m, rows)
    assert [r["alone_same"] for r in rows] == [True, True, False] and tags["alone_text"] == "n2 b c"
    assert "alone_text" not in long


def test_a_request_that_fails_starts_its_dependents_and_gets_a_row(stub, tmp_path):
    """A server that is not there: every request fails (status 0), the one
    after it starts anyway, and the report counts the failures."""
    m = M.parse_mix("m", _mix(_req("a", kind="long"), _req("b", at_s=None, after_first_token_of="a")))
    rows = M.replay_mix(Client("http://127.0.0.1:9"), "gone", m, model_id="x")
    assert [r["status"] for r in rows] == [0, 0] and rows[1]["sent_s"] >= rows[0]["done_s"] - 1e-3
    assert figures(rows)["n_failed"] == 2 and "2 (2 failed)" in format_mix(rows)


# ------------------------------------------------------------------ the report
def _row(target, rid, role, sent, ttft, done, tokens, same=None, status=200):
    r = {"kind": "request", "bench": "mix", "target": target, "id": rid, "role": role, "status": status,
         "sent_s": sent, "ttft_s": ttft, "done_s": done, "wall_s": done - sent, "tokens": tokens,
         "finish_reason": "stop"}
    if same is not None:
        r["alone_same"] = same
    return r


ROWS = [_row("a", "edit", "long", 0.0, 0.5, 5.5, 180, True),
        _row("a", "title", "title", 1.5, 6.0, 8.0, 10, True),
        _row("a", "tags", "tags", 3.0, 5.0, 9.0, 20, False),
        _row("a", "more", "follow_up", 4.5, 4.0, 12.5, 40, True),
        _row("b", "edit", "long", 0.0, 0.4, 14.0, 150),
        _row("b", "title", "title", 1.4, 1.0, 5.0, 10),
        _row("b", "tags", "tags", 2.9, 2.0, 20.0, 10, status=503)]


def test_report_figures_from_hand_written_rows():
    f = figures([r for r in ROWS if r["target"] == "a"])
    assert f["side_ttft_median_s"] == 5.0 and f["side_ttft_worst_s"] == 6.0
    assert (f["side_done_min_s"], f["side_done_max_s"]) == (6.0, 8.0)
    assert f["long_done_s"] == 5.5 and f["all_done_s"] == 12.5
    assert f["tokens"] == 250 and f["tokens_per_s"] == 20.0 and f["alone_same"] == (3, 4)
    g = figures([r for r in ROWS if r["target"] == "b"])      # the failed request counts in time, not in tokens
    assert g["n_failed"] == 1 and g["side_ttft_median_s"] == 1.0 and g["all_done_s"] == 20.0
    assert g["tokens"] == 160 and g["tokens_per_s"] == 8.0 and g["alone_same"] is None


def _invoke(args):
    from click.testing import CliRunner
    from edgespec.app.cli import main
    return CliRunner().invoke(main, args)


def test_cli_report_prints_the_tables(tmp_path):
    head = {"kind": "header", "bench": "mix", "command": "edgespec bench-mix x", "model": "m.gguf", "mix": "side",
            "n_requests": 4, "parallel": 4, "n_ctx": 4096, "alone": True, "targets": {"a": ["edgespec", "serve"]}}
    out = tmp_path / "r.jsonl"
    out.write_text("\n".join(json.dumps(r) for r in [head] + ROWS))
    r = _invoke(["bench-mix-report", str(out)])
    assert r.exit_code == 0, r.output
    assert "| a | 4 | 5.00 | 6.00 | 6.0-8.0 | 5.5 | 12.5 | 250 | 20.0 | 3/4 |" in r.output
    assert "| b | 3 (1 failed) | 1.00 | 1.00 | 3.6-3.6 | 14.0 | 20.0 | 160 | 8.0 | - |" in r.output
    assert "| a | tags | tags | 3.00 | 5.00 | 9.00 | 20 | stop | no |" in r.output
    assert "command: edgespec bench-mix x" in r.output and "a: edgespec serve" in r.output


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_mix(_req("a", max_tokens="many"))))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"kind": "session"}\n')
    for args, fragment in ((["bench-mix", "--mix", str(bad)], "`max_tokens`"),
                           (["bench-mix", "--mix", str(MIXES / "four-edits.json"), "--target", "vllm"], "target 'vllm'"),
                           (["bench-mix-report", str(rows)], "no mix request rows")):
        r = _invoke(args)
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (args, r.output)
        assert fragment in r.output and "Traceback" not in r.output


def test_the_default_mix_is_found_from_any_working_directory(tmp_path, monkeypatch):
    from edgespec.paths import source_data
    assert source_data("mixes", "side-requests.json") == str(MIXES / "side-requests.json")
    monkeypatch.chdir(tmp_path)
    r = _invoke(["bench-mix", "--target", "vllm"])
    assert r.exit_code == 1 and "target 'vllm'" in r.output, r.output


# ------------------------------------------------------------------ against a real server
def test_mix_on_edgespec_serve_with_two_slots(model_path, tmp_path):
    """Two requests on `edgespec serve --parallel 2` (exact kernels, as the
    tests run): the second sent 0.1 s after the first's first token; both
    answered, rows complete, and the alone pass recorded for each."""
    data = _mix(_req("long", kind="long", messages=[{"role": "user", "content": "Count from one to ten in words."}],
                     max_tokens=12),
                _req("title", at_s=None, after_first_token_of="long", delay_s=0.1,
                     messages=[{"role": "user", "content": "Give a three-word title for a chat about counting."}],
                     max_tokens=6))
    m = M.parse_mix("two", data)
    out = tmp_path / "r.jsonl"
    head, rows = M.run_mix(m, T.parse_targets(["edgespec"]), model_path,
                           M.MixSettings(n_ctx=512, parallel=2, alone=True, command="test"), str(out))
    assert head["targets"]["edgespec"][-2:] == ["--parallel", "2"] and head["parallel"] == 2
    assert [r["id"] for r in rows] == ["long", "title"]
    for r in rows:
        assert r["status"] == 200 and r["text"] and r["tokens"] >= 1 and r["tokens_from"] == "timings"
        assert r["ttft_s"] is not None and r["done_s"] >= r["sent_s"] + r["ttft_s"] - 1e-3
        assert r["finish_reason"] in ("stop", "length") and r["prompt_n"] is not None
        # recorded, not promised here: with --parallel 2 an exact answer beside another was seen to differ
        # from the same request's alone (issue 62 item 3 is to make them equal and prove it)
        assert isinstance(r["alone_same"], bool) and r["alone_wall_s"] > 0
        assert ("alone_text" in r) == (not r["alone_same"])
    assert rows[1]["sent_s"] >= rows[0]["sent_s"] + rows[0]["ttft_s"] + 0.1 - 1e-3
    saved = [json.loads(x) for x in out.read_text().splitlines()]
    assert saved[0]["kind"] == "header" and saved[0]["command"] == "test" and saved[1:] == json.loads(json.dumps(rows))
