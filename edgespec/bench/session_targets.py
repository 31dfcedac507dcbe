"""The servers `edgespec bench-sessions` replays traces against.

A target is named on the command line as

    edgespec                     `edgespec serve MODEL` at its defaults
    edgespec-NAME=OPTIONS        `edgespec serve MODEL OPTIONS` (e.g. edgespec-exact=--kernels exact)
    llama-server[-ngram-...]     llama.cpp's server as edgespec.bench.peer_server starts it
                                 for that method (plain, ngram-simple, ngram-mod, ...)
    NAME=http://HOST:PORT        a server already running there (started by hand)

The tool starts each one in turn on a free loopback port with the run's
model, context and threads (llama-server: one slot, its prompt cache at its
defaults), replays every trace on it, and stops it before the next.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from edgespec.bench.peer_server import SERVER_METHODS, LlamaServerRunner, free_port, server_env, stop_process
from edgespec.bench.sessions import Client
from edgespec.errors import BenchError, PeerError

START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Target:
    name: str
    kind: str                       # "edgespec", "llama-server" or "url"
    extra: tuple[str, ...] = ()     # edgespec serve's (or llama-server's) extra options
    url: str = ""
    method: str = ""                # the llama-server method


def parse_target(spec: str) -> Target:
    """One --target value (see the module doc); BenchError for a bad one."""
    name, eq, rest = spec.partition("=")
    name = name.strip()
    if eq and rest.strip().startswith("http://"):
        return Target(name, "url", url=rest.strip())
    extra = tuple(shlex.split(rest)) if eq else ()
    if name == "edgespec" or name.startswith("edgespec-"):
        return Target(name, "edgespec", extra)
    if name in SERVER_METHODS:
        return Target(name, "llama-server", extra, method=name)
    raise BenchError(f"target {spec!r}: edgespec, edgespec-NAME=OPTIONS, one of {', '.join(SERVER_METHODS)}, "
                     f"or NAME=http://HOST:PORT")


def parse_targets(specs) -> list[Target]:
    targets = [parse_target(s) for s in specs]
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise BenchError(f"two targets have the same name: {', '.join(names)}")
    return targets


def edgespec_args(model_path: str, port: int, n_ctx: int, threads: int | None, extra=()) -> list[str]:
    """`edgespec serve`'s command line for a target (this Python, this edgespec)."""
    args = [sys.executable, "-m", "edgespec", "serve", model_path, "--port", str(port), "-c", str(n_ctx)]
    if threads:
        args += ["-t", str(threads)]
    return args + list(extra)


class EdgespecServer:
    """An `edgespec serve` subprocess: started, waited for (/health), stopped."""

    def __init__(self, args: list[str], port: int, timeout: float = START_TIMEOUT_S):
        self.args, self.port = args, port
        self.log = tempfile.TemporaryFile(mode="w+", prefix="edgespec-serve-", suffix=".log")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait(timeout)
        except BaseException:
            self.close()
            raise

    def _tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        lines = [x for x in self.log.read().splitlines() if x.strip()]
        return " | ".join(lines[-3:])[:500] or "no output"

    def _wait(self, timeout: float) -> None:
        import urllib.error
        import urllib.request
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise PeerError(f"edgespec serve exited with {self.proc.returncode}: {self._tail()}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > end:
                raise PeerError(f"edgespec serve did not answer /health in {timeout:.0f} s: {self._tail()}")
            time.sleep(0.3)

    def close(self) -> None:
        stop_process(self.proc, 60)     # a serve shutting down gives its running request time to end
        self.log.close()


@contextlib.contextmanager
def started(target: Target, model_path: str, n_ctx: int, threads: int | None, binary: str | None = None):
    """Yields (Client, the command line) for a target while it runs."""
    if target.kind == "url":
        yield Client(target.url), []
        return
    if target.kind == "edgespec":
        port = free_port()
        args = edgespec_args(model_path, port, n_ctx, threads, target.extra)
        server = EdgespecServer(args, port)
    else:
        if binary is None:
            raise PeerError("no llama-server binary given")
        server = LlamaServerRunner(target.method, binary, model_path, n_ctx, 0, threads, env=server_env(),
                                   extra_args=target.extra)
        port, args = server.port, server.args
    try:
        yield Client(f"http://127.0.0.1:{port}"), args
    finally:
        server.close()


def warm_up(client: Client, model_id: str) -> None:
    """One short request before the traces, so no session pays for a cold start."""
    client.send("/v1/chat/completions", {"model": model_id, "messages": [{"role": "user", "content": "Hi"}],
                                         "max_tokens": 2, "temperature": 0.0})


def needs_llama_server(targets: list[Target]) -> bool:
    return any(t.kind == "llama-server" for t in targets)


def header(model_path: str, sessions, n_ctx: int, threads: int | None, max_tokens: int) -> dict:
    """The first line of a results file: model, machine, settings (targets' command lines added as they start)."""
    import datetime
    import platform
    from edgespec.calibration.cache import cpu_name
    from edgespec.version import __version__

    return {"kind": "header", "edgespec_version": __version__, "model": model_path, "n_ctx": n_ctx,
            "threads": threads, "max_tokens": max_tokens, "decoding": "greedy",
            "sessions": {s.name: s.header for s in sessions}, "n_sessions": len(sessions),
            "n_requests": sum(len(s.requests) for s in sessions), "targets": {},
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "hostname": platform.node(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
            "pythonpath": os.environ.get("PYTHONPATH", "")}


def run_sessions(sessions, targets: list[Target], model_path: str, n_ctx: int, threads: int | None,
                 max_tokens: int, out_path: str, binary: str | None = None, progress=None) -> tuple[dict, list]:
    """Every target in turn: started, warmed up, every session replayed, stopped.
    Rows are written to out_path as they come (header first, rewritten with
    the targets' command lines at the end)."""
    import json

    from edgespec.bench.sessions import replay

    head = header(model_path, sessions, n_ctx, threads, max_tokens)
    rows: list[dict] = []
    for t in targets:
        with started(t, model_path, n_ctx, threads, binary) as (client, args):
            head["targets"][t.name] = args
            warm_up(client, client.model_id())
            rows += replay(client, t.name, sessions, max_tokens, progress=progress)
        with open(out_path, "w", encoding="utf-8") as f:
            for r in [head] + rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return head, rows
