#!/usr/bin/env python3
"""What llama.cpp's CPU kernel switches cost in tokens per second.

    python tools/kernel_cost.py qwen2.5-coder-0.5b
    python tools/kernel_cost.py MODEL --settings default,tiled,repack --prompt 512 --decode 128 --batch 16

edgespec turns two llama.cpp CPU features off because they make batched logits
differ from one-token logits (see README, "What lossless means"): the tiled
K-quant matrix product (GGML_CPU_TILED_MM) and weight repacking
(use_extra_bufts).  For each setting this runs, in a fresh process (the tiled
switch is read once per process, and a crash stays contained):

  prefill   one prompt of --prompt random tokens in 512-token chunks
  decode    --decode one-token decodes after it (tokens/s, median step)
  batch     --reps chains of --batch tokens after it (ms each)

Settings: default (both off, as edgespec runs), tiled (GGML_CPU_TILED_MM=1),
repack (use_extra_bufts on), both, noflash (flash attention off, f16 K cache,
tiled product off), and fast: edgespec's --kernels fast (tiled product on,
flash attention off, q8_0 K cache), not exact (batched logits differ from
one-token ones); fastf16: fast with llama.cpp's default f16 K cache, what plain
llama.cpp runs with the same threads, no repacking and no flash attention
(edgespec's fast kernels before 2026-11-28); fastfa: fastf16 with flash
attention at llama.cpp's auto (on), as llama-server runs by default.  Run it
on an idle machine: these are timings; --rounds N runs the settings N times
in turn (A B A B ...), so that a change in the machine's load spreads over
all of them.  Besides wall-clock rates, prefill_cpu_tok_s is prompt tokens
per second of the process's CPU time: with --threads 1 it barely moves when
other processes share the CPU.  --threads as in edgespec (default: one per
physical core).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name: (GGML_CPU_TILED_MM, repack, flash attention (None: llama.cpp's auto), K cache (None: edgespec's))
SETTINGS = {"default": ("0", False, None, None), "tiled": ("1", False, None, None),
            "repack": ("0", True, None, None), "both": ("1", True, None, None),
            "noflash": ("0", False, False, "f16"), "fast": ("1", False, False, None),
            "fastf16": ("1", False, False, "f16"), "fastfa": ("1", False, None, "f16")}


def measure(path: str, setting: str, threads, n_prompt: int, n_decode: int, batch: int, reps: int) -> dict:
    import numpy as np

    from edgespec.backend.llama import LlamaBackend
    from edgespec.backend.process import tiled_mm_setting

    _, repack, flash_attn, cache_type_k = SETTINGS[setting]
    # exact (edgespec's one-thread policy for f16 one-token decodes past 256
    # cells) only for the settings on edgespec's own K cache: an explicit f16
    # cache is timed as llama.cpp runs it, every decode on every thread
    be = LlamaBackend(path, n_ctx=n_prompt + n_decode + batch + 64, n_threads=threads, max_nodes=max(batch, 1),
                      cache_type_k=cache_type_k, cpu_repack=repack, flash_attn=flash_attn,
                      exact=flash_attn is None and cache_type_k is None)
    rng = np.random.default_rng(0)
    toks = rng.integers(100, min(be.n_vocab, 20000), size=n_prompt + n_decode + batch).astype(np.int32)
    zero, one = np.zeros(batch, np.int32), np.ones(batch, np.int32)
    t0, c0 = time.perf_counter(), time.process_time()
    be.prefill(toks[:n_prompt])
    prefill_s, prefill_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    steps = []
    for t in toks[n_prompt:n_prompt + n_decode]:
        t0 = time.perf_counter()
        be.decode_tree(np.array([t], np.int32), zero[:1], zero[:1], one[:1], 1)
        be.logits()
        be.keep(1)
        steps.append(time.perf_counter() - t0)
    chain = toks[n_prompt + n_decode:]
    batches = []
    for _ in range(reps):
        t0 = time.perf_counter()
        be.decode_tree(chain, np.arange(batch, dtype=np.int32), zero, one, 1)
        be.logits()
        be.keep(0)
        batches.append(time.perf_counter() - t0)
    be.close()
    return {"tiled_mm": tiled_mm_setting(), "repack": repack, "flash_attn": "auto" if flash_attn is None else flash_attn,
            "threads": be.n_threads,
            "cache_type_k": be.cache_type_k, "prefill_tok_s": n_prompt / prefill_s, "prefill_cpu_tok_s": n_prompt / prefill_cpu_s,
            "decode_tok_s": len(steps) / sum(steps), "decode_median_ms": 1000 * float(np.median(steps)),
            f"batch{batch}_median_ms": 1000 * float(np.median(batches))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--settings", default="default,tiled,repack")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=1, help="run the settings this many times, in turn")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    from edgespec.models.resolve import resolve_model
    path = resolve_model(a.model)
    if a.child:
        r = measure(path, a.child, a.threads, a.prompt, a.decode, a.batch, a.reps)
        print(json.dumps(r))
        return 0
    for name in a.settings.split(",") * a.rounds:
        tiled = SETTINGS[name][0]
        cmd = [sys.executable, os.path.abspath(__file__), path, "--child", name,
               "--prompt", str(a.prompt), "--decode", str(a.decode), "--batch", str(a.batch), "--reps", str(a.reps)]
        if a.threads:
            cmd += ["--threads", str(a.threads)]
        p = subprocess.run(cmd, env=dict(os.environ, GGML_CPU_TILED_MM=tiled), capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{name:<8} failed (exit code {p.returncode}): {(p.stderr.strip().splitlines() or [''])[-1]}")
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        cells = "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())
        print(f"{name:<8} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
