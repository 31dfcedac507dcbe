"""Where edgespec keeps what it measures and downloads: one cache directory
($EDGESPEC_CACHE_DIR, else $XDG_CACHE_HOME/edgespec, else ~/.cache/edgespec),
shared by the calibration, the model zoo and the bench's peer builds."""
from __future__ import annotations

import os


def cache_dir() -> str:
    d = os.environ.get("EDGESPEC_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "edgespec")
    return d
