"""The `auto` drafter: every cheap drafter's proposal merged into one tree.

Retrieval first: the suffix drafter's tree (matches in the prompt, the
generation so far and the corpora) has priority; the tri-gram MCTS tree and the
adjacency (Token Recycling) tree are merged into it as a trie, their branches
sharing the probability mass the retrieved branches leave over at each node
(kernels/suffix.py `merge_trees`).  Every node keeps its source, so the engine's
acceptance model calibrates each source separately and its cost gate keeps,
node by node, only what is expected to pay under the measured c(T): a weak
tri-gram guess at depth 3 is cut while a long retrieved continuation stays.

This module is the merge loop over the parts.  Each part has a declared role
(drafters/mechanisms/: RETRIEVAL the suffix part, GUESS the others, TEMPLATE
the adjacency part Graft keeps aside), and the merge and its mechanisms test
the role, never which object a part is.  Each mechanism around the merge
lives in drafters/mechanisms/ (one module each, holding its own state).  Each
paper's mechanism is a switch (a bool field of HybridConfig, `auto-noX` /
`auto+X` by name; numeric settings by `auto+X=V`).  Where edgespec's own
variant differs from the published one, both exist under two names, the
published one under the paper's word and off by default until measured (see
README "Drafters and corpora" for the table):

* AdaPLD (drafters/papers/adapld.py: one anchor j* among the earlier positions of
  the last token, a copy, branches and successors from it): ``branch`` (the
  model's top ``branch_k`` after j* minus the copied token, each with one
  successor) vs ``branch_depth``; ``semantic`` (when the last token never
  occurred: tokens at embedding cosine ``semantic_tau``, branches and
  successors, no copy) vs ``semantic_pair``; ``rerank`` (j* by the hidden
  states at layer ``rerank_layer``, papers/rerank.py); ``copy_len``
  (AdaPLD: 30, edgespec: 32).
* ReSpec: ``trigger`` (papers/trigger.py: retrieve iff H_{k*} <= theta,
  k* the retrieval key) vs ``entropy`` (mechanisms/entropy.py); ``feedback``
  (every occurrence of the key scored from 0.5, those under theta_score
  dropped, the best 3 drafted; the winner rewarded L_acc / L_draft, the other
  selected ones 0) vs ``ema`` (the suffix drafter's moving average per match
  position, its plug-in position_ema, mechanisms/position_ema.py); relaxed verification with its
  look-ahead and Phi is VerifyConfig "relaxed".
* AASD: ``aasd`` (alternatives at misaligned prompt positions only, as
  SOURCE_ALIGN, and prompt-copied drafts marked SOURCE_PROMPT, which
  VerifyConfig "entropy" relaxes) vs ``aasd_all``.
* Graft: ``graft`` (papers/graft.py) vs ``graft_tail``
  (mechanisms/graft_tail.py).
* ADED: ``aded`` (the trigram part's published form, papers/aded.py) vs
  edgespec's tri-gram search (drafters/trigram.py).

``schedule`` (mechanisms/schedule.py) idles the parts other than the
RETRIEVAL one whose drafts do not pay for their drafting time.

The published forms live in drafters/papers/ and are imported only in the
branch that builds them when switched on: the default `auto` loads none of
them (tests/test_hybrid.py checks it in a fresh interpreter).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from edgespec.kernels.suffix import merge_trees
from edgespec.drafters.tree import DraftTree
from edgespec.drafters.adjacency import AdjacencyDrafter
from edgespec.drafters.base import Drafter
from edgespec.drafters.branch import BranchDrafter
from edgespec.drafters.mechanisms import GUESS, RETRIEVAL, TEMPLATE
from edgespec.drafters.mechanisms.entropy import ENTROPY_TOPK, EntropyScaler
from edgespec.drafters.mechanisms.graft_tail import TailGraft
from edgespec.drafters.mechanisms.position_ema import PositionEma
from edgespec.drafters.mechanisms.schedule import PartSchedule
from edgespec.drafters.semantic import SemanticDrafter
from edgespec.drafters.suffix import SuffixConfig, SuffixDrafter
from edgespec.drafters.trigram import TrigramConfig, TrigramDrafter


@dataclass
class HybridConfig:
    """Which components run, their settings, and the largest merged proposal.

    Published mechanisms (off until measured) and edgespec's own variants of
    them (on: today's behaviour); see the module docstring and README."""
    suffix: bool = True
    trigram: bool = True
    adjacency: bool = True
    ema: bool = True
    entropy: bool = True
    schedule: bool = True
    branch_depth: bool = True
    aasd: bool = False      # opt-in (auto+aasd): it costs prefill time, and no decode gain was measured on CPU
    aasd_all: bool = False
    semantic_pair: bool = True
    graft_tail: bool = True
    # the papers' mechanisms as published
    branch: bool = False            # AdaPLD branch drafting (+ successor drafting)
    semantic: bool = False          # AdaPLD semantic fallback
    rerank: bool = False            # AdaPLD: the anchor chosen by hidden-state cosine
    trigger: bool = False           # ReSpec entropy trigger
    feedback: bool = False          # ReSpec feedback-driven candidate selection
    graft: bool = False             # Graft prune-then-graft under a fixed budget
    aded: bool = False              # ADED as published: the trigram part's TrigramConfig.aded
    memory: bool = True             # the suffix part drafts from the memory of earlier requests too
    copy_len: int = 32              # tokens copied after a lexical anchor (AdaPLD: 30)
    branch_k: int = 8               # AdaPLD: the model's top 8 after the anchor
    successor_len: int = 1          # AdaPLD: one successor token per branch (0: none; more: edgespec's)
    semantic_tau: float = 0.1       # AdaPLD: token-embedding cosine threshold
    rerank_layer: int = 0           # AdaPLD: the block whose output is compared (0: 13/40 of the depth)
    trigger_theta: float = 1.5      # ReSpec: retrieve iff H_{k*} <= theta, k* = argmin_k C_k (theta 1.5)
    trigger_lambda: float = 0.5     # ReSpec: C_k = H_k + lambda / k (lambda: not given, edgespec's choice)
    trigger_window: int = 3         # ReSpec: k <= l = 3
    feedback_top: int = 3           # ReSpec: top-3 selection
    feedback_init: float = 0.5      # ReSpec: S_0 = 0.5
    feedback_rate: float = 0.5      # ReSpec's EMA rate alpha (not given, edgespec's choice)
    feedback_min: float = 0.2       # ReSpec's theta_score (not given, edgespec's choice)
    # Graft: prune at checkpoint depth 2 / 4 / 6 when the best-path confidence is below that checkpoint's
    # calibrated threshold; stricter at shallow checkpoints (papers/graft.py: the values are edgespec's)
    graft_tau2: float = 0.2
    graft_tau4: float = 0.1
    graft_tau6: float = 0.05
    max_nodes: int = 64

    def __post_init__(self):
        if not (self.suffix or self.trigram or self.adjacency or self.branch_depth or self.aasd
                or self.aasd_all or self.semantic_pair or self.branch or self.semantic or self.rerank):
            raise ValueError("HybridConfig: enable at least one component")
        for name in ("max_nodes", "copy_len", "branch_k", "successor_len", "rerank_layer", "trigger_window",
                     "feedback_top"):
            v = getattr(self, name)
            lo = 0 if name in ("successor_len", "rerank_layer") else 1
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"HybridConfig.{name} must be an integer >= {lo}, got {v!r}")
            setattr(self, name, int(v))
        for name in ("semantic_tau", "trigger_theta", "trigger_lambda", "feedback_init", "feedback_rate", "feedback_min",
                     "graft_tau2", "graft_tau4", "graft_tau6"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not np.isfinite(v):
                raise ValueError(f"HybridConfig.{name} must be a number, got {v!r}")
            setattr(self, name, float(v))
        # Graft's base thresholds, shallowest checkpoint first (the fields' order), must not rise with
        # depth; checked here, on the fields, so that papers/graft.py is imported only with graft on
        taus = [(f.name, getattr(self, f.name)) for f in fields(self) if f.name.startswith("graft_tau")]
        if any(a < b for (_, a), (_, b) in zip(taus, taus[1:])):
            raise ValueError("HybridConfig: Graft's thresholds must not rise with depth "
                             f"({', '.join(f'{f}={t:g}' for f, t in taus)})")



class HybridDrafter(Drafter):
    """suffix, semantic, branch, trigram, adjacency: merged in that priority order.

    ``HybridDrafter(n_vocab, corpora=(), config=None, model_path=None,
    embeddings=None, memory=None)``: the semantic fallbacks compare tokens by
    the model's own embeddings, read from ``model_path`` (a GGUF) or given as
    a TokenEmbeddings; with neither they are left out.  ``memory``: the
    MemoryStore the suffix part also drafts from.

    The mechanisms: ``schedule`` (PartSchedule), ``entropy`` (EntropyScaler),
    ``graft_tail`` (TailGraft), built whatever the config says (its
    switches decide which the merge calls); the papers' ``trigger``
    (RetrievalTrigger), ``rerank`` (HiddenStates) and ``graft`` (PruneGraft),
    built (and imported) only when switched on, else None."""

    name = "auto"
    sources = (SuffixDrafter.sources + SemanticDrafter.sources + BranchDrafter.sources + TrigramDrafter.sources
               + AdjacencyDrafter.sources)
    """What its parts' proposals carry (the registry's docs table; the
    schedule credits each part its own)."""

    def __init__(self, n_vocab: int, corpora=(), config: HybridConfig | None = None,
                 model_path: str | None = None, embeddings=None, memory=None):
        self.config = c = config if config is not None else HybridConfig()
        self.rerank = None      # AdaPLD's hidden states, kept here and read by its part
        if c.rerank:
            from edgespec.drafters.papers.rerank import HiddenStates
            self.rerank = HiddenStates()
        made = self._make_parts(c, n_vocab, corpora, model_path, embeddings, memory)
        self.roles = [role for role, _ in made]     # per part: RETRIEVAL, GUESS or TEMPLATE (mechanisms/)
        self.parts = [p for _, p in made]
        if not self.parts:
            raise ValueError("HybridConfig: no component can run (the semantic fallbacks need the model's "
                             "embeddings: a model path)")
        self.prefill_topk = max(p.prefill_topk for p in self.parts)
        self.topk = max(p.topk for p in self.parts)
        self.entropy = EntropyScaler(c.entropy and c.suffix)
        if self.entropy.enabled:
            self.topk = max(self.topk, ENTROPY_TOPK)
        self.wants_entropy = c.trigger
        self.wants_hidden = c.rerank        # rerank always builds the AdaPLD part, which reads the states
        self.hidden_layer = c.rerank_layer
        self.schedule = PartSchedule(c, self.parts, self.roles)
        n = c.max_nodes
        self._buf = [(np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int8))
                     for _ in range(2)]
        self.graft_tail = TailGraft(n)
        self.trigger, self.graft = self._paper_mechanisms(c)
        # the lifecycle hooks run on these, in this order
        self.mechanisms = [m for m in (self.entropy, self.trigger, self.rerank, self.graft, self.schedule)
                           if m is not None and m.enabled]

    def _paper_mechanisms(self, c: HybridConfig):
        """(ReSpec's trigger, Graft's prune-then-graft), each None unless switched on (and imported only then)."""
        trigger = graft = None
        if c.trigger:
            from edgespec.drafters.papers.trigger import RetrievalTrigger
            trigger = RetrievalTrigger(c, self.parts)
        if c.graft and TEMPLATE in self.roles:      # Graft needs its template part
            from edgespec.drafters.papers.graft import PruneGraft
            graft = PruneGraft(c, self._buf)
        return trigger, graft

    @staticmethod
    def _retrieval_part(c: HybridConfig, corpora, memory) -> SuffixDrafter:
        """The suffix part, with its plug-ins in the registry's order: the
        position EMA (`ema`), ReSpec's feedback (imported only when on)."""
        plugins: list = [PositionEma()] if c.ema else []
        if c.feedback:
            from edgespec.drafters.papers.feedback import FeedbackConfig, PositionFeedback
            plugins.append(PositionFeedback(FeedbackConfig(feedback_init=c.feedback_init, feedback_rate=c.feedback_rate,
                                                           feedback_top=c.feedback_top, feedback_min=c.feedback_min)))
        return SuffixDrafter(SuffixConfig(max_depth=c.copy_len, prompt_source=c.aasd, memory=c.memory,
                                          max_nodes=max(64, c.max_nodes)), corpora=corpora, memory=memory,
                             plugins=plugins)

    def _make_parts(self, c: HybridConfig, n_vocab: int, corpora, model_path, embeddings,
                    memory) -> list[tuple[str, Drafter]]:
        """(role, drafter) of each component, in merge priority order."""
        parts: list[tuple[str, Drafter]] = []
        if c.suffix:
            parts.append((RETRIEVAL, self._retrieval_part(c, corpora, memory)))
        if (c.semantic_pair or c.semantic) and embeddings is None and model_path is not None:
            from edgespec.drafters.embeddings import TokenEmbeddings
            embeddings = TokenEmbeddings(model_path)
        if c.semantic_pair and embeddings is not None:
            parts.append((GUESS, SemanticDrafter(embeddings, max_nodes=c.max_nodes)))
        if c.branch or c.rerank or (c.semantic and embeddings is not None):
            from edgespec.drafters.papers.adapld import AdaPLDDrafter
            parts.append((GUESS, AdaPLDDrafter(branch=c.branch, embeddings=embeddings if c.semantic else None,
                                               rerank=c.rerank, hidden=self.rerank, k=c.branch_k,
                                               successor_len=c.successor_len, tau=c.semantic_tau,
                                               copy_len=c.copy_len, max_nodes=c.max_nodes)))
        if c.branch_depth or c.aasd or c.aasd_all:
            parts.append((GUESS, BranchDrafter(aasd=c.aasd, aasd_all=c.aasd_all, branch=c.branch_depth,
                                               max_nodes=c.max_nodes)))
        if c.trigram:
            parts.append((GUESS, TrigramDrafter(n_vocab, corpora=corpora, config=TrigramConfig(aded=c.aded))))
        if c.adjacency:
            parts.append((TEMPLATE, AdjacencyDrafter(n_vocab, corpora=corpora)))
        return parts

    def warmup(self) -> None:
        for p in self.parts:
            p.warmup()
        t = DraftTree(np.array([5, 6], np.int32), np.array([-1, 0], np.int32),
                      np.array([0.5, 0.5], np.float32), np.array([0, 0], np.int8))
        if self.entropy.enabled or self.wants_entropy:
            from edgespec.kernels import topk
            topk.warmup()
        self.graft_tail.warmup()
        a, b = self._buf
        merge_trees(t.tokens, t.parents, t.probs, t.source, 2, t.tokens, t.parents, t.probs, t.source, 2,
                    4, a[0], a[1], a[2], a[3])

    def begin(self, prompt: np.ndarray) -> None:
        for p in self.parts:
            p.begin(prompt)
        for m in self.mechanisms:
            m.begin(prompt)

    def observe_prefill(self, start, topk_tokens, topk_logits) -> None:
        for p in self.parts:
            if p.prefill_topk:
                p.observe_prefill(start, topk_tokens, topk_logits)

    def observe_prefill_hidden(self, start: int, hidden: np.ndarray) -> None:
        if self.rerank is not None:
            self.rerank.store(start, hidden)

    def observe(self, result) -> None:
        for i, p in enumerate(self.parts):
            if self.schedule.observes(i):
                p.observe(result)
        for m in self.mechanisms:
            m.observe(result)

    # --------------------------------------------------------------- propose
    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        budget = min(int(budget), self.config.max_nodes)
        if budget <= 0:
            return DraftTree.empty()
        c = self.config
        for m in self.mechanisms:
            m.start_step()
        retrieve = self._trigger() if self.trigger is not None else True
        graft = self.graft is not None
        cur, template, drafted = self._merge(context, budget, retrieve, graft)
        if graft:
            cur = self.graft.graft(cur, template, budget)
        if cur is None or cur[4] == 0:
            return DraftTree.empty()
        m = cur[4]
        if cur[0] is self._buf[0][0] or cur[0] is self._buf[1][0]:    # merged: out of the scratch buffers
            tree = (cur[0][:m].copy(), cur[1][:m].copy(), cur[2][:m].copy(), cur[3][:m].copy())
        else:                   # one part's own proposal (its arrays are the part's fresh copies)
            tree = tuple(a[:m] for a in cur[:4])
        if c.graft_tail and drafted:
            tree = self.graft_tail.graft(context, *tree, budget)
        return DraftTree.raw(*tree)

    def _trigger(self) -> bool:
        """ReSpec's decision for this step; its key k* handed to the RETRIEVAL part."""
        retrieve = self.trigger.check()
        for p, role in zip(self.parts, self.roles):
            if role == RETRIEVAL:
                p.use_key(self.trigger.key)
        return retrieve

    def _merge(self, context, budget: int, retrieve: bool, graft: bool):
        """The parts' proposals merged in priority order: (cur, template, drafted).

        cur: (tokens, parents, probs, source, m) of the merge, or None;
        template: with `graft`, the TEMPLATE part's root-centred tree, kept
        aside; drafted: a part other than the RETRIEVAL one proposed nodes
        (graft_tail may apply).
        With `graft`, Graft's checkpoints are decided on the tree merged so far
        after each part; once one prunes, the drafted parts after it are not asked."""
        cur = None
        k = 0
        drafted = False
        template = None
        for i, role in enumerate(self.roles):
            if self.schedule.resting(i) or (not retrieve and self.trigger.gated[i]) \
                    or (graft and self.graft.pruned and role != TEMPLATE):
                self.schedule.skip(i)
                continue
            t = self.schedule.propose(i, context, budget)
            if len(t) == 0:
                continue
            if role == RETRIEVAL:
                if self.entropy.enabled:       # only retrieved drafts are scaled: computed when there are some
                    self.entropy.scale(t)
            else:
                drafted = True
            if graft and role == TEMPLATE:
                template = t
                continue
            if cur is None:
                cur = (t.tokens, t.parents, t.probs, t.source, len(t))
            else:
                out = self._buf[k]
                k ^= 1
                m = merge_trees(cur[0], cur[1], cur[2], cur[3], cur[4],
                                t.tokens, t.parents, t.probs, t.source, len(t), budget,
                                out[0], out[1], out[2], out[3])
                cur = (out[0], out[1], out[2], out[3], m)
            if graft:
                cur = self.graft.checkpoint(cur)
        return cur, template, drafted
