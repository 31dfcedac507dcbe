"""Where a step's time goes (issue 51, item 1): `edgespec bench` with every part of a step timed apart.

    python tools/step_parts.py MODEL.gguf [bench options...] [--parts-out FILE]

Runs `edgespec bench` in this process (the same options: --prompts, --methods,
-ngl, --max-tokens, ...) with the engine's and the backend's step functions
wrapped in timers, then prints one JSON line per method: steps, tokens per
step, and milliseconds per step of each part:

  propose    the drafters (Engine._propose; grammar drafts included)
  choose     the cost gate's plan and the hold chooser's evidence (Gate.choose, Gate.judge_hold)
  seq_ops    decode_tree's KV bookkeeping before the decode (llama_memory_seq_rm/seq_cp) and batch filling
  launch     the llama_decode call itself (on CUDA it returns once the graph is queued)
  device     llama_synchronize right after it: the device's compute and the copy of the outputs
  logits     the view of the output rows (LlamaBackend.logits)
  verify     the walk of the tree over the logits on the host (argmax or sampling, grammar checks)
  keep       committing the accepted slots: llama_memory_seq_rm (LlamaBackend.keep)
  other      the rest of Engine._step (counting, committing text, the drafters' feedback, top-k records)
  step       Engine._step whole

The synchronize after llama_decode moves the device's time from wherever
llama.cpp would have waited (the logits read) into `device`; the step's total
does not change.  A timer costs about a microsecond a call.  llama-server
methods run as usual (their steps are not edgespec's and are not timed).
"""
from __future__ import annotations

import functools
import json
import signal
import sys
import time
from collections import defaultdict

PARTS = ("propose", "choose", "seq_ops", "launch", "device", "logits", "verify", "keep", "other", "step")
acc: dict = defaultdict(lambda: defaultdict(float))
state = {"method": None}


def timed(cls, name: str, part: str) -> None:
    """Wrap cls.name so its inclusive time adds to `part` of the current method."""
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            a = acc[state["method"]]
            if a.get("_in_step"):   # calls outside a step (prefill, calibration slices) are not a step's
                a[part] += time.perf_counter() - t0
    setattr(cls, name, wrapper)


def instrument() -> None:
    import llama_cpp as L

    from edgespec.backend.llama import LlamaBackend
    from edgespec.bench import runner
    from edgespec.core.engine import Engine
    from edgespec.core.gate import Gate

    for cls, name, part in ((Engine, "_propose", "propose"), (Gate, "choose", "choose"),
                            (Gate, "judge_hold", "choose"), (LlamaBackend, "decode_tree", "tree"),
                            (LlamaBackend, "logits", "logits"), (Engine, "_verify", "verify"),
                            (LlamaBackend, "keep", "keep"), (Engine, "_step", "step")):
        timed(cls, name, part)
    decode = LlamaBackend._decode

    def split_decode(self, n):
        t0 = time.perf_counter()
        decode(self, n)
        t1 = time.perf_counter()
        L.llama_synchronize(self.ctx)
        a = acc[state["method"]]
        if a.get("_in_step"):       # prefill's decodes are not a step's
            a["launch"] += t1 - t0
            a["device"] += time.perf_counter() - t1
            a["in_tree"] += time.perf_counter() - t0
    LlamaBackend._decode = split_decode
    step = Engine._step

    def counted_step(self, st):
        a = acc[state["method"]]
        a["steps"] += 1
        a["_in_step"] = 1.0
        try:
            return step(self, st)
        finally:
            a["_in_step"] = 0.0
    Engine._step = counted_step
    run = runner._Methods.run

    def run_method(self, m, *a, **k):
        state["method"] = None if state.get("warming") else m
        r = run(self, m, *a, **k)
        acc[state["method"]]["tokens"] += r.get("n_generated") or 0
        return r
    runner._Methods.run = run_method
    warm_up = runner._warm_up

    def untimed_warm_up(*a, **k):     # the warm-up's first steps compile kernels: not timed
        state["warming"] = True
        try:
            return warm_up(*a, **k)
        finally:
            state["warming"] = False
    runner._warm_up = untimed_warm_up


def report() -> list[dict]:
    rows = []
    for m, a in acc.items():
        if m is None or not a["steps"]:
            continue
        n = a["steps"]
        parts = {"seq_ops": a["tree"] - a["in_tree"]}
        parts.update({p: a[p] for p in ("propose", "choose", "launch", "device", "logits", "verify", "keep", "step")})
        parts["other"] = a["step"] - sum(parts[p] for p in PARTS if p not in ("other", "step"))
        rows.append({"method": m, "steps": int(n), "tokens_per_step": round(a["tokens"] / n, 3),
                     **{f"{p}_ms": round(parts[p] / n * 1e3, 4) for p in PARTS}})
    return rows


def main(argv: list[str]) -> None:
    out = None
    if "--parts-out" in argv:
        i = argv.index("--parts-out")
        out = argv[i + 1]
        del argv[i:i + 2]
    # a timeout's SIGTERM still writes what was timed (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    instrument()
    from edgespec.app.cli import main as cli
    try:
        cli.main(["bench", *argv], standalone_mode=False)
    finally:
        rows = report()
        text = "\n".join(json.dumps(r) for r in rows)
        print("\n# step parts (ms per step)\n" + text, flush=True)
        if out:
            with open(out, "w") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
