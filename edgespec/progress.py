"""Progress bars on stderr (tqdm), or a silent stand-in with the same methods."""
from __future__ import annotations

import sys


class NoBar:
    """What progress_bar returns when progress is off."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        pass

    def set_postfix_str(self, s="", refresh=True):
        pass

    def close(self):
        pass


def progress_bar(progress, **kw):
    """A tqdm bar on stderr when `progress`, else a NoBar (kw: tqdm's total, desc, unit...)."""
    if not progress:
        return NoBar()
    from tqdm import tqdm
    return tqdm(file=sys.stderr, dynamic_ncols=True, leave=True, **kw)
