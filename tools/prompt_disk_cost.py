"""What the prompt cache's disk tier costs, against the prefill it saves.

    python tools/prompt_disk_cost.py [MODEL] [--tokens 512,2048] [--repeat 5]

For each prompt length, with exact kernels and the default K cache, on a
prompt of real text (the Spec-Bench prompts in tests/data, as token ids):
  prefill   the whole prompt from an empty cache (what a restart pays without the tier)
  copy      the end of request's save_state() (on the request's path: the model is held)
  write     the writer thread's file (behind the request: encode, CRC-32, write, rename)
  restore   lookup, read with CRC check and llama.cpp's restore, from the page
            cache (warm) and after the file is dropped from it (cold: posix_fadvise)
Each as wall ms and the process's CPU ms (every thread's; the restores the
median of --repeat), and per 1,000 tokens; the file's bytes per token.  The
prompt cache's rule (PromptDisk.worth_loading) restores a file when its
read costs less than the prefill it saves: the last column is that ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("EDGESPEC_KERNELS", "exact")

from edgespec import SpecModel  # noqa: E402
from edgespec.core.prompt_disk import read_state  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                    "spec_bench_prompts.jsonl")


def timed(fn):
    """(result, wall s, CPU s of the whole process) of fn()."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def text_tokens(m: SpecModel, n: int) -> np.ndarray:
    """n tokens of real prompts, one after another."""
    with open(DATA, encoding="utf-8") as f:
        text = "\n\n".join(t for line in f if line.strip() for t in json.loads(line)["turns"])
    toks = m.tokenize(text)
    assert len(toks) >= n, f"the prompts hold {len(toks)} tokens, fewer than {n}"
    return toks[:n]


def drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def prefill_and_write(m: SpecModel, toks: np.ndarray) -> dict:
    """Prefill the whole prompt from an empty cache; the end of request copies the cells, the writer writes them."""
    pc = m.prefix_cache
    for name in os.listdir(pc.disk.folder):
        os.unlink(os.path.join(pc.disk.folder, name))
    pc.disk.refresh()
    r, _, pre_cpu = timed(lambda: m.generate(toks, max_tokens=1, reuse_prefix=False))
    _, write_w, write_c = timed(pc.disk.flush)
    _, copy_w, copy_c = timed(m.backend.save_state)      # the copy the end of the request made (pc.copy_s)
    return {"prefill": (r.prefill_s, pre_cpu), "copy": (copy_w, copy_c), "write": (write_w, write_c)}


def restore(m: SpecModel, toks: np.ndarray, cold: bool) -> tuple[float, float, int, int]:
    """(wall s, CPU s, tokens, file bytes) of a restore of the prompt's file into an empty cache."""
    pc, be = m.prefix_cache, m.backend
    e, n = pc.disk.lookup(toks, len(toks))
    assert e is not None and n == len(e.tokens)
    if cold:
        drop_from_page_cache(e.path)
    be.reset()

    def run():
        e2, _ = pc.disk.lookup(toks, len(toks))
        be.restore_state(read_state(e2), e2.tokens)
    _, w, c = timed(run)
    assert be.n_past == n
    return w, c, n, e.file_bytes


def report(m: SpecModel, n: int, repeat: int) -> tuple[str, dict]:
    toks = text_tokens(m, n)
    got = prefill_and_write(m, toks)
    for cold in (False, True):
        runs = [restore(m, toks, cold) for _ in range(repeat)]
        got["cold" if cold else "warm"] = tuple(statistics.median(r[i] for r in runs) for i in (0, 1))
    n, nbytes = runs[0][2], runs[0][3]
    k = 1000 / n
    ms = {name: (w * 1e3, c * 1e3) for name, (w, c) in got.items()}
    row = {"tokens": n, "file_bytes": nbytes, **{f"{name}_ms": round(w, 2) for name, (w, _) in ms.items()},
           **{f"{name}_cpu_ms": round(c, 2) for name, (_, c) in ms.items()},
           "restore_cold_ms_per_1k": round(ms["cold"][0] * k, 2), "restore_warm_ms_per_1k": round(ms["warm"][0] * k, 2)}
    return (f"  {n:5d} tokens, {nbytes / n:,.0f} B/token: "
            + ", ".join(f"{name} {w:.1f}/{c:.1f}" for name, (w, c) in ms.items())
            + f"; per 1,000 tokens: restore {ms['warm'][0] * k:.1f} warm, {ms['cold'][0] * k:.1f} cold, "
              f"prefill {ms['prefill'][0] * k:.0f}; prefill / cold restore = {ms['prefill'][0] / ms['cold'][0]:.0f}x"), row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--repeat", type=int, default=5, help="restores per length (the prefill runs once)")
    ap.add_argument("--out", help="append one JSON line per length here (model, machine, date and the figures)")
    a = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="edgespec-prompt-disk-")
    try:
        with SpecModel(a.model, drafter="none", n_ctx=4096, calibrate=False, prompt_cache_disk_mib=0) as m:
            m.use_prompt_cache(0, 4096, folder)
            print(f"{os.path.basename(m.model_path)}: K cache {m.backend.cache_type_k}, {m.backend.n_threads} "
                  f"threads; wall ms / CPU ms (restores: median of {a.repeat})", flush=True)
            for n in (int(x) for x in a.tokens.split(",")):
                text, row = report(m, n, a.repeat)
                print(text, flush=True)
                if a.out:
                    import datetime

                    from edgespec.calibration.cache import cpu_name
                    row = {"model": os.path.basename(m.model_path), "cache_type_k": m.backend.cache_type_k,
                           "threads": m.backend.n_threads, "cpu": cpu_name(),
                           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), **row}
                    with open(a.out, "a", encoding="utf-8") as f:
                        f.write(json.dumps(row) + "\n")
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


if __name__ == "__main__":
    main()
