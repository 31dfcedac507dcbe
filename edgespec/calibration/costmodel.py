"""What verification costs on this machine, and how likely a draft is accepted.

CostCurve: the measured time of one llama_decode of T tokens (logits at all of
them) relative to T = 1, for the loaded model and settings on this machine, at
a few context lengths (attention over a longer context makes a batch dearer
relative to one token: on the 2-core machine c(8) is 2.7 after 300 cells and
3.7 after 2000).  It is measured once (`calibrate`), cached on disk under a key
made of the model file's content, the settings and the machine, and re-measured by
`edgespec calibrate`.

AcceptanceModel: per session, what fraction of verified draft nodes of each
source, drafter-score bucket and depth were accepted.  Its estimates start from
the drafter's own score and move to the observed rate as evidence comes in.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace

import numpy as np

from edgespec.kernels.tree import N_SCORE_BUCKETS, SCORE_EDGES
from edgespec.core.tree import N_SOURCES, SOURCE_NAMES

CALIBRATION_VERSION = 5
DEFAULT_TS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 48, 64)
DEFAULT_PREFIXES = (300, 1000, 2000)
SHORT_PREFIX = 100      # the short regime (<= 256 cells) is measured after 100 cells
PACED_CHUNK = 64        # prompt tokens per slice when a measurement runs between requests
log = logging.getLogger("edgespec.calibration")


class CalibrationCacheWarning(UserWarning):
    """The calibration cache could not be read or written: the measurement is
    used (or redone) in this process only."""


class CalibrationStopped(Exception):
    """A background measurement was stopped (the model is closing, or a
    synchronous calibration takes over)."""


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


def model_fingerprint(model_path: str, span: int = 1 << 20) -> str:
    """The model file by content, not by place: its size and a hash of its
    first and last MiB (the GGUF header with the tensor layout, and the last
    tensor's data).  A copy, a move or a reinstall of the same file keeps its
    calibration; another file (a different quantization or fine-tune) gets
    its own."""
    size = os.path.getsize(model_path)
    h = hashlib.sha256(str(size).encode())
    with open(model_path, "rb") as f:
        h.update(f.read(span))
        f.seek(max(0, size - span))
        h.update(f.read(span))
    return h.hexdigest()[:32]


def calibration_key(model_path: str, n_gpu_layers: int, n_threads: int, extra: str = "") -> str:
    from edgespec.backend.llama import llama_cpp_version

    parts = [model_fingerprint(model_path),
             f"ngl={n_gpu_layers}", f"threads={n_threads}", platform.machine(), _cpu_name(),
             str(os.cpu_count()), llama_cpp_version(), f"v{CALIBRATION_VERSION}", extra]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


@dataclass
class CostCurve:
    """ts: the measured batch sizes (ascending, starting at 1); rel: time(T)/time(1)
    after meta["prefix"] KV cells (the shortest measured context);
    t1_s: seconds of one single-token decode there (past the first 256 KV cells);
    t1_short_s: the same within the first 256 cells, where the exact backend
    decodes single tokens with every thread even with an f16 K cache (see
    backend/llama.py; with the default q8_0 K cache it does so everywhere);
    short_rel: time(T)/t1_short_s there (measured after 100 cells, in the same
    interleaved rounds as its own single tokens; empty in old caches);
    longer: the same measurement after longer contexts, ascending, as dicts
    {"n_kv", "t1_s", "rel", "after_s"};
    after_s / after_short_s / longer[i]["after_s"]: the extra seconds of the
    one-token decode that follows a batch, over one that follows a one-token
    decode (0 in old caches).  The cost tables charge it to the batch: a step
    that verifies a tree makes the next plain step dearer by that much."""
    ts: list
    rel: list
    t1_s: float
    meta: dict = field(default_factory=dict)
    t1_short_s: float = 0.0
    longer: list = field(default_factory=list)
    short_rel: list = field(default_factory=list)
    after_s: float = 0.0
    after_short_s: float = 0.0
    # where this curve came from: "measured" (here, now), "cached" (read from
    # the cache), "built-in" (builtin_curve: a guess); never written to the cache
    origin: str = field(default="measured", compare=False)

    @property
    def builtin(self) -> bool:
        """A built-in guess rather than a measurement: its t1 seconds mean nothing."""
        return self.origin == "built-in"

    def contexts(self) -> list[tuple[int, float, list]]:
        """(KV cells, t1_s, rel) of every measured context, ascending."""
        return [(int(self.meta.get("prefix", 300)), self.t1_s, self.rel)] + \
            [(int(d["n_kv"]), float(d["t1_s"]), d["rel"]) for d in self.longer]

    def _after_rel(self) -> list[float]:
        """after_s of every measured context (ascending) in units of its t1."""
        return [self.after_s / self.t1_s] + [float(d.get("after_s", 0.0)) / float(d["t1_s"]) for d in self.longer]

    def _weights(self, n_kv):
        """Interpolation between the measured contexts: (i, j, w) with the
        estimate (1 - w) * ctx[i] + w * ctx[j]; linear in the number of KV cells
        (attention work grows linearly with it), clamped below the first
        context and extrapolated at most to twice the last one."""
        cs = [c[0] for c in self.contexts()]
        if n_kv is None or len(cs) == 1 or n_kv <= cs[0]:
            return 0, 0, 0.0
        n = min(float(n_kv), 2.0 * cs[-1])
        j = next((k for k in range(1, len(cs)) if n <= cs[k]), len(cs) - 1)
        i = j - 1
        return i, j, (n - cs[i]) / max(1, cs[j] - cs[i])

    def t1_at(self, n_kv: int | None = None) -> float:
        """Seconds of one single-token decode (past 256 cells) with n_kv cells in use."""
        i, j, w = self._weights(n_kv)
        ctx = self.contexts()
        return max(1e-6, (1 - w) * ctx[i][1] + w * ctx[j][1])

    def table(self, max_t: int, short: bool = False, n_kv: int | None = None) -> np.ndarray:
        """cost[T] for T = 0..max_t (cost[0] = 0) in units of one single-token
        decode at the same context, linear between measured points and
        extrapolated from the last two beyond them; with n_kv, interpolated
        between the measured contexts.  Entries T >= 2 include the after-batch
        cost of the one-token decode that follows (after_s)."""
        if short and self.t1_short_s > 0 and self.short_rel:
            # the short regime's own curve, in units of t1_s like every table
            out = self._rel_table(self.short_rel, max_t) * (self.t1_short_s / self.t1_s)
            out[2:] += self.after_short_s / self.t1_s
            out[0] = 0.0
            return out
        i, j, w = self._weights(n_kv)
        ctx = self.contexts()
        after = self._after_rel()
        out = self._rel_table(ctx[i][2], max_t)
        out[2:] += after[i]
        if w:
            hi = self._rel_table(ctx[j][2], max_t)
            hi[2:] += after[j]
            out = (1 - w) * out + w * hi
            out[1:] = np.maximum.accumulate(out[1:])
        out[0] = 0.0
        out[1] = 1.0
        if short and self.t1_short_s > 0:
            out[1] = min(1.0, self.t1_short_s / self.t1_s)
        return out

    def _rel_table(self, rel, max_t: int) -> np.ndarray:
        ts = np.asarray(self.ts, np.float64)
        rel = np.asarray(rel, np.float64)
        T = np.arange(max_t + 1, dtype=np.float64)
        # a step function: a batch of T costs what the smallest measured size
        # >= T costs, since the engine pads a batch to that size (its cost is
        # then a measured one, and the padding drafts ride along for free)
        out = rel[np.minimum(np.searchsorted(ts, T), len(ts) - 1)]
        if len(ts) >= 2 and max_t > ts[-1]:
            slope = (rel[-1] - rel[-2]) / (ts[-1] - ts[-2])
            hi = T > ts[-1]
            out[hi] = rel[-1] + slope * (T[hi] - ts[-1])
        return out

    def to_json(self) -> dict:
        return {"ts": list(map(int, self.ts)), "rel": [round(float(r), 4) for r in self.rel],
                "t1_s": self.t1_s, "t1_short_s": self.t1_short_s, "meta": self.meta,
                "longer": [{"n_kv": int(d["n_kv"]), "t1_s": float(d["t1_s"]),
                            "rel": [round(float(r), 4) for r in d["rel"]],
                            "after_s": float(d.get("after_s", 0.0))} for d in self.longer],
                "short_rel": [round(float(r), 4) for r in self.short_rel],
                "after_s": self.after_s, "after_short_s": self.after_short_s}

    @staticmethod
    def from_json(d: dict) -> "CostCurve":
        c = CostCurve(list(d["ts"]), list(d["rel"]), float(d["t1_s"]), dict(d.get("meta", {})),
                      float(d.get("t1_short_s", 0.0)), list(d.get("longer", [])), list(d.get("short_rel", [])),
                      float(d.get("after_s", 0.0)), float(d.get("after_short_s", 0.0)))
        c.origin = "cached"
        if not c.ts or c.ts[0] != 1:
            raise ValueError("malformed cost curve")
        _check_finite(c)
        if c.short_rel and (len(c.short_rel) != len(c.ts) or any(r <= 0 for r in c.short_rel)):
            raise ValueError("malformed cost curve")
        if c.after_s < 0 or c.after_short_s < 0 or any(float(x.get("after_s", 0.0)) < 0 for x in c.longer):
            raise ValueError("malformed cost curve")
        last = -1
        for n, t1, rel in c.contexts():
            if len(rel) != len(c.ts) or any(r <= 0 for r in rel) or t1 <= 0 or n <= last:
                raise ValueError("malformed cost curve")
            last = n
        return c

    def describe(self) -> str:
        if self.builtin:
            cells = "  ".join(f"T={t}:{r:.2f}" for t, r in zip(self.ts, self.rel) if t in (2, 4, 8, 16, 32, 64))
            return (f"c(T) built-in ({self.meta.get('builtin', '?')}; a conservative guess, not measured: "
                    f"drafting runs only where it surely pays): {cells}")
        short = ""
        lines = []
        if self.t1_short_s and self.short_rel:
            cells = "  ".join(f"T={t}:{r:.2f}" for t, r in zip(self.ts, self.short_rel))
            lines.append(f"after {SHORT_PREFIX} KV cells (the short regime), relative to one token "
                         f"({self.t1_short_s * 1000:.2f} ms): {cells}; next token after a batch "
                         f"+{self.after_short_s * 1000:.2f} ms")
        elif self.t1_short_s:
            short = f"; one token within the first 256 cells: {self.t1_short_s * 1000:.2f} ms"
        for (n, t1, rel), after in zip(self.contexts(), self._after_rel()):
            cells = "  ".join(f"T={t}:{r:.2f}" for t, r in zip(self.ts, rel))
            lines.append(f"after {n} KV cells, relative to one token ({t1 * 1000:.2f} ms): {cells}; "
                         f"next token after a batch +{after * t1 * 1000:.2f} ms")
        return "c(T)" + short + "\n" + "\n".join(lines)


def _check_finite(c: CostCurve) -> None:
    """A curve holds finite numbers only (json reads NaN, Infinity and 1e999)."""
    nums = [c.t1_s, c.t1_short_s, c.after_s, c.after_short_s, *c.rel, *c.short_rel]
    for d in c.longer:
        nums += [d["n_kv"], d["t1_s"], d.get("after_s", 0.0), *d["rel"]]
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in nums):
        raise ValueError("cost curve with a value that is not a finite number")


# The built-in curves: what a model starts with until its own curve is
# measured (background calibration).  They are steeper than every curve
# measured so far on their kind of machine (CPU: up to c(2) 1.96, c(8) 6.05,
# c(32) 23.4, c(48) 32.9; GPU, published llama.cpp figures: c(2) 1.12,
# c(4) 1.33-1.41, c(8) 2.15-2.16), so under them the gate verifies a draft
# only where it is nearly certain and long: T = 2 never pays on CPU.
BUILTIN_CPU = (2.0, 0.75)      # c(T) = 2 + 0.75 (T - 2) for T >= 2
BUILTIN_GPU = (1.3, 0.3)       # c(T) = 1.3 + 0.3 (T - 2) for T >= 2


def builtin_curve(gpu: bool = False, ts=DEFAULT_TS) -> CostCurve:
    """The conservative built-in c(T) for a CPU or a fully offloaded GPU model,
    the same at every context.  Its t1 is a placeholder (origin "built-in"):
    the engine does not time its own overhead against it."""
    c2, slope = BUILTIN_GPU if gpu else BUILTIN_CPU
    ts = list(range(1, max(ts) + 1))        # a line, given at every size (tables step between points)
    rel = [1.0] + [c2 + slope * (t - 2) for t in ts[1:]]
    return CostCurve(list(ts), rel, 1.0, {"prefix": 300, "builtin": "GPU" if gpu else "CPU"}, 1.0, [],
                     list(rel), origin="built-in")


def _never() -> bool:
    return False


def _prefill(backend, toks, pause, chunk: int) -> None:
    """backend.reset() and prefill toks; in chunks of `chunk` tokens with a
    pause() before each after the first, starting over when a pause reports
    that a request used the backend meanwhile."""
    while True:
        backend.reset()
        for i in range(0, len(toks), chunk):
            if i and pause():
                break
            backend.prefill(toks[i:i + chunk], want_last_logits=False)
        else:
            return


def _measure_at(backend, ts, prefix: int, reps: int, rng, tick, pause=None) -> tuple[float, list, float]:
    """(t1_s, rel, after_s) after a random prefix of `prefix` tokens: the median
    of `reps` decodes of T-token chains per T, interleaved so that machine noise
    spreads over all sizes, and after_s, what a one-token decode right after a
    batch costs more than one after another one-token decode (median of paired
    differences; measured 0.4-0.6 ms on the 2-core machine at every context and
    batch size, up to 7% of a step in the short regime).

    pause: None, or a callable called before every timed decode (and every
    prefill chunk) that returns True when a request used the backend since
    its last call: the prefix is then laid down again."""
    chunk = PACED_CHUNK if pause else prefix
    pause = pause or _never
    pre = rng.integers(100, min(backend.n_vocab, 20000), size=prefix).astype(np.int32)
    pause()
    _prefill(backend, pre, pause, chunk)
    times = {t: [] for t in ts}
    singles, after = [], []
    one = np.ones(max(ts), np.int32)
    zeros = np.zeros(max(ts), np.int32)

    def decode(toks) -> float:
        t = len(toks)
        t0 = time.perf_counter()
        backend.decode_tree(toks, np.arange(t, dtype=np.int32), zeros[:t], one[:t], 1)
        backend.logits()
        dt = time.perf_counter() - t0
        backend.keep(0)
        return dt

    prev_batch = False
    for r in range(reps + 1):  # first round is a warm-up
        for t in ts:
            if pause():
                _prefill(backend, pre, pause, chunk)
                prev_batch = False
            # two one-token decodes before every timed decode: the first pays
            # for following the previous batch (if there was one), the second
            # follows a one-token decode, as the batch follows a plain step in
            # generation (right after a large batch a one-token decode measured
            # 10-30% slower on the 2-core machine)
            a = decode(one[:1] * 500)
            b = decode(one[:1] * 500)
            dt = decode(rng.integers(100, min(backend.n_vocab, 20000), size=t).astype(np.int32))
            if r:
                times[t].append(dt)
                singles.append(b)
                if prev_batch:
                    after.append(a - b)
            prev_batch = t > 1
        tick()
    med = {t: float(np.median(v)) for t, v in times.items()}
    t1 = float(np.median(singles + times[1]))
    rel = [max(med[t] / t1, 1e-3) for t in ts]
    # a cost curve must not fall with T (noise can make it): enforce monotone
    for i in range(1, len(rel)):
        rel[i] = max(rel[i], rel[i - 1])
    rel[0] = 1.0
    after_s = max(0.0, float(np.median(after))) if after else 0.0
    return t1, rel, after_s


def plan_contexts(n_ctx: int, prefixes=DEFAULT_PREFIXES, max_t: int = max(DEFAULT_TS)) -> list[int]:
    """The contexts (KV cells) a calibration measures with this context size:
    `prefixes` capped at half the context, one within 1.5x of the previous
    dropped (a context capped next to another adds nothing)."""
    cap = min(n_ctx - max_t - 2, n_ctx // 2)
    kept: list[int] = []
    for p in sorted({max(1, min(p, cap)) for p in prefixes}):
        if not kept or p >= 1.5 * kept[-1]:
            kept.append(p)
    return kept


def measure_cost_curve(backend, ts=DEFAULT_TS, prefixes=DEFAULT_PREFIXES, reps: int = 5,
                       progress=None, pause=None) -> CostCurve:
    """Time decodes of T tokens (chains, logits at every token) after each of
    `prefixes` KV cells (capped by the context size), and single tokens within
    the first 256 cells.  progress(done, total) is called after every round;
    pause: see _measure_at (a measurement between requests)."""
    prefixes = plan_contexts(backend.n_ctx, prefixes, max(ts))
    ts = [t for t in ts if t <= backend.max_nodes and backend.n_ctx > prefixes[0] + t + 1]
    rng = np.random.default_rng(0)
    total = (len(prefixes) + 1) * (reps + 1)
    done = [0]

    def tick():
        done[0] += 1
        if progress:
            progress(done[0], total)

    at = [(p,) + _measure_at(backend, ts, p, reps, rng, tick, pause) for p in prefixes]
    # the short regime: one-token decodes with every thread (backend/llama.py),
    # so its own curve, its singles timed in the same rounds as its batches
    t1_short, short_rel, after_short = _measure_at(backend, ts, min(SHORT_PREFIX, prefixes[0]), reps, rng, tick,
                                                    pause)
    backend.reset()
    p0, t1, rel, after0 = at[0]
    return CostCurve(ts, rel, t1, {"prefix": p0, "reps": reps, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")},
                     t1_short, [{"n_kv": p, "t1_s": t, "rel": r, "after_s": a} for p, t, r, a in at[1:]], short_rel,
                     after0, after_short)


def _curve_path(key: str) -> str:
    return os.path.join(cache_dir(), "calibration", key + ".json")


def _read_cached(path: str, parse, warn: bool):
    """parse(the JSON in path), or None when the file is missing; a file that
    cannot be read or parsed (NaN included) is None too, with a warning."""
    try:
        with open(path) as f:
            return parse(json.load(f))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        if warn:
            warnings.warn(f"ignoring the calibration cache file {path}, which is unreadable or malformed ({e}); "
                          "measuring again", CalibrationCacheWarning, stacklevel=3)
        return None


def cached_curve(key: str, needed: int = 0, warn: bool = True) -> CostCurve | None:
    """The cached curve under `key`, or None when it is missing, malformed or
    its longest measured context is shorter than `needed` KV cells (it was
    measured with a smaller context size)."""
    c = _read_cached(_curve_path(key), CostCurve.from_json, warn)
    return c if c is not None and c.contexts()[-1][0] >= needed else None


def load_or_measure(backend, key: str, remeasure: bool = False, progress=None, needed: int = 0,
                    pacer=None) -> CostCurve:
    """The cached curve under `key` (see cached_curve); else measure and cache
    it.  The measurement runs under the key's file lock (cache_lock): a second
    process that wants the same key waits and then reads the first one's
    result.  A cache that cannot be written is a warning; the curve is used.
    pacer: None, or what paces a measurement between requests (its pause()
    and stopped(); see edgespec.calibration.background)."""
    path = _curve_path(key)
    if not remeasure and (c := cached_curve(key, needed)) is not None:
        return c
    with cache_lock(path, pacer):
        if not remeasure and (c := cached_curve(key, needed, warn=False)) is not None:
            return c                    # another process measured it while this one waited
        for _ in range(2):              # a second try when the machine looked busy
            curve = measure_cost_curve(backend, progress=progress, **_paced(pacer))
            try:
                _check_finite(curve)
            except ValueError as e:
                from edgespec.errors import BackendError
                raise BackendError(f"the measured cost curve is not usable ({e}); run `edgespec calibrate` "
                                   "again") from None
            if (bad := implausible_batch(curve)) is None:
                curve.meta["cache_file"] = path
                write_cache(path, curve.to_json())
                return curve
        warnings.warn(f"the measured cost curve is implausible (a batch of {bad} tokens cost more than "
                      f"{IMPLAUSIBLE_PER_TOKEN:g} x {bad} one-token decodes: was the machine busy?); it is used "
                      "capped at one decode per token for now, not cached, and measured again next time",
                      CalibrationCacheWarning, stacklevel=2)
    return capped(curve)


# A batch of T tokens reads the weights once, so it never costs much more
# than T one-token decodes; a measured ratio beyond this per token says the
# timings were disturbed (other processes competing for the cores), and a
# curve cached from them would keep the gate from drafting for good.
IMPLAUSIBLE_PER_TOKEN = 1.75    # well above every curve measured on a quiet machine (BENCHMARKS.md)


def implausible_batch(curve: CostCurve) -> int | None:
    """The smallest batch size T >= 2 whose cost exceeds IMPLAUSIBLE_PER_TOKEN
    x T one-token decodes in any measured regime, or None."""
    for _, _, rel in curve.contexts() + [(0, 0.0, curve.short_rel)]:
        for t, r in zip(curve.ts, rel):
            if t >= 2 and r > IMPLAUSIBLE_PER_TOKEN * t:
                return int(t)
    return None


def capped(curve: CostCurve) -> CostCurve:
    """A copy of the curve with every cost capped at T one-token decodes."""
    def cap(rel):
        return [min(float(r), float(t)) for t, r in zip(curve.ts, rel)]
    longer = [dict(d, rel=cap(d["rel"])) for d in curve.longer]
    meta = dict(curve.meta, capped=True)
    return replace(curve, rel=cap(curve.rel), short_rel=cap(curve.short_rel), longer=longer, meta=meta)


def _paced(pacer) -> dict:
    """The measurement's pause= argument, when a pacer runs it between requests."""
    return {"pause": pacer.pause} if pacer is not None else {}


@contextlib.contextmanager
def cache_lock(path: str, pacer=None):
    """Hold the exclusive lock of a cache entry (fcntl.flock on path + ".lock",
    beside it; the lock file stays).  Another process, or another model in
    this one, that measures the same entry waits here (polling, so that a
    pacer's stopped() ends the wait).  Without fcntl (Windows), or where the
    lock file cannot be created (a read-only cache, where nothing can be
    cached either), it runs unlocked."""
    try:
        import fcntl
    except ImportError:          # pragma: no cover - Windows
        fcntl = None
    fd = None
    if fcntl is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            fd = None
    if fd is None:
        yield
        return
    try:
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    log.warning("waiting for another edgespec process that is calibrating this model "
                                "(lock %s); its result is used", path + ".lock")
                    said = True
                if pacer is not None and pacer.stopped():
                    raise CalibrationStopped() from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)             # releases the lock


