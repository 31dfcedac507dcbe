"""Mixes: several requests sent at once, as apps send them, replayed on a
server with their concurrency (`edgespec bench-mix`, docs/sessions.md).

A mix is data (benchmarks/mixes/*.json), one JSON object:

    {"mix": "edgespec-mix", "description": "...", "source": [...where its code came from, with licenses...],
     "requests": [
       {"id": "edit", "kind": "long", "messages": [...], "max_tokens": 384, "temperature": 0, "at_s": 0},
       {"id": "title", "kind": "title", "messages": [...], "max_tokens": 32, "temperature": 0,
        "after_first_token_of": "edit", "delay_s": 1.0}]}

A request has an `id` (unique), a `kind` (what it is to the app: a request
of kind "long" is the long answer, every other a side request), its chat
`messages` (sent to /v1/chat/completions) or a `prompt` (/v1/completions),
`max_tokens`, `temperature` (0 if given: the replay is greedy) and when it
starts: `at_s` seconds after the run's start, or `delay_s` seconds after
the first token of the request `after_first_token_of` names (an earlier
one in the list, so the starts cannot wait on each other in a ring).  A
request whose trigger ends without a token starts `delay_s` after that one
ended.

The replay starts every request at its time in a thread of its own; each
streams (server-sent events) and its row records when it was sent, its
time to first token, when it was done (seconds after the run's start), its
tokens (the server's timings.predicted_n, else usage.completion_tokens,
else the events that carried text: `tokens_from` says which), its text and
finish_reason.  With `alone`, every request is then sent once more by
itself on the same server, and its row says whether that answer's text is
the same as the one given beside the others (`alone_same`).
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field

from edgespec.bench.sessions import PATHS, Client
from edgespec.errors import BenchError

BENCH = "mix"
MIX_MARK = "edgespec-mix"
LONG = "long"
REQUEST_KEYS = {"id", "kind", "messages", "prompt", "max_tokens", "temperature", "at_s", "after_first_token_of",
                "delay_s"}


@dataclass(frozen=True)
class MixRequest:
    id: str
    kind: str
    path: str               # /v1/chat/completions (messages) or /v1/completions (prompt)
    body: dict              # messages or prompt, max_tokens, temperature: what is sent besides model and stream
    at_s: float | None      # seconds after the run's start, or None: after a trigger
    after: str | None = None
    delay_s: float = 0.0


@dataclass
class Mix:
    name: str
    header: dict            # the file's other fields (description, source)
    requests: list[MixRequest] = field(default_factory=list)


def _number(where: str, r: dict, key: str) -> float:
    v = r[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise BenchError(f"{where}: `{key}` must be a number of seconds >= 0, not {v!r}")
    return float(v)


def _body(where: str, r: dict) -> tuple[str, dict]:
    if ("messages" in r) == ("prompt" in r):
        raise BenchError(f"{where}: give `messages` (a chat request) or `prompt` (a completion), one of them")
    if "messages" in r:
        msgs = r["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise BenchError(f"{where}: `messages` must be a non-empty list of {{role, content}} strings")
        path, body = PATHS[0], {"messages": msgs}
    else:
        if not isinstance(r["prompt"], str) or not r["prompt"]:
            raise BenchError(f"{where}: `prompt` must be a non-empty string")
        path, body = PATHS[1], {"prompt": r["prompt"]}
    n = r.get("max_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BenchError(f"{where}: `max_tokens` must be a positive integer, not {n!r}")
    if r.get("temperature", 0) != 0 or isinstance(r.get("temperature"), bool):
        raise BenchError(f"{where}: `temperature` must be 0 (the replay is greedy), not {r['temperature']!r}")
    return path, dict(body, max_tokens=n, temperature=0.0)


def _request(where: str, r, earlier: set) -> MixRequest:
    """One entry of `requests`, checked (earlier: the ids before it)."""
    if not isinstance(r, dict):
        raise BenchError(f"{where}: a request is a JSON object")
    unknown = sorted(set(r) - REQUEST_KEYS)
    if unknown:
        raise BenchError(f"{where}: unknown field `{unknown[0]}` (a request has {', '.join(sorted(REQUEST_KEYS))})")
    for key in ("id", "kind"):
        if not isinstance(r.get(key), str) or not r[key]:
            raise BenchError(f"{where}: `{key}` must be a non-empty string")
    if r["id"] in earlier:
        raise BenchError(f"{where}: `id` {r['id']!r} is taken by an earlier request")
    path, body = _body(where, r)
    if ("at_s" in r) == ("after_first_token_of" in r):
        raise BenchError(f"{where}: say when it starts: `at_s`, or `after_first_token_of` (with `delay_s`)")
    if "at_s" in r:
        if "delay_s" in r:
            raise BenchError(f"{where}: `delay_s` goes with `after_first_token_of`, not with `at_s`")
        return MixRequest(r["id"], r["kind"], path, body, _number(where, r, "at_s"))
    after = r["after_first_token_of"]
    if after not in earlier:
        raise BenchError(f"{where}: `after_first_token_of` {after!r} names no earlier request")
    delay = _number(where, r, "delay_s") if "delay_s" in r else 0.0
    return MixRequest(r["id"], r["kind"], path, body, None, after, delay)


def parse_mix(name: str, data) -> Mix:
    """A mix from its JSON value; BenchError naming the request and field."""
    if not isinstance(data, dict) or data.get("mix") != MIX_MARK:
        raise BenchError(f"{name}: a mix is a JSON object with \"mix\": \"{MIX_MARK}\"")
    reqs = data.get("requests")
    if not isinstance(reqs, list) or not reqs:
        raise BenchError(f"{name}: `requests` must be a non-empty list")
    out: list[MixRequest] = []
    for i, r in enumerate(reqs):
        rid = r.get("id") if isinstance(r, dict) else None
        out.append(_request(f"{name}: request {i}" + (f" ({rid})" if isinstance(rid, str) else ""), r,
                            {x.id for x in out}))
    return Mix(name, {k: v for k, v in data.items() if k != "requests"}, out)


def load_mix(path: str) -> Mix:
    """A mix file (the module doc); BenchError when it cannot be read or is wrong."""
    name = os.path.basename(path).removesuffix(".json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise BenchError(f"cannot read the mix {path}: {e.strerror}") from None
    except ValueError as e:
        raise BenchError(f"{path}: not JSON ({e})") from None
    return parse_mix(name, data)


def start_at(req: MixRequest, t0: float, first_token: dict) -> float:
    """The clock time `req` is sent at: t0 + at_s, or delay_s after its
    trigger's first token (first_token: id -> clock time)."""
    if req.at_s is not None:
        return t0 + req.at_s
    return first_token[req.after] + req.delay_s


