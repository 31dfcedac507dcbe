"""Cost curves for the replay that no calibration of this machine gives:
the published GPU curves (`--cost rtx3090`, `--cost m2`), a curve from a
JSON file, and a GPU check's steady/alternating pair (tools/gpu/shapes.py).
"""
from __future__ import annotations

import numpy as np


# Published c(T) of GPUs (llama-bench, time of a batch of T tokens over one
# token): RTX 3090, Llama-8B Q4_0, 512 tokens of context (llama.cpp PR #15802);
# Apple M2-class Metal GPU, Qwen2-7B Q8_0 (llama.cpp PR #10581).
GPU_CURVES = {
    "rtx3090": ((1, 2, 4, 8), (1.0, 1.12, 1.33, 2.15)),
    "m2": ((1, 2, 4, 8), (1.0, 1.11, 1.41, 2.16)),
}
GPU_T1_S = 0.01
"""The plain step the GPU curves are scaled to (only ratios matter: edgespec replay
scales every modelled time by the recorded plain decode time)."""


def gpu_curve(name: str):
    """A CostCurve from published points.  Between them c(T) is linear; beyond
    T = 8 it is extrapolated linearly from c(4)..c(8) (the rule of
    CostCurve's table: the last two points' slope), e.g. for the RTX 3090
    c(16) = 2.15 + 8 * (2.15 - 1.33) / 4 = 3.79 and c(32) = 7.07; no
    after-batch cost, one context (no attention growth modelled)."""
    from edgespec.calibration.curve import CostCurve
    ts, rel = GPU_CURVES[name]
    every = list(range(1, max(ts) + 1))     # every size (a table charges a step function between points)
    return CostCurve(every, [float(x) for x in np.interp(every, ts, rel)], GPU_T1_S, {"prefix": 512, "source": name})


def curve_from_file(path: str):
    """A CostCurve from a JSON file: either a whole calibration (CostCurve.to_json)
    or {"ts": [1, 2, ...], "rel": [1.0, ...]} (linear between the points,
    extrapolated from the last two)."""
    import json
    from edgespec.calibration.curve import CostCurve
    with open(path) as f:
        d = json.load(f)
    d.setdefault("t1_s", GPU_T1_S)
    return CostCurve.from_json(d)


def shape_curve(prefix: str):
    """A CostCurve with steady widths from a GPU check's pair of files,
    PREFIX-steady.json and PREFIX-alternating.json (tools/gpu/shapes.py:
    {"ts", "rel", "t1_ms", "after_ms"} each, after 300 cells): `rel` the
    alternating widths, `steady_rel` the steady ones, after_s the median
    one-token decode after a batch over t1.  One context; no short regime."""
    import json
    from edgespec.calibration.curve import CostCurve
    with open(prefix + "-steady.json") as f:
        steady = json.load(f)
    with open(prefix + "-alternating.json") as f:
        alt = json.load(f)
    if steady["ts"] != alt["ts"] or steady["ts"][0] != 1:
        raise ValueError(f"{prefix}: the steady and alternating files measure different sizes")
    t1 = float(alt["t1_ms"]) / 1000
    after = max(0.0, float(np.median(alt.get("after_ms") or [alt["t1_ms"]])) / 1000 - t1)
    every = list(range(1, max(alt["ts"]) + 1))      # linear between the points (a model, not padded shapes)
    c = CostCurve(every, [float(x) for x in np.interp(every, alt["ts"], alt["rel"])], t1,
                  {"prefix": 300, "source": prefix}, after_s=after,
                  steady_rel=[float(x) for x in np.interp(every, steady["ts"], steady["rel"])])
    c.origin = "cached"
    return c
