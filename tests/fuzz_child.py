"""The child process of tests/test_fuzz.py: damaged files through edgespec,
where a llama.cpp abort or a numba kernel reading out of bounds would kill
the process instead of the test run.

Reads one job (JSON) from stdin:
    {"target": NAME, "base": file, "work": file, "mem_cap": bytes, "args": {...},
     "cases": [{"truncate": n} | {"patch": [[offset, hex bytes], ...]}, ...]}
`work` starts as a copy of `base`; each case damages it in place, runs the
target on it and restores it.  For each case it prints {"i": i} before the
target runs and then one result line: {"i", "ok": what it did} or {"i",
"error", "type"} for an EdgespecError (the CLI prints those as one line), or
{"i", "unexpected": traceback} for anything else.
The address space is capped at mem_cap (RLIMIT_AS), so a huge allocation
fails here instead of taking the machine's memory.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import traceback


def _damage(work: str, base: str, case: dict):
    """Apply a case to `work`; return the function that undoes it."""
    if "truncate" in case:
        n = int(case["truncate"])
        os.truncate(work, n)

        def undo():
            with open(base, "rb") as src, open(work, "r+b") as dst:
                src.seek(n)
                dst.seek(n)
                shutil.copyfileobj(src, dst)
        return undo
    saved = []
    with open(work, "r+b") as f:
        for off, hexbytes in case["patch"]:
            new = bytes.fromhex(hexbytes)
            f.seek(off)
            saved.append((off, f.read(len(new))))
            f.seek(off)
            f.write(new)

    def undo():
        with open(work, "r+b") as f:
            for off, old in reversed(saved):
                f.seek(off)
                f.write(old)
    return undo


def target_model(path: str, args: dict) -> str:
    """Load the (damaged) GGUF as SpecModel does and generate a few tokens."""
    from edgespec import SpecModel

    with SpecModel(path, n_ctx=256, calibrate=False, drafter="suffix", n_threads=1) as m:
        r = m.generate("Name a colour.", max_tokens=4)
    return f"{r.n_generated} tokens"


def target_build_corpus(path: str, args: dict) -> str:
    """Build a corpus with the (damaged) GGUF's tokenizer (a vocab-only load):
    on an error, nothing may be left in the output directory."""
    from edgespec.corpus.build import build_corpus

    out_dir = args["out_dir"]
    try:
        c = build_corpus([args["text"]], path, os.path.join(out_dir, "c.corpus"), progress=False)
    except BaseException:
        left = os.listdir(out_dir)
        if left:
            raise AssertionError(f"a failed build left {left} behind") from None
        raise
    os.unlink(os.path.join(out_dir, "c.corpus"))
    return f"{c.n_tokens} tokens"


def target_corpus(path: str, args: dict) -> str:
    """Load the (damaged) corpus for the model and generate with every drafter
    that reads it, cost gate off (every drafted node verified)."""
    from edgespec.corpus.format import Corpus
    from edgespec.drafters import make_drafter
    from edgespec.core.config import EngineConfig
    from edgespec.core.engine import Engine, drain
    from edgespec.core.params import Request

    m = _model(args["model"])
    c = Corpus.load(path, vocab=m.vocab)
    out = []
    for name in ("suffix", "trigram", "adjacency", "auto"):
        d = make_drafter(name, n_vocab=m.vocab.n_vocab, corpora=[c], model_path=m.model_path)
        eng = Engine(m.backend, d, None, EngineConfig(max_nodes=32, cost_gate=False))
        r = drain(eng.run(eng.resolve(Request(m.prompt_tokens(args["prompt"]), max_tokens=args.get("max_tokens", 8),
                                  reuse_prefix=False))))
        out.append(f"{name} {r.n_generated}")
    return ", ".join(out)


_MODELS: dict = {}


def _model(path: str):
    if path not in _MODELS:
        from edgespec import SpecModel
        # one thread: on a busy machine two spinning decode threads can take
        # seconds a step, and the thread count changes nothing checked here
        _MODELS[path] = SpecModel(path, n_ctx=512, calibrate=False, drafter="none", n_threads=1)
    return _MODELS[path]


TARGETS = {"model": target_model, "build_corpus": target_build_corpus, "corpus": target_corpus}


def main() -> None:
    job = json.load(sys.stdin)
    if job.get("mem_cap"):
        resource.setrlimit(resource.RLIMIT_AS, (job["mem_cap"], job["mem_cap"]))
    from edgespec.errors import EdgespecError

    clear = EdgespecError        # what edgespec's CLI turns into one "Error:" line
    target, base, work = TARGETS[job["target"]], job["base"], job["work"]
    shutil.copyfile(base, work)
    for i, case in enumerate(job["cases"]):
        print(json.dumps({"i": i}), flush=True)
        undo = _damage(work, base, case)
        try:
            res = {"i": i, "ok": target(work, job.get("args", {}))}
        except clear as e:
            res = {"i": i, "error": str(e), "type": type(e).__name__}
        except BaseException:
            res = {"i": i, "unexpected": traceback.format_exc()}
        finally:
            undo()
        print(json.dumps(res), flush=True)
    with open("/proc/self/status") as f:
        peak = [ln.split()[1] for ln in f if ln.startswith("VmPeak")]
    print(json.dumps({"vm_peak_kb": int(peak[0]) if peak else None}), flush=True)


if __name__ == "__main__":
    main()
