"""ADED as published (drafters/papers/aded.py, kernels/aded.py; `trigram+aded`): the
tri-gram matrix of Eq. (1) with the elimination threshold t, Adjust3Gram
(Algorithm 2), and the MCTS of Algorithm 1 (PUCT of Eqs. 2-3, selection,
expansion, rollout, backpropagation of 1 + the sum of tri-gram scores, the best
n sentences).  Worked examples on hand-made corpora; no model needed."""
from __future__ import annotations

import math

import numpy as np
import pytest

from edgespec.corpus.compile import compile_tokens
from edgespec.drafters import make_drafter, parse_drafter_name
from edgespec.drafters.base import StepResult
from edgespec.drafters.hybrid import HybridConfig, HybridDrafter
from edgespec.drafters.trigram import TrigramConfig, TrigramDrafter
from edgespec.kernels.trigram import exploration, puct_child, puct_score
from edgespec.drafters.tree import SOURCE_TRIGRAM, DraftTree

V = 32


def arr(x):
    return np.asarray(x, np.int32)


def corpus(docs, max_successors=16):
    return compile_tokens([arr(d) for d in docs], V, max_successors=max_successors)


def aded(docs=(), **kw):
    return TrigramDrafter(V, [corpus(docs)] if docs else [], TrigramConfig(aded=True, **kw))


def step(context, accepted):
    return StepResult(context=arr(context), accepted=arr(accepted), proposed=DraftTree.empty(),
                      node_accepted=np.zeros(0, bool), node_tested=np.zeros(0, bool))


def adjusted(d):
    """What Adjust3Gram wrote, as {(w1, w2, w3): value}."""
    return {(*ctx, w3): p for ctx, row in d._aded.adjusted().items() for w3, p in row.items()}


def leaves(tree):
    parents = set(int(p) for p in tree.parents)
    return [i for i in range(len(tree)) if i not in parents]


def path(tree, i):
    out = []
    while i >= 0:
        out.append(int(tree.tokens[i]))
        i = int(tree.parents[i])
    return out[::-1]


# a branching corpus, every tri-gram seen 12 times or more: after (1, 2), 3 twice as often
# as 4; then single chains 3 5 7 9 and 4 6 8 10
BRANCH = [[1, 2, 3, 5, 7, 9]] * 24 + [[1, 2, 4, 6, 8, 10]] * 12


def test_the_settings_are_the_papers():
    """Appendix, "Configuration of ADED": t = 12, s = 150, c1 = 32.0, c2 = 8.0, l = 4,
    n = 24."""
    c = TrigramConfig(aded=True)
    assert (c.trigram_min_count, c.iterations, c.c1, c.c2, c.max_depth, c.sequences) == \
        (12, 150, 32.0, 8.0, 4, 24)
    assert c.rollout and c.adjust
    # the default `trigram` is edgespec's variant: no threshold, no published search
    assert not TrigramConfig().aded and TrigramConfig().trigram_min_count == 1
    assert parse_drafter_name("trigram+aded") == ("trigram", True, {"aded": True})
    assert parse_drafter_name("auto+aded") == ("auto", True, {"aded": True})
    assert make_drafter("trigram+aded".split("+")[0], n_vocab=V, aded=True).config.aded


def test_puct_score_eqs_2_and_3():
    """E = C1 + log((sum_b N(s, b) + C2 + 1) / C2);
    PUCT(s, a) = Q(s, a) + E P(s, a) sqrt(sum_b N(s, b)) / (1 + N(s, a))."""
    e = 32.0 + math.log((10 + 8.0 + 1) / 8.0)
    assert exploration(10.0, 32.0, 8.0) == pytest.approx(e)
    assert puct_score(2.5, 0.25, 3, 10.0, 32.0, 8.0) == pytest.approx(2.5 + e * 0.25 * math.sqrt(10) / 4)


