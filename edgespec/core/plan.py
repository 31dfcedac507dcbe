"""StepPlan: the verification batch the gate chose for one decode step, by
name.  The engine lays and verifies the batch from it, the gate learns from
it and the feedback tells the drafter what it held; none of them reads the
gate's scratch arrays or plan_step's tuple (kernels/tree.py).
"""
from __future__ import annotations

import numpy as np


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


class StepPlan:
    """One step's batch: the chosen draft nodes of the proposal (a DraftTree)
    and their layout, the root (the pending token) in slot 0, then the nodes
    depth first, likeliest child first (kernels/tree.layout_preorder).

    The arrays are views of the gate's scratch, no copies: a plan holds until
    the gate's next choose(); copy what must outlive the step.  k = n_nodes.

      n_nodes       the draft nodes verified, k (0: a plain one-token step)
      width         the batch's slots, k + 1
      n_leaves      the KV sequences the batch uses (its leaves; >= 1)
    Per chosen node j < k (the selection, in the proposal's order):
      nodes         its index in the proposal, ascending
      node_parent   its parent as a position in `nodes`, -1 the root; < j
      node_accepted on the step's accepted path (the committed chain or the
                    node carried past a batch hole)
      node_tested   its parent was on that path; both written by Gate.learn
                    after the verification, meaningless before
    Per batch slot s < k + 1:
      slot_pos      the position in `nodes` of slot s's node; -1 for the root
      slot_parent   the slot of its parent: -1 for the root, else < s
      depth         its depth, the root's 0, a child's its parent's + 1
      leaf_first, leaf_count: slot s lies on the KV sequences leaf_first ..
                    leaf_first + leaf_count - 1 (leaves numbered in preorder,
                    so slots 0..d of the first-child chain have leaf_first 0)
    Per draft slot s = 1..k:
      batch_nodes   batch_nodes[s - 1] = nodes[slot_pos[s]], slot s's node's
                    index in the proposal: the nodes in batch order
    """
    __slots__ = ("n_nodes", "width", "n_leaves", "nodes", "node_parent", "node_accepted", "node_tested",
                 "slot_pos", "slot_parent", "depth", "leaf_first", "leaf_count", "batch_nodes")

    def __init__(self, n_nodes: int, n_leaves: int, nodes: np.ndarray, node_parent: np.ndarray,
                 node_accepted: np.ndarray, node_tested: np.ndarray, slot_pos: np.ndarray, slot_parent: np.ndarray,
                 depth: np.ndarray, leaf_first: np.ndarray, leaf_count: np.ndarray, batch_nodes: np.ndarray):
        self.n_nodes = n_nodes
        self.width = n_nodes + 1
        self.n_leaves = n_leaves
        self.nodes = nodes
        self.node_parent = node_parent
        self.node_accepted = node_accepted
        self.node_tested = node_tested
        self.slot_pos = slot_pos
        self.slot_parent = slot_parent
        self.depth = depth
        self.leaf_first = leaf_first
        self.leaf_count = leaf_count
        self.batch_nodes = batch_nodes

    @staticmethod
    def plain() -> StepPlan:
        """A plain one-token step's plan: the root alone, on sequence 0 (its
        arrays read-only, so one plan serves every plain step)."""
        def a(v: list, dtype) -> np.ndarray:
            return _readonly(np.array(v, dtype))
        return StepPlan(0, 1, a([], np.int64), a([], np.int32), a([], np.bool_), a([], np.bool_), a([-1], np.int64),
                        a([-1], np.int64), a([0], np.int32), a([0], np.int32), a([1], np.int32), a([], np.int64))
