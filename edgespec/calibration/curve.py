"""The cost curve c(T): the measured time of one llama_decode of T tokens
(logits at all of them) relative to T = 1, for the loaded model and settings
on this machine, at a few context lengths (attention over a longer context
makes a batch dearer relative to one token).

It is measured once (load_or_measure), cached under the calibration key
(edgespec.calibration.cache) and re-measured by `edgespec calibrate`; until
then a model may run on a conservative built-in curve.  The measurement can
run between requests in slices (a pacer's pause()), which the exactness
self-check shares.
"""
from __future__ import annotations

import functools
import math
import time
import warnings
from dataclasses import dataclass, field, replace

import numpy as np

from edgespec.calibration.cache import CalibrationCacheWarning, cache_lock, curve_path, read_cached, write_cache
from edgespec.errors import Interrupted

DEFAULT_TS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 48, 64)
DEFAULT_PREFIXES = (300, 1000, 2000)
SHORT_PREFIX = 100      # the short regime (<= 256 cells) is measured after 100 cells
PACED_CHUNK = 64        # prompt tokens per slice when a measurement runs between requests
STEADY_RUN, STEADY_KEEP = 4, 2   # one-token decodes in a row per round; the last ones time t1


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
    that verifies a tree makes the next plain step dearer by that much;
    steady_rel: time(T)/t1_s after meta["prefix"] cells when the decode
    before it had the same width T (a backend that replays a captured graph
    for an unchanged shape, as llama.cpp's CUDA backend does, runs these
    much faster than the alternating widths of `rel`; empty in old caches,
    then taken as equal to `rel`)."""
    ts: list
    rel: list
    t1_s: float
    meta: dict = field(default_factory=dict)
    t1_short_s: float = 0.0
    longer: list = field(default_factory=list)
    short_rel: list = field(default_factory=list)
    after_s: float = 0.0
    after_short_s: float = 0.0
    steady_rel: list = field(default_factory=list)
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

    def table(self, max_t: int, short: bool = False, n_kv: int | None = None, after: bool = True) -> np.ndarray:
        """cost[T] for T = 0..max_t (cost[0] = 0) in units of one single-token
        decode at the same context, linear between measured points and
        extrapolated from the last two beyond them; with n_kv, interpolated
        between the measured contexts.  Entries T >= 2 include the after-batch
        cost of the one-token decode that follows (after_rel), unless `after`
        is False."""
        a = self.after_rel(short, n_kv) if after else 0.0
        if short and self.t1_short_s > 0 and self.short_rel:
            # the short regime's own curve, in units of t1_s like every table
            out = self._rel_table(self.short_rel, max_t) * (self.t1_short_s / self.t1_s)
            out[2:] += a
            out[0] = 0.0
            return out
        i, j, w = self._weights(n_kv)
        ctx = self.contexts()
        out = self._rel_table(ctx[i][2], max_t)
        out[2:] += a
        if w:
            hi = self._rel_table(ctx[j][2], max_t)
            hi[2:] += a
            out = (1 - w) * out + w * hi
            out[1:] = np.maximum.accumulate(out[1:])
        out[0] = 0.0
        out[1] = 1.0
        if short and self.t1_short_s > 0:
            out[1] = min(1.0, self.t1_short_s / self.t1_s)
        return out

    def after_rel(self, short: bool = False, n_kv: int | None = None) -> float:
        """The after-batch extra of a one-token decode, in units of t1_s:
        the short regime's, or interpolated between the measured contexts."""
        if short and self.t1_short_s > 0 and self.short_rel:
            return self.after_short_s / self.t1_s
        i, j, w = self._weights(n_kv)
        after = self._after_rel()
        return (1 - w) * after[i] + w * after[j]

    def steady_factor(self, max_t: int) -> np.ndarray:
        """steady / alternating cost per T = 0..max_t, as measured after the
        first context (ones where steady widths were not measured)."""
        if not self.steady_rel:
            return np.ones(max_t + 1)
        f = self._rel_table(self.steady_rel, max_t) / self._rel_table(self.rel, max_t)
        f[:2] = 1.0
        return np.minimum(f, 1.0)

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
                "after_s": self.after_s, "after_short_s": self.after_short_s,
                "steady_rel": [round(float(r), 4) for r in self.steady_rel]}

    @staticmethod
    def from_json(d: dict) -> "CostCurve":
        c = CostCurve(list(d["ts"]), list(d["rel"]), float(d["t1_s"]), dict(d.get("meta", {})),
                      float(d.get("t1_short_s", 0.0)), list(d.get("longer", [])), list(d.get("short_rel", [])),
                      float(d.get("after_s", 0.0)), float(d.get("after_short_s", 0.0)), list(d.get("steady_rel", [])))
        c.origin = "cached"
        if not c.ts or c.ts[0] != 1:
            raise ValueError("malformed cost curve")
        check_finite(c)
        for extra in (c.short_rel, c.steady_rel):
            if extra and (len(extra) != len(c.ts) or any(r <= 0 for r in extra)):
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
        quick = " quick (measured at load, one context; the full curve is measured in the background)" \
            if self.meta.get("quick") else ""
        return "c(T)" + quick + short + "\n" + "\n".join(lines)


