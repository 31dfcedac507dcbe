"""ReSpec as published: the entropy trigger (drafters/mechanisms/trigger.py), the
feedback-driven candidate selection (drafters/suffix.py) and the cap Phi on
relaxed acceptances (engine + VerifyConfig.max_relaxed): worked examples."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgespec.drafters.base import Drafter, StepResult
from edgespec.drafters.hybrid import HybridConfig, HybridDrafter
from edgespec.drafters.suffix import SuffixConfig, SuffixDrafter
from edgespec.core.engine import Engine, drain
from edgespec.kernels.topk import row_entropy
from edgespec.core.tree import SOURCE_CONTEXT, SOURCE_TRIGRAM, DraftTree
from edgespec.core.verify import VerifyConfig

from conftest import dev_prompts

I32 = np.int32


def test_row_entropy_over_the_whole_row():
    x = np.array([[0.0, 0.0, 0.0, 0.0],            # uniform over 4: log 4
                  [np.log(3.0), 0.0, -80.0, -80.0]], np.float32)   # p = 3/4, 1/4 (and ~0)
    out = np.zeros(2, np.float32)
    row_entropy(x, 2, out)
    assert out[0] == pytest.approx(np.log(4.0), abs=1e-6)
    assert out[1] == pytest.approx(-(0.75 * np.log(0.75) + 0.25 * np.log(0.25)), abs=1e-5)


def _step(d, ctx, tree, got, entropy):
    d.observe(StepResult(np.append(ctx, got).astype(I32), np.array([got], I32), tree,
                         np.zeros(len(tree), bool), tree.parents == -1, entropy=np.array(entropy, np.float32)))


def test_trigger_retrieves_only_when_some_window_is_confident():
    d = HybridDrafter(100, config=HybridConfig(trigger=True, entropy=False, ema=False, branch_depth=False,
                                               graft_tail=False))
    assert d.wants_entropy
    d.warmup()
    ctx = np.array([1, 2, 3, 4, 5, 9, 8, 1, 2], I32)     # "1 2" -> retrieval would copy 3
    d.begin(ctx)
    assert d.trigger.triggered()            # nothing known yet: retrieve

    def retrieved():
        t = d.propose(ctx, 16)
        return bool((t.source == SOURCE_CONTEXT).any())

    assert retrieved()
    # entropies of the last three committed positions 2.0, 0.4, 0.5 (lambda 0.5, theta 1.5):
    # C_1 = 0.5 + 0.5 = 1.0 <= 1.5: retrieve
    _step(d, ctx, DraftTree.empty(), 3, [2.0, 0.4, 0.5])
    assert d.trigger.triggered() and retrieved()
    # 2.0, 1.4, 1.3: C_1 = 1.3 + 0.5 = 1.8, C_2 = 1.35 + 0.25 = 1.6, C_3 = 1.567 + 0.167 = 1.733;
    # the smallest, 1.6, is above 1.5: no retrieval (the tri-gram / adjacency parts still draft)
    _step(d, ctx, DraftTree.empty(), 3, [2.0, 1.4, 1.3])
    assert not d.trigger.triggered() and not retrieved()
    # one confident position (0.2): the window is 1.4, 1.3, 0.2 and C_1 = 0.7: retrieve again
    _step(d, ctx, DraftTree.empty(), 3, [0.2])
    assert d.trigger.triggered() and retrieved()
    # theta and lambda are settings: with theta = 0.6 the same window does not retrieve
    d.config.trigger_theta = 0.6
    assert not d.trigger.triggered()


def _tree(chains):
    toks, pars, probs = [], [], []
    for chain in chains:
        parent = -1
        for t in chain:
            toks.append(t)
            pars.append(parent)
            probs.append(0.5)
            parent = len(toks) - 1
    return DraftTree(np.array(toks, I32), np.array(pars, I32), np.array(probs, np.float32), np.zeros(len(toks), np.int8))


def test_feedback_scores_select_the_best_three_and_reward_the_winner_only():
    d = SuffixDrafter(SuffixConfig(feedback=True, max_depth=4))
    assert d.observes
    # "7 8" occurred four times before the end, followed by 20, 30, 40 and 50
    # ends:        1                4 5                 9                13
    ctx = np.array([7, 8, 20, 1, 7, 8, 30, 2, 7, 8, 40, 3, 7, 8, 50, 4, 7, 8], I32)
    d.begin(ctx)
    t = d.propose(ctx, 32)
    # every score starts at 0.5: the top 3 are the matcher's first three (the most
    # recent: ends 13, 9, 5), so 20 (end 1) is not drafted
    assert sorted(t.tokens[t.parents == -1].tolist()) == [30, 40, 50]
    # the gate verified the chains of 50 and 30 (40's was cut); the model followed
    # 30 2 7 8 all the way (bonus 5): that occurrence (end 5) wins, R = L_acc / L_draft
    # = 4 / 4; the loser (end 13, verified, nothing accepted) gets R = 0; end 9 was
    # not verified and keeps its score
    d.observe(StepResult(np.append(ctx, [30, 2, 7, 8, 5]).astype(I32), np.array([30, 2, 7, 8, 5], I32),
                         _tree([[50, 4, 7, 8], [30, 2, 7, 8]]), np.zeros(8, bool), np.zeros(8, bool)))
    # rate 0.5: end 5 -> 0.5 * 0.5 + 0.5 * 1 = 0.75; end 13 -> 0.25; ends 9 and 1 stay 0.5
    assert d._fb[[1, 5, 9, 13]].tolist() == [0.5, 0.75, 0.5, 0.25]
    t = d.propose(ctx, 32)
    # now the best three: end 5 (0.75), then ends 9 and 1 (0.5, in the matcher's order); 50 drops
    assert sorted(t.tokens[t.parents == -1].tolist()) == [20, 30, 40]
    # a partial follow: the model took 40 then 9 (L_acc 1 of L_draft 2 verified): R = 0.5
    d.observe(StepResult(np.append(ctx, [40, 9]).astype(I32), np.array([40, 9], I32),
                         _tree([[40, 3]]), np.zeros(2, bool), np.zeros(2, bool)))
    assert d._fb[9] == pytest.approx(0.5)
    # a new request starts from 0.5 everywhere
    d.begin(ctx)
    assert (d._fb == 0.5).all()


class _Chain(Drafter):
    """Proposes the same chain of tokens from one source at every step."""
    name = "chain"

    def __init__(self, toks, source):
        self.toks, self.source = list(toks), source

    def propose(self, context, budget):
        k = min(len(self.toks), budget)
        return DraftTree(np.array(self.toks[:k], I32), np.arange(-1, k - 1, dtype=I32),
                         np.full(k, 0.9, np.float32), np.full(k, self.source, np.int8))


@pytest.mark.model
def test_relaxed_acceptances_are_capped_per_step(model):
    toks = model.prompt_tokens([{"role": "user", "content": dev_prompts(124)[0]["turns"][0]}])
    anything = dict(top_k=model.vocab.n_vocab, tau=1e9, lookahead=0)
    chain = [1234, 1235, 1236]          # tokens plain decoding does not produce here

    def run(cap, source=SOURCE_CONTEXT):
        cfg = dataclasses.replace(model.config, cost_gate=False,
                                  verify=VerifyConfig("relaxed", max_relaxed=cap, **anything))
        eng = Engine(model.backend, _Chain(chain, source), model.cost, cfg)
        res = drain(eng.run(toks, max_tokens=24))
        eng.reset()
        return res

    capped = run(1)                     # Phi = 1: one relaxed token per step at most
    assert capped.n_relaxed > 0 and capped.n_relaxed <= capped.n_steps
    free = run(0)                       # 0 = no cap: the whole chain is relaxed each step
    assert free.n_relaxed > free.n_steps
    assert run(1, SOURCE_TRIGRAM).n_relaxed == 0      # never a generated guess
