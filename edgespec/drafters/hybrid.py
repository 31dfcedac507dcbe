"""The `auto` drafter: every cheap drafter's proposal merged into one tree.

Retrieval first: the suffix drafter's tree (matches in the prompt, the
generation so far and the corpora) has priority; the tri-gram MCTS tree and the
adjacency (Token Recycling) tree are merged into it as a trie, their branches
sharing the probability mass the retrieved branches leave over at each node
(kernels/suffix.py `merge_trees`).  Every node keeps its source, so the engine's
acceptance model calibrates each source separately and its cost gate keeps,
node by node, only what is expected to pay under the measured c(T): a weak
tri-gram guess at depth 3 is cut while a long retrieved continuation stays.

Two ReSpec ideas sit on the retrieval part (each switchable):

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

from ..kernels import anchor as _ak
from ..kernels import suffix as _sk
from ..kernels.suffix import merge_trees
from ..kernels.topk import push_entropy
from ..tree import (N_SOURCES, SOURCE_ADJACENCY, SOURCE_BRANCH, SOURCE_CONTEXT, SOURCE_CORPUS,
                    SOURCE_SEMANTIC, SOURCE_TRIGRAM, DraftTree)
from .adjacency import AdjacencyDrafter
from .base import Drafter
from .branch import BranchDrafter
from .semantic import SemanticDrafter
from .suffix import SuffixConfig, SuffixDrafter
from .trigram import TrigramDrafter

GRAFT_RESERVE = 8                   # at most 8 slots of a proposal go to grafts
GRAFT_POINTS = 2                    # from the 2 most probable drafted leaves
GRAFT_MIN_CUM = 0.05                # whose path is at least this likely
GRAFT_DEPTH = 4
GRAFT_FROM = (SOURCE_TRIGRAM, SOURCE_ADJACENCY, SOURCE_BRANCH, SOURCE_SEMANTIC)
_GRAFT_FROM_MASK = np.isin(np.arange(N_SOURCES), GRAFT_FROM)
SCHEDULE_PROBE = 8                  # an idle part proposes again after 8 steps,
SCHEDULE_PROBE_MAX = 64             # doubling the wait after each failed probe, to 64
SCHEDULE_ALPHA = 0.1                # weight of the newest step in the moving averages
SCHEDULE_GAIN0 = 1.0                # parts start trusted (1 accepted token per step)
ENTROPY_TOPK = 8                    # entropy of the model's top-8 distribution
ENTROPY_MAX = float(np.log(ENTROPY_TOPK))
ENTROPY_BUCKETS = 5
ENTROPY_WINDOW = 4                  # committed positions in the recent mean


@dataclass
class HybridConfig:
    """Which components run, and the largest merged proposal."""
    suffix: bool = True
    trigram: bool = True
    adjacency: bool = True
    ema: bool = True
    entropy: bool = True
    schedule: bool = True
    branch: bool = True
    aasd: bool = False      # opt-in (auto+aasd): ~17% more prefill time, no decode gain measured on CPU
    semantic: bool = True
    graft: bool = True
    max_nodes: int = 64

    def __post_init__(self):
        if not (self.suffix or self.trigram or self.adjacency or self.branch or self.aasd or self.semantic):
            raise ValueError("HybridConfig: enable at least one component")
        if isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, (int, np.integer)) \
                or self.max_nodes < 1:
            raise ValueError(f"HybridConfig.max_nodes must be an integer >= 1, got {self.max_nodes!r}")
        self.max_nodes = int(self.max_nodes)


class HybridDrafter(Drafter):
    """suffix, semantic, branch, trigram, adjacency: merged in that priority order.

    ``HybridDrafter(n_vocab, corpora=(), config=None, model_path=None,
    embeddings=None)``: the semantic fallback compares tokens by the model's
    own embeddings, read from ``model_path`` (a GGUF) or given as a
    TokenEmbeddings; with neither it is left out."""

    name = "auto"

    def __init__(self, n_vocab: int, corpora=(), config: HybridConfig | None = None,
                 model_path: str | None = None, embeddings=None):
        self.config = c = config if config is not None else HybridConfig()
        self.parts: list[Drafter] = []
        self._suffix = None
        if c.suffix:
            self._suffix = SuffixDrafter(SuffixConfig(position_ema=c.ema), corpora=corpora)
            self.parts.append(self._suffix)
        if c.semantic and (embeddings is not None or model_path is not None):
            if embeddings is None:
                from ..embeddings import TokenEmbeddings
                embeddings = TokenEmbeddings(model_path)
            self.parts.append(SemanticDrafter(embeddings, max_nodes=c.max_nodes))
        self.prefill_topk = 0
        if c.branch or c.aasd:
            br = BranchDrafter(aasd=c.aasd, branch=c.branch, max_nodes=c.max_nodes)
            self.parts.append(br)
            self.prefill_topk = br.prefill_topk
        if c.trigram:
            self.parts.append(TrigramDrafter(n_vocab, corpora=corpora))
        if c.adjacency:
            self.parts.append(AdjacencyDrafter(n_vocab, corpora=corpora))
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
        # schedule: per part, sources, EMA of contributed tokens and of propose time
        srcs = {SuffixDrafter: (SOURCE_CONTEXT, SOURCE_CORPUS), TrigramDrafter: (SOURCE_TRIGRAM,),
                AdjacencyDrafter: (SOURCE_ADJACENCY,), BranchDrafter: (SOURCE_BRANCH,),
                SemanticDrafter: (SOURCE_SEMANTIC,)}
        self._sources = [srcs[type(p)] for p in self.parts]
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

    def warmup(self) -> None:
        for p in self.parts:
            p.warmup()
        t = DraftTree(np.array([5, 6], np.int32), np.array([-1, 0], np.int32),
                      np.array([0.5, 0.5], np.float32), np.array([0, 0], np.int8))
        if self._entropy:
            from ..kernels import topk
            topk.warmup()
        a, b = self._buf
        merge_trees(t.tokens, t.parents, t.probs, t.source, 2, t.tokens, t.parents, t.probs, t.source, 2,
                    4, a[0], a[1], a[2], a[3])

    def begin(self, prompt: np.ndarray) -> None:
        for p in self.parts:
            p.begin(prompt)
        self._hn = 0
        self._hmean = 0.0
        self._ent_last = (-1, 1.0)

    def observe_prefill(self, start, topk_tokens, topk_logits) -> None:
        for p in self.parts:
            if p.prefill_topk:
                p.observe_prefill(start, topk_tokens, topk_logits)

    def observe(self, result) -> None:
        nxt = self._n_steps + 1
        idle, proposed, probe, wants = self._idle, self._proposed, self._next_probe, self._wants
        for i, p in enumerate(self.parts):
            # an idle part observes only around its probes
            if wants[i] and not (idle[i] and not proposed[i] and nxt < probe[i]):
                p.observe(result)
        if self._entropy:
            self._observe_entropy(result)
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
        for i, p in enumerate(self.parts):
            if self._idle[i] and self._n_steps < self._next_probe[i]:
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
        if cur[0] is self._buf[0][0] or cur[0] is self._buf[1][0]:    # merged: out of the scratch buffers
            tree = (cur[0][:m].copy(), cur[1][:m].copy(), cur[2][:m].copy(), cur[3][:m].copy())
        else:                   # one part's own proposal (its arrays are the part's fresh copies)
            tree = cur[:4]
        if self.config.graft and drafted:
            tree = self._graft(context, *tree, budget)
        return DraftTree.raw(*tree)

    # --------------------------------------------------------------- graft
    def _graft(self, context, tok, par, pr, src, budget):
        """Graft's prune-then-graft: retrieval continued from the best drafted leaves.

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