def check_finite(c: CostCurve) -> None:
    """A curve holds finite numbers only (json reads NaN, Infinity and 1e999)."""
    nums = [c.t1_s, c.t1_short_s, c.after_s, c.after_short_s, *c.rel, *c.short_rel, *c.steady_rel]
    for d in c.longer:
        nums += [d["n_kv"], d["t1_s"], d.get("after_s", 0.0), *d["rel"]]
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in nums):
        raise ValueError("cost curve with a value that is not a finite number")


def no_pause() -> bool:
    """The pause() of a measurement that does not run between requests."""
    return False


def paced(pacer) -> dict:
    """The measurement's pause= argument, when a pacer runs it between requests."""
    return {"pause": pacer.pause} if pacer is not None else {}


def prefill(backend, toks, pause, chunk: int) -> None:
    """backend.reset() and prefill toks; in chunks of `chunk` tokens with a
    pause() before each after the first, starting over when a pause reports
    that a request used the backend meanwhile or a request interrupted a chunk."""
    while True:
        backend.reset()
        try:
            for i in range(0, len(toks), chunk):
                if i and pause():
                    break
                backend.prefill(toks[i:i + chunk], want_last_logits=False)
            else:
                return
        except Interrupted:
            pause()


def retried(fn, pause, relay):
    """fn()'s result, run again until no request interrupts it (a measurement
    between requests: edgespec.backend.interrupt); after an interruption, wait
    for the request (pause()) and lay the measurement's context down again
    (relay()).  Without a pacer nothing interrupts, and fn runs once."""
    while True:
        try:
            return fn()
        except Interrupted:
            pause()
            relay()


def timed_chain(backend, toks: np.ndarray) -> float:
    """Seconds of one decode of the chain `toks` (logits at every token),
    its cells dropped after."""
    t = len(toks)
    t0 = backend.clock()
    backend.decode_tree(toks, np.arange(t, dtype=np.int32), np.zeros(t, np.int32), np.ones(t, np.int32), 1)
    backend.logits()
    dt = backend.clock() - t0
    backend.keep(0)
    return dt


def measure_at(backend, ts, prefix: int, reps: int, rng, tick, pause=None, steady: list | None = None) -> tuple[float, list, float]:
    """(t1_s, rel, after_s) after a random prefix of `prefix` tokens: the median
    of `reps` decodes of T-token chains per T, interleaved so that machine noise
    spreads over all sizes; t1 the last STEADY_KEEP of STEADY_RUN one-token
    decodes in a row each round (on CUDA the first decodes of a new shape
    run uncaptured, then capture the graph); after_s what the two one-token
    decodes right after a batch cost over two plain ones (median).  With
    `steady` (a list), it also times a T-token decode that follows two of
    the same width (a replayed graph by then) and appends their medians over t1.

    pause: None, or a callable called before every timed decode (and prefill
    chunk), True when a request used the backend since its last call (or
    interrupted a decode: retried): the prefix is then laid down again."""
    chunk = PACED_CHUNK if pause else prefix
    pause = pause or no_pause
    pre = rng.integers(100, min(backend.n_vocab, 20000), size=prefix).astype(np.int32)
    times, same = {t: [] for t in ts}, {t: [] for t in ts}
    singles, after, firsts = [], [], []
    one = np.ones(max(ts), np.int32)

    decode = functools.partial(timed_chain, backend)       # seconds of one chain's decode

    def relay() -> None:
        prefill(backend, pre, pause, chunk)
    pause()
    relay()

    def sample(t: int):
        # two one-token decodes first: the first pays for following the previous batch, the second
        # is followed by the batch as a plain step is in generation (after a batch a token is dearer)
        a = decode(one[:1] * 500)
        b = decode(one[:1] * 500)
        dt = decode(rng.integers(100, min(backend.n_vocab, 20000), size=t).astype(np.int32))
        if steady is not None and t > 1:
            decode(one[:t] * 500)
            same[t].append(decode(one[:t] * 501))
        return a, b, dt

    prev_batch = False
    for r in range(reps + 1):  # first round is a warm-up
        for t in ts:
            if pause():
                relay()
                prev_batch = False
            a, b, dt = retried(lambda: sample(t), pause, relay)
            if r:
                times[t].append(dt)
                if prev_batch:
                    firsts.append(a + b)
            prev_batch = t > 1
        run = retried(lambda: [decode(one[:1] * 500) for _ in range(STEADY_RUN)], pause, relay)
        if r:
            singles.extend(run[-STEADY_KEEP:])
            # the two one-token decodes after each of this round's batches (on CUDA the first
            # runs uncaptured, the second captures the graph) over two of this round's plain ones
            after.extend(x - 2.0 * float(np.median(run[-STEADY_KEEP:])) for x in firsts)
        firsts.clear()
        prev_batch = False
        tick()
    return _medians(ts, times, singles, after, same, steady)