def request_body(req: MixRequest, model_id: str) -> dict:
    return dict(req.body, model=model_id, stream=True)


def tokens_of(got: dict) -> tuple[int, str]:
    """An answer's generated tokens and where the count came from (the module doc)."""
    n = (got.get("timings") or {}).get("predicted_n")
    if isinstance(n, int):
        return n, "timings"
    n = (got.get("usage") or {}).get("completion_tokens")
    if isinstance(n, int):
        return n, "usage"
    return int(got.get("chunks") or 0), "chunks"


class _Run:
    """One replay of a mix: the first-token times its threads share, under a lock."""

    def __init__(self, mix: Mix, client: Client, model_id: str, clock):
        self.mix, self.client, self.model_id, self.clock = mix, client, model_id, clock
        self.lock = threading.Lock()
        self.first: dict[str, float] = {}
        self.fired = {r.id: threading.Event() for r in mix.requests}
        self.got: dict[str, dict] = {}
        self.t0 = 0.0

    def _first_token(self, rid: str) -> None:
        with self.lock:
            self.first.setdefault(rid, self.clock())
        self.fired[rid].set()

    def one(self, req: MixRequest) -> None:
        if req.after is not None:
            self.fired[req.after].wait()
        with self.lock:
            at = start_at(req, self.t0, self.first)
        time.sleep(max(0.0, at - self.clock()))
        sent = self.clock()
        try:
            got = self.client.send(req.path, request_body(req, self.model_id),
                                   on_first_token=lambda: self._first_token(req.id))
        except Exception as e:      # noqa: BLE001 - a thread's failure is its row's, not a lost thread
            got = {"status": 0, "error": f"{type(e).__name__}: {e}", "wall_ms": 0.0}
        done = self.clock()
        self._first_token(req.id)       # no token came: its dependents start after it ended
        with self.lock:
            self.got[req.id] = dict(got, sent=sent, done=done)

    def run(self) -> dict:
        threads = [threading.Thread(target=self.one, args=(r,), name=f"mix-{r.id}", daemon=True)
                   for r in self.mix.requests]
        self.t0 = self.clock()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.got


def request_row(target: str, mix: Mix, req: MixRequest, got: dict, t0: float) -> dict:
    """The results row of one request of a replayed mix (times in seconds)."""
    tokens, source = tokens_of(got)
    t = got.get("timings") or {}
    row = {"kind": "request", "bench": BENCH, "target": target, "mix": mix.name, "id": req.id, "role": req.kind,
           "path": req.path, "after": req.after, "status": got["status"], "sent_s": round(got["sent"] - t0, 4),
           "ttft_s": None if got.get("ttft_ms") is None else round(got["ttft_ms"] / 1e3, 4),
           "done_s": round(got["done"] - t0, 4), "wall_s": round(got["done"] - got["sent"], 4),
           "tokens": tokens, "tokens_from": source, "text": got.get("text", ""),
           "finish_reason": got.get("finish_reason"), "prompt_n": t.get("prompt_n"), "cache_n": t.get("cache_n")}
    if got.get("error"):
        row["error"] = got["error"]
    return row


