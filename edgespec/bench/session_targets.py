"""The servers `edgespec bench-sessions` replays traces against.

A target is named on the command line as

    edgespec                     `edgespec serve MODEL` at its defaults
    edgespec-NAME=OPTIONS        `edgespec serve MODEL OPTIONS` (e.g. edgespec-exact=--kernels exact)
    llama-server[-ngram-...]     llama.cpp's server as edgespec.bench.peer_server starts it
                                 for that method (plain, ngram-simple, ngram-mod, ...)
    NAME=http://HOST:PORT        a server already running there (started by hand)

The tool starts each one in turn on a free loopback port with the run's
model, context and threads (llama-server: one slot, or bench-mix's --parallel
slots, see started(); its prompt cache at its defaults), replays every trace
on it, and stops it before the next.

An edgespec target's OPTIONS may also hold two of the bench's own:
`--fresh-cache` starts it as a new user starts it, with an empty cache
folder of its own (EDGESPEC_CACHE_DIR: nothing calibrated or timed, no
saved prompts) and no warm-up request, so its first request pays what a new
user's does; `--same-cache` starts it with the folder the last fresh target
left (that user's second session).  Where a --same-cache target follows, a
fresh target's server is kept up after its sessions, idle, until its
background calibration has ended (as a user's server between two
sessions), so that target starts with what it cached.  The time each target took to start (to its
first /health) and that wait are in the header: a fresh start's load-time
measurements are there, not in the sessions' wall time.

`restart` ("session" or "request") stops every target and starts it again
before each session (or each request), as a user's server is restarted (a
reboot, an update, a model switch) or an embedding app relaunched: no
warm-up after a restart, and every start's seconds in the header.  An
edgespec target then keeps one cache folder across its restarts (the prompt
cache's disk tier, issue 57): its own fresh one with --fresh-cache, the last
fresh one's with --same-cache, else a folder of its own that starts with a
copy of the environment's calibration and no saved prompts (so that files
from earlier runs cannot serve these prompts).
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
CALIBRATION_TIMEOUT_S = 1200.0     # a fresh target's background calibration, waited for after its sessions


CACHE_OPTIONS = ("--fresh-cache", "--same-cache")
RESTARTS = ("session", "request")


@dataclass(frozen=True)
class Target:
    name: str
    kind: str                       # "edgespec", "llama-server" or "url"
    extra: tuple[str, ...] = ()     # edgespec serve's (or llama-server's) extra options
    url: str = ""
    method: str = ""                # the llama-server method
    cache: str = ""                 # edgespec: "fresh", "same" or "" (the environment's cache folder)


def parse_target(spec: str) -> Target:
    """One --target value (see the module doc); BenchError for a bad one."""
    name, eq, rest = spec.partition("=")
    name = name.strip()
    if eq and rest.strip().startswith("http://"):
        return Target(name, "url", url=rest.strip())
    extra = tuple(shlex.split(rest)) if eq else ()
    if name == "edgespec" or name.startswith("edgespec-"):
        cache = [o for o in extra if o in CACHE_OPTIONS]
        if len(cache) > 1:
            raise BenchError(f"target {spec!r}: --fresh-cache or --same-cache, not both")
        return Target(name, "edgespec", tuple(o for o in extra if o not in CACHE_OPTIONS),
                      cache=cache[0][2:-6] if cache else "")
    if any(o in CACHE_OPTIONS for o in extra):
        raise BenchError(f"target {spec!r}: --fresh-cache and --same-cache are for edgespec targets")
    if name in SERVER_METHODS:
        return Target(name, "llama-server", extra, method=name)
    raise BenchError(f"target {spec!r}: edgespec, edgespec-NAME=OPTIONS, one of {', '.join(SERVER_METHODS)}, "
                     f"or NAME=http://HOST:PORT")


def parse_targets(specs) -> list[Target]:
    targets = [parse_target(s) for s in specs]
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise BenchError(f"two targets have the same name: {', '.join(names)}")
    fresh = False
    for t in targets:
        if t.cache == "same" and not fresh:
            raise BenchError(f"target {t.name}: --same-cache reuses an earlier --fresh-cache target's folder; "
                             "none comes before it")
        fresh = fresh or t.cache == "fresh"
    return targets


def edgespec_args(model_path: str, port: int, n_ctx: int, threads: int | None, extra=()) -> list[str]:
    """`edgespec serve`'s command line for a target (this Python, this edgespec)."""
    args = [sys.executable, "-m", "edgespec", "serve", model_path, "--port", str(port), "-c", str(n_ctx)]
    if threads:
        args += ["-t", str(threads)]
    return args + list(extra)


