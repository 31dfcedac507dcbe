"""The gate's StepPlan (core/plan.py): the named contract between the gate,
the engine and the feedback, checked on a hand-written proposal."""
import numpy as np

from edgespec.core.config import EngineConfig
from edgespec.core.gate import Gate
from edgespec.drafters.tree import DraftTree

# the proposal, parents before children:   root
#                                         /    \
#                                   0 (.9)      1 (.5)
#                                   /   \          \
#                              2 (.8)  4 (.3)      3 (.7)
# with no evidence yet each node's calibrated probability is its score, so
# the path probabilities are .9, .5, .72, .35, .27
TREE = DraftTree(np.array([10, 11, 12, 13, 14]), np.array([-1, -1, 0, 1, 0]),
                 np.array([0.9, 0.5, 0.8, 0.7, 0.3]), np.zeros(5))


def _held(budget: int):
    """The plan of the budget-1 likeliest nodes (a held width: no cost gate)."""
    return Gate(EngineConfig(max_nodes=16), None).choose(TREE, budget, 0, gated=False)


def _check_invariants(plan, tree: DraftTree) -> None:
    k = plan.n_nodes
    assert plan.width == k + 1 and len(plan.nodes) == len(plan.node_parent) == len(plan.batch_nodes) == k
    assert len(plan.slot_pos) == len(plan.slot_parent) == len(plan.depth) == len(plan.leaf_count) == k + 1
    assert list(plan.nodes) == sorted(set(plan.nodes))                     # ascending, distinct
    for j, i in enumerate(plan.nodes):                                      # the selection is a subtree
        pj = plan.node_parent[j]
        assert pj < j and (tree.parents[i] == -1 if pj == -1 else plan.nodes[pj] == tree.parents[i])
    assert plan.slot_pos[0] == -1 and plan.slot_parent[0] == -1 and plan.depth[0] == 0     # the root first
    assert plan.leaf_first[0] == 0 and plan.leaf_count[0] == plan.n_leaves
    assert sorted(plan.slot_pos[1:]) == list(range(k))                      # every chosen node has one slot
    for s in range(1, k + 1):
        ps = plan.slot_parent[s]
        assert 0 <= ps < s and plan.depth[s] == plan.depth[ps] + 1          # parents before children
        node = plan.batch_nodes[s - 1]
        assert node == plan.nodes[plan.slot_pos[s]]
        assert tree.parents[node] == (-1 if ps == 0 else plan.batch_nodes[ps - 1])


def test_plan_lays_the_whole_tree_depth_first_likeliest_child_first():
    plan = _held(16)
    _check_invariants(plan, TREE)
    assert plan.n_nodes == 5 and list(plan.nodes) == [0, 1, 2, 3, 4]
    assert list(plan.batch_nodes) == [0, 2, 4, 1, 3]
    assert list(plan.slot_parent) == [-1, 0, 1, 1, 0, 4]
    assert list(plan.depth) == [0, 1, 2, 2, 1, 2]
    # leaves: slots 2, 3 and 5; the first-child chain 0, 1, 2 is on sequence 0
    assert plan.n_leaves == 3
    assert list(plan.leaf_first) == [0, 0, 0, 1, 2, 2] and list(plan.leaf_count) == [3, 2, 1, 1, 1, 1]


def test_plan_of_a_held_width_keeps_the_likeliest_subtree():
    plan = _held(4)         # 3 nodes: .9, .72, .5
    _check_invariants(plan, TREE)
    assert list(plan.nodes) == [0, 1, 2] and list(plan.node_parent) == [-1, -1, 0]
    assert list(plan.batch_nodes) == [0, 2, 1] and list(plan.slot_parent) == [-1, 0, 1, 0]
    assert plan.n_leaves == 2


def test_plain_plan_is_the_root_alone():
    g = Gate(EngineConfig(max_nodes=16), None)
    for plan in (g.choose(DraftTree.empty(), 16, 0), g.choose(TREE, 1, 0), g.plain()):
        _check_invariants(plan, TREE)
        assert plan.n_nodes == 0 and plan.width == 1 and plan.n_leaves == 1
        assert list(plan.depth) == [0] and list(plan.leaf_count) == [1] and list(plan.slot_parent) == [-1]
        assert not plan.depth.flags.writeable          # shared by every plain step


def test_learn_marks_the_tested_and_accepted_nodes_in_the_plan():
    g = Gate(EngineConfig(max_nodes=16), None)
    plan = g.choose(TREE, 16, 0, gated=False)
    g.learn(TREE, plan, 2, None)        # slots 0..2 committed: nodes 0 and 2 accepted
    assert list(plan.node_accepted) == [True, False, True, False, False]
    # tested: a parent on the accepted path (node 3's parent, node 1, was rejected)
    assert list(plan.node_tested) == [True, True, True, False, True]
    assert g.acceptance.n_c.sum() == 4 and g.acceptance.a_c.sum() == 2
