"""Sampling through the tree engine keeps the model's distribution."""
from __future__ import annotations

import collections
import math

import numpy as np
import pytest

from edgespec import SamplingConfig
from edgespec.core.config import EngineConfig
from edgespec.core.engine import Engine
from edgespec.core.verify import sample_token, sampling_distribution

from conftest import OracleDrafter
from edgespec.core.engine import drain
from edgespec.core.params import Request


def chi2_critical(dof: int, alpha: float = 1e-3) -> float:
    """Upper alpha quantile of chi-square (Wilson-Hilferty approximation; z for 1e-3)."""
    z = 3.090232
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_sample_token_follows_the_distribution():
    """Unit check of the sampler: u sweeps the CDF, so the share of u values that
    map to each token equals its probability."""
    logits = np.array([2.0, 1.0, 0.5, -1.0, -3.0], np.float32)
    cfg = SamplingConfig(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05)
    cand, p = sampling_distribution(logits, cfg)
    # tempered softmax then top-k=4 drops token 4; top-p 0.9 keeps the tokens
    # until the cumulative share reaches 0.9
    assert cand[0] == 0 and 4 not in cand
    us = (np.arange(20000) + 0.5) / 20000
    counts = collections.Counter(sample_token(logits, cfg, u) for u in us)
    for t, pt in zip(cand, p):
        assert abs(counts[int(t)] / 20000 - pt) < 1e-3
    assert sample_token(logits, SamplingConfig(temperature=0.0), 0.99) == 0


@pytest.mark.parametrize("shape", ["fan", "chain"])
def test_same_seed_gives_same_text_as_plain_sampling(model, shape):
    """Each committed position consumes one uniform draw from the request's
    generator, as plain sampling does, so with equal logits a fixed seed gives
    the same tokens whatever the tree looked like."""
    toks = model.prompt_tokens("Write a short poem about rivers and mountains.")
    for seed in (1, 2, 3):
        cfg = SamplingConfig(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
        ref = model.generate(toks, max_tokens=48, sampling=cfg, drafter="none")
        drafter = OracleDrafter(len(toks), ref.tokens, shape, model.backend.n_vocab, seed=seed)
        eng = Engine(model.backend, drafter, model.cost, EngineConfig(max_nodes=24, cost_gate=False))
        res = drain(eng.run(eng.resolve(Request(toks, max_tokens=48, sampling=cfg, reuse_prefix=False))))
        assert res.tokens == ref.tokens
        assert res.n_draft_accepted > 5


def test_sampling_distribution_matches_plain_chi_square(model):
    """Independent seeds: the distribution of the first four sampled tokens from the
    tree engine (suffix drafts, every proposal verified) and from plain decoding
    agree (chi-square homogeneity test, alpha = 0.001)."""
    toks = model.prompt_tokens("red green blue, red green blue, red green blue, red green blue, red", raw=True)
    cfg_kw = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    n = 250
    samples = {}
    suffix = model.engine_for("suffix")
    suffix.config.cost_gate = False
    accepted = 0
    try:
        for name, drafter, base in (("plain", "none", 0), ("spec", "suffix", 10_000)):
            out = []
            for i in range(n):
                cfg = SamplingConfig(seed=base + i, **cfg_kw)
                r = model.generate(toks, max_tokens=4, sampling=cfg, drafter=drafter, reuse_prefix=True)
                out.append(tuple(r.tokens))
                if drafter == "suffix":
                    accepted += r.n_draft_accepted
            samples[name] = out
    finally:
        suffix.config.cost_gate = True
    assert accepted > n // 2, "the tree path was hardly exercised"
    ca, cb = collections.Counter(samples["plain"]), collections.Counter(samples["spec"])
    keys = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
    rows = [(ca[k], cb[k]) for k in keys]
    rest = (n - sum(a for a, _ in rows), n - sum(b for _, b in rows))
    if sum(rest) > 0:
        rows.append(rest)
    assert len(rows) >= 3, "too few distinct outcomes for a meaningful test"
    stat = 0.0
    for a, b in rows:
        tot = a + b
        for obs in (a, b):
            exp = tot / 2
            stat += (obs - exp) ** 2 / exp
    assert stat < chi2_critical(len(rows) - 1), (stat, rows)


def test_sampling_config_validation():
    with pytest.raises(ValueError):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingConfig(min_p=1.0)
