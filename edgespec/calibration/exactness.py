"""The exactness self-check: whether a verification batch of T tokens gives
logits bit-identical to decoding the same tokens one at a time, on this
model, these settings and this machine.  Greedy output is token-identical to
plain decoding only where it holds, so SpecModel runs it at calibration and
reports its verdict; the verdict is cached beside the cost curve, under the
same key and lock.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from edgespec.calibration.cache import cache_dir, cache_lock, curve_path, read_cached, write_cache
from edgespec.calibration.curve import PACED_CHUNK, no_pause, paced, prefill, retried

EXACTNESS_VERSION = 1
EXACT_CONTEXTS = (100, 600)   # KV cells before the checked tokens: short, and past 512 (split-KV)


@dataclass
class ExactnessReport:
    """Whether a verification batch of T tokens gives the same logits, bit for
    bit, as decoding those tokens one at a time, for every T in 2..max_t,
    after each of `contexts` KV cells.

    exact: every row of every batch equal.  max_abs_diff: the largest
    |logit difference| seen.  failed: the batch sizes that differed somewhere.
    argmax_flips: rows (over all T and contexts) whose argmax differed.
    per_context: {cells: {"failed": [...], "max_abs_diff": x}}."""
    exact: bool
    max_t: int
    contexts: list
    max_abs_diff: float = 0.0
    failed: list = field(default_factory=list)
    argmax_flips: int = 0
    per_context: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    origin: str = field(default="measured", compare=False)     # or "cached"; never written

    def to_json(self) -> dict:
        return {"version": EXACTNESS_VERSION, "exact": self.exact, "max_t": self.max_t,
                "contexts": list(self.contexts), "max_abs_diff": self.max_abs_diff, "failed": list(self.failed),
                "argmax_flips": self.argmax_flips, "per_context": self.per_context, "meta": self.meta}

    @staticmethod
    def from_json(d: dict) -> "ExactnessReport":
        if d.get("version") != EXACTNESS_VERSION:
            raise ValueError("old exactness check")
        if not math.isfinite(float(d["max_abs_diff"])) or not d["contexts"]:
            raise ValueError("exactness check with a value that is not a finite number")
        return ExactnessReport(bool(d["exact"]), int(d["max_t"]), list(d["contexts"]), float(d["max_abs_diff"]),
                               [int(t) for t in d["failed"]], int(d.get("argmax_flips", 0)),
                               dict(d.get("per_context", {})), dict(d.get("meta", {})), origin="cached")

    def describe(self) -> str:
        if self.exact:
            return (f"exact: batches of 2..{self.max_t} tokens give logits bit-identical to one-token decoding "
                    f"(checked after {' and '.join(map(str, self.contexts))} KV cells)")
        ts = batch_ranges(self.failed)
        return (f"NOT exact: batches of {ts} tokens give logits that differ from one-token decoding by up to "
                f"{self.max_abs_diff:.3g} ({self.argmax_flips} argmax flips; checked 2..{self.max_t} after "
                f"{' and '.join(map(str, self.contexts))} KV cells)")


def batch_ranges(ts) -> str:
    """[2, 3, 4, 9] -> '2-4, 9'."""
    out, ts = [], sorted(ts)
    i = 0
    while i < len(ts):
        j = i
        while j + 1 < len(ts) and ts[j + 1] == ts[j] + 1:
            j += 1
        out.append(str(ts[i]) if i == j else f"{ts[i]}-{ts[j]}")
        i = j + 1
    return ", ".join(out)


def _exact_contexts(backend, max_t: int, contexts=EXACT_CONTEXTS) -> list[int]:
    """The contexts a check uses on this backend: capped to fit n_ctx."""
    return sorted({max(1, min(c, backend.n_ctx - max_t - 1)) for c in contexts})


def check_exactness(backend, max_t: int | None = None, contexts=EXACT_CONTEXTS, seed: int = 0,
                    progress=None, ts=None, pause=None) -> ExactnessReport:
    """Decode max_t tokens one at a time after each context, keeping every
    row of logits, then the same tokens as one chain batch of every size
    T = 2..max_t at the same positions (the batch fills the same KV cells the
    one-token decodes used), and compare the rows bit for bit.  The decodes go
    through backend.decode_tree, so they use the thread settings generation
    uses.  Contexts that do not fit n_ctx are capped.  ts: only these batch
    sizes (a quicker survey; the default is every size).  progress(done, total).
    pause: as in the cost curve's measurement (curve.measure_at); when a
    request used the backend, the context and its one-token rows are computed
    again before the next batch."""
    max_t = min(max_t or backend.max_nodes, backend.max_nodes, backend.n_ctx - 2)
    ts = sorted(t for t in (ts or range(2, max_t + 1)) if 2 <= t <= max_t)
    rng = np.random.default_rng(seed)
    hi = min(backend.n_vocab, 20000)
    ctxs = _exact_contexts(backend, max_t, contexts)
    rep = ExactnessReport(True, max_t, ctxs)
    total, done = len(ctxs) * len(ts), 0
    zeros, ones = np.zeros(max_t, np.int32), np.ones(max_t, np.int32)
    chunk = PACED_CHUNK if pause else max(ctxs)
    pause = pause or no_pause
    for n_kv in ctxs:
        pre = rng.integers(100, hi, size=n_kv).astype(np.int32)
        toks = rng.integers(100, hi, size=max_t).astype(np.int32)
        pause()

        def relay():
            return retried(lambda: _one_token_rows(backend, pre, toks, pause, chunk), pause, lambda: None)

        def batch(t):
            backend.decode_tree(toks[:t], np.arange(t, dtype=np.int32), zeros[:t], ones[:t], 1)
            return backend.logits()
        ref = relay()
        failed, worst = [], 0.0
        for t in ts:
            if pause():
                ref = relay()
            lg = retried(lambda: batch(t), pause, relay)
            if not np.array_equal(lg, ref[:t]):
                d = float(np.max(np.abs(lg.astype(np.float64) - ref[:t])))
                failed.append(t)
                # NaN or infinite logits: the largest finite float32 (a cache holds finite numbers)
                worst = max(worst, d if math.isfinite(d) else float(np.finfo(np.float32).max))
                rep.argmax_flips += int(np.sum(lg.argmax(axis=1) != ref[:t].argmax(axis=1)))
            backend.keep(0)
            done += 1
            if progress:
                progress(done, total)
        rep.per_context[str(n_kv)] = {"failed": failed, "max_abs_diff": worst}
        rep.failed = sorted(set(rep.failed) | set(failed))
        rep.max_abs_diff = max(rep.max_abs_diff, worst)
    backend.reset()
    rep.exact = not rep.failed
    rep.meta = {"checked_at": time.strftime("%Y-%m-%d %H:%M:%S"), "cache_type_k": backend.cache_type_k,
                "n_threads": backend.n_threads}
    return rep


def _one_token_rows(backend, pre, toks, pause, chunk: int) -> np.ndarray:
    """Lay down the context pre, decode toks one at a time after it keeping
    every row of logits, and forget them again (the KV cache holds pre)."""
    prefill(backend, pre, pause, chunk)
    n_kv = backend.n_past
    zeros, ones = np.zeros(1, np.int32), np.ones(1, np.int32)
    ref = np.empty((len(toks), backend.n_vocab), np.float32)
    for i in range(len(toks)):
        backend.decode_tree(toks[i:i + 1], zeros, zeros, ones, 1)
        ref[i] = backend.logits()[0]
        backend.keep(1)
    backend.truncate(n_kv)
    return ref


def load_or_check_exactness(backend, key: str, recheck: bool = False, progress=None,
                            cached_only: bool = False, pacer=None) -> ExactnessReport | None:
    """The cached exactness verdict under `key` (beside the cost curve of the
    same key), unless missing, malformed or checked for smaller batches than
    backend.max_nodes; then check and cache it (cached_only: return None),
    under the key's file lock as load_or_measure."""
    path = os.path.join(cache_dir(), "calibration", key + ".exact.json")
    if not recheck and (r := _cached_exactness(backend, path, warn=True)) is not None:
        return r
    if cached_only:
        return None
    with cache_lock(curve_path(key), pacer):
        if not recheck and (r := _cached_exactness(backend, path, warn=False)) is not None:
            return r
        r = check_exactness(backend, progress=progress, **paced(pacer))
        write_cache(path, r.to_json())
    return r


def _cached_exactness(backend, path: str, warn: bool) -> ExactnessReport | None:
    r = read_cached(path, ExactnessReport.from_json, warn)
    want = min(backend.max_nodes, backend.n_ctx - 2)
    if r is not None and r.max_t >= want and r.contexts[-1] >= _exact_contexts(backend, want)[-1]:
        return r
    return None