def write_cache(path: str, obj) -> bool:
    """Write a cache entry whole or not at all; a failure (a read-only or full
    cache folder) is a CalibrationCacheWarning and leaves no temporary file."""
    try:
        _write_json_atomic(path, obj)
        return True
    except (OSError, ValueError) as e:
        warnings.warn(f"could not write the calibration cache {path} ({e}); the measurement is used by this "
                      "process only (EDGESPEC_CACHE_DIR chooses another folder)", CalibrationCacheWarning,
                      stacklevel=3)
        return False


def _write_json_atomic(path: str, obj) -> None:
    """A temporary file beside path, then a rename; no NaN or infinity."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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

    def shrink(self, cap: float) -> None:
        """Scale each fine (source, score, depth) cell down to at most `cap`
        tested nodes, its accepted fraction kept.  The coarse cells keep every
        request's evidence (the source's calibration and each bucket's rate);
        the fine ones, which the estimate consults first and which back off to
        the coarse, then soon hold mostly the current request's own evidence."""
        f = np.minimum(1.0, cap / np.maximum(self.n_f, 1e-9))
        self.n_f *= f
        self.a_f *= f

    def report(self) -> list[dict]:
        """Rows of (source, score bucket, tested nodes, predicted and observed acceptance)."""
        rows = []
        for s in range(N_SOURCES):
            for b in range(N_SCORE_BUCKETS):
                n = self.n_c[s, b]
                if n > 0:
                    rows.append({"source": SOURCE_NAMES[s], "score": f"{SCORE_EDGES[b]:g}-{SCORE_EDGES[b + 1]:g}",
                                 "tested": int(n), "predicted": round(float(self.pred_sum[s, b] / n), 3),
                                 "observed": round(float(self.a_c[s, b] / n), 3)})
        return rows


