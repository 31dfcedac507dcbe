"""Bench statistics over result rows: a method's pooled speed and acceptance,
its speedup over `none` per pass, and a bootstrap interval of that speedup."""
from __future__ import annotations

import numpy as np


def method_stats(rows: list[dict]) -> dict:
    """Aggregate one method's results over a set of prompts."""
    n_tok = sum(max(0, r["n_generated"] - 1) for r in rows)
    dec = sum(r["decode_s"] for r in rows)
    st = {"n": len(rows), "tokens_per_s": n_tok / dec if dec > 0 else 0.0,
          "mean_accepted": None, "engine_ms_per_step": None, "decode_ms_per_step": None,
          "identical": None, "n_compared": 0}
    steps = [r for r in rows if r.get("n_steps")]
    if steps:
        n_steps = sum(r["n_steps"] for r in steps)
        committed = sum(r["mean_accepted"] * r["n_steps"] for r in steps)
        st["mean_accepted"] = committed / n_steps
        eng = [r["engine_s"] / r["n_steps"] * 1000 for r in steps if r.get("engine_s") is not None]
        if eng:
            st["engine_ms_per_step"] = sum(eng) / len(eng)
        dc = [r["decode_call_s"] / r["n_steps"] * 1000 for r in steps if r.get("decode_call_s") is not None]
        if dc:
            st["decode_ms_per_step"] = sum(dc) / len(dc)
    cmp = [r["identical_to_none"] for r in rows if r.get("identical_to_none") is not None]
    if cmp:
        st["identical"] = sum(1 for x in cmp if x)
        st["n_compared"] = len(cmp)
    rl = [r["rouge_l_to_none"] for r in rows if r.get("rouge_l_to_none") is not None]
    st["rouge_l"] = sum(rl) / len(rl) if rl else None
    checked = [r["valid"] for r in rows if r.get("valid") is not None]   # constrained prompts' answers
    st["valid"] = sum(1 for x in checked if x) if checked else None
    st["n_checked"] = len(checked)
    return st


def pass_speedups(rows: list[dict], method: str) -> list[float]:
    """The method's speedup over `none` in each pass (bench --repeat) on its own."""
    out = []
    for rep in sorted({r.get("repeat", 0) for r in rows}):
        here = [r for r in rows if r.get("repeat", 0) == rep]
        a = method_stats([r for r in here if r["method"] == method])
        b = method_stats([r for r in here if r["method"] == "none"])
        if a["n"] and b["n"] and b["tokens_per_s"] > 0:
            out.append(a["tokens_per_s"] / b["tokens_per_s"])
    return out


CI_MIN_UNITS = 4
"""Fewest (prompt, pass) runs for which the report gives a confidence interval."""


def speedup_ci(rows: list[dict], method: str, level: float = 0.95, n_boot: int = 2000,
               seed: int = 0) -> tuple[float, float] | None:
    """A bootstrap confidence interval of the method's speedup over `none`.

    The unit is one (prompt, pass) pair with both runs, so each resample keeps
    a run beside the `none` run it was timed against.  With several passes the
    units are resampled within each prompt: the interval then says how far
    machine noise moves the speedup on these prompts (the drafts are the same
    in every pass).  With one pass the prompts themselves are resampled, so
    the interval also holds the spread between prompts.  The statistic is the
    pooled speedup, sum(tokens) / sum(decode_s) over sum(tokens) / sum(decode_s)
    of `none`, as in the tables.  None when fewer than CI_MIN_UNITS units."""
    def key(r):
        return r.get("question_id", r.get("prompt_index")), r.get("repeat", 0)

    base = {key(r): r for r in rows if r["method"] == "none" and key(r)[0] is not None}
    units: dict = {}
    several = len({k[1] for k in base}) > 1
    for r in rows:
        k = key(r)
        if r["method"] == method and k in base:
            b = base[k]
            units.setdefault(k[0] if several else None, []).append(
                (max(0, r["n_generated"] - 1), r["decode_s"], max(0, b["n_generated"] - 1), b["decode_s"]))
    if sum(len(v) for v in units.values()) < CI_MIN_UNITS:
        return None
    rng = np.random.default_rng(seed)
    tot = np.zeros((n_boot, 4))
    for group in units.values():
        a = np.asarray(group, np.float64)
        pick = rng.integers(0, len(a), size=(n_boot, len(a)))
        tot += a[pick].sum(axis=1)
    ok = (tot[:, 1] > 0) & (tot[:, 2] > 0)
    sp = (tot[ok, 0] / tot[ok, 1]) / (tot[ok, 2] / tot[ok, 3])
    if len(sp) == 0:
        return None
    lo, hi = np.quantile(sp, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
