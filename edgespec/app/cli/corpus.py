"""`edgespec build-corpus`: compile text, code or JSON lines into a drafters' corpus file."""
from __future__ import annotations

import click

from edgespec.app.cli.loading import load_model
from edgespec.app.cli.options import complete_model, run_config, user_errors


def _answer_model(model_path: str, n_ctx: int):
    """The model that answers the chat preset's instructions (build-corpus --preset chat)."""
    return load_model(model_path, run_config(drafter="suffix", n_ctx=n_ctx, calibrate=True))


@click.command("build-corpus")
@click.argument("inputs", nargs=-1, metavar="[INPUT]...")
@click.option("-m", "--model", default=None, metavar="MODEL", shell_complete=complete_model,
              help="GGUF whose tokenizer (and, for --preset chat, answers) the "
                                            "corpus is built with (default: SmolLM2-135M-Instruct).")
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="The corpus file to write (replaced atomically).")
@click.option("--glob", "globs", multiple=True, help="Files to take from INPUT directories, e.g. '*.py' "
              "(repeatable; a pattern with / matches the path inside the directory). Default: common "
              "text and source-code suffixes.")
@click.option("--field", default=None, help="Text field of JSON-lines records (default: text); records "
                                            "with a `messages` list are rendered with the chat template.")
@click.option("--preset", type=click.Choice(("stdlib", "chat")), default=None,
              help="Add a preset corpus: stdlib (this Python's standard library, up to 20 MB) or chat "
                   "(the model's own answers to edgespec/corpus/corpora/chat_instructions.txt, cached in OUT.answers.jsonl).")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="With --preset: only its first N files (stdlib) or instructions (chat).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="With --preset chat: most tokens per answer (default 256).")
@click.option("--max-successors", type=click.IntRange(min=1, max=1024), default=8, show_default=True,
              help="Successors kept per tri-gram context.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def build_corpus_cmd(inputs, model, out_path, globs, field, preset, limit, max_tokens, max_successors, quiet):
    """Compile text, source code or JSON lines into a corpus file for the drafters.

    INPUT is a file or a directory (searched recursively); .jsonl/.ndjson files
    hold one document per line.  Text is tokenized with MODEL's tokenizer; the
    corpus holds the tokens, a suffix array and tri-gram/bi-gram successor tables.
    """
    import os
    import time

    from edgespec.corpus.build import build_corpus
    from edgespec.models.resolve import resolve_model

    if not inputs and not preset:
        raise click.UsageError("give at least one INPUT file or directory, or --preset")
    t0 = time.perf_counter()
    with user_errors():
        try:
            c = build_corpus(list(inputs), resolve_model(model), out_path, glob=list(globs) or None, field=field,
                             preset=preset, limit=limit, max_tokens=max_tokens, max_successors=max_successors,
                             load_model=_answer_model, progress=not quiet)
        except OSError as e:
            raise click.ClickException(f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")) from None
    size = os.path.getsize(out_path)
    n = max(c.n_tokens, 1)
    click.echo(f"{out_path}: {c.n_tokens:,} tokens in {c.n_docs:,} document(s) from {len(c.header['sources'])} "
               f"source(s); {size / 1e6:.1f} MB ({size / n:.1f} bytes/token, tri-grams {c.tri_nbytes / n:.1f}); "
               f"built in {time.perf_counter() - t0:.1f}s")
