"""What a real step pays on a device beyond its decode's shape: fitted terms.

A GPU check's shape files (tools/gpu/shapes.py: PREFIX-steady.json and
PREFIX-alternating.json) time bare `llama_decode` calls.  A real step pays
more: reading its rows' logits back, the host's argmax, the KV bookkeeping.
On the H200 of 2026-11-27 the replay under the bare shapes modelled the
timed answers 10-60% too fast.  `StepTerms` are those extra costs, per
decode, fitted once per device from timed answers (an `edgespec bench`
results file: its rows' decode time, steps, drafting steps and drafted
nodes) by `fit_terms` (tools/fit_step_costs.py), and kept in the cost file
under the key "step":

    plain_ms   per one-token decode
    draft_ms   per drafting decode (T >= 2) whose width differs from one of
               the two decodes before it (the CUDA graph is built again)
    held_ms    per drafting decode at the width of the two before (steady:
               the graph is replayed)
    node_ms    per drafted node (T - 1) of any drafting decode

ReplayBackend adds `StepTerms.extra_s` to each decode's modelled shape
cost; cost files without the key are charged as before.

The fit works from per-answer counts, so it charges each answer's decodes
by the same shapes the replay uses, with two approximations where a row
does not say more: an answer's drafting decodes all have its mean width,
and every drafting decode of a method that holds a width (NAME@holdN) is
steady, every other one changes width; a one-token decode after a batch
(min(drafting, plain) of them) pays the measured after-batch cost.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

TERMS = ("plain_ms", "draft_ms", "held_ms", "node_ms")


@dataclass(frozen=True)
class StepTerms:
    """Seconds a decode pays beyond its shape (see the module doc)."""
    plain_s: float = 0.0
    draft_s: float = 0.0
    held_s: float = 0.0
    node_s: float = 0.0

    def extra_s(self, n: int, steady: bool) -> float:
        """The extra seconds of a decode of n tokens (steady: at the width of the two decodes before)."""
        if n <= 1:
            return self.plain_s
        return (self.held_s if steady else self.draft_s) + self.node_s * (n - 1)

    def to_json(self) -> dict:
        return {k: round(1000 * v, 5) for k, v in zip(TERMS, (self.plain_s, self.draft_s, self.held_s, self.node_s))}

    @classmethod
    def from_json(cls, d: dict) -> StepTerms:
        return cls(*(float(d.get(k, 0.0)) / 1000 for k in TERMS))


def load_terms(path: str) -> StepTerms | None:
    """The "step" terms of a cost file (a JSON file, or a PREFIX whose
    PREFIX-steady.json holds them); None where it has none."""
    for p in (path + "-steady.json", path):
        if p.endswith(".json") and os.path.exists(p):
            with open(p) as f:
                d = json.load(f)
            return StepTerms.from_json(d["step"]) if isinstance(d, dict) and d.get("step") else None
    return None


@dataclass(frozen=True)
class Shapes:
    """A GPU check's bare decode costs, in seconds: alternating and steady
    widths, and the extra of a one-token decode after a batch."""
    ts: list
    alt_rel: list
    steady_rel: list
    t1_s: float
    after_s: float

    @classmethod
    def load(cls, prefix: str) -> Shapes:
        with open(prefix + "-steady.json") as f:
            steady = json.load(f)
        with open(prefix + "-alternating.json") as f:
            alt = json.load(f)
        t1 = float(alt["t1_ms"]) / 1000
        after = max(0.0, float(np.median(alt.get("after_ms") or [alt["t1_ms"]])) / 1000 - t1)
        return cls(list(alt["ts"]), list(alt["rel"]), list(steady["rel"]), t1, after)

    def width_s(self, width: float, steady: bool) -> float:
        """A decode of `width` tokens, linear between the measured sizes (as shape_curve)."""
        return float(np.interp(width, self.ts, self.steady_rel if steady else self.alt_rel)) * self.t1_s


def held(method: str) -> bool:
    """Whether a bench method holds its batch width (NAME@holdN)."""
    mode = method.partition("@")[2]
    return mode.startswith("hold") and mode[4:].isdigit()


def counts(row: dict) -> dict:
    """One answer's decodes by kind, from its bench row."""
    steps, draft, nodes = int(row["n_steps"]), int(row.get("n_draft_steps") or 0), int(row.get("n_draft_nodes") or 0)
    plain = steps - draft
    hold = held(row["method"])
    return {"plain": plain, "draft": 0 if hold else draft, "held": draft if hold else 0, "nodes": nodes,
            "after": min(draft, plain), "width": 1.0 + nodes / draft if draft else 1.0}


def shape_s(shapes: Shapes, c: dict) -> float:
    """An answer's decode seconds under the bare shapes (the approximations of the module doc)."""
    s = c["plain"] * shapes.t1_s + c["after"] * shapes.after_s
    s += c["draft"] * shapes.width_s(c["width"], False) + c["held"] * shapes.width_s(c["width"], True)
    return s


def design(c: dict) -> list:
    """An answer's row of the fit's design matrix (the counts TERMS multiply)."""
    return [c["plain"], c["draft"], c["held"], c["nodes"]]


def edgespec_rows(rows) -> list:
    """The timed edgespec answers of a results file's rows (peers have no step counts)."""
    return [r for r in rows if r.get("kind", "result") == "result" and r.get("n_steps") and "n_draft_nodes" in r
            and r.get("decode_call_s") is not None]


def fit_terms(rows, shapes: Shapes) -> tuple[StepTerms, dict]:
    """Least squares of the answers' device time (decode_call_s) over their
    bare shape cost, on the counts of TERMS, each answer's error relative to
    its time (a long answer weighs no more than a short one); a term no
    answer exercises (no held widths in the run) stays 0.  The terms and the
    fit's figures (rms: of the relative error an answer)."""
    rows = edgespec_rows(rows)
    cs = [counts(r) for r in rows]
    a = np.array([design(c) for c in cs], np.float64)
    timed = np.array([r["decode_call_s"] for r in rows], np.float64)
    y = timed - np.array([shape_s(shapes, c) for c in cs], np.float64)
    used = np.nonzero(a.any(axis=0))[0]
    coef = np.zeros(a.shape[1])
    coef[used] = np.linalg.lstsq(a[:, used] / timed[:, None], y / timed, rcond=None)[0]
    rel = (y - a @ coef) / timed
    info = {"answers": len(rows), "rms": round(float(np.sqrt(np.mean(rel ** 2))), 4),
            "terms_fitted": [TERMS[i] for i in used]}
    return StepTerms(*(float(x) for x in coef)), info


def predict_s(row: dict, shapes: Shapes, terms: StepTerms) -> float:
    """An answer's modelled device seconds from its own counts."""
    c = counts(row)
    extra = c["plain"] * terms.plain_s + c["draft"] * terms.draft_s + c["held"] * terms.held_s + c["nodes"] * terms.node_s
    return shape_s(shapes, c) + extra
