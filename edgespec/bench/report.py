"""The bench report: the text tables (per category and over all prompts),
the header lines above them, the divergence notes below, and the plot."""
from __future__ import annotations

import os
from typing import Iterable

import numpy as np

from edgespec.bench.methods import is_peer
from edgespec.bench.stats import method_stats, pass_speedups, speedup_ci
from edgespec.errors import BenchError


def _table(title: str, rows: list[dict], methods: list[str]) -> list[str]:
    by_m = {m: [r for r in rows if r["method"] == m] for m in methods}
    stats = {m: method_stats(v) for m, v in by_m.items() if v}
    n_prompts = max((len({r.get("question_id", i) for i, r in enumerate(v)}) for v in by_m.values()), default=0)
    n_passes = len({r.get("repeat", 0) for r in rows})
    base = stats.get("none")
    lossy = any(s.get("rouge_l") is not None and s["identical"] != s["n_compared"] for s in stats.values())
    checked = any(s.get("valid") is not None for s in stats.values())
    cols = ("method", "tok/s", "acc/step", "speedup", "95% CI") + (("passes",) if n_passes > 1 else ()) + \
        ("identical",) + (("valid",) if checked else ()) + \
        (("ROUGE-L",) if lossy else ()) + ("engine ms/step", "decode ms/step")
    body = []
    for m in methods:
        if m not in stats:
            continue
        s = stats[m]
        speed = (f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}x"
                 if base and base["tokens_per_s"] > 0 else "-")
        ci = speedup_ci(rows, m) if base and m != "none" else None
        ci_s = f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-"
        spread = ()
        if n_passes > 1:
            ps = pass_speedups(rows, m) if base and m != "none" else []
            spread = (f"{min(ps):.2f}-{max(ps):.2f}" if ps else "-",)
        ident = "-" if m == "none" or s["identical"] is None else f"{s['identical']}/{s['n_compared']}"
        valid = (("-" if s.get("valid") is None else f"{s['valid']}/{s['n_checked']}"),) if checked else ()
        body.append((m, f"{s['tokens_per_s']:.1f}",
                     "-" if s["mean_accepted"] is None else f"{s['mean_accepted']:.2f}",
                     speed, ci_s) + spread + (ident,) + valid +
                    ((("-" if s.get("rouge_l") is None else f"{s['rouge_l']:.3f}"),) if lossy else ()) + (
                     "-" if s["engine_ms_per_step"] is None else f"{s['engine_ms_per_step']:.2f}",
                     "-" if s["decode_ms_per_step"] is None else f"{s['decode_ms_per_step']:.2f}"))
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(cols)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    passes = f" x {n_passes} passes" if n_passes > 1 else ""
    lines = [f"{title} ({n_prompts} prompt{'s' if n_prompts != 1 else ''}{passes})", fmt(cols),
             fmt(["-" * w for w in widths])]
    lines += [fmt(b) for b in body]
    return lines


def format_report(results: Iterable[dict], head: dict | None = None) -> str:
    """Tables per category (in order of first appearance) and over all prompts.

    tok/s: decode tokens per second, sum(n_generated - 1) / sum(decode_s).
    acc/step: tokens committed per verification step (edgespec methods).
    speedup: tok/s over the tok/s of `none` on the same prompts.
    95% CI: a bootstrap interval of the speedup (see speedup_ci): with
        several passes, how far the machine's noise moves it on these
        prompts; with one pass, across prompts as well.
    passes (with bench --repeat): the lowest and highest speedup of a single
        pass, each pass on its own.
    identical: runs whose output equals `none`'s in the same pass (tokens for
        edgespec and llama-server methods, text for llama-cpp-python methods),
        as k/n.
    valid (when prompts carry a json_schema or grammar): answers of the
        constrained prompts that follow it (parse as JSON and follow the
        schema, or the grammar accepts them whole), as k/n.
    engine ms/step: edgespec's own time per step outside llama_decode
        (drafting, gate, verification, bookkeeping), averaged over prompts;
    decode ms/step: time inside llama_decode per step, averaged over prompts.
    Below the tables, for each method that drafted from a memory of earlier
    requests (NAME+memory): how much of its answers came from it.
    """
    results = list(results)
    calib = [r for r in results if r.get("kind") == "calibration"]
    results = [r for r in results if r.get("kind", "result") == "result"]
    methods, cats = methods_and_categories(results)
    out = _header_lines(head) + [""] if head else []
    for c in cats:
        out += _table(c, [r for r in results if r["category"] == c], methods)
        out.append("")
    out += _table("all", results, methods)
    out += _few_prompts_note(results, methods, cats)
    out += divergence_lines(results, head)
    out += memory_lines(results, methods)
    if calib:
        out += _calibration_lines(calib)
    return "\n".join(out)


