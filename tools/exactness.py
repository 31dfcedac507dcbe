#!/usr/bin/env python3
"""Are batched logits bit-identical to one-token logits?  A table per model and K cache.

    python tools/exactness.py smollm2 gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
    python tools/exactness.py model.gguf --cache-type-k q8_0,f16 --contexts 100,600 --max-t 48

For each model (a path, or a name from edgespec get-models) and K cache type
it runs edgespec.calibration.exactness.check_exactness (the check SpecModel runs at
calibration): max-t tokens decoded one at a time after each context, then as
one batch of every size 2..max-t, logits compared bit for bit.  It prints one
line per (model, cache, context): the batch sizes that differed, the largest
|logit difference| and how many rows changed their argmax.  --json writes the
reports as JSON lines.  Not a timing: safe on a busy machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from edgespec.backend.llama import EXACT_MAX_BATCH, LlamaBackend  # noqa: E402
from edgespec.calibration.exactness import batch_ranges, check_exactness  # noqa: E402
from edgespec.models.zoo import MODELS, require_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--cache-type-k", default="q8_0,f16")
    ap.add_argument("--contexts", default="100,600")
    ap.add_argument("--max-t", type=int, default=EXACT_MAX_BATCH)
    ap.add_argument("--ts", default=None, help="only these batch sizes, e.g. 2,3,4,8,16,32,48 (default: 2..max-t)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-repack", action="store_true", help="load with llama.cpp's weight repacking on")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the reports here (JSON lines)")
    a = ap.parse_args(argv)
    ctxs = [int(c) for c in a.contexts.split(",")]
    ts = [int(t) for t in a.ts.split(",")] if a.ts else None
    out = open(a.json_out, "a") if a.json_out else None
    print(f"{'model':<22} {'K cache':<7} {'cells':>5}  {'exact':<5} {'max |dlogit|':>12} {'argmax flips':>12}  batch sizes that differ")
    for name in a.models:
        path = require_model(name) if name in MODELS else name
        for k in a.cache_type_k.split(","):
            be = LlamaBackend(path, n_ctx=max(ctxs) + a.max_t + 64, max_nodes=a.max_t, n_threads=a.threads,
                              cache_type_k=k, cpu_repack=a.cpu_repack)
            try:
                for c in ctxs:
                    r = check_exactness(be, a.max_t, contexts=(c,), ts=ts)
                    print(f"{name:<22} {k:<7} {r.contexts[0]:>5}  {str(r.exact):<5} {r.max_abs_diff:>12.4g} "
                          f"{r.argmax_flips:>12}  {batch_ranges(r.failed) or '-'}", flush=True)
                    if out:
                        out.write(json.dumps({"model": name, "cache_type_k": k, "cpu_repack": a.cpu_repack,
                                              **r.to_json()}) + "\n")
            finally:
                be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