def test_selection_takes_the_child_of_highest_puct():
    """Both searches descend by puct_child: the child of highest Eq. 2 score
    under Eq. 3's E, Q the mean backed-up value (0 unvisited), ties to the
    earlier child.  Hand-made children of node 0 (nodes 1-4) where the
    highest prior, the highest mean value and the least visited each point
    elsewhere than PUCT does."""
    first = arr([1, 0, 0, 0, 0]); nch = arr([4, -1, -1, -1, -1])
    prior = np.array([0.0, 0.50, 0.20, 0.25, 0.05])
    visits = arr([0, 40, 2, 5, 0])
    value = np.array([0.0, 44.0, 3.0, 9.0, 0.0])      # Q: 1.1, 1.5, 1.8, 0
    c1, c2 = 1.0, 8.0                                   # a small C1, so that Q and the prior trade off
    sum_n = float(visits[1:].sum())
    scores = [puct_score(value[c] / visits[c] if visits[c] else 0.0, prior[c], visits[c], sum_n, c1, c2)
              for c in range(1, 5)]
    want = 1 + int(np.argmax(scores))
    assert want == 2
    assert want != 1 + int(np.argmax(prior[1:]))        # not the likeliest child
    assert want != 1 + int(np.argmin(visits[1:]))       # not the least visited
    assert want != 1 + int(np.argmax(value[1:] / np.maximum(visits[1:], 1)))    # not the best mean value
    assert puct_child(0, first, nch, prior, visits, value, c1, c2) == want
    # the paper's C1 = 32: the same rule
    assert puct_child(0, first, nch, prior, visits, value, 32.0, 8.0) == 1 + int(np.argmax(
        [puct_score(value[c] / visits[c] if visits[c] else 0.0, prior[c], visits[c], sum_n, 32.0, 8.0)
         for c in range(1, 5)]))
    # no visits yet: every score is Q = 0, the earlier child wins the tie
    assert puct_child(0, first, nch, prior, arr([0] * 5), np.zeros(5), c1, c2) == 1


def test_eq_1_without_the_trigrams_seen_fewer_than_t_times():
    """P(w_i | w_{i-2}, w_{i-1}) = C(w_{i-2}, w_{i-1}, w_i) / C(w_{i-2}, w_{i-1}), with t,
    "the threshold for the elimination of tri-gram probability", at 12."""
    docs = [[1, 2, 3]] * 20 + [[1, 2, 4]] * 13 + [[1, 2, 5]] * 12 + [[1, 2, 9]] * 11
    d = aded(docs)
    # 9 was seen 11 times: eliminated; 5 (12 times) stays; C(1, 2) is every occurrence (56)
    assert d.distribution(1, 2) == pytest.approx({3: 20 / 56, 4: 13 / 56, 5: 12 / 56})
    # the threshold is a setting of its own: t = 1 keeps every tri-gram
    assert aded(docs, min_count=1).distribution(1, 2) == pytest.approx(
        {3: 20 / 56, 4: 13 / 56, 5: 12 / 56, 9: 11 / 56})
    # no backoff: a context the matrix does not know has no successor, so no draft
    assert d.distribution(7, 2) == {}
    assert len(d.propose(arr([7, 2]), 16)) == 0
    # t applies to edgespec's variant too when asked (trigram+min_count=12)
    base = TrigramDrafter(V, [corpus(docs)], TrigramConfig(min_count=12))
    assert 9 not in base.distribution(1, 2) and 3 in base.distribution(1, 2)


