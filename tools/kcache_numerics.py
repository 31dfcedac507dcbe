"""How much the K cache type and llama.cpp's thread count move the model's numbers.

    python tools/kcache_numerics.py [--prompts FILE.jsonl] [--texts 4] [--positions 150]

Teacher-forced: the first turns of long prompts (summarization, rag, qa,
translation) are tokenized as plain text; after `start` cells of each text
(60: the short regime; 1000: past the split-KV threshold) the next `positions`
tokens of the same text are decoded one at a time, with three caches/threads:

  f16-1t   f16 K cache, one-token decodes on one thread (edgespec with
           --cache-type-k f16; llama-cpp-python's default on a 2-core machine)
  f16-2t   f16 K cache on every thread (llama.cpp's own default; past 512 cells
           it takes the split-KV path, which batches cannot reproduce)
  q8-2t    q8_0 K cache on every thread (edgespec's CPU default)

Reported against f16-1t: mean and largest |logit difference|, how often the
top token agrees, and each configuration's mean negative log-likelihood of the
forced text (nats/token), a quality check.  Batches play no part here: this
is about the numbers of plain decoding, which every edgespec drafter then
reproduces exactly.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from edgespec.backend.llama import LlamaBackend
from edgespec.models.resolve import resolve_model

DEV = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "spec_bench_dev.jsonl")
CONFIGS = {"f16-1t": ("f16", 1), "f16-2t": ("f16", None), "q8-2t": ("q8_0", None)}


def forced_logits(be: LlamaBackend, toks: np.ndarray, start: int, n: int, threads: int) -> np.ndarray:
    be.reset()
    be.prefill(toks[:start], want_last_logits=False)
    be.set_single_threads(threads)
    out = []
    for t in toks[start:start + n]:
        be.decode_tree(np.array([t], np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32),
                       np.ones(1, np.int32), 1)
        out.append(be.logits()[0].astype(np.float64))
        be.keep(1)
    return np.array(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default=DEV)
    ap.add_argument("--texts", type=int, default=4, help="texts per context length")
    ap.add_argument("--positions", type=int, default=150, help="forced tokens per text")
    a = ap.parse_args()
    path = resolve_model(a.model)
    # exact=False: the threads are set here, not by the backend's exactness rule
    bes = {k: LlamaBackend(path, n_ctx=4096, exact=False, max_nodes=8, cache_type_k=v[0]) for k, v in CONFIGS.items()}
    rows = [json.loads(x) for x in open(a.prompts) if x.strip()]
    texts = [r["turns"][0] for r in rows if r.get("category") in ("summarization", "rag", "qa", "translation")]
    for start in (60, 1000):
        diffs = {k: [] for k in CONFIGS if k != "f16-1t"}
        nll = {k: [] for k in CONFIGS}
        used = 0
        for text in texts:
            toks = np.asarray(bes["f16-1t"].vocab.tokenize(text), np.int32)
            if len(toks) < start + a.positions + 1:
                continue
            out = {k: forced_logits(be, toks, start, a.positions, CONFIGS[k][1] or be.n_threads)
                   for k, be in bes.items()}
            nxt = toks[start + 1:start + a.positions + 1]
            for k, lg in out.items():
                mx = lg.max(1, keepdims=True)
                lse = np.log(np.exp(lg - mx).sum(1)) + mx[:, 0]
                nll[k].append(float(np.mean(lse - lg[np.arange(len(nxt)), nxt])))
            ref = out["f16-1t"]
            for k in diffs:
                d = np.abs(out[k] - ref)
                diffs[k].append((d.mean(), d.max(), (out[k].argmax(1) == ref.argmax(1)).mean()))
            used += 1
            if used == a.texts:
                break
        print(f"after {start} cells, {used} texts x {a.positions} forced tokens:")
        for k, v in diffs.items():
            v = np.array(v)
            print(f"  {k} vs f16-1t: mean |dlogit| {v[:, 0].mean():.3f}, max {v[:, 1].max():.2f}, "
                  f"top-1 agreement {v[:, 2].mean():.3f}")
        for k, v in nll.items():
            print(f"  {k} NLL of the text: {np.mean(v):.4f} nats/token")
    for be in bes.values():
        be.close()


if __name__ == "__main__":
    main()
