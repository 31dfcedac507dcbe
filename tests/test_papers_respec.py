"""ReSpec as published (Fang et al., /work/shared/seeds/respec.txt): the
entropy-guided trigger (drafters/papers/trigger.py, section 3.2.1), the
feedback-driven candidate selection (drafters/suffix.py, section 3.3) and the
relaxed verification with look-ahead tolerance (core/verify.py, section 3.4):
worked examples on hand-written arrays, and on the model that Phi bounds the
relaxed attempts of a step."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgespec.drafters.base import Drafter, StepResult
from edgespec.drafters.hybrid import HybridConfig, HybridDrafter
from edgespec.drafters.papers.trigger import select_key
from edgespec.drafters import make_drafter
from edgespec.core.engine import Engine, drain
from edgespec.kernels.topk import row_entropy
from edgespec.drafters.tree import SOURCE_CONTEXT, SOURCE_TRIGRAM, DraftTree
from edgespec.core.relaxed import relaxed_path
from edgespec.core.verify import VerifyConfig
from edgespec.core.params import Request

from conftest import dev_prompts, trie_slots

I32 = np.int32


def test_row_entropy_over_the_whole_row():
    x = np.array([[0.0, 0.0, 0.0, 0.0],            # uniform over 4: log 4
                  [np.log(3.0), 0.0, -80.0, -80.0]], np.float32)   # p = 3/4, 1/4 (and ~0)
    out = np.zeros(2, np.float32)
    row_entropy(x, 2, out)
    assert out[0] == pytest.approx(np.log(4.0), abs=1e-6)
    assert out[1] == pytest.approx(-(0.75 * np.log(0.75) + 0.25 * np.log(0.25)), abs=1e-5)


# ------------------------------------------------------------------ 3.2.1 trigger
def test_key_is_the_argmin_of_c_and_its_entropy_decides():
    # eq. (2) C_k = H_k + lambda / k, eq. (3) k* = argmin C_k, "Retrieval is
    # triggered if H_min = H_{k*} <= theta_entropy (1.5)".  Entropies of the last
    # three positions (oldest first) 1.7, 1.7, 1.4, lambda 0.5:
    # H_1 = 1.4, C_1 = 1.9; H_2 = 1.55, C_2 = 1.8; H_3 = 1.6, C_3 = 1.767.
    k, h = select_key([1.7, 1.7, 1.4], 0.5, 3)
    assert k == 3 and h == pytest.approx(1.6)       # k* = 3: H_{k*} = 1.6 > 1.5, no retrieval
    # (the most confident window, H_1 = 1.4, is not the one that decides)
    # one position known, H_1 = 1.4: C_1 = 1.9 > 1.5 but H_{k*} = 1.4 <= 1.5: retrieve
    assert select_key([1.4], 0.5, 3) == (1, pytest.approx(1.4))
    # ties of C go to the shortest key (Algorithm 1 keeps a strictly smaller C only):
    # lambda 0: C_k = H_k, and H_1 = H_2 = H_3 = 1
    assert select_key([1.0, 1.0, 1.0], 0.0, 3)[0] == 1
    # the window is l = 3: older positions do not count
    assert select_key([0.0, 9.0, 9.0, 9.0], 0.5, 3)[0] == 3


def _step(d, ctx, tree, got, entropy):
    d.observe(StepResult(np.append(ctx, got).astype(I32), np.array([got], I32), tree,
                         np.zeros(len(tree), bool), tree.parents == -1, entropy=np.array(entropy, np.float32)))


def test_trigger_retrieves_iff_the_entropy_at_k_star_is_low():
    d = HybridDrafter(100, config=HybridConfig(trigger=True, entropy=False, ema=False, branch_depth=False,
                                               graft_tail=False))
    assert d.wants_entropy
    assert (d.config.trigger_theta, d.config.trigger_window) == (1.5, 3)    # the paper's theta and l
    d.warmup()
    ctx = np.array([1, 2, 3, 4, 5, 9, 8, 1, 2], I32)     # "1 2" -> retrieval would copy 3
    d.begin(ctx)

    def retrieved():
        t = d.propose(ctx, 16)
        return bool((t.source == SOURCE_CONTEXT).any())

    assert retrieved()                      # nothing known yet: retrieve
    # 2.0, 1.4, 1.3: C_1 = 1.8, C_2 = 1.35 + 0.25 = 1.6, C_3 = 1.567 + 0.167 = 1.733:
    # k* = 2 and H_2 = 1.35 <= 1.5: retrieve (min C = 1.6 > 1.5 would not)
    _step(d, ctx, DraftTree.empty(), 3, [2.0, 1.4, 1.3])
    assert retrieved() and d.trigger.key == 2
    # 1.7, 1.7, 1.4: k* = 3, H_3 = 1.6 > 1.5: no retrieval (the tri-gram / adjacency parts still draft)
    _step(d, ctx, DraftTree.empty(), 3, [1.7, 1.7, 1.4])
    assert not retrieved() and d.trigger.key == 3
    # one confident position (0.2): 1.7, 1.4, 0.2, C_1 = 0.7 is the least: k* = 1, retrieve
    _step(d, ctx, DraftTree.empty(), 3, [0.2])
    assert retrieved() and d.trigger.key == 1
    # theta is a setting: with theta = 0.1 the same window does not retrieve
    d.config.trigger_theta = 0.1
    assert not d.trigger.triggered()


def test_key_star_is_the_retrieval_key_of_the_feedback_selection():
    d = HybridDrafter(100, config=HybridConfig(trigger=True, feedback=True, entropy=False, ema=False,
                                               branch_depth=False, graft_tail=False, trigram=False,
                                               adjacency=False, schedule=False))
    ctx = np.array([6, 2, 30, 1, 2, 40, 5, 1, 2], I32)
    d.begin(ctx)

    def roots():
        t = d.propose(ctx, 32)
        return sorted(t.tokens[t.parents == -1].tolist())

    # k* = 2: the key "1 2" occurred once before (then 40)
    _step(d, ctx, DraftTree.empty(), 2, [0.1, 0.1])      # H_1 = H_2 = 0.1: C_1 = 0.6, C_2 = 0.35
    assert roots() == [40] and d.trigger.key == 2
    # k* = 1: the key "2" occurred twice before (then 30 and 40): both are retrieved
    _step(d, ctx, DraftTree.empty(), 2, [3.0, 3.0, 0.1])  # C_1 = 0.6, C_2 = 1.8, C_3 = 2.2
    assert roots() == [30, 40] and d.trigger.key == 1


# ------------------------------------------------------------------ 3.3 feedback
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


def _observe(d, ctx, accepted, verified_chains):
    t = _tree(verified_chains)
    d.observe(StepResult(np.append(ctx, accepted).astype(I32), np.array(accepted, I32), t,
                         np.zeros(len(t), bool), np.zeros(len(t), bool)))


def test_feedback_scores_every_position_selects_three_rewards_the_winner_only():
    d = make_drafter("suffix", feedback=True, max_depth=4)       # the plug-in, through the registry
    assert d.observes
    c = d.plugins["feedback"].config
    assert (c.feedback_init, c.feedback_top) == (0.5, 3)      # S_0 "e.g. 0.5", top-3
    # "7 8" occurred four times before the end, followed by 20, 30, 40 and 50
    # ends:        1                4 5                 9                13
    ctx = np.array([7, 8, 20, 1, 7, 8, 30, 2, 7, 8, 40, 3, 7, 8, 50, 4, 7, 8], I32)
    d.begin(ctx)
    t = d.propose(ctx, 32)
    # every position of the key is retrieved and scored 0.5: the top 3 (ties: the
    # most recent) are ends 13, 9, 5, so 20 (end 1) is not drafted
    assert sorted(t.tokens[t.parents == -1].tolist()) == [30, 40, 50]
    # the gate verified the chains of 50 and 30 (40's was cut); the model followed
    # 30 2 7 8 all the way (bonus 5): that occurrence (end 5) wins, R = L_acc / L_draft
    # = 4 / 4; every other selected position gets R = 0: end 13 (verified, nothing
    # accepted) and end 9 (selected, cut by the gate, so its draft accepted nothing)
    _observe(d, ctx, [30, 2, 7, 8, 5], [[50, 4, 7, 8], [30, 2, 7, 8]])
    # EMA (eq. 4), rate 0.5: end 5 -> 0.5 * 0.5 + 0.5 * 1 = 0.75; ends 9 and 13 -> 0.25;
    # end 1 was not selected and keeps 0.5
    assert d.plugins["feedback"].scores[[1, 5, 9, 13]].tolist() == [0.5, 0.75, 0.25, 0.25]
    t = d.propose(ctx, 32)
    # the best three: end 5 (0.75), end 1 (0.5), then ends 13 and 9 tie at 0.25 (the more recent)
    assert sorted(t.tokens[t.parents == -1].tolist()) == [20, 30, 50]
    # a partial follow: the model took 20 then 9 where the chain said 1 (L_acc 1 of L_draft 2
    # verified): R = 0.5 for end 1; ends 5 and 13 get 0
    _observe(d, ctx, [20, 9], [[20, 1]])
    assert d.plugins["feedback"].scores[[1, 5, 9, 13]].tolist() == [0.5, 0.375, 0.25, 0.125]
    # theta_score filters: end 13 (0.125) is under 0.2 and is not drafted any more,
    # though only three positions are left
    t = d.propose(ctx, 32)
    assert sorted(t.tokens[t.parents == -1].tolist()) == [20, 30, 40]
    # a new request starts from 0.5 everywhere
    d.begin(ctx)
    assert (d.plugins["feedback"].scores == 0.5).all()


def test_feedback_falls_back_when_no_position_passes_theta_score():
    d = make_drafter("suffix", feedback=True, max_depth=4, feedback_min=0.3)
    ctx = np.array([7, 8, 20, 1, 7, 8, 30, 2, 7, 8], I32)     # the key "7 8" at ends 1 and 5
    d.begin(ctx)
    assert len(d.propose(ctx, 32)) > 0
    _observe(d, ctx, [9], [[30], [20]])                      # neither followed: both 0.25 < 0.3
    assert d.plugins["feedback"].scores[[1, 5]].tolist() == [0.25, 0.25]
    assert len(d.propose(ctx, 32)) == 0                     # no context retrieval: fall back
    assert d.plugins["feedback"].selected == []


# --------------------------------------------------- 3.4 relaxed verification
THE, THAT, CAT, SAT, ON, A, MAT, END = 1, 2, 3, 4, 5, 6, 7, 0
V = 8


def _batch(paths, model):
    """A verification batch laid out depth first: `paths` are candidate
    sequences of (token, source) merged as a trie under the root (slot 0);
    model(prefix) -> {token: logit} the model's row after the root + prefix
    (every other token at -20).  Returns (logits, parents, tokens, sources)."""
    toks, pars, srcs, prefix_of = trie_slots(paths)
    logits = np.full((len(toks), V), -20.0, np.float32)
    for s, prefix in enumerate(prefix_of):
        for tok, v in model(prefix).items():
            logits[s, tok] = v
    return logits, pars, toks, srcs


def _sentence(*words):
    """The model writes `words` greedily; after each prefix a close second: "that"
    for "the" (0.5 below), "a" for "cat" (1.0 below)."""
    def model(prefix):
        i = len(prefix)
        want = words[i] if i < len(words) else END
        row = {want: 5.0}
        if want == THE:
            row[THAT] = 4.5
        if want == CAT:
            row[A] = 4.0
        return row
    return model


def _accepted(paths, model, cfg):
    logits, pars, toks, srcs = _batch(paths, model)
    return [toks[s] for s in relaxed_path(logits, pars, toks, srcs, cfg)]


R, G = SOURCE_CONTEXT, SOURCE_TRIGRAM        # retrieved, model-drafted


def test_relaxed_check_is_top_k_and_tolerance_tau_for_retrieved_drafts_only():
    cfg = VerifyConfig("relaxed")
    # the values: TopK's k, tau, m and Phi are not given by the paper (it recommends
    # tau <= 3 and m <= 3): edgespec's 5, 1.5, 2 and 2
    assert (cfg.top_k, cfg.tau, cfg.lookahead, cfg.phi) == (5, 1.5, 2, 2)
    model = _sentence(THE, CAT, SAT, ON)
    # "that cat sat on" copied from the context, where the model writes "the cat sat on":
    # "that" is rejected by greedy verification, passes eqs. (6)-(7) (rank 2, log-prob
    # 0.5 below "the"), and is followed by xi = 3 >= m greedy matches: all four accepted
    assert _accepted([[(THAT, R), (CAT, R), (SAT, R), (ON, R)]], model, cfg) == [THAT, CAT, SAT, ON]
    # strict for the Drafter Module's drafts: the same tokens from the tri-gram part
    assert _accepted([[(THAT, G), (CAT, G), (SAT, G), (ON, G)]], model, cfg) == []
    # eq. (7): with tau = 0.4 the gap of 0.5 is too large, and the walk ends there
    assert _accepted([[(THAT, R), (CAT, R)]], model, dataclasses.replace(cfg, tau=0.4)) == []
    # eq. (6): with k = 1 only the top token is in TopK
    assert _accepted([[(THAT, R), (CAT, R), (SAT, R)]], model, dataclasses.replace(cfg, top_k=1)) == []


def test_look_ahead_needs_m_greedy_matches_and_attempts_chain():
    model = _sentence(THE, CAT, SAT, ON, END)
    cfg = VerifyConfig("relaxed", lookahead=2, phi=2)
    # m = 2: "that cat" has xi = 1 < m: the next attempt is at the next position
    # ("cat", a greedy token, passes; xi = 0): Phi = 2 attempts are spent, last stays 0
    assert _accepted([[(THAT, R), (CAT, R)]], model, cfg) == []
    # a chain: "that a cat sat": "that" passes with xi = 0 < m, so current moves on; at
    # "a" (model: "cat", "a" 1.0 below: passes) xi = 2 >= m: last jumps past both
    chain = [[(THAT, R), (A, R), (CAT, R), (SAT, R)]]
    model2 = _chain_model()
    assert _accepted(chain, model2, cfg) == [THAT, A, CAT, SAT]
    # with Phi = 1 the single attempt ("that", xi = 0) does not extend last
    assert _accepted(chain, model2, dataclasses.replace(cfg, phi=1)) == []
    # m = 0: a passing token is accepted on its own
    assert _accepted([[(THAT, R)]], model, dataclasses.replace(cfg, lookahead=0, phi=1)) == [THAT]


def _chain_model():
    """The model writes "the cat sat on"; after "that" it writes "cat", "a" 1.0 below;
    after "that a" it goes on "cat sat" (the copy's own words)."""
    def model(prefix):
        if prefix == ():
            return {THE: 5.0, THAT: 4.5}
        if prefix == (THAT,):
            return {CAT: 5.0, A: 4.0}
        if prefix == (THAT, A):
            return {CAT: 5.0}
        if prefix == (THAT, A, CAT):
            return {SAT: 5.0}
        return {END: 5.0}
    return model


def test_phi_bounds_the_relaxed_attempts():
    # "that cat sat" then "a mat on": two relaxed points, each followed by two greedy matches
    def model(prefix):
        nxt = {(): {THE: 5.0, THAT: 4.5}, (THAT,): {CAT: 5.0}, (THAT, CAT): {SAT: 5.0},
               (THAT, CAT, SAT): {THE: 5.0, A: 4.5}, (THAT, CAT, SAT, A): {MAT: 5.0},
               (THAT, CAT, SAT, A, MAT): {ON: 5.0}}
        return nxt.get(prefix, {END: 5.0})
    path = [[(THAT, R), (CAT, R), (SAT, R), (A, R), (MAT, R), (ON, R)]]
    assert _accepted(path, model, VerifyConfig("relaxed", phi=1)) == [THAT, CAT, SAT]
    assert _accepted(path, model, VerifyConfig("relaxed", phi=2)) == [THAT, CAT, SAT, A, MAT, ON]
    assert _accepted(path, model, VerifyConfig("relaxed", phi=0)) == []     # no attempt: strict


def test_the_longest_candidate_of_the_tree_is_accepted():
    model = _sentence(THE, CAT, SAT, ON)
    cfg = VerifyConfig("relaxed")
    # the model's own "the" is drafted too (a leaf); the relaxed candidate is longer
    tree = [[(THE, G)], [(THAT, R), (CAT, R), (SAT, R)]]
    assert _accepted(tree, model, cfg) == [THAT, CAT, SAT]
    # equally long: the one with fewer relaxed tokens (the model's own text)
    tree = [[(THAT, R), (CAT, R), (SAT, R)], [(THE, G), (CAT, G), (SAT, G)]]
    assert _accepted(tree, model, cfg) == [THE, CAT, SAT]


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
def test_relaxed_attempts_are_bounded_by_phi_per_step(model):
    toks = model.prompt_tokens([{"role": "user", "content": dev_prompts(124)[0]["turns"][0]}])
    anything = dict(top_k=model.vocab.n_vocab, tau=1e9, lookahead=0)
    chain = [1234, 1235, 1236]          # tokens plain decoding does not produce here

    def run(phi, source=SOURCE_CONTEXT):
        cfg = dataclasses.replace(model.config, cost_gate=False,
                                  verify=VerifyConfig("relaxed", phi=phi, **anything))
        eng = Engine(model.backend, _Chain(chain, source), model.cost, cfg)
        res = drain(eng.run(eng.resolve(Request(toks, max_tokens=24, reuse_prefix=False))))
        eng.reset()
        return res

    one = run(1)                        # Phi = 1: one relaxed token per step at most
    assert one.n_relaxed > 0 and one.n_relaxed <= one.n_steps
    three = run(3)                      # Phi = 3: the whole chain is relaxed each step
    assert three.n_relaxed > three.n_steps
    assert run(3, SOURCE_TRIGRAM).n_relaxed == 0      # never a generated guess