def test_adjust3gram_raises_recent_trigrams_up_to_maxprob_without_decay():
    """Algorithm 2: for each tri-gram of tokens[n - maxLength : n], newProb =
    min(currentProb + increment, maxProb) if the matrix has it, else increment."""
    d = aded([[1, 2, 3]] * 20 + [[1, 2, 4]] * 16, adjust_length=5, adjust_increment=0.25,
             adjust_max_prob=0.6)
    assert d.distribution(1, 2) == pytest.approx({3: 20 / 36, 4: 16 / 36})
    prompt = [7, 1, 2, 3, 1, 2, 3]
    d.begin(arr(prompt))
    # subTokens = 2 3 1 2 3: (2, 3, 1) and (3, 1, 2) are new (0.25), (1, 2, 3) was
    # 20/36 = .556 and is capped at .6; (7, 1, 2) and the first (1, 2, 3) are too old
    assert adjusted(d) == pytest.approx({(2, 3, 1): 0.25, (3, 1, 2): 0.25, (1, 2, 3): 0.6})
    assert d.distribution(1, 2) == pytest.approx({3: 0.6, 4: 16 / 36})
    # each step runs it again over the input: +0.25 each time, up to maxProb
    d.observe(step(prompt, []))
    assert adjusted(d)[(2, 3, 1)] == pytest.approx(0.5)
    d.observe(step(prompt, []))
    assert adjusted(d)[(2, 3, 1)] == pytest.approx(0.6)
    # no sliding window, no decay: 200 tokens of other text later the raised values stay
    ctx = list(prompt)
    for i in range(100):
        ctx += [20 + i % 5, 26]
        d.observe(step(ctx, ctx[-2:]))
    assert d.distribution(1, 2) == pytest.approx({3: 0.6, 4: 16 / 36})
    assert d.distribution(2, 3)[1] == pytest.approx(0.6)
    # switched off (the paper's non-adaptive ablation), the matrix stays the corpus's
    fixed = aded([[1, 2, 3]] * 20 + [[1, 2, 4]] * 16, adjust=False)
    fixed.begin(arr(prompt))
    assert adjusted(fixed) == {}
    assert fixed.distribution(1, 2) == pytest.approx({3: 20 / 36, 4: 16 / 36})


def test_one_iteration_expands_the_root_moves_to_its_last_child_and_rolls_out():
    """Algorithm 1, one iteration from the root (token 2 after 1): expansion makes a
    child of every untried word (3 with P = 2/3, 4 with 1/3) and moves to the last
    (line 22); the simulation samples from the matrix until the state holds the root
    and l = 4 tokens (4 6 8 10); backpropagation adds score = 1 + the sum of the four
    tri-gram scores (1/3 + 1 + 1 + 1) to the node and the root."""
    d = aded(BRANCH, iterations=1)
    tree = d.propose(arr([0, 1, 2]), 64)
    s = d._aded.search_tree()
    assert s["iterations"] == 1
    assert s["tok"].tolist() == [2, 3, 4] and s["par"].tolist() == [-1, 0, 0]
    assert s["prior"][1:].tolist() == pytest.approx([2 / 3, 1 / 3])
    assert s["visits"].tolist() == [1, 0, 1]
    assert s["score"].tolist() == pytest.approx([1 + 1 / 3 + 3, 0, 1 + 1 / 3 + 3])
    # the rolled-out tokens are not tree nodes: the sentences are the tree's paths
    assert sorted(tree.tokens.tolist()) == [3, 4]
    # without the rollout the state ends at the expanded node: score 1 + 1/3
    d = aded(BRANCH, iterations=1, rollout=False)
    d.propose(arr([0, 1, 2]), 64)
    assert d._aded.search_tree()["score"].tolist() == pytest.approx([4 / 3, 0, 4 / 3])


def test_backpropagation_adds_one_plus_the_sum_of_the_path_scores():
    """Every node's accumulated score is the sum, over the iterations through it,
    of 1 + the tri-gram scores of the whole state (tree path plus rollout); with a
    corpus of unique continuations each state is full, so an iteration through a
    branch under 3 adds 1 + 2/3 + 3 and one under 4 adds 1 + 1/3 + 3."""
    d = aded(BRANCH)
    d.propose(arr([0, 1, 2]), 64)
    s = d._aded.search_tree()
    assert s["iterations"] == 150 and s["visits"][0] == 150
    by_tok = {int(t): i for i, t in enumerate(s["tok"]) if s["par"][i] == 0}
    for t, p in ((3, 2 / 3), (4, 1 / 3)):
        i = by_tok[t]
        assert s["score"][i] == pytest.approx(s["visits"][i] * (1 + p + 3))
    # the root's score sums every iteration's
    assert s["score"][0] == pytest.approx(sum(s["score"][i] for i in by_tok.values()))
    # the tree reaches the search depth l = 4 and no deeper
    depth = np.zeros(len(s["tok"]), int)
    for i in range(1, len(depth)):
        depth[i] = depth[s["par"][i]] + 1
    assert depth.max() == 4


