#!/usr/bin/env python3
"""What a background calibration adds to a request's latency (issue 56).

    python tools/pending_latency.py qwen2.5-coder-0.5b --requests 30 --out pending.json

A new user's first session: the model loads on an empty cache folder (a
temporary one: nothing timed, nothing calibrated), so it measures a quick
c(T) at load and the full calibration between requests.  Then a chat of
--requests turns, each a short question appended to the conversation so far
(as an app resends its history), with a pause of --gap-ms between turns so
that the calibration takes slices; every turn is streamed and its time to
first token taken.  Once the calibration has finished (it is waited for, with
no requests), the same conversation is sent again on the same model: those
times to first token are the baseline.  Printed and written (JSON): the load
time, the quick curve's time, the pacer's waits (how long each request waited
for a slice: the interruption), and time to first token pending against
after, each as p50 and p95; the added latency is their difference per turn.
Run it on an idle machine: these are timings.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QUESTIONS = ["Name a fruit.", "Why is the sky blue? One sentence.", "Rename x to total in: def f(x): return x * 2",
             "Write a haiku about rivers.", "What is 17 times 3?", "List three prime numbers.",
             "Fix the typo: 'teh cat sat'.", "Give a synonym for quick."]


def pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else None


def turns(model, n: int, gap_s: float, max_tokens: int, rng) -> list[float]:
    """Time to first token of each of n chat turns (seconds)."""
    messages, ttft = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}], []
    for i in range(n):
        time.sleep(gap_s * rng.uniform(0.5, 1.5))
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        t0, first = time.perf_counter(), []

        def on_text(piece):
            if not first and piece:
                first.append(time.perf_counter() - t0)
        r = model.chat(messages, max_tokens=max_tokens, on_text=on_text)
        ttft.append(first[0] if first else time.perf_counter() - t0)
        messages.append({"role": "assistant", "content": r.text})
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--gap-ms", type=float, default=300.0, help="mean pause between turns (0.5x-1.5x)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgespec-new-user-") as cache:
        os.environ["EDGESPEC_CACHE_DIR"] = cache
        from edgespec import SpecModel
        from edgespec.models.resolve import resolve_model

        path = resolve_model(a.model)
        quick = []
        t0 = time.perf_counter()
        m = SpecModel(path, n_ctx=a.ctx, n_threads=a.threads, progress=lambda d, t: quick.append(time.perf_counter()))
        load_s = time.perf_counter() - t0
        try:
            assert m.calibration_state == "measuring", m.calibration_state
            quick_s = (quick[-1] - t0) if quick else 0.0
            pending = turns(m, a.requests, a.gap_ms / 1000, a.max_tokens, random.Random(0))
            waits, interrupts = list(m._pacer.waits), m._pacer.interrupts
            t1 = time.perf_counter()
            finished = m.wait_for_calibration(1800)
            calib_s = time.perf_counter() - t1
            m.new_session()
            after = turns(m, a.requests, a.gap_ms / 1000, a.max_tokens, random.Random(0))
            out = {"model": path, "kernels": m.kernels, "cache_type_k": m.backend.cache_type_k,
                   "threads": m.backend.n_threads, "n_ctx": a.ctx, "requests": a.requests, "gap_ms": a.gap_ms,
                   "load_s": round(load_s, 2), "quick_curve_s": round(quick_s, 2),
                   "calibration_finished": finished, "calibration_rest_s": round(calib_s, 1),
                   "state": m.calibration_state, "interrupts": interrupts,
                   "wait_ms": {"n": len(waits), "p50": pct([w * 1e3 for w in waits], .5),
                               "p95": pct([w * 1e3 for w in waits], .95), "max": max(waits, default=0) * 1e3},
                   "ttft_pending_ms": {"p50": pct(pending, .5) * 1e3, "p95": pct(pending, .95) * 1e3},
                   "ttft_after_ms": {"p50": pct(after, .5) * 1e3, "p95": pct(after, .95) * 1e3},
                   "added_ms": {"p50": pct([x - y for x, y in zip(pending, after)], .5) * 1e3,
                                "p95": pct([x - y for x, y in zip(pending, after)], .95) * 1e3},
                   "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": os.getloadavg()}
        finally:
            m.close()
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
