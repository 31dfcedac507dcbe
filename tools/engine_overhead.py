"""Measure edgespec's own work per step (everything outside llama_decode) for
16-node (or --nodes) verification trees.

    python tools/engine_overhead.py [--nodes 16] [--steps 200] [--prompts FILE.jsonl]

Two cases, both with the cost gate off so that every step verifies a full tree:

  copy       a prompt that repeats one passage; the suffix drafter proposes a
             `nodes`-deep chain that is almost always accepted whole (about 15
             tokens per step): the worst case for the per-token work of the walk
             (one argmax over the vocabulary per accepted position).
  realistic  dev prompts (first turns, chat template) with the suffix drafter
             matching from one token on (min_match 1, 16 matches), so that most
             steps verify a wide tree of `nodes` nodes that is accepted as often
             as real drafts are (1-2 tokens per step).

Reported per case: steps, mean batch size, mean tokens per step, engine ms/step
(drafting, gate, layout, verification walk, text, bookkeeping) and llama_decode
ms/step.
"""
from __future__ import annotations

import argparse
import os

from edgespec import EngineConfig, SpecModel
from edgespec.drafters import make_drafter
from edgespec.core.engine import Engine, drain
from edgespec.core.params import Request

PASSAGE = ("The committee met on Tuesday to review the budget. It approved the new library, "
           "delayed the road repairs, and asked for a report on the water supply by March. ")
DEV = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "spec_bench_dev.jsonl")


def measure(eng: Engine, prompts, steps: int, max_tokens: int) -> str:
    n_steps = nodes = gen = 0
    eng_s = dec_s = 0.0
    i = 0
    while n_steps < steps:
        r = drain(eng.run(eng.resolve(Request(prompts[i % len(prompts)], max_tokens=max_tokens, reuse_prefix=False))))
        i += 1
        n_steps += r.n_steps
        nodes += r.n_draft_nodes + r.n_steps
        gen += r.n_generated
        eng_s += r.engine_s
        dec_s += r.decode_call_s
    return (f"{n_steps} steps, mean batch {nodes / n_steps:.1f} tokens, {gen / n_steps:.2f} tokens/step: "
            f"engine {eng_s / n_steps * 1000:.3f} ms/step, llama_decode {dec_s / n_steps * 1000:.2f} ms/step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default=DEV, help="Spec-Bench style JSONL for the realistic case")
    ap.add_argument("--case", choices=["copy", "realistic", "both"], default="both")
    a = ap.parse_args()
    m = SpecModel(a.model, drafter="none")
    cfg = EngineConfig(max_nodes=a.nodes + 1, cost_gate=False)
    if a.case in ("copy", "both"):
        eng = Engine(m.backend, make_drafter("suffix", max_depth=a.nodes, max_nodes=a.nodes), m.cost, cfg)
        toks = m.prompt_tokens(PASSAGE * 12, raw=True)
        drain(eng.run(eng.resolve(Request(toks, max_tokens=16, reuse_prefix=False))))                       # warm-up
        print("copy:     ", measure(eng, [toks], a.steps, 256))
    if a.case in ("realistic", "both"):
        from edgespec.bench.prompts import load_prompts
        eng = Engine(m.backend, make_drafter("suffix", min_match=1, max_matches=16, max_nodes=a.nodes),
                     m.cost, cfg)
        prompts = [m.prompt_tokens(p.turn) for p in load_prompts(a.prompts)][::7]
        drain(eng.run(eng.resolve(Request(prompts[0], max_tokens=16, reuse_prefix=False))))                 # warm-up
        print("realistic:", measure(eng, prompts, a.steps, 64))


if __name__ == "__main__":
    main()
