"""Editor traces (issue 65): the generator's rule on hand-written files
(edgespec/bench/editor.py), the replay's scoring and summary on hand-made
answers (edgespec/bench/editor_replay.py), llama-server's n_indent cut on
the answer's text (core/stream.py), and one trace replayed over HTTP on an
in-process edgespec server with Qwen2.5-Coder-0.5B (the model-matrix tier)."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest

from edgespec.bench import editor as E
from edgespec.bench import editor_replay as R
from edgespec.bench.session_targets import parse_targets
from edgespec.core.stream import TextStream
from edgespec.errors import BenchError

SOURCE = 'def area(w, h):\n    """The area."""\n    return w * h\n\nx = 1\n'
EXTRA_A = "".join(f"a{i} = {i}\n" for i in range(7))      # chunks of 3 lines: a0-a2, a3-a5 (a6 alone: too short)
EXTRA_B = "b = 1\nc = 2\nd = 3\n"


def write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return str(p)


def small_trace(tmp_path, **spec):
    src = write(tmp_path, "proj/area.py", SOURCE)
    a, b = write(tmp_path, "proj/a.py", EXTRA_A), write(tmp_path, "proj/lib/b.py", EXTRA_B)
    return E.editor_trace(src, [a, b], E.TraceSpec(**{"ring_chunks": 2, "chunk_lines": 3, **spec}))


# ------------------------------------------------------------------ the generator
def test_cursor_columns_follow_the_rule():
    assert E.cursor_columns("def area(w, h):") == [0, 5, 10]
    assert E.cursor_columns("    return w * h") == [4, 8, 12]
    assert E.cursor_columns("\t}") == [1] and E.cursor_columns("  ab") == [2, 3]
    assert E.cursor_columns("") == [] and E.cursor_columns("   \t") == []


def test_trace_of_a_small_file(tmp_path):
    """Three requests per line (fewer for a short one), none for the blank
    line; llama.vim's fields; the ring from the other files, moved on every
    two lines, sent when it changes."""
    t = small_trace(tmp_path, ring_every=2)
    roles = [(r["role"], r["line"], r["col"]) for r in t.requests]
    assert roles == [("ring", 1, 0), ("line", 1, 0), ("keystroke", 1, 5), ("keystroke", 1, 10),
                     ("line", 2, 4), ("keystroke", 2, 9), ("keystroke", 2, 14),
                     ("ring", 3, 0), ("line", 3, 4), ("keystroke", 3, 8), ("keystroke", 3, 12),
                     ("line", 5, 0), ("keystroke", 5, 1), ("keystroke", 5, 3)]
    a0 = {"filename": "a.py", "text": "a0 = 0\na1 = 1\na2 = 2\n"}
    b0 = {"filename": "lib/b.py", "text": EXTRA_B}
    a1 = {"filename": "a.py", "text": "a3 = 3\na4 = 4\na5 = 5\n"}
    assert t.requests[0]["body"]["input_extra"] == [a0, b0] and t.requests[0]["body"]["n_predict"] == 0
    assert t.requests[7]["body"]["input_extra"] == [b0, a1]
    assert [r["body"]["input_extra"] for r in t.requests[8:]] == [[b0, a1]] * 6
    first = t.requests[1]
    assert first["body"]["input_prefix"] == "\n" and first["body"]["prompt"] == ""
    assert first["typed"] == "def area(w, h):" and first["body"]["n_indent"] == 0
    assert first["body"]["input_suffix"] == '\n    """The area."""\n    return w * h\n\nx = 1\n'
    key = t.requests[9]["body"]
    assert key["prompt"] == "    retu" and t.requests[9]["typed"] == "rn w * h" and key["n_indent"] == 4
    assert key["input_prefix"] == 'def area(w, h):\n    """The area."""\n' and key["input_suffix"] == "\n\nx = 1\n"
    start = t.requests[4]      # only the indentation typed: llama.vim starts the line from its first column
    assert start["body"]["prompt"] == "" and start["body"]["n_indent"] == 0 and start["typed"] == '    """The area."""'
    assert (key["n_predict"], key["t_max_predict_ms"], key["top_k"], key["top_p"]) == (128, 500, 40, 0.99)
    assert key["samplers"] == ["top_k", "top_p", "infill"] and key["cache_prompt"] is True
    assert "timings/cache_n" in key["response_fields"] and "content" in key["response_fields"]
    assert t.header["lines_typed"] == [1, 2, 3, 5] and t.header["extra"] == ["a.py", "lib/b.py"]
    assert len(t.header["source_sha256"]) == 64 and t.header["trace"] == E.TRACE_MARK


def test_windows_ring_and_range(tmp_path):
    """256 lines before the cursor, 64 after; --start and --lines choose the
    lines typed; a fixed ring is sent once."""
    src = write(tmp_path, "big.py", "".join(f"v{i} = {i}\n" for i in range(400)))
    a = write(tmp_path, "a.py", EXTRA_A)
    t = E.editor_trace(src, [a], E.TraceSpec(start=301, n_lines=2, chunk_lines=3))
    assert [(r["role"], r["line"]) for r in t.requests] == [("ring", 301)] + [("line", 301)] + [("keystroke", 301)] * 2 \
        + [("line", 302)] + [("keystroke", 302)] * 2
    b = t.requests[1]["body"]
    assert b["input_prefix"] == "".join(f"v{i} = {i}\n" for i in range(44, 300))
    assert b["input_suffix"] == "\n" + "".join(f"v{i} = {i}\n" for i in range(301, 365))
    assert [c["text"] for c in b["input_extra"]] == [EXTRA_A[:21], EXTRA_A[21:42]]
    with pytest.raises(BenchError, match="no line 401"):
        E.editor_trace(src, [], E.TraceSpec(start=401))
    with pytest.raises(BenchError):
        E.TraceSpec(chunk_lines=2)


def test_trace_file_round_trip_and_errors(tmp_path):
    t = small_trace(tmp_path)
    out = tmp_path / "t.jsonl"
    E.write_trace(t, str(out))
    back = E.load_editor_trace(str(out))
    assert back.header == t.header and back.requests == t.requests and back.name == "t"
    out.write_text('{"trace": "edgespec-session"}\n')
    with pytest.raises(BenchError, match="first line must be the header"):
        E.load_editor_trace(str(out))
    out.write_text(json.dumps(t.header) + '\n{"path": "/v1/completions", "role": "line", "typed": "", "body": {}}\n')
    with pytest.raises(BenchError, match="t.jsonl:2"):
        E.load_editor_trace(str(out))


# ------------------------------------------------------------------ scoring and summary
def test_first_line_scoring():
    assert R.first_line_right("rn w * h\n\nx = 1", "rn w * h")
    assert R.first_line_right("rn w * h  \n", "rn w * h")
    assert not R.first_line_right("rn w*h", "rn w * h")
    assert not R.first_line_right("\nrn w * h", "rn w * h")
    assert not R.first_line_right("", "") and not R.first_line_right("x", "")


def test_answer_fields_read_filtered_and_whole_answers():
    flat = {"content": "ab\n", "timings/prompt_n": 7, "timings/prompt_ms": 3.5, "timings/cache_n": 90,
            "timings/predicted_n": 4, "tokens_cached": 101, "truncated": False}
    got = R.answer_fields(flat)
    assert (got["text"], got["prompt_n"], got["cache_n"], got["predicted_n"], got["tokens_cached"]) == ("ab\n", 7, 90, 4, 101)
    assert got["predicted_ms"] is None
    whole = {"content": "x", "timings": {"prompt_n": 1, "cache_n": 2, "prompt_ms": 1.0, "predicted_n": 3,
                                         "predicted_ms": 9.0}, "stop_type": "eos"}
    got = R.answer_fields(whole)
    assert (got["prompt_n"], got["cache_n"], got["predicted_ms"], got["stop_type"]) == (1, 2, 9.0, "eos")


def test_replay_body_is_greedy():
    body = E.infill_body(["    x = 1"], 0, 6, [])
    sent = R.replay_body(body)
    assert sent["top_k"] == 1 and sent["temperature"] == 0.0 and body["top_k"] == 40
    assert sent["samplers"] == body["samplers"] and sent["prompt"] == "    x "
    ring = R.replay_body(E.ring_body([{"filename": "a", "text": "b\n"}]))
    assert "top_k" not in ring and ring["n_predict"] == 0


class Answers:
    """A stand-in server: hand-made answers, one per request in order."""

    def __init__(self, answers):
        self.answers, self.sent = list(answers), []

    def post(self, path, body):
        self.sent.append((path, body))
        return self.answers.pop(0)


def _answer(wall, content, prompt_n, prompt_ms, cache_n, predicted_n=5):
    return {"status": 200, "wall_ms": wall, "json": {
        "content": content, "timings/prompt_n": prompt_n, "timings/prompt_ms": prompt_ms,
        "timings/cache_n": cache_n, "timings/predicted_n": predicted_n, "tokens_cached": prompt_n + cache_n + predicted_n}}


def test_replay_rows_and_summary(tmp_path):
    """Request rows in order, the ring apart; p50/p95 (linear), mean, the
    prefill share, tokens per request at a new line and per keystroke,
    first lines right; a failed request counted, not scored."""
    t = small_trace(tmp_path, n_lines=2)      # ring, line 1 x3, line 2 x3
    typed = [r["typed"] for r in t.requests]
    answers = [{"status": 200, "wall_ms": 50.0, "json": {}},
               _answer(100.0, typed[1] + "\n    pass", 300, 60.0, 40),
               _answer(200.0, "wrong", 10, 20.0, 330),
               _answer(300.0, typed[3], 12, 30.0, 330),
               _answer(400.0, typed[4] + "\n", 280, 200.0, 60),
               {"status": 500, "wall_ms": 5.0, "error": "boom"},
               _answer(500.0, "", 8, 10.0, 340)]
    server = Answers(answers)
    rows = R.replay(lambda s, i: server, "t1", [t])
    assert [p for p, _ in server.sent] == ["/infill"] * 7 and server.sent[1][1]["top_k"] == 1
    reqs, s = rows[:-1], rows[-1]
    assert [r["first_line_right"] for r in reqs] == [False, True, False, True, True, False, False]
    assert reqs[5]["error"] == "boom" and reqs[5]["prompt_n"] is None
    assert s["kind"] == "summary" and s["n_requests"] == 6 and s["n_failed"] == 1 and s["first_lines_right"] == 3
    assert s["p50_ms"] == 300.0 and s["p95_ms"] == pytest.approx(480.0) and s["mean_ms"] == 300.0
    assert s["prefill_share"] == pytest.approx(320.0 / 1500.0)
    assert s["prompt_n_line"] == 290.0 and s["prompt_n_keystroke"] == 10.0 and s["n_ring"] == 1 and s["ring_ms"] == 50.0
    out = tmp_path / "r.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in [{"kind": "header", "model": "m"}] + rows))
    head, back = R.read_results(str(out))
    table = R.format_editor(back, head)
    assert "3/6" in table and "0.30" in table and "21%" in table and "(1 failed)" in table
    with pytest.raises(BenchError, match="no editor summary"):
        out.write_text('{"kind": "session"}\n')
        R.read_results(str(out))


def test_fim_preset_goes_to_llama_server_targets_only():
    targets = R.with_fim_preset(parse_targets(["edgespec", "llama-server-ngram-mod=--top-k 1", "x=http://127.0.0.1:1"]))
    assert targets[0].extra == () and targets[2].extra == ()
    assert targets[1].extra == R.FIM_PRESET + ("--top-k", "1")


def _invoke(args):
    from conftest import cli_runner

    from edgespec.app.cli import main
    return cli_runner().invoke(main, args)


def test_cli_writes_a_trace_and_reports_a_run(tmp_path):
    """editor-trace writes what editor_trace builds (and says how many
    requests); bench-editor-report prints a saved run; mistakes end in one line."""
    src = write(tmp_path, "proj/area.py", SOURCE)
    a = write(tmp_path, "proj/a.py", EXTRA_A)
    out = tmp_path / "t.jsonl"
    r = _invoke(["editor-trace", src, "--extra", a, "--chunk-lines", "3", "--lines", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    got = E.load_editor_trace(str(out))
    want = E.editor_trace(src, [a], E.TraceSpec(n_lines=2, chunk_lines=3))
    assert got.requests == want.requests and "6 requests on 2 lines of area.py (+ 1 ring updates)" in r.stderr
    rows = R.replay(lambda s, i: Answers([_answer(10.0 * (i + 1), got.requests[i]["typed"], 5, 1.0, 9)]), "t", [got])
    res = tmp_path / "r.jsonl"
    res.write_text("".join(json.dumps(x) + "\n" for x in [{"kind": "header", "model": "m.gguf", "targets": {"t": ["x"]}}] + rows))
    r = _invoke(["bench-editor-report", str(res)])
    assert r.exit_code == 0 and "model: m.gguf" in r.output and "6/6" in r.output, r.output
    session = write(tmp_path, "s.jsonl", '{"trace": "edgespec-session"}\n')
    for args, fragment in ((["editor-trace", src, "--start", "99", "--out", str(out)], "no line 99"),
                           (["bench-editor-report", str(out)], "no editor summary rows"),
                           (["bench-editor", "--trace", src], "not JSON lines"),
                           (["bench-editor", "--trace", session], "first line must be the header")):
        r = _invoke(args)
        assert r.exit_code == 1 and fragment in r.stderr and "Traceback" not in r.stderr, (args, r.output)


# ------------------------------------------------------------------ n_indent
class Chars:
    """A vocabulary whose token t is the character chr(t)."""

    def piece(self, t: int) -> bytes:
        return chr(t).encode()


def _indent_cut(pieces: list[str], n_indent: int, stop=()) -> tuple[str, bool, bool]:
    out = TextStream(Chars(), list(stop), n_indent)
    done = False
    for p in pieces:
        if out.push_many([ord(c) for c in p]):
            done = True
            break
    return out.text, done, out.indent_cut


def test_n_indent_cuts_the_first_line_indented_less():
    """llama-server's rule: lines after the first newline need n_indent of
    indentation; the first that has less, once a character follows it (a
    blank line counts), is cut there, its indentation kept; the first line
    is never judged; 0 is off; the earliest of a stop string and the cut wins."""
    body = "x = 1\n        y = 2\n    z = 3\n"
    assert _indent_cut([body], 8) == ("x = 1\n        y = 2\n    ", True, True)
    assert _indent_cut(list(body), 8) == ("x = 1\n        y = 2\n    ", True, True)
    assert _indent_cut([body], 4) == (body, False, False) and _indent_cut([body], 0) == (body, False, False)
    assert _indent_cut(["a\n\tb\n\n  c"], 1) == ("a\n\tb\n", True, True)
    assert _indent_cut(["  a\n  b\n"], 3) == ("  a\n  ", True, True)
    assert _indent_cut(["x\n    ", "  "], 8) == ("x\n      ", False, False)      # undecided: all indentation so far
    assert _indent_cut(["x\n  y"], 4, stop=["x"]) == ("", True, False)
    assert _indent_cut(["x\n  y STOP"], 4, stop=["STOP"]) == ("x\n  ", True, True)


# ------------------------------------------------------------------ over HTTP (matrix)
@contextlib.contextmanager
def served(model):
    """edgespec's server app on a loopback port, in this process (uvicorn in
    a thread; no lifespan: the module's model stays open)."""
    import uvicorn

    from edgespec.app.server import Server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(Server(model, model_id="coder").app, host="127.0.0.1", port=port,
                                        log_level="warning", lifespan="off"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not srv.started:
        assert th.is_alive() and time.monotonic() - t0 < 60, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(60)


@pytest.mark.matrix
def test_replay_on_an_in_process_server(coder, tmp_path):
    """A four-request trace (the ring, one line's three requests) replayed
    over HTTP as bench-editor runs a target: every request answered, the
    keystrokes reusing the line's cells, the first lines those of the
    library's greedy infill of the same request; the results file reads back."""
    from edgespec.bench.session_targets import run_sessions
    t = small_trace(tmp_path, start=3, n_lines=1)
    assert [r["role"] for r in t.requests] == ["ring", "line", "keystroke", "keystroke"]
    out = tmp_path / "r.jsonl"
    with served(coder) as base:
        head, rows = run_sessions([t], parse_targets([f"inproc={base}"]), coder.model_path, 2048, None, 0, str(out),
                                  kind=R)
    assert head["bench"] == "editor" and head["targets"] == {"inproc": []}
    reqs, s = [r for r in rows if r["kind"] == "request"], rows[-1]
    assert [r["status"] for r in reqs] == [200] * 4, [r.get("error") for r in reqs]
    assert reqs[0]["prompt_n"] is None and reqs[0]["text"] == ""         # the ring: no answer asked for
    line, keys = reqs[1], reqs[2:]
    assert line["prompt_n"] > 0 and all(r["predicted_n"] >= 1 and r["tokens_cached"] > r["cache_n"] for r in reqs[1:])
    assert all(r["cache_n"] > 0 and r["prompt_n"] < line["prompt_n"] for r in keys), [(r["prompt_n"], r["cache_n"]) for r in reqs]
    for req, row in zip(t.requests[1:], reqs[1:]):
        b = req["body"]
        ref = coder.infill(b["input_prefix"], b["input_suffix"], [(c["filename"], c["text"]) for c in b["input_extra"]],
                           middle=b["prompt"], max_tokens=128)
        assert R.first_line(row["text"]) == R.first_line(ref.text), (row["text"], ref.text)
        assert row["first_line_right"] == R.first_line_right(ref.text, req["typed"])
    assert s["n_requests"] == 3 and s["n_failed"] == 0 and s["n_ring"] == 1 and s["p50_ms"] > 0
    assert s["first_lines_right"] == sum(r["first_line_right"] for r in reqs)
    head2, back = R.read_results(str(out))
    assert head2["bench"] == "editor" and back[1:] == json.loads(json.dumps(rows))
    assert "inproc" in R.format_editor(back, head2)
