"""`edgespec replay`: a bench results file's recorded greedy answers through
drafters, without running the model.  The replay is
edgespec/bench/replay_results.py (over edgespec/replay/); docs/bench.md says
what it models."""
from __future__ import annotations

import click

from edgespec.app.cli.options import user_errors


@click.command("replay")
@click.argument("results", type=click.Path(dir_okay=False, exists=True))
@click.option("--prompts", "prompts_file", required=True, type=click.Path(dir_okay=False),
              help="The prompts file the bench ran (JSON lines).")
@click.option("--methods", default="suffix", show_default=True,
              help="Comma-separated bench method names (none always runs; oracle-NAME: NAME's proposals at "
                   "perfect acceptance estimates).")
@click.option("--model", default=None, help="The model file (default: the one the results header names).")
@click.option("--corpus", multiple=True, help="A corpus file (.esc) the drafters read (repeatable).")
@click.option("--category", multiple=True, help="Only prompts of this category (repeatable).")
@click.option("--limit", type=int, default=None, help="Only the first N prompts.")
@click.option("--cost", default="cpu", show_default=True,
              help="Comma-separated cost curves, a table each: cpu (the results file's calibration), rtx3090, m2, "
                   "flat:SLOPE, a JSON file, or a GPU check's PREFIX (PREFIX-steady.json, PREFIX-alternating.json).")
@click.option("--flat", type=float, default=None, metavar="SLOPE",
              help="The same as --cost flat:SLOPE: c(T) = 1 + SLOPE x (T - 1) at every context, a GPU-like "
                   "curve (modelled, not measured).")
@click.option("--overhead-ms", type=float, default=None,
              help="Engine work per step for the time model (default: the bench's own figure per method, "
                   "else 0.15 ms).")
@click.option("--draft-ms", type=float, default=None,
              help="Time each proposal of auto's parts as this many ms for its drafting schedule, not by the "
                   "clock: with --overhead-ms and --gate-overhead a replay is the same run after run.")
@click.option("--teacher", is_flag=True,
              help="Run the teacher pass even when no method needs it (every method then sees the model's real "
                   "top-k logits and entropies; without it they are stand-ins).")
@click.option("--gate-overhead", type=float, default=None, metavar="REL",
              help="Fix the gate's per-step overhead term (plain-step units) instead of the engine's moving "
                   "average of its own time here.")
@click.option("--history-cap", type=float, default=None, metavar="N",
              help="EngineConfig(history_cap=N): earlier requests' acceptance counts scaled to at most N "
                   "tested nodes per cell at each request's start.")
@click.option("--static-costs", is_flag=True,
              help="The gate decides from the curve alone: no learned step costs, no speed guard.")
@click.option("--no-shadow", is_flag=True, help="The acceptance model learns from verified nodes only.")
@click.option("--json", "as_json", is_flag=True,
              help="JSON lines, one per cost curve, method and category (ALL: every prompt): cost, method, "
                   "category, modelled_speedup, tokens_per_step, modelled_s, bench_s.")
def replay(results, prompts_file, methods, model, corpus, category, limit, cost, flat, overhead_ms, draft_ms,
           teacher, gate_overhead, history_cap, static_costs, no_shadow, as_json):
    """Replay RESULTS (an `edgespec bench` results file: its `none` rows are
    the model's greedy output, its header the cost curve and settings)
    through the drafters of --methods on the real engine over a modelled
    backend, and print per cost curve and category the tokens per step and
    the modelled speedup over `none` beside the bench's own figures."""
    from edgespec.bench.replay_results import ReplayOptions, json_lines, replay_file, table

    opts = ReplayOptions(methods=methods, cost=f"flat:{flat:g}" if flat is not None else cost,
                         overhead_ms=overhead_ms, draft_ms=draft_ms, teacher=teacher, gate_overhead=gate_overhead,
                         history_cap=history_cap, static_costs=static_costs, shadow=not no_shadow)

    def open_model(head):
        from edgespec.app.api import SpecModel
        return SpecModel(model or head.get("model"), drafter="none", n_ctx=int(head["n_ctx"]), calibrate=False,
                         max_nodes=int(head["max_nodes"]), corpora=list(corpus))

    with user_errors():
        for cname, run, rows in replay_file(open_model, results, prompts_file, opts, category, limit,
                                            say=lambda s: click.echo(s, err=True)):
            click.echo("\n".join(json_lines(cname, run, rows) if as_json else table(cname, run, rows)))
