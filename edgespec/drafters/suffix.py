"""The `suffix` drafter: prompt lookup / suffix matching that proposes a tree.

Each step it looks for earlier occurrences of the end of the context (prompt,
earlier chat turns and generation so far) and proposes the tokens that followed
them, merged into a trie.  With compiled corpora loaded (edgespec.corpus.format) it
also looks the end of the context up in each corpus's suffix array and adds
what followed there (the SuffixDecoding / SAM-Decoding idea).  It is
stateless (but for the opt-in `edits`, which keeps the current answer's
alignment to its prompt): the engine passes the whole context every step, and a backward scan
over it plus a few binary searches per corpus are cheap enough (timings in
BENCHMARKS.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.kernels import suffix as _k
from edgespec.kernels import anchor as _a
from edgespec.kernels import edits as _e
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

    position_ema: bool = False
    """ReSpec-style memory per match position in the context: each occurrence
    end ``e`` whose first continuation token was verified gets an exponential
    moving average of "that token was the model's choice" (start 1, decay
    ``ema_decay``); occurrences whose average fell below ``ema_min`` are no
    longer proposed, so an anchor that keeps failing stops costing batch slots.
    Off for `suffix` (the plain prompt-lookup baseline), on inside `auto`."""

    ema_decay: float = 0.5
    ema_min: float = 0.3

    feedback: bool = False
    """ReSpec's feedback-driven candidate selection (section 3.3, Algorithm 1
    lines 15-28): every match position (occurrence end ``e`` in the context)
    has a score S, starting at ``feedback_init``.  Each step every earlier
    occurrence of the retrieval key is retrieved (the key: the last k* tokens,
    k* from the `trigger` when `auto` runs it, else the longest suffix that
    occurred before, as SAM-Decoding's); those scored below ``feedback_min``
    (theta_score) are dropped, the ``feedback_top`` best of the rest drafted,
    and when none is left there is no context retrieval this step (the other
    drafters draft).  After verification every selected position is updated,
    S <- (1 - rate) S + rate R: the winner (the one whose continuation the
    model followed furthest; ties: the higher score, then the more recent)
    with R = L_acc / L_draft (accepted tokens of its continuation over those
    of it that were verified), every other one with R = 0.  Off by default
    (edgespec's own variant is position_ema)."""

    feedback_init: float = 0.5
    """S_0, the paper's "e.g. 0.5"."""
    feedback_rate: float = 0.5
    """The EMA rate alpha; not given by the paper: 0.5 is edgespec's choice."""
    feedback_top: int = 3
    """Top-3, the paper's."""
    feedback_min: float = 0.2
    """theta_score; not given by the paper ("a learned threshold"): 0.2 is
    edgespec's choice, so that with rate 0.5 a new position is dropped after
    two losses in a row."""

    prompt_source: bool = False
    """Mark context-match nodes whose token was copied from the prompt as
    SOURCE_PROMPT (AASD relaxes only prompt-retrieved tokens; `auto+aasd`
    turns this on).  The acceptance model then calibrates them apart."""

    edits: bool = False
    """Keep the answer aligned to the prompt and learn the edits it makes
    (kernels/edits.py): the copy then applies them ahead (a rename proposes
    the new name wherever the prompt has the old one).  The edited chain is
    merged into the tree ahead of the plain continuations, as SOURCE_EDIT.
    Off by default: it gains on renames and loses as much elsewhere
    (BENCHMARKS.md, "Code edits against llama-server")."""

    edit_gap: int = 8
    """Longest old or new span of one edit, in tokens."""

    edit_anchor: int = 3
    """Tokens on which answer and prompt must agree again after an edit."""

    memory: bool = True
    """Also draft from the memory of earlier requests (edgespec/memory/: the
    SpecModel's MemoryStore, when it has one), as SOURCE_MEMORY nodes merged
    after the context's and before the corpora's."""

    memory_min_match: int = 3
    """Shortest match in the memory whose continuation is proposed (at least
    the memory index's window, 3)."""

    edit_trust: float = 0.6
    """An edit is applied ahead only while (made + 1) / (made + left out + 2)
    is at least this: once made and never left out (2/3) it is; an edit
    the answer then leaves out once (a one-off fix, a rewrite that only
    looked like an edit) is not."""

    def __post_init__(self):
        if not (0.0 <= self.ema_decay < 1.0) or not (0.0 <= self.ema_min <= 1.0):
            raise ValueError("SuffixConfig: ema_decay must be in [0, 1) and ema_min in [0, 1]")
        if not (0.0 <= self.edit_trust <= 1.0):
            raise ValueError("SuffixConfig: edit_trust must be in [0, 1]")
        if not (0.0 <= self.feedback_init <= 1.0) or not (0.0 < self.feedback_rate <= 1.0) \
                or not (0.0 <= self.feedback_min <= 1.0):
            raise ValueError("SuffixConfig: feedback_init and feedback_min must be in [0, 1] and feedback_rate "
                             "in (0, 1]")
        for name in ("min_match", "max_match", "max_matches", "max_depth", "max_nodes",
                     "corpus_min_match", "feedback_top", "edit_gap", "edit_anchor", "memory_min_match"):
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


class SuffixDrafter(Drafter):
    """Proposes the continuations of earlier occurrences of the context's suffix.

    ``SuffixDrafter(config=None, corpora=(), memory=None)``: ``corpora`` is a
    sequence of compiled corpora (objects with ``tokens``, ``sa`` and
    ``sa_depth`` as in edgespec.corpus.format.Corpus); none are needed.
    ``memory``: a MemoryStore (edgespec/memory/) of earlier requests, looked
    up after the context and before the corpora (``config.memory`` switches
    it off).

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

    def __init__(self, config: SuffixConfig | None = None, corpora=(), memory=None):
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
        # position_ema: score per context position, and the occurrence ends
        # (with their first continuation token) of the last proposal
        self.observes = c.position_ema or c.feedback
        self._ema = np.ones(0, np.float32)
        self._last: list[tuple[int, int]] = []
        self.feedback = None    # ReSpec's scores per match position (with c.feedback; imported only then)
        if c.feedback:
            from edgespec.drafters.papers.feedback import PositionFeedback
            self.feedback = PositionFeedback(c)
        self._key_len = 0       # feedback's retrieval key: the last _key_len tokens (use_key; 0: none)
        self._n_prompt = 0
        # edits: the alignment state and recorded edits of the current answer,
        # and the chain buffers (parents fixed: a chain)
        self._align = np.zeros(_e.STATE_SIZE, np.int64)
        self._edits = np.zeros((64, _e.EDIT_COLS), np.int64)
        self._chain_tok = np.zeros(c.max_depth, np.int32)
        self._chain_p = np.zeros(c.max_depth, np.float32)
        self._chain_par = np.arange(-1, c.max_depth - 1, dtype=np.int32)
        self._chain_src = np.zeros(c.max_depth, np.int8)

    def use_key(self, k: int) -> None:
        """With ``feedback``: the next proposals retrieve every earlier
        occurrence of the last k tokens (ReSpec's k*, handed over by `auto`
        each step its trigger decides; 0: the longest match's)."""
        self._key_len = int(k)

    @property
    def n_corpora(self) -> int:
        return len(self._corpora)

    def warmup(self) -> None:
        _k.warmup()
        _e.warmup()
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
        if c.edits and 0 < self._n_prompt < n:
            m, cur, tmp = self._edited(ctx, n, max_nodes, m, cur, tmp)
        if m == 0:
            return DraftTree.empty()
        return DraftTree.raw(cur[0][:m].copy(), cur[1][:m].copy(),
                             cur[2][:m].copy(), cur[3][:m].copy())

    def _context_tree(self, ctx, n, max_nodes, cur) -> int:
        """The continuation tree of the context's own matches, built into `cur`
        (after the position EMA and feedback have filtered them); returns its node count."""
        c = self.config
        k = _k.find_suffix_matches(ctx, n, c.min_match, c.max_match, c.max_matches,
                                   self._ends, self._lens)
        if c.position_ema:
            self._last = []
            if k:
                k = self._filter_by_ema(ctx, n, k)
        if self.feedback is not None:
            self.feedback.selected = []
            if k or self._key_len:      # the key: k* from ReSpec's trigger, else the longest match (SAM-Decoding)
                k = self.feedback.select(ctx, n, self._key_len or (int(self._lens[0]) if k else 0),
                                         self._ends, self._lens)
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

    def _edited(self, ctx, n, max_nodes, m, cur, tmp):
        """Merge the aligned, edited copy chain (kernels/edits.py) ahead of the
        tree so far; returns (m, cur, tmp) after the merge."""
        c = self.config
        st = self._align
        if st[0] > n:           # not this answer's context: start over
            st[:] = 0
        _e.align(ctx, n, self._n_prompt, st, self._edits, c.edit_gap, c.edit_anchor)
        ch, applied, first = _e.edited_chain(ctx, n, self._n_prompt, st, self._edits, c.max_depth,
                                             c.edit_trust, self._chain_tok, self._chain_p)
        if not applied:         # nothing the plain matches lack
            return m, cur, tmp
        src = self._chain_src
        src[:first] = SOURCE_CONTEXT
        src[first:ch] = SOURCE_EDIT
        m = _k.merge_trees(self._chain_tok, self._chain_par, self._chain_p, src, ch,
                           cur[0], cur[1], cur[2], cur[3], m, max_nodes, tmp[0], tmp[1], tmp[2], tmp[3])
        return m, tmp, cur

    # ----------------------------------------------------- position_ema only
    # Without it the drafter is stateless (the whole context arrives with every
    # propose()) and `observes` is False, which spares the engine building a
    # StepResult per step.
    def _filter_by_ema(self, ctx: np.ndarray, n: int, k: int) -> int:
        """Drop occurrences whose position score fell below ema_min; remember
        the kept ones for observe()."""
        if len(self._ema) < n:
            grown = np.ones(max(2 * len(self._ema), n, 256), np.float32)
            grown[:len(self._ema)] = self._ema
            self._ema = grown
        ema, lo = self._ema, self.config.ema_min
        j = 0
        last = []
        for i in range(k):
            e = int(self._ends[i])
            if ema[e] < lo:
                continue
            self._ends[j], self._lens[j] = e, self._lens[i]
            j += 1
            last.append((e, int(ctx[e + 1])))
        self._last = last
        return j

    def begin(self, prompt: np.ndarray) -> None:
        self._ema[:] = 1.0
        self._last = []
        if self.feedback is not None:
            self.feedback.begin()
        self._n_prompt = len(prompt)
        self._align[:] = 0

    def observe(self, result) -> None:
        if self.feedback is not None:
            self.feedback.observe(result)
        if not self._last:
            return
        pr = result.proposed
        verified = set(pr.tokens[pr.parents == -1].tolist()) if len(pr) else set()
        got = int(result.accepted[0])
        d = self.config.ema_decay
        for e, tok in self._last:
            if tok in verified:     # the model decided on this occurrence's draft
                self._ema[e] = d * self._ema[e] + (1.0 - d) * (tok == got)
        self._last = []
