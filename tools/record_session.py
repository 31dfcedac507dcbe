#!/usr/bin/env python3
"""Record an app's requests as a session trace for `edgespec bench-sessions`.

    python tools/record_session.py --out benchmarks/sessions/aider-edit.jsonl \\
        --app aider --app-version 0.86.2 --how "aider --message ... x3" \\
        --forward http://127.0.0.1:8080 --forward-max-tokens 300 --port 8099

An OpenAI-compatible endpoint on 127.0.0.1 (stdlib only): every POST to
/v1/chat/completions or /v1/completions is appended to the trace, as
{"path", "role", "body"} with the body exactly as the app sent it, and
answered by forwarding it to a real server (--forward: the app sees a real
model's answers, so its follow-up requests carry real histories) or with a
canned answer (--canned TEXT), streamed when the request asks.  The request
header X-Trace-Role sets the line's role (default: `summary` for Aider's
history summaries, see role_of, else chat).  GET /v1/models is
forwarded, or answered with --model-id.  The trace's first line is its
header (docs/sessions.md): what recorded it, and how.  Ctrl-C or SIGTERM stops.
"""
from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import signal
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
PATHS = ("/v1/chat/completions", "/v1/completions")


def header(a) -> dict:
    return {"trace": "edgespec-session", "app": a.app, "app_version": a.app_version, "model": a.model_note,
            "recorded": a.how, "answers": f"forwarded to {a.forward}" if a.forward else "canned",
            "forward_max_tokens": a.forward_max_tokens if a.forward else None,
            "date": datetime.date.today().isoformat(), "recorder": "tools/record_session.py"}


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


class Handler(BaseHTTPRequestHandler):
    args: argparse.Namespace

    def log_message(self, fmt, *a):       # quiet: one line per request below
        pass

    def _send(self, status: int, body: bytes, ctype="application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.args.forward:
            return self._forward("GET", None)
        if self.path.rstrip("/") == "/v1/models":
            data = {"object": "list", "data": [{"id": self.args.model_id, "object": "model", "owned_by": "me"}]}
            return self._send(200, json.dumps(data).encode())
        self._send(404, b'{"error": "not found"}')

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0].rstrip("/")
        if path not in PATHS:
            return self._send(404, b'{"error": {"message": "the recorder takes chat and text completions"}}')
        body = json.loads(raw)
        role = self.headers.get("X-Trace-Role") or role_of(body)
        append(self.args.out, {"path": path, "role": role, "body": body})
        print(f"recorded {path} ({role}, stream {bool(body.get('stream'))}, "
              f"{len(body.get('messages') or [])} messages)", file=sys.stderr, flush=True)
        if self.args.forward:
            fwd = dict(body)
            if fwd.get("max_tokens") is None and fwd.get("max_completion_tokens") is None:
                fwd["max_tokens"] = self.args.forward_max_tokens
            return self._forward("POST", json.dumps(fwd).encode())
        model = body.get("model", self.args.model_id)
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for e in canned_events(path, self.args.canned, model):
                self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            return
        self._send(200, json.dumps(canned_json(path, self.args.canned, model)).encode())

    def _forward(self, method: str, data: bytes | None):
        """The request to --forward, its answer relayed as it comes (a stream line by line)."""
        u = urllib.parse.urlsplit(self.args.forward)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the trace to write (appended to if it exists)")
    ap.add_argument("--port", type=int, default=8099)
    ap.add_argument("--app", required=True, help="the app that sends the requests (aider, ...)")
    ap.add_argument("--app-version", default="")
    ap.add_argument("--how", default="", help="how the app was run (its command lines), for the header")
    ap.add_argument("--model-note", default="", help="the model the answers came from, for the header")
    ap.add_argument("--forward", default=None, help="http://HOST:PORT of a server that answers")
    ap.add_argument("--forward-max-tokens", type=int, default=300,
                    help="max_tokens added to forwarded requests that have none (the trace keeps them without)")
    ap.add_argument("--canned", default="OK.", help="the answer without --forward")
    ap.add_argument("--model-id", default="recorded", help="the model /v1/models names without --forward")
    a = ap.parse_args(argv)
    if not os.path.exists(a.out) or os.path.getsize(a.out) == 0:
        append(a.out, header(a))
    Handler.args = a
    srv = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"recording to {a.out} on http://127.0.0.1:{a.port}/v1", file=sys.stderr, flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
