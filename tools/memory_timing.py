"""Time the memory store's lookup (MemoryStore.propose: the match search and
the continuation tree) at a given number of stored tokens.

    python tools/memory_timing.py --tokens 1000000 [--budget N] [--cold]

The store is filled with entries of Zipf-distributed tokens (a 49k
vocabulary, as SmolLM2's) in which earlier passages recur, so the common
short windows have long hash chains and many lookups find long matches.
The contexts looked up end in a passage of the store (found) or in random
tokens (mostly not found).  --cold streams 128 MB through the caches before
each lookup, as a model's decode between two steps does.  Prints the median
and 99th percentile per lookup, and the time and memory of the fill.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from edgespec.drafters.tree import SOURCE_MEMORY
from edgespec.memory.store import MemoryStore


def fill(store: MemoryStore, n_tokens: int, rng) -> float:
    """Add entries until the store has seen n_tokens; returns the seconds taken."""
    t0 = time.perf_counter()
    seen = []
    total = 0
    while total < n_tokens:
        n = int(rng.integers(50, 400))
        e = np.minimum(rng.zipf(1.2, n), 49_151).astype(np.int32)
        if seen and rng.random() < 0.5:          # a passage of an earlier entry, copied in
            src = seen[int(rng.integers(len(seen)))]
            a = int(rng.integers(len(src)))
            piece = src[a:a + int(rng.integers(10, 80))]
            at = int(rng.integers(n))
            e = np.concatenate([e[:at], piece, e[at:]])
        store.add(e)
        seen.append(e)
        if len(seen) > 500:
            seen.pop(0)
        total += len(e)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    store = MemoryStore(args.budget) if args.budget else MemoryStore()
    store.warmup()
    fill_s = fill(store, args.tokens, rng)
    stats = store.stats()
    _, slots = store.snapshot()
    out = (np.zeros(64, np.int32), np.zeros(64, np.int32), np.zeros(64, np.float32), np.zeros(64, np.int8))
    ends, lens, mlen = np.zeros(8, np.int32), np.zeros(8, np.int32), np.zeros(64, np.int32)
    flush = np.ones(16 << 20, np.float64)
    times = {"found": [], "random": []}
    nodes = {"found": 0, "random": 0}
    for i in range(args.lookups):
        kind = "found" if i % 2 == 0 else "random"
        if kind == "found":
            e = int(rng.integers(40, len(slots) - 1))
            ctx = np.concatenate([rng.integers(0, 49_152, 200), slots[e - 30:e + 1]]).astype(np.int32)
            ctx = ctx[ctx >= 0]
        else:
            ctx = np.minimum(rng.zipf(1.2, 300), 49_151).astype(np.int32)
        if args.cold:
            flush += 1.0
        t0 = time.perf_counter()
        m = store.propose(ctx, len(ctx), 3, 32, 8, 32, 64, out, ends, lens, mlen, SOURCE_MEMORY)
        times[kind].append(time.perf_counter() - t0)
        nodes[kind] += m
    print(f"stored: {stats['tokens']:,} tokens in {stats['entries']:,} entries (budget {stats['budget']:,} slots), "
          f"{stats['bytes'] / 2**20:.1f} MiB allocated; filled in {fill_s:.2f}s ({stats['evicted']} evicted)")
    for kind, ts in times.items():
        us = np.array(ts) * 1e6
        print(f"{kind:>6} contexts{' (cold caches)' if args.cold else ''}: median {np.median(us):.1f} us, "
              f"p99 {np.percentile(us, 99):.1f} us, max {us.max():.1f} us; {nodes[kind] / len(ts):.1f} nodes a lookup")


if __name__ == "__main__":
    main()