# ------------------------------------------------------------------ exactness
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
        ts = _ranges(self.failed)
        return (f"NOT exact: batches of {ts} tokens give logits that differ from one-token decoding by up to "
                f"{self.max_abs_diff:.3g} ({self.argmax_flips} argmax flips; checked 2..{self.max_t} after "
                f"{' and '.join(map(str, self.contexts))} KV cells)")


def _ranges(ts) -> str:
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
    pause: as in _measure_at; when a request used the backend, the context
    and its one-token rows are computed again before the next batch."""
    max_t = min(max_t or backend.max_nodes, backend.max_nodes, backend.n_ctx - 2)
    ts = sorted(t for t in (ts or range(2, max_t + 1)) if 2 <= t <= max_t)
    rng = np.random.default_rng(seed)
    hi = min(backend.n_vocab, 20000)
    ctxs = _exact_contexts(backend, max_t, contexts)
    rep = ExactnessReport(True, max_t, ctxs)
    total, done = len(ctxs) * len(ts), 0
    zeros, ones = np.zeros(max_t, np.int32), np.ones(max_t, np.int32)
    chunk = PACED_CHUNK if pause else max(ctxs)
    pause = pause or _never
    for n_kv in ctxs:
        pre = rng.integers(100, hi, size=n_kv).astype(np.int32)
        toks = rng.integers(100, hi, size=max_t).astype(np.int32)
        pause()
        ref = _one_token_rows(backend, pre, toks, pause, chunk)
        failed, worst = [], 0.0
        for t in ts:
            if pause():
                ref = _one_token_rows(backend, pre, toks, pause, chunk)
            backend.decode_tree(toks[:t], np.arange(t, dtype=np.int32), zeros[:t], ones[:t], 1)
            lg = backend.logits()
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
    _prefill(backend, pre, pause, chunk)
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
    with cache_lock(_curve_path(key), pacer):
        if not recheck and (r := _cached_exactness(backend, path, warn=False)) is not None:
            return r
        r = check_exactness(backend, progress=progress, **_paced(pacer))
        write_cache(path, r.to_json())
    return r


def _cached_exactness(backend, path: str, warn: bool) -> ExactnessReport | None:
    r = _read_cached(path, ExactnessReport.from_json, warn)
    want = min(backend.max_nodes, backend.n_ctx - 2)
    if r is not None and r.max_t >= want and r.contexts[-1] >= _exact_contexts(backend, want)[-1]:
        return r
    return None
