"""`--kernels auto`: what exactness costs on this machine, and the choice.

`exact` keeps llama.cpp on CPU kernels under which a verification batch gives
logits bit-identical to one-token decoding (flash attention on, the tiled
K-quant product off, a q8_0 K cache with 2+ threads); `fast` lets it run its
fastest ones (flash attention off, the tiled product on).  What that costs
depends on the CPU and on what the process does: on an AVX-512/AMX Xeon
plain decoding was up to 1.5x faster with `fast`; on the 2-core AMD EPYC the
two decode within a few percent, but exact kernels read an app's prompt about
1.4x slower (issue 64).  What differs there is attention, not the matrix
product: with the tiled product on under exact's other settings prompts read
as slowly (54 against 51 tokens/s), and flash attention over a q8_0 K cache
is the slow part (over an f16 K cache it reads as fast as `fast`, 77 tokens/s,
but f16 needs one thread for one-token decodes to stay exact), measured
2026-12-02 (docs/exactness.md).  Half of an app's session is reading prompts.

So a price has three parts, each timed as several samples under both
settings at an app's shape (the recorded Aider sessions', benchmarks/sessions:
a request reads 450-980 new prompt tokens after up to 1,230 cached ones and
decodes at depths up to 1,700 cells): NEW prompt tokens after CACHED cached
ones, then one-token decodes and verification batches of 16 at that depth.
The choice weighs their ratios by APP_MIX, the share of a session's time each
takes (about 40% reading prompts), and keeps exact only where the samples say
it costs the app no more than fast (`choose`): a calibrated session must not
be slower than the first session's fast kernels.  A tie inside the noise goes
to the setting that reads prompts faster; a verdict inside the noise is timed
once more first.

Until a price is measured, `auto` on a CPU runs fast: on every machine
measured, fast was at most a few percent slower in any part and up to
1.5x-2.9x faster in some (the better bet), and serve, chat, the library and
the drop-in never wait for a timing at load.  The one-shot commands
(`generate`, `bench`, `calibrate`) time it, in two child processes (the
tiled product is a process-wide switch that llama.cpp reads once), several
seconds for a small model; the price is cached beside the calibration
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
TIMED = ("exact", "fast")         # the settings a price times, each in a child process
PARTS = ("prefill", "1", "16")    # a prompt token, a one-token decode, a verification batch of 16
# the share of an app session's time each part takes: prefill was 39% of
# Qwen2.5-Coder-0.5B's and 37% of the 1.5B's wall time over the recorded Aider
# sessions (BENCHMARKS.md, 2026-11-28), and a drafting decode spends its time
# about evenly between one-token decodes and verification batches
APP_MIX = {"prefill": 0.4, "1": 0.3, "16": 0.3}
# an app's shape (the recorded Aider sessions): a price timed after 512
# tokens said exact kernels read prompts 1.19x slower, the session read them
# 1.35x slower, where attention and the K cache weigh more (issue 64)
CACHED = 1024               # prompt tokens laid down untimed: the cached part of an app's prompt
NEW = 640                   # prompt tokens timed after them (one prefill call): the new part
PREFILL_REPS = 2            # the new part timed this many times (truncated back to CACHED between)
REPS = 5                    # timed decodes of each size, at depth CACHED + NEW (after one warm-up round)
CHILD_TIMEOUT_S = 900
VERSION = 3                 # 2: after 512 tokens, exact within 5% (app-shaped and no slower since 3: measured again)


def _median(xs) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


@dataclass
class KernelPrice:
    """Samples (seconds; prefill: per prompt token) of each part in PARTS
    under each setting in TIMED ({setting: {part: [...]}}), and the choice."""
    samples: dict
    choice: str
    measured_at: str = ""
    rounds: int = 1

    def median(self, setting: str, part: str) -> float:
        return _median(self.samples[setting][part])

    def ratio(self, part: str) -> float:
        """How much longer a part takes with exact kernels than fast (medians)."""
        return self.median("exact", part) / self.median("fast", part)

    def _mix(self, pick) -> float:
        return sum(w * pick(self.samples["exact"][p], self.samples["fast"][p]) for p, w in APP_MIX.items())

    def weighted(self) -> float:
        """What an app's mix costs with exact kernels over fast (medians)."""
        return self._mix(lambda e, f: _median(e) / _median(f))

    def weighted_range(self) -> tuple[float, float]:
        """The weighted ratio's range over the samples: each part's lowest
        exact over highest fast, and the reverse."""
        return self._mix(lambda e, f: min(e) / max(f)), self._mix(lambda e, f: max(e) / min(f))

    def in_noise(self) -> bool:
        """Whether the samples leave the verdict open (their range straddles fast's cost, 1)."""
        lo, hi = self.weighted_range()
        return lo <= 1.0 < hi

    def describe(self) -> str:
        return (f"exact kernels cost {self.ratio('prefill'):.2f}x fast on a prompt, {self.ratio('1'):.2f}x on a "
                f"one-token decode, {self.ratio('16'):.2f}x on a batch of 16; {self.weighted():.2f}x over an "
                f"app's mix: {self.choice}")

    def to_json(self) -> dict:
        return {"version": VERSION, "samples": self.samples, "choice": self.choice,
                "measured_at": self.measured_at, "rounds": self.rounds}

    @staticmethod
    def from_json(d: dict) -> KernelPrice:
        if d.get("version") != VERSION or d.get("choice") not in TIMED:
            raise ValueError("not a kernel price of this version")
        samples = {k: _samples(d["samples"][k]) for k in TIMED}
        return KernelPrice(samples, d["choice"], str(d.get("measured_at", "")), int(d.get("rounds", 1)))