def _medians(ts, times: dict, singles: list, after: list, same: dict, steady: list | None):
    """measure_at's (t1_s, rel, after_s) from its timings, and the steady
    widths' medians over t1 appended to `steady` (when it is a list)."""
    med = {t: float(np.median(v)) for t, v in times.items()}
    t1 = float(np.median(singles))
    rel = [max(med[t] / t1, 1e-3) for t in ts]
    # a cost curve must not fall with T (noise can make it): enforce monotone
    for i in range(1, len(rel)):
        rel[i] = max(rel[i], rel[i - 1])
    rel[0] = 1.0
    after_s = max(0.0, float(np.median(after))) if after else 0.0
    if steady is not None:
        steady.extend([1.0] + [max(float(np.median(same[t][1:])) / t1, 1e-3) for t in ts[1:]])
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
    pause: see measure_at (a measurement between requests)."""
    prefixes = plan_contexts(backend.n_ctx, prefixes, max(ts))
    ts = [t for t in ts if t <= backend.max_nodes and backend.n_ctx > prefixes[0] + t + 1]
    rng = np.random.default_rng(0)
    total = (len(prefixes) + 1) * (reps + 1)
    done = [0]

    def tick():
        done[0] += 1
        if progress:
            progress(done[0], total)

    steady: list = []      # the steady widths, after the first context only
    at = [(p,) + measure_at(backend, ts, p, reps, rng, tick, pause, steady if i == 0 else None)
          for i, p in enumerate(prefixes)]
    # the short regime: one-token decodes with every thread (backend/llama.py),
    # so its own curve, its singles timed in the same rounds as its batches
    t1_short, short_rel, after_short = measure_at(backend, ts, min(SHORT_PREFIX, prefixes[0]), reps, rng, tick,
                                                    pause)
    backend.reset()
    p0, t1, rel, after0 = at[0]
    return CostCurve(ts, rel, t1, {"prefix": p0, "reps": reps, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")},
                     t1_short, [{"n_kv": p, "t1_s": t, "rel": r, "after_s": a} for p, t, r, a in at[1:]], short_rel,
                     after0, after_short, steady)


def cached_curve(key: str, needed: int = 0, warn: bool = True) -> CostCurve | None:
    """The cached curve under `key`, or None when it is missing, malformed or
    its longest measured context is shorter than `needed` KV cells (it was
    measured with a smaller context size)."""
    c = read_cached(curve_path(key), CostCurve.from_json, warn)
    return c if c is not None and c.contexts()[-1][0] >= needed else None


def load_or_measure(backend, key: str, remeasure: bool = False, progress=None, needed: int = 0,
                    pacer=None) -> CostCurve:
    """The cached curve under `key` (see cached_curve); else measure and cache
    it.  The measurement runs under the key's file lock (cache_lock): a second
    process that wants the same key waits and then reads the first one's
    result.  A cache that cannot be written is a warning; the curve is used.
    pacer: None, or what paces a measurement between requests (its pause()
    and stopped(); see edgespec.calibration.background)."""
    path = curve_path(key)
    if not remeasure and (c := cached_curve(key, needed)) is not None:
        return c
    with cache_lock(path, pacer):
        if not remeasure and (c := cached_curve(key, needed, warn=False)) is not None:
            return c                    # another process measured it while this one waited
        for _ in range(2):              # a second try when the machine looked busy
            curve = measure_cost_curve(backend, progress=progress, **paced(pacer))
            try:
                check_finite(curve)
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
    x T one-token decodes in any measured regime, or None.  Where batches of
    an unchanged width (steady_rel) were measured within the bound, dear
    alternating widths are the backend's, not a busy machine's: llama.cpp's
    CUDA backend captures its graph anew at each change of shape (an H200 on
    2026-11-28: a batch of 2 after a one-token decode cost 5.1 of them, the
    same batch repeated 1.13), and capping that curve made the gate price
    batches far below what they cost."""
    steady = [(t, r) for t, r in zip(curve.ts, curve.steady_rel) if t >= 2]
    if steady and all(r <= IMPLAUSIBLE_PER_TOKEN * t for t, r in steady):
        return None
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
