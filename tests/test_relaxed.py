"""Relaxed verification (lossy opt-in): the acceptance rules on hand-made logits,
and on the real model that only retrieved drafts are ever accepted by them and
that exact mode is untouched."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgespec.drafters.base import Drafter
from edgespec.core.engine import Engine, drain
from edgespec.drafters.tree import SOURCE_CONTEXT, SOURCE_TRIGRAM, DraftTree
from edgespec.core.relaxed import relaxed_accepts, relaxed_path
from edgespec.core.verify import SamplingConfig, VerifyConfig, rouge_l
from edgespec.core.params import Request

from conftest import dev_prompts


def test_relaxed_rule_top_k_and_tau():
    row = np.array([5.0, 4.5, 1.0, 4.8, 0.0], np.float32)   # ranks: 0, 3, 1, 2 (by value 5, 4.8, 4.5, 1)
    cfg = VerifyConfig("relaxed", top_k=3, tau=1.0, lookahead=0)
    assert relaxed_accepts(row, 3, cfg) == pytest.approx(-0.2)
    assert relaxed_accepts(row, 1, cfg) == pytest.approx(-0.5)
    assert relaxed_accepts(row, 2, cfg) == -np.inf            # 4 below the best
    assert relaxed_accepts(row, 1, VerifyConfig("relaxed", top_k=2, tau=1.0)) == -np.inf   # rank 2
    assert relaxed_accepts(row, 1, VerifyConfig("relaxed", top_k=3, tau=0.4)) == -np.inf   # gap 0.5


def test_entropy_inv_rule_falls_with_entropy():
    cfg = VerifyConfig("entropy_inv", eps=0.3)   # edgespec's earlier rule, kept under this name
    peaked = np.array([10.0, 7.0, 0.0, 0.0], np.float32)     # low entropy: p(1) ~ 0.05 < 0.3 * e^-H
    flat = np.array([1.0, 0.9, 0.8, 0.8], np.float32)        # high entropy: the bar is low
    assert relaxed_accepts(peaked, 1, cfg) == -np.inf
    assert relaxed_accepts(flat, 1, cfg) > -np.inf


def test_config_and_rouge():
    with pytest.raises(ValueError):
        VerifyConfig("sloppy")
    assert VerifyConfig().exact and not VerifyConfig("entropy").exact
    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l([1, 2, 3, 4], [1, 9, 3, 4]) == pytest.approx(0.75)
    assert rouge_l([1, 2], [3, 4]) == 0.0


def _old_entropy_inv_walk(logits, bpl, btl, src, cfg):
    """The engine's walk for relaxed modes before the papers' procedures
    (greedy first; at a mismatch the best relaxed retrieved child whose
    subtree continues with `lookahead` greedy matches; at most max_relaxed a
    step), kept as the reference for entropy_inv."""
    def child(slot, tok):
        return next((t for t in range(slot + 1, len(btl)) if bpl[t] == slot and btl[t] == tok), -1)

    def relaxed_child(slot):
        best, best_c = -np.inf, -1
        for t in range(slot + 1, len(btl)):
            if bpl[t] == slot and src[t] in cfg.relax_sources:
                sc = relaxed_accepts(logits[slot], btl[t], cfg)
                if sc > best:
                    best, best_c = sc, t
        if best_c < 0:
            return -1
        s2 = best_c
        for _ in range(cfg.lookahead):
            s2 = child(s2, int(logits[s2].argmax()))
            if s2 < 0:
                return -1
        return best_c

    cap = cfg.max_relaxed or (1 << 30)
    path, slot, n = [], 0, 0
    while True:
        c = child(slot, int(logits[slot].argmax()))
        if c < 0 and n < cap:
            c = relaxed_child(slot)
            n += c >= 0
        if c < 0:
            return path
        path.append(c)
        slot = c


def test_entropy_inv_keeps_its_greedy_first_walk():
    rng = np.random.default_rng(7)
    for case in range(300):
        nb = int(rng.integers(2, 16))
        bpl = [-1] + [int(rng.integers(0, t)) for t in range(1, nb)]
        btl, src = [0], [-1]
        for t in range(1, nb):
            used = {btl[u] for u in range(1, t) if bpl[u] == bpl[t]}
            btl.append(int(rng.choice([v for v in range(6) if v not in used])) if len(used) < 6 else 0)
            src.append(int(rng.choice([SOURCE_CONTEXT, SOURCE_TRIGRAM])))
        logits = rng.normal(0, 0.7, (nb, 6)).astype(np.float32)
        cfg = VerifyConfig("entropy_inv", eps=float(rng.uniform(0.05, 0.6)), lookahead=int(rng.integers(0, 3)),
                           max_relaxed=int(rng.integers(0, 3)))
        assert relaxed_path(logits, bpl, btl, src, cfg) == _old_entropy_inv_walk(logits, bpl, btl, src, cfg), case


class _FixedDrafter(Drafter):
    """Proposes one node, token `tok`, from the given source, at every step."""
    name = "fixed"

    def __init__(self, tok: int, source: int):
        self.tok, self.source = tok, source

    def propose(self, context, budget):
        return DraftTree(np.array([self.tok], np.int32), np.array([-1], np.int32),
                         np.array([0.9], np.float32), np.array([self.source], np.int8))


@pytest.mark.model
def test_only_retrieved_drafts_are_relaxed(model):
    toks = model.prompt_tokens([{"role": "user", "content": dev_prompts(128)[0]["turns"][0]}])
    ref = model.generate(toks, max_tokens=24, drafter="none")
    anything = VerifyConfig("relaxed", top_k=model.vocab.n_vocab, tau=1e9, lookahead=0)
    cfg = dataclasses.replace(model.config, cost_gate=False, verify=anything)
    tok = 1234   # a token plain decoding does not produce here
    assert tok not in ref.tokens

    def run(source):
        eng = Engine(model.backend, _FixedDrafter(tok, source), model.cost, cfg)
        res = drain(eng.run(eng.resolve(Request(toks, max_tokens=24, reuse_prefix=False))))
        eng.reset()
        return res

    r = run(SOURCE_TRIGRAM)            # a generated guess is never accepted by the relaxed rule
    assert r.tokens == ref.tokens and r.n_relaxed == 0 and r.verify == "relaxed"
    r = run(SOURCE_CONTEXT)            # a retrieved one is, under a rule that accepts anything
    assert r.n_relaxed > 0 and tok in r.tokens and r.tokens != ref.tokens
    eng = Engine(model.backend, _FixedDrafter(tok, SOURCE_CONTEXT), model.cost, cfg)
    with pytest.raises(ValueError, match="greedy"):     # the one check, made before run (which trusts it)
        eng.resolve(Request(toks, max_tokens=4, sampling=SamplingConfig(temperature=0.7, seed=1)))
