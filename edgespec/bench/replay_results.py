"""Replaying a bench results file's recorded greedy outputs through drafters,
without running the model (`edgespec replay`; docs/bench.md).

The results file's `none` rows are the model's greedy output for each prompt,
its header the calibrated cost curve and settings.  A method named
``oracle-NAME`` keeps from each of NAME's proposals only the path the recorded
output follows, at probability 1 (edgespec.replay.simulator.OracleDrafter):
the speed that perfect acceptance estimates would get from NAME's candidates.
Each method runs through the real Engine over
edgespec.replay.simulator.ReplayBackend, prompts in the file's order, so the
acceptance statistics evolve as in the bench.

A cost curve (`ReplayOptions.cost`, one table each): ``cpu`` = the results
file's own calibration, ``rtx3090`` / ``m2`` = published GPU curves
(edgespec.replay.curves.gpu_curve, extrapolated linearly beyond T = 8),
``flat:SLOPE`` = c(T) = 1 + SLOPE (T - 1) at every context, a JSON file (a
curve or a saved calibration), or PREFIX naming a GPU check's
PREFIX-steady.json and PREFIX-alternating.json (tools/gpu/): each decode is
then charged by its shape (edgespec.replay.curves.shape_curve) in that
machine's seconds, plus, where PREFIX-steady.json holds a "step" key, the
device's extra per decode fitted by tools/fit_step_costs.py
(edgespec.replay.steps).

Drafters that read more of the model than its greedy tokens (the prefill's
rankings, the entropy, the hidden states) get them from one teacher-forced
pass of the real model over each prompt and its recorded answer
(edgespec.replay.simulator.teacher_pass), cached beside the results file
(RESULTS.teacher.npz; hidden states in RESULTS.hidden.npz); when it runs,
every method of the run sees those numbers.  Methods with a lossy
verification mode, a memory of earlier answers, and peers cannot be replayed:
their bench figures are printed as they are.  ``default`` replays as the
drafter the header says it resolved to, ``NAME@holdN`` with a held width of
N, ``NAME@free`` / ``NAME@holdcost`` with the width chosen by cost off / on.

The model is loaded by the caller (a SpecModel, through its public methods:
the bench stands below app/).
"""
from __future__ import annotations

import collections
import itertools
import json
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from edgespec.bench.methods import is_peer, with_memory
from edgespec.bench.prompts import load_prompts
from edgespec.bench.results import read_results
from edgespec.calibration.curve import CostCurve
from edgespec.core.config import EngineConfig
from edgespec.core.engine import Engine
from edgespec.drafters.mechanisms import schedule
from edgespec.errors import BenchError
from edgespec.replay.curves import GPU_CURVES, curve_from_file, gpu_curve, shape_curve
from edgespec.replay.simulator import OracleDrafter, ReplayBackend, ReplayRequest, Teacher, replay, teacher_pass
from edgespec.replay.steps import load_terms
from edgespec.run.specs import HOLD_COST, HOLD_FREE, drafter_from_spec, engine_settings, hold_width, split_verify

Say = Callable[[str], None]


@dataclass(frozen=True)
class ReplayOptions:
    """The replay's settings (the command's options; docs/bench.md)."""
    methods: str = "suffix"             # comma-separated bench method names; none always runs
    cost: str = "cpu"                   # comma-separated cost curves (the module doc)
    overhead_ms: float | None = None    # engine work per step; default: the bench's figure per method, else 0.15
    draft_ms: float | None = None       # time each proposal of auto's parts as this, not by the clock
    teacher: bool = False               # run the teacher pass even when no method needs it
    gate_overhead: float | None = None  # the gate's per-step overhead fixed (plain-step units)
    history_cap: float | None = None    # EngineConfig(history_cap=...)
    static_costs: bool = False          # no learned step costs, no guard
    shadow: bool = True                 # the acceptance model learns from shadow nodes too


def load_run(results: str) -> tuple[dict, list[dict], dict]:
    """(header, result rows, the `none` rows by question id) of a bench results
    file; BenchError when it cannot be replayed."""
    head, rows = read_results(results)
    rows = [r for r in rows if r.get("kind", "result") == "result"]
    if head is None or not head.get("cost_curve"):
        raise BenchError("the results file has no header with a cost curve (run `edgespec bench` to make one)")
    none = {r["question_id"]: r for r in rows if r["method"] == "none"}
    if not none:
        raise BenchError("the results file has no `none` rows: they are the recorded model output")
    return head, rows, none


