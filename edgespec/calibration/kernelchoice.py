"""`--kernels auto`: what exactness costs on this machine, and the choice.

`exact` keeps llama.cpp on CPU kernels under which a verification batch gives
logits bit-identical to one-token decoding (flash attention on, the tiled
K-quant product off); `fast` lets it run its fastest ones.  What that costs
depends on the CPU and on what the process does: on an AVX-512/AMX Xeon
plain decoding was up to 1.5x faster with `fast`; on the 2-core AMD EPYC the
two decode within a few percent, but exact kernels read a prompt 1.5x
(Qwen2.5-Coder-0.5B) to 2.9x (1.5B) slower (issue 56), and half of an app's
session is reading prompts.

So a price has three parts, each timed as several samples under both
settings: a prompt token (prefill), a one-token decode and a verification
batch of 16, after a chat-sized context.  The choice weighs their ratios by
APP_MIX, the share of a session's time each takes in the recorded app
sessions (benchmarks/sessions: about 40% reading prompts), and keeps exact where
that costs at most TOLERANCE more than fast.  Where decoding ties, the prompt
decides.  A verdict that sits inside the noise (the weighted ratio's range
over the samples straddles TOLERANCE) is timed once more and decided on all
samples, so it does not flip on one noisy run.

Until a price is measured, `auto` on a CPU runs fast: on every machine
measured, fast was at most a few percent slower in any part and up to
1.5x-2.9x faster in some (the better bet), and serve, chat, the library and
the drop-in never wait for a timing at load.  The one-shot
commands (`generate`, `bench`, `calibrate`) time it, in two child processes
(the tiled product is a process-wide switch that llama.cpp reads once), a
few seconds for a small model; the price is cached beside the calibration
(`<key>.kernels.json`) and every later load reads it.  Under either choice
every committed token is the model's own argmax (or draw) under the
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
TOLERANCE = 1.05            # exact is kept while the app mix costs at most 5% more than fast
PARTS = ("prefill", "1", "16")    # a prompt token, a one-token decode, a verification batch of 16
# the share of an app session's time each part takes: prefill was 39% of
# Qwen2.5-Coder-0.5B's and 37% of the 1.5B's wall time over the recorded Aider
# sessions (BENCHMARKS.md, 2026-11-28), and a drafting decode spends its time
# about evenly between one-token decodes and verification batches
APP_MIX = {"prefill": 0.4, "1": 0.3, "16": 0.3}
PREFIX = 512                # prompt tokens, timed in chunks, before the timed decodes
CHUNK = 128                 # prompt tokens a timed prefill chunk
REPS = 5                    # timed decodes of each size (after one warm-up round)
CHILD_TIMEOUT_S = 900
VERSION = 2                 # 1: decodes only (its verdicts ignored the prompt: measured again)


def _median(xs) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


@dataclass
class KernelPrice:
    """Samples (seconds; prefill: per prompt token) of each part in PARTS under
    each setting, and the choice."""
    exact_s: dict
    fast_s: dict
    choice: str
    measured_at: str = ""
    rounds: int = 1

    def ratio(self, part: str) -> float:
        """How much longer a part takes with exact kernels than fast (medians)."""
        return _median(self.exact_s[part]) / _median(self.fast_s[part])

    def weighted(self) -> float:
        """What the app mix costs with exact kernels over fast."""
        return sum(w * self.ratio(p) for p, w in APP_MIX.items())

    def weighted_range(self) -> tuple[float, float]:
        """The weighted ratio's range over the samples: each part's lowest exact
        over highest fast, and the reverse."""
        lo = sum(w * min(self.exact_s[p]) / max(self.fast_s[p]) for p, w in APP_MIX.items())
        hi = sum(w * max(self.exact_s[p]) / min(self.fast_s[p]) for p, w in APP_MIX.items())
        return lo, hi

    def in_noise(self) -> bool:
        """Whether the samples leave the verdict open (their range straddles TOLERANCE)."""
        lo, hi = self.weighted_range()
        return lo <= TOLERANCE < hi

    def describe(self) -> str:
        return (f"exact kernels cost {self.ratio('prefill'):.2f}x fast on a prompt, {self.ratio('1'):.2f}x on a "
                f"one-token decode, {self.ratio('16'):.2f}x on a batch of 16; {self.weighted():.2f}x over an "
                f"app's mix: {self.choice}")

    def to_json(self) -> dict:
        return {"version": VERSION, "exact_s": self.exact_s, "fast_s": self.fast_s, "choice": self.choice,
                "measured_at": self.measured_at, "rounds": self.rounds}

    @staticmethod
    def from_json(d: dict) -> KernelPrice:
        if d.get("version") != VERSION or d.get("choice") not in ("exact", "fast"):
            raise ValueError("not a kernel price of this version")
        ex, fa = _samples(d["exact_s"]), _samples(d["fast_s"])
        return KernelPrice(ex, fa, d["choice"], str(d.get("measured_at", "")), int(d.get("rounds", 1)))


def _samples(d: dict) -> dict:
    """{part: [positive seconds, ...]} for every part, or ValueError."""
    out = {p: [float(x) for x in d[p]] for p in PARTS}
    if any(not xs or min(xs) <= 0 for xs in out.values()):
        raise ValueError("a kernel price lacks a part")
    return out


def choose(exact_s: dict, fast_s: dict) -> str:
    """exact where the app mix costs at most TOLERANCE times fast's (medians), else fast."""
    return "exact" if KernelPrice(exact_s, fast_s, "exact").weighted() <= TOLERANCE else "fast"


