"""AdaPLD as published (drafters/adapld.py, the rerank in drafters/mechanisms/rerank.py):
worked examples on hand-written token arrays, rankings, embeddings and hidden
states.  Which anchors are chosen, which branch tokens and successor drafts
are added, and what the semantic fallback and the rerank do."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.drafters import make_drafter, parse_drafter_name
from edgespec.drafters.adapld import AdaPLDDrafter
from edgespec.drafters.hybrid import HybridConfig, HybridDrafter
from edgespec.drafters.embeddings import TokenEmbeddings
from edgespec.kernels.anchor import build_adapld_tree, single_anchors
from edgespec.core.tree import SOURCE_BRANCH, SOURCE_CONTEXT, SOURCE_SEMANTIC
from conftest import topk_table

I32 = np.int32


def rankings(n, rows: dict, k=8):
    return topk_table(n, rows, k)


def adapld_tree(ctx, ends, scale, exclude, tok, p, k_branch=8, succ=4, cap=16):
    n = len(ctx)
    buf = np.zeros(n + 1, I32)
    buf[:n] = ctx
    out = (np.zeros(cap, I32), np.zeros(cap, I32), np.zeros(cap, np.float32), np.zeros(cap, np.int8))
    one = (np.zeros(1, I32), np.zeros(1, I32))
    m = build_adapld_tree(buf, n, np.array(ends, I32), np.array(scale, np.float32), len(ends), exclude, tok, p,
                          n - 1, k_branch, succ, cap, *out, SOURCE_BRANCH, *one)
    return [(int(out[0][i]), int(out[1][i]), round(float(out[2][i]), 3)) for i in range(m)]


def test_branch_drafting_offers_the_models_top_k_minus_the_copied_token_with_successors():
    # position:  0  1  2  3  4  5  6  7  8  9  10 (root)
    ctx = [5, 6, 7, 1, 2, 3, 9, 8, 4, 1, 2]
    # the lexical anchor: "1 2" ended at 4 before, so retrieval copies 3 9 8 ...;
    # when the model read "5 6 7 1 2" it ranked 3 first, then 9, 7, 8
    tok, p = rankings(11, {4: [(3, .5), (9, .2), (7, .15), (8, .1)]})
    nodes = adapld_tree(ctx, [4], [1.0], True, tok, p)
    # branch tokens: 9, 7, 8 beside the copied 3 (3 itself is the retrieval tree's,
    # so it is left out), with the model's probabilities
    assert [n for n in nodes if n[1] == -1] == [(9, -1, 0.2), (7, -1, 0.15), (8, -1, 0.1)]
    # successor drafting: under each branch token, what followed its latest earlier
    # occurrence (a 1-token match, L = 1: confidences 1/3, 2/4, 3/5, 4/6):
    # 9 at 6 -> 8 4 1 2;  7 at 2 -> 1 2 3 9;  8 at 7 -> 4 1 2 (the context ends there)
    assert nodes == [(9, -1, 0.2), (8, 0, 0.333), (4, 1, 0.5), (1, 2, 0.6), (2, 3, 0.667),
                     (7, -1, 0.15), (1, 5, 0.333), (2, 6, 0.5), (3, 7, 0.6), (9, 8, 0.667),
                     (8, -1, 0.1), (4, 10, 0.333), (1, 11, 0.5), (2, 12, 0.6)]
    # K caps the branch width (K = 2: the top 2 are 3 and 9, minus the copied 3), and
    # successor_len = 0 switches successor drafting off
    assert adapld_tree(ctx, [4], [1.0], True, tok, p, k_branch=2, succ=0) == [(9, -1, 0.2)]
    # a semantic anchor copies nothing, so its whole ranking is offered, scaled by
    # the anchor's similarity (0.5)
    assert [n for n in adapld_tree(ctx, [4], [0.5], False, tok, p, succ=0)] == \
        [(3, -1, 0.25), (9, -1, 0.1), (7, -1, 0.075), (8, -1, 0.05)]
    # the capacity holds, parents first
    assert len(adapld_tree(ctx, [4], [1.0], True, tok, p, cap=3)) == 3


def test_single_token_anchors_at_tau():
    ctx = np.array([10, 20, 30, 40, 50], I32)          # root 50
    sim = np.full(64, -1.0, np.float32)
    sim[[10, 20, 30, 40]] = [0.12, 0.5, 0.05, 0.3]
    ends, score = np.zeros(4, I32), np.zeros(4, np.float32)
    k = single_anchors(ctx, 5, sim, 0.1, 4, ends, score)
    # single tokens (not pairs) at cosine >= 0.1: 20 (0.5) at 1, 40 (0.3) at 3, 10 (0.12)
    # at 0; 30 (0.05) is below tau; best first
    assert k == 3 and ends[:3].tolist() == [1, 3, 0]
    assert np.allclose(score[:3], [0.5, 0.3, 0.12])
    assert single_anchors(ctx, 5, sim, 0.1, 1, ends, score) == 1 and ends[0] == 1


def _embeddings():
    V, D = 64, 8
    rng = np.random.default_rng(0)
    E = rng.standard_normal((V, D)).astype(np.float32)
    E[11] = E[10] + 0.05 * rng.standard_normal(D)      # 11 ~ 10
    return TokenEmbeddings.from_matrix(E)


def test_semantic_fallback_gives_a_branch_and_successors_never_a_copy():
    d = AdaPLDDrafter(branch=True, embeddings=_embeddings())
    assert d.prefill_topk == 8 and d.topk == 8
    d.warmup()
    # the root 11 occurs nowhere earlier: the lexical set is empty
    prompt = np.array([3, 10, 4, 5, 6, 7, 11], I32)
    d.begin(prompt)
    # after reading "3 10" the model expected 20, then 21; the text went on with 4
    pre_t, pre_l = np.full((7, 8), -1, I32), np.full((7, 8), -50.0, np.float32)   # unknown ranks: no mass
    pre_t[1, :2], pre_l[1, :2] = [20, 21], [3.0, 2.0]
    d.observe_prefill(0, pre_t, pre_l)
    t = d.propose(prompt, 16)
    t.validate(64)
    # the semantic anchor is position 1 (token 10, the most similar to 11); the
    # model's ranking there is offered, scaled by the similarity; 4, the text
    # that followed 10, is not copied
    assert sorted(t.tokens.tolist()) == [20, 21] and (t.parents == -1).all()
    assert (t.source == SOURCE_SEMANTIC).all()
    sim = float((_embeddings().rows([10]) @ _embeddings().rows([11]).T)[0, 0])
    assert t.probs[0] == pytest.approx(sim / (1 + np.exp(-1.0)), rel=1e-4)   # softmax(3, 2)[0] * sim
    # when the model's ranking there holds a token that occurred before (4), the
    # successor drafts continue from its latest occurrence: 5 6 7 11
    pre_t[1, :2], pre_l[1, :2] = [4, 20], [3.0, 2.0]
    d.begin(prompt)
    d.observe_prefill(0, pre_t, pre_l)
    t = d.propose(prompt, 16)
    chain, node = [], 0
    assert t.tokens[0] == 4
    while True:
        kids = np.flatnonzero(t.parents == node)
        if len(kids) == 0:
            break
        node = int(kids[0])
        chain.append(int(t.tokens[node]))
    assert chain == [5, 6, 7, 11]
    # with a lexical anchor ("6 7" again at the end) the fallback stays silent and
    # the branches sit beside the copied token instead
    ctx = np.array([3, 10, 4, 5, 6, 7, 11, 6, 7], I32)
    d.begin(ctx)
    pre_t, pre_l = np.full((9, 8), -1, I32), np.full((9, 8), -50.0, np.float32)
    pre_t[5, :3], pre_l[5, :3] = [11, 30, 31], [3.0, 2.0, 1.0]    # after "... 6 7": 11 (copied), 30, 31
    d.observe_prefill(0, pre_t, pre_l)
    t = d.propose(ctx, 16)
    assert set(t.tokens[t.parents == -1].tolist()) == {30, 31} and (t.source == SOURCE_BRANCH).all()


def test_hybrid_switches_and_copy_length():
    name, _, sw = parse_drafter_name("auto+branch-nobranch_depth+copy_len=30")
    d = make_drafter(name, n_vocab=100, **sw)
    assert [p.name for p in d.parts] == ["suffix", "adapld", "trigram", "adjacency"]
    assert d.prefill_topk == 8 and d._suffix.config.max_depth == 30
    # today's defaults: edgespec's variants on, the published ones off, copy length 32
    d = make_drafter("auto", n_vocab=100)
    assert [p.name for p in d.parts] == ["suffix", "branch", "trigram", "adjacency"]
    assert d.prefill_topk == 0 and d._suffix.config.max_depth == 32
    with pytest.raises(ValueError):
        parse_drafter_name("auto+copy_len=x")
    with pytest.raises(ValueError):
        parse_drafter_name("auto+trigram=3")       # a switch, not a numeric setting
    assert parse_drafter_name("auto+trigger_theta=2.5")[2] == {"trigger_theta": 2.5}


def test_rerank_orders_anchors_by_the_models_hidden_states():
    cfg = HybridConfig(trigram=False, adjacency=False, branch_depth=False, ema=False, entropy=False,
                       rerank=True, rerank_top=1)
    d = HybridDrafter(100, config=cfg)
    assert d.wants_hidden
    # position: 0  1  2  3  4  5  6  7  8 (root)
    ctx = np.array([1, 2, 7, 1, 2, 8, 5, 1, 2], I32)
    d.begin(ctx)
    # "1 2" ended at 1 (then 7) and at 4 (then 8).  The model's state where it
    # predicted the root (position 7) is like its state at position 0 (before
    # the older "2"), unlike the one at 3 (before the newer "2")
    H = np.zeros((9, 4), np.float32)
    H[:, 3] = 1.0
    H[0] = H[7] = [1.0, 0.2, 0.0, 0.0]
    H[3] = [0.0, 0.0, 1.0, 0.0]
    d.observe_prefill_hidden(0, H)
    t = d.propose(ctx, 8)
    # the older occurrence wins the rerank and alone is kept: 7 is drafted, not 8
    assert t.tokens[t.parents == -1].tolist() == [7] and t.source[0] == SOURCE_CONTEXT
    # without the rerank both occurrences are drafted, the more recent (8) first
    d2 = HybridDrafter(100, config=HybridConfig(trigram=False, adjacency=False, branch_depth=False, ema=False,
                                                entropy=False))
    d2.begin(ctx)
    assert d2.propose(ctx, 8).tokens[:2].tolist() == [8, 7]
    # no hidden state at the root's position yet (a new request): the order stays
    ctx2 = np.array([4, 4, 1, 2, 7, 1, 2, 8, 5, 1, 2], I32)
    d.begin(ctx2)
    assert d.propose(ctx2, 8).tokens[:2].tolist() == [8, 7]
