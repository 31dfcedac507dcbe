"""Tests of the adjacency drafter (Token Recycling) and the top-k kernel, against
hand-worked cases and pure-Python references.  No model needed."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from edgespec.drafters.adjacency import (
    AdjacencyConfig,
    AdjacencyDrafter,
    best_rank_paths,
    default_rank_probs,
    template_arrays,
)
from edgespec.drafters.base import StepResult
from edgespec.kernels import adjacency as K
from edgespec.kernels.topk import push_entropy, topk_rows, topk_rows_vals
from edgespec.kernels.topk import warmup as topk_warmup
from edgespec.drafters.tree import SOURCE_ADJACENCY, DraftTree


@pytest.fixture(scope="module", autouse=True)
def _warm():
    K.warmup()
    topk_warmup()


# --------------------------------------------------------------------------
# helpers

def step(inputs, rows):
    """A StepResult carrying only the top-k part (what observe() reads)."""
    inputs = np.asarray(inputs, np.int32)
    return StepResult(inputs, inputs, DraftTree.empty(), np.zeros(0, bool), np.zeros(0, bool),
                      topk_input=inputs, topk_tokens=np.asarray(rows, np.int32).reshape(len(inputs), -1)
                      if len(inputs) else np.zeros((0, 0), np.int32))


def fake_corpus(docs, n_vocab, width):
    """A duck-typed compiled corpus holding only the successor rows, built the
    way CORPUS_SPEC.md defines them: per token its `width` most frequent
    successors within a document, count descending, ties token ascending."""
    counts: dict = {}
    for d in docs:
        for a, b in zip(d[:-1], d[1:]):
            counts.setdefault(int(a), {}).setdefault(int(b), 0)
            counts[int(a)][int(b)] += 1
    nxt = np.full((n_vocab, width), -1, np.int32)
    cnt = np.zeros((n_vocab, width), np.uint32)
    for a, succ in counts.items():
        best = sorted(succ.items(), key=lambda kv: (-kv[1], kv[0]))[:width]
        for j, (b, c) in enumerate(best):
            nxt[a, j], cnt[a, j] = b, c
    return SimpleNamespace(n_vocab=n_vocab, adj_next=nxt, adj_count=cnt)


def ref_merge(corpora, n_vocab, k):
    """Pure-Python reference of the corpus seed: summed counts, top k."""
    adj = np.full((n_vocab, k), -1, np.int32)
    for v in range(n_vocab):
        tot: dict = {}
        for c in corpora:
            for t, n in zip(c.adj_next[v].tolist(), c.adj_count[v].tolist()):
                if t >= 0 and n > 0:
                    tot[t] = tot.get(t, 0) + n
        best = sorted(tot.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        for j, (t, _) in enumerate(best):
            adj[v, j] = t
    return adj


def ref_expand(adj, origin, scale, root, template, rank_probs, max_nodes):
    """Pure-Python reference of expand_template on rank paths."""
    nodes = []        # (token, parent expanded index, prob, cum)
    at = {}           # path -> expanded index
    for path in template:
        par = path[:-1]
        if par:
            if par not in at:
                continue
            pe = at[par]
            pt, pc = nodes[pe][0], nodes[pe][3]
        else:
            pe, pt, pc = -1, root, 1.0
        t = int(adj[pt, path[-1]])
        if t < 0:
            continue
        p = float(np.float32(np.float32(rank_probs[path[-1]]) * np.float32(scale[origin[pt]])))
        if p <= 0:
            continue
        if any(n[1] == pe and n[0] == t for n in nodes):
            continue
        at[path] = len(nodes)
        nodes.append((t, pe, p, pc * p))
    order = sorted(range(len(nodes)), key=lambda i: -nodes[i][3])   # stable
    new = {}
    toks, pars, probs = [], [], []
    for r, i in enumerate(order[:max_nodes]):
        new[i] = r
        toks.append(nodes[i][0])
        pars.append(-1 if nodes[i][1] < 0 else new[nodes[i][1]])
        probs.append(nodes[i][2])
    return toks, pars, probs


def check_tree(tree: DraftTree, n_vocab: int):
    tree.validate(n_vocab=n_vocab)
    assert tree.tokens.dtype == np.int32 and tree.parents.dtype == np.int32
    assert tree.probs.dtype == np.float32 and tree.source.dtype == np.int8
    assert np.all(tree.source == SOURCE_ADJACENCY)
    assert np.all((tree.probs > 0) & (tree.probs <= 1))
    # path scores never increase along the output order
    cum = np.zeros(len(tree))
    for i, p in enumerate(tree.parents):
        cum[i] = tree.probs[i] * (1.0 if p < 0 else cum[p])
    assert np.all(np.diff(cum) <= 1e-12)
    for p in set(tree.parents.tolist()):
        assert tree.probs[tree.parents == p].sum() <= 1.0 + 1e-6


# --------------------------------------------------------------------------
# topk_rows

def ref_topk(logits, rows, k):
    out = []
    for r in rows:
        if 0 <= r < logits.shape[0]:
            out.append(np.argsort(-logits[r], kind="stable")[:k].tolist())
        else:
            out.append([-1] * k)
    return out


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_topk_rows_matches_argsort(data):
    n_batch = data.draw(st.integers(1, 5))
    n_vocab = data.draw(st.sampled_from([1, 3, 8, 31, 63, 64, 65, 127, 128, 200, 1000]))
    k = data.draw(st.integers(1, 32))
    ties = data.draw(st.booleans())
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if ties:   # few distinct values: many ties, also across block boundaries
        logits = rng.integers(-3, 4, size=(n_batch, n_vocab)).astype(np.float32)
    else:
        logits = (rng.standard_normal((n_batch, n_vocab)) * 4).astype(np.float32)
    if data.draw(st.booleans()):
        logits.setflags(write=False)
    dt = data.draw(st.sampled_from([np.int32, np.int64]))
    n_rows = data.draw(st.integers(0, 6))
    rows = np.array(data.draw(st.lists(st.integers(-1, n_batch), min_size=n_rows, max_size=n_rows)), dt)
    out = np.full((max(n_rows, 1), 33), -7, np.int32)
    got = topk_rows(logits, rows, n_rows, k, out)
    assert got == n_rows
    kk = min(k, n_vocab)
    assert out[:n_rows, :kk].tolist() == ref_topk(logits, rows.tolist(), kk)
    assert np.all(out[:n_rows, kk:] == -7)    # columns past k untouched


def test_topk_rows_full_vocab_and_clamps():
    rng = np.random.default_rng(1)
    v = 49152
    logits = (rng.standard_normal((6, v)) * 3).astype(np.float32)
    logits[2, 40000] = logits[2, 17] = logits[2, 49151] = 50.0   # a three-way tie at the top
    logits[4] = np.linspace(-1, 1, v, dtype=np.float32)         # ascending: the slow path
    rows = np.array([2, 0, 4, 5], np.int64)
    out = np.zeros((4, 8), np.int32)
    assert topk_rows(logits, rows, 4, 8, out) == 4
    assert out.tolist() == ref_topk(logits, rows, 8)
    assert out[0, :3].tolist() == [17, 40000, 49151]
    # n_rows clamped to len(rows) and the output; k clamped to the output width
    small = np.zeros((2, 3), np.int32)
    assert topk_rows(logits, rows, 10, 8, small) == 2
    assert small.tolist() == [r[:3] for r in ref_topk(logits, rows[:2], 3)]
    assert topk_rows(logits, rows, 0, 8, out) == 0
    assert topk_rows(logits, rows, 2, 0, out) == 0


def test_topk_rows_vals_writes_the_logits():
    logits = np.array([[0.5, 3.0, -1.0, 3.0, 2.0],
                       [9.0, 1.0, 1.0, 8.5, -2.0]], np.float32)
    tok = np.full((3, 4), -7, np.int32)
    val = np.full((3, 4), -7.0, np.float32)
    assert topk_rows_vals(logits, np.array([1, 0, 2], np.int64), 3, 3, tok, val) == 3
    assert tok[:2, :3].tolist() == [[0, 3, 1], [1, 3, 4]]
    assert val[:2, :3].tolist() == [[9.0, 8.5, 1.0], [3.0, 3.0, 2.0]]
    assert tok[2, :3].tolist() == [-1, -1, -1]              # a row out of range
    assert tok[:, 3].tolist() == [-7, -7, -7] and val[0, 3] == -7.0    # past k: untouched
    with pytest.raises(ValueError):                          # values buffer too small
        topk_rows_vals(logits, np.array([0, 1], np.int64), 2, 3, tok, np.zeros((1, 3), np.float32))


def test_push_entropy_window():
    # uniform over 4 -> log 4; one certain entry (others -inf-like) -> ~0
    x = np.array([[1.0, 1.0, 1.0, 1.0], [50.0, 0.0, 0.0, 0.0], [2.0, 1.0, 0.0, -1.0]], np.float32)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    h = -(p * np.log(np.maximum(p, 1e-300))).sum(axis=1)     # reference, in numpy
    assert h[0] == pytest.approx(np.log(4)) and h[1] == pytest.approx(0.0, abs=1e-12)
    ring = np.zeros(2)
    assert push_entropy(x, 1, ring, 0) == pytest.approx(h[0])          # window holds 1 entry
    assert push_entropy(x[1:], 2, ring, 1) == pytest.approx((h[1] + h[2]) / 2)   # the last 2 of 3
    assert sorted(ring.tolist()) == pytest.approx(sorted([h[1], h[2]]))
    assert push_entropy(x, 0, np.zeros(2), 0) == 0.0


# --------------------------------------------------------------------------
# table updates

def test_update_rows_replaces_rows():
    adj = np.full((10, 4), -1, np.int32)
    origin = np.zeros(10, np.int8)
    adj[3] = [9, 8, 7, 6]
    origin[3] = K.ORIGIN_CORPUS
    inputs = np.array([3, 5, 12, -1, 3], np.int32)            # 12 and -1 out of range
    topk = np.array([[1, 2, 3, 4],
                     [5, 6, 7, 8],
                     [1, 1, 1, 1],
                     [1, 1, 1, 1],
                     [4, 3, 11, 0]], np.int32)                   # 11 out of range -> -1
    assert K.update_rows(adj, origin, inputs, topk, 5) == 3
    assert adj[3].tolist() == [4, 3, -1, 0]                    # the later row wins
    assert adj[5].tolist() == [5, 6, 7, 8]
    assert origin[3] == origin[5] == K.ORIGIN_MODEL
    assert np.all(adj[[0, 1, 2, 4, 6, 7, 8, 9]] == -1)
    # a narrower ranking pads with -1; n is clamped to the inputs
    assert K.update_rows(adj, origin, np.array([5], np.int32), np.array([[2, 1]], np.int32), 9) == 1
    assert adj[5].tolist() == [2, 1, -1, -1]


def test_observe_writes_model_rows_and_begin_keeps_them():
    d = AdjacencyDrafter(20, config=AdjacencyConfig(k=3, template=((0,), (1,), (0, 0))))
    d.begin(np.array([1, 2], np.int32))
    assert d.topk == 3
    d.observe(step([4, 7], [[7, 5, 6], [9, 4, 1]]))
    assert d.adj[4].tolist() == [7, 5, 6] and d.adj[7].tolist() == [9, 4, 1]
    d.observe(step([], np.zeros((0, 3))))                      # nothing: no change
    d.begin(np.array([4, 11, 7, 12], np.int32))                 # new request: the table stays
    assert d.adj[4].tolist() == [7, 5, 6] and d.adj[7].tolist() == [9, 4, 1]
    tree = d.propose(np.array([0, 4], np.int32), 10)
    assert tree.tokens.tolist() == [7, 9, 5]
    assert tree.parents.tolist() == [-1, 0, -1]
    d.reset()
    assert np.all(d.adj == -1) and np.all(d.origin == K.ORIGIN_EMPTY)


def test_prompt_bigrams_seed_only_unknown_rows():
    d = AdjacencyDrafter(10, config=AdjacencyConfig(k=3, template=((0,), (1,), (2,))))
    d.observe(step([2], [[9, 8, 7]]))
    d.begin(np.array([1, 5, 1, 6, 1, 5, 2, 3, 1, 7, 1, 8], np.int32))
    # token 1 was followed by 5, 6, 5, 7, 8: most recent distinct first, k = 3
    assert d.adj[1].tolist() == [8, 7, 5]
    assert d.adj[5].tolist() == [2, 1, -1]
    assert d.adj[2].tolist() == [9, 8, 7]                       # the model's row is kept
    assert d.origin[1] == K.ORIGIN_PROMPT and d.origin[2] == K.ORIGIN_MODEL
    # a later prompt refreshes prompt rows; model rows override them
    d.begin(np.array([1, 4], np.int32))
    assert d.adj[1].tolist() == [4, 8, 7]
    d.observe(step([1], [[3, 2, 0]]))
    d.begin(np.array([1, 9], np.int32))
    assert d.adj[1].tolist() == [3, 2, 0]
    # prompt rows are scored with prompt_scale
    tree = d.propose(np.array([5], np.int32), 8)
    assert tree.tokens.tolist() == [2, 1]
    np.testing.assert_allclose(tree.probs, np.array(d.config.rank_probs[:2]) * d.config.prompt_scale,
                               rtol=1e-6)
    off = AdjacencyDrafter(10, config=AdjacencyConfig(k=3, seed_prompt=False))
    off.begin(np.array([1, 5, 1, 6], np.int32))
    assert np.all(off.adj == -1)


# --------------------------------------------------------------------------
# corpus seed

def test_seed_from_corpora_sums_counts():
    v = 12
    a = fake_corpus([np.array([1, 2, 1, 2, 1, 3, 1, 4]), np.array([5, 6, 5, 6])], v, 3)
    b = fake_corpus([np.array([1, 3, 1, 3, 1, 3, 1, 7]), np.array([6, 5])], v, 2)
    # token 1: a says 2x2, 3x1, 4x1; b says 3x3, 7x1 -> 3:4, 2:2, 4:1, 7:1
    d = AdjacencyDrafter(v, corpora=[a, b], config=AdjacencyConfig(k=3, template=((0,), (1,), (2,), (0, 0))))
    assert d.adj[1].tolist() == [3, 2, 4]
    assert d.adj[6].tolist() == [5, -1, -1]
    assert d.adj.tolist() == ref_merge([a, b], v, 3).tolist()
    assert d.origin[1] == K.ORIGIN_CORPUS and d.origin[0] == K.ORIGIN_EMPTY
    # corpus rows score with corpus_scale; the model's row then replaces one
    tree = d.propose(np.array([1], np.int32), 10)
    # scores .2, .071, .038 at depth 1; (0, 0) = 1 after 3: path score .2 * .2 = .04
    assert tree.tokens.tolist() == [3, 2, 1, 4]
    assert tree.parents.tolist() == [-1, -1, 0, -1]
    rp = np.array(d.config.rank_probs)
    np.testing.assert_allclose(tree.probs, np.array([rp[0], rp[1], rp[0], rp[2]]) * 0.5, rtol=1e-6)
    d.observe(step([1], [[9, 3, 2]]))
    assert d.propose(np.array([1], np.int32), 1).tokens.tolist() == [9]
    d.reset()
    assert d.adj.tolist() == ref_merge([a, b], v, 3).tolist()
    with pytest.raises(ValueError, match="n_vocab"):
        AdjacencyDrafter(v + 1, corpora=[a])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_seed_matches_reference(data):
    v = data.draw(st.integers(2, 15))
    n_corp = data.draw(st.integers(1, 3))
    corpora = []
    for _ in range(n_corp):
        docs = data.draw(st.lists(st.lists(st.integers(0, v - 1), max_size=30), max_size=4))
        corpora.append(fake_corpus([np.array(d, np.int64) for d in docs], v, data.draw(st.integers(1, 4))))
    k = data.draw(st.integers(1, 6))
    d = AdjacencyDrafter(v, corpora=corpora, config=AdjacencyConfig(k=k))
    assert d.adj.tolist() == ref_merge(corpora, v, k).tolist()


# --------------------------------------------------------------------------
# template expansion

def test_expand_hand_written_table():
    # rows: 0 -> [1, 2, 3]; 1 -> [4, 4, -1] (a repeated entry); 2 -> [0, 5, 6];
    # 3 -> corpus row [7, ...]; 4 -> empty
    adj = np.full((8, 3), -1, np.int32)
    origin = np.zeros(8, np.int8)
    adj[0], origin[0] = [1, 2, 3], K.ORIGIN_MODEL
    adj[1], origin[1] = [4, 4, -1], K.ORIGIN_MODEL
    adj[2], origin[2] = [0, 5, 6], K.ORIGIN_MODEL
    adj[3], origin[3] = [7, 6, 5], K.ORIGIN_CORPUS
    template = ((0,), (1,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2,), (2, 0), (0, 0, 0), (1, 0, 0))
    rp = np.array([0.5, 0.25, 0.125], np.float32)
    scale = np.array([0.0, 0.5, 0.75, 1.0], np.float32)
    tp, tr = template_arrays(template)
    out_t = np.full(16, -9, np.int32)
    out_p = np.full(16, -9, np.int32)
    out_q = np.full(16, -9, np.float32)
    m = K.expand_template(adj, origin, scale, 0, tp, tr, rp, 16, out_t, out_p, out_q)
    # expanded (template order, skipped ones dropped):
    #   (0,)   1  p .5  cum .5        (1,)   2  p .25  cum .25
    #   (0,0)  4  p .5  cum .25       (0,1)  4 duplicate -> skipped   (0,2) -1 -> skipped
    #   (1,0)  0  p .5  cum .125      (1,1)  5  p .25  cum .0625
    #   (2,)   3  p .125 cum .125     (2,0)  7  corpus row: p .5*.5  cum .03125
    #   (0,0,0) row of 4 is empty -> skipped   (1,0,0) 1  p .5  cum .0625
    # sorted by cum (stable): (0,) (1,) (0,0) (1,0) (2,) (1,1) (1,0,0) (2,0)
    assert m == 8
    assert out_t[:m].tolist() == [1, 2, 4, 0, 3, 5, 1, 7]
    assert out_p[:m].tolist() == [-1, -1, 0, 1, -1, 1, 3, 4]
    np.testing.assert_allclose(out_q[:m], [.5, .25, .5, .5, .125, .25, .5, .25])
    assert out_t[m] == -9
    # a budget cuts the same order
    m3 = K.expand_template(adj, origin, scale, 0, tp, tr, rp, 3, out_t, out_p, out_q)
    assert m3 == 3 and out_t[:3].tolist() == [1, 2, 4]
    # root outside the vocabulary or with an empty row: nothing
    assert K.expand_template(adj, origin, scale, 8, tp, tr, rp, 16, out_t, out_p, out_q) == 0
    assert K.expand_template(adj, origin, scale, 4, tp, tr, rp, 16, out_t, out_p, out_q) == 0
    # scale 0 switches corpus rows off: (2, 0) disappears
    scale0 = np.array([0.0, 0.0, 0.75, 1.0], np.float32)
    m = K.expand_template(adj, origin, scale0, 0, tp, tr, rp, 16, out_t, out_p, out_q)
    assert out_t[:m].tolist() == [1, 2, 4, 0, 3, 5, 1]
    # matches the reference
    assert ref_expand(adj, origin, scale, 0, template, rp, 16) == (
        [1, 2, 4, 0, 3, 5, 1, 7], [-1, -1, 0, 1, -1, 1, 3, 4], [.5, .25, .5, .5, .125, .25, .5, .25])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_expand_random_tables(data):
    v = data.draw(st.integers(1, 6))          # tiny vocabularies: many repeats
    k = data.draw(st.integers(1, 4))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    adj = rng.integers(-1, v, size=(v, k)).astype(np.int32)
    origin = rng.integers(0, 4, size=v).astype(np.int8)
    origin[np.all(adj < 0, axis=1)] = K.ORIGIN_EMPTY
    template = best_rank_paths(default_rank_probs(k), data.draw(st.integers(1, 40)),
                               data.draw(st.integers(1, 6)))
    cfg = AdjacencyConfig(k=k, template=template,
                          corpus_scale=data.draw(st.sampled_from([0.0, 0.5, 1.0])))
    d = AdjacencyDrafter(v, config=cfg)
    d.adj[...] = adj
    d.origin[...] = origin
    root = data.draw(st.integers(0, v - 1))
    budget = data.draw(st.integers(-1, 50))
    tree = d.propose(np.array([root], np.int32), budget)
    check_tree(tree, v)
    assert len(tree) <= max(budget, 0)
    ref = ref_expand(adj, origin, d._scale, root, template, cfg.rank_probs, max(budget, 0))
    assert tree.tokens.tolist() == ref[0]
    assert tree.parents.tolist() == ref[1]
    np.testing.assert_allclose(tree.probs, ref[2], rtol=1e-6)
    # a smaller budget gives a prefix of the larger proposal
    if len(tree) > 1:
        small = d.propose(np.array([root], np.int32), len(tree) - 1)
        assert np.array_equal(small.tokens, tree.tokens[:-1])
        assert np.array_equal(small.parents, tree.parents[:-1])


def test_propose_budget_and_empty_cases():
    v = 50
    d = AdjacencyDrafter(v)
    d.warmup()
    assert len(d.propose(np.array([3], np.int32), 10)) == 0      # empty table
    rng = np.random.default_rng(0)
    for t in range(v):   # distinct successors per row, like a model's top-k
        d.observe(step([t], [rng.permutation(v)[:8]]))
    ctx = np.array([7, 3], np.int32)
    full = d.propose(ctx, 1000)
    assert len(full) == len(d.config.template) == 24
    check_tree(full, v)
    for budget in (0, -2, 1, 2, 5, 23):
        tree = d.propose(ctx, budget)
        assert len(tree) == max(budget, 0)
        assert np.array_equal(tree.tokens, full.tokens[:len(tree)])
    assert len(d.propose(np.zeros(0, np.int32), 10)) == 0
    # first node: the root's rank-0 successor; the chain follows rank 0
    assert full.tokens[0] == d.adj[3, 0] and full.tokens[1] == d.adj[full.tokens[0], 0]
    # proposals do not alias the drafter's buffers
    a = d.propose(ctx, 4)
    d.propose(np.array([5], np.int32), 4)
    assert a.tokens.tolist() == full.tokens[:4].tolist()


# --------------------------------------------------------------------------
# configuration

def test_default_template_shape():
    c = AdjacencyConfig()
    assert c.k == 8 and len(c.rank_probs) == 8 and len(c.template) == 24
    assert c.template[:3] == ((0,), (0, 0), (0, 0, 0))
    assert (0, 0, 0, 0, 0, 0) in c.template and (1,) in c.template and (2,) in c.template
    seen = set()
    for p in c.template:
        assert len(p) == 1 or p[:-1] in seen
        seen.add(p)
    assert sum(default_rank_probs(32)) < 1.0
    assert AdjacencyDrafter.topk == 8 and AdjacencyDrafter.name == "adjacency"


@pytest.mark.parametrize("kw", [
    dict(k=0), dict(k=33), dict(k=2.0), dict(k=True),
    dict(template=()), dict(template=((1, 0),)), dict(template=((0,), (0,))),
    dict(template=((8,),)), dict(template=((0,), ())), dict(template="abc"),
    dict(rank_probs=(0.5,) * 7), dict(rank_probs=(0.1, 0.2) + (0.0,) * 6),
    dict(rank_probs=(0.5, 0.5, 0.1) + (0.0,) * 5), dict(rank_probs=(1.5,) + (0.0,) * 7),
    dict(corpus_scale=1.5), dict(prompt_scale=-0.1), dict(prompt_scale="x"),
    dict(seed_prompt=1), dict(template_nodes=0), dict(template_depth=0),
])
def test_config_rejects(kw):
    with pytest.raises(ValueError):
        AdjacencyConfig(**kw)


def test_drafter_rejects_bad_vocab_and_corpus_shape():
    with pytest.raises(ValueError):
        AdjacencyDrafter(0)
    bad = SimpleNamespace(n_vocab=5, adj_next=np.zeros((5, 2), np.int32), adj_count=np.zeros((5, 3), np.uint32))
    with pytest.raises(ValueError):
        AdjacencyDrafter(5, corpora=[bad])


def test_seed_from_compiled_corpus():
    corpus_mod = pytest.importorskip("edgespec.corpus.compile")
    if not hasattr(corpus_mod, "compile_tokens"):
        pytest.skip("edgespec.corpus.compile.compile_tokens not available")
    docs = [np.array([1, 2, 1, 2, 1, 3, 1, 4], np.int32), np.array([5, 6, 5, 6, 1, 3], np.int32)]
    corpus = corpus_mod.compile_tokens(docs, 12, k_adj=3)
    d = AdjacencyDrafter(12, corpora=[corpus, fake_corpus(docs, 12, 2)], config=AdjacencyConfig(k=4))
    # token 1: 2x2, 3x2, 4x1 in each corpus view (the second one keeps 2 of them)
    assert d.adj[1].tolist() == [2, 3, 4, -1]
    assert d.adj.tolist() == ref_merge([corpus, fake_corpus(docs, 12, 2)], 12, 4).tolist()