class EdgespecServer:
    """An `edgespec serve` subprocess: started, waited for (/health), stopped."""

    def __init__(self, args: list[str], port: int, timeout: float = START_TIMEOUT_S, env: dict | None = None):
        self.args, self.port = args, port
        self.log = tempfile.TemporaryFile(mode="w+", prefix="edgespec-serve-", suffix=".log")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
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


def with_parallel(extra: tuple[str, ...], parallel: int) -> tuple[str, ...]:
    """An edgespec target's serve options with `--parallel N` first, unless
    they set --parallel themselves (edgespec-queue='--parallel 1': the queue)."""
    if parallel == 1 or any(o == "--parallel" or o.startswith("--parallel=") for o in extra):
        return extra
    return ("--parallel", str(parallel)) + extra


@contextlib.contextmanager
def started(target: Target, model_path: str, n_ctx: int, threads: int | None, binary: str | None = None,
            cache_dir: str | None = None, parallel: int = 1):
    """Yields (Client, the command line) for a target while it runs;
    cache_dir: an edgespec target's EDGESPEC_CACHE_DIR (None: the environment's);
    parallel: requests served at once, each with n_ctx tokens of context
    (edgespec serve's --parallel gives every slot -c; llama-server's -np
    splits its -c between the slots, so it gets -c parallel * n_ctx)."""
    if target.kind == "url":
        yield Client(target.url), []
        return
    if target.kind == "edgespec":
        port = free_port()
        args = edgespec_args(model_path, port, n_ctx, threads, with_parallel(target.extra, parallel))
        env = dict(os.environ, EDGESPEC_CACHE_DIR=cache_dir) if cache_dir else None
        server = EdgespecServer(args, port, env=env)
    else:
        if binary is None:
            raise PeerError("no llama-server binary given")
        server = LlamaServerRunner(target.method, binary, model_path, n_ctx * parallel, 0, threads, env=server_env(),
                                   extra_args=target.extra, n_parallel=parallel)
        port, args = server.port, server.args
    try:
        yield Client(f"http://127.0.0.1:{port}"), args
    finally:
        server.close()


def warm_up(client: Client, model_id: str) -> None:
    """One short request before the traces, so no session pays for a cold start."""
    client.send("/v1/chat/completions", {"model": model_id, "messages": [{"role": "user", "content": "Hi"}],
                                         "max_tokens": 2, "temperature": 0.0})


def settles(targets: list, i: int) -> bool:
    """Whether targets[i]'s background calibration is waited for before it stops: a fresh target's,
    where a later --same-cache target reads its folder."""
    return targets[i].cache == "fresh" and any(u.cache == "same" for u in targets[i + 1:])


