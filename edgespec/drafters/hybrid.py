"""The `auto` drafter: every cheap drafter's proposal merged into one tree.

Retrieval first: the suffix drafter's tree (matches in the prompt, the
generation so far and the corpora) has priority; the tri-gram MCTS tree and the
adjacency (Token Recycling) tree are merged into it as a trie, their branches
sharing the probability mass the retrieved branches leave over at each node
(kernels/suffix.py `merge_trees`).  Every node keeps its source, so the engine's
acceptance model calibrates each source separately and its cost gate keeps,
node by node, only what is expected to pay under the measured c(T): a weak
tri-gram guess at depth 3 is cut while a long retrieved continuation stays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.suffix import merge_trees
from ..tree import DraftTree
from .adjacency import AdjacencyDrafter
from .base import Drafter
from .suffix import SuffixDrafter
from .trigram import TrigramDrafter


@dataclass
class HybridConfig:
    """Which components run, and the largest merged proposal."""
    suffix: bool = True
    trigram: bool = True
    adjacency: bool = True
    max_nodes: int = 64

    def __post_init__(self):
        if not (self.suffix or self.trigram or self.adjacency):
            raise ValueError("HybridConfig: enable at least one component")
        if isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, (int, np.integer)) \
                or self.max_nodes < 1:
            raise ValueError(f"HybridConfig.max_nodes must be an integer >= 1, got {self.max_nodes!r}")
        self.max_nodes = int(self.max_nodes)


class HybridDrafter(Drafter):
    """suffix + trigram + adjacency, merged in that priority order."""

    name = "auto"

    def __init__(self, n_vocab: int, corpora=(), config: HybridConfig | None = None):
        self.config = c = config if config is not None else HybridConfig()
        self.parts: list[Drafter] = []
        if c.suffix:
            self.parts.append(SuffixDrafter(corpora=corpora))
        if c.trigram:
            self.parts.append(TrigramDrafter(n_vocab, corpora=corpora))
        self.topk = 0
        if c.adjacency:
            adj = AdjacencyDrafter(n_vocab, corpora=corpora)
            self.parts.append(adj)
            self.topk = adj.topk
        n = c.max_nodes
        self._buf = [(np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int8))
                     for _ in range(2)]

    def warmup(self) -> None:
        for p in self.parts:
            p.warmup()
        t = DraftTree(np.array([5, 6], np.int32), np.array([-1, 0], np.int32),
                      np.array([0.5, 0.5], np.float32), np.array([0, 0], np.int8))
        a, b = self._buf
        merge_trees(t.tokens, t.parents, t.probs, t.source, 2, t.tokens, t.parents, t.probs, t.source, 2,
                    4, a[0], a[1], a[2], a[3])

    def begin(self, prompt: np.ndarray) -> None:
        for p in self.parts:
            p.begin(prompt)

    def observe(self, result) -> None:
        for p in self.parts:
            p.observe(result)

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        budget = min(int(budget), self.config.max_nodes)
        if budget <= 0:
            return DraftTree.empty()
        cur = None      # (tokens, parents, probs, source, m) of the merge so far
        k = 0
        for p in self.parts:
            t = p.propose(context, budget)
            if len(t) == 0:
                continue
            if cur is None:
                cur = (t.tokens, t.parents, t.probs, t.source, len(t))
                continue
            out = self._buf[k]
            k ^= 1
            m = merge_trees(cur[0], cur[1], cur[2], cur[3], cur[4],
                            t.tokens, t.parents, t.probs, t.source, len(t), budget,
                            out[0], out[1], out[2], out[3])
            cur = (out[0], out[1], out[2], out[3], m)
        if cur is None or cur[4] == 0:
            return DraftTree.empty()
        m = cur[4]
        return DraftTree(cur[0][:m].copy(), cur[1][:m].copy(), cur[2][:m].copy(), cur[3][:m].copy())
