"""Every exact-mode combination of the papers' published mechanisms is
lossless: greedy output token-identical to `--drafter none` through the same
backend (real SmolLM2 GGUF, real llama.cpp), with every proposed node
verified (the cost gate off: the drafts' own trees reach the batch, the
hardest case), and for all of them at once also with the gate on (the
default: the gate picks a subtree of the same drafts)."""
from __future__ import annotations

import pytest

from conftest import dev_prompts

pytestmark = pytest.mark.model

COMBOS = [
    "auto+branch-nobranch_depth+copy_len=30",          # AdaPLD branch + successor drafting, long copies
    "auto+semantic-nosemantic_pair",                   # AdaPLD semantic fallback
    "auto+branch+rerank",                            # AdaPLD hidden-state rerank (llama.cpp's hidden states)
    "auto+trigger+feedback-noentropy-noema",             # ReSpec trigger and feedback selection
    "auto+aasd",                                     # AASD alignment sampling, prompt-marked drafts
    "auto+graft-nograft_tail",                         # Graft prune-then-graft
    "auto+branch+semantic+rerank+trigger+feedback+aasd+graft+copy_len=30"   # all of them at once
    "-nobranch_depth-nosemantic_pair-noentropy-noema-nograft_tail",
]


@pytest.fixture(scope="module")
def references(model):
    out = []
    for row in dev_prompts(504, 124):   # rag (past 512 cells), coding: where copies run long
        toks = model.prompt_tokens([{"role": "user", "content": row["turns"][0]}])
        out.append((row["question_id"], toks, model.generate(toks, max_tokens=40, drafter="none").tokens))
    return out


@pytest.mark.parametrize("name", COMBOS)
def test_published_mechanisms_are_lossless(model, references, name):
    eng = model.engine_for(name)
    try:
        for gate in ((False, True) if name == COMBOS[-1] else (False,)):
            eng.config.cost_gate = gate
            for qid, toks, ref in references:
                r = model.generate(toks, max_tokens=40, drafter=name)
                assert r.tokens == ref, (qid, gate)
    finally:
        eng.config.cost_gate = True
        model.backend.set_hidden(False)
