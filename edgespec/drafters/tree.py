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

MAX_SOURCES = 32
"""Capacity of the source registry: per-source arrays (the gate's acceptance
counts, the schedule's tallies) are sized by it, so a source registered after
they were made still has its row."""


@dataclass(frozen=True)
class Source:
    """A kind of draft node.  The engine's acceptance model calibrates each
    source apart; the flags say which mechanisms treat its nodes specially.

    retrieved: text copied from what the model read or a corpus (ReSpec's
        relaxed verification may accept such a token)
    aligned:   a token AASD's conditional verification may accept (copied
        from the prompt, or the model's own choice at a misaligned position)
    guess:     a model-free guess (tri-gram, adjacency, branch, semantic):
        a leaf retrieval never looked from, which graft_tail continues
    """
    id: int
    name: str
    retrieved: bool = False
    aligned: bool = False
    guess: bool = False


SOURCES: list[Source] = []
"""Every registered source, indexed by its id (the value stored in DraftTree.source)."""


def register_source(name: str, *, retrieved: bool = False, aligned: bool = False, guess: bool = False) -> int:
    """Register a draft source and return its id.  The module that makes a
    source's nodes registers it, once (a second registration of a name is an
    error: two modules would share one calibration)."""
    if any(s.name == name for s in SOURCES):
        raise ValueError(f"draft source {name!r} is already registered")
    if len(SOURCES) >= MAX_SOURCES:
        raise ValueError(f"at most {MAX_SOURCES} draft sources")
    SOURCES.append(Source(len(SOURCES), name, retrieved, aligned, guess))
    return len(SOURCES) - 1


def sources_with(flag: str) -> tuple[int, ...]:
    """The ids of the registered sources whose `flag` is set (read at each
    call: a source registered later is included)."""
    return tuple(s.id for s in SOURCES if getattr(s, flag))


def source_name(i: int) -> str:
    return SOURCES[i].name if 0 <= i < len(SOURCES) else f"source{i}"


# every built-in source, registered here in one fixed order whatever module is
# imported first (their ids are stored in results files and compared in tests:
# append, never reorder)
SOURCE_CONTEXT = register_source("context", retrieved=True)     # a match in the prompt / generation so far
SOURCE_CORPUS = register_source("corpus", retrieved=True)       # a match in a compiled corpus
SOURCE_TRIGRAM = register_source("trigram", guess=True)
SOURCE_ADJACENCY = register_source("adjacency", guess=True)
SOURCE_CARRY = register_source("carry")         # accepted last step off the batch's first path, re-verified
SOURCE_BRANCH = register_source("branch", guess=True)     # the model's own alternatives beside a retrieved copy
SOURCE_SEMANTIC = register_source("semantic", guess=True)  # continuation of an embedding-similar anchor
SOURCE_PROMPT = register_source("prompt", retrieved=True, aligned=True)   # a context match copied from the prompt
SOURCE_ALIGN = register_source("align", aligned=True, guess=True)   # AASD: the model's choice where the prompt disagreed
SOURCE_GRAMMAR = register_source("grammar")     # text a request's grammar forces next (the engine adds it)
SOURCE_EDIT = register_source("edit", retrieved=True)   # a prompt copy with the answer's edits applied ahead
SOURCE_VALUE = register_source("value", retrieved=True)   # prompt text the answer copies, found by characters (grammar)
SOURCE_LABEL = register_source("label", retrieved=True)   # prompt text after a label naming the key the grammar opens
SOURCE_MEMORY = register_source("memory", retrieved=True)   # copied from the memory of earlier requests
SOURCE_FILLER = register_source("filler")   # pads a held batch width (EngineConfig.hold_width)
N_SOURCES = MAX_SOURCES

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


def merge_chain(tree: DraftTree, chain: np.ndarray, prob: float, source: int = SOURCE_CARRY,
                 start: int = 0) -> DraftTree:
    """Insert a chain below the root into a proposal, sharing existing nodes
    (which then count as `source`, with at least `prob`, from the chain's
    `start`-th token on: the nodes before it are left as they are)."""
    toks, pars = list(tree.tokens), list(tree.parents)
    probs, src = list(tree.probs), list(tree.source)
    cur = -1
    for j, t in enumerate(chain.tolist()):
        nxt = -1
        for i in range(len(toks)):
            if pars[i] == cur and toks[i] == t:
                nxt = i
                break
        if nxt >= 0:
            if j >= start:
                probs[nxt] = max(probs[nxt], prob)
                src[nxt] = source
        else:
            toks.append(t); pars.append(cur); probs.append(prob); src.append(source)
            nxt = len(toks) - 1
        cur = nxt
    return DraftTree(np.array(toks, np.int32), np.array(pars, np.int32),
                     np.array(probs, np.float32), np.array(src, np.int8))


FILLER_PROB = 0.05     # the drafter score of padding: the gate's acceptance statistics start from it


def pad_tree(tree: DraftTree, ctx: np.ndarray, need: int) -> DraftTree:
    """A proposal of at least `need` nodes (where it can be made so): the
    tokens that followed the last token of ctx where it occurred before, then
    that token repeated, merged in as a chain of filler."""
    if len(tree) >= need or len(ctx) == 0:
        return tree
    last = int(ctx[-1])
    hits = np.flatnonzero(ctx[:-1] == last)
    follow = ctx[hits[-1] + 1:hits[-1] + 1 + need] if len(hits) else ctx[:0]
    chain = np.concatenate([follow, np.full(need - len(follow), last, ctx.dtype)])
    tree = merge_chain(tree, chain.astype(np.int32), FILLER_PROB, SOURCE_FILLER, start=need)   # shared nodes keep theirs
    if len(tree) < need:        # the chain ran along existing nodes: a second one beside it
        tree = merge_chain(tree, np.full(need - len(tree), last ^ 1, np.int32), FILLER_PROB, SOURCE_FILLER, start=need)
    return tree