def recorded_prompts(none: dict, prompts_file: str, categories=None, limit=None) -> list:
    """The prompts file's prompts that the results file recorded, in the file's order."""
    prompts = [p for p in load_prompts(prompts_file, categories=categories or None) if p.question_id in none]
    return prompts[:limit] if limit else prompts


def requests(model, head: dict, none: dict, prompts: list):
    """(ReplayRequest per prompt, their question ids): the prompt's tokens and its recorded answer."""
    reqs, qids = [], []
    for p in prompts:
        qids.append(p.question_id)
        rec = none[p.question_id]
        reqs.append(ReplayRequest(str(p.question_id), p.category,
                                  model.prompt_tokens(p.turn, raw=bool(head.get("raw"))),
                                  np.asarray(rec["tokens"], np.int32), rec.get("stop_reason") == "stop",
                                  rec.get("topk")))
    return reqs, qids


def cost_curve(name: str, head: dict) -> CostCurve:
    """The cost curve `name` names (the module doc), the results header's for ``cpu``."""
    if name == "cpu":
        return CostCurve.from_json(head["cost_curve"])
    if name in GPU_CURVES:
        return gpu_curve(name)
    if name.startswith("flat:"):
        try:
            return flat_curve(CostCurve.from_json(head["cost_curve"]), float(name[5:]))
        except ValueError:
            raise BenchError(f"--cost {name!r}: flat:SLOPE takes a number") from None
    if os.path.exists(name):
        return curve_from_file(name)
    if os.path.exists(name + "-steady.json"):
        return shape_curve(name)
    raise BenchError(f"--cost {name!r}: not cpu, {', '.join(GPU_CURVES)}, flat:SLOPE, a JSON file or a PREFIX of "
                     "PREFIX-steady.json and PREFIX-alternating.json")


def flat_curve(cost: CostCurve, slope: float) -> CostCurve:
    """`cost` with every context's c(T) replaced by 1 + slope (T - 1) and no
    after-batch cost (one-token times kept)."""
    ts = list(range(1, max(cost.ts) + 1))       # every size: a model, not padded shapes
    rel = [1.0 + slope * (t - 1) for t in ts]
    return CostCurve(ts, rel, cost.t1_s, dict(cost.meta, flat=slope), cost.t1_short_s,
                     [dict(d, rel=list(rel), after_s=0.0) for d in cost.longer],
                     list(rel) if cost.short_rel else [], 0.0, 0.0)


def replayable(meth: str, head: dict) -> tuple[str, dict] | None:
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


def attach_teachers(path: str, hidden_path: str, model_path: str, head: dict, reqs, want_hidden: bool,
                    say: Say) -> None:
    """Attach a Teacher to every request, from the cache files or one pass of the model."""
    from edgespec.backend.llama import LlamaBackend
    cache = dict(np.load(path)) if os.path.exists(path) else {}
    hcache = dict(np.load(hidden_path)) if (want_hidden and os.path.exists(hidden_path)) else {}
    missing = [r for r in reqs if f"{r.key}/ids" not in cache or (want_hidden and r.key not in hcache)]
    if missing:
        say(f"teacher pass over {len(missing)} prompt+answer records (once; cached in {path})...")
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
                say(f"  {i}/{len(missing)}")
        be.close()
        np.savez(path + ".tmp.npz", **cache)
        os.replace(path + ".tmp.npz", path)
        if want_hidden:
            np.savez(hidden_path + ".tmp.npz", **hcache)
            os.replace(hidden_path + ".tmp.npz", hidden_path)
    for r in reqs:
        r.teacher = Teacher(*(cache[f"{r.key}/{f}"] for f in ("ids", "logits", "entropy", "tail")),
                            hcache.get(r.key))


