"""The curve a model runs on before its own full c(T) is cached: the
conservative built-in guess, and the quick curve measured at load on a fresh
cache (edgespec.calibration.curve has the full measurement and the cache)."""
from __future__ import annotations

import time

import numpy as np

from edgespec.calibration import curve
from edgespec.calibration.curve import DEFAULT_TS, CostCurve


# The built-in curves: what a model starts with until its own curve is
# measured (background calibration).  They are steeper than every curve
# measured on their kind of machine (CPU; GPU: published llama.cpp figures;
# see BENCHMARKS.md), so under them the gate verifies a draft only where it
# is nearly certain and long: T = 2 never pays on CPU.
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


QUICK_TS = (1, 2, 4, 8, 16, 32)
QUICK_PREFIX = 300
QUICK_REPS = 2


def quick_curve(backend, progress=None) -> CostCurve:
    """A first c(T) for a model on a fresh cache, measured at load: sizes up
    to 32 after 300 cells, two timed rounds after a warm-up, without the
    short regime and the steady widths (docs/calibration.md has what it
    took), so that the first requests draft under this machine's own
    prices rather than the built-in guess while the full curve is measured
    between requests.  Not cached; capped like a busy machine's where
    implausible; ValueError where not finite."""
    prefix = curve.plan_contexts(backend.n_ctx, (QUICK_PREFIX,), max(QUICK_TS))[0]
    ts = [t for t in QUICK_TS if t <= backend.max_nodes and backend.n_ctx > prefix + t + 1]
    rounds = [0]

    def tick():
        rounds[0] += 1
        if progress:
            progress(rounds[0], QUICK_REPS + 1)
    t1, rel, after = curve.measure_at(backend, ts, prefix, QUICK_REPS, np.random.default_rng(0), tick)
    backend.reset()
    c = CostCurve(ts, rel, t1, {"prefix": prefix, "reps": QUICK_REPS, "quick": True,
                                "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}, after_s=after)
    curve.check_finite(c)
    return c if curve.implausible_batch(c) is None else curve.capped(c)
