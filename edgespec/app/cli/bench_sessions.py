"""`edgespec bench-sessions`: recorded app sessions replayed against servers.

The traces, the targets and the replay are edgespec/bench/sessions.py and
session_targets.py; docs/sessions.md says how to record and read them.
"""
from __future__ import annotations

import click

from edgespec.app.cli.options import REQUEST, complete_model, user_errors

DEFAULT_TARGETS = ("edgespec", "llama-server", "llama-server-ngram-simple", "llama-server-ngram-mod")


def _progress(row: dict) -> None:
    t = f"{row['ttft_ms']:.0f} ms to first token, " if row.get("ttft_ms") is not None else ""
    status = "" if row["status"] == 200 else f" HTTP {row['status']}: {row.get('error', '')[:120]}"
    click.echo(f"  {row['target']} {row['session']}#{row['index']} {row['role']}: {row['wall_ms']:.0f} ms, {t}"
               f"prompt {row.get('prompt_n')} + cached {row.get('cache_n')}, {row.get('predicted_n')} generated"
               f"{status}", err=True)


def _default_sessions() -> str:
    """The clone's recorded traces, found from the package's own path (not the
    working directory); without a clone, a usage error that says what to pass."""
    from edgespec.paths import source_data

    path = source_data("sessions")
    if path is None:
        raise click.UsageError("no recorded sessions here: edgespec was not imported from a clone of its "
                               "repository (whose benchmarks/sessions holds them); pass --sessions PATH")
    return path


@click.command("bench-sessions")
@click.argument("model", required=False, shell_complete=complete_model)
@click.option("--sessions", "sessions_path", default=None, type=click.Path(exists=True),
              help="A trace file (JSON lines), or a folder of them (*.jsonl).  Default: the recorded traces, "
                   "benchmarks/sessions of the clone edgespec runs from (an installed wheel has none).")
@click.option("--target", "targets", multiple=True, metavar="SPEC",
              help="A server to replay on (repeatable; the first is the reference of `identical`): edgespec, "
                   "edgespec-NAME='SERVE OPTIONS' (e.g. edgespec-exact='--kernels exact'), llama-server, "
                   "llama-server-ngram-simple, llama-server-ngram-mod, ... (edgespec build-peers), or "
                   f"NAME=http://HOST:PORT (already running).  Default: {', '.join(DEFAULT_TARGETS)}.  An edgespec "
                   "target's options may hold --fresh-cache (started as a new user: an empty cache folder, no "
                   "warm-up) or --same-cache (the last fresh target's folder: that user's next session).")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None,
              help="Threads of every started server (default: each server's own default).")
@click.option("-c", "--ctx", "n_ctx", type=click.IntRange(min=512), default=8192, show_default=True,
              help="Context of every started server (Aider's prompts run to 2,000 tokens before the answer).")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=REQUEST.max_tokens, show_default=True,
              help="max_tokens of the requests that have none (Aider sends none: without a cap an answer "
                   "may run to the end of the context).")
@click.option("--restart", type=click.Choice(["session", "request"]), default=None,
              help="Stop each target and start it again before every session (or request), without a warm-up, "
                   "as a restarted server or relaunched app: what the prompt cache's disk tier keeps.  An "
                   "edgespec target keeps one cache folder across its restarts (without --fresh-cache or "
                   "--same-cache: its own, with a copy of the calibration and no saved prompts).")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run every target this many times, in the same order each round (on a machine whose speed "
                   "drifts from run to run, each target gets samples of the whole run; the tables pool them).")
@click.option("--out", "out_path", default="sessions.jsonl", show_default=True, type=click.Path(dir_okay=False),
              help="The results (JSON lines: a header, then a row per request and per session and target).")
def bench_sessions(model, sessions_path, targets, threads, n_ctx, max_tokens, restart, rounds, out_path):
    """Replay recorded app sessions (Aider, Open WebUI, Continue) on servers.

    Each target is started in turn with MODEL, greeted with one short
    request, then sent every session's requests in order (greedy); the table
    gives per session its wall time, time to first token, prefill time,
    cached prompt tokens and decode speed, and how many answers equal the
    first target's (docs/sessions.md)."""
    from edgespec.bench.session_report import format_sessions
    from edgespec.bench.session_targets import needs_llama_server, parse_targets, run_sessions
    from edgespec.bench.sessions import load_sessions
    from edgespec.models.resolve import resolve_model

    sessions_path = sessions_path or _default_sessions()
    with user_errors():
        sessions = load_sessions(sessions_path)
        target_list = parse_targets(targets or DEFAULT_TARGETS)
        binary = None
        if needs_llama_server(target_list):
            from edgespec.bench.peers import find_llama_server
            binary = find_llama_server().path
        model_path = resolve_model(model)
        click.echo(f"bench-sessions: {len(sessions)} sessions, {sum(len(s.requests) for s in sessions)} requests "
                   f"x {len(target_list)} targets -> {out_path}", err=True)
        head, rows = run_sessions(sessions, target_list, model_path, n_ctx, threads, max_tokens, out_path,
                                  binary=binary, progress=_progress, restart=restart or "", rounds=rounds)
    click.echo(format_sessions(rows, head))
    click.echo(f"\nresults: {out_path}", err=True)


@click.command("bench-sessions-report")
@click.argument("results_file", type=click.Path(dir_okay=False, exists=True))
def bench_sessions_report(results_file):
    """Print the tables of `edgespec bench-sessions` from a saved results file."""
    from edgespec.bench.session_report import format_sessions
    from edgespec.bench.sessions import read_results

    with user_errors():
        head, rows = read_results(results_file)
    click.echo(format_sessions(rows, head))