class Run:
    """One results file's replay: its recorded rows, the requests rebuilt from
    them and the model's vocabulary, and each method under each cost curve."""

    def __init__(self, model, results: str, head: dict, rows: list[dict], none: dict, reqs, qids,
                 opts: ReplayOptions):
        self.model, self.results, self.head, self.none = model, results, head, none
        self.reqs, self.qids, self.opts = reqs, qids, opts
        self.eog = int(np.nonzero(model.vocab.eog_mask())[0][0])
        self.bench_rows: dict = collections.defaultdict(dict)
        self.bench_all: dict = collections.defaultdict(lambda: collections.defaultdict(list))
        for r in rows:
            self.bench_rows[r["method"]][r["question_id"]] = r
            self.bench_all[r["method"]][r["question_id"]].append(r)        # every repeat
        methods = ["none"] + [x for x in opts.methods.split(",") if x and x != "none"]
        self.lossy = [x for x in methods if replayable(x, head) is None]
        self.methods = [x for x in methods if x not in self.lossy]
        self.cats = sorted({r.category for r in reqs}) + ["all"]

    def overhead(self, method: str) -> float:
        if self.opts.overhead_ms is not None:
            return self.opts.overhead_ms / 1000
        rs = [r for r in self.bench_rows.get(method, {}).values() if r.get("n_steps")]
        if rs:
            return sum(r["engine_s"] for r in rs) / sum(r["n_steps"] for r in rs)
        return 0.15e-3

    def drafter(self, meth: str, be=None):
        oracle = meth.startswith("oracle-")
        spec = replayable(meth[len("oracle-"):] if oracle else meth, self.head)[0]
        m = self.model
        d, _ = drafter_from_spec(spec, n_vocab=m.vocab.n_vocab, model_path=m.model_path, corpora=m.corpora)
        return OracleDrafter(d, be) if (oracle and be is not None) else d

    def teach(self, say: Say) -> None:
        """The teacher pass, where a method (or --teacher) needs the model's own numbers."""
        probe = [self.drafter(x) for x in self.methods]
        hidden = any(getattr(d, "wants_hidden", False) for d in probe)
        if self.opts.teacher or any(d.prefill_topk or getattr(d, "wants_entropy", False) or hidden for d in probe):
            attach_teachers(self.results + ".teacher.npz", self.results + ".hidden.npz", self.model.model_path,
                            self.head, self.reqs, hidden, say)

    def under(self, cname: str, say: Say) -> dict:
        """Every method replayed under the cost curve `cname`: its rows by method."""
        cost = cost_curve(cname, self.head)
        terms = load_terms(cname) if cost.steady_rel else None      # a device's fitted extra per decode
        results: dict = {}
        for meth in self.methods:
            results[meth] = self._method(meth, cost, terms, results.get("none"))
            out = results[meth]
            wc, nd = sum(r["n_width_changes"] for r in out), sum(r["n_decodes"] for r in out)
            say(f"replayed {meth} under {cname}: {len(out)} prompts; {wc} of {nd} decodes changed width")
        return results

    def _method(self, meth: str, cost: CostCurve, terms, none_rows) -> list[dict]:
        o, oh = self.opts, self.overhead(meth)
        m = self.model
        be = ReplayBackend(m.vocab, m.backend.n_ctx, m.backend.max_nodes, cost, self.eog, overhead_s=oh, terms=terms)
        d = self.drafter(meth, be)
        d.warmup()
        eng = Engine(be, d, cost, EngineConfig(max_nodes=int(self.head["max_nodes"]), gate_overhead=o.gate_overhead,
                                               shadow=o.shadow, history_cap=o.history_cap,
                                               learn_costs=not o.static_costs, guard=not o.static_costs,
                                               **replayable(meth.removeprefix("oracle-"), self.head)[1]))
        out = replay(eng, be, self.reqs, int(self.head["max_tokens"]))
        for i, r in enumerate(out):
            # scale the c(T) model by this prompt's measured plain decode time, so
            # that `none` is exact and the others differ only by the c(T) shape;
            # a shape curve is in its own machine's seconds
            rec, base = self.none[self.qids[i]], (none_rows[i] if meth != "none" else r)
            f = rec["decode_call_s"] / base["model_s"] if rec.get("decode_call_s") and base["model_s"] else 1.0
            f = 1.0 if cost.steady_rel else f
            r["time_s"] = r["model_s"] * f + r["n_steps"] * oh
        return out


