"""The kernels and the K cache a model loads with: resolved here, once, for
every command, the library, the drop-in and the bench.

`loadout(run, model_path)` turns a run's `kernels` ("auto", "exact", "fast";
None: $EDGESPEC_KERNELS, else auto: `setting`, the only reader of that
variable) and `cache_type_k` ("auto", "f16", "q8_0") into the Loadout
llama.cpp is given (backend/settings.py: its fields, and Loadout.resolve,
the rules per hardware).  "auto" kernels on a CPU take a cached price's
verdict (edgespec.calibration.kernelchoice: the prompt, one-token decodes and
batches weighed as an app spends its time), measure it first when asked to
(`measure`, the one-shot commands), and otherwise run fast until something
measures it; with layers offloaded (a GPU, RPC workers) the setting changes
nothing and is reported as exact (`times_kernels` says which runs time it).
A Loadout says where its kernels came from, so the commands can print it.
"""
from __future__ import annotations

import os

from edgespec.backend.ggml import parse_endpoints
from edgespec.backend.process import default_threads
from edgespec.backend.settings import Loadout, is_offloaded
from edgespec.calibration.kernelchoice import KERNELS, auto_choice
from edgespec.errors import ConfigError

__all__ = ["ENV", "Loadout", "loadout", "setting", "times_kernels"]

ENV = "EDGESPEC_KERNELS"    # the default setting where none is given (else "auto")


def setting(kernels: str | None) -> str:
    """The setting asked for: `kernels`, else $EDGESPEC_KERNELS, else "auto"
    (ConfigError for anything but KERNELS)."""
    asked = kernels or os.environ.get(ENV) or "auto"
    if asked not in KERNELS:
        raise ConfigError(f"kernels must be one of {', '.join(KERNELS)}, not {asked!r}")
    return asked


def times_kernels(run) -> bool:
    """Whether RunConfig `run`'s kernels are chosen by timing exact against
    fast ones here: kernels "auto" (as set or from $EDGESPEC_KERNELS) on a CPU."""
    return setting(run.kernels) == "auto" and not is_offloaded(run.n_gpu_layers, parse_endpoints(run.rpc))


def loadout(run, model_path: str, measure: bool | None = None, progress=None) -> Loadout:
    """The Loadout of RunConfig `run` for `model_path`.  measure: time an auto
    choice that is not cached (None: when run.calibrate is True); progress(done,
    total) after each timing child."""
    threads = run.n_threads or default_threads()
    asked = setting(run.kernels)
    price = None
    if asked != "auto":
        kernels, source = asked, "asked"
    elif not times_kernels(run):      # offloaded: llama.cpp's defaults either way
        kernels, source = "exact", "offloaded"
    else:
        kernels, price = auto_choice(model_path, threads, measure=run.calibrate is True if measure is None
                                     else measure, progress=progress)
        source = "measured" if price is not None else "untimed"
    return Loadout.resolve(kernels, threads, run.n_gpu_layers, bool(parse_endpoints(run.rpc)), run.cache_type_k,
                           setting=asked, price=price, source=source)
