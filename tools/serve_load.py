"""Measure `edgespec serve` against the library and under concurrent clients.

    python tools/serve_load.py --prompts ../shared/data/spec_bench_dev.jsonl --limit 40 \
        --max-tokens 128 --clients 1,4,8 [--model M.gguf] [--drafter suffix] [--json out.json]

1. Library: SpecModel.generate over the prompts (greedy), one after another:
   decode tokens/s (tokens after the first / time after the first token).
2. Server, one client: the same prompts streamed through a fresh `edgespec
   serve` subprocess (same model and settings) over HTTP: decode tokens/s
   seen by the client (tokens after the first / time from the first to the
   last content event), time to first token (request sent -> first content
   event) and the overhead against the library; the server's own
   predicted_per_second beside it.
3. Concurrency: for each N in --clients, N client threads send the prompt
   list between them (each prompt once, streamed) as fast as answers come:
   requests/s, p50/p95 latency (request sent -> [DONE]), p50/p95 time to
   first token, and nothing lost (every request answered 200 with a
   finish_reason, its text identical to the one-client run).

Run it on an otherwise idle machine: it measures speed.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from serving import running_server  # noqa: E402

from edgespec.app.api import SpecModel  # noqa: E402
from edgespec.bench.prompts import load_prompts  # noqa: E402


def stream_request(base: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat request; client-side timings and the text."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=3600)
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True})
    t0 = time.perf_counter()
    out = {"status": None, "text": "", "t_first": None, "t_last": None, "finish_reason": None, "timings": None}
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        out["status"] = r.status
        if r.status != 200:
            r.read()
            return out
        while True:
            line = r.fp.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            ch = ev.get("choices") or [{}]
            piece = (ch[0].get("delta") or {}).get("content")
            if piece:
                now = time.perf_counter()
                out["t_first"] = out["t_first"] or now
                out["t_last"] = now
                out["text"] += piece
            if ch[0].get("finish_reason"):
                out["finish_reason"] = ch[0]["finish_reason"]
                out["timings"] = ev.get("timings")
        out["t_done"] = time.perf_counter()
    finally:
        conn.close()
    out["latency"] = out.get("t_done", time.perf_counter()) - t0
    out["ttft"] = (out["t_first"] - t0) if out["t_first"] else None
    return out


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def library_run(args, prompts) -> dict:
    m = SpecModel(args.model, drafter=args.drafter, n_ctx=args.ctx, n_threads=args.threads)
    try:
        m.generate("Say hello.", max_tokens=8)                       # warm-up
        toks, secs, texts = 0, 0.0, []
        for p in prompts:
            r = m.generate(p.turn, max_tokens=args.max_tokens)
            toks += max(r.n_generated - 1, 0)
            secs += r.decode_s
            texts.append(r.text)
    finally:
        m.close()
    return {"tokens_per_s": toks / secs if secs else 0.0, "texts": texts}


def server_args(args) -> list[str]:
    a = ["--ctx", str(args.ctx), "--drafter", args.drafter, "--queue", str(max(args.clients) + 1)]
    if args.threads:
        a += ["--threads", str(args.threads)]
    return a + ([args.model] if args.model else [])


def one_client(base, args, prompts) -> dict:
    stream_request(base, "Say hello.", 8)                           # warm-up
    rows = [stream_request(base, p.turn, args.max_tokens) for p in prompts]
    toks = sum(max(r["timings"]["predicted_n"] - 1, 0) for r in rows)
    span = sum(r["t_last"] - r["t_first"] for r in rows if r["t_first"])
    srv = sum(r["timings"]["predicted_ms"] for r in rows) / 1e3
    return {"client_tokens_per_s": toks / span if span else 0.0,
            "server_tokens_per_s": toks / srv if srv else 0.0,
            "ttft_p50_s": pct([r["ttft"] for r in rows if r["ttft"]], 50),
            "ttft_p95_s": pct([r["ttft"] for r in rows if r["ttft"]], 95),
            "texts": [r["text"] for r in rows]}


def concurrent(base, args, prompts, n: int, reference: list[str]) -> dict:
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    rows: list = []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, p = todo.pop(0)
            r = stream_request(base, p.turn, args.max_tokens)
            r["i"] = i
            with lock:
                rows.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in rows if r["status"] == 200 and r["finish_reason"]]
    same = sum(1 for r in ok if r["text"] == reference[r["i"]])
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"]]
    return {"clients": n, "requests": len(prompts), "answered": len(ok), "lost": len(prompts) - len(ok),
            "identical_to_one_client": same, "requests_per_s": len(ok) / wall, "wall_s": wall,
            "latency_p50_s": pct(lat, 50), "latency_p95_s": pct(lat, 95),
            "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--category", action="append", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default="suffix")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="Also write the figures here.")
    args = ap.parse_args()
    prompts = load_prompts(args.prompts, categories=args.category, limit=args.limit)
    print(f"{len(prompts)} prompts, max_tokens {args.max_tokens}, drafter {args.drafter}", file=sys.stderr)
    lib = library_run(args, prompts)
    print(f"library: {lib['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    with running_server(*server_args(args)) as (base, _):
        one = one_client(base, args, prompts)
        load = [concurrent(base, args, prompts, n, one["texts"]) for n in args.clients]
    same_lib = sum(a == b for a, b in zip(one["texts"], lib["texts"]))
    overhead = 1 - one["client_tokens_per_s"] / lib["tokens_per_s"] if lib["tokens_per_s"] else float("nan")
    print(f"\ndecode tok/s: library {lib['tokens_per_s']:.1f}, server seen by one client "
          f"{one['client_tokens_per_s']:.1f} (server's own {one['server_tokens_per_s']:.1f}); "
          f"overhead {overhead:+.1%}; texts identical to the library's {same_lib}/{len(prompts)}")
    print(f"time to first token, one client: p50 {one['ttft_p50_s'] * 1e3:.0f} ms, "
          f"p95 {one['ttft_p95_s'] * 1e3:.0f} ms")
    print("\n| clients | requests/s | latency p50 | latency p95 | TTFT p50 | TTFT p95 | answered | lost | "
          "identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in load:
        print(f"| {r['clients']} | {r['requests_per_s']:.2f} | {r['latency_p50_s']:.2f} s | "
              f"{r['latency_p95_s']:.2f} s | {r['ttft_p50_s']:.2f} s | {r['ttft_p95_s']:.2f} s | "
              f"{r['answered']}/{r['requests']} | {r['lost']} | {r['identical_to_one_client']}/{r['answered']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "library_tokens_per_s": lib["tokens_per_s"],
                       "server": {k: v for k, v in one.items() if k != "texts"}, "overhead": overhead,
                       "identical_to_library": same_lib, "load": load}, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