def replay_mix(client: Client, target: str, mix: Mix, model_id: str | None = None, clock=time.perf_counter) -> list[dict]:
    """Every request of the mix at its time (the module doc): a row each, in the mix's order."""
    run = _Run(mix, client, model_id or client.model_id(), clock)
    got = run.run()
    return [request_row(target, mix, r, got[r.id], run.t0) for r in mix.requests]


def replay_alone(client: Client, mix: Mix, rows: list[dict], model_id: str | None = None) -> None:
    """Each request once more, by itself, one after another: its row gets
    alone_same (the same text as beside the others; None where either
    answer failed), alone_wall_s, and alone_text where the texts differ."""
    model_id = model_id or client.model_id()
    for req, row in zip(mix.requests, rows):
        got = client.send(req.path, request_body(req, model_id))
        ok = got["status"] == 200 and row["status"] == 200
        row["alone_same"] = (got.get("text") == row["text"]) if ok else None
        row["alone_wall_s"] = round(got["wall_ms"] / 1e3, 4)
        if ok and not row["alone_same"]:
            row["alone_text"] = got.get("text", "")


# ------------------------------------------------------------------ targets
@dataclass(frozen=True)
class MixSettings:
    """What every target of a run shares."""
    n_ctx: int = 4096                   # each request's context (llama-server gets parallel * n_ctx: its -np splits -c)
    threads: int | None = None
    parallel: int = 4                   # requests served at once: llama-server's -np, edgespec serve's --parallel
    alone: bool = False
    command: str = ""                   # the command line, for the header


def mix_header(mix: Mix, model_path: str, s: MixSettings) -> dict:
    """The first line of a results file: the command, machine, model, date, settings."""
    import datetime
    import platform

    from edgespec.calibration.cache import cpu_name
    from edgespec.version import __version__

    return {"kind": "header", "bench": BENCH, "command": s.command, "edgespec_version": __version__,
            "model": model_path, "mix": mix.name, "mix_header": mix.header, "n_requests": len(mix.requests),
            "n_ctx": s.n_ctx, "threads": s.threads, "parallel": s.parallel, "alone": s.alone, "decoding": "greedy",
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "hostname": platform.node(), "cpu": cpu_name(), "cpu_count": os.cpu_count(), "targets": {},
            "started_s": {}, "cache": {}}


def _write(out_path: str, head: dict, rows: list[dict]) -> None:
    with open(out_path, "w", encoding="utf-8") as f:
        for r in [head] + rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _one_target(t, mix: Mix, model_path: str, s: MixSettings, how: tuple) -> list[dict]:
    """A target started, warmed up (unless fresh: a new user's first request
    pays the cold start), the mix replayed (and alone), stopped; the header
    `head` gets its command line and start-up.  how: (head, binary, cache
    folder, progress, settle: wait for a fresh target's background
    calibration to end before stopping it)."""
    from edgespec.bench import session_targets as T

    head, binary, cache, progress, settle = how
    t_start = time.monotonic()
    with T.started(t, model_path, s.n_ctx, s.threads, binary, cache, parallel=s.parallel) as (client, args):
        head["targets"][t.name], head["started_s"][t.name] = args, round(time.monotonic() - t_start, 2)
        head["cache"][t.name] = t.cache or "as found"
        model_id = client.model_id()
        if t.cache != "fresh":
            T.warm_up(client, model_id)
        rows = replay_mix(client, t.name, mix, model_id)
        if s.alone:
            replay_alone(client, mix, rows, model_id)
        for r in rows if progress else ():
            progress(r)
        if settle:      # as bench-sessions: a later --same-cache target starts with its calibration
            head.setdefault("calibrated_after_s", {})[t.name] = T.calibration_ended(client)
    return rows


def run_mix(mix: Mix, targets: list, model_path: str, s: MixSettings, out_path: str, binary: str | None = None,
            progress=None) -> tuple[dict, list[dict]]:
    """Every target in turn (session_targets' Target: --fresh-cache and
    --same-cache as bench-sessions has them), the mix replayed on each; the
    results file rewritten after each target (header first)."""
    import contextlib
    import tempfile

    from edgespec.bench import session_targets as T

    head, rows = mix_header(mix, model_path, s), []
    with contextlib.ExitStack() as stack:
        fresh_dir = None
        for i, t in enumerate(targets):
            if t.cache == "fresh":
                fresh_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="edgespec-new-user-"))
            rows += _one_target(t, mix, model_path, s, (head, binary, fresh_dir if t.cache else None, progress,
                                                        T.settles(targets, i)))
            _write(out_path, head, rows)
    return head, rows
