"""`edgespec cache stats` and `edgespec cache clear`: look into and empty the
prompt cache's folder on disk (edgespec.core.prompt_disk; docs/serving.md,
"Prompt prefix cache").  Its files hold users' prompts as KV cells and
token ids."""
from __future__ import annotations

import os
import time

import click

from edgespec.core.prompt_disk import SUFFIX, prompt_folder


@click.group("cache")
def cache_cmd():
    """Look into or empty the prompt prefixes kept on disk (--prompt-cache-disk-mib; docs/serving.md)."""


def _files(folder: str) -> list[tuple[str, os.stat_result]]:
    """(name, stat) of the folder's cache files and temporary files; [] when there is no folder."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise click.ClickException(f"cannot read {folder}: {e.strerror or e}") from None
    out = []
    for n in names:
        if n.endswith(SUFFIX) or n.endswith(".part"):
            try:
                out.append((n, os.stat(os.path.join(folder, n))))
            except OSError:
                pass            # deleted meanwhile (a running model evicting)
    return out


@cache_cmd.command("stats")
def stats():
    """Where the prompt cache's files are, how many, how big, per model and setting (KEY)."""
    folder = prompt_folder()
    files = [(n, st) for n, st in _files(folder) if n.endswith(SUFFIX)]
    click.echo(f"{folder}: {len(files)} files, {sum(st.st_size for _, st in files):,} bytes")
    keys: dict[str, list] = {}
    for n, st in files:
        keys.setdefault(n.split("-", 1)[0], []).append(st)
    for key, sts in sorted(keys.items(), key=lambda kv: -max(st.st_mtime for st in kv[1])):
        last = time.strftime("%Y-%m-%d %H:%M", time.localtime(max(st.st_mtime for st in sts)))
        click.echo(f"  {key}: {len(sts)} files, {sum(st.st_size for st in sts):,} bytes, last used {last}")


@cache_cmd.command("clear")
def clear():
    """Delete the prompt cache's files (the prompts they hold with them).  A
    running model goes on without them and saves new ones as requests come."""
    folder = prompt_folder()
    gone = failed = 0
    for n, _ in _files(folder):
        try:
            os.unlink(os.path.join(folder, n))
            gone += 1
        except FileNotFoundError:
            pass
        except OSError as e:
            failed += 1
            click.echo(f"cannot delete {os.path.join(folder, n)}: {e.strerror or e}", err=True)
    click.echo(f"{folder}: deleted {gone} files")
    if failed:
        raise click.ClickException(f"{failed} files could not be deleted")
