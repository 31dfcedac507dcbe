"""AASD as published (Wang et al., /work/shared/seeds/aasd.txt): the
entropy-adaptive threshold of conditional verification (verify.py, mode
"entropy", eqs. 4-6), relaxing only prompt-retrieved and alignment-sampled
tokens and accepting the longest candidate that passes, with no cap and no
look-ahead; alignment sampling at misaligned prompt positions only
(drafters/branch.py): worked examples."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgespec.drafters.base import Drafter
from edgespec.drafters.branch import BranchDrafter
from edgespec.drafters.suffix import SuffixConfig, SuffixDrafter
from edgespec.core.engine import Engine, drain
from edgespec.drafters.tree import SOURCE_ALIGN, SOURCE_BRANCH, SOURCE_CONTEXT, SOURCE_PROMPT, DraftTree
from edgespec.core.relaxed import aasd_threshold, relaxed_accepts, relaxed_path
from edgespec.core.verify import VerifyConfig
from edgespec.core.params import Request

from conftest import dev_prompts, trie_slots
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


IS, WAS, MADE, A, GREAT, END = 1, 2, 3, 4, 5, 0
V = 8


def _batch(paths, model):
    """A verification batch laid out depth first: `paths` are candidates of
    (token, source) merged as a trie under the root (slot 0); model(prefix) ->
    {token: probability} after the root + prefix (the rest of the mass spread
    evenly).  Returns (logits, parents, tokens, sources)."""
    toks, pars, srcs, prefix_of = trie_slots(paths)
    logits = np.zeros((len(toks), V), np.float32)
    for s, prefix in enumerate(prefix_of):
        p = model(prefix)
        rest = (1.0 - sum(p.values())) / (V - len(p))
        logits[s] = logits_row([p.get(t, rest) for t in range(V)])
    return logits, pars, toks, srcs


def logits_row(p):
    return np.log(np.maximum(np.asarray(p, np.float64), 1e-12)).astype(np.float32)


def _accepted(paths, model, cfg):
    logits, pars, toks, srcs = _batch(paths, model)
    return [toks[s] for s in relaxed_path(logits, pars, toks, srcs, cfg)]


def _jackson(prefix):
    """Figure 2: after "Michael Jackson" the model's top-1 is "was", top-2 "made",
    and the prompt's "is" third; after "is" it goes on "a great" itself."""
    if prefix == ():
        return {WAS: 0.42, MADE: 0.30, IS: 0.28}
    if prefix == (IS,):
        return {A: 0.9}
    if prefix == (IS, A):
        return {GREAT: 0.9}
    return {END: 0.9}


def test_the_longest_candidate_that_passes_is_accepted():
    # the n-gram "is a great" retrieved by the key "Michael Jackson" (copied from the
    # prompt) and the alignment-sampled "was" and "made" for the 100th position
    tree = [[(WAS, SOURCE_ALIGN)], [(MADE, SOURCE_ALIGN)], [(IS, SOURCE_PROMPT), (A, SOURCE_PROMPT),
                                                             (GREAT, SOURCE_PROMPT)]]
    cfg = VerifyConfig("entropy")
    # H = 1.082 nats over 0.42, 0.30, 0.28: delta = 0.1 * 1.082 + 0.1 = 0.208, so "was",
    # "made" and "is" all pass; "We accept the longest draft candidate that passes
    # verification": "is a great" (3 tokens) over the model's own "was" (1)
    logits, *_ = _batch(tree, _jackson)
    assert aasd_threshold(logits[0], 0.1, 0.1) == pytest.approx(0.208, abs=1e-3)
    assert _accepted(tree, _jackson, cfg) == [IS, A, GREAT]
    # equally long candidates: the one with fewer relaxed tokens (the model's own "was")
    tree2 = [[(IS, SOURCE_PROMPT)], [(WAS, SOURCE_ALIGN)]]
    assert _accepted(tree2, _jackson, cfg) == [WAS]
    # strict for tokens retrieved from the generated context: the same "is a great"
    # copied from the answer so far is not relaxed, the model's "was" is all that passes
    ctx_tree = [[(WAS, SOURCE_ALIGN)], [(IS, SOURCE_CONTEXT), (A, SOURCE_CONTEXT), (GREAT, SOURCE_CONTEXT)]]
    assert _accepted(ctx_tree, _jackson, cfg) == [WAS]


def test_no_cap_and_no_look_ahead():
    # four prompt tokens in a row, none the model's top choice, each with p = 0.3
    # under a top of 0.4 (delta = 0.1 H + 0.1 < 0.3): every one passes
    def model(prefix):
        return {6: 0.4, 1 + len(prefix): 0.3} if len(prefix) < 4 else {END: 0.9}
    copy = [[(1, SOURCE_PROMPT), (2, SOURCE_PROMPT), (3, SOURCE_PROMPT), (4, SOURCE_PROMPT)]]
    assert _accepted(copy, model, VerifyConfig("entropy")) == [1, 2, 3, 4]
    # ReSpec's Phi (and edgespec's cap of entropy_inv) do not apply to AASD
    assert _accepted(copy, model, VerifyConfig("entropy", phi=1, max_relaxed=1)) == [1, 2, 3, 4]
    # no look-ahead: a passing token is accepted with nothing after it
    assert _accepted([copy[0][:1]], model, VerifyConfig("entropy")) == [1]


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
        res = drain(eng.run(eng.resolve(Request(toks, max_tokens=24, reuse_prefix=False))))
        eng.reset()
        return res

    for s in (SOURCE_CONTEXT, SOURCE_BRANCH):        # retrieved from the answer, or a generated-side branch
        r = run(s)
        assert r.tokens == ref.tokens and r.n_relaxed == 0 and r.verify == "entropy"
    for s in (SOURCE_PROMPT, SOURCE_ALIGN):
        r = run(s)
        assert r.n_relaxed > 0 and tok in r.tokens
