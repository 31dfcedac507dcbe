"""`--kernels auto`: what exactness costs on this machine, and the choice.

`exact` keeps llama.cpp on CPU kernels under which a verification batch gives
logits bit-identical to one-token decoding (flash attention on, a q8_0 K
cache, the tiled K-quant product off); `fast` lets it run its fastest ones.
What that costs depends on the CPU: on an AVX-512/AMX Xeon plain decoding was
up to 1.5x faster with `fast`, on an AVX2 machine the two were within a few
percent (BENCHMARKS.md, "What does exactness cost?").  So `auto` measures
both once per model, machine and thread count and keeps exact where it is
within TOLERANCE of fast on a one-token decode and on a verification batch,
fast otherwise.

Each setting is timed in a fresh process: the tiled product is a
process-wide switch that llama.cpp reads once.  The verdict and both prices
are cached beside the calibration (`<key>.kernels.json`).  Under either
choice every committed token is the model's own argmax (or draw) under the
arithmetic it runs; only `exact` makes that arithmetic match one-token
decoding bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from edgespec.calibration.cache import cache_dir, calibration_key, write_cache
from edgespec.errors import ConfigError

KERNELS = ("auto", "exact", "fast")
ENV = "EDGESPEC_KERNELS"    # the default setting where none is given (else "auto")
TOLERANCE = 1.05            # exact is kept while it costs at most 5% more than fast
SIZES = (1, 16)             # a one-token decode and a verification batch
PREFIX = 1000               # KV cells before the timed decodes (a chat's context)
CHILD_TIMEOUT_S = 900
VERSION = 1


@dataclass
class KernelPrice:
    """Seconds per decode of each size in SIZES, under each setting, and the choice."""
    exact_s: dict
    fast_s: dict
    choice: str
    measured_at: str = ""

    def ratio(self, t: int) -> float:
        """How much longer a decode of t tokens takes with exact kernels than fast."""
        return self.exact_s[t] / self.fast_s[t]

    def describe(self) -> str:
        return (f"exact kernels cost {self.ratio(1):.2f}x fast on a one-token decode, "
                f"{self.ratio(SIZES[-1]):.2f}x on a batch of {SIZES[-1]}: {self.choice}")

    def to_json(self) -> dict:
        return {"version": VERSION, "exact_s": {str(k): v for k, v in self.exact_s.items()},
                "fast_s": {str(k): v for k, v in self.fast_s.items()}, "choice": self.choice,
                "measured_at": self.measured_at}

    @staticmethod
    def from_json(d: dict) -> KernelPrice:
        if d.get("version") != VERSION or d.get("choice") not in ("exact", "fast"):
            raise ValueError("not a kernel price of this version")
        ex = {int(k): float(v) for k, v in d["exact_s"].items()}
        fa = {int(k): float(v) for k, v in d["fast_s"].items()}
        if any(t not in ex or t not in fa or ex[t] <= 0 or fa[t] <= 0 for t in SIZES):
            raise ValueError("a kernel price lacks a size")
        return KernelPrice(ex, fa, d["choice"], str(d.get("measured_at", "")))


def choose(exact_s: dict, fast_s: dict) -> str:
    """exact where it costs at most TOLERANCE times fast at every size, else fast."""
    return "exact" if all(exact_s[t] <= TOLERANCE * fast_s[t] for t in SIZES) else "fast"


def _path(model_path: str, n_threads: int) -> str:
    key = calibration_key(model_path, 0, n_threads, extra="kernel-price")
    return os.path.join(cache_dir(), key + ".kernels.json")


def cached_price(model_path: str, n_threads: int) -> KernelPrice | None:
    try:
        with open(_path(model_path, n_threads)) as f:     # (a missing model file: None too)
            return KernelPrice.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measure_price(model_path: str, n_threads: int, progress=None) -> KernelPrice:
    """Time both settings, each in a child process; cache and return the price.
    progress(done, total) after each child.  ConfigError when a child fails."""
    secs = {}
    for i, k in enumerate(("exact", "fast")):
        cmd = [sys.executable, "-m", "edgespec.calibration.kernelchoice", model_path, k, str(n_threads)]
        env = dict(os.environ, GGML_CPU_TILED_MM="1" if k == "fast" else "0")
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"timing {k} kernels took over {CHILD_TIMEOUT_S} s; use --kernels exact or fast") from None
        if r.returncode != 0 or not r.stdout.strip():
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise ConfigError(f"timing {k} kernels failed ({tail}); use --kernels exact or fast")
        secs[k] = {int(t): float(s) for t, s in json.loads(r.stdout.strip().splitlines()[-1]).items()}
        if progress:
            progress(i + 1, 2)
    price = KernelPrice(secs["exact"], secs["fast"], choose(secs["exact"], secs["fast"]),
                        time.strftime("%Y-%m-%d %H:%M:%S"))
    write_cache(_path(model_path, n_threads), price.to_json())
    return price


def setting(kernels: str | None) -> str:
    """The setting asked for: `kernels`, else $EDGESPEC_KERNELS, else "auto"."""
    return kernels or os.environ.get(ENV) or "auto"


def resolve(kernels: str | None, model_path: str, n_threads: int, gpu: bool, measure: bool,
            progress=None) -> tuple[str, KernelPrice | None]:
    """The kernels to load with ("exact" or "fast") and the price behind an
    "auto" choice; None asks for setting(None).  On a GPU the setting changes
    nothing (llama.cpp's defaults are used either way): "exact".  "auto"
    without a cached price measures it when `measure`, else runs exact (price
    None) until something measures it."""
    kernels = setting(kernels)
    if kernels not in KERNELS:
        raise ConfigError(f"kernels must be one of {', '.join(KERNELS)}, not {kernels!r}")
    if kernels != "auto":
        return kernels, None
    if gpu:
        return "exact", None
    price = cached_price(model_path, n_threads)
    if price is None and measure:
        price = measure_price(model_path, n_threads, progress)
    return (price.choice if price else "exact"), price


def _time_one_setting(model_path: str, kernels: str, n_threads: int) -> dict:
    """In the child: load with these kernels, time decodes of each size."""
    import numpy as np

    from edgespec.backend.llama import LlamaBackend
    from edgespec.backend.process import kernel_options
    from edgespec.calibration.curve import measure_at

    be = LlamaBackend(model_path, n_ctx=2048, n_threads=n_threads, max_nodes=max(SIZES), max_leaves=1,
                      **kernel_options(kernels == "fast"))
    try:
        t1, rel, _ = measure_at(be, list(SIZES), PREFIX, 5, np.random.default_rng(0), lambda: None)
    finally:
        be.close()
    return {str(t): t1 * r for t, r in zip(SIZES, rel)}


if __name__ == "__main__":
    path, which, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps(_time_one_setting(path, which, threads)))
