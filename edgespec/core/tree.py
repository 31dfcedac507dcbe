"""Draft trees as flat arrays.

A drafter proposes the tokens that may follow the *root*: the last token of the
context, which the model has not decoded yet (it is the bonus token of the
previous step, or the last prompt token).  The proposal holds only the draft
nodes, never the root:

    tokens[i]   token id of draft node i
    parents[i]  index of node i's parent in these arrays, or -1 when the parent
                is the root; always parents[i] < i (parents come first)
    probs[i]    the drafter's own estimate of P(node i accepted | parent accepted),
                in [0, 1]; siblings should sum to at most 1
    source[i]   which drafter made node i (SOURCE_* below); the calibrator keeps
                separate acceptance statistics per source

Siblings must carry distinct tokens (two children of one node with the same token
would be the same draft twice).  The engine, not the drafter, decides how much of
a proposal to verify (the cost gate) and in which order the nodes go into the
llama.cpp batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SOURCE_CONTEXT = 0   # suffix match in the prompt / generation so far
SOURCE_CORPUS = 1    # suffix match in a compiled corpus
SOURCE_TRIGRAM = 2
SOURCE_ADJACENCY = 3
SOURCE_CARRY = 4     # tokens accepted last step off the batch's first path, re-verified
SOURCE_BRANCH = 5    # the model's own alternatives beside a retrieved continuation (AASD, AdaPLD)
SOURCE_SEMANTIC = 6  # continuation of an embedding-similar anchor (AdaPLD fallback)
SOURCE_PROMPT = 7    # a context match copied from the prompt (marked so only with auto+aasd)
SOURCE_ALIGN = 8     # AASD alignment sampling: the model's choice where the prompt disagreed
SOURCE_GRAMMAR = 9   # text a request's grammar forces next (the engine adds it; no drafter does)
SOURCE_EDIT = 10     # a prompt copy with the answer's own edits applied, from the first edited token on
N_SOURCES = 11
SOURCE_NAMES = ("context", "corpus", "trigram", "adjacency", "carry", "branch", "semantic", "prompt", "align",
                "grammar", "edit")


@dataclass
class DraftTree:
    tokens: np.ndarray   # int32 [M]
    parents: np.ndarray  # int32 [M]
    probs: np.ndarray    # float32 [M]
    source: np.ndarray   # int8 [M]

    def __post_init__(self):
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32)
        self.parents = np.ascontiguousarray(self.parents, dtype=np.int32)
        self.probs = np.ascontiguousarray(self.probs, dtype=np.float32)
        self.source = np.ascontiguousarray(self.source, dtype=np.int8)
        m = len(self.tokens)
        if not (len(self.parents) == len(self.probs) == len(self.source) == m):
            raise ValueError("DraftTree arrays must have equal lengths")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def raw(cls, tokens, parents, probs, source) -> "DraftTree":
        """Wrap arrays that already have the right dtypes and lengths, without
        the conversions and checks of the constructor (the engine's hot path)."""
        t = object.__new__(cls)
        t.tokens, t.parents, t.probs, t.source = tokens, parents, probs, source
        return t

    @staticmethod
    def empty() -> "DraftTree":
        """The empty proposal (one shared instance: treat it as read-only)."""
        return _EMPTY

    def validate(self, n_vocab: int | None = None) -> None:
        """Raise ValueError if the arrays break the invariants in the module doc."""
        m = len(self.tokens)
        idx = np.arange(m)
        if m and (np.any(self.parents >= idx) or np.any(self.parents < -1)):
            raise ValueError("every parent index must be -1 or smaller than its child's")
        if n_vocab is not None and m and (self.tokens.min() < 0 or self.tokens.max() >= n_vocab):
            raise ValueError("draft token id out of the vocabulary")
        seen = set()
        for p, t in zip(self.parents.tolist(), self.tokens.tolist()):
            if (p, t) in seen:
                raise ValueError(f"two siblings under parent {p} carry token {t}")
            seen.add((p, t))


_EMPTY = DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int8))
