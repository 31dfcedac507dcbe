"""`edgespec bench`, `bench-report` and `build-peers`: comparing decoding methods.

bench times edgespec's drafters against llama-cpp-python and llama-server on
a prompts file, bench-report prints saved results again, and build-peers
builds the llama-server the bench's peer methods run.  The work is in
edgespec/bench/; these commands read the options and print.
"""
from __future__ import annotations

import click

from edgespec.app.cli.loading import load_model, with_chat_template
from edgespec.app.cli.options import (backend_options, complete_model, corpus_option, model_options,
                                      run_config_options, user_errors)


@click.command()
@click.argument("model", required=False, shell_complete=complete_model)
@model_options
@click.option("--prompts", "prompts_file", required=True, type=click.Path(dir_okay=False),
              help="JSON-lines prompts (question_id, category, turns); the first turn is used.")
@click.option("--methods", default=",".join(("none", "suffix", "llama-cpp-python", "llama-cpp-python-expert",
                                              "llama-cpp-python-pld")),
              show_default=True, help="Comma-separated: edgespec drafters (none, suffix, trigram, adjacency, auto; "
                                      "NAME-nocorpus runs one without the --corpus files, NAME-noX / NAME+X "
                                      "switches a component X off / on, e.g. auto-notrigram, NAME+X=V sets a "
                                      "numeric setting, e.g. auto+copy_len=30; NAME@relaxed, NAME@entropy or "
                                      "NAME@entropy_inv with a lossy verification mode) and "
                                      "default (what `edgespec generate` runs with no options), "
                                      "NAME+memory (suffix+memory, default+memory: with a memory of the run's "
                                      "earlier answers, prompts in file order), "
                                      "llama-cpp-python (its defaults), llama-cpp-python-expert (a thread per "
                                      "physical core, flash attention, edgespec's K cache), llama-cpp-python-pld "
                                      "(prompt lookup, 10 tokens), llama-cpp-python-pld-cpu (2 tokens), "
                                      "llama-server, llama-server-ngram-simple, -ngram-map-k, -ngram-map-k4v, "
                                      "-ngram-mod, -ngram-cache (llama.cpp's server: edgespec build-peers); "
                                      "PEER@tN runs a peer with N threads.")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N prompts (after --category).")
@click.option("--category", multiple=True, help="Only prompts of this category (repeatable).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run the prompt list N times, each pass a fresh session; the report pools the passes and "
                   "shows the range of single-pass speedups (for categories with few prompts on a noisy machine).")
@click.option("--out", "out_path", default="results.jsonl", show_default=True, type=click.Path(dir_okay=False),
              help="Where to write the JSON-lines results (header line, then one line per prompt and method).")
@click.option("--raw", is_flag=True, help="Send each prompt's first turn as plain text, without the chat template "
                                          "(base and completion models, which have none).")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Also draw decode tok/s by category and method into this image (PNG; needs edgespec[plot]).")
@click.option("--peer-rpc", metavar="HOST:PORT[,...]", default=None,
              help="With --rpc: the RPC workers the llama-server methods use (a worker serves one client at a "
                   "time, so they need their own, on the same machines as the model's).")
@corpus_option
@backend_options
@click.option("--memory", "memory_file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="The memory store the NAME+memory methods start from (each its own copy; the file is read, "
                   "never written).  Without it they start empty.")
@run_config_options
def bench(model, prompts_file, methods, max_tokens, limit, category, repeat, out_path, raw, plot_path, peer_rpc,
          config, memory_file):
    """Compare decoding methods on a prompts file (greedy), prompt by prompt.

    Prints a table per category and overall: decode tok/s, tokens per step,
    speedup over `none`, and how many outputs are identical to `none`.
    """
    from edgespec.backend.ggml import parse_endpoints
    from edgespec.bench.methods import parse_methods, server_binary
    from edgespec.bench.prompts import load_prompts
    from edgespec.bench.report import format_report, plot_results
    from edgespec.bench.runner import run_bench, stderr_progress

    with user_errors():
        prompts = load_prompts(prompts_file, categories=list(category), limit=limit)
        method_list = parse_methods(methods)
        server_binary(method_list)         # not built: say so before loading the model
    if not raw:
        model = with_chat_template(model, "use --raw to send the prompts as plain text")
    m = load_model(model, config.but(drafter="none", memory=False, calibrate=True))
    try:
        click.echo(f"bench: {len(prompts)} prompts x {len(method_list)} methods"
                   f"{f' x {repeat} passes' if repeat > 1 else ''}, max_tokens {max_tokens}, "
                   f"{m.backend.n_threads} threads -> {out_path}", err=True)
        with user_errors():
            head, results = run_bench(m, prompts, method_list, max_tokens=max_tokens, out_path=out_path,
                                      llama_threads=config.n_threads, repeat=repeat, raw=raw,
                                      prompts_file=prompts_file, progress=stderr_progress,
                                      peer_rpc=parse_endpoints(peer_rpc) if peer_rpc else (),
                                      memory_file=memory_file)
    finally:
        m.close()
    click.echo(format_report(results, head))
    click.echo(f"\nresults: {out_path}", err=True)
    if plot_path:
        with user_errors():
            plot_results(results, plot_path, head)
        click.echo(f"plot: {plot_path}", err=True)


@click.command("bench-report")
@click.argument("results_files", nargs=-1, required=True, type=click.Path(dir_okay=False),
                metavar="RESULTS_FILE...")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Also draw decode tok/s by category and method into this image (PNG; needs edgespec[plot]).")
def bench_report(results_files, plot_path):
    """Print the tables of `edgespec bench` from a saved results file.

    Several files of the same model and settings (a bench stopped part way,
    then run again on the remaining prompts with --category or --limit) are
    reported as one: each prompt's methods were timed side by side in one of
    the runs, and the header lists them."""
    from edgespec.bench.report import format_report, plot_results
    from edgespec.bench.results import read_results_pooled

    with user_errors():
        head, results = read_results_pooled(results_files)
    click.echo(format_report(results, head))
    if plot_path:
        with user_errors():
            plot_results(results, plot_path, head)
        click.echo(f"plot: {plot_path}", err=True)


@click.command("build-peers")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Parallel compile jobs (default: one per CPU).")
@click.option("--force", is_flag=True, help="Build again even if a build for this llama-cpp-python exists.")
@click.option("--sdist", type=click.Path(dir_okay=False, exists=True), default=None,
              help="llama-cpp-python's source distribution (.tar.gz) of the installed version, instead of "
                   "downloading it with pip (offline machines).")
def build_peers_cmd(jobs, force, sdist):
    """Build llama.cpp's llama-server and rpc-server for `edgespec bench`.

    They are built from the llama.cpp source that the installed
    llama-cpp-python vendors (the same commit), with RPC support, and cached
    in edgespec's cache directory; bench's llama-server methods run them.
    Needs cmake and a C++ compiler; takes several minutes (about 8 on 2 cores).
    CMAKE_ARGS is passed on to CMake (e.g. -DGGML_CUDA=on)."""
    from edgespec.bench import peers

    with user_errors():
        manifest = peers.build_peers(jobs=jobs, force=force, sdist=sdist,
                                     say=lambda s: click.echo(s, err=True))
        click.echo(peers.peers_dir(manifest["llama_cpp_python"]))
