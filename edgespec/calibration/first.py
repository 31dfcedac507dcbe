"""The curve a model runs on before its own full c(T) is cached: the
conservative built-in guess, and the quick curve measured at load on a fresh
cache (edgespec.calibration.curve has the full measurement and the cache)."""
from __future__ import annotations

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


QUICK_TS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def quick_curve(backend, progress=None) -> CostCurve:
    """A first c(T) for a model on a fresh cache, measured at load in seconds
    (one context of 300 cells and the short regime, sizes up to 32, two timed
    rounds), so that the first requests draft under this machine's own
    prices rather than the built-in guess while the full curve is measured
    between requests.  Not cached; capped like a busy machine's where
    implausible; ValueError where not finite."""
    c = curve.measure_cost_curve(backend, ts=QUICK_TS, prefixes=(300,), reps=2, progress=progress)
    curve.check_finite(c)
    c.meta["quick"] = True
    return c if curve.implausible_batch(c) is None else curve.capped(c)
