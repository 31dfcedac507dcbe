"""The `suffix` drafter: prompt lookup / suffix matching that proposes a tree.

Each step it looks for earlier occurrences of the end of the context (prompt,
earlier chat turns and generation so far) and proposes the tokens that followed
them, merged into a trie.  With compiled corpora loaded (edgespec.corpus.format) it
also looks the end of the context up in each corpus's suffix array and adds
what followed there (the SuffixDecoding / SAM-Decoding idea).  It is
stateless: the engine passes the whole context every step, and a backward
scan over it plus a few binary searches per corpus are cheap enough (timings
in BENCHMARKS.md).

Mechanisms off the product path plug in (SuffixPlugIn; drafters/registry.py
names them, each with its own settings, switched by the same drafter specs):
the position EMA (`position_ema`, on inside `auto`:
drafters/mechanisms/position_ema.py), ReSpec's feedback (`feedback`:
drafters/papers/feedback.py) and the learned edits (`edits`:
drafters/mechanisms/edits.py); they hold whatever state they keep.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.kernels import suffix as _k
from edgespec.kernels import anchor as _a
from edgespec.drafters.tree import SOURCE_CONTEXT, SOURCE_CORPUS, SOURCE_EDIT, SOURCE_MEMORY, SOURCE_PROMPT, DraftTree
from edgespec.drafters.base import Drafter


@dataclass
class SuffixConfig:
    """Settings of the suffix drafter."""

    min_match: int = 2
    """Shortest suffix match (in tokens) whose continuation is proposed.  1 would
    propose after any repeated single token, which is mostly noise."""

    max_match: int = 32
    """Matches are not extended beyond this many tokens; longer matches rank
    equal, the more recent first."""

    max_matches: int = 8
    """How many earlier occurrences (best first) feed the tree."""

    max_depth: int = 32
    """Continuation length taken after each occurrence = maximum tree depth."""

    max_nodes: int = 64
    """Upper bound on the nodes of one proposal (the engine's budget may be
    lower)."""

    corpus_min_match: int = 3
    """Shortest match in a corpus whose continuation is proposed.  Longer than
    min_match: a corpus of millions of tokens holds most 2-token suffixes by
    chance.  Corpus matches use max_match (capped by the corpus's sa_depth),
    max_matches and max_depth like context matches."""

    prompt_source: bool = False
    """Mark context-match nodes whose token was copied from the prompt as
    SOURCE_PROMPT (AASD relaxes only prompt-retrieved tokens; `auto+aasd`
    turns this on).  The acceptance model then calibrates them apart."""

    memory: bool = True
    """Also draft from the memory of earlier requests (edgespec/memory/: the
    SpecModel's MemoryStore, when it has one), as SOURCE_MEMORY nodes merged
    after the context's and before the corpora's."""

    memory_min_match: int = 3
    """Shortest match in the memory whose continuation is proposed (at least
    the memory index's window, 3)."""

    def __post_init__(self):
        for name in ("min_match", "max_match", "max_matches", "max_depth", "max_nodes",
                     "corpus_min_match", "memory_min_match"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"SuffixConfig.{name} must be an integer, got {v!r}")
            if v < 1:
                raise ValueError(f"SuffixConfig.{name} must be >= 1, got {v}")
            setattr(self, name, int(v))
        if self.min_match > self.max_match:
            raise ValueError(
                f"SuffixConfig.min_match ({self.min_match}) must not exceed "
                f"max_match ({self.max_match})")
        if self.corpus_min_match > self.max_match:
            raise ValueError(
                f"SuffixConfig.corpus_min_match ({self.corpus_min_match}) must not "
                f"exceed max_match ({self.max_match})")


class SuffixPlugIn:
    """A mechanism plugged into the suffix drafter (no-ops here), called in
    the order the drafter was given them (the registry's order).

    name:     its switch in a drafter spec (drafters/registry.py)
    observes: whether the drafter must be handed every step (observe)
    attach(config)  the SuffixConfig of the drafter it is plugged into
    select(ctx, n, k, ends, lens, key) -> k: the context's k matches (ends,
              lens: rewritten in place), filtered or chosen anew; key: the
              retrieval key `auto`'s trigger handed over (0: none)
    extend(ctx, n, max_nodes, m, cur, tmp) -> (m, cur, tmp): a tree merged
              into the m-node proposal in `cur` after the corpora's
    begin, observe, warmup: as a Drafter's."""

    name = ""
    observes = False

    def attach(self, suffix_config) -> None:
        pass

    def warmup(self) -> None:
        pass

    def begin(self, prompt) -> None:
        pass

    def select(self, ctx, n: int, k: int, ends, lens, key: int) -> int:
        return k

    def extend(self, ctx, n: int, max_nodes: int, m: int, cur, tmp):
        return m, cur, tmp

    def observe(self, result) -> None:
        pass


class SuffixDrafter(Drafter):
    """Proposes the continuations of earlier occurrences of the context's suffix.

    ``SuffixDrafter(config=None, corpora=(), memory=None, plugins=())``: ``corpora`` is a
    sequence of compiled corpora (objects with ``tokens``, ``sa`` and
    ``sa_depth`` as in edgespec.corpus.format.Corpus); none are needed.
    ``memory``: a MemoryStore (edgespec/memory/) of earlier requests, looked
    up after the context and before the corpora (``config.memory`` switches
    it off).  ``plugins``: SuffixPlugIn mechanisms (see the module doc).

    Each step:

    1. the context tree: occurrences of the context's suffix in the context
       itself (at least min_match tokens), merged into a trie;
    2. for each corpus in order: the longest suffix of the context that occurs
       in it (at least corpus_min_match tokens) and up to max_matches of its
       occurrences (filled up with slightly shorter matches), merged into a
       trie and then into the proposal so far (``merge_trees``).

    The context is preferred: it is the request's own text, while a corpus
    only knows how such text usually goes on.  If the context has no match the
    corpus trees make the whole proposal; otherwise a corpus adds branches
    beside the context's, sharing the probability mass the context's children
    leave over (a node both propose keeps the context source and the larger
    probability); a later corpus likewise shares what the context and the
    earlier corpora leave.  The corpora are queried even when the context
    matched: a budget often leaves room, and a corpus continuation can outrank
    the deep, low-probability end of a context branch.

    Node probabilities are the tree kernel's heuristic: the share of the
    occurrences' weight (``L * L`` per occurrence of match length ``L``) that
    passes through the node, times ``L_eff / (L_eff + 2)`` with ``L_eff`` the
    match length grown by the node's depth; so they rise with the match
    length and with the number of occurrences that agree (a corpus's
    occurrences are sampled evenly over its suffix-array interval, so common
    continuations get proportionally many).  Corpus nodes carry
    SOURCE_CORPUS, so the engine calibrates them apart from context nodes.
    Nodes come ordered by decreasing cumulative probability, parents before
    children, so any prefix of the proposal is itself a valid tree of the most
    probable nodes.
    """

    name = "suffix"
    sources = (SOURCE_CONTEXT, SOURCE_CORPUS, SOURCE_PROMPT, SOURCE_EDIT, SOURCE_MEMORY)
    retrieves = True

    def __init__(self, config: SuffixConfig | None = None, corpora=(), memory=None, plugins=()):
        self.config = config if config is not None else SuffixConfig()
        c = self.config
        self.memory = memory if c.memory else None
        # (tokens, sa, sa_depth) per corpus, as plain contiguous int32 arrays
        # (np.asarray turns a memmap into an ndarray view without copying).
        self._corpora = [
            (np.ascontiguousarray(np.asarray(cp.tokens), dtype=np.int32),
             np.ascontiguousarray(np.asarray(cp.sa), dtype=np.int32),
             int(cp.sa_depth))
            for cp in corpora]
        self._ends = np.zeros(c.max_matches, np.int32)
        self._lens = np.zeros(c.max_matches, np.int32)
        self._mlen = np.zeros(c.max_nodes, np.int32)
        # Three tree buffers (tokens, parents, probs, source): the proposal so
        # far, a corpus tree, and the merge target (swapped with the first).
        self._bufs = [(np.zeros(c.max_nodes, np.int32), np.zeros(c.max_nodes, np.int32),
                       np.zeros(c.max_nodes, np.float32), np.zeros(c.max_nodes, np.int8))
                      for _ in range(3)]
        # Source of a fresh corpus tree (constant): preallocated.
        self._src_corpus = np.full(c.max_nodes, SOURCE_CORPUS, np.int8)
        self.plugins = {p.name: p for p in plugins}     # by name, in the order given
        for p in self.plugins.values():
            p.attach(c)
        self.observes = any(p.observes for p in self.plugins.values())
        self._key_len = 0       # feedback's retrieval key: the last _key_len tokens (use_key; 0: none)
        self._n_prompt = 0

    def use_key(self, k: int) -> None:
        """For ``feedback``: the next proposals retrieve every earlier
        occurrence of the last k tokens (ReSpec's k*, handed over by `auto`
        each step its trigger decides; 0: the longest match's)."""
        self._key_len = int(k)

    @property
    def n_corpora(self) -> int:
        return len(self._corpora)

    def warmup(self) -> None:
        _k.warmup()
        for p in self.plugins.values():
            p.warmup()
        if self.memory is not None:
            self.memory.warmup()

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        # Cost: microseconds a step, mostly the backward scan over the context,
        # plus a suffix-array lookup per corpus whose binary searches miss the
        # caches a model decode between steps has flushed (BENCHMARKS.md).
        c = self.config
        max_nodes = min(int(budget), c.max_nodes)
        if max_nodes <= 0:
            return DraftTree.empty()
        ctx = np.ascontiguousarray(context, dtype=np.int32)
        n = ctx.shape[0]
        cur, spare, tmp = self._bufs
        m = self._context_tree(ctx, n, max_nodes, cur)
        if self.memory is not None:
            mc = self.memory.propose(ctx, n, c.memory_min_match, c.max_match, c.max_matches, c.max_depth,
                                     max_nodes, spare, self._ends, self._lens, self._mlen, SOURCE_MEMORY)
            m, cur, spare, tmp = self._merge_in(m, mc, spare[3], max_nodes, cur, spare, tmp)
        m, cur, tmp = self._add_corpora(ctx, n, max_nodes, m, cur, spare, tmp)
        for p in self.plugins.values():
            m, cur, tmp = p.extend(ctx, n, max_nodes, m, cur, tmp)
        if m == 0:
            return DraftTree.empty()
        return DraftTree.raw(cur[0][:m].copy(), cur[1][:m].copy(),
                             cur[2][:m].copy(), cur[3][:m].copy())

    def _context_tree(self, ctx, n, max_nodes, cur) -> int:
        """The continuation tree of the context's own matches, built into `cur`
        (after the plug-ins have selected them); returns its node count."""
        c = self.config
        k = _k.find_suffix_matches(ctx, n, c.min_match, c.max_match, c.max_matches,
                                   self._ends, self._lens)
        for p in self.plugins.values():
            k = p.select(ctx, n, k, self._ends, self._lens, self._key_len)
        if not k:
            return 0
        m = _k.build_continuation_tree(ctx, n, self._ends, self._lens, k, c.max_depth,
                                       max_nodes, cur[0], cur[1], cur[2], self._mlen)
        cur[3][:m] = SOURCE_CONTEXT
        if c.prompt_source and self._n_prompt:
            _a.mark_copied_from(ctx, n, self._n_prompt, self._ends, k, c.max_depth, cur[0], cur[1], m,
                                cur[3], SOURCE_CONTEXT, SOURCE_PROMPT)
        return m

    def _add_corpora(self, ctx, n, max_nodes, m, cur, spare, tmp):
        """Each corpus's continuation tree merged into the m-node tree in `cur`
        (the buffers swap as they fill); returns (m, cur, tmp) after the merges."""
        c = self.config
        for tokens, sa, depth in self._corpora:
            k = _k.sa_find_matches(tokens, sa, depth, ctx, n, c.corpus_min_match,
                                   c.max_match, c.max_matches, self._ends, self._lens)
            if k == 0:
                continue
            mc = _k.build_continuation_tree(tokens, tokens.shape[0], self._ends, self._lens,
                                            k, c.max_depth, max_nodes, spare[0], spare[1],
                                            spare[2], self._mlen)
            if mc:
                spare[3][:mc] = SOURCE_CORPUS
            m, cur, spare, tmp = self._merge_in(m, mc, self._src_corpus, max_nodes, cur, spare, tmp)
        return m, cur, tmp

    @staticmethod
    def _merge_in(m, mc, src, max_nodes, cur, spare, tmp):
        """Merge the mc-node tree in `spare` (its sources `src`) into the
        m-node tree in `cur`; returns (m, cur, spare, tmp) after the buffers swap."""
        if mc == 0:
            return m, cur, spare, tmp
        if m == 0:
            return mc, spare, cur, tmp
        m = _k.merge_trees(cur[0], cur[1], cur[2], cur[3], m,
                           spare[0], spare[1], spare[2], src, mc,
                           max_nodes, tmp[0], tmp[1], tmp[2], tmp[3])
        return m, tmp, spare, cur

    def begin(self, prompt: np.ndarray) -> None:
        self._n_prompt = len(prompt)
        for p in self.plugins.values():
            p.begin(prompt)

    def observe(self, result) -> None:
        # only with a plug-in that observes: the plain drafter is stateless and
        # `observes` False spares the engine building a StepResult per step
        for p in self.plugins.values():
            p.observe(result)
