"""AdaPLD as published (drafters/papers/adapld.py, the hidden states in
drafters/papers/rerank.py, the middle layer in backend/layer_tap.py):
worked examples of the paper's §3 on hand-written token arrays, rankings,
embeddings and hidden states.

Notation of the paper, 0-based here: the memory M is ctx[:n], the query
anchor a_i its last token ctx[n-1]; hidden row p is the model's state after
reading ctx[:p+1], so the "preceding context" of position t is row t - 1."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.drafters.tree import SOURCE_BRANCH, SOURCE_CONTEXT, SOURCE_SEMANTIC
from edgespec.drafters import make_drafter, parse_drafter_name
from edgespec.drafters.papers.adapld import AdaPLDDrafter, TokenCosines
from edgespec.drafters.embeddings import TokenEmbeddings
from edgespec.drafters.hybrid import HybridConfig, HybridDrafter
from edgespec.kernels.anchor import best_anchor, build_adapld_tree

I32 = np.int32
NO_SIMS = np.zeros(0, np.float32)


def unit(*v, d=6):
    x = np.zeros(d, np.float32)
    x[:len(v)] = v
    return x / np.linalg.norm(x)


def hidden(n, rows: dict, d=6):
    """Hidden states of n positions: the given rows, the others mutually
    orthogonal to them and to each other as far as d allows (a fixed far
    direction)."""
    H = np.tile(unit(0, 0, 0, 0, 0, 1, d=d), (n, 1))
    for p, v in rows.items():
        H[p] = v
    return H


def prefill_rankings(n, rows: dict, k=8):
    """The model's ranking after each position, as the prefill hands it:
    token ids and logits (rows not given: unknown)."""
    tok, lg = np.full((n, k), -1, I32), np.full((n, k), -50.0, np.float32)
    for p, pairs in rows.items():
        for r, (t, logit) in enumerate(pairs):
            tok[p, r], lg[p, r] = t, logit
    return tok, lg


def drafter(ctx, rankings=None, H=None, **kw):
    d = AdaPLDDrafter(**kw)
    d.warmup()
    ctx = np.array(ctx, I32)
    d.begin(ctx)
    d.observe_prefill(0, *(rankings or prefill_rankings(len(ctx), {})))
    if H is not None:
        d.observe_prefill_hidden(0, H)
    return d, ctx


def paths(t):
    """The proposal as its set of root-to-leaf token paths."""
    kids = {i: [] for i in range(len(t))}
    for i, p in enumerate(t.parents.tolist()):
        if p >= 0:
            kids[p].append(i)

    def walk(i):
        if not kids[i]:
            return [(int(t.tokens[i]),)]
        return [(int(t.tokens[i]),) + rest for c in kids[i] for rest in walk(c)]
    return {p for i in range(len(t)) if t.parents[i] == -1 for p in walk(i)}


def test_lexical_anchors_are_earlier_positions_of_the_single_last_token():
    # Eq. 3: C_lex = {j : M_j = a_i}.  The last token 7 occurred at 1 ("5 7"); the
    # context ends "6 7", so no two-token suffix repeats, yet 7 alone is an anchor
    ctx = [5, 7, 8, 9, 6, 7]
    d, c = drafter(ctx, branch=True)
    t = d.propose(c, 64)
    # Eqs. 8-9: the main copy M[j*+1 .. j*+l], l = min(30, |M| - j*) = 4 (to the end)
    assert paths(t) == {(8, 9, 6, 7)} and (t.source == SOURCE_CONTEXT).all()
    # the kernel: candidates are the positions holding the token, up to n-2
    H, known = np.zeros((0, 1), np.float32), np.zeros(0, np.bool_)
    assert best_anchor(c, 6, 7, NO_SIMS, 0.0, H, known, 4) == 1
    assert best_anchor(c, 6, 6, NO_SIMS, 0.0, H, known, 4) == 4
    assert best_anchor(c, 6, 3, NO_SIMS, 0.0, H, known, 4) == -1      # never occurred


# position:   0  1  2   3  4  5  6   7  8  9 (root 7)
CTX_TWO = [3, 7, 8, 11, 4, 7, 9, 12, 6, 7]
RANKS_TWO = {1: [(8, 3.0), (9, 2.0), (4, 1.0), (13, 0.5)],       # after "3 7": 8 (the text), 9, 4, 13
             5: [(9, 3.0), (21, 2.0)]}                             # after "... 4 7": 9 (the text), 21


def test_one_anchor_chosen_by_hidden_cosine_and_everything_drafted_from_it():
    # Eqs. 6-7: the root 7 occurred at 1 and 5; s(j) = cos(h_{j-1}, h_{n-2}).  The
    # state before the root (row 8) is like the one before the older 7 (row 0)
    H = hidden(10, {0: unit(1, 0.1), 8: unit(1, 0), 4: unit(0, 1)})
    d, c = drafter(CTX_TWO, prefill_rankings(10, RANKS_TWO), H, branch=True, rerank=True)
    assert d.wants_hidden and d.prefill_topk == 8
    t = d.propose(c, 64)
    # j* = 1: the copy M[2..9]; the branches: the top 8 after reading M[:2] minus the
    # copied 8 (Eq. 11); each branch gets its successor (Eq. 15): 9 was followed by 12,
    # 4 by 7; 13 never occurred, so it stays one token
    assert paths(t) == {(8, 11, 4, 7, 9, 12, 6, 7), (9, 12), (4, 7), (13,)}
    # nothing from the other occurrence: neither its copy (9 12 ...) nor its ranking (21)
    assert 21 not in t.tokens.tolist()
    roots = t.parents == -1
    assert (t.source[roots] == [SOURCE_CONTEXT, SOURCE_BRANCH, SOURCE_BRANCH, SOURCE_BRANCH]).all()
    p = np.exp([3.0, 2.0, 1.0, 0.5]) / np.exp([3.0, 2.0, 1.0, 0.5]).sum()   # softmax of the kept logits
    assert np.allclose(t.probs[roots][1:], p[1:], rtol=1e-5)
    # the same context, the state before the root now like the one before the newer 7
    H2 = hidden(10, {0: unit(0, 1), 8: unit(1, 0), 4: unit(1, 0.1)})
    d2, _ = drafter(CTX_TWO, prefill_rankings(10, RANKS_TWO), H2, branch=True, rerank=True)
    assert paths(d2.propose(c, 64)) == {(9, 12, 6, 7), (21,)}
    # without the rerank (or without hidden states) the most recent occurrence
    d3, _ = drafter(CTX_TWO, prefill_rankings(10, RANKS_TWO), branch=True)
    assert paths(d3.propose(c, 64)) == {(9, 12, 6, 7), (21,)}


# position:  0   1  2  3  4   5  6  7   8  9  10  11 (root 50)
CTX_SUCC = [1, 50, 2, 3, 9, 21, 4, 9, 22, 5, 6, 50]
RANKS_SUCC = {1: [(2, 3.0), (9, 2.0), (13, 1.0)]}     # after "1 50": 2 (the text), 9, 13


def test_a_successor_is_one_token_chosen_by_hidden_similarity():
    # Eqs. 13-14: branch 9 occurred at 4 (then 21) and at 7 (then 22); s_b(t) =
    # cos(h_{t-1}, h_{j*}) with j* = 1.  The state before the older 9 (row 3) is
    # like the anchor's (row 1)
    H = hidden(12, {1: unit(1, 0), 3: unit(1, 0.1), 6: unit(0, 1)})
    d, c = drafter(CTX_SUCC, prefill_rankings(12, RANKS_SUCC), H, branch=True, rerank=True)
    t = d.propose(c, 64)
    copy = (2, 3, 9, 21, 4, 9, 22, 5, 6, 50)
    # Eq. 15: one successor token, M[j_b + 1] = 21; not the latest occurrence's 22,
    # and not a longer copy of what followed (21 4 9 ...)
    assert paths(t) == {copy, (9, 21), (13,)}
    # the state before the newer 9 like the anchor's instead: its follower 22
    H2 = hidden(12, {1: unit(1, 0), 3: unit(0, 1), 6: unit(1, 0.1)})
    d2, _ = drafter(CTX_SUCC, prefill_rankings(12, RANKS_SUCC), H2, branch=True, rerank=True)
    assert paths(d2.propose(c, 64)) == {copy, (9, 22), (13,)}
    # successor_len = 0: branches without successors (the paper's "w/o successor drafting")
    d3, _ = drafter(CTX_SUCC, prefill_rankings(12, RANKS_SUCC), H, branch=True, rerank=True, successor_len=0)
    assert paths(d3.propose(c, 64)) == {copy, (9,), (13,)}


def _embeddings():
    """Token embeddings where 13 ~ 3 and 11 ~ 10 (raw cosine 0.6), every other
    token orthogonal to those four."""
    V, D = 64, 68
    E = np.zeros((V, D), np.float32)
    E[np.arange(V), 4 + np.arange(V)] = 1.0
    E[3], E[13] = unit(1, 0, d=D), unit(0.6, 0.8, d=D)
    E[10], E[11] = unit(0, 0, 1, d=D), unit(0, 0, 0.6, 0.8, d=D)
    return TokenEmbeddings.from_matrix(E)


def test_successor_backs_off_to_a_semantic_candidate():
    # §3.5: successor candidates follow the same lexical-first backoff as the anchor:
    # branch 13 never occurred, but 3 (cosine 0.6 >= tau) did, followed by 9
    d, c = drafter(CTX_SUCC, prefill_rankings(12, RANKS_SUCC), branch=True, embeddings=_embeddings())
    t = d.propose(c, 64)
    assert (13, 9) in paths(t) and (9, 22) in paths(t)      # 9 itself: lexical, the most recent
    # without the embeddings 13 gets no successor
    d2, _ = drafter(CTX_SUCC, prefill_rankings(12, RANKS_SUCC), branch=True)
    assert (13,) in paths(d2.propose(c, 64))


def test_semantic_fallback_fires_only_when_the_last_token_never_occurred():
    # position: 0  1   2  3  4  5  6 (root 11, new)
    ctx = [3, 10, 4, 5, 6, 7, 11]
    ranks = prefill_rankings(7, {1: [(20, 3.0), (21, 2.0)]})     # after "3 10": 20, 21; the text: 4
    d, c = drafter(ctx, ranks, branch=True, embeddings=_embeddings())
    t = d.propose(c, 64)
    # Eqs. 4-5: C_lex is empty, C_sem = {1} (10, cosine 0.6); Eq. 11: the whole top K
    # there, no copy of what followed 10 (4 5 ...), sources semantic
    assert paths(t) == {(20,), (21,)} and (t.source == SOURCE_SEMANTIC).all()
    # the root occurred before (at 5 below): the lexical anchor, never the fallback,
    # even though 10 (similar) is there too
    ctx2 = [3, 10, 4, 5, 11, 8, 6, 11]
    d2, c2 = drafter(ctx2, prefill_rankings(8, {1: [(20, 3.0)], 4: [(8, 3.0), (30, 2.0)]}), branch=True,
                     embeddings=_embeddings())
    t2 = d2.propose(c2, 64)
    assert paths(t2) == {(8, 6, 11), (30,)} and SOURCE_SEMANTIC not in t2.source.tolist()
    # the fallback alone (no `branch`) leaves lexical anchors to the suffix part
    d3, c3 = drafter(ctx2, branch=False, embeddings=_embeddings())
    assert len(d3.propose(c3, 64)) == 0
    d4, c4 = drafter(ctx, ranks, branch=False, embeddings=_embeddings())
    assert paths(d4.propose(c4, 64)) == {(20,), (21,)}


def test_semantic_candidates_use_the_raw_token_embeddings_at_tau():
    # Eq. 4: cos(e_{M_j}, e_{a_i}) of the model's token embeddings, as they are (no
    # centring), against tau = 0.1
    rng = np.random.default_rng(0)
    E = rng.standard_normal((32, 8)).astype(np.float32) + 2.0      # a direction every row shares
    emb = TokenEmbeddings.from_matrix(E)
    ctx = np.array([5, 6, 7, 8], I32)
    sims = TokenCosines(emb).of(ctx, 4, 9)
    raw = E / np.linalg.norm(E, axis=1, keepdims=True)
    assert np.allclose(sims[[5, 6, 7, 8]], raw[[5, 6, 7, 8]] @ raw[9], atol=1e-5)
    # a candidate qualifies at cosine >= tau; without hidden states the most recent
    s = np.full(32, -1.0, np.float32)
    s[[5, 6, 7]] = [0.12, 0.5, 0.05]
    H, known = np.zeros((0, 1), np.float32), np.zeros(0, np.bool_)
    assert best_anchor(ctx, 4, 9, s, 0.1, H, known, 2) == 1
    s[6] = 0.09
    assert best_anchor(ctx, 4, 9, s, 0.1, H, known, 2) == 0


def test_copy_length_is_min_of_l_m_and_what_memory_holds():
    # Eq. 8: l = min(l_m, |M| - j*) with l_m = 30 (the paper's setting)
    ctx = list(range(100, 160)) + [102]
    d, c = drafter(ctx, branch=False, rerank=True)
    (path,) = paths(d.propose(c, 64))
    assert path == tuple(range(103, 133)) and len(path) == 30
    d2, _ = drafter(ctx, branch=False, rerank=True, copy_len=5)
    assert paths(d2.propose(c, 64)) == {tuple(range(103, 108))}
    # the kernel with a small budget keeps the first copied token and the branches,
    # cutting the copy's deep end first
    out = (np.zeros(3, I32), np.zeros(3, I32), np.zeros(3, np.float32), np.zeros(3, np.int8))
    m = build_adapld_tree(c, len(c), 2, 30, np.array([7, 8], I32), np.array([.3, .2], np.float32), 2,
                          np.array([-1, -1], I32), 1, 3, *out, SOURCE_CONTEXT, SOURCE_BRANCH)
    assert m == 3 and out[0].tolist() == [103, 7, 8] and out[1].tolist() == [-1, -1, -1]


def test_hybrid_switches_settings_and_the_shared_hidden_states():
    name, _, sw = parse_drafter_name("auto+branch+rerank-nobranch_depth+copy_len=30")
    d = make_drafter(name, n_vocab=100, **sw)
    assert [p.name for p in d.parts] == ["suffix", "adapld", "trigram", "adjacency"]
    assert d.roles == ["retrieval", "guess", "guess", "template"]
    suffix, adapld = d.parts[:2]
    assert d.prefill_topk == 8 and suffix.config.max_depth == 30 and adapld.copy_len == 30
    assert d.wants_hidden and d.hidden_layer == 0 and adapld.successor_len == 1
    name, _, sw = parse_drafter_name("auto+rerank+rerank_layer=5")
    assert make_drafter(name, n_vocab=100, **sw).hidden_layer == 5
    # today's defaults: edgespec's variants on, the published ones off, copy length 32
    d = make_drafter("auto", n_vocab=100)
    assert [p.name for p in d.parts] == ["suffix", "branch", "trigram", "adjacency"]
    assert d.prefill_topk == 0 and not d.wants_hidden and d.parts[0].config.max_depth == 32
    with pytest.raises(ValueError):
        parse_drafter_name("auto+copy_len=x")
    with pytest.raises(ValueError):
        HybridConfig(rerank_layer=-1)
    # the hybrid keeps the hidden states (whether or not the schedule lets the part
    # observe) and its AdaPLD part chooses by them
    cfg = HybridConfig(trigram=False, adjacency=False, branch_depth=False, ema=False, entropy=False,
                       rerank=True)
    h = HybridDrafter(100, config=cfg)
    adapld = h.parts[1]
    assert adapld.name == "adapld"
    c = np.array(CTX_TWO, I32)
    h.begin(c)
    h.observe_prefill_hidden(0, hidden(10, {0: unit(1, 0.1), 8: unit(1, 0), 4: unit(0, 1)}))
    assert paths(adapld.propose(c, 64)) == {(8, 11, 4, 7, 9, 12, 6, 7)}
    h.begin(c)       # same context: the states stay
    h.observe_prefill_hidden(0, hidden(10, {0: unit(0, 1), 8: unit(1, 0), 4: unit(1, 0.1)}))
    assert paths(adapld.propose(c, 64)) == {(9, 12, 6, 7)}


def _tree_step(be, toks):
    n = len(toks)
    be.decode_tree(np.array(toks, I32), np.arange(n, dtype=I32), np.zeros(n, I32), np.ones(n, I32), 1)


def test_middle_layer_hidden_states_leave_the_logits_bit_identical(model_path):
    from edgespec.backend.llama import LlamaBackend
    prefix = np.arange(200, 330, dtype=I32)
    chain = [1000, 2000, 3000, 4000]
    bes = [LlamaBackend(model_path, n_ctx=512, max_nodes=16) for _ in range(2)]
    try:
        for be in bes:
            be.prefill(prefix)
            be.kv_tokens = prefix.copy()
        plain, tapped = bes
        tapped.set_hidden(True, 0)           # block round(13/40 x 30) = 10 of SmolLM2's 30
        assert tapped.hidden_layer == 10 and tapped.n_past == len(prefix)
        _tree_step(plain, chain)
        _tree_step(tapped, chain)
        assert np.array_equal(plain.logits(), tapped.logits())
        rows = tapped.hidden().copy()
        assert rows.shape == (4, tapped.n_embd) and np.isfinite(rows).all()
        # row i is position i's: the same tokens decoded one at a time give the same rows
        tapped.keep(0)
        for i, tok in enumerate(chain):
            _tree_step(tapped, [tok])
            assert np.array_equal(tapped.hidden()[0], rows[i])
            tapped.keep(1)
        # another layer's states are other vectors: the final one (llama.cpp's own)
        plain.keep(0)
        plain.set_hidden(True)
        _tree_step(plain, chain[:1])
        final = plain.hidden()[0]
        assert abs(final @ rows[0]) / np.linalg.norm(final) / np.linalg.norm(rows[0]) < 0.99
        tapped.set_hidden(False)
        with pytest.raises(Exception):
            tapped.hidden()
    finally:
        for be in bes:
            be.close()
