"""The `auto` drafter: every cheap drafter's proposal merged into one tree.

Retrieval first: the suffix drafter's tree (matches in the prompt, the
generation so far and the corpora) has priority; the tri-gram MCTS tree and the
adjacency (Token Recycling) tree are merged into it as a trie, their branches
sharing the probability mass the retrieved branches leave over at each node
(kernels/suffix.py `merge_trees`).  Every node keeps its source, so the engine's
acceptance model calibrates each source separately and its cost gate keeps,
node by node, only what is expected to pay under the measured c(T): a weak
tri-gram guess at depth 3 is cut while a long retrieved continuation stays.

Each paper's mechanism is a switch (a bool field of HybridConfig, `auto-noX`
/ `auto+X` by name; numeric settings by `auto+X=V`).  Where edgespec's own
variant differs from the published one, both exist under two names, the
published one under the paper's word and off by default until measured (see
README "Drafters and corpora" for the table):

* AdaPLD: ``branch`` (top 8 at the anchor's next position minus the copied
  token, with ``successor_len`` successor drafts) vs ``branch_depth``;
  ``semantic`` (single tokens at cosine ``semantic_tau`` = 0.1, a branch and
  successors, no copy) vs ``semantic_pair``; ``copy_len`` (AdaPLD: 30,
  edgespec: 12); ``rerank`` (the lexical anchors ordered by the cosine of
  the model's hidden states, llama.cpp's own, at the anchor and at the end
  of the context; the ``rerank_top`` most similar are kept).
* ReSpec: ``trigger`` (retrieve iff min over k <= 3 of H_k + lambda / k <=
  theta = 1.5, H_k the mean entropy of the model's distribution over the
  last k positions) vs ``entropy``; ``feedback`` (position scores from 0.5,
  reward L_acc / L_draft, losers 0, the best 3 drafted) vs ``ema``; the cap
  Phi on relaxed acceptances is VerifyConfig.max_relaxed.
* AASD: ``aasd`` (alternatives at misaligned prompt positions only, as
  SOURCE_ALIGN, and prompt-copied drafts marked SOURCE_PROMPT, which
  VerifyConfig "entropy" relaxes) vs ``aasd_all``.
* Graft: ``graft`` (calibrated pruning checkpoints on the drafted tree's best
  path, a fixed budget split between the pruned tree and a root-centred
  adjacency template grafted into the freed slots) vs ``graft_tail``.

Two ReSpec-inspired variants of edgespec sit on the retrieval part (each switchable):

* ``ema``: the suffix drafter keeps a moving average per match position and
  stops proposing occurrences whose drafts keep failing (SuffixConfig.position_ema).
* ``entropy``: a soft, calibrated retrieval trigger.  The model's recent
  uncertainty is the mean entropy of its top-8 distribution over the last 4
  committed positions (read from logits the verification computed anyway; the
  full-vocabulary entropy would cost ~0.15 ms a row on the 2-core machine).
  Per entropy bucket the drafter counts how its depth-1 retrieved drafts fared
  against their scores, and scales those drafts' scores by the bucket's rate
  relative to the overall rate (at most 1): where the model is too unsure for
  copying to work, retrieved drafts score low and the cost gate drops them.

``schedule`` (Graft's fixed budget, applied to drafting time): the gate already
keeps only nodes whose verification pays, but *making* a proposal costs time
too (the tri-gram MCTS ~65 us a step on the 2-core machine), and the gate's
estimates are only estimates.  For the tri-gram and adjacency parts the drafter
keeps a moving average, per step in which the part proposed, of its net value
(draft tokens it added to the accepted path, minus the verification time of
its verified nodes, in plain-step units) and of its propose() time.  A part
whose value is worth less than its time goes idle: it proposes again after
``SCHEDULE_PROBE`` steps (a probe), and each probe that leaves it idle doubles
the wait, up to ``SCHEDULE_PROBE_MAX`` steps; a probe that pays makes it active
again.  An idle part also skips observe() except in the step before a probe
and in the probe itself (its tables then miss the steps between: on the 2-core
machine the idle parts' observing cost ~0.05 ms a step, the probes ~0.05 ms
more).  The suffix part is always on (it is the cheap one).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from edgespec.kernels import anchor as _ak
from edgespec.kernels import suffix as _sk
from edgespec.kernels.suffix import merge_trees
from edgespec.kernels.topk import push_entropy
from edgespec.core.tree import (N_SOURCES, SOURCE_ADJACENCY, SOURCE_ALIGN, SOURCE_BRANCH, SOURCE_CONTEXT, SOURCE_CORPUS,
                    SOURCE_EDIT, SOURCE_PROMPT, SOURCE_SEMANTIC, SOURCE_TRIGRAM, DraftTree)
from edgespec.drafters.adapld import AdaPLDDrafter
from edgespec.drafters.adjacency import AdjacencyDrafter
from edgespec.drafters.base import Drafter
from edgespec.drafters.branch import BranchDrafter
from edgespec.drafters.semantic import SemanticDrafter
from edgespec.drafters.suffix import SuffixConfig, SuffixDrafter
from edgespec.drafters.trigram import TrigramDrafter

GRAFT_RESERVE = 8                   # graft_tail: at most 8 slots of a proposal go to grafts
GRAFT_POINTS = 2                    # from the 2 most probable drafted leaves
GRAFT_MIN_CUM = 0.05                # whose path is at least this likely
GRAFT_DEPTH = 4
GRAFT_FROM = (SOURCE_TRIGRAM, SOURCE_ADJACENCY, SOURCE_BRANCH, SOURCE_SEMANTIC, SOURCE_ALIGN)
_GRAFT_FROM_MASK = np.isin(np.arange(N_SOURCES), GRAFT_FROM)
GRAFT_CHECKPOINTS = (2, 4, 6)       # graft: pruning checkpoints (depths of the drafted tree)
SCHEDULE_PROBE = 8                  # an idle part proposes again after 8 steps,
SCHEDULE_PROBE_MAX = 64             # doubling the wait after each failed probe, to 64
SCHEDULE_ALPHA = 0.1                # weight of the newest step in the moving averages
SCHEDULE_GAIN0 = 1.0                # parts start trusted (1 accepted token per step)
ENTROPY_TOPK = 8                    # entropy of the model's top-8 distribution
ENTROPY_MAX = float(np.log(ENTROPY_TOPK))
ENTROPY_BUCKETS = 5
ENTROPY_WINDOW = 4                  # committed positions in the recent mean
_RETRIEVAL = (SuffixDrafter, SemanticDrafter, AdaPLDDrafter, BranchDrafter)   # what ReSpec's trigger gates


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
    aasd: bool = False      # opt-in (auto+aasd): ~17% more prefill time, no decode gain measured on CPU
    aasd_all: bool = False
    semantic_pair: bool = True
    graft_tail: bool = True
    # the papers' mechanisms as published
    branch: bool = False            # AdaPLD branch drafting (+ successor drafting)
    semantic: bool = False          # AdaPLD semantic fallback
    rerank: bool = False            # AdaPLD hidden-state rerank of the lexical anchors
    trigger: bool = False           # ReSpec entropy trigger
    feedback: bool = False          # ReSpec feedback-driven candidate selection
    graft: bool = False             # Graft prune-then-graft under a fixed budget
    copy_len: int = 32              # tokens copied after a lexical anchor (AdaPLD: 30)
    branch_k: int = 8               # AdaPLD: the model's top 8 at the anchor's next position
    successor_len: int = 4          # AdaPLD successor drafts per branch token (0: none)
    semantic_tau: float = 0.1       # AdaPLD: single-token cosine threshold
    rerank_top: int = 2             # lexical anchors kept after the hidden-state rerank
    trigger_theta: float = 1.5      # ReSpec: retrieve iff min_k C_k <= theta
    trigger_lambda: float = 0.5     # ReSpec: C_k = H_k + lambda / k (lambda: edgespec's choice)
    trigger_window: int = 3         # ReSpec: k <= 3
    feedback_top: int = 3           # ReSpec: top-3 selection
    feedback_init: float = 0.5
    feedback_rate: float = 0.5
    graft_tau: float = 0.1          # Graft: prune at a checkpoint whose calibrated best-path confidence is below
    max_nodes: int = 64

    def __post_init__(self):
        if not (self.suffix or self.trigram or self.adjacency or self.branch_depth or self.aasd
                or self.aasd_all or self.semantic_pair or self.branch or self.semantic):
            raise ValueError("HybridConfig: enable at least one component")
        for name in ("max_nodes", "copy_len", "branch_k", "successor_len", "rerank_top", "trigger_window",
                     "feedback_top"):
            v = getattr(self, name)
            lo = 0 if name == "successor_len" else 1
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"HybridConfig.{name} must be an integer >= {lo}, got {v!r}")
            setattr(self, name, int(v))
        for name in ("semantic_tau", "trigger_theta", "trigger_lambda", "feedback_init", "feedback_rate",
                     "graft_tau"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not np.isfinite(v):
                raise ValueError(f"HybridConfig.{name} must be a number, got {v!r}")
            setattr(self, name, float(v))


class HybridDrafter(Drafter):
    """suffix, semantic, branch, trigram, adjacency: merged in that priority order.

    ``HybridDrafter(n_vocab, corpora=(), config=None, model_path=None,
    embeddings=None)``: the semantic fallbacks compare tokens by the model's
    own embeddings, read from ``model_path`` (a GGUF) or given as a
    TokenEmbeddings; with neither they are left out."""

    name = "auto"

    def __init__(self, n_vocab: int, corpora=(), config: HybridConfig | None = None,
                 model_path: str | None = None, embeddings=None):
        self.config = c = config if config is not None else HybridConfig()
        self.parts = self._make_parts(c, n_vocab, corpora, model_path, embeddings)
        if not self.parts:
            raise ValueError("HybridConfig: no component can run (the semantic fallbacks need the model's "
                             "embeddings: a model path)")
        self.prefill_topk = max(p.prefill_topk for p in self.parts)
        self.topk = max(p.topk for p in self.parts)
        self._entropy = c.entropy and c.suffix
        if self._entropy:
            self.topk = max(self.topk, ENTROPY_TOPK)
        self._hring = np.zeros(ENTROPY_WINDOW, np.float64)   # the last committed positions' entropies
        self._hn = 0                                          # how many were pushed this request
        self._hmean = 0.0                                     # their mean over the window
        self._ent_pred = [0.0] * ENTROPY_BUCKETS     # per bucket: predicted and accepted
        self._ent_acc = [0.0] * ENTROPY_BUCKETS      # depth-1 retrieved drafts
        self._ent_tot = [0.0, 0.0]                   # their sums over the buckets
        self._ent_last = (-1, 1.0)       # (bucket, factor) of the last proposal
        # ReSpec's trigger: the full entropies of the last committed positions (newest last)
        self.wants_entropy = c.trigger
        self._trig_h: list[float] = []
        self.n_triggered = self.n_trigger_checks = 0
        # AdaPLD's rerank: unit hidden states by context position
        self.wants_hidden = c.rerank
        self._H = np.zeros((0, 0), np.float32)
        self._H_known = np.zeros(0, np.bool_)
        self._H_ctx = np.zeros(0, np.int32)
        if c.rerank:
            for p in (self._suffix, self._adapld):
                if p is not None:
                    p.anchor_hook = self._rerank
        # Graft: per checkpoint, predicted best-path confidence and observed reach
        self._gp_pred = np.zeros(len(GRAFT_CHECKPOINTS))
        self._gp_obs = np.zeros(len(GRAFT_CHECKPOINTS))
        self._gp_last: list[tuple[int, float]] = []     # (checkpoint, raw confidence) of the last proposal
        self.graft_stats = np.zeros(len(GRAFT_CHECKPOINTS) + 1, np.int64)   # prunings per stage, none
        # schedule: per part, sources, EMA of contributed tokens and of propose time
        srcs = {SuffixDrafter: (SOURCE_CONTEXT, SOURCE_CORPUS, SOURCE_PROMPT, SOURCE_EDIT), TrigramDrafter: (SOURCE_TRIGRAM,),
                AdjacencyDrafter: (SOURCE_ADJACENCY,), BranchDrafter: (SOURCE_BRANCH, SOURCE_ALIGN),
                SemanticDrafter: (SOURCE_SEMANTIC,), AdaPLDDrafter: (SOURCE_BRANCH, SOURCE_SEMANTIC)}
        self._sources = [srcs[type(p)] for p in self.parts]
        self._retrieval = [isinstance(p, _RETRIEVAL) for p in self.parts]
        self._gain = np.full(len(self.parts), SCHEDULE_GAIN0)
        self._cost = np.zeros(len(self.parts))
        self._idle = [False] * len(self.parts)
        self._proposed = [False] * len(self.parts)
        self._extra_proposed = False        # a part other than suffix proposed this step
        self._wants = [p.wants_observe() for p in self.parts]
        self._wait = [SCHEDULE_PROBE] * len(self.parts)     # current probe interval
        self._next_probe = [0] * len(self.parts)            # step of the next probe
        self._n_steps = 0
        self._g_ends = np.zeros(4, np.int32)
        self._g_lens = np.zeros(4, np.int32)
        self._g_buf = (np.zeros(GRAFT_RESERVE, np.int32), np.zeros(GRAFT_RESERVE, np.int32),
                       np.zeros(GRAFT_RESERVE, np.float32), np.zeros(GRAFT_RESERVE, np.int32))
        n = c.max_nodes
        self._g_cum = np.zeros(n, np.float64)
        self._g_leaf = np.zeros(n, np.bool_)
        self._buf = [(np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int8))
                     for _ in range(2)]

    def _make_parts(self, c: HybridConfig, n_vocab: int, corpora, model_path, embeddings) -> list[Drafter]:
        """The component drafters in merge priority order; sets _suffix, _adapld, _adjacency."""
        parts: list[Drafter] = []
        self._suffix = self._adapld = self._adjacency = None
        if c.suffix:
            self._suffix = SuffixDrafter(SuffixConfig(
                position_ema=c.ema, max_depth=c.copy_len, feedback=c.feedback, feedback_top=c.feedback_top,
                feedback_init=c.feedback_init, feedback_rate=c.feedback_rate, prompt_source=c.aasd,
                max_nodes=max(64, c.max_nodes)), corpora=corpora)
            parts.append(self._suffix)
        if (c.semantic_pair or c.semantic) and embeddings is None and model_path is not None:
            from edgespec.drafters.embeddings import TokenEmbeddings
            embeddings = TokenEmbeddings(model_path)
        if c.semantic_pair and embeddings is not None:
            parts.append(SemanticDrafter(embeddings, max_nodes=c.max_nodes))
        if c.branch or (c.semantic and embeddings is not None):
            self._adapld = AdaPLDDrafter(branch=c.branch, embeddings=embeddings if c.semantic else None,
                                         k=c.branch_k, successor_len=c.successor_len, tau=c.semantic_tau,
                                         max_nodes=c.max_nodes)
            parts.append(self._adapld)
        if c.branch_depth or c.aasd or c.aasd_all:
            parts.append(BranchDrafter(aasd=c.aasd, aasd_all=c.aasd_all, branch=c.branch_depth,
                                       max_nodes=c.max_nodes))
        if c.trigram:
            parts.append(TrigramDrafter(n_vocab, corpora=corpora))
        if c.adjacency:
            self._adjacency = AdjacencyDrafter(n_vocab, corpora=corpora)
            parts.append(self._adjacency)
        return parts

    def warmup(self) -> None:
        for p in self.parts:
            p.warmup()
        t = DraftTree(np.array([5, 6], np.int32), np.array([-1, 0], np.int32),
                      np.array([0.5, 0.5], np.float32), np.array([0, 0], np.int8))
        if self._entropy or self.wants_entropy:
            from edgespec.kernels import topk
            topk.warmup()
        _ak.warmup()
        a, b = self._buf
        merge_trees(t.tokens, t.parents, t.probs, t.source, 2, t.tokens, t.parents, t.probs, t.source, 2,
                    4, a[0], a[1], a[2], a[3])

    def begin(self, prompt: np.ndarray) -> None:
        for p in self.parts:
            p.begin(prompt)
        self._hn = 0
        self._hmean = 0.0
        self._ent_last = (-1, 1.0)
        self._trig_h = []
        self._gp_last = []
        if self.wants_hidden:       # hidden states stay valid for the prefix shared with the last context
            m = min(len(prompt), len(self._H_ctx))
            neq = np.nonzero(self._H_ctx[:m] != prompt[:m])[0]
            self._H_known[int(neq[0]) if len(neq) else m:] = False
            self._H_ctx = np.asarray(prompt, np.int32)

    def observe_prefill(self, start, topk_tokens, topk_logits) -> None:
        for p in self.parts:
            if p.prefill_topk:
                p.observe_prefill(start, topk_tokens, topk_logits)

    def observe_prefill_hidden(self, start: int, hidden: np.ndarray) -> None:
        self._store_hidden(start, hidden)

    def observe(self, result) -> None:
        nxt = self._n_steps + 1
        idle, proposed, probe, wants = self._idle, self._proposed, self._next_probe, self._wants
        for i, p in enumerate(self.parts):
            # an idle part observes only around its probes
            if wants[i] and not (idle[i] and not proposed[i] and nxt < probe[i]):
                p.observe(result)
        if self._entropy:
            self._observe_entropy(result)
        if self.wants_entropy and len(result.entropy):
            self._trig_h = (self._trig_h + result.entropy.tolist())[-self.config.trigger_window:]
        if self.wants_hidden and result.hidden.ndim == 2 and len(result.hidden):
            self._H_ctx = result.context
            self._store_hidden(len(result.context) - len(result.accepted) - 1, result.hidden)
        if self._gp_last:
            self._observe_graft(result)
        if self._extra_proposed and self.config.schedule and result.plain_step_s > 0:
            self._observe_schedule(result)      # it weighs only the parts other than suffix

    # ------------------------------------------------------------ schedule
    def _observe_schedule(self, result) -> None:
        pr = result.proposed
        k = len(pr)
        if k:
            acc_n = np.bincount(pr.source[result.node_accepted], minlength=N_SOURCES)
            node_n = np.bincount(pr.source, minlength=N_SOURCES)
        # what each verified draft node added to this step's decode time
        per_node = max(0.0, result.step_decode_s - result.plain_step_s) / k if k else 0.0
        a = SCHEDULE_ALPHA
        for i, p in enumerate(self.parts):
            if not self._proposed[i] or p is self._suffix:
                continue
            g = nodes = 0
            if k:
                for s in self._sources[i]:
                    g += int(acc_n[s])
                    nodes += int(node_n[s])
            # net value in plain-step units: accepted tokens minus verify time of its nodes
            self._gain[i] = (1 - a) * self._gain[i] + a * (g - nodes * per_node / result.plain_step_s)
            was_idle = self._idle[i]
            self._idle[i] = self._gain[i] * result.plain_step_s < self._cost[i]
            if not self._idle[i]:
                self._wait[i] = SCHEDULE_PROBE
            else:
                if was_idle:            # a probe that did not pay: wait longer
                    self._wait[i] = min(2 * self._wait[i], SCHEDULE_PROBE_MAX)
                self._next_probe[i] = self._n_steps + self._wait[i]

    def schedule_report(self) -> list[tuple[str, float, float, bool]]:
        """(part, net value per proposing step in plain-step units, propose ms, idle) per part."""
        return [(p.name, float(self._gain[i]), float(self._cost[i] * 1e3), self._idle[i])
                for i, p in enumerate(self.parts)]

    # ------------------------------------------------------ entropy trigger
    def _observe_entropy(self, result) -> None:
        b, f = self._ent_last
        pr = result.proposed
        if b >= 0 and len(pr):
            m = (pr.parents == -1) & (pr.source <= SOURCE_CORPUS) & result.node_tested
            if m.any():
                p, a = float(pr.probs[m].sum()) / f, float(result.node_accepted[m].sum())
                self._ent_pred[b] += p
                self._ent_acc[b] += a
                self._ent_tot[0] += p
                self._ent_tot[1] += a
        x = result.topk_logits
        r = len(x)
        if r:
            self._hmean = push_entropy(x, r, self._hring, self._hn)
            self._hn += r

    def _entropy_factor(self) -> tuple[int, float]:
        """(bucket, score factor) for the current recent entropy."""
        if not self._hn:
            return -1, 1.0
        h = self._hmean
        b = min(int(h / ENTROPY_MAX * ENTROPY_BUCKETS), ENTROPY_BUCKETS - 1)
        rate_b = (self._ent_acc[b] + 1.0) / (self._ent_pred[b] + 1.0)
        rate = (self._ent_tot[1] + 1.0) / (self._ent_tot[0] + 1.0)
        return b, min(1.0, max(0.05, rate_b / rate))

    def triggered(self) -> bool:
        """ReSpec's entropy trigger: with H_k the mean entropy of the model's
        distribution over the last k committed positions (k = 1 .. window),
        retrieve iff min_k (H_k + lambda / k) <= theta.  The lambda / k term
        asks more of a short window (less evidence).  No entropy known yet
        (the first step of a request): retrieve."""
        h = self._trig_h
        if not h:
            return True
        c = self.config
        best = min(sum(h[-k:]) / k + c.trigger_lambda / k for k in range(1, len(h) + 1))
        return best <= c.trigger_theta

    # ---------------------------------------------------- hidden-state rerank
    def _store_hidden(self, start: int, hidden: np.ndarray) -> None:
        r, d = hidden.shape
        if r == 0:
            return
        if self._H.shape[1] != d or len(self._H) < start + r:
            cap = max(start + r, 2 * len(self._H), 1024)
            H = np.zeros((cap, d), np.float32)
            known = np.zeros(cap, np.bool_)
            if self._H.shape[1] == d:
                H[:len(self._H)] = self._H
                known[:len(self._H_known)] = self._H_known
            self._H, self._H_known = H, known
        self._H[start:start + r] = hidden / (np.linalg.norm(hidden, axis=1, keepdims=True) + 1e-9)
        self._H_known[start:start + r] = True

    def _rerank(self, ctx, n: int, ends, lens, k: int) -> int:
        """AdaPLD's rerank: order the lexical anchors by the cosine of the
        model's hidden state where it predicted the matched token (position
        e - 1 for an occurrence ending at e) and where it predicted the root
        (position n - 2); keep the rerank_top most similar.  Without the
        hidden states (a replay without them) the order stays."""
        q = n - 2
        H, known = self._H, self._H_known
        if q < 0 or q >= len(known) or not known[q]:
            return k
        e = ends[:k].astype(np.int64) - 1
        ok = (e >= 0) & (e < len(known))
        ok[ok] = known[e[ok]]
        sims = np.full(k, -2.0)
        sims[ok] = H[e[ok]] @ H[q]
        order = np.argsort(-sims, kind="stable")[:self.config.rerank_top]
        j = len(order)
        ends[:j], lens[:j] = ends[:k][order].copy(), lens[:k][order].copy()
        return j

    # --------------------------------------------------------------- propose
    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        budget = min(int(budget), self.config.max_nodes)
        if budget <= 0:
            return DraftTree.empty()
        cur = None      # (tokens, parents, probs, source, m) of the merge so far
        k = 0
        drafted = False         # a part other than retrieval proposed: graft may apply
        self._ent_last = (-1, 1.0)
        self._extra_proposed = False
        self._n_steps += 1
        c = self.config
        retrieve = True
        if c.trigger:
            retrieve = self.triggered()
            self.n_trigger_checks += 1
            self.n_triggered += retrieve
        graft = c.graft and self._adjacency is not None
        template = None         # graft: the adjacency part's root-centred tree, kept aside
        for i, p in enumerate(self.parts):
            if (self._idle[i] and self._n_steps < self._next_probe[i]) or (not retrieve and self._retrieval[i]):
                self._proposed[i] = False
                continue
            t0 = time.perf_counter()
            t = p.propose(context, budget)
            self._cost[i] = (1 - SCHEDULE_ALPHA) * self._cost[i] + SCHEDULE_ALPHA * (time.perf_counter() - t0)
            self._proposed[i] = True
            if p is not self._suffix:
                self._extra_proposed = True
            if len(t) == 0:
                continue
            if p is self._suffix:
                if self._entropy:       # only retrieved drafts are scaled: computed when there are some
                    self._ent_last = self._entropy_factor()
                    if self._ent_last[1] < 1.0:
                        top = t.parents == -1
                        t.probs[top] *= self._ent_last[1]
            else:
                drafted = True
            if graft and p is self._adjacency:
                template = t
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
        if graft:
            cur = self._prune_and_graft(cur, template, budget)
        if cur is None or cur[4] == 0:
            return DraftTree.empty()
        m = cur[4]
        if cur[0] is self._buf[0][0] or cur[0] is self._buf[1][0]:    # merged: out of the scratch buffers
            tree = (cur[0][:m].copy(), cur[1][:m].copy(), cur[2][:m].copy(), cur[3][:m].copy())
        else:                   # one part's own proposal (its arrays are the part's fresh copies)
            tree = tuple(a[:m] for a in cur[:4])
        if c.graft_tail and drafted:
            tree = self._graft(context, *tree, budget)
        return DraftTree.raw(*tree)

    # ----------------------------------------------------- graft (published)
    def _prune_and_graft(self, cur, template, budget):
        """Graft (Shen et al., 2026, "Draft Less, Retrieve More") as this
        project's issue 19 describes it (the paper's text was not reachable
        from this session): the verification budget B is fixed; the drafted
        tree (every part but adjacency, merged) is pruned at the first
        checkpoint depth d_s (GRAFT_CHECKPOINTS) whose calibrated best-path
        confidence (the largest product of node probabilities down to depth
        d_s, times that checkpoint's observed/predicted reach ratio) is below
        graft_tau: its nodes deeper than d_s go, B_draft(s) = what stays and
        B_retr(s) = B - B_draft(s).  The retrieval template, the adjacency
        table expanded from the root (Token Recycling's tree, best ranks
        first), fills exactly those B_retr slots, merged under the root."""
        self._gp_last = []
        if cur is None:
            if template is None:
                return None
            return (template.tokens, template.parents, template.probs, template.source, min(len(template), budget))
        tok, par, pr, src, m = cur
        depth = np.empty(m, np.int64)
        cum = np.empty(m, np.float64)
        for i in range(m):
            q = par[i]
            depth[i] = 1 if q < 0 else depth[q] + 1
            cum[i] = pr[i] * (1.0 if q < 0 else cum[q])
        keep = m
        stage = len(GRAFT_CHECKPOINTS)
        for s, d in enumerate(GRAFT_CHECKPOINTS):
            at = depth == d
            if not at.any():
                break
            conf = float(cum[at].max())
            self._gp_last.append((s, conf))
            ratio = (self._gp_obs[s] + 1.0) / (self._gp_pred[s] + 1.0)
            if conf * ratio < self.config.graft_tau:
                keep = int(np.count_nonzero(depth <= d))
                stage = s
                break
        self.graft_stats[stage] += 1
        b_draft = min(keep, budget)
        if keep < m:        # pruned: keep the nodes down to depth d_s (parents precede children)
            sel = np.flatnonzero(depth <= GRAFT_CHECKPOINTS[stage])[:b_draft]
            tok, par, pr, src = self._compact(tok, par, pr, src, sel)
            m = len(sel)
        b_retr = budget - b_draft
        if template is None or b_retr <= 0:
            return (tok, par, pr, src, min(m, budget))
        out = self._buf[0] if tok is not self._buf[0][0] else self._buf[1]
        mt = min(len(template), b_retr)
        mm = merge_trees(tok, par, pr, src, m, template.tokens, template.parents, template.probs, template.source,
                         mt, b_draft + mt, out[0], out[1], out[2], out[3])
        return (out[0], out[1], out[2], out[3], mm)

    @staticmethod
    def _compact(tok, par, pr, src, sel):
        """The nodes `sel` (ascending, closed under parents) as a tree of their own."""
        remap = np.full(len(tok), -1, np.int64)
        remap[sel] = np.arange(len(sel))
        p = par[sel]
        newp = np.where(p < 0, -1, remap[np.maximum(p, 0)]).astype(np.int32)
        return tok[sel].copy(), newp, pr[sel].copy(), src[sel].copy()

    def _observe_graft(self, result) -> None:
        """Calibrate the checkpoints: at each checkpoint reached by the last
        proposal, did the step accept drafts down to that depth?"""
        pr = result.proposed
        n_acc = len(result.accepted) - 1
        for s, conf in self._gp_last:
            d = GRAFT_CHECKPOINTS[s]
            if len(pr) == 0:
                continue
            self._gp_pred[s] += conf
            self._gp_obs[s] += float(n_acc >= d)
        self._gp_last = []

    # ---------------------------------------------------------- graft_tail
    def _graft(self, context, tok, par, pr, src, budget):
        """edgespec's `graft_tail` (Graft's TAIL strawman rather than Graft):
        retrieval continued from the best drafted leaves.

        Retrieval alone anchors at the root.  A confident tri-gram, adjacency,
        branch or semantic leaf is a position retrieval never looked from: with
        its path appended to the context, the end of that hypothetical context
        may occur earlier, and what followed there is grafted under the leaf
        (source context).  The slots come from the tail of the merged
        proposal (its least probable nodes, pruned), at most GRAFT_RESERVE of
        the budget; the engine's gate then judges grafted nodes like any other.
        """
        m = len(tok)
        reserve = min(GRAFT_RESERVE, budget // 4)
        lim = min(m, budget - reserve)
        if reserve <= 0 or lim <= 0:
            return tok, par, pr, src
        drafted = _GRAFT_FROM_MASK[src[:lim]]
        if not drafted.any():                           # retrieval alone: nothing to graft under
            return tok, par, pr, src
        cum, leaf = self._g_cum[:m], self._g_leaf[:m]
        _ak.path_probs(par, pr, m, cum, leaf)
        ok = leaf[:lim] & drafted & (cum[:lim] >= GRAFT_MIN_CUM)
        cand = np.flatnonzero(ok)
        if len(cand) == 0:
            return tok, par, pr, src
        points = cand[np.argsort(-cum[cand], kind="stable")[:GRAFT_POINTS]]
        ctx = np.ascontiguousarray(context, dtype=np.int32)
        grafts = []
        room = reserve
        for i in points:
            path = []
            q = i
            while q >= 0:
                path.append(tok[q])
                q = par[q]
            ext = np.concatenate([ctx, np.array(path[::-1], np.int32)])
            k = _sk.find_suffix_matches(ext, len(ext), 2, 32, 4, self._g_ends, self._g_lens)
            if k == 0:
                continue
            g = self._g_buf
            mc = _sk.build_continuation_tree(ext, len(ext), self._g_ends, self._g_lens, k, GRAFT_DEPTH,
                                             room, g[0], g[1], g[2], g[3])
            if mc:
                grafts.append((i, g[0][:mc].copy(), g[1][:mc].copy(), g[2][:mc].copy()))
                room -= mc
            if room <= 0:
                break
        if not grafts:
            return tok, par, pr, src
        total = reserve - room
        keep = min(m, budget - total)          # every graft point is < lim <= keep
        toks, pars, probs = [tok[:keep]], [par[:keep]], [pr[:keep]]
        base = keep
        for i, gt, gp, gq in grafts:
            toks.append(gt)
            pars.append(np.where(gp < 0, i, gp + base).astype(np.int32))
            probs.append(gq)
            base += len(gt)
        srcs = np.concatenate([src[:keep], np.full(total, SOURCE_CONTEXT, np.int8)])
        return np.concatenate(toks), np.concatenate(pars), np.concatenate(probs), srcs
