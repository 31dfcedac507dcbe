"""Preset corpora for `edgespec build-corpus --preset NAME`.

The recipes are data files in the repository's corpora/ folder:

* stdlib (corpora/stdlib.json): the .py files of this interpreter's standard
  library (sysconfig's stdlib path) without site-packages, test suites, IDLE
  and caches, in sorted relative-path order, capped at max_bytes (20 MB; a file
  that would pass the cap is skipped, so the choice is deterministic).
* chat (corpora/chat.json, corpora/chat_instructions.txt): self-distillation.
  The model answers each instruction (greedy, chat template, max_tokens), and
  each conversation, rendered with the chat template, becomes a document, so
  the corpus holds what this model itself tends to write.  The answers are
  cached as JSON lines in `<output>.answers.jsonl` (keyed by model file,
  max_tokens and instruction): a re-run generates only what is missing.
"""
from __future__ import annotations

import json
import os
import sysconfig
import time

from .corpus import CorpusError, Source, _bar

PRESETS = ("stdlib", "chat")
CORPORA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "corpora")


def recipe(name: str) -> dict:
    """The recipe corpora/NAME.json."""
    if name not in PRESETS:
        raise CorpusError(f"unknown preset {name!r} (presets: {', '.join(PRESETS)})")
    path = os.path.join(CORPORA_DIR, name + ".json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CorpusError(f"preset {name}: recipe {path} not found (the corpora/ folder of the "
                          "edgespec checkout is needed)") from None


# ---------------------------------------------------------------- stdlib
def stdlib_files(limit: int | None = None, rec: dict | None = None) -> list[str]:
    """The standard-library files of the stdlib recipe, in order (at most `limit`)."""
    rec = rec or recipe("stdlib")
    root = sysconfig.get_paths()["stdlib"]
    skip = set(rec["exclude_dirs"])
    suffixes = tuple(rec["suffixes"])
    cap = int(rec["max_bytes"])
    files, total = [], 0
    for r, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith("."))
        for fn in sorted(names):
            if not fn.endswith(suffixes):
                continue
            p = os.path.join(r, fn)
            size = os.path.getsize(p)
            if total + size > cap:
                continue
            files.append(p)
            total += size
            if limit is not None and len(files) >= limit:
                return files
    if not files:
        raise CorpusError(f"preset stdlib: no .py files found under {root}")
    return files


# ------------------------------------------------------------------ chat
def chat_instructions(rec: dict | None = None) -> list[str]:
    """The instructions, one per line (blank lines and # comments skipped; a
    literal \\n inside a line is a line break)."""
    rec = rec or recipe("chat")
    path = os.path.join(CORPORA_DIR, rec["instructions"])
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(line.replace("\\n", "\n"))
    return out


def _model_id(model_path: str) -> str:
    return f"{os.path.basename(model_path)}:{os.path.getsize(model_path)}"


def answers_path(out_path: str) -> str:
    return os.fspath(out_path) + ".answers.jsonl"


def _read_cache(path: str) -> dict:
    cache = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                    cache[(r["model"], r["max_tokens"], r["instruction"])] = r["answer"]
                except (ValueError, KeyError, TypeError):
                    continue   # a line cut short by an interrupted run: generated again
    return cache


def chat_records(model_path: str, out_path: str, limit: int | None = None, max_tokens: int | None = None,
                 progress=True) -> list[dict]:
    """One {"messages": [user, assistant]} record per instruction: the model's
    greedy answer, from the cache or generated now (and appended to the cache)."""
    rec = recipe("chat")
    instructions = chat_instructions(rec)[:limit]
    max_tokens = int(max_tokens or rec["max_tokens"])
    cpath = answers_path(out_path)
    cache = _read_cache(cpath)
    mid = _model_id(model_path)
    todo = [s for s in instructions if (mid, max_tokens, s) not in cache]
    if todo:
        from .api import SpecModel
        model = SpecModel(model_path, drafter="suffix", n_ctx=int(rec.get("n_ctx", 2048)))
        t0, n_gen = time.perf_counter(), 0
        try:
            with open(cpath, "a", encoding="utf-8") as f, \
                    _bar(progress, total=len(todo), desc="generating answers", unit="instr") as bar:
                for s in todo:
                    r = model.generate(s, max_tokens=max_tokens)
                    cache[(mid, max_tokens, s)] = r.text
                    f.write(json.dumps({"model": mid, "max_tokens": max_tokens, "instruction": s,
                                        "answer": r.text, "n_tokens": r.n_generated,
                                        "stop_reason": r.stop_reason}, ensure_ascii=False) + "\n")
                    f.flush()
                    n_gen += r.n_generated
                    bar.update(1)
                    bar.set_postfix_str(f"{n_gen / max(time.perf_counter() - t0, 1e-9):.0f} tok/s", refresh=False)
        finally:
            model.close()
    return [{"messages": [{"role": "user", "content": s},
                          {"role": "assistant", "content": cache[(mid, max_tokens, s)]}]}
            for s in instructions]


# ------------------------------------------------------------------ entry
def preset_sources(name: str, model_path: str, out_path: str, limit: int | None = None,
                   max_tokens: int | None = None, progress=True) -> list[Source]:
    """The build sources of a preset (see the module docstring)."""
    recipe(name)
    if name == "stdlib":
        return [Source(name=p, kind="text", path=p, size=os.path.getsize(p)) for p in stdlib_files(limit)]
    records = chat_records(model_path, out_path, limit=limit, max_tokens=max_tokens, progress=progress)
    size = sum(len(json.dumps(r, ensure_ascii=False).encode("utf-8")) for r in records)
    return [Source(name="preset:chat", kind="records", records=records, size=size)]
