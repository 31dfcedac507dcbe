"""App sessions: recorded request traces and their replay against a server.

A trace (benchmarks/sessions/*.jsonl, docs/sessions.md) is one app session: a
header line, then the HTTP requests the app sent, in order, one a line:

    {"trace": "edgespec-session", "app": ..., "app_version": ..., "model": ...,
     "recorded": "how it was recorded", ...}
    {"path": "/v1/chat/completions", "role": "chat", "body": {...}}
    {"path": "/v1/chat/completions", "role": "title", "body": {...}}

`role` says what the request is to the app (chat: a turn of the
conversation; title, tags, autocomplete, ...: a side request).  Replaying
sends each body as recorded (the history of later requests holds the answers
of the recording, not the replay's: every target gets the same prompts),
except: `model` is the target's served model, `temperature` 0 (greedy), and
a request without `max_tokens` gets the replay's cap.  A request line may
carry `gap_s`: the seconds the app paused after the answer before it sent
this request (a person reading, typing); the replay waits that long first,
outside the request's time.  Each answer's figures
come from the response's `timings` (llama-server's names, which edgespec
serve returns too; a stream has them on its last chunk), the time to first
token from the clock here: from sending the request to the first chunk that
carries text.
"""
from __future__ import annotations

import copy
import http.client
import json
import os
import time
from dataclasses import dataclass, field
from statistics import median

from edgespec.errors import BenchError, PeerError

TRACE_MARK = "edgespec-session"
PATHS = ("/v1/chat/completions", "/v1/completions")
TIMING_FIELDS = ("prompt_n", "prompt_ms", "cache_n", "predicted_n", "predicted_ms", "predicted_per_second")
REQUEST_TIMEOUT_S = 3600.0
MAX_GAP_S = 600.0       # a request line's gap_s at most: a pause, not a stall


@dataclass
class Session:
    """One trace file: its header and its requests ({"path", "role", "body"})."""
    name: str
    header: dict
    requests: list[dict] = field(default_factory=list)


def _check_request(where: str, r) -> dict:
    if not isinstance(r, dict) or not isinstance(r.get("body"), dict):
        raise BenchError(f"{where}: a request line is an object with a `body` object")
    if r.get("path") not in PATHS:
        raise BenchError(f"{where}: path {r.get('path')!r} is not one of {', '.join(PATHS)}")
    body = r["body"]
    key = "messages" if r["path"] == PATHS[0] else "prompt"
    if key not in body:
        raise BenchError(f"{where}: a {r['path']} body needs `{key}`")
    if not isinstance(r.get("role", "chat"), str):
        raise BenchError(f"{where}: `role` is a string")
    gap = r.get("gap_s", 0)
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap <= MAX_GAP_S:
        raise BenchError(f"{where}: `gap_s` is a number of seconds from 0 to {MAX_GAP_S:g}")
    return {"path": r["path"], "role": r.get("role", "chat"), "body": body, "gap_s": float(gap)}


def load_session(path: str) -> Session:
    """A trace file; BenchError saying which line is wrong."""
    name = os.path.basename(path).removesuffix(".jsonl")
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(i + 1, line) for i, line in enumerate(f) if line.strip()]
    except OSError as e:
        raise BenchError(f"cannot read the trace {path}: {e.strerror}") from None
    rows = []
    for no, line in lines:
        try:
            rows.append((no, json.loads(line)))
        except ValueError as e:
            raise BenchError(f"{path}:{no}: not JSON ({e})") from None
    if not rows or not isinstance(rows[0][1], dict) or rows[0][1].get("trace") != TRACE_MARK:
        raise BenchError(f"{path}: the first line must be the header, with \"trace\": \"{TRACE_MARK}\"")
    reqs = [_check_request(f"{path}:{no}", r) for no, r in rows[1:]]
    if not reqs:
        raise BenchError(f"{path}: no requests after the header")
    return Session(name, rows[0][1], reqs)


def load_sessions(where: str) -> list[Session]:
    """A trace file, or every *.jsonl in a folder (in name order)."""
    if os.path.isdir(where):
        files = sorted(os.path.join(where, f) for f in os.listdir(where) if f.endswith(".jsonl"))
        if not files:
            raise BenchError(f"{where}: no *.jsonl traces")
        return [load_session(f) for f in files]
    return [load_session(where)]


