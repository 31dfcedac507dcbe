"""`edgespec calibrate`: measure the verify cost c(T), the exactness self-check and
the kernel choice again for a model on this machine, and cache them."""
from __future__ import annotations

import json
import os

import click

from edgespec.app.cli.loading import calibration_note, load_model, remeasure_kernel_price
from edgespec.app.cli.options import backend_options, complete_model, model_options, run_config_options, user_errors
from edgespec.app.cli.output import calibration_line, json_default, kernels_line


@click.command()
@click.argument("model", required=False, shell_complete=complete_model)
@model_options
@backend_options
@click.option("--json", "as_json", is_flag=True, help="Print the curve as JSON.")
@run_config_options
def calibrate(model, config, as_json):
    """Re-measure the verify cost c(T) of MODEL on this machine and cache it.

    c(T) is the time of one llama_decode of T tokens over the time of one token;
    the cost gate uses it to decide how many draft tokens are worth verifying.
    """
    config = config.but(drafter="none", calibrate=False)
    if config.times_kernels():
        with user_errors():
            remeasure_kernel_price(model, config.n_threads, note=not as_json)
    m = load_model(model, config)
    try:
        if not as_json:
            click.echo(f"measuring c(T) for {m.model_path} with {m.backend.n_threads} threads, "
                       f"K cache {m.backend.cache_type_k}...", err=True)
        with user_errors():
            curve = m.calibrate(remeasure=True, progress=None if as_json else calibration_note(None))
        if as_json:
            d = curve.to_json()
            d["exactness"] = m.exactness.to_json() if m.exactness is not None else None
            d["kernels"] = {"setting": m.kernels_setting, "resolved": m.kernels,
                            "price": m.kernel_price.to_json() if m.kernel_price is not None else None}
            click.echo(json.dumps(d, default=json_default))
        else:
            click.echo(curve.describe())
            if m.exactness is not None:
                click.echo(m.exactness.describe())
            click.echo(calibration_line(m))
            click.echo(kernels_line(m))
            path = curve.meta.get("cache_file", "?")
            click.echo(f"cached in {path}" if os.path.isfile(path) else f"NOT cached (could not write {path})")
    finally:
        m.close()