def _path(model_path: str, n_threads: int) -> str:
    key = calibration_key(model_path, 0, n_threads, extra="kernel-price")
    return os.path.join(cache_dir(), key + ".kernels.json")


def cached_price(model_path: str, n_threads: int) -> KernelPrice | None:
    try:
        with open(_path(model_path, n_threads)) as f:     # (a missing model file: None too)
            return KernelPrice.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _time_in_child(model_path: str, kernels: str, n_threads: int) -> dict:
    """{part: [seconds, ...]} of one setting, timed in a fresh process."""
    cmd = [sys.executable, "-m", "edgespec.calibration.kernelchoice", model_path, kernels, str(n_threads)]
    env = dict(os.environ, GGML_CPU_TILED_MM="1" if kernels == "fast" else "0")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"timing {kernels} kernels took over {CHILD_TIMEOUT_S} s; use --kernels exact or fast") from None
    if r.returncode != 0 or not r.stdout.strip():
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"timing {kernels} kernels failed ({tail}); use --kernels exact or fast")
    return _samples(json.loads(r.stdout.strip().splitlines()[-1]))


def measure_price(model_path: str, n_threads: int, progress=None, timer=_time_in_child) -> KernelPrice:
    """Time both settings, each in a child process (timer), once more when
    the first round leaves the verdict inside the noise; cache and return the
    price.  progress(done, total) before the first child (done 0) and after
    each.  ConfigError when a child fails."""
    secs: dict = {"exact": {p: [] for p in PARTS}, "fast": {p: [] for p in PARTS}}
    total, done = 2, 0
    if progress:
        progress(0, total)
    for rnd in (1, 2):
        for k in ("exact", "fast"):
            for p, xs in timer(model_path, k, n_threads).items():
                secs[k][p] += xs
            done += 1
            if progress:
                progress(done, total)
        price = KernelPrice(secs["exact"], secs["fast"], choose(secs["exact"], secs["fast"]),
                            time.strftime("%Y-%m-%d %H:%M:%S"), rnd)
        if rnd == 2 or not price.in_noise():
            break
        total = 4
    write_cache(_path(model_path, n_threads), price.to_json())
    return price


def auto_choice(model_path: str, n_threads: int, measure: bool, progress=None) -> tuple[str, KernelPrice | None]:
    """The kernels "auto" loads with on a CPU ("exact" or "fast") and the price
    behind the choice: the cached price's; without one, measured now when
    `measure`, else fast (price None) until something measures it.  The
    setting itself, and the offloaded case, are edgespec.run.kernels'."""
    price = cached_price(model_path, n_threads)
    if price is None and measure:
        price = measure_price(model_path, n_threads, progress)
    return (price.choice if price else "fast"), price


def _time_one_setting(model_path: str, kernels: str, n_threads: int) -> dict:
    """In the child: load with these kernels; time PREFIX prompt tokens in
    chunks (seconds per token each), then REPS decodes of 1 and of 16 tokens
    after them, each after two one-token decodes (as a batch follows a plain
    step in generation), in interleaved rounds so that noise spreads over both."""
    import numpy as np

    from edgespec.backend.llama import LlamaBackend
    from edgespec.backend.settings import BackendSettings, Loadout
    from edgespec.calibration.curve import timed_chain

    load = Loadout.resolve(kernels, n_threads)      # on this CPU, as a run with these kernels loads
    be = LlamaBackend(model_path, BackendSettings(n_ctx=2048, n_threads=n_threads, max_nodes=16, max_leaves=1,
                                                  load=load))
    rng = np.random.default_rng(0)
    try:
        out: dict = {"prefill": [], "1": [], "16": []}
        pre = rng.integers(100, min(be.n_vocab, 20000), size=PREFIX).astype(np.int32)
        be.prefill(pre[:32], want_last_logits=False)      # untimed: the weights' first touch
        be.reset()
        for i in range(0, PREFIX, CHUNK):
            t0 = be.clock()
            be.prefill(pre[i:i + CHUNK], want_last_logits=False)
            out["prefill"].append((be.clock() - t0) / CHUNK)
        one = np.full(1, 500, np.int32)
        for r in range(REPS + 1):           # the first round is a warm-up
            for t in (1, 16):
                timed_chain(be, one)
                timed_chain(be, one)
                dt = timed_chain(be, rng.integers(100, min(be.n_vocab, 20000), size=t).astype(np.int32))
                if r:
                    out[str(t)].append(dt)
    finally:
        be.close()
    return out


if __name__ == "__main__":
    path, which, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps(_time_one_setting(path, which, threads)))
