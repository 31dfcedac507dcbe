"""Replay recorded greedy outputs through drafters, without running the model.

    python tools/replay.py RESULTS.jsonl --prompts ../shared/data/spec_bench_dev.jsonl \
        --methods suffix,trigram,adjacency [--corpus FILE] [--category C] [--limit N]

RESULTS.jsonl is an `edgespec bench` results file: its `none` rows are the
model's greedy output for each prompt, its header the calibrated cost curve and
settings.  A method named ``oracle-NAME`` (e.g. ``oracle-suffix``) keeps from
each of NAME's proposals only the path the recorded output follows, at
probability 1 (edgespec.replay.OracleDrafter): the speed that perfect
acceptance estimates would get from NAME's candidates.  Each method runs
through the real Engine over
edgespec.replay.ReplayBackend, prompts in the file's order, so the acceptance
statistics evolve as in the bench.  Printed per category: tokens per step and a
modelled speedup over `none` (c(T) per decode plus the engine's per-step work);
where the results file has the same method, the bench's own figures stand beside.
"""
from __future__ import annotations

import argparse
import collections
import sys

import numpy as np

from edgespec.api import SpecModel
from edgespec.bench import load_prompts, read_results
from edgespec.costmodel import CostCurve
from edgespec.drafters import make_drafter, parse_drafter_name
from edgespec.engine import Engine, EngineConfig
from edgespec.replay import OracleDrafter, ReplayBackend, ReplayRequest, replay


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--methods", default="suffix")
    ap.add_argument("--model", default=None)
    ap.add_argument("--corpus", action="append", default=[])
    ap.add_argument("--category", action="append", default=[])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--flat", type=float, default=None, metavar="SLOPE",
                    help="model a GPU-like flat cost curve, c(T) = 1 + SLOPE x (T - 1) at every context, instead "
                         "of the calibrated one (the gate and the time model both use it): what these drafts "
                         "would give where a batch costs little more than one token (modelled, not measured)")
    ap.add_argument("--overhead-ms", type=float, default=None,
                    help="engine work per step for the time model (default: the bench's own figure per method, "
                         "else 0.15 ms)")
    a = ap.parse_args(argv)

    head, rows = read_results(a.results)
    rows = [r for r in rows if r.get("kind", "result") == "result"]
    if head is None or not head.get("cost_curve"):
        sys.exit("the results file has no header with a cost curve (run `edgespec bench` to make one)")
    cost = CostCurve.from_json(head["cost_curve"])
    if a.flat is not None:
        cost = flat_curve(cost, a.flat)
    none = {r["question_id"]: r for r in rows if r["method"] == "none"}
    if not none:
        sys.exit("the results file has no `none` rows: they are the recorded model output")
    prompts = [p for p in load_prompts(a.prompts, categories=a.category or None) if p.question_id in none]
    if a.limit:
        prompts = prompts[:a.limit]

    m = SpecModel(a.model or head.get("model"), drafter="none", n_ctx=int(head["n_ctx"]), calibrate=False,
                  max_nodes=int(head["max_nodes"]), corpora=a.corpus)
    vocab = m.vocab
    eog = int(np.nonzero(vocab.eog_mask())[0][0])
    reqs, qids = [], []
    for p in prompts:
        qids.append(p.question_id)
        rec = none[p.question_id]
        reqs.append(ReplayRequest(str(p.question_id), p.category,
                                  m.prompt_tokens(p.turn, raw=bool(head.get("raw"))),
                                  np.asarray(rec["tokens"], np.int32), rec.get("stop_reason") == "stop",
                                  rec.get("topk")))
    max_tokens = int(head["max_tokens"])
    bench_rows = collections.defaultdict(dict)
    for r in rows:
        bench_rows[r["method"]][r["question_id"]] = r

    def overhead(method: str) -> float:
        if a.overhead_ms is not None:
            return a.overhead_ms / 1000
        rs = [r for r in bench_rows.get(method, {}).values() if r.get("n_steps")]
        if rs:
            return sum(r["engine_s"] for r in rs) / sum(r["n_steps"] for r in rs)
        return 0.15e-3

    methods = ["none"] + [x for x in a.methods.split(",") if x and x != "none"]
    results = {}
    for meth in methods:
        oracle = meth.startswith("oracle-")
        name, use_corpus, switches = parse_drafter_name(meth[len("oracle-"):] if oracle else meth)
        d = make_drafter(name, n_vocab=vocab.n_vocab, model_path=m.model_path,
                         corpora=m.corpora if use_corpus else (), **switches)
        be = ReplayBackend(vocab, m.backend.n_ctx, m.backend.max_nodes, cost, eog)
        if oracle:
            d = OracleDrafter(d, be)
        d.warmup()
        eng = Engine(be, d, cost, EngineConfig(max_nodes=int(head["max_nodes"])))
        out = replay(eng, be, reqs, max_tokens)
        oh = overhead(meth)
        for i, r in enumerate(out):
            # scale the c(T) model by this prompt's measured plain decode time, so
            # that `none` is exact and the others differ only by the c(T) shape
            rec, base = none[qids[i]], (results["none"][i] if meth != "none" else r)
            f = rec["decode_call_s"] / base["model_s"] if rec.get("decode_call_s") and base["model_s"] else 1.0
            r["time_s"] = r["model_s"] * f + r["n_steps"] * oh
        results[meth] = out
        print(f"replayed {meth}: {len(out)} prompts", file=sys.stderr)
    m.close()

    cats = sorted({r.category for r in reqs}) + ["all"]
    print(f"{'category':<15} {'method':<18} {'acc/step':>8} {'bench':>6} {'speedup*':>8} {'bench':>6}")
    for c in cats:
        for meth in methods[1:]:
            sel = [i for i, r in enumerate(reqs) if c == "all" or r.category == c]
            rr = [results[meth][i] for i in sel]
            rn = [results["none"][i] for i in sel]
            gen = sum(r["n_generated"] for r in rr)
            acc = (sum(r["n_steps"] + r["n_draft_accepted"] for r in rr) / max(1, sum(r["n_steps"] for r in rr)))
            sp = sum(r["time_s"] for r in rn) / max(1e-12, sum(r["time_s"] for r in rr))
            b = [bench_rows.get(meth, {}).get(qids[i]) for i in sel]
            bacc = bsp = ""
            if all(b):
                bacc = f"{sum(x['n_steps'] + x['n_draft_accepted'] for x in b) / sum(x['n_steps'] for x in b):.2f}"
                bn = [bench_rows['none'][x['question_id']] for x in b]
                bsp = f"{sum(x['decode_s'] for x in bn) / sum(x['decode_s'] for x in b):.2f}"
            print(f"{c:<15} {meth:<18} {acc:>8.2f} {bacc:>6} {sp:>8.2f} {bsp:>6}   ({gen} tokens)")
    print("\n* modelled: c(T) per decode from " + (f"a flat curve, c(T) = 1 + {a.flat:g} (T - 1)"
          if a.flat is not None else "the results file's calibration") + " + the engine's work per step")
    return 0


def flat_curve(cost: CostCurve, slope: float) -> CostCurve:
    """`cost` with every context's c(T) replaced by 1 + slope (T - 1) and no
    after-batch cost (one-token times kept)."""
    rel = [1.0 + slope * (t - 1) for t in cost.ts]
    return CostCurve(list(cost.ts), rel, cost.t1_s, dict(cost.meta, flat=slope), cost.t1_short_s,
                     [dict(d, rel=list(rel), after_s=0.0) for d in cost.longer],
                     list(rel) if cost.short_rel else [], 0.0, 0.0)


if __name__ == "__main__":
    sys.exit(main())
