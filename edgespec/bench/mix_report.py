"""The report of `edgespec bench-mix`: per target, the side requests' time
to first token (median, worst), how long each side request took after it
was sent (least, most), when the long answer and the last request were
done (seconds after the run's start), the tokens generated over the run
per second of it (from the first request sent to the last done), and how
many answers equal the same request sent alone; then a row per request.
Markdown tables (docs/sessions.md, "Several requests at once")."""
from __future__ import annotations

from statistics import median

from edgespec.bench.mix import BENCH, LONG
from edgespec.bench.sessions import read_rows

COLS = ("target", "reqs", "side TTFT median s", "side TTFT worst s", "side done s (after sent)", "long done s",
        "all done s", "tokens", "tok/s", "same alone")
REQUEST_COLS = ("target", "id", "kind", "sent s", "TTFT s", "done s", "tokens", "finish", "same alone")


def figures(rows: list[dict]) -> dict:
    """One target's figures over its request rows (the module doc); None
    where there is nothing to measure (no side request, no long one)."""
    side = [r for r in rows if r["role"] != LONG]
    ttft = [r["ttft_s"] for r in side if r["status"] == 200 and r.get("ttft_s") is not None]
    side_done = [r["wall_s"] for r in side if r["status"] == 200]
    long_done = [r["done_s"] for r in rows if r["role"] == LONG and r["status"] == 200]
    span = max(r["done_s"] for r in rows) - min(r["sent_s"] for r in rows) if rows else 0.0
    tokens = sum(int(r.get("tokens") or 0) for r in rows if r["status"] == 200)
    alone = [r["alone_same"] for r in rows if r.get("alone_same") is not None]
    return {"n": len(rows), "n_failed": sum(r["status"] != 200 for r in rows),
            "side_ttft_median_s": median(ttft) if ttft else None, "side_ttft_worst_s": max(ttft) if ttft else None,
            "side_done_min_s": min(side_done) if side_done else None,
            "side_done_max_s": max(side_done) if side_done else None,
            "long_done_s": max(long_done) if long_done else None,
            "all_done_s": max(r["done_s"] for r in rows) if rows else None,
            "tokens": tokens, "tokens_per_s": tokens / span if span > 0 else None,
            "alone_same": (sum(alone), len(alone)) if alone else None}


def _s(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _alone(same) -> str:
    return "-" if same is None else f"{same[0]}/{same[1]}"


def _cells(target: str, f: dict) -> tuple:
    fail = f" ({f['n_failed']} failed)" if f["n_failed"] else ""
    done = "-" if f["side_done_min_s"] is None else f"{f['side_done_min_s']:.1f}-{f['side_done_max_s']:.1f}"
    return (target, f"{f['n']}{fail}", _s(f["side_ttft_median_s"]), _s(f["side_ttft_worst_s"]), done,
            _s(f["long_done_s"], 1), _s(f["all_done_s"], 1), str(f["tokens"]), _s(f["tokens_per_s"], 1),
            _alone(f["alone_same"]))


def _request_cells(r: dict) -> tuple:
    same = r.get("alone_same")
    finish = r.get("finish_reason") or ("-" if r["status"] == 200 else f"HTTP {r['status']}")
    return (r["target"], r["id"], r["role"], _s(r["sent_s"]), _s(r.get("ttft_s")), _s(r["done_s"]),
            str(r.get("tokens")), finish, "-" if same is None else ("yes" if same else "no"))


def _table(cols: tuple, body: list[tuple]) -> list[str]:
    line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return [line(cols), line(["---"] * len(cols))] + [line(b) for b in body]


def _head_lines(head: dict) -> list[str]:
    mh = head.get("mix_header") or {}
    out = [f"command: {head.get('command') or '-'}", f"model: {head.get('model')}",
           f"machine: {head.get('cpu')} ({head.get('hostname')}), {head.get('threads') or 'default'} threads, "
           f"{head.get('date')}",
           f"mix: {head.get('mix')} ({head.get('n_requests')} requests{'; ' + mh['description'] if mh.get('description') else ''})",
           f"greedy; {head.get('parallel')} requests at once, n_ctx {head.get('n_ctx')} each"
           + ("; then each request alone" if head.get("alone") else "")]
    started = head.get("started_s") or {}
    for name, cmd in (head.get("targets") or {}).items():
        how = f" (started in {started[name]:.1f} s)" if name in started else ""
        out.append(f"{name}: {' '.join(cmd) if cmd else 'a running server'}{how}")
    return out + [""]


def format_mix(rows: list[dict], head: dict | None = None) -> str:
    """The printed tables (rows: a results file's, the header among them or not)."""
    reqs = [r for r in rows if r.get("kind") == "request" and r.get("bench") == BENCH]
    targets = list(dict.fromkeys(r["target"] for r in reqs))
    out = _head_lines(head) if head else []
    out += _table(COLS, [_cells(t, figures([r for r in reqs if r["target"] == t])) for t in targets])
    out += ["", "side: every request whose kind is not \"long\"; side done: seconds from sending it to its last "
                "token; long done, all done: seconds after the run's start; tok/s: the tokens of every answer over "
                "the run (first sent to last done); same alone: answers equal to the same request's sent alone", ""]
    out += _table(REQUEST_COLS, [_request_cells(r) for r in reqs])
    return "\n".join(out)


def read_results(path: str) -> tuple[dict | None, list[dict]]:
    """A bench-mix results file: (its header or None, every row)."""
    return read_rows(path, lambda r: r.get("kind") == "request" and r.get("bench") == BENCH,
                     "mix request rows (not a bench-mix results file?)")