def calibration_ended(client: Client) -> float | None:
    """Seconds until an idle edgespec server's background calibration ended
    (its /health no longer says "measuring"); None after CALIBRATION_TIMEOUT_S."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < CALIBRATION_TIMEOUT_S:
        if client.get("/health").get("calibration") != "measuring":
            return round(time.monotonic() - t0, 1)
        time.sleep(2.0)
    return None


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


def seeded_cache(folder: str) -> str:
    """`folder` holding a copy of the environment's calibration (c(T), the
    self-check, the kernels' price) and nothing else: a calibrated user's
    cache without saved prompts."""
    import shutil

    from edgespec.paths import cache_dir

    os.makedirs(folder, exist_ok=True)
    src = os.path.join(cache_dir(), "calibration")
    if os.path.isdir(src):
        shutil.copytree(src, os.path.join(folder, "calibration"), ignore=shutil.ignore_patterns("*.lock"))
    return folder


class Restarting:
    """A target's server, started again whenever the replay asks with a new
    key (run_sessions' restart); start() is a started(...) context."""

    def __init__(self, start):
        self._start, self._key, self._cm = start, None, None
        self.args: list[str] = []
        self.starts_s: list[float] = []

    def client(self, key):
        if self._cm is None or key != self._key:
            self.close()
            t0 = time.monotonic()
            cm = self._start()
            self.client_now, self.args = cm.__enter__()
            self._cm, self._key = cm, key
            self.starts_s.append(round(time.monotonic() - t0, 2))
        return self.client_now

    def close(self) -> None:
        cm, self._cm = self._cm, None
        if cm is not None:
            cm.__exit__(None, None, None)


def _restart_key(restart: str):
    """The replay's (session, index) -> the key whose change restarts a server."""
    if restart == "session":
        return lambda s, i: s.name
    if restart == "request":
        return lambda s, i: (s.name, i)
    return lambda s, i: None


def _cache_for(t: Target, restart: str, stack, fresh_dir: str | None) -> str | None:
    if t.cache:
        return fresh_dir
    if restart and t.kind == "edgespec":
        return seeded_cache(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgespec-restarts-")))
    return None


def run_sessions(sessions, targets: list[Target], model_path: str, n_ctx: int, threads: int | None,
                 max_tokens: int, out_path: str, binary: str | None = None, progress=None,
                 restart: str = "", rounds: int = 1, kind=None) -> tuple[dict, list]:
    """Every target in turn: started, warmed up, every session replayed, stopped
    (restart: see the module doc); `rounds` times over, the targets in the
    same order each round (rows then carry their round: a machine whose speed
    drifts between runs shows it, and every target gets samples of each part
    of the run).  Rows are written to out_path as they come (header first,
    rewritten with the targets' command lines at the end).  kind: the
    module whose replay(...) and warm_up(...) run the sessions (default
    edgespec.bench.sessions and this module's warm_up; the editor traces
    pass edgespec.bench.editor_replay), its BENCH in the header's `bench`."""
    import json

    if restart and restart not in RESTARTS:
        raise BenchError(f"restart must be one of {', '.join(RESTARTS)}")
    head = header(model_path, sessions, n_ctx, threads, max_tokens)
    if kind is not None:
        head["bench"] = kind.BENCH
    head["started_s"], head["cache"] = {}, {}
    if restart:
        head["restart"], head["restarts_s"] = restart, {}
    if rounds > 1:
        head["rounds"] = rounds
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        fresh_dir = None
        for rnd in range(rounds):
            for i, t in enumerate(targets):
                if t.cache == "fresh":
                    fresh_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="edgespec-new-user-"))
                cache = _cache_for(t, restart, stack, fresh_dir)
                label = t.name if rnd == 0 else f"{t.name} (round {rnd + 1})"
                got = _run_target(t, label, head, sessions, cache, (model_path, n_ctx, threads, max_tokens, binary),
                                  restart, (progress, kind, settles(targets, i)))
                rows += [dict(r, round=rnd + 1) for r in got] if rounds > 1 else got
                with open(out_path, "w", encoding="utf-8") as f:
                    for r in [head] + rows:
                        f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return head, rows


def _run_target(t: Target, label: str, head: dict, sessions, cache: str | None, run: tuple, restart: str,
                how: tuple) -> list[dict]:
    """One target's replay of every session; its start-up (and a fresh
    target's calibration) noted in `head` under `label`.  how: (progress,
    the replay's module or None: run_sessions' kind, whether to wait for a
    fresh target's background calibration to end before stopping it)."""
    from edgespec.bench import sessions as default_kind

    progress, kind, settle = how
    replay, warm = (kind.replay, kind.warm_up) if kind is not None else (default_kind.replay, warm_up)
    model_path, n_ctx, threads, max_tokens, binary = run
    key = _restart_key(restart)
    server = Restarting(lambda: started(t, model_path, n_ctx, threads, binary, cache))
    try:
        client = server.client(key(sessions[0], 0))
        head["targets"][t.name] = server.args
        head["started_s"][label] = server.starts_s[0]
        head["cache"][label] = t.cache or ("own, calibration copied" if cache else "as found")
        if t.cache != "fresh" and not restart:      # a new user's (a restart's) first request pays the cold start
            warm(client, client.model_id())
        rows = replay(lambda s, i: server.client(key(s, i)), t.name, sessions, max_tokens, progress=progress)
        if restart:
            head["restarts_s"][label] = server.starts_s
        if t.cache == "fresh":
            client = server.client_now
            head.setdefault("calibration_waits_ms", {})[label] = client.get("/health").get("calibration_waits_ms")
            if settle:
                head.setdefault("calibrated_after_s", {})[label] = calibration_ended(client)
        return rows
    finally:
        server.close()
