"""`edgespec bench-mix`, `bench-mix-report`: several requests at once (a
streaming answer and an app's side requests, or edits started together)
replayed on servers with their concurrency.  The mix and its replay are
edgespec/bench/mix.py, the tables mix_report.py; docs/sessions.md
("Several requests at once") says how to read them."""
from __future__ import annotations

import click

from edgespec.app.cli.options import complete_model, user_errors

DEFAULT_TARGETS = ("edgespec", "edgespec-queue=--parallel 1", "llama-server", "llama-server-ngram-mod")
DEFAULT_MIX = "side-requests.json"


def _default_mix() -> str:
    """The clone's side-requests mix, found from the package's own path;
    without a clone, a usage error that says what to pass."""
    from edgespec.paths import source_data

    path = source_data("mixes", DEFAULT_MIX)
    if path is None:
        raise click.UsageError("no mixes here: edgespec was not imported from a clone of its repository "
                               "(whose benchmarks/mixes holds them); pass --mix PATH")
    return path


def _progress(row: dict) -> None:
    t = f"first token {row['ttft_s']:.2f} s, " if row.get("ttft_s") is not None else ""
    status = "" if row["status"] == 200 else f" HTTP {row['status']}: {row.get('error', '')[:120]}"
    alone = {True: ", same alone", False: ", NOT the same alone"}.get(row.get("alone_same"), "")
    click.echo(f"  {row['target']} {row['id']} ({row['role']}): sent at {row['sent_s']:.2f} s, {t}"
               f"done at {row['done_s']:.2f} s, {row['tokens']} tokens{alone}{status}", err=True)


@click.command("bench-mix")
@click.argument("model", required=False, shell_complete=complete_model)
@click.option("--mix", "mix_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A mix (JSON: its requests and when each starts).  Default: side-requests.json of the clone's "
                   "benchmarks/mixes (an installed wheel has none).")
@click.option("--target", "targets", multiple=True, metavar="SPEC",
              help="A server to replay on (repeatable), as bench-sessions names them: edgespec, "
                   "edgespec-NAME='SERVE OPTIONS', llama-server, llama-server-ngram-mod, ..., or NAME=http://HOST:PORT; "
                   "--fresh-cache and --same-cache as there.  Default: " + ", ".join(DEFAULT_TARGETS) + ".")
@click.option("--parallel", type=click.IntRange(min=1), default=4, show_default=True,
              help="Requests served at once: llama-server's -np (with -c N times --ctx: its slots split -c), "
                   "edgespec serve's --parallel unless the target's options set it (edgespec-queue='--parallel 1').")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None,
              help="Threads of every started server (default: each server's own default).")
@click.option("-c", "--ctx", "n_ctx", type=click.IntRange(min=512), default=4096, show_default=True,
              help="Context of each request (of each slot).")
@click.option("--alone", is_flag=True, help="Then send every request once more by itself on the same server and "
                                            "say whether its answer is the same as beside the others.")
@click.option("--out", "out_path", default="mix.jsonl", show_default=True, type=click.Path(dir_okay=False),
              help="The results (JSON lines: a header, then a row per request and target).")
def bench_mix(model, mix_path, targets, parallel, threads, n_ctx, alone, out_path):
    """Replay a mix of requests sent at once on servers.

    Each target is started in turn with MODEL, greeted with one short
    request, then sent the mix: every request at its time (seconds after
    the start, or after another's first token), each in a thread of its
    own, streamed, greedy.  The table gives per target the side requests'
    time to first token, when they, the long answer and the last request
    were done, and the tokens per second over the run (docs/sessions.md)."""
    import shlex
    import sys

    from edgespec.bench.mix import MixSettings, load_mix, run_mix
    from edgespec.bench.mix_report import format_mix
    from edgespec.bench.session_targets import needs_llama_server, parse_targets
    from edgespec.models.resolve import resolve_model

    mix_path = mix_path or _default_mix()
    with user_errors():
        mix = load_mix(mix_path)
        target_list = parse_targets(targets or DEFAULT_TARGETS)
        binary = None
        if needs_llama_server(target_list):
            from edgespec.bench.peers import find_llama_server
            binary = find_llama_server().path
        model_path = resolve_model(model)
        settings = MixSettings(n_ctx=n_ctx, threads=threads, parallel=parallel, alone=alone,
                               command=shlex.join(["edgespec"] + sys.argv[1:]))
        click.echo(f"bench-mix: {mix.name}, {len(mix.requests)} requests x {len(target_list)} targets, "
                   f"{parallel} at once -> {out_path}", err=True)
        head, rows = run_mix(mix, target_list, model_path, settings, out_path, binary=binary, progress=_progress)
    click.echo(format_mix(rows, head))
    click.echo(f"\nresults: {out_path}", err=True)


@click.command("bench-mix-report")
@click.argument("results_file", type=click.Path(dir_okay=False, exists=True))
def bench_mix_report(results_file):
    """Print the tables of `edgespec bench-mix` from a saved results file."""
    from edgespec.bench.mix_report import format_mix, read_results

    with user_errors():
        head, rows = read_results(results_file)
    click.echo(format_mix(rows, head))
