"""What verification costs on this machine, and how likely a draft is accepted.

CostCurve: the measured time of one llama_decode of T tokens (logits at all of
them) relative to T = 1, for the loaded model and settings on this machine.  It
is measured once (`calibrate`), cached on disk under a key made of the model
file, the settings and the machine, and re-measured by `edgespec calibrate`.

AcceptanceModel: per session, what fraction of verified draft nodes of each
source, drafter-score bucket and depth were accepted.  Its estimates start from
the drafter's own score and move to the observed rate as evidence comes in.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from .tree import N_SOURCES, SOURCE_NAMES

CALIBRATION_VERSION = 2
DEFAULT_TS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)


def cache_dir() -> str:
    d = os.environ.get("EDGESPEC_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "edgespec")
    return d


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_key(model_path: str, n_gpu_layers: int, n_threads: int, extra: str = "") -> str:
    st = os.stat(model_path)
    import llama_cpp
    parts = [os.path.realpath(model_path), str(st.st_size), str(st.st_mtime_ns),
             f"ngl={n_gpu_layers}", f"threads={n_threads}", platform.machine(), _cpu_name(),
             str(os.cpu_count()), llama_cpp.__version__, f"v{CALIBRATION_VERSION}", extra]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


@dataclass
class CostCurve:
    """ts: the measured batch sizes (ascending, starting at 1); rel: time(T)/time(1);
    t1_s: seconds of one single-token decode past the first 256 KV cells;
    t1_short_s: the same within the first 256 cells, where the exact backend
    still decodes single tokens with every thread (see backend/llama.py)."""
    ts: list
    rel: list
    t1_s: float
    meta: dict = field(default_factory=dict)
    t1_short_s: float = 0.0

    def table(self, max_t: int, short: bool = False) -> np.ndarray:
        """cost[T] for T = 0..max_t (cost[0] = 0), linear between measured points and
        extrapolated from the last two beyond them."""
        ts = np.asarray(self.ts, np.float64)
        rel = np.asarray(self.rel, np.float64)
        T = np.arange(max_t + 1, dtype=np.float64)
        out = np.interp(T, ts, rel)
        if len(ts) >= 2 and max_t > ts[-1]:
            slope = (rel[-1] - rel[-2]) / (ts[-1] - ts[-2])
            hi = T > ts[-1]
            out[hi] = rel[-1] + slope * (T[hi] - ts[-1])
        out[0] = 0.0
        if short and self.t1_short_s > 0:
            out[1] = min(1.0, self.t1_short_s / self.t1_s)
        return out

    def to_json(self) -> dict:
        return {"ts": list(map(int, self.ts)), "rel": [round(float(r), 4) for r in self.rel],
                "t1_s": self.t1_s, "t1_short_s": self.t1_short_s, "meta": self.meta}

    @staticmethod
    def from_json(d: dict) -> "CostCurve":
        c = CostCurve(list(d["ts"]), list(d["rel"]), float(d["t1_s"]), dict(d.get("meta", {})),
                      float(d.get("t1_short_s", 0.0)))
        if not c.ts or c.ts[0] != 1 or len(c.ts) != len(c.rel) or any(r <= 0 for r in c.rel):
            raise ValueError("malformed cost curve")
        return c

    def describe(self) -> str:
        cells = "  ".join(f"T={t}:{r:.2f}" for t, r in zip(self.ts, self.rel))
        short = f"; one token within the first 256 cells: {self.t1_short_s * 1000:.2f} ms" if self.t1_short_s else ""
        return f"c(T) relative to one token ({self.t1_s * 1000:.2f} ms{short}): {cells}"


def measure_cost_curve(backend, ts=DEFAULT_TS, prefix: int = 300, reps: int = 5,
                       progress=None) -> CostCurve:
    """Time decodes of T tokens (chains, logits at every token) after a prefix of
    `prefix` tokens; the median of `reps` repetitions per T, interleaved so that
    machine noise spreads over all sizes."""
    prefix = max(1, min(prefix, backend.n_ctx - max(ts) - 2, backend.n_ctx // 2))
    ts = [t for t in ts if t <= backend.max_nodes and backend.n_ctx > prefix + t + 1]
    rng = np.random.default_rng(0)
    backend.reset()
    pre = rng.integers(100, min(backend.n_vocab, 20000), size=prefix).astype(np.int32)
    backend.prefill(pre, want_last_logits=False)
    times = {t: [] for t in ts}
    one = np.ones(max(ts), np.int32)
    zeros = np.zeros(max(ts), np.int32)
    for r in range(reps + 1):  # first round is a warm-up
        for t in ts:
            toks = rng.integers(100, min(backend.n_vocab, 20000), size=t).astype(np.int32)
            t0 = time.perf_counter()
            backend.decode_tree(toks, np.arange(t, dtype=np.int32), zeros[:t], one[:t], 1)
            backend.logits()
            dt = time.perf_counter() - t0
            backend.keep(0)
            if r:
                times[t].append(dt)
        if progress:
            progress(r, reps)
    # single tokens within the first 256 cells
    backend.reset()
    backend.prefill(pre[:min(100, prefix)], want_last_logits=False)
    short = []
    for r in range(3 * reps + 1):
        t0 = time.perf_counter()
        backend.decode_tree(one[:1] * 500, zeros[:1], zeros[:1], one[:1], 1)
        backend.logits()
        dt = time.perf_counter() - t0
        backend.keep(0)
        if r:
            short.append(dt)
    backend.reset()
    med = {t: float(np.median(v)) for t, v in times.items()}
    t1 = med[1]
    rel = [max(med[t] / t1, 1e-3) for t in ts]
    # a cost curve must not fall with T (noise can make it): enforce monotone
    for i in range(1, len(rel)):
        rel[i] = max(rel[i], rel[i - 1])
    rel[0] = 1.0
    return CostCurve(ts, rel, t1, {"prefix": prefix, "reps": reps, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")},
                     float(np.median(short)))


def load_or_measure(backend, key: str, remeasure: bool = False, progress=None) -> CostCurve:
    path = os.path.join(cache_dir(), "calibration", key + ".json")
    if not remeasure:
        try:
            with open(path) as f:
                return CostCurve.from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    curve = measure_cost_curve(backend, progress=progress)
    curve.meta["cache_file"] = path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(curve.to_json(), f)
    os.replace(tmp, path)
    return curve


N_SCORE_BUCKETS = 10
N_DEPTH_BUCKETS = 4


class AcceptanceModel:
    """Online estimate of P(draft node accepted | parent accepted).

    Two levels of counts: coarse (source, score bucket) and fine (source, score
    bucket, depth bucket).  The estimate backs off from fine to coarse to the
    drafter's own score:  coarse = (acc + K0 * score) / (n + K0), and
    fine = (acc + K1 * coarse) / (n + K1).  The arithmetic runs in
    kernels/tree.py (plan_step predicts, learn_step counts); this class owns the
    counts and reports predicted against observed acceptance.
    """

    K0 = 4.0
    K1 = 8.0

    def __init__(self):
        shape = (N_SOURCES, N_SCORE_BUCKETS)
        self.n_c = np.zeros(shape)
        self.a_c = np.zeros(shape)
        self.n_f = np.zeros(shape + (N_DEPTH_BUCKETS,))
        self.a_f = np.zeros(shape + (N_DEPTH_BUCKETS,))
        # calibration report: predicted vs observed per bucket
        self.pred_sum = np.zeros(shape)

    def report(self) -> list[dict]:
        """Rows of (source, score bucket, tested nodes, predicted and observed acceptance)."""
        rows = []
        for s in range(N_SOURCES):
            for b in range(N_SCORE_BUCKETS):
                n = self.n_c[s, b]
                if n > 0:
                    rows.append({"source": SOURCE_NAMES[s], "score": f"{b / N_SCORE_BUCKETS:.1f}-{(b + 1) / N_SCORE_BUCKETS:.1f}",
                                 "tested": int(n), "predicted": round(float(self.pred_sum[s, b] / n), 3),
                                 "observed": round(float(self.a_c[s, b] / n), 3)})
        return rows
