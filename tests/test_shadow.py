"""The acceptance model's evidence from proposals the gate did not verify
(kernels.tree.shadow_learn), on hand-made trees and committed tokens."""
import numpy as np

from edgespec.kernels.tree import N_SCORE_BUCKETS, score_bucket, shadow_learn

NSRC, NSB, NDB = 9, N_SCORE_BUCKETS, 4

# root -> 5 -> 6 -> 7 (source 0, scores 0.92, 0.85, 0.75)
#      -> 8 (source 3, score 0.3)
#      5 -> 9 (source 0, score 0.15)
TOKENS = np.array([5, 6, 7, 8, 9], np.int32)
PARENTS = np.array([-1, 0, 1, -1, 0], np.int32)
PROBS = np.array([0.92, 0.85, 0.75, 0.3, 0.15], np.float32)
SOURCE = np.array([0, 0, 0, 3, 0], np.int8)
COND = np.array([0.7, 0.6, 0.5, 0.2, 0.1])


def counts():
    return (np.zeros((NSRC, NSB)), np.zeros((NSRC, NSB)), np.zeros((NSRC, NSB, NDB)), np.zeros((NSRC, NSB, NDB)),
            np.zeros((NSRC, NSB)))


def run(cont, verified=None, state=None, c=None):
    c = c or counts()
    verified = np.zeros(5, np.bool_) if verified is None else verified
    state = np.zeros(5, np.int8) if state is None else state
    pending = shadow_learn(TOKENS, PARENTS, PROBS, SOURCE, COND, verified, state, np.asarray(cont, np.int32), *c)
    return pending, state, c


def test_every_decidable_node_is_counted_against_the_committed_tokens():
    pending, state, (n_c, a_c, n_f, a_f, pred) = run([5, 6, 4])
    # 5 and 6 match, 7 does not (4 was committed at depth 3), 8 misses at depth 1,
    # 9 is tested (its parent 5 matched) and misses at depth 2
    assert pending == 0
    assert state.tolist() == [1, 1, 2, 2, 2]
    assert n_c[0].sum() == 4 and a_c[0].sum() == 2
    assert n_c[3, 3] == 1 and a_c[3, 3] == 0
    b = [score_bucket(p) for p in PROBS]               # score buckets, as learn_step takes them
    assert b == [9, 8, 7, 3, 1]
    assert n_c[0, 9] == a_c[0, 9] == n_c[0, 8] == a_c[0, 8] == n_c[0, 7] == 1 and a_c[0, 7] == 0
    assert n_c[0, b[4]] == 1 and a_c[0, b[4]] == 0
    assert n_f[0, 7, 2] == 1 and a_f[0, 7, 2] == 0    # node 7 at depth 3
    assert n_f[0, 9, 0] == 1 and a_f[0, 9, 0] == 1    # node 5 at depth 1
    assert np.isclose(pred.sum(), COND.sum())


def test_nodes_below_a_miss_are_not_tested():
    pending, state, (n_c, a_c, *_ ) = run([8])
    # depth 1: 5 misses, 8 hits; 6, 7 and 9 sit below a miss: never tested
    assert pending == 0
    assert state.tolist() == [2, 2, 2, 1, 2]
    assert n_c.sum() == 2 and a_c.sum() == 1


def test_deeper_nodes_wait_for_more_committed_tokens():
    c = counts()
    pending, state, c = run([5], c=c)
    assert pending == 3 and state.tolist() == [1, 0, 0, 2, 0]    # 6 and 9 wait at depth 2, 7 waits on 6
    assert c[0].sum() == 2
    pending, state, c = run([5, 6], state=state, c=c)
    assert pending == 1 and state.tolist() == [1, 1, 0, 2, 2]
    pending, state, c = run([5, 6, 7], state=state, c=c)
    assert pending == 0 and state.tolist() == [1, 1, 1, 2, 2]
    assert c[0].sum() == 5 and c[1].sum() == 3        # each node counted once, over three calls


def test_verified_nodes_are_followed_but_not_counted_again():
    verified = np.array([True, True, False, False, False])
    pending, state, (n_c, a_c, *_ ) = run([5, 6, 7], verified=verified)
    assert state.tolist() == [1, 1, 1, 2, 2]
    # only 7, 8 and 9 are new evidence: 5 and 6 were counted by learn_step
    assert n_c.sum() == 3 and a_c.sum() == 1


def test_history_cap_bounds_the_fine_cells_and_keeps_the_coarse():
    from edgespec.core.gate import AcceptanceModel

    acc = AcceptanceModel()
    acc.n_c[1, 3], acc.a_c[1, 3] = 40.0, 30.0
    acc.n_f[1, 3, 0], acc.a_f[1, 3, 0] = 10.0, 5.0
    acc.n_f[1, 3, 1], acc.a_f[1, 3, 1] = 3.0, 1.0           # under the cap: left alone
    acc.shrink(4.0)
    assert (acc.n_c[1, 3], acc.a_c[1, 3]) == (40.0, 30.0)
    assert (acc.n_f[1, 3, 0], acc.a_f[1, 3, 0]) == (4.0, 2.0)
    assert (acc.n_f[1, 3, 1], acc.a_f[1, 3, 1]) == (3.0, 1.0)
    assert acc.n_f.sum() == 7.0 and not np.isnan(acc.n_f).any()