def memory_lines(results: list[dict], methods: list[str]) -> list[str]:
    """For each method with memory drafts: the share of its generated tokens
    that were accepted drafts from the memory, over all prompts and by
    quarter of the run (prompts in file order, so the store fills as it goes)."""
    out = []
    for m in methods:
        rows = sorted((r for r in results if r["method"] == m), key=lambda r: (r.get("repeat", 0),
                                                                                r.get("prompt_index", 0)))
        if not any("memory" in (r.get("accepted_by_source") or {}) for r in rows):
            continue
        share = lambda rs: (sum((r.get("accepted_by_source") or {}).get("memory", 0) for r in rs),  # noqa: E731
                            sum(r.get("n_generated", 0) for r in rs))
        got, total = share(rows)
        q = max(1, -(-len(rows) // 4))
        parts = [share(rows[i:i + q]) for i in range(0, len(rows), q)]
        by_q = ", ".join(f"{a / b:.0%}" if b else "-" for a, b in parts)
        out.append(f"{m}: {got:,} of {total:,} generated tokens ({got / max(total, 1):.1%}) were accepted drafts "
                   f"from the memory of earlier answers; by quarter of the run: {by_q}")
    return ([""] if out else []) + out


def _header_lines(head: dict) -> list[str]:
    """The report's lines on the model, machine and settings of a run (its header)."""
    out = [f"model: {head.get('model')}", _machine_line(head)]
    if head.get("rpc"):
        out.append(_rpc_line(head))
    reps = int(head.get("repeat", 1) or 1)
    out.append(f"max_tokens {head.get('max_tokens')}, greedy decoding" +
               (", raw prompts (no chat template)" if head.get("raw") else "") +
               (f", {reps} passes (each a fresh session)" if reps > 1 else ""))
    out.append(_exact_line(head))
    if head.get("kernel_price"):
        out.append("kernels auto: " + _price_line(head["kernel_price"]))
    if head.get("constrained"):
        out.append(constraint_line(head["constrained"]))
    out += peer_header_lines(head)
    if head.get("pooled"):
        out.append(f"pooled from {len(head['pooled'])} runs (each prompt's methods side by side in one of them): "
                   + ", ".join(f"{os.path.basename(p['file'])} ({p['date']})" for p in head["pooled"]))
    return out


def _price_line(d: dict) -> str:
    from edgespec.calibration.kernelchoice import KernelPrice
    try:
        return KernelPrice.from_json(d).describe()
    except (ValueError, KeyError, TypeError):     # a results file from before the price's version
        return f"{d.get('choice')} (a kernel price of version {d.get('version')})"


def _machine_line(head: dict) -> str:
    return (f"machine: {head.get('cpu')} ({head.get('hostname')}), {head.get('n_threads')} threads, "
            f"n_ctx {head.get('n_ctx')}, n_gpu_layers {head.get('n_gpu_layers')}, "
            f"K cache {head.get('cache_type_k', 'f16')}, "
            + (f"kernels {head['kernels']}, " if head.get("kernels", "exact") != "exact" else "") +
            f"llama_cpp {head.get('llama_cpp_version')}, {head.get('date')}")


def _rpc_line(head: dict) -> str:
    """The RPC workers of a run over --rpc: each with its HELLO round trip, the split, llama-server's own workers."""
    rtt = head.get("rpc_hello_ms") or {}
    return ("RPC workers: " + ", ".join(f"{ep} (HELLO {rtt[ep]:.1f} ms)" if rtt.get(ep) is not None
                                        else ep for ep in head["rpc"])
            + (f", split {':'.join(f'{x:g}' for x in head['tensor_split'])}" if head.get("tensor_split")
               else "")
            + (f", output layer {head['rpc_output']}" if head.get("rpc_output") else "")
            + (f"; llama-server's: {', '.join(head['peer_rpc'])}" if head.get("peer_rpc") else ""))


def _few_prompts_note(results: list[dict], methods: list[str], cats: list[str]) -> list[str]:
    """A note on categories of fewer than 5 prompts in a single-pass run, whose speedups are noisy."""
    few = [c for c in cats if len({r.get("question_id") for r in results if r["category"] == c}) < 5]
    if few and len({r.get("repeat", 0) for r in results}) == 1 and "none" in methods:
        return ["", f"note: {len(few)} categor{'y has' if len(few) == 1 else 'ies have'} fewer than 5 prompts "
                    f"({', '.join(few)}); on a busy machine their speedups can move by 0.1x or more from run "
                    f"to run: --repeat N runs every prompt N times and shows the spread"]
    return []


def _calibration_lines(calib: list[dict]) -> list[str]:
    """The acceptance calibration table: each drafter's predicted against
    observed acceptance per source, pooled over every pass."""
    out = ["", "acceptance calibration (draft nodes whose parent was accepted; predicted = the gate's "
               "estimate, observed = share accepted)",
           f"{'method':<20} {'source':<10} {'tested':>8} {'predicted':>10} {'observed':>9}"]
    agg: dict = {}          # (method, source) over every pass
    for c in calib:
        for row in c["rows"]:
            a = agg.setdefault((c["method"], row["source"]), [0, 0.0, 0.0])
            a[0] += row["tested"]
            a[1] += row["predicted"] * row["tested"]
            a[2] += row["observed"] * row["tested"]
    for (m, src), (n, pr, ob) in agg.items():
        out.append(f"{m:<20} {src:<10} {n:>8} {pr / n:>10.3f} {ob / n:>9.3f}")
    return out


def constraint_line(c: dict) -> str:
    """The report header's line on constrained prompts (the header's "constrained")."""
    kinds = [f"{c[k]} by a {what}" for k, what in (("json_schema", "JSON schema"), ("grammar", "GBNF grammar")) if c.get(k)]
    return (f"constrained: {c['json_schema'] + c['grammar']} of {c['n_prompts']} prompts ({', '.join(kinds)}); every "
            f"method decodes under the same grammar, `valid` counts the answers that follow it")


def peer_header_lines(head: dict) -> list[str]:
    """What method `default` resolved to and which llama-server ran, for the report's header."""
    out = []
    d = head.get("default")
    if d:
        out.append(f"default = `edgespec generate` with no options: drafter {d['generate_drafter']}, kernels "
                   f"{d['kernels']}, K cache {d['cache_type_k']}, {d['n_threads']} threads, n_ctx {d['n_ctx']}, "
                   f"max_nodes {d['max_nodes']}, cost gate {'on' if d['cost_gate'] else 'off'}")
    srv = head.get("llama_server")
    if srv:
        b = srv["binary"]
        same = (f"built from llama-cpp-python {b['llama_cpp_python']}'s llama.cpp" if b.get("same_as_llama_cpp_python")
                else "not built by edgespec build-peers (its llama.cpp unchecked)")
        out.append(f"llama-server: {b['version']}, {same}; " + ", ".join(
            f"{m} {s['threads']} thread{'s' if s['threads'] != 1 else ''}" for m, s in srv["methods"].items()))
    return out


def _exact_line(head: dict) -> str:
    ex = head.get("exactness")
    if head.get("exact") is None or not ex:
        return "exact: not checked (the exactness self-check did not run)"
    if ex["exact"]:
        return (f"exact: true (self-check: batches of 2..{ex['max_t']} tokens gave logits bit-identical "
                f"to one-token decoding)")
    return (f"exact: FALSE (self-check: batches of {', '.join(map(str, ex['failed']))} tokens differ from "
            f"one-token decoding by up to {ex['max_abs_diff']:.3g}; greedy text can differ at near-ties)")


def divergence_lines(results: list[dict], head: dict | None) -> list[str]:
    """The divergences of exact edgespec methods from `none`, each with its
    logit gap, set against the self-check: a gap wider than twice its largest
    |logit difference| (or any gap when the check found the model exact) is
    no near-tie that batched arithmetic explains."""
    rows = [r for r in results if r.get("divergence")]
    ex = (head or {}).get("exactness") or {}
    bound = 2 * float(ex.get("max_abs_diff", 0.0)) if ex else None
    compared = [r for r in results if r.get("identical_to_none") is not None and r["method"] != "none"
                and not is_peer(r["method"]) and r.get("verify", "exact") == "exact"]
    if not compared:
        return []
    out = ["", f"divergences from none: {len(rows)} of {len(compared)} runs of exact edgespec methods"
               + (" (gap = none's top logit minus the logit of the method's token, re-decoded plainly)" if rows else "")]
    for r in rows:
        d = r["divergence"]
        tok = "end of answer" if d["token"] is None else f"token {d['token']}"
        if d["gap"] is None:
            verdict = "the grammar rejects the method's token there: look for a bug"
        elif not d.get("reproduced", True):
            verdict = "re-decoding did not reproduce none's token: look for a bug"
        elif bound is None:
            verdict = "no self-check to compare with"
        elif d["gap"] <= bound:
            verdict = f"near-tie (<= 2 x the self-check's {bound / 2:.3g})"
        else:
            verdict = (f"NOT a near-tie batched arithmetic explains (self-check max |dlogit| {bound / 2:.3g}): "
                       "look for a bug")
        out.append(f"  {r['method']:<18} q{r.get('question_id')} ({r.get('category')}), pass {r.get('repeat', 0)}, "
                   f"at token {d['index']} ({tok} instead of {d['none_token']}): gap {_gap(d['gap'])}, "
                   f"top-2 gap {_gap(d['top2_gap'])}: {verdict}")
    return out


def _gap(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def methods_and_categories(results: list[dict]) -> tuple[list[str], list[str]]:
    """The methods and the categories of result rows, each in first-seen order."""
    return list(dict.fromkeys(r["method"] for r in results)), list(dict.fromkeys(r["category"] for r in results))


def plot_results(results: Iterable[dict], path: str, head: dict | None = None) -> None:
    """Decode tokens/s by category (and over all prompts) and method, as
    grouped bars, into an image file (matplotlib: the `plot` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'edgespec[plot]'") from None
    results = [r for r in results if r.get("kind", "result") == "result"]
    methods, cats = methods_and_categories(results)
    cats.append("all")
    speeds = np.array([[method_stats([r for r in results if r["method"] == m and c in ("all", r["category"])])
                        ["tokens_per_s"] for c in cats] for m in methods])
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6.0, (0.5 + 0.12 * len(methods)) * len(cats) + 3), 4.5))
    x = np.arange(len(cats))
    for i, m in enumerate(methods):
        ax.bar(x + (i - (len(methods) - 1) / 2) * width, speeds[i], width, label=m)
    ax.set_xticks(x)
    ax.set_xticklabels(cats, rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s")
    title = os.path.basename(str((head or {}).get("model", "")))
    if head:
        title += f"\n{head.get('cpu')}, {head.get('n_threads')} threads, K cache {head.get('cache_type_k')}, " \
                 f"max_tokens {head.get('max_tokens')}"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot write the plot {path}: {e}") from None
    finally:
        plt.close(fig)
