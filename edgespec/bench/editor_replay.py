"""An editor trace (edgespec.bench.editor) replayed against a server's
`POST /infill`, and its report.

The requests go one after another, each answered in full before the next
is sent (llama.vim has one request in flight; here none is replaced by the
next keystroke's, so every request's whole latency is measured).  Each body
goes as the trace has it, but greedy: `temperature` 0 and `top_k` 1 (the
samplers stay llama.vim's; llama-server applies no temperature when
`samplers` does not name it, and top-k 1 leaves it the likeliest token), so
two servers' answers can be compared and a run repeated.

A request's row: the client's wall time (sending to the last byte), the
server's figures (`timings/prompt_n`: prompt tokens read; `timings/cache_n`
and `tokens_cached`: reused, and all the slot holds after the answer;
`timings/predicted_n`: generated; `prompt_ms`, `predicted_ms`), the
suggestion and whether its first line is right: the suggestion up to its
first newline equals what was typed next (both without trailing
whitespace; an empty suggestion is not right).  The summary over a trace's
"line" and "keystroke" requests: latency p50, p95 (numpy's linear
percentiles) and mean, the prefill share (the servers' prompt_ms over the
wall times, added up), prompt tokens read per request (at a new line, per
keystroke), reused, generated, and first lines right; the "ring" requests
(llama.vim's, in the background) are counted apart.
"""
from __future__ import annotations

import copy

import numpy as np

from edgespec.bench.sessions import Client, Session, read_rows

BENCH = "editor"         # the results' header and rows say so
FIM_PRESET = ("--cache-reuse", "256", "-b", "1024", "-ub", "1024")
"""llama-server's flags of the FIM presets llama.vim and llama.vscode recommend (added to its targets)."""
TIMINGS = ("prompt_n", "prompt_ms", "cache_n", "predicted_n", "predicted_ms")
WARM_UP = {"input_prefix": "", "input_suffix": "\n", "prompt": "x = ", "n_predict": 1, "temperature": 0.0,
           "top_k": 1, "cache_prompt": True}


def replay_body(body: dict) -> dict:
    """What the replay sends for a trace's body (the module's doc)."""
    b = copy.deepcopy(body)
    b["temperature"] = 0.0
    if b.get("n_predict") != 0:
        b["top_k"] = 1
    return b


def answer_fields(resp: dict) -> dict:
    """content, tokens_cached, truncated, stop_type and the timings of a
    native answer, filtered by response_fields ("timings/prompt_n" keys) or whole."""
    nested = resp.get("timings") if isinstance(resp.get("timings"), dict) else {}
    out = {k: resp.get(f"timings/{k}", nested.get(k)) for k in TIMINGS}
    out.update(text=resp.get("content", ""), tokens_cached=resp.get("tokens_cached"),
               truncated=resp.get("truncated"), stop_type=resp.get("stop_type"))
    return out


def first_line(text: str) -> str:
    return text.split("\n", 1)[0].rstrip()


def first_line_right(suggestion: str, typed: str) -> bool:
    want = typed.rstrip()
    return bool(want) and first_line(suggestion) == want


def request_row(target: str, trace: Session, index: int, got: dict) -> dict:
    """The results row of one replayed request (got: Client.post's answer)."""
    req = trace.requests[index]
    row = {"kind": "request", "bench": BENCH, "target": target, "session": trace.name, "index": index,
           "role": req["role"], "line": req.get("line"), "col": req.get("col"), "status": got["status"],
           "wall_ms": got["wall_ms"], "typed": req["typed"]}
    if got["status"] == 200 and isinstance(got.get("json"), dict):
        row.update(answer_fields(got["json"]))
        row["first_line_right"] = req["role"] != "ring" and first_line_right(row["text"], req["typed"])
    else:
        row.update({k: None for k in TIMINGS}, text="", first_line_right=False,
                   error=got.get("error") or "no JSON answer")
    return row