def replay_file(open_model: Callable, results: str, prompts_file: str, opts: ReplayOptions, categories=(),
                limit=None, say: Say = lambda s: None):
    """Replay the results file `results`: yields (cost curve name, the Run, its
    rows by method) per cost curve.  open_model(header) loads the model (a
    SpecModel) the recorded run's settings name; it is closed at the end."""
    head, rows, none = load_run(results)
    prompts = recorded_prompts(none, prompts_file, categories, limit)
    model = open_model(head)
    clock = schedule.clock
    if opts.draft_ms is not None:      # each call: one proposal later, whatever loads the machine
        schedule.clock = itertools.count(0.0, opts.draft_ms / 1000).__next__
    try:
        reqs, qids = requests(model, head, none, prompts)
        run = Run(model, results, head, rows, none, reqs, qids, opts)
        run.teach(say)
        for cname in opts.cost.split(","):
            yield cname, run, run.under(cname, say)
    finally:
        schedule.clock = clock
        model.close()


def _sums(rows) -> dict:
    """Totals of replayed rows: generated tokens, steps, accepted drafts, modelled seconds."""
    return {k: sum(r[k] for r in rows) for k in ("n_generated", "n_steps", "n_draft_accepted", "time_s")}


def json_lines(cname: str, run: Run, results: dict) -> list[str]:
    """One JSON line per method (none included) and category (ALL: every prompt)."""
    lines = []
    for c in run.cats:
        sel = [i for i, r in enumerate(run.reqs) if c == "all" or r.category == c]
        base = _sums([results["none"][i] for i in sel])
        for meth in run.methods:
            t = _sums([results[meth][i] for i in sel])
            b = [x for i in sel for x in run.bench_all[meth][run.qids[i]]] if meth in run.bench_all else []
            passes = max(1, len(b) / max(1, len(sel)))
            lines.append(json.dumps({
                "cost": cname, "method": meth, "category": "ALL" if c == "all" else c,
                "modelled_speedup": round(base["time_s"] / max(1e-12, t["time_s"]), 4),
                "tokens_per_step": round((t["n_steps"] + t["n_draft_accepted"]) / max(1, t["n_steps"]), 4),
                "modelled_s": round(t["time_s"], 4),
                "bench_s": round(sum(x["decode_s"] for x in b) / passes, 4) if b else None}))
    return lines


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


def table(cname: str, run: Run, results: dict) -> list[str]:
    """The printed table of one cost curve: per category and method, replayed beside the bench's figures."""
    lines = ["", f"cost curve: {cname}",
             f"{'category':<15} {'method':<32} {'acc/step':>8} {'bench':>6} {'speedup*':>8} {'bench':>6} "
             f"{'identical':>9} {'ROUGE-L':>7}"]
    for c in run.cats:
        sel = [i for i, r in enumerate(run.reqs) if c == "all" or r.category == c]
        for meth in run.methods[1:]:
            rr = [results[meth][i] for i in sel]
            rn = [results["none"][i] for i in sel]
            gen = sum(r["n_generated"] for r in rr)
            acc = (sum(r["n_steps"] + r["n_draft_accepted"] for r in rr) / max(1, sum(r["n_steps"] for r in rr)))
            sp = sum(r["time_s"] for r in rn) / max(1e-12, sum(r["time_s"] for r in rr))
            bacc, bsp, idt, rl = _bench_cells(meth, sel, run.qids, run.bench_rows)
            lines.append(f"{c:<15} {meth:<32} {acc:>8.2f} {bacc:>6} {sp:>8.2f} {bsp:>6} {idt:>9} {rl:>7}   "
                         f"({gen} tokens)")
        for meth in run.lossy:          # not replayable: the bench's own figures
            bacc, bsp, idt, rl = _bench_cells(meth, sel, run.qids, run.bench_rows)
            lines.append(f"{c:<15} {meth:<32} {'-':>8} {bacc:>6} {'-':>8} {bsp:>6} {idt:>9} {rl:>7}   "
                         "(bench only: not replayed)")
    lines += ["", "* modelled: c(T) per decode from the chosen curve + the engine's work per step "
              "(replayed outputs are identical to `none` by construction)"]
    return lines
