"""Recording an app's requests as a session trace for `edgespec bench-sessions`
(the command is `edgespec record-session`; docs/sessions.md).

An OpenAI-compatible endpoint on 127.0.0.1 (standard library only): every
POST to /v1/chat/completions or /v1/completions is appended to the trace, as
{"path", "role", "body"} with the body exactly as the app sent it, and
answered by forwarding it to a real server (`forward`: the app sees a real
model's answers, so its follow-up requests carry real histories) or with a
canned answer, streamed when the request asks.  The request header
X-Trace-Role sets the line's role (default: role_of).  GET /v1/models is
forwarded, or answered with `model_id`.  The trace's first line is its header
(what recorded it, and how).
"""
from __future__ import annotations

import datetime
import http.client
import json
import os
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()         # one writer at a time: the server answers requests on threads
PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class Recording:
    """What a recording writes to and how it answers (the command's options)."""
    out: str
    app: str
    port: int = 8099
    app_version: str = ""
    how: str = ""                   # how the app was run, for the header
    model_note: str = ""            # the model the answers came from, for the header
    forward: str | None = None      # http://HOST:PORT of a server that answers
    forward_max_tokens: int = 300   # added to forwarded requests that have none (the trace keeps them without)
    canned: str = "OK."             # the answer without `forward`
    model_id: str = "recorded"      # the model /v1/models names without `forward`


def header(rec: Recording) -> dict:
    return {"trace": "edgespec-session", "app": rec.app, "app_version": rec.app_version, "model": rec.model_note,
            "recorded": rec.how, "answers": f"forwarded to {rec.forward}" if rec.forward else "canned",
            "forward_max_tokens": rec.forward_max_tokens if rec.forward else None,
            "date": datetime.date.today().isoformat(), "recorder": "edgespec record-session"}


def role_of(body: dict) -> str:
    """A request's role when the app sends no X-Trace-Role: `summary` for
    Aider's background summary of a long chat history (a system message and
    one user message holding the chat as '# USER' / '# ASSISTANT' sections,
    not streamed), else `chat`."""
    ms = body.get("messages") or []
    if (len(ms) == 2 and ms[0].get("role") == "system" and not body.get("stream")
            and str(ms[1].get("content", "")).startswith("# USER")):
        return "summary"
    return "chat"


def append(path: str, row: dict) -> None:
    with LOCK, open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")


def canned_events(path: str, text: str, model: str) -> list[dict]:
    """The chunks of a streamed canned answer (one text chunk, then the finish)."""
    if path == PATHS[0]:
        first = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}]}
        last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    else:
        first = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
        last = {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}
    obj = "chat.completion.chunk" if path == PATHS[0] else "text_completion"
    return [{"id": "rec", "object": obj, "created": int(time.time()), "model": model, **e} for e in (first, last)]


def canned_json(path: str, text: str, model: str) -> dict:
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
              if path == PATHS[0] else {"index": 0, "text": text, "finish_reason": "stop"})
    return {"id": "rec", "object": "chat.completion" if path == PATHS[0] else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}


class _Handler(BaseHTTPRequestHandler):
    rec: Recording              # set on the subclass recorder() makes

    def log_message(self, fmt, *a):       # quiet: one line per request below
        pass

    def _send(self, status: int, body: bytes, ctype="application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.rec.forward:
            return self._forward("GET", None)
        if self.path.rstrip("/") == "/v1/models":
            data = {"object": "list", "data": [{"id": self.rec.model_id, "object": "model", "owned_by": "me"}]}
            return self._send(200, json.dumps(data).encode())
        self._send(404, b'{"error": "not found"}')

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0].rstrip("/")
        if path not in PATHS:
            return self._send(404, b'{"error": {"message": "the recorder takes chat and text completions"}}')
        body = json.loads(raw)
        role = self.headers.get("X-Trace-Role") or role_of(body)
        append(self.rec.out, {"path": path, "role": role, "body": body})
        print(f"recorded {path} ({role}, stream {bool(body.get('stream'))}, "
              f"{len(body.get('messages') or [])} messages)", file=sys.stderr, flush=True)
        if self.rec.forward:
            fwd = dict(body)
            if fwd.get("max_tokens") is None and fwd.get("max_completion_tokens") is None:
                fwd["max_tokens"] = self.rec.forward_max_tokens
            return self._forward("POST", json.dumps(fwd).encode())
        model = body.get("model", self.rec.model_id)
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for e in canned_events(path, self.rec.canned, model):
                self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            return
        self._send(200, json.dumps(canned_json(path, self.rec.canned, model)).encode())

    def _forward(self, method: str, data: bytes | None):
        """The request to `forward`, its answer relayed as it comes (a stream line by line)."""
        u = urllib.parse.urlsplit(self.rec.forward)
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=3600)
        try:
            conn.request(method, self.path, body=data, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            ctype = r.getheader("Content-Type", "application/json")
            if "event-stream" not in ctype:
                return self._send(r.status, r.read(), ctype)
            self.send_response(r.status)
            self.send_header("Content-Type", ctype)
            self.end_headers()
            for line in r:
                self.wfile.write(line)
                self.wfile.flush()
        finally:
            conn.close()


def recorder(rec: Recording) -> ThreadingHTTPServer:
    """The recording server, bound to 127.0.0.1:rec.port (not yet serving); the
    trace gets its header first when it is new or empty."""
    if not os.path.exists(rec.out) or os.path.getsize(rec.out) == 0:
        append(rec.out, header(rec))
    handler = type("RecordingHandler", (_Handler,), {"rec": rec})
    return ThreadingHTTPServer(("127.0.0.1", rec.port), handler)