def replay_body(body: dict, model_id: str, max_tokens: int) -> dict:
    """What the replay sends for a recorded body (see the module doc)."""
    b = copy.deepcopy(body)
    b["model"] = model_id
    b["temperature"] = 0.0
    if b.get("max_tokens") is None and b.get("max_completion_tokens") is None:
        b["max_tokens"] = int(max_tokens)
    return b


class Client:
    """Requests to one OpenAI-compatible server at 127.0.0.1:port (stdlib)."""

    def __init__(self, base: str):
        hostport = base.removeprefix("http://").rstrip("/")
        self.host, _, port = hostport.partition(":")
        self.port = int(port or 80)

    def _conn(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S)

    def get(self, path: str) -> dict:
        """A GET's JSON body; PeerError when there is none."""
        conn = self._conn()
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return json.loads(r.read())
        except (OSError, ValueError) as e:
            raise PeerError(f"no answer to GET {path} from {self.host}:{self.port}: {e}") from None
        finally:
            conn.close()

    def model_id(self) -> str:
        """The first model /v1/models lists (the one the server runs)."""
        data = self.get("/v1/models")
        try:
            return data["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise PeerError(f"{self.host}:{self.port}/v1/models lists no model") from None

    def send(self, path: str, body: dict, on_first_token=None) -> dict:
        """One request: {status, wall_ms, ttft_ms, text, timings, finish_reason, error}
        (a stream's also: chunks, the events that carried text, and usage when
        the server sent one); on_first_token() is called as a stream's first
        text arrives."""
        conn = self._conn()
        t0 = time.perf_counter()
        try:
            conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                out = {"status": r.status, "error": r.read()[:300].decode("utf-8", "replace")}
            elif body.get("stream"):
                out = _read_stream(r, t0, on_first_token)
            else:
                out = _read_json(json.loads(r.read()))
        except (OSError, ValueError) as e:
            out = {"status": 0, "error": f"{type(e).__name__}: {e}"}
        finally:
            conn.close()
        out["wall_ms"] = (time.perf_counter() - t0) * 1e3
        return out


    def post(self, path: str, body: dict) -> dict:
        """One POST answered by one JSON object (llama-server's native
        endpoints): {status, json (None unless 200), error, wall_ms}."""
        conn = self._conn()
        out: dict = {"status": 0, "json": None}
        t0 = time.perf_counter()
        try:
            conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            raw = r.read()
            out["status"] = r.status
            if r.status == 200:
                out["json"] = json.loads(raw)
            else:
                out["error"] = raw[:300].decode("utf-8", "replace")
        except (OSError, ValueError) as e:
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        out["wall_ms"] = (time.perf_counter() - t0) * 1e3
        return out


def _choice_text(choice: dict, delta: bool) -> str:
    part = choice.get("delta" if delta else "message") or {}
    if "text" in choice:                       # /v1/completions
        return choice.get("text") or ""
    text = (part.get("content") or "") + (part.get("reasoning_content") or "")
    if part.get("tool_calls"):
        text += json.dumps(part["tool_calls"], sort_keys=True)
    return text


def _read_json(resp: dict) -> dict:
    choice = (resp.get("choices") or [{}])[0]
    return {"status": 200, "text": _choice_text(choice, delta=False), "timings": resp.get("timings") or {},
            "finish_reason": choice.get("finish_reason"), "ttft_ms": None}


def _read_stream(r, t0: float, on_first_token=None) -> dict:
    """Server-sent events until [DONE]: the text, the time its first piece
    came, the last `timings`, `usage` and finish_reason seen, the events
    that carried text."""
    out = {"status": 200, "text": "", "timings": {}, "finish_reason": None, "ttft_ms": None, "chunks": 0}
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if "error" in ev:
            out["error"] = json.dumps(ev["error"])[:300]
            break
        choice = (ev.get("choices") or [{}])[0]
        piece = _choice_text(choice, delta=True)
        if piece and out["ttft_ms"] is None:
            out["ttft_ms"] = (time.perf_counter() - t0) * 1e3
            if on_first_token is not None:
                on_first_token()
        out["chunks"] += bool(piece)
        out["text"] += piece
        out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
        if isinstance(ev.get("timings"), dict):
            out["timings"] = ev["timings"]
        if isinstance(ev.get("usage"), dict):
            out["usage"] = ev["usage"]
    return out


def request_row(target: str, session: Session, index: int, got: dict) -> dict:
    """The results row of one replayed request."""
    req = session.requests[index]
    t = got.get("timings") or {}
    row = {"kind": "request", "target": target, "session": session.name, "index": index, "role": req["role"],
           "path": req["path"], "stream": bool(req["body"].get("stream")), "status": got["status"],
           "wall_ms": got["wall_ms"], "ttft_ms": got.get("ttft_ms"), "text": got.get("text", ""),
           "finish_reason": got.get("finish_reason")}
    row.update({k: t.get(k) for k in TIMING_FIELDS})
    if got.get("error"):
        row["error"] = got["error"]
    return row


def session_row(target: str, session: Session, rows: list[dict]) -> dict:
    """A session's totals over its request rows (docs/sessions.md's columns)."""
    num = lambda k: sum(float(r.get(k) or 0) for r in rows)  # noqa: E731
    ttft = [r["ttft_ms"] for r in rows if r.get("ttft_ms") is not None]
    chat_ttft = [r["ttft_ms"] for r in rows if r["role"] == "chat" and r.get("ttft_ms") is not None]
    prompt = num("prompt_n") + num("cache_n")
    decode_s = num("predicted_ms") / 1e3
    return {"kind": "session", "target": target, "session": session.name, "app": session.header.get("app"),
            "n_requests": len(rows), "n_failed": sum(r["status"] != 200 for r in rows),
            "wall_s": num("wall_ms") / 1e3, "ttft_first_ms": ttft[0] if ttft else None,
            "ttft_followup_ms": median(chat_ttft[1:]) if len(chat_ttft) > 1 else None,
            "prefill_ms": num("prompt_ms"), "prompt_tokens": int(prompt), "cache_n": int(num("cache_n")),
            "cached_share": num("cache_n") / prompt if prompt else 0.0,
            "predicted_n": int(num("predicted_n")),
            "decode_tok_s": num("predicted_n") / decode_s if decode_s > 0 else 0.0}


def replay(client_for, target: str, sessions: list[Session], max_tokens: int, progress=None) -> list[dict]:
    """Every session's requests in order: request rows, then a session row
    after each session.  client_for(session, index) is the Client a request
    goes to (a Client itself: all to that one server)."""
    if isinstance(client_for, Client):
        client_for = (lambda c: lambda s, i: c)(client_for)
    model_id = None
    out = []
    for s in sessions:
        rows = []
        for i, req in enumerate(s.requests):
            client = client_for(s, i)
            model_id = model_id or client.model_id()
            if req["gap_s"]:
                time.sleep(req["gap_s"])        # the app's pause since the last answer (not in wall_ms)
            got = client.send(req["path"], replay_body(req["body"], model_id, max_tokens))
            rows.append(request_row(target, s, i, got))
            if progress:
                progress(rows[-1])
        out += rows + [session_row(target, s, rows)]
    return out


def read_rows(path: str, is_row, what: str) -> tuple[dict | None, list[dict]]:
    """A bench results file of JSON lines: (its header or None, every row);
    BenchError unless some row passes is_row (`what` names such rows and the
    command that writes them, for the message)."""
    try:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise BenchError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise BenchError(f"{path}: not a JSON-lines results file ({e})") from None
    if not any(isinstance(r, dict) and is_row(r) for r in rows):
        raise BenchError(f"{path}: no {what}")
    return next((r for r in rows if r.get("kind") == "header"), None), rows


def read_results(path: str) -> tuple[dict | None, list[dict]]:
    """A bench-sessions results file: (its header or None, every row)."""
    return read_rows(path, lambda r: r.get("kind") == "session",
                     "session rows (not a bench-sessions results file?)")


def identical_counts(rows: list[dict], reference: str) -> dict:
    """For each target: (answers identical to the reference target's, answers
    both have) over the requests both answered with 200 (in the same round)."""
    ref = {(r.get("round"), r["session"], r["index"]): r["text"] for r in rows
           if r["kind"] == "request" and r["target"] == reference and r["status"] == 200}
    out: dict = {}
    for r in rows:
        key = (r.get("round"), r.get("session"), r.get("index"))
        if r["kind"] != "request" or r["target"] == reference or r["status"] != 200 or key not in ref:
            continue
        same, n = out.get(r["target"], (0, 0))
        out[r["target"]] = (same + (r["text"] == ref[key]), n + 1)
    return out
