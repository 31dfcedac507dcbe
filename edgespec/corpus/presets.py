"""Preset corpora for `edgespec build-corpus --preset NAME`.

The recipes are package data in edgespec/corpus/corpora/ (so a wheel install has them):

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

The caller hands the chat preset a function that loads the model it answers
with (e.g. edgespec.SpecModel): this module does not import the API, so
edgespec.corpus.build uses it without an import cycle.
"""
from __future__ import annotations

import json
import os
import sysconfig
import time
from importlib import resources

from edgespec.errors import CorpusError
from edgespec.progress import progress_bar

PRESETS = ("stdlib", "chat")


class PresetError(CorpusError):
    """An unknown preset, a missing recipe, or a preset that cannot be built here."""


def _data(name: str):
    """A file of the package's corpora/ folder (a Traversable)."""
    return resources.files(__package__).joinpath("corpora", name)


def recipe(name: str) -> dict:
    """The recipe corpora/NAME.json."""
    if name not in PRESETS:
        raise PresetError(f"unknown preset {name!r} (presets: {', '.join(PRESETS)})")
    try:
        return json.loads(_data(name + ".json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PresetError(f"preset {name}: its recipe corpora/{name}.json is missing from the "
                          "edgespec package; reinstall edgespec") from None


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
        raise PresetError(f"preset stdlib: no .py files found under {root}")
    return files


# ------------------------------------------------------------------ chat
def chat_instructions(rec: dict | None = None) -> list[str]:
    """The instructions, one per line (blank lines and # comments skipped; a
    literal \\n inside a line is a line break)."""
    rec = rec or recipe("chat")
    out = []
    for line in _data(rec["instructions"]).read_text(encoding="utf-8").splitlines():
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
                except (ValueError, KeyError, TypeError, RecursionError):
                    continue   # a line cut short by an interrupted run: generated again
    return cache


def chat_records(model_path: str, out_path: str, load_model, limit: int | None = None,
                 max_tokens: int | None = None, progress=True) -> list[dict]:
    """One {"messages": [user, assistant]} record per instruction: the model's
    greedy answer, from the cache or generated now (and appended to the cache).

    load_model(model_path, n_ctx=N) returns a model with generate(text,
    max_tokens=) (a result with text, n_generated, stop_reason) and close(),
    e.g. edgespec.SpecModel; it is called only when an answer is missing."""
    rec = recipe("chat")
    instructions = chat_instructions(rec)[:limit]
    max_tokens = int(max_tokens or rec["max_tokens"])
    cpath = answers_path(out_path)
    cache = _read_cache(cpath)
    mid = _model_id(model_path)
    todo = [s for s in instructions if (mid, max_tokens, s) not in cache]
    if todo:
        if load_model is None:
            raise PresetError("preset chat: the model answers its instructions; pass load_model "
                              "(e.g. edgespec.SpecModel) to build it")
        _generate(load_model(model_path, n_ctx=int(rec.get("n_ctx", 2048))), todo, cache, cpath,
                  (mid, max_tokens), progress)
    return [{"messages": [{"role": "user", "content": s},
                          {"role": "assistant", "content": cache[(mid, max_tokens, s)]}]}
            for s in instructions]


def _generate(model, todo: list[str], cache: dict, cpath: str, key: tuple, progress) -> None:
    """Answer `todo` with `model` (closed at the end), appending each answer to
    the cache file as soon as it is known."""
    mid, max_tokens = key
    t0, n_gen = time.perf_counter(), 0
    try:
        with open(cpath, "a", encoding="utf-8") as f, \
                progress_bar(progress, total=len(todo), desc="generating answers", unit="instr") as b:
            for s in todo:
                r = model.generate(s, max_tokens=max_tokens)
                cache[(mid, max_tokens, s)] = r.text
                f.write(json.dumps({"model": mid, "max_tokens": max_tokens, "instruction": s,
                                    "answer": r.text, "n_tokens": r.n_generated,
                                    "stop_reason": r.stop_reason}, ensure_ascii=False) + "\n")
                f.flush()
                n_gen += r.n_generated
                b.update(1)
                b.set_postfix_str(f"{n_gen / max(time.perf_counter() - t0, 1e-9):.0f} tok/s", refresh=False)
    finally:
        model.close()


# ------------------------------------------------------------------ entry
def preset_inputs(name: str, model_path: str, out_path: str, load_model=None, limit: int | None = None,
                  max_tokens: int | None = None, progress=True) -> tuple[str, list]:
    """What a preset contributes to a build (see the module docstring):
    ("files", paths) for stdlib, ("records", chat records) for chat."""
    recipe(name)
    if name == "stdlib":
        return "files", stdlib_files(limit)
    return "records", chat_records(model_path, out_path, load_model, limit=limit, max_tokens=max_tokens,
                                    progress=progress)
