"""`edgespec memory stats FILE` and `edgespec memory clear FILE`: look into
and empty a memory file (--memory FILE of generate, chat, serve and bench;
docs/memory.md)."""
from __future__ import annotations

import os

import click


@click.group("memory")
def memory_cmd():
    """Look into or empty a memory file (--memory FILE; docs/memory.md)."""


def _existing(path: str) -> None:
    if not os.path.exists(path):
        raise click.ClickException(f"{path}: no such file")


@memory_cmd.command("stats")
@click.argument("path", type=click.Path(dir_okay=False))
def stats(path):
    """What the memory file PATH holds: requests, tokens, size, when it was written."""
    from edgespec.memory.file import file_stats

    _existing(path)
    try:
        s = file_stats(path)
    except OSError as e:
        raise click.ClickException(f"cannot read {path}: {e.strerror or e}") from None
    if s["problem"] and s.get("entries") is None:
        raise click.ClickException(f"{path}: {s['problem']} (a model started with --memory {path} starts empty "
                                   "and leaves it alone; `edgespec memory clear` empties it)")
    click.echo(f"{path}: {s['entries']} requests, {s.get('tokens', '?')} tokens, {s['bytes']:,} bytes, "
               f"tokenizer of {s['n_vocab']} tokens, written {s['saved']}")
    if s["problem"]:
        raise click.ClickException(f"{path}: {s['problem']}")


@memory_cmd.command("clear")
@click.argument("path", type=click.Path(dir_okay=False))
def clear(path):
    """Empty the memory file PATH (a running model that keeps its memory
    there writes what it holds again at its next save: stop it first)."""
    from edgespec.memory.file import clear_file

    _existing(path)
    try:
        clear_file(path)
    except OSError as e:
        raise click.ClickException(f"cannot clear {path}: {e.strerror or e}") from None
    click.echo(f"{path}: cleared")
