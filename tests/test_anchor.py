"""The anchored parts of `auto`: the model's alternatives beside retrieved text
(AASD / AdaPLD branches, drafters/branch.py) and the semantic fallback
(drafters/semantic.py): kernels on hand-written token arrays, drafters with
hand-made rankings and embeddings, and the real GGUF's embeddings."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.drafters.base import StepResult
from edgespec.drafters.branch import BranchDrafter
from edgespec.drafters.semantic import SemanticDrafter
from edgespec.drafters.embeddings import TokenEmbeddings
from edgespec.kernels.anchor import build_branch_tree, path_probs, soft_anchors, softmax_rows
from edgespec.drafters.tree import SOURCE_ALIGN, SOURCE_BRANCH, SOURCE_SEMANTIC, DraftTree
from conftest import topk_table

I32 = np.int32


def rankings(n, rows: dict, k=4):
    return topk_table(n, rows, k)


def branch_tree(ctx, ends, tok, p, n_known=None, depth=3, alt=2, cap=16, n_prompt=0, misaligned_only=False,
                with_src=False):
    ctx = np.array(ctx, I32)
    out = (np.zeros(cap, I32), np.zeros(cap, I32), np.zeros(cap, np.float32), np.zeros(cap, np.int8))
    m = build_branch_tree(ctx, len(ctx), np.array(ends, I32), len(ends), tok, p,
                          len(ctx) - 1 if n_known is None else n_known, depth, alt, cap, *out, n_prompt,
                          misaligned_only, SOURCE_ALIGN, SOURCE_BRANCH)
    return [(int(out[0][i]), int(out[1][i]), round(float(out[2][i]), 3)) + ((int(out[3][i]),) if with_src else ())
            for i in range(m)]


def test_branch_tree_puts_the_models_alternatives_beside_the_copied_tokens():
    # context "1 2 3 9 ... 1 2": retrieval copies 3, 9 after the earlier "1 2" (end e = 1)
    ctx = [1, 2, 3, 9, 4, 1, 2]
    tok, p = rankings(7, {1: [(3, .6), (7, .3), (8, .05), (6, .01)],   # after "1 2": model agreed
                          2: [(5, .7), (9, .2)]})                      # after "3": model said 5, text 9
    nodes = branch_tree(ctx, [1], tok, p)
    # root children: 7 and 8 (3 is the copied token, left to retrieval; at most 2 alternatives)
    assert nodes[0] == (7, -1, 0.3) and nodes[1] == (8, -1, 0.05)
    # depth 2: the copied 3 (probability 0: an anchor, retrieval holds it), then the
    # model's own choice 5 beside the text's 9
    assert nodes[2] == (3, -1, 0.0)
    assert nodes[3] == (5, 2, 0.7)
    assert len(nodes) == 4          # row 3 unknown: nothing deeper


def test_branch_tree_respects_unknown_rows_capacity_and_shared_prefixes():
    ctx = [1, 2, 3, 1, 2, 3, 1, 2]
    tok, p = rankings(8, {1: [(4, .5), (3, .4)], 4: [(3, .5), (6, .4)]})
    # two occurrences of "1 2" (ends 4 and 1) give distinct alternatives 6 and 4 at the root
    nodes = branch_tree(ctx, [4, 1], tok, p)
    assert sorted(n[0] for n in nodes if n[1] == -1) == [4, 6]
    # rows at or past n_known are not read
    assert branch_tree(ctx, [4, 1], tok, p, n_known=1) == []
    # the capacity holds
    assert len(branch_tree(ctx, [4, 1], tok, p, cap=1)) == 1
    # a ranking that only repeats the copied token offers nothing
    tok2, p2 = rankings(8, {1: [(3, .9)]})
    assert branch_tree(ctx, [1], tok2, p2, depth=1) == []


def test_soft_anchors_rank_similar_pairs_and_skip_exact_ones():
    ctx = np.array([5, 10, 20, 7, 11, 21, 8, 10, 20, 12, 22], I32)
    V = 30
    s_last = np.full(V, -1.0, np.float32)
    s_prev = np.full(V, -1.0, np.float32)
    s_last[[20, 21, 22]] = [0.9, 0.7, 1.0]      # similarity to the last token 22
    s_prev[[10, 11, 12]] = [0.8, 0.65, 1.0]      # to the previous token 12
    end = np.zeros(4, I32)
    score = np.zeros(4, np.float32)
    k = soft_anchors(ctx, len(ctx), s_last, s_prev, 0.6, 4, end, score)
    # "10 20" twice (the more recent first on equal score), then "11 21"
    assert k == 3 and end[:k].tolist() == [8, 2, 5]
    assert np.allclose(score[:k], [0.85, 0.85, 0.675])
    # a higher threshold drops the weaker pair; an exact repeat of both is not an anchor
    assert soft_anchors(ctx, len(ctx), s_last, s_prev, 0.7, 4, end, score) == 2
    ctx2 = np.array([12, 22, 3, 12, 22], I32)
    assert soft_anchors(ctx2, 5, s_last, s_prev, 0.6, 4, end, score) == 0


def step(context, accepted, topk_tokens, topk_logits):
    ctx = np.array(context, I32)
    return StepResult(ctx, np.array(accepted, I32), DraftTree.empty(), np.zeros(0, bool), np.zeros(0, bool),
                      topk_input=np.array(context[len(context) - len(accepted) - 1:][:len(topk_tokens)], I32),
                      topk_tokens=np.array(topk_tokens, I32), topk_logits=np.array(topk_logits, np.float32))


def test_softmax_rows_write_into_their_positions():
    # two rows of kept logits (largest first): log(2), 0 -> 2/3, 1/3; equal -> 1/2 each
    x = np.array([[np.log(2.0), 0.0], [5.0, 5.0]], np.float32)
    out = np.full((4, 3), -1.0, np.float32)
    softmax_rows(x, out, 1, 2)
    np.testing.assert_allclose(out[1:3, :2], [[2 / 3, 1 / 3], [0.5, 0.5]], rtol=1e-6)
    assert (out[0] == -1).all() and (out[3] == -1).all() and (out[1:3, 2] == -1).all()


def test_path_probs_multiply_down_the_tree_and_mark_leaves():
    #   0 (0.5) -> 1 (0.4) -> 3 (0.5);  0 -> 2 (0.2);  4 (0.25) a second root
    par = np.array([-1, 0, 0, 1, -1], np.int32)
    pr = np.array([0.5, 0.4, 0.2, 0.5, 0.25], np.float32)
    cum, leaf = np.full(5, 9.0), np.zeros(5, np.bool_)
    path_probs(par, pr, 5, cum, leaf)
    np.testing.assert_allclose(cum, [0.5, 0.2, 0.1, 0.1, 0.25], rtol=1e-6)
    assert leaf.tolist() == [False, False, True, True, True]


def test_branch_drafter_keeps_prefill_and_verification_rankings_by_position():
    d = BranchDrafter(aasd_all=True, branch=True)      # edgespec's variant: alternatives at every prompt position
    assert d.prefill_topk == 4 and d.topk == 4
    prompt = np.array([1, 2, 3, 9, 4], I32)
    d.begin(prompt)
    # prefill rankings for positions 0..4; after "2" the model preferred 3 then 7
    pre_t = np.array([[2, 0, 0, 0], [3, 7, 8, 6], [5, 9, 0, 0], [4, 0, 0, 0], [1, 0, 0, 0]], I32)
    pre_l = np.array([[5, 0, 0, 0], [5, 4, 1, 0], [5, 4, 0, 0], [5, 0, 0, 0], [5, 0, 0, 0]], np.float32)
    d.observe_prefill(0, pre_t, pre_l)
    # one step: root 4 (position 4) verified, bonus 1 accepted, then root 1 at position 5
    d.observe(step([1, 2, 3, 9, 4, 1], [1], [[1, 2, 0, 0]], [[6, 5, 0, 0]]))
    d.observe(step([1, 2, 3, 9, 4, 1, 2], [2], [[2, 6, 0, 0]], [[6, 2, 0, 0]]))
    t = d.propose(np.array([1, 2, 3, 9, 4, 1, 2], I32), 16)
    assert (t.source == SOURCE_BRANCH).all()
    roots = {int(a): float(b) for a, b, q in zip(t.tokens, t.probs, t.parents) if q == -1}
    # after "1 2" (position 1, from the prefill) the model's 7 and 8 stand beside the copied 3
    assert set(roots) == {7, 8, 3} and roots[3] == 0.0 and roots[7] > roots[8] > 0
    # a new prompt that shares only "1 2" keeps those two rows and forgets the rest
    d.begin(np.array([1, 2, 6, 6], I32))
    assert d._tok[1, 1] == 7 and (d._tok[2:] == -1).all()


def test_branch_drafter_switches():
    assert BranchDrafter(aasd=False, branch=True).prefill_topk == 0
    only_aasd = BranchDrafter(aasd=True, branch=False)
    assert only_aasd.topk == 0 and not only_aasd.wants_observe()
    with pytest.raises(ValueError):
        BranchDrafter(aasd=False, branch=False)


def test_semantic_drafter_anchors_on_similar_tokens_only_without_an_exact_match():
    V, D = 64, 8
    rng = np.random.default_rng(0)
    E = rng.standard_normal((V, D)).astype(np.float32)
    E[11] = E[10] + 0.05 * rng.standard_normal(D)      # 11 ~ 10
    E[21] = E[20] + 0.05 * rng.standard_normal(D)      # 21 ~ 20
    emb = TokenEmbeddings.from_matrix(E)
    d = SemanticDrafter(emb, max_nodes=16)
    d.warmup()
    ctx = np.array([3, 10, 20, 30, 40, 50, 4, 5, 11, 21], I32)
    d.begin(ctx)
    t = d.propose(ctx, 16)
    # "11 21" is like "10 20": what followed there (30 40 50 ...) is proposed
    assert t.tokens[:3].tolist() == [30, 40, 50] and t.parents[:3].tolist() == [-1, 0, 1]
    assert (t.source == SOURCE_SEMANTIC).all() and 0 < t.probs[0] < 1
    # the incremental similarity cache gives what a fresh drafter computes
    ctx2 = np.append(ctx, [6, 7, 10, 20]).astype(I32)      # now "10 20" repeats exactly
    assert len(d.propose(ctx2, 16)) == 0
    ctx3 = np.append(ctx, [61]).astype(I32)
    fresh = SemanticDrafter(emb, max_nodes=16)
    fresh.begin(ctx3)
    assert d.propose(ctx3, 16).tokens.tolist() == fresh.propose(ctx3, 16).tokens.tolist()


def test_real_token_embeddings_find_neighbours(model):
    from edgespec.drafters.embeddings import TokenEmbeddings
    emb = TokenEmbeddings(model.model_path)
    v = model.vocab
    words = [" quickly", " rapidly", " table", " seven", " the"]
    ids = [int(v.tokenize(w, add_special=False)[0]) for w in words]
    x = emb.rows(ids)
    assert np.allclose(np.linalg.norm(x, axis=1), 1, atol=1e-4)
    sims = x @ x.T
    # " rapidly" is the closest of the others to " quickly"; unrelated words are far apart
    assert int(np.argmax(sims[0, 1:])) == 0 and sims[0, 1] > 0.6
    assert sims[2, 3] < 0.5


def test_prefill_rankings_match_the_logits(model):
    """backend.prefill(topk_out=...) ranks every prompt row, and leaves the last
    row's logits exactly as a plain prefill does."""
    be = model.backend
    toks = model.prompt_tokens("Name three colours of the rainbow and say why the sky is blue.")
    n = len(toks)
    be.reset()
    be.prefill(toks)
    plain_last = be.logits()[0].copy()
    be.reset()
    ids = np.full((n, 4), -1, I32)
    vals = np.zeros((n, 4), np.float32)
    be.prefill(toks, topk_out=(ids, vals))
    last = be.logits()
    assert last.shape[0] == 1 and np.array_equal(last[0], plain_last)
    assert ids[-1].tolist() == np.argsort(-plain_last, kind="stable")[:4].tolist()
    assert np.allclose(vals[-1], plain_last[ids[-1]])
    assert (ids >= 0).all() and (np.diff(vals, axis=1) <= 0).all()
    be.reset()
    model.engine.reset()


def test_auto_with_aasd_is_identical_and_keeps_prompt_rankings(model):
    """auto+aasd through the real engine, cost gate off (every proposed node
    verified): greedy output equals plain decoding, and the branch part holds
    the model's ranking at every prompt position after the prefill."""
    from conftest import dev_prompts
    eng = model.engine_for("auto+aasd")
    eng.config.cost_gate = False
    try:
        for row in dev_prompts(128, 140, 160):
            toks = model.prompt_tokens([{"role": "user", "content": row["turns"][0]}])
            ref = model.generate(toks, max_tokens=48, drafter="none")
            # prefilled whole: the positions of a reused prefix are not ranked again
            r = model.generate(toks, max_tokens=48, drafter="auto+aasd", reuse_prefix=False)
            assert r.tokens == ref.tokens, row["question_id"]
            br = next(p for p in eng.drafter.parts if p.name == "branch")
            assert (br._tok[:len(toks) - 1, 0] >= 0).all()
            # the ranking after the last prompt token starts with the first generated token
            assert br._tok[len(toks) - 1, 0] == ref.tokens[0]
    finally:
        eng.config.cost_gate = True
