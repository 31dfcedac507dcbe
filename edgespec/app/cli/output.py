"""The lines the commands print about a model and a result.

The --stats block, where the calibration comes from, the kernels in use, the
acceptance table, the exactness notice, streamed text made safe for a
terminal and numpy values made JSON: shared by generate, chat, serve and
calibrate, so each says the same thing the same way.
"""
from __future__ import annotations

import sys

import click


def kernels_line(model) -> str:
    """One line: the kernels in use and, for --kernels auto, why."""
    p = getattr(model, "kernel_price", None)
    if getattr(model, "kernels_setting", model.kernels) != "auto":
        return f"kernels: {model.kernels} (--kernels {model.kernels})"
    if p is None:
        return (f"kernels: auto -> {model.kernels}" + ("" if model.backend.n_gpu_layers else
                " (the better bet until what exactness costs here is measured: `edgespec calibrate` measures it)"))
    return f"kernels: auto -> {model.kernels} ({p.describe()})"


def json_default(o):
    """json.dumps' default: numpy scalars and arrays as Python numbers and lists."""
    try:
        import numpy as np
        if isinstance(o, np.integer):
            return int(o)
        if isinstance(o, np.floating):
            return float(o)
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def stats_lines(result, model) -> list[str]:
    """The --stats block: summary, step counts, time split, acceptance calibration."""
    r = result
    lines = [r.summary()]
    rate = f" ({r.n_draft_accepted / r.n_draft_nodes:.0%})" if r.n_draft_nodes else ""
    if model.exactness is not None:
        lines.append(model.exactness.describe())
    lines.append(f"drafter: {r.drafter}, cost gate: {'on' if model.config.cost_gate else 'off'}; "
                 f"steps: {r.n_steps}, steps with drafts: {r.n_draft_steps}, draft nodes verified: "
                 f"{r.n_draft_nodes}, accepted: {r.n_draft_accepted}{rate}, carried: {r.n_carried}")
    if r.constrained:
        lines.append(f"constrained by a grammar: every token chosen among those it admits; "
                     f"steps that drafted forced text: {r.n_forced}")
    if r.n_steps:
        lines.append(f"time per step: llama_decode {r.decode_call_s / r.n_steps * 1000:.2f} ms, "
                     f"engine {r.engine_s / r.n_steps * 1000:.2f} ms")
    lines.append(calibration_line(model))
    lines.append(kernels_line(model))
    if model.cost is not None:
        lines.append(model.cost.describe())
    lines += acceptance_lines(model)
    return lines


CALIBRATION_STATES = {
    "cached": "c(T) and the self-check from the calibration cache",
    "measured": "c(T) and the self-check measured by this process (and cached)",
    "measuring": "measuring c(T) and the self-check in the background, between requests; until then a "
                 "quick c(T) measured at load (one context) and exactness not yet known",
    "built-in": "the quick c(T) measured at load (the background calibration did not finish; `edgespec "
                "calibrate` measures the full one)",
    "off": "not calibrated (c(T) = T assumed)",
}


def calibration_line(model) -> str:
    """One line: where the model's c(T) and exactness verdict come from."""
    state = getattr(model, "calibration_state", "cached")
    line = f"calibration: {state}: {CALIBRATION_STATES.get(state, state)}"
    err = getattr(model, "calibration_error", None)
    return line + (f" ({err})" if err is not None and state == "built-in" else "")


def acceptance_lines(model) -> list[str]:
    rows = model.engine.acceptance.report()
    if not rows:
        return ["acceptance calibration: no draft nodes verified yet"]
    out = ["acceptance calibration (per drafter source and score bucket):",
           f"  {'source':<10} {'score':<9} {'tested':>7} {'predicted':>10} {'observed':>9}"]
    for row in rows:
        out.append(f"  {row['source']:<10} {row['score']:<9} {row['tested']:>7} "
                   f"{row['predicted']:>10.3f} {row['observed']:>9.3f}")
    return out


def exactness_notice(model) -> str | None:
    """One line for stderr when the self-check found batched logits not
    bit-identical to one-token decoding on this model (None otherwise)."""
    r = model.exactness
    if r is None or r.exact:
        return None
    where = "on this model and machine"
    if getattr(model, "kernels", "exact") == "fast":
        where = ("with --kernels fast" if getattr(model, "kernels_setting", "fast") == "fast"
                 else "with the fast kernels --kernels auto chose here")
    return (f"note: {where} a verification batch's logits differ from one-token decoding "
            f"(by up to {r.max_abs_diff:.2g}): greedy output can differ from --drafter none where the two top "
            f"tokens nearly tie (README: what lossless means)")


def echo_stream(piece: str) -> None:
    """A streamed piece of the answer on stdout, control characters made visible on a terminal."""
    from edgespec.app.termsafe import visible

    click.echo(visible(piece) if sys.stdout.isatty() else piece, nl=False)
