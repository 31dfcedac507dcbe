"""Helpers for the tests that run a real `edgespec serve` subprocess."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(base: str, method: str, path: str, body=None, headers: dict | None = None,
            timeout: float = 600) -> tuple[int, dict, bytes]:
    """One HTTP request (stdlib): (status, headers, body).  A dict body is sent as JSON."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        h = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def streams_at_once(base: str, model_id: str, n: int, headers: dict | None = None) -> list[tuple]:
    """n streamed chat requests released together (a barrier); every admitted
    stream is held open until all n have their status, then dropped (the
    server cancels them).  Returns (status, Retry-After, body of a refusal)
    per request, in the order they were answered."""
    barrier, held = threading.Barrier(n), threading.Barrier(n)
    results: list = []
    lock = threading.Lock()
    host, port = base.removeprefix("http://").split(":")

    def run(i: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        try:
            barrier.wait()
            conn.request("POST", "/v1/chat/completions", body=json.dumps(
                {"model": model_id, "messages": [{"role": "user", "content": f"Tell a long story number {i}."}],
                 "max_tokens": 32, "stream": True}),      # a queued stream gets its status when it starts
                headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            with lock:
                results.append((r.status, r.getheader("Retry-After"), r.read() if r.status != 200 else b""))
            held.wait()                 # hold every admitted stream until all have their answer
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return results


@contextlib.contextmanager
def running_server(*args: str, startup_timeout: float = 600):
    """`python -m edgespec serve ARGS` on a free 127.0.0.1 port: yields its base
    URL once /health answers, stops it afterwards."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    log = tempfile.NamedTemporaryFile("w+", prefix="edgespec-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"edgespec serve exited with {proc.returncode}: {Path(log.name).read_text()}")
            try:
                if request(base, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"edgespec serve did not start: {Path(log.name).read_text()}")
            time.sleep(0.5)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # pragma: no cover
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)
