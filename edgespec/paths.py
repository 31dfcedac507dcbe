"""Where edgespec keeps what it measures and downloads: one cache directory
($EDGESPEC_CACHE_DIR, else $XDG_CACHE_HOME/edgespec, else ~/.cache/edgespec),
shared by the calibration, the model zoo and the bench's peer builds; and
where the repository's benchmark data is, when edgespec runs from a clone."""
from __future__ import annotations

import os


def cache_dir() -> str:
    d = os.environ.get("EDGESPEC_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "edgespec")
    return d


def source_data(*parts: str) -> str | None:
    """The path `parts` under the repository's benchmarks/ folder (results/,
    prompts/, sessions/) when this package was imported from a source tree (a
    clone, an editable install, PYTHONPATH), whatever the working directory;
    None otherwise: a wheel carries no benchmark data (the data is not code)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks", *parts)
    if os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.exists(path):
        return path
    return None
