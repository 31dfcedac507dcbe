"""AASD as published: the entropy-adaptive threshold of conditional
verification (verify.py, mode "entropy"), relaxing only prompt-retrieved and
alignment-sampled tokens, and alignment sampling at misaligned prompt
positions only (drafters/branch.py): worked examples."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgespec.drafters.base import Drafter
from edgespec.drafters.branch import BranchDrafter
from edgespec.drafters.suffix import SuffixConfig, SuffixDrafter
from edgespec.core.engine import Engine, drain
from edgespec.core.tree import SOURCE_ALIGN, SOURCE_BRANCH, SOURCE_CONTEXT, SOURCE_PROMPT, DraftTree
from edgespec.core.verify import VerifyConfig, aasd_threshold, relaxed_accepts

from conftest import dev_prompts
from test_anchor import branch_tree, rankings

I32 = np.int32


def logits(p):
    return np.log(np.asarray(p, np.float64)).astype(np.float32)


def test_threshold_rises_with_entropy_and_is_capped_by_the_top_probability():
    cfg = VerifyConfig("entropy")               # alpha 0.1, beta 0.1, no look-ahead
    assert (cfg.alpha, cfg.beta, cfg.lookahead) == (0.1, 0.1, 0)
    # a confident row: p = 0.81, 0.19.  H = 0.486 nats, delta = 0.1 * 0.486 + 0.1 = 0.149:
    # the runner-up (0.19) clears it
    sure = logits([0.81, 0.19])
    assert aasd_threshold(sure, 0.1, 0.1) == pytest.approx(0.1486, abs=1e-3)
    assert relaxed_accepts(sure, 1, cfg) > -np.inf
    # an unsure row: p = 0.25, 0.19, 0.19, 0.19, 0.18.  H = 1.602, 0.1 * H + 0.1 = 0.260,
    # capped by max P = 0.25: the same 0.19 now falls short (the bar rose with the entropy)
    unsure = logits([0.25, 0.19, 0.19, 0.19, 0.18])
    assert aasd_threshold(unsure, 0.1, 0.1) == pytest.approx(0.25, abs=1e-6)
    assert relaxed_accepts(unsure, 1, cfg) == -np.inf
    assert relaxed_accepts(unsure, 0, cfg) > -np.inf          # the model's own choice always passes
    # alpha = 0.2 raises the confident row's bar to 0.2 * 0.486 + 0.1 = 0.197 > 0.19
    assert relaxed_accepts(sure, 1, VerifyConfig("entropy", alpha=0.2)) == -np.inf
    # edgespec's earlier rule, kept as entropy_inv, goes the other way: p >= 0.3 exp(-H)
    # is 0.185 on the confident row and 0.061 on the unsure one, so both pass
    inv = VerifyConfig("entropy_inv")
    assert relaxed_accepts(sure, 1, inv) > -np.inf and relaxed_accepts(unsure, 1, inv) > -np.inf


def test_only_prompt_retrieved_and_alignment_sampled_tokens_are_relaxed():
    assert set(VerifyConfig("entropy").relax_sources) == {SOURCE_PROMPT, SOURCE_ALIGN}
    # ReSpec's rule relaxes every retrieved token (the context, the corpora, the prompt)
    assert SOURCE_CONTEXT in VerifyConfig("relaxed").relax_sources
    assert SOURCE_ALIGN not in VerifyConfig("relaxed").relax_sources


def test_alignment_sampling_only_where_the_prompt_and_the_model_disagree():
    # prompt "1 2 3 9 4", then the answer "1 2": retrieval copies 3 9 after the earlier "1 2"
    ctx = [1, 2, 3, 9, 4, 1, 2]
    tok, p = rankings(7, {1: [(3, .6), (7, .3), (8, .05)],   # after "1 2": the model's top is the copied 3
                          2: [(5, .7), (9, .2)]})              # after "3": the model said 5, the prompt 9
    nodes = branch_tree(ctx, [1], tok, p, n_prompt=5, misaligned_only=True, with_src=True)
    # position 1 is aligned: no alternatives there; position 2 is misaligned: the
    # model's 5 stands beside the prompt's 9 (under the restated 3), as SOURCE_ALIGN
    assert nodes == [(3, -1, 0.0, SOURCE_BRANCH), (5, 0, 0.7, SOURCE_ALIGN)]
    # edgespec's earlier variant (aasd_all) offers alternatives at every position
    assert [n[:3] for n in branch_tree(ctx, [1], tok, p, n_prompt=5)] == \
        [(7, -1, 0.3), (8, -1, 0.05), (3, -1, 0.0), (5, 2, 0.7)]
    # the drafter: aasd keeps the prefill's rankings and drafts only misaligned positions
    d = BranchDrafter(aasd=True, branch=False)
    assert d.prefill_topk == 4 and not d.wants_observe()
    d.begin(np.array(ctx[:5], I32))
    d.observe_prefill(0, tok[:5, :4].copy(), np.log(np.maximum(p[:5, :4], 1e-9)))
    t = d.propose(np.array(ctx, I32), 8)
    assert t.tokens[t.source == SOURCE_ALIGN].tolist() == [5]


def test_prompt_copied_drafts_are_marked():
    # prompt 5 1 2 3 4 | answer 9 1 2 6 7 1 2: "1 2" occurred in the prompt (end 2,
    # then 3 4) and in the answer (end 7, then 6 7)
    prompt = np.array([5, 1, 2, 3, 4], I32)
    ctx = np.array([5, 1, 2, 3, 4, 9, 1, 2, 6, 7, 1, 2], I32)
    d = SuffixDrafter(SuffixConfig(prompt_source=True))
    d.begin(prompt)
    t = d.propose(ctx, 32)
    node = {}
    for i, (a, b) in enumerate(zip(t.tokens.tolist(), t.parents.tolist())):
        node[(b, a)] = i
    three = node[(-1, 3)]
    four = node[(three, 4)]
    nine = node[(four, 9)]
    six = node[(-1, 6)]
    src = t.source
    # 3 and 4 were copied from the prompt; 9 (position 5) and 6 (position 8) from the answer
    assert (src[three], src[four], src[nine], src[six]) == (SOURCE_PROMPT, SOURCE_PROMPT, SOURCE_CONTEXT,
                                                            SOURCE_CONTEXT)
    # off by default: everything is SOURCE_CONTEXT
    d2 = SuffixDrafter()
    d2.begin(prompt)
    assert (d2.propose(ctx, 32).source == SOURCE_CONTEXT).all()


class _Fixed(Drafter):
    name = "fixed"

    def __init__(self, tok, source):
        self.tok, self.source = tok, source

    def propose(self, context, budget):
        return DraftTree(np.array([self.tok], I32), np.array([-1], I32), np.array([0.9], np.float32),
                         np.array([self.source], np.int8))


@pytest.mark.model
def test_conditional_verification_relaxes_prompt_and_aligned_sources_only(model):
    toks = model.prompt_tokens([{"role": "user", "content": dev_prompts(124)[0]["turns"][0]}])
    ref = model.generate(toks, max_tokens=24, drafter="none")
    tok = 1234
    assert tok not in ref.tokens
    # alpha = beta = 0: delta = min(0, max P) = 0, every relaxable token passes
    cfg = dataclasses.replace(model.config, cost_gate=False, verify=VerifyConfig("entropy", alpha=0.0, beta=0.0))

    def run(source):
        eng = Engine(model.backend, _Fixed(tok, source), model.cost, cfg)
        res = drain(eng.run(toks, max_tokens=24))
        eng.reset()
        return res

    for s in (SOURCE_CONTEXT, SOURCE_BRANCH):        # retrieved from the answer, or a generated-side branch
        r = run(s)
        assert r.tokens == ref.tokens and r.n_relaxed == 0 and r.verify == "entropy"
    for s in (SOURCE_PROMPT, SOURCE_ALIGN):
        r = run(s)
        assert r.n_relaxed > 0 and tok in r.tokens