def test_the_output_is_the_best_n_sentences_merged_into_a_tree():
    """"sentences <- extract sentences from root; sort sentences by score": the
    drafts are the root-to-leaf paths of the search tree, best (accumulated) score
    first, the top n = 24 merged into one tree (shared prefixes once)."""
    docs = []
    for a in range(3, 11):           # eight successors of (1, 2), each with four of its own
        for b in range(11, 15):
            docs += [[1, 2, a, b, a + 20, b + 10]] * 12
    d = TrigramDrafter(V, [corpus(docs, max_successors=8)], TrigramConfig(aded=True, max_nodes=200))
    tree = d.propose(arr([0, 1, 2]), 200)
    tree.validate(V)
    assert set(tree.source.tolist()) == {SOURCE_TRIGRAM}
    s = d._aded.search_tree()
    kids = np.zeros(len(s["tok"]), int)
    for p in s["par"][1:]:
        kids[p] += 1
    leaf_ids = [i for i in range(1, len(s["tok"])) if kids[i] == 0]
    assert len(leaf_ids) > 24
    ranked = sorted(leaf_ids, key=lambda i: (-s["score"][i], i))[:24]

    def sentence(i):
        out = []
        while i > 0:
            out.append(int(s["tok"][i]))
            i = int(s["par"][i])
        return out[::-1]
    # exactly the 24 best sentences, each once, and the best one drafted first
    assert sorted(path(tree, i) for i in leaves(tree)) == sorted(sentence(i) for i in ranked)
    assert path(tree, leaves(tree)[0]) == sentence(ranked[0])
    # n is a setting: one sentence is a single chain
    one = TrigramDrafter(V, [corpus(docs, max_successors=8)], TrigramConfig(aded=True, sequences=1))
    chain = one.propose(arr([0, 1, 2]), 64)
    assert chain.parents.tolist() == list(range(-1, len(chain) - 1)) and len(leaves(chain)) == 1


def test_budget_determinism_and_sibling_probabilities():
    d = aded(BRANCH)
    d.begin(arr([1, 2, 11, 1, 2, 12, 1, 2, 13]))       # Adjust3Gram: 11, 12, 13 after (1, 2)
    full = d.propose(arr([0, 1, 2]), 64)
    full.validate(V)
    again = d.propose(arr([0, 1, 2]), 64)                # the generator restarts each search
    assert full.tokens.tolist() == again.tokens.tolist()
    assert full.parents.tolist() == again.parents.tolist()
    small = d.propose(arr([0, 1, 2]), 3)
    assert len(small) == 3 and small.tokens.tolist() == full.tokens[:3].tolist()
    # adjusted values need not sum to 1 (2/3 + 1/3 + 3 x 0.1 here); the drafted siblings do
    roots = full.parents == -1
    assert float(full.probs[roots].sum()) == pytest.approx(1.0, abs=1e-6)


def test_auto_aded_switches_the_trigram_part_to_the_published_form():
    d = HybridDrafter(V, [corpus(BRANCH)], HybridConfig(aded=True, suffix=False, adjacency=False,
                                                        branch_depth=False, semantic_pair=False))
    (part,) = [p for p in d.parts if isinstance(p, TrigramDrafter)]
    assert part.config.aded and part.config.trigram_min_count == 12
    default = HybridDrafter(V, [corpus(BRANCH)], HybridConfig())
    (part,) = [p for p in default.parts if isinstance(p, TrigramDrafter)]
    assert not part.config.aded
    tree = d.propose(arr([0, 1, 2]), 16)
    assert len(tree) and set(tree.source.tolist()) == {SOURCE_TRIGRAM}