def _samples(d: dict) -> dict:
    """{part: [positive seconds, ...]} for every part, or ValueError."""
    out = {p: [float(x) for x in d[p]] for p in PARTS}
    if any(not xs or min(xs) <= 0 for xs in out.values()):
        raise ValueError("a kernel price lacks a part")
    return out


def choose(samples: dict) -> str:
    """The verdict on {setting: {part: samples}}: exact where its whole range
    over the samples costs an app's mix no more than fast; fast where even
    its best case costs more; in between (a tie within the noise) the one
    that reads prompts faster.  So a calibrated session is never slower than
    fast's, as far as the samples can tell."""
    p = KernelPrice(samples, "fast")
    lo, hi = p.weighted_range()
    if hi <= 1.0:
        return "exact"
    if lo > 1.0:
        return "fast"
    return "exact" if p.median("exact", "prefill") < p.median("fast", "prefill") else "fast"


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
    """Time both settings (TIMED), each in a child process (timer), once
    more when the first round leaves the verdict inside the noise; cache and
    return the price.  progress(done, total) before the first child (done 0)
    and after each.  ConfigError when a child fails."""
    secs: dict = {k: {p: [] for p in PARTS} for k in TIMED}
    total, done = len(TIMED), 0
    if progress:
        progress(0, total)
    for rnd in (1, 2):
        for k in TIMED:
            for p, xs in timer(model_path, k, n_threads).items():
                secs[k][p] += xs
            done += 1
            if progress:
                progress(done, total)
        price = KernelPrice(secs, choose(secs), time.strftime("%Y-%m-%d %H:%M:%S"), rnd)
        if rnd == 2 or not price.in_noise():
            break
        total = 2 * len(TIMED)
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
    """In the child: load with these kernels; lay CACHED prompt tokens down,
    time NEW more (seconds per token; PREFILL_REPS times), then REPS decodes
    of 1 and 16 tokens at that depth, each after two one-token decodes (as
    a batch follows a plain step in generation), in interleaved rounds so
    that noise spreads over all of them."""
    import numpy as np

    from edgespec.backend.llama import LlamaBackend
    from edgespec.backend.settings import BackendSettings, Loadout
    from edgespec.calibration.curve import timed_chain

    load = Loadout.resolve(kernels, n_threads)      # on this CPU, as a run with these kernels loads
    be = LlamaBackend(model_path, BackendSettings(n_ctx=CACHED + NEW + 64, n_threads=n_threads, max_nodes=16,
                                                  max_leaves=1, load=load))
    rng = np.random.default_rng(0)
    try:
        out: dict = {p: [] for p in PARTS}
        pre = rng.integers(100, min(be.n_vocab, 20000), size=CACHED + NEW).astype(np.int32)
        be.prefill(pre[:32], want_last_logits=False)      # untimed: the weights' first touch
        be.reset()
        be.prefill(pre[:CACHED], want_last_logits=False)
        for _ in range(PREFILL_REPS):
            be.truncate(CACHED)
            t0 = be.clock()
            be.prefill(pre[CACHED:], want_last_logits=False)
            out["prefill"].append((be.clock() - t0) / NEW)
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
