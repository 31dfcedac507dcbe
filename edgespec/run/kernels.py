"""The kernels and the K cache a model loads with: resolved here, once, for
every command, the library, the drop-in and the bench.

`loadout(run, model_path)` turns a run's `kernels` ("auto", "exact", "fast";
None: $EDGESPEC_KERNELS, else auto) and `cache_type_k` ("auto", "f16",
"q8_0") into what llama.cpp is given.  "auto" kernels on a CPU take a cached
price's verdict (edgespec.calibration.kernelchoice: the prompt, one-token
decodes and batches weighed as an app spends its time), measure it first when
asked to (`measure`, the one-shot commands), and otherwise run fast until
something measures it; with layers offloaded (a GPU, RPC workers) the
setting changes nothing and is reported as exact.  "auto" K cache follows
the kernels (backend.process.auto_cache_type_k).  A Loadout says where its
kernels came from, so the commands can print it.
"""
from __future__ import annotations

from dataclasses import dataclass

from edgespec.backend.ggml import parse_endpoints
from edgespec.backend.process import auto_cache_type_k, default_threads
from edgespec.calibration.kernelchoice import KernelPrice, resolve, setting


@dataclass(frozen=True)
class Loadout:
    """setting: what was asked ("auto", "exact", "fast"); kernels: what loads
    ("exact" or "fast"); cache_type_k: "f16" or "q8_0"; price: the measurement
    behind an auto verdict (None: asked for, offloaded, or not measured yet);
    source: "asked", "offloaded", "measured" or "untimed"."""
    setting: str
    kernels: str
    cache_type_k: str
    price: KernelPrice | None
    source: str


def loadout(run, model_path: str, measure: bool | None = None, progress=None) -> Loadout:
    """The Loadout of RunConfig `run` for `model_path`.  measure: time an auto
    choice that is not cached (None: when run.calibrate is True); progress(done,
    total) after each timing child."""
    threads = run.n_threads or default_threads()
    rpc = bool(parse_endpoints(run.rpc))
    offloaded = bool(run.n_gpu_layers or rpc)
    asked = setting(run.kernels)
    kernels, price = resolve(run.kernels, model_path, threads, gpu=offloaded,
                             measure=run.calibrate is True if measure is None else measure, progress=progress)
    source = ("asked" if asked != "auto" else "offloaded" if offloaded
              else "measured" if price is not None else "untimed")
    k = run.cache_type_k
    if k in (None, "auto"):
        # the backend's own rule (backend/llama.py applies the same to "auto"), given what loads
        exact = kernels == "exact" and (not run.n_gpu_layers or rpc)
        k = auto_cache_type_k(exact, threads, fast_cpu=kernels == "fast" and not offloaded)
    return Loadout(asked, kernels, k, price, source)
