"""What reading llama.cpp's hidden states costs (AdaPLD's rerank, `auto+rerank`).

    python tools/hidden_cost.py [MODEL] [--reps 30] [--ctx 2048] [--prefix 500]

With hidden states on (LlamaBackend.set_hidden(True): llama_set_embeddings),
llama.cpp copies every output row's final hidden state out of the graph as well
as its logits, and the engine copies the committed rows for the drafter.  This
times, interleaved on and off after the same `--prefix` KV cells, median of
`--reps`:

  step T     one verification batch of T tokens (T = 1, 4, 16, 32) plus the
             copy of its rows' hidden states, against the same batch without
  prefill    a 512-token prompt chunk with every row an output (as `branch`,
             `semantic` and `aasd` already ask for the rankings) with and
             without the hidden states copied

Run it on an otherwise idle machine; the figures go to BENCHMARKS.md ("the
papers' mechanisms").
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from edgespec.backend.llama import LlamaBackend
from edgespec.models.resolve import resolve_model


def _step(be, toks, hidden: bool) -> float:
    n = len(toks)
    t0 = time.perf_counter()
    be.decode_tree(toks, np.arange(n, dtype=np.int32), np.zeros(n, np.int32), np.ones(n, np.int32), 1)
    be.logits()
    if hidden:
        be.hidden()[:n].copy()
    dt = time.perf_counter() - t0
    be.keep(0)
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--prefix", type=int, default=500)
    a = ap.parse_args(argv)
    be = LlamaBackend(resolve_model(a.model), n_ctx=a.ctx, max_nodes=48)
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 5000, size=a.prefix).astype(np.int32)
    be.prefill(prefix)
    print(f"model {be.model_path}, {be.n_threads} threads, K cache {be.cache_type_k}, n_embd {be.n_embd}")
    for T in (1, 4, 16, 32):
        toks = rng.integers(100, 5000, size=T).astype(np.int32)
        on, off = [], []
        for _ in range(a.reps):
            for h in (False, True):
                be.set_hidden(h)
                (on if h else off).append(_step(be, toks, h))
        m_on, m_off = statistics.median(on) * 1e3, statistics.median(off) * 1e3
        print(f"step T={T:>2}: {m_off:7.3f} ms without, {m_on:7.3f} ms with hidden states "
              f"({m_on - m_off:+.3f} ms, {100 * (m_on / m_off - 1):+.1f}%)")
    chunk = rng.integers(100, 5000, size=512).astype(np.int32)
    ids, vals = np.zeros((512, 8), np.int32), np.zeros((512, 8), np.float32)
    hid = np.zeros((512, be.n_embd), np.float32)
    on, off = [], []
    for _ in range(max(3, a.reps // 10)):
        for h in (False, True):
            be.set_hidden(h)
            be.truncate(a.prefix)
            t0 = time.perf_counter()
            be.prefill(chunk, topk_out=(ids, vals), hidden_out=hid if h else None)
            (on if h else off).append(time.perf_counter() - t0)
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"prefill 512 rows with rankings: {m_off:.3f} s without, {m_on:.3f} s with hidden states "
          f"({100 * (m_on / m_off - 1):+.1f}%)")
    be.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
