"""Measure edgespec's own work per step (everything outside llama_decode) for
forced tree sizes, with the real suffix drafter proposing full trees.

    python tools/engine_overhead.py [--nodes 16] [--steps 200]

The prompt repeats a passage so the suffix drafter always has long matches; the
cost gate is off and max_nodes = nodes + 1, so every step verifies a tree of
`nodes` draft nodes (or as many as the drafter found).  Reported: mean batch
size, engine ms/step (drafting, gate, layout, verification, bookkeeping) and
llama_decode ms/step.
"""
from __future__ import annotations

import argparse

from edgespec import EngineConfig, SpecModel
from edgespec.drafters import make_drafter
from edgespec.engine import Engine, drain

PASSAGE = ("The committee met on Tuesday to review the budget. It approved the new library, "
           "delayed the road repairs, and asked for a report on the water supply by March. ")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    m = SpecModel(a.model, drafter="none")
    eng = Engine(m.backend, make_drafter("suffix", max_depth=a.nodes, max_nodes=a.nodes), m.cost,
                 EngineConfig(max_nodes=a.nodes + 1, cost_gate=False))
    toks = m.prompt_tokens(PASSAGE * 12, raw=True)
    steps = nodes = 0
    eng_s = dec_s = 0.0
    while steps < a.steps:
        r = drain(eng.run(toks, max_tokens=256))
        steps += r.n_steps
        nodes += r.n_draft_nodes + r.n_steps
        eng_s += r.engine_s
        dec_s += r.decode_call_s
    print(f"{steps} steps, mean batch {nodes / steps:.1f} tokens (root + drafts): "
          f"engine {eng_s / steps * 1000:.3f} ms/step, llama_decode {dec_s / steps * 1000:.2f} ms/step")


if __name__ == "__main__":
    main()
