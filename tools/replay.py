"""Replay recorded greedy outputs through drafters, without running the model.

    python tools/replay.py RESULTS.jsonl --prompts ../shared/data/spec_bench_dev.jsonl \
        --methods suffix,trigram,adjacency [--corpus FILE] [--category C] [--limit N] \
        [--cost cpu,rtx3090,m2,FILE.json,PREFIX]

RESULTS.jsonl is an `edgespec bench` results file: its `none` rows are the
model's greedy output for each prompt, its header the calibrated cost curve and
settings.  A method named ``oracle-NAME`` (e.g. ``oracle-suffix``) keeps from
each of NAME's proposals only the path the recorded output follows, at
probability 1 (edgespec.replay.simulator.OracleDrafter): the speed that perfect
acceptance estimates would get from NAME's candidates.  Each method runs
through the real Engine over edgespec.replay.simulator.ReplayBackend, prompts in the
file's order, so the acceptance statistics evolve as in the bench.

--cost picks the cost curve(s) the engine's gate and the time model use, one
table each: ``cpu`` (default) = the results file's own calibration (this
machine), ``rtx3090`` = an RTX 3090 with Llama-8B Q4_0 (llama.cpp PR #15802:
c(2) = 1.12, c(4) = 1.33, c(8) = 2.15), ``m2`` = an Apple M2-class GPU with
Qwen2-7B Q8_0 (llama.cpp PR #10581: c(2) = 1.11, c(4) = 1.41, c(8) = 2.16), ``flat:SLOPE`` = c(T) = 1 + SLOPE (T - 1)
at every context (``--flat SLOPE`` is the same), a JSON file ({"ts": [...], "rel": [...]} or a saved calibration),
or PREFIX naming a GPU check's PREFIX-steady.json and PREFIX-alternating.json
(tools/gpu/: batch widths kept steady and alternating with one-token decodes,
and the one-token decode after a batch, as measured; the replay then charges
each decode by its shape, edgespec.replay.curves.shape_curve, and times
steps in that machine's seconds, the engine's work per step counted as the
--overhead-ms given; where PREFIX-steady.json holds a "step" key, the
device's extra per decode fitted by tools/fit_step_costs.py is charged on
top, edgespec.replay.steps).  Beyond the
published T = 8 the GPU curves are extrapolated linearly from c(4)..c(8)
(edgespec.replay.curves.gpu_curve); the engine's own work per step is counted as
measured on this machine, relative to this machine's plain step.

Drafters that read more of the model than its greedy tokens (the prefill's
rankings for branch drafting and AASD, the entropy for ReSpec's trigger, the
hidden states for AdaPLD's rerank) get them from one teacher-forced pass of the
real model over each prompt and its recorded answer (edgespec.replay.simulator.teacher_pass),
cached beside RESULTS (RESULTS.teacher.npz; hidden states, only when a method
asks for them, in RESULTS.hidden.npz); when it runs, every method of the run
sees those numbers, so the methods stay comparable.  Methods with a lossy verification mode
(``NAME@relaxed`` ...) cannot be replayed (their output leaves the record);
their bench figures are printed as they are, as are those of peers and
NAME+memory methods.  The bench's method names replay as the bench ran them:
``default`` as the drafter the results file's header says it resolved to,
``NAME@holdN`` with a held batch width of N (EngineConfig.hold_width), ``NAME@free``
with the gate's own choice every step (EngineConfig.hold_choice off; ``default`` replays with
today's default, the width chosen by cost, whatever the recorded run's was), ``NAME@holdcost``
with the width chosen by cost.

Printed per curve and category: tokens per step and modelled speedup over
`none` (c(T) per decode plus the engine's per-step work), and beside them,
where the results file has the same method, the bench's tokens per step,
measured speedup, identical outputs and ROUGE-L to `none`.  With --json the
table is JSON lines instead, one object per cost curve, method and category
(``ALL`` for every prompt): cost, method, category, modelled_speedup,
tokens_per_step, modelled_s and bench_s (the bench's decode seconds a pass).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import sys

import numpy as np

from edgespec.app.api import SpecModel
from edgespec.bench.prompts import load_prompts
from edgespec.bench.results import read_results
from edgespec.calibration.curve import CostCurve
from edgespec.run.specs import HOLD_COST, HOLD_FREE, drafter_from_spec, engine_settings, hold_width, split_verify
from edgespec.bench.methods import is_peer, with_memory
from edgespec.core.config import EngineConfig
from edgespec.core.engine import Engine
from edgespec.drafters.mechanisms import schedule
from edgespec.replay.curves import GPU_CURVES, curve_from_file, gpu_curve, shape_curve
from edgespec.replay.simulator import OracleDrafter, ReplayBackend, ReplayRequest, Teacher, replay, teacher_pass
from edgespec.replay.steps import load_terms


def _curve(name: str, head: dict) -> CostCurve:
    if name == "cpu":
        return CostCurve.from_json(head["cost_curve"])
    if name in GPU_CURVES:
        return gpu_curve(name)
    if name.startswith("flat:"):
        try:
            return flat_curve(CostCurve.from_json(head["cost_curve"]), float(name[5:]))
        except ValueError:
            sys.exit(f"--cost {name!r}: flat:SLOPE takes a number")
    if os.path.exists(name):
        return curve_from_file(name)
    if os.path.exists(name + "-steady.json"):
        return shape_curve(name)
    sys.exit(f"--cost {name!r}: not cpu, {', '.join(GPU_CURVES)}, flat:SLOPE, a JSON file or a PREFIX of "
             "PREFIX-steady.json and PREFIX-alternating.json")


def _teachers(path: str, hidden_path: str, model_path: str, head: dict, reqs, want_hidden: bool) -> None:
    """Attach a Teacher to every request, from the cache files or one pass of the model."""
    from edgespec.backend.llama import LlamaBackend
    cache = dict(np.load(path)) if os.path.exists(path) else {}
    hcache = dict(np.load(hidden_path)) if (want_hidden and os.path.exists(hidden_path)) else {}
    missing = [r for r in reqs if f"{r.key}/ids" not in cache or (want_hidden and r.key not in hcache)]
    if missing:
        print(f"teacher pass over {len(missing)} prompt+answer records (once; cached in {path})...", file=sys.stderr)
        # the recorded run's K cache and threads: the numbers are those its engine saw (none
        # recorded: f16, what the backend's own "auto" gave exact=False before the Loadout)
        be = LlamaBackend(model_path, n_ctx=int(head["n_ctx"]), max_nodes=512, max_leaves=1, exact=False,
                          n_threads=head.get("n_threads"), cache_type_k=head.get("cache_type_k") or "f16",
                          n_gpu_layers=int(head.get("n_gpu_layers") or 0))
        for i, r in enumerate(missing, 1):
            t = teacher_pass(be, np.concatenate([r.prompt, r.output]), len(r.prompt), hidden=want_hidden)
            for f in ("ids", "logits", "entropy", "tail"):
                cache[f"{r.key}/{f}"] = getattr(t, f)
            if want_hidden:
                hcache[r.key] = t.hidden
            if i % 10 == 0:
                print(f"  {i}/{len(missing)}", file=sys.stderr)
        be.close()
        np.savez(path + ".tmp.npz", **cache)
        os.replace(path + ".tmp.npz", path)
        if want_hidden:
            np.savez(hidden_path + ".tmp.npz", **hcache)
            os.replace(hidden_path + ".tmp.npz", hidden_path)
    for r in reqs:
        r.teacher = Teacher(*(cache[f"{r.key}/{f}"] for f in ("ids", "logits", "entropy", "tail")),
                            hcache.get(r.key))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--methods", default="suffix")
    ap.add_argument("--model", default=None)
    ap.add_argument("--corpus", action="append", default=[])
    ap.add_argument("--category", action="append", default=[])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--cost", default="cpu", help="comma-separated: cpu, rtx3090, m2, flat:SLOPE or a JSON file")
    ap.add_argument("--flat", type=float, default=None, metavar="SLOPE",
                    help="model a GPU-like flat cost curve, c(T) = 1 + SLOPE x (T - 1) at every context, instead "
                         "of the calibrated one (the gate and the time model both use it): what these drafts "
                         "would give where a batch costs little more than one token (modelled, not measured); "
                         "the same as --cost flat:SLOPE")
    ap.add_argument("--overhead-ms", type=float, default=None,
                    help="engine work per step for the time model (default: the bench's own figure per method, "
                         "else 0.15 ms)")
    ap.add_argument("--draft-ms", type=float, default=None,
                    help="time each proposal of auto's parts as this many ms for its drafting schedule, instead "
                         "of by the clock: with --overhead-ms and --gate-overhead a replay is then the same "
                         "run after run, whatever else loads the machine")
    ap.add_argument("--teacher", action="store_true",
                    help="run the teacher pass even when no method needs it (every method then sees the "
                         "model's real top-k logits and entropies; without it they are stand-ins)")
    ap.add_argument("--gate-overhead", type=float, default=None, metavar="REL",
                    help="fix the gate's per-step overhead term (plain-step units) instead of the engine's moving "
                         "average of its own time here, so the gate's decisions do not depend on this machine's load")
    ap.add_argument("--history-cap", type=float, default=None, metavar="N",
                    help="EngineConfig(history_cap=N): earlier requests' fine (source, score, depth) acceptance "
                         "counts scaled to at most N tested nodes per cell at each request's start")
    ap.add_argument("--static-costs", action="store_true",
                    help="the gate decides from the calibrated (or --cost) curve alone: no learned step costs, no "
                         "speed guard (EngineConfig(learn_costs=False, guard=False)), as before they existed")
    ap.add_argument("--no-shadow", action="store_true",
                    help="the acceptance model learns from verified nodes only (EngineConfig(shadow=False))")
    ap.add_argument("--json", action="store_true",
                    help="print the table as JSON lines, one object per cost curve, method and category (ALL: "
                         "every prompt): cost, method, category, modelled_speedup (over none), tokens_per_step, "
                         "modelled_s and bench_s (the bench's decode seconds a pass, where it ran the method)")
    a = ap.parse_args(argv)

    if a.draft_ms is not None:
        schedule.clock = itertools.count(0.0, a.draft_ms / 1000).__next__     # each call: one proposal later
    head, rows = read_results(a.results)
    rows = [r for r in rows if r.get("kind", "result") == "result"]
    if head is None or not head.get("cost_curve"):
        sys.exit("the results file has no header with a cost curve (run `edgespec bench` to make one)")
    if a.flat is not None:
        a.cost = f"flat:{a.flat:g}"
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
    bench_all: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        bench_rows[r["method"]][r["question_id"]] = r
        bench_all[r["method"]][r["question_id"]].append(r)        # every repeat

    def overhead(method: str) -> float:
        if a.overhead_ms is not None:
            return a.overhead_ms / 1000
        rs = [r for r in bench_rows.get(method, {}).values() if r.get("n_steps")]
        if rs:
            return sum(r["engine_s"] for r in rs) / sum(r["n_steps"] for r in rs)
        return 0.15e-3

    methods = ["none"] + [x for x in a.methods.split(",") if x and x != "none"]
    lossy = [x for x in methods if _replayable(x, head) is None]
    methods = [x for x in methods if x not in lossy]

    def build(meth: str, be=None):
        oracle = meth.startswith("oracle-")
        spec = _replayable(meth[len("oracle-"):] if oracle else meth, head)[0]
        d, _ = drafter_from_spec(spec, n_vocab=vocab.n_vocab, model_path=m.model_path, corpora=m.corpora)
        return OracleDrafter(d, be) if (oracle and be is not None) else d

    probe = [build(x) for x in methods]
    needs = a.teacher or any(d.prefill_topk or getattr(d, "wants_entropy", False) or getattr(d, "wants_hidden", False)
                             for d in probe)
    if needs:
        _teachers(a.results + ".teacher.npz", a.results + ".hidden.npz", m.model_path, head, reqs,
                  any(getattr(d, "wants_hidden", False) for d in probe))

    cats = sorted({r.category for r in reqs}) + ["all"]
    for cname in a.cost.split(","):
        cost = _curve(cname, head)
        terms = load_terms(cname) if cost.steady_rel else None      # a device's fitted extra per decode
        results = {}
        for meth in methods:
            oh = overhead(meth)
            be = ReplayBackend(vocab, m.backend.n_ctx, m.backend.max_nodes, cost, eog, overhead_s=oh, terms=terms)
            d = build(meth, be)
            d.warmup()
            eng = Engine(be, d, cost, EngineConfig(max_nodes=int(head["max_nodes"]), gate_overhead=a.gate_overhead,
                                                   shadow=not a.no_shadow, history_cap=a.history_cap,
                                                   learn_costs=not a.static_costs, guard=not a.static_costs,
                                                   **_replayable(meth.removeprefix("oracle-"), head)[1]))
            out = replay(eng, be, reqs, max_tokens)
            for i, r in enumerate(out):
                # scale the c(T) model by this prompt's measured plain decode time, so
                # that `none` is exact and the others differ only by the c(T) shape;
                # a shape curve is in its own machine's seconds
                rec, base = none[qids[i]], (results["none"][i] if meth != "none" else r)
                f = rec["decode_call_s"] / base["model_s"] if rec.get("decode_call_s") and base["model_s"] else 1.0
                f = 1.0 if cost.steady_rel else f
                r["time_s"] = r["model_s"] * f + r["n_steps"] * oh
            results[meth] = out
            wc, nd = sum(r["n_width_changes"] for r in out), sum(r["n_decodes"] for r in out)
            print(f"replayed {meth} under {cname}: {len(out)} prompts; {wc} of {nd} decodes changed width",
                  file=sys.stderr)
        if a.json:
            _report_json(cname, cats, methods, results, reqs, qids, bench_all)
        else:
            _report(cname, cats, methods, lossy, results, reqs, qids, bench_rows)
    m.close()
    return 0


def _replayable(meth: str, head: dict) -> tuple[str, dict] | None:
    """(drafter spec, EngineConfig fields) that a bench method replays as:
    `default` the drafter the bench's header says it resolved to (else
    generate's default), NAME@holdN NAME with a held width of N,
    NAME@holdcost / NAME@free NAME with the width chosen by cost or not; None for a
    method whose output leaves the record (a lossy verification mode), one
    with a memory of earlier answers, and another program (a peer)."""
    if meth == "default":
        from edgespec.run.settings import RunConfig
        return (head.get("default") or {}).get("drafter") or RunConfig.defaults().drafter, {}
    if is_peer(meth) or with_memory(meth):
        return None
    base, mode = split_verify(meth)
    if mode is None:
        return meth, {}
    return (base, engine_settings(mode)) if hold_width(mode) or mode in (HOLD_COST, HOLD_FREE) else None


def _sums(rows) -> dict:
    """Totals of replayed rows: generated tokens, steps, accepted drafts, modelled seconds."""
    return {k: sum(r[k] for r in rows) for k in ("n_generated", "n_steps", "n_draft_accepted", "time_s")}


def _report_json(cname, cats, methods, results, reqs, qids, bench_all) -> None:
    """One JSON line per method (none included) and category (ALL: every prompt)."""
    for c in cats:
        sel = [i for i, r in enumerate(reqs) if c == "all" or r.category == c]
        base = _sums([results["none"][i] for i in sel])
        for meth in methods:
            t = _sums([results[meth][i] for i in sel])
            b = [x for i in sel for x in bench_all[meth][qids[i]]] if meth in bench_all else []
            passes = max(1, len(b) / max(1, len(sel)))
            print(json.dumps({"cost": cname, "method": meth, "category": "ALL" if c == "all" else c,
                              "modelled_speedup": round(base["time_s"] / max(1e-12, t["time_s"]), 4),
                              "tokens_per_step": round((t["n_steps"] + t["n_draft_accepted"]) / max(1, t["n_steps"]), 4),
                              "modelled_s": round(t["time_s"], 4),
                              "bench_s": round(sum(x["decode_s"] for x in b) / passes, 4) if b else None}))


def _bench_cells(meth, sel, qids, bench_rows):
    """The bench's tokens/step, measured speedup, identical count and ROUGE-L of
    a method over the prompts `sel` (blanks where the file lacks it)."""
    b = [bench_rows.get(meth, {}).get(qids[i]) for i in sel]
    if not b or not all(b):
        return "", "", "", ""
    bacc = f"{sum(x['n_steps'] + x['n_draft_accepted'] for x in b) / max(1, sum(x['n_steps'] for x in b)):.2f}"
    bn = [bench_rows['none'][x['question_id']] for x in b]
    bsp = f"{sum(x['decode_s'] for x in bn) / sum(x['decode_s'] for x in b):.2f}"
    ident = [x.get("identical_to_none") for x in b]
    idt = f"{sum(1 for v in ident if v)}/{len(ident)}" if all(v is not None for v in ident) else ""
    rl = [x.get("rouge_l_to_none") for x in b if x.get("rouge_l_to_none") is not None]
    return bacc, bsp, idt, (f"{sum(rl) / len(rl):.3f}" if rl else "")


def _report(cname, cats, methods, lossy, results, reqs, qids, bench_rows) -> None:
    print(f"\ncost curve: {cname}")
    print(f"{'category':<15} {'method':<32} {'acc/step':>8} {'bench':>6} {'speedup*':>8} {'bench':>6} "
          f"{'identical':>9} {'ROUGE-L':>7}")
    for c in cats:
        sel = [i for i, r in enumerate(reqs) if c == "all" or r.category == c]
        for meth in methods[1:]:
            rr = [results[meth][i] for i in sel]
            rn = [results["none"][i] for i in sel]
            gen = sum(r["n_generated"] for r in rr)
            acc = (sum(r["n_steps"] + r["n_draft_accepted"] for r in rr) / max(1, sum(r["n_steps"] for r in rr)))
            sp = sum(r["time_s"] for r in rn) / max(1e-12, sum(r["time_s"] for r in rr))
            bacc, bsp, idt, rl = _bench_cells(meth, sel, qids, bench_rows)
            print(f"{c:<15} {meth:<32} {acc:>8.2f} {bacc:>6} {sp:>8.2f} {bsp:>6} {idt:>9} {rl:>7}   ({gen} tokens)")
        for meth in lossy:          # not replayable: the bench's own figures
            bacc, bsp, idt, rl = _bench_cells(meth, sel, qids, bench_rows)
            print(f"{c:<15} {meth:<32} {'-':>8} {bacc:>6} {'-':>8} {bsp:>6} {idt:>9} {rl:>7}   (bench only: not replayed)")
    print("\n* modelled: c(T) per decode from the chosen curve + the engine's work per step "
          "(replayed outputs are identical to `none` by construction)")


def flat_curve(cost: CostCurve, slope: float) -> CostCurve:
    """`cost` with every context's c(T) replaced by 1 + slope (T - 1) and no
    after-batch cost (one-token times kept)."""
    ts = list(range(1, max(cost.ts) + 1))       # every size: a model, not padded shapes
    rel = [1.0 + slope * (t - 1) for t in ts]
    return CostCurve(ts, rel, cost.t1_s, dict(cost.meta, flat=slope), cost.t1_short_s,
                     [dict(d, rel=list(rel), after_s=0.0) for d in cost.longer],
                     list(rel) if cost.short_rel else [], 0.0, 0.0)


if __name__ == "__main__":
    sys.exit(main())