def _mean(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summary_row(target: str, trace: Session, rows: list[dict]) -> dict:
    """A trace's figures on one target (the module's doc) over its request rows."""
    asked = [r for r in rows if r["role"] != "ring"]
    ok = [r for r in asked if r["status"] == 200]
    wall = [r["wall_ms"] for r in ok]
    at = (lambda q: float(np.percentile(wall, q))) if wall else (lambda q: None)
    ring = [r for r in rows if r["role"] == "ring"]
    return {"kind": "summary", "bench": BENCH, "target": target, "session": trace.name,
            "n_requests": len(asked), "n_failed": len(asked) - len(ok), "p50_ms": at(50), "p95_ms": at(95),
            "mean_ms": _mean(wall), "wall_s": sum(wall) / 1e3,
            "prefill_share": sum(r["prompt_ms"] or 0 for r in ok) / sum(wall) if wall and sum(wall) else None,
            "prompt_n": _mean(r["prompt_n"] for r in ok),
            "prompt_n_line": _mean(r["prompt_n"] for r in ok if r["role"] == "line"),
            "prompt_n_keystroke": _mean(r["prompt_n"] for r in ok if r["role"] == "keystroke"),
            "cache_n": _mean(r["cache_n"] for r in ok), "predicted_n": _mean(r["predicted_n"] for r in ok),
            "first_lines_right": sum(bool(r["first_line_right"]) for r in ok),
            "n_ring": len(ring), "ring_ms": sum(r["wall_ms"] for r in ring)}


def replay(client_for, target: str, traces: list[Session], max_tokens: int = 0, progress=None) -> list[dict]:
    """Every trace's requests in order: request rows, then a summary row
    after each trace.  client_for(trace, index) is the Client a request goes
    to, or a Client; max_tokens is not used (n_predict is the trace's)."""
    if isinstance(client_for, Client):
        client_for = (lambda c: lambda s, i: c)(client_for)
    out = []
    for t in traces:
        rows = []
        for i, req in enumerate(t.requests):
            rows.append(request_row(target, t, i, client_for(t, i).post(req["path"], replay_body(req["body"]))))
            if progress:
                progress(rows[-1])
        out += rows + [summary_row(target, t, rows)]
    return out


def with_fim_preset(targets: list) -> list:
    """The targets, llama-server's started with FIM_PRESET before their own options."""
    import dataclasses
    return [dataclasses.replace(t, extra=FIM_PRESET + t.extra) if t.kind == "llama-server" else t for t in targets]


def warm_up(client: Client, model_id: str) -> None:
    """One short /infill before the traces, so no request pays a cold start."""
    client.post("/infill", WARM_UP)


# ------------------------------------------------------------------ report
COLS = ("target", "trace", "reqs", "p50 s", "p95 s", "mean s", "prefill share", "read/req (line, key)",
        "reused/req", "gen/req", "first lines right")


def _s(ms) -> str:
    return "-" if ms is None else f"{ms / 1e3:.2f}"


def _n(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def _cells(s: dict) -> tuple:
    fail = f" ({s['n_failed']} failed)" if s["n_failed"] else ""
    share = "-" if s["prefill_share"] is None else f"{s['prefill_share']:.0%}"
    name = s["target"] + (f" (round {s['round']})" if s.get("round") else "")
    return (name, s["session"], f"{s['n_requests']}{fail}", _s(s["p50_ms"]), _s(s["p95_ms"]),
            _s(s["mean_ms"]), share, f"{_n(s['prompt_n'])} ({_n(s['prompt_n_line'])}, {_n(s['prompt_n_keystroke'])})",
            _n(s["cache_n"]), _n(s["predicted_n"]), f"{s['first_lines_right']}/{s['n_requests']}")


def format_editor(rows: list[dict], head: dict | None = None) -> str:
    """The printed table: a row per target and trace (rows: a results file's)."""
    body = [_cells(s) for s in rows if s.get("kind") == "summary"]
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(COLS)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    out = []
    if head:
        out += [f"model: {head.get('model')}",
                f"machine: {head.get('cpu')} ({head.get('hostname')}), {head.get('threads') or 'default'} threads, "
                f"n_ctx {head.get('n_ctx')}, {head.get('date')}; greedy (temperature 0, top_k 1)"]
        out += [f"{name}: {' '.join(cmd) if cmd else 'a running server'}" for name, cmd in (head.get("targets") or {}).items()]
        out.append("")
    out += [fmt(COLS), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
    out.append("read/req: prompt tokens read per request (at a new line, per keystroke); reused: cache_n; "
               "ring requests (in the background) are not in the figures")
    return "\n".join(out)


def read_results(path: str) -> tuple[dict | None, list[dict]]:
    """A bench-editor results file: (its header or None, every row)."""
    return read_rows(path, lambda r: r.get("kind") == "summary" and r.get("bench") == BENCH,
                     "editor summary rows (not a bench-editor results file?)")
