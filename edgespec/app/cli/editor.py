"""`edgespec editor-trace`, `bench-editor`, `bench-editor-report`: editor
traces (the requests llama.vim sends to /infill while a file is typed)
written from a source file, and replayed against servers.  The rule and the
replay are edgespec/bench/editor.py and editor_replay.py; docs/sessions.md
("Editor traces") says how to read them."""
from __future__ import annotations

import click

from edgespec.app.cli.options import complete_model, user_errors

DEFAULT_TARGETS = ("edgespec", "llama-server", "llama-server-ngram-mod", "llama-server-ngram-simple")


@click.command("editor-trace")
@click.argument("source", type=click.Path(exists=True, dir_okay=False))
@click.option("--extra", "extra", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Another file of the same project whose chunks fill the ring (input_extra); repeatable.")
@click.option("--start", type=click.IntRange(min=1), default=1, show_default=True,
              help="The first line typed (1-based); the lines above it stand as they are.")
@click.option("--lines", "n_lines", type=click.IntRange(min=1), default=None,
              help="How many non-blank lines to type (each gets up to three requests).  Default: to the end.")
@click.option("--ring-chunks", type=click.IntRange(min=0), default=4, show_default=True,
              help="Chunks of the --extra files the ring holds.")
@click.option("--chunk-lines", type=click.IntRange(min=3), default=64, show_default=True,
              help="Lines per ring chunk (llama.vim's ring_chunk_size).")
@click.option("--ring-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Lines typed between two ring changes (one chunk in at the back, the oldest out); 0: the ring stays.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="The trace to write (JSON lines).")
def editor_trace(source, extra, start, n_lines, ring_chunks, chunk_lines, ring_every, out_path):
    """Write the requests llama.vim sends while SOURCE is typed.

    SOURCE's lines are typed anew from top to bottom in the file as it
    stands (the real lines above and below the cursor, the current line only
    as far as it is typed): a request after the line's indentation, after a
    third and after two thirds of the rest, each with llama.vim's fields
    (256 lines before the cursor, 64 after, the ring of --extra chunks,
    n_predict 128, t_max_predict_ms 500, cache_prompt, its samplers) and the
    text typed next, which bench-editor scores the suggestion's first line
    against.  Hold the code out: a module of another project, with
    --extra files of that project."""
    from edgespec.bench.editor import TraceSpec, editor_trace as build, write_trace

    with user_errors():
        spec = TraceSpec(start=start, n_lines=n_lines, ring_chunks=ring_chunks, chunk_lines=chunk_lines,
                         ring_every=ring_every)
        trace = build(source, list(extra), spec)
        write_trace(trace, out_path)
    roles = [r["role"] for r in trace.requests]
    click.echo(f"{out_path}: {len(roles) - roles.count('ring')} requests on {len(trace.header['lines_typed'])} lines "
               f"of {trace.header['source']} (+ {roles.count('ring')} ring updates)", err=True)


def _progress(row: dict) -> None:
    status = "" if row["status"] == 200 else f" HTTP {row['status']}: {row.get('error', '')[:120]}"
    right = " right" if row.get("first_line_right") else ""
    click.echo(f"  {row['target']} {row['session']}#{row['index']} {row['role']} {row['line']}:{row['col']}: "
               f"{row['wall_ms']:.0f} ms, read {row.get('prompt_n')}, reused {row.get('cache_n')}, "
               f"{row.get('predicted_n')} generated{right}{status}", err=True)


@click.command("bench-editor")
@click.argument("model", required=False, shell_complete=complete_model)
@click.option("--trace", "trace_paths", multiple=True, required=True, type=click.Path(exists=True, dir_okay=False),
              help="An editor trace (edgespec editor-trace); repeatable.")
@click.option("--target", "targets", multiple=True, metavar="SPEC",
              help="A server to replay on (repeatable), as bench-sessions names them: edgespec, "
                   "edgespec-NAME='SERVE OPTIONS', llama-server, llama-server-ngram-mod, llama-server-ngram-simple, ..., "
                   f"or NAME=http://HOST:PORT.  Default: {', '.join(DEFAULT_TARGETS)}.")
@click.option("--fim-preset/--no-fim-preset", default=True, show_default=True,
              help="Start llama-server targets with the FIM preset's flags, --cache-reuse 256 -b 1024 -ub 1024.")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None,
              help="Threads of every started server (default: each server's own default).")
@click.option("-c", "--ctx", "n_ctx", type=click.IntRange(min=512), default=8192, show_default=True,
              help="Context of every started server.")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run every target this many times, in the same order each round.")
@click.option("--out", "out_path", default="editor.jsonl", show_default=True, type=click.Path(dir_okay=False),
              help="The results (JSON lines: a header, a row per request, a summary per trace and target).")
def bench_editor(model, trace_paths, targets, fim_preset, threads, n_ctx, rounds, out_path):
    """Replay editor traces on servers' /infill, one request at a time.

    Each target is started in turn with MODEL, sent one short /infill, then
    every trace's requests in order, greedy (temperature 0, top_k 1); the
    table gives per target and trace the request latency p50, p95 and mean,
    the prefill share of the time, the prompt tokens read (at a new line and
    per keystroke), reused and generated per request, and how many
    suggestions' first lines equal what was typed next (docs/sessions.md)."""
    from edgespec.bench import editor_replay
    from edgespec.bench.editor import load_editor_trace
    from edgespec.bench.session_targets import needs_llama_server, parse_targets, run_sessions
    from edgespec.models.resolve import resolve_model

    with user_errors():
        traces = [load_editor_trace(p) for p in trace_paths]
        target_list = parse_targets(targets or DEFAULT_TARGETS)
        if fim_preset:
            target_list = editor_replay.with_fim_preset(target_list)
        binary = None
        if needs_llama_server(target_list):
            from edgespec.bench.peers import find_llama_server
            binary = find_llama_server().path
        model_path = resolve_model(model)
        n = sum(len(t.requests) for t in traces)
        click.echo(f"bench-editor: {len(traces)} traces, {n} requests x {len(target_list)} targets -> {out_path}",
                   err=True)
        head, rows = run_sessions(traces, target_list, model_path, n_ctx, threads, 0, out_path, binary=binary,
                                  progress=_progress, rounds=rounds, kind=editor_replay)
    click.echo(editor_replay.format_editor(rows, head))
    click.echo(f"\nresults: {out_path}", err=True)


@click.command("bench-editor-report")
@click.argument("results_file", type=click.Path(dir_okay=False, exists=True))
def bench_editor_report(results_file):
    """Print the table of `edgespec bench-editor` from a saved results file."""
    from edgespec.bench.editor_replay import format_editor, read_results

    with user_errors():
        head, rows = read_results(results_file)
    click.echo(format_editor(rows, head))
