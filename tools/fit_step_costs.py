"""Fit what a real step pays on a device beyond its decode's shape, and check the fit.

    python tools/fit_step_costs.py --shapes tests/data/h200/cost-smollm2 \
        --out tests/data/h200/cost-smollm2-fit2 benchmarks/results/h200-2026-11-27-hold-smollm2-*.jsonl.gz
    python tools/fit_step_costs.py --shapes tests/data/h200/cost-smollm2-fit2 \
        --check benchmarks/results/h200-2026-11-27-smollm2-*.jsonl.gz

RESULTS are `edgespec bench` results files timed on the device the shapes
(PREFIX-steady.json, PREFIX-alternating.json from tools/gpu/shapes.py) were
measured on.  With --out, the per-decode terms (edgespec.replay.steps:
plain_ms, draft_ms, held_ms, node_ms) are fitted by least squares over every
edgespec answer's device time (decode_call_s) and written with the shapes
to OUT-steady.json and OUT-alternating.json, which `edgespec replay --cost
OUT` then charges.  With --check, each method's timed total (decode_s: the
device time and the engine's) is printed beside the model's, from the
answers' own step counts and the shapes' terms (the engine time as
recorded): the step model alone, without the replay's drafting.  --json
prints the check as JSON lines.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from edgespec.bench.results import read_results
from edgespec.replay.steps import Shapes, StepTerms, edgespec_rows, fit_terms, load_terms, predict_s


def _rows(paths) -> list:
    out = []
    for p in paths:
        _, rows = read_results(p)
        out += [dict(r, file=os.path.basename(p)) for r in edgespec_rows(rows)]
    return out


def write(prefix: str, out: str, terms: StepTerms, info: dict, sources) -> None:
    """OUT-{steady,alternating}.json: the shapes of PREFIX, the terms in the steady file."""
    for kind in ("steady", "alternating"):
        with open(f"{prefix}-{kind}.json") as f:
            d = json.load(f)
        if kind == "steady":
            d["step"] = dict(terms.to_json(), fit=dict(info, sources=[os.path.basename(s) for s in sources]))
        with open(f"{out}-{kind}.json", "w") as f:
            json.dump(d, f)
            f.write("\n")


def check(rows, shapes: Shapes, terms: StepTerms) -> list[dict]:
    """Per results file and method: timed and modelled totals (seconds)."""
    acc: dict = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        a = acc[(r["file"], r["method"])]
        a[0] += 1
        a[1] += r["decode_s"]
        a[2] += predict_s(r, shapes, terms) + (r.get("engine_s") or 0.0)
    return [{"file": f, "method": m, "answers": n, "timed_s": round(t, 4), "modelled_s": round(p, 4),
             "error": round(p / t - 1, 4)} for (f, m), (n, t, p) in acc.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--shapes", required=True, help="PREFIX of PREFIX-steady.json and PREFIX-alternating.json")
    ap.add_argument("--out", help="fit the terms and write OUT-steady.json and OUT-alternating.json")
    ap.add_argument("--check", action="store_true", help="print timed against modelled totals per method")
    ap.add_argument("--json", action="store_true", help="the check as JSON lines")
    a = ap.parse_args(argv)
    shapes = Shapes.load(a.shapes)
    rows = _rows(a.results)
    if not rows:
        sys.exit("no timed edgespec answers in the results files")
    terms = load_terms(a.shapes) or StepTerms()
    if a.out:
        terms, info = fit_terms(rows, shapes)
        write(a.shapes, a.out, terms, info, a.results)
        print(f"fitted over {info['answers']} answers (rms {100 * info['rms']:.1f}% an answer): "
              f"{json.dumps(terms.to_json())} -> {a.out}-steady.json", file=sys.stderr)
    if a.check:
        for c in check(rows, shapes, terms):
            print(json.dumps(c) if a.json else
                  f"{c['file']:<44} {c['method']:<16} {c['answers']:>4} timed {c['timed_s']:8.3f} s  "
                  f"modelled {c['modelled_s']:8.3f} s  {100 * c['error']:+6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
