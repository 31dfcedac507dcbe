"""The report of `edgespec bench-sessions`: one table row per target and
session, then one per target over all sessions (docs/sessions.md's columns),
and how many answers each target shares with the first."""
from __future__ import annotations

from edgespec.bench.sessions import identical_counts

COLS = ("target", "session", "reqs", "wall s", "TTFT 1st ms", "TTFT next ms", "prefill ms", "cached/prompt tok",
        "decode tok/s", "identical")


def _ms(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def _cells(s: dict, ident: str) -> tuple:
    fail = f" ({s['n_failed']} failed)" if s.get("n_failed") else ""
    return (s["target"], s["session"], f"{s['n_requests']}{fail}", f"{s['wall_s']:.2f}", _ms(s["ttft_first_ms"]),
            _ms(s["ttft_followup_ms"]), _ms(s["prefill_ms"]),
            f"{s['cache_n']}/{s['prompt_tokens']} ({s['cached_share']:.0%})", f"{s['decode_tok_s']:.1f}", ident)


def _total(target: str, sessions: list[dict]) -> dict:
    num = lambda k: sum(float(s.get(k) or 0) for s in sessions)  # noqa: E731
    nexts = [s["ttft_followup_ms"] for s in sessions if s["ttft_followup_ms"] is not None]
    decode_s = sum(s["predicted_n"] / s["decode_tok_s"] for s in sessions if s["decode_tok_s"] > 0)
    return {"target": target, "session": "all", "n_requests": int(num("n_requests")), "n_failed": int(num("n_failed")),
            "wall_s": num("wall_s"), "ttft_first_ms": None,
            "ttft_followup_ms": sum(nexts) / len(nexts) if nexts else None, "prefill_ms": num("prefill_ms"),
            "cache_n": int(num("cache_n")), "prompt_tokens": int(num("prompt_tokens")),
            "cached_share": num("cache_n") / num("prompt_tokens") if num("prompt_tokens") else 0.0,
            "decode_tok_s": num("predicted_n") / decode_s if decode_s > 0 else 0.0}


def _session_ident(rows: list[dict], target: str, session: str, reference: str) -> str:
    if target == reference:
        return "-"
    got = identical_counts([r for r in rows if r.get("session") == session], reference).get(target)
    return f"{got[0]}/{got[1]}" if got else "-"


def format_sessions(rows: list[dict], head: dict | None = None) -> str:
    """The printed tables (rows: a results file's rows, header included or not)."""
    sessions = [r for r in rows if r.get("kind") == "session"]
    targets = list(dict.fromkeys(s["target"] for s in sessions))
    ref = targets[0] if targets else ""
    body = [_cells(s, _session_ident(rows, s["target"], s["session"], ref)) for s in sessions]
    totals = identical_counts(rows, ref)
    for t in targets:
        got = totals.get(t)
        body.append(_cells(_total(t, [s for s in sessions if s["target"] == t]),
                           f"{got[0]}/{got[1]}" if got else "-"))
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(COLS)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    out = _head_lines(head) if head else []
    out += [fmt(COLS), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
    if len(targets) > 1:
        out.append(f"identical: answers equal to {ref}'s, of the requests both answered")
    return "\n".join(out)


def _head_lines(head: dict) -> list[str]:
    out = [f"model: {head.get('model')}",
           f"machine: {head.get('cpu')} ({head.get('hostname')}), {head.get('threads') or 'default'} threads, "
           f"n_ctx {head.get('n_ctx')}, {head.get('date')}",
           f"greedy (temperature 0), max_tokens {head.get('max_tokens')} where a request has none; "
           f"{head.get('n_sessions')} sessions, {head.get('n_requests')} requests"]
    started, cache = head.get("started_s") or {}, head.get("cache") or {}
    if head.get("restart"):
        out.append(f"every server stopped and started again before each {head['restart']} (no warm-up)")
    for name, cmd in (head.get("targets") or {}).items():
        how = f" (started in {started[name]:.1f} s" + (f", cache folder {cache[name]}" if name in cache else "") + ")" \
            if name in started else ""
        out.append(f"{name}: {' '.join(cmd) if cmd else 'a running server'}{how}")
        starts = (head.get("restarts_s") or {}).get(name)
        if starts:
            out.append(f"  {name} started {len(starts)} times, {sum(starts) / len(starts):.1f} s on average")
        waits = (head.get("calibration_waits_ms") or {}).get(name)
        if waits:
            after = (head.get("calibrated_after_s") or {}).get(name)
            out.append(f"  {name} while calibrating in the background: {waits['n']} requests waited for a slice "
                       f"(p50 {waits['p50']} ms, p95 {waits['p95']} ms, max {waits['max']} ms); its calibration "
                       + (f"ended {after:.0f} s after its sessions" if after is not None else "had not ended"))
    return out + [""]
