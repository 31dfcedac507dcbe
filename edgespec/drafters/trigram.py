"""The `trigram` drafter: edgespec's variant of ADED (adaptive draft-verification),
and, with ``aded``, ADED as published (drafters/papers/aded.py).

A tri-gram model P(w3 | w1, w2) built from compiled corpora and adapted online
to the tokens of the current conversation, searched by Monte Carlo tree search
(PUCT) for the most promising continuations of the context's last two tokens.

Model (formula in ``edgespec.kernels.trigram.successors``): the corpus counts,
merged over all corpora at construction, give a prior; an *overlay* counts the
tri-grams (and bi-grams) of the most recent ``window`` tokens the drafter saw
(the prompt at ``begin()``, the accepted tokens at ``observe()``), each
occurrence raising a count by ``increment`` up to ``cap``, and occurrences that
leave the window are taken back.  The two are mixed as a Dirichlet posterior,
``P = (o + kappa * base) / (O + kappa)``.  Unknown (w1, w2) contexts back off
to bi-grams.  With no corpus the overlay alone drives the drafter.

The overlay persists across requests (that is the adaptation); the window
bounds how far back it remembers.

The search values a simulated path by the sum of its nodes' cumulative
probabilities, without a rollout, and drafts the most-visited nodes
(kernels/trigram.py `mcts_draft`).  ADED's paper differs on each point: its
matrix is Eq. (1) without the tri-grams seen fewer than t = 12 times, adjusted
by Adjust3Gram (raised by an increment up to maxProb, no decay), and its
search (Algorithm 1) rolls out to depth l, scores a path 1 + the sum of its
tri-gram values and drafts the n = 24 best sentences: ``aded`` switches all of
that on (drafters/papers/aded.py, imported only with ``aded`` or a
``min_count`` above 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.kernels import trigram as _k
from edgespec.drafters.tree import SOURCE_TRIGRAM, DraftTree
from edgespec.drafters.base import Drafter

ADED_MIN_COUNT = 12
"""ADED's t: "the threshold for the elimination of tri-gram probability"."""


@dataclass
class TrigramConfig:
    """Settings of the trigram drafter (search settings from the ADED paper:
    s = 150 iterations, l = 4, c1 = 32, c2 = 8, n = 24 sentences)."""

    iterations: int = 150
    """MCTS simulations per proposal."""

    max_depth: int = 4
    """Deepest draft node (tokens after the root)."""

    candidates: int = 24
    """Successors considered per node: an expanded node gets at most this many
    children, the most probable (with ``aded``: every matrix successor, up to
    this many; the paper's n = 24 is ``sequences``)."""

    c1: float = 32.0
    """PUCT exploration constant C1 in E = C1 + log((sum N + C2 + 1) / C2)."""

    c2: float = 8.0
    """PUCT constant C2 (> 0)."""

    max_nodes: int = 64
    """Upper bound on the nodes of one proposal (the engine's budget may be
    lower)."""

    window: int = 4096
    """The overlay counts the n-grams of this many most recent tokens."""

    increment: int = 1
    """Overlay count added per observed occurrence."""

    cap: int = 16
    """Largest effective overlay count of one (context, successor)."""

    overlay_slots: int = 8
    """Successors with their own overlay count per context; further distinct
    successors count only in the context's total (they lower the others'
    probabilities but are not proposed)."""

    prior_weight: float = 1.0
    """kappa: strength of the corpus (or backoff) prior against the overlay's
    counts, in overlay count units.  One overlay occurrence of an otherwise
    unknown tri-gram gives it probability 1 / (1 + kappa)."""

    backoff_weight: float = 0.5
    """beta: bi-gram probabilities are multiplied by this when they stand in
    for an unknown tri-gram context (a bi-gram predicts worse)."""

    aded: bool = False
    """ADED as published (drafters/papers/aded.py): the matrix of Eq. (1) without the
    tri-grams counted fewer than t times, Adjust3Gram instead of the windowed
    overlay, and Algorithm 1's search (rollout, a path scored 1 + the sum of
    its tri-gram values, the best ``sequences`` sentences drafted as a tree).
    window, increment, cap, overlay_slots, prior_weight and backoff_weight are
    then unused."""

    rollout: bool = True
    """With ``aded``: Algorithm 1's simulation (off: a path's score stops at
    the expanded node)."""

    adjust: bool = True
    """With ``aded``: Adjust3Gram before each search (off: the corpus matrix
    stays fixed, the paper's non-adaptive ablation)."""

    sequences: int = 24
    """With ``aded``: n, the best sentences drafted."""

    min_count: int = 0
    """t: corpus tri-grams counted fewer than t times are dropped when the
    corpora are loaded; 0 is the form's own (12 with ``aded``, else 1: keep
    all)."""

    adjust_length: int = 1024
    """With ``aded``: Adjust3Gram's maxLength, the last tokens of the input
    whose tri-grams are raised before each search (not given by the paper:
    Figure 2 updates the matrix from the input tokens, and the whole input is
    re-read every step, so this bounds that work; a typical prompt fits)."""

    adjust_increment: float = 0.1
    """With ``aded``: Adjust3Gram's increment (not given by the paper)."""

    adjust_max_prob: float = 1.0
    """With ``aded``: Adjust3Gram's maxProb (not given by the paper)."""

    seed: int = 0
    """With ``aded``: the rollout's random generator starts from this at every
    search (Algorithm 1, line 1)."""

    @property
    def trigram_min_count(self) -> int:
        """The effective t (see ``min_count``)."""
        return self.min_count or (ADED_MIN_COUNT if self.aded else 1)

    def __post_init__(self):
        for name in ("iterations", "max_depth", "candidates", "max_nodes", "window",
                     "increment", "cap", "overlay_slots", "sequences", "adjust_length",
                     "min_count", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"TrigramConfig.{name} must be an integer, got {v!r}")
            lo = 0 if name in ("min_count", "seed") else 1
            if v < lo:
                raise ValueError(f"TrigramConfig.{name} must be >= {lo}, got {v}")
            setattr(self, name, int(v))
        for name in ("aded", "rollout", "adjust"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"TrigramConfig.{name} must be a bool, got {getattr(self, name)!r}")
            setattr(self, name, bool(getattr(self, name)))
        self._check_numbers()

    def _check_numbers(self):
        for name in ("c1", "c2", "prior_weight", "backoff_weight", "adjust_increment",
                     "adjust_max_prob"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise ValueError(f"TrigramConfig.{name} must be a number, got {v!r}")
            v = float(v)
            if not np.isfinite(v):
                raise ValueError(f"TrigramConfig.{name} must be finite, got {v}")
            setattr(self, name, v)
        if self.c1 < 0:
            raise ValueError(f"TrigramConfig.c1 must be >= 0, got {self.c1}")
        if self.c2 <= 0:
            raise ValueError(f"TrigramConfig.c2 must be > 0, got {self.c2}")
        if self.prior_weight <= 0:
            raise ValueError(f"TrigramConfig.prior_weight must be > 0, got {self.prior_weight}")
        if not 0 <= self.backoff_weight <= 1:
            raise ValueError(
                f"TrigramConfig.backoff_weight must be in [0, 1], got {self.backoff_weight}")
        if self.cap < self.increment:
            raise ValueError(
                f"TrigramConfig.cap ({self.cap}) must be >= increment ({self.increment})")
        if not 0 < self.adjust_increment <= self.adjust_max_prob <= 1:
            raise ValueError("TrigramConfig: need 0 < adjust_increment <= adjust_max_prob <= 1, got "
                             f"{self.adjust_increment} and {self.adjust_max_prob}")


# --------------------------------------------------------------------------
# corpus tables


def _readonly(a, dtype):
    """A contiguous read-only view (or copy, if the dtype differs) of a: every
    corpus array reaches numba with the same type, memmap or not."""
    a = np.ascontiguousarray(a, dtype=dtype)
    v = a.view()
    v.flags.writeable = False
    return v


_TABLES = ("tri_w1_offsets", "tri_w2", "tri_ctx_count", "tri_offsets", "tri_next", "tri_count",
           "adj_next", "adj_count")


def _empty_tables(V):
    return dict(
        tri_w1_offsets=np.zeros(V + 1, np.int32), tri_w2=np.zeros(0, np.int32),
        tri_ctx_count=np.zeros(0, np.uint32), tri_offsets=np.zeros(1, np.int32),
        tri_next=np.zeros(0, np.int32), tri_count=np.zeros(0, np.uint32),
        adj_next=np.full((V, 0), -1, np.int32), adj_count=np.zeros((V, 0), np.uint32))


def _clip_u32(x):
    return np.minimum(x, np.iinfo(np.uint32).max).astype(np.uint32)


def merge_corpora(corpora, n_vocab: int) -> dict:
    """One set of tri-gram / bi-gram tables (the spec's array names) for
    several corpora: counts of equal n-grams are summed, successors re-sorted
    count descending (ties token ascending).  Nothing is pruned (a row keeps
    the union of its corpora's successors; the bi-gram rows get K = the sum of
    the corpora's K_adj).  One corpus is used as it is (no copy)."""
    V = int(n_vocab)
    if len(corpora) == 0:
        return _empty_tables(V)
    if len(corpora) == 1:
        c = corpora[0]
        return {name: getattr(c, name) for name in _TABLES}

    return {**_merge_trigrams(corpora, V), **_merge_bigrams(corpora, V)}


def _merge_trigrams(corpora, V: int) -> dict:
    """The tri-gram tables of several corpora in one: every corpus flattened
    to (context key, w3, count) rows, equal rows summed, re-sorted."""
    ctx_keys, ctx_counts, ent_ctx, ent_w3, ent_cnt = [], [], [], [], []
    for c in corpora:
        w1 = np.repeat(np.arange(V, dtype=np.int64), np.diff(np.asarray(c.tri_w1_offsets)))
        key = w1 * V + np.asarray(c.tri_w2, np.int64)
        ctx_keys.append(key)
        ctx_counts.append(np.asarray(c.tri_ctx_count, np.int64))
        ent_ctx.append(np.repeat(key, np.diff(np.asarray(c.tri_offsets))))
        ent_w3.append(np.asarray(c.tri_next, np.int64))
        ent_cnt.append(np.asarray(c.tri_count, np.int64))
    ctx_key, inv = np.unique(np.concatenate(ctx_keys), return_inverse=True)
    ctx_count = np.bincount(inv, weights=np.concatenate(ctx_counts), minlength=len(ctx_key))
    e_ctx, e_w3, e_cnt = (np.concatenate(x) for x in (ent_ctx, ent_w3, ent_cnt))
    order = np.lexsort((e_w3, e_ctx))
    e_ctx, e_w3, e_cnt = e_ctx[order], e_w3[order], e_cnt[order]
    start = np.ones(len(e_ctx), bool)
    start[1:] = (e_ctx[1:] != e_ctx[:-1]) | (e_w3[1:] != e_w3[:-1])
    heads = np.flatnonzero(start)
    e_ctx, e_w3 = e_ctx[heads], e_w3[heads]
    e_cnt = np.add.reduceat(e_cnt, heads) if len(heads) else e_cnt[:0]
    order = np.lexsort((e_w3, -e_cnt, e_ctx))
    e_ctx, e_w3, e_cnt = e_ctx[order], e_w3[order], e_cnt[order]
    row = np.searchsorted(ctx_key, e_ctx)
    tri_offsets = np.zeros(len(ctx_key) + 1, np.int64)
    np.cumsum(np.bincount(row, minlength=len(ctx_key)), out=tri_offsets[1:])
    tri_w1_offsets = np.searchsorted(ctx_key // V, np.arange(V + 1))
    return dict(
        tri_w1_offsets=tri_w1_offsets.astype(np.int32), tri_w2=(ctx_key % V).astype(np.int32),
        tri_ctx_count=_clip_u32(ctx_count.astype(np.int64)),
        tri_offsets=tri_offsets.astype(np.int32), tri_next=e_w3.astype(np.int32),
        tri_count=_clip_u32(e_cnt))


def _merge_bigrams(corpora, V: int) -> dict:
    """The bi-gram tables of several corpora in one: the union of the rows,
    summed, the top sum(K) per token."""
    k_out = sum(int(np.shape(c.adj_next)[1]) for c in corpora)
    rows, nxt, cnt = [], [], []
    for c in corpora:
        an = np.asarray(c.adj_next, np.int64)
        ok = an >= 0
        rows.append(np.nonzero(ok)[0])
        nxt.append(an[ok])
        cnt.append(np.asarray(c.adj_count, np.int64)[ok])
    key = np.concatenate(rows) * V + np.concatenate(nxt)
    ukey, inv = np.unique(key, return_inverse=True)
    ucnt = np.bincount(inv, weights=np.concatenate(cnt), minlength=len(ukey)).astype(np.int64)
    urow, unxt = ukey // V, ukey % V
    order = np.lexsort((unxt, -ucnt, urow))
    urow, unxt, ucnt = urow[order], unxt[order], ucnt[order]
    rank = np.arange(len(urow)) - np.searchsorted(urow, urow)
    adj_next = np.full((V, k_out), -1, np.int32)
    adj_count = np.zeros((V, k_out), np.uint32)
    adj_next[urow, rank] = unxt
    adj_count[urow, rank] = _clip_u32(ucnt)
    return dict(adj_next=adj_next, adj_count=adj_count)


def _corpus_bundle(tables: dict, V: int):
    """The kernels' corpus tuple: the tables read-only, plus bi_total[w2]
    (how often w2 was followed by some token, counted from the tri-gram
    contexts whose second token is w2; at least the bi-gram row's sum)."""
    t = {k: _readonly(v, np.int32 if v.dtype.kind == "i" else np.uint32)
         for k, v in tables.items()}
    bi_total = np.bincount(t["tri_w2"], weights=t["tri_ctx_count"].astype(np.float64),
                           minlength=V)[:V]
    bi_total = np.maximum(bi_total, t["adj_count"].sum(axis=1, dtype=np.float64))
    return (t["tri_w1_offsets"], t["tri_w2"], t["tri_ctx_count"], t["tri_offsets"],
            t["tri_next"], t["tri_count"], t["adj_next"], t["adj_count"],
            _readonly(bi_total, np.float64))


# --------------------------------------------------------------------------
# the drafter


def _overlay_arrays(window: int, slots: int):
    """Fresh overlay hash table, ring and state (see the kernel module doc)."""
    h = 1
    while h < 4 * window:
        h *= 2
    ov = (np.full(h, -1, np.int64), np.zeros(h, np.int32),
          np.full((h, slots), -1, np.int32), np.zeros((h, slots), np.int32))
    ring = (np.full(window, -1, np.int64), np.full(window, -1, np.int64),
            np.full(window, -1, np.int32), np.zeros(window, np.int8))
    state = np.array([0, -1, -1], np.int64)
    return ov, ring, state


class TrigramDrafter(Drafter):
    """ADED: an adaptive tri-gram model searched by MCTS.

    ``TrigramDrafter(n_vocab, corpora=(), config=None)``; corpora are
    ``edgespec.corpus.format.Corpus`` objects (anything with the spec's tri_* and
    adj_* arrays and ``n_vocab``), merged once here (then the tri-grams under
    the count threshold t dropped).

    Proposals: up to ``min(budget, max_nodes)`` nodes, most-visited first
    (parents before children, so any prefix is a valid tree); probs are the
    nodes' conditional probabilities under the mixed model.  With ``aded``
    the published form drafts instead (drafters/papers/aded.py, ``AdedSearch``).
    """

    name = "trigram"
    sources = (SOURCE_TRIGRAM,)

    def __init__(self, n_vocab: int, corpora=(), config: TrigramConfig | None = None):
        self.config = config if config is not None else TrigramConfig()
        c = self.config
        V = int(n_vocab)
        if V < 1:
            raise ValueError(f"n_vocab must be >= 1, got {n_vocab}")
        corpora = tuple(corpora)
        for corp in corpora:
            if int(corp.n_vocab) != V:
                raise ValueError(f"corpus n_vocab {corp.n_vocab} differs from the model's {V}")
        self.n_vocab = V
        tables = merge_corpora(corpora, V)
        if c.trigram_min_count > 1:     # ADED's t (edgespec's variant's too, when set)
            from edgespec.drafters.papers.aded import drop_rare_trigrams
            tables = drop_rare_trigrams(tables, c.trigram_min_count)
        self._corpus = _corpus_bundle(tables, V)
        self._aded = None
        if c.aded:
            from edgespec.drafters.papers.aded import AdedSearch
            self._aded = AdedSearch(self._corpus, V, c)
        self._ov, self._ring, self._state = _overlay_arrays(c.window, c.overlay_slots)
        self._mix = (V, c.prior_weight, c.backoff_weight, c.increment, c.cap)
        self._search = (c.iterations, c.max_depth, c.candidates, c.c1, c.c2)
        self._alloc_search()

    def _alloc_search(self):
        c = self.config
        row_len = np.diff(self._corpus[3])
        n_cand = (int(row_len.max()) if len(row_len) else 0) + self._corpus[6].shape[1] \
            + 2 * c.overlay_slots
        cap = 1 + c.iterations * c.candidates
        self._nodes = (np.zeros(cap, np.int32), np.zeros(cap, np.int32), np.zeros(cap, np.int32),
                       np.zeros(cap, np.int32), np.zeros(cap, np.int32), np.zeros(cap, np.float64),
                       np.zeros(cap, np.float64), np.zeros(cap, np.int32), np.zeros(cap, np.float64))
        self._cand = (np.zeros(c.candidates, np.int32), np.zeros(c.candidates, np.float64),
                      np.zeros(n_cand, np.int32), np.zeros(n_cand, np.float64),
                      np.zeros(n_cand, np.float64))
        self._path = np.zeros(c.max_depth + 1, np.int32)
        self._sel_idx = np.zeros(c.max_nodes, np.int32)
        self._sel_key = np.zeros(c.max_nodes, np.float64)
        self._new_index = np.zeros(cap, np.int32)
        self._tokens = np.zeros(c.max_nodes, np.int32)
        self._parents = np.zeros(c.max_nodes, np.int32)
        self._probs = np.zeros(c.max_nodes, np.float32)
        self._source = np.full(c.max_nodes, SOURCE_TRIGRAM, np.int8)

    # -- interface ---------------------------------------------------------

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        c = self.config
        max_out = min(int(budget), c.max_nodes)
        n = len(context)
        if max_out <= 0 or n == 0:
            return DraftTree.empty()
        w2 = int(context[-1])
        w1 = int(context[-2]) if n >= 2 else -1
        if self._aded is not None:
            return self._aded.propose(w1, w2, max_out)
        m = _k.mcts_draft(self._corpus, self._ov, self._mix, w1, w2, self._search,
                          self._nodes, self._cand, self._path, max_out, self._tokens,
                          self._parents, self._probs, self._sel_idx, self._sel_key,
                          self._new_index)
        if m == 0:
            return DraftTree.empty()
        return DraftTree(self._tokens[:m].copy(), self._parents[:m].copy(),
                         self._probs[:m].copy(), self._source[:m].copy())

    def begin(self, prompt: np.ndarray) -> None:
        """Feed the prompt to the overlay as a new stream (its first tokens
        form no n-grams with what came before).  The whole prompt is fed
        (about 0.2 us a token): which successors hold a slot depends on the
        order of arrival, also before the window.  With ``aded``: Adjust3Gram
        over the prompt's last tokens, the input of the first search."""
        if self._aded is not None:
            self._aded.adjust(prompt)
            return
        self._state[1] = self._state[2] = -1
        p = np.ascontiguousarray(prompt, dtype=np.int32)
        _k.overlay_feed(self._ov, self._ring, self._state, p, len(p), self.n_vocab)

    def observe(self, result) -> None:
        """Feed the tokens this step appended; the two tokens before them are
        taken from ``result.context`` when it has them (so the stream stays
        right even if begin() was not called).  With ``aded``: Adjust3Gram over
        the context's last tokens, the input of the next search."""
        if self._aded is not None:
            self._aded.adjust(np.asarray(result.context))
            return
        acc = np.ascontiguousarray(result.accepted, dtype=np.int32)
        k = len(acc)
        if k == 0:
            return
        ctx = result.context
        if len(ctx) >= k + 2:
            self._state[1] = int(ctx[-k - 2])
            self._state[2] = int(ctx[-k - 1])
        elif len(ctx) == k + 1:
            self._state[1] = -1
            self._state[2] = int(ctx[0])
        _k.overlay_feed(self._ov, self._ring, self._state, acc, k, self.n_vocab)

    def reset(self) -> None:
        """Forget everything the overlay (or Adjust3Gram) learned."""
        c = self.config
        if self._aded is not None:
            self._aded.reset()
        self._ov, self._ring, self._state = _overlay_arrays(c.window, c.overlay_slots)

    def warmup(self) -> None:
        """Compile (or load from numba's cache) every kernel with the exact
        argument types of this instance, on a scratch overlay (the real one
        is left untouched)."""
        c = self.config
        if self._aded is not None:
            self._aded.warmup()
            return
        ov, ring, state = _overlay_arrays(4, c.overlay_slots)
        toks = np.array([1, 2, 3, 1, 2, 3, 1, 2, 4, 1], np.int32) % self.n_vocab
        _k.overlay_feed(ov, ring, state, toks, len(toks), self.n_vocab)
        _k.successors(self._corpus, ov, int(toks[-2]), int(toks[-1]), self._mix,
                      c.candidates, *self._cand)
        _k.mcts_draft(self._corpus, ov, self._mix, int(toks[-2]), int(toks[-1]), self._search,
                      self._nodes, self._cand, self._path, c.max_nodes, self._tokens,
                      self._parents, self._probs, self._sel_idx, self._sel_key,
                      self._new_index)
        _k.puct_score(0.5, 0.5, 1, 2.0, c.c1, c.c2)

    # -- inspection (tests, debugging; not the hot path) -------------------

    def distribution(self, w1: int, w2: int, k: int | None = None) -> dict[int, float]:
        """The mixed model's k most probable successors of (w1, w2) (w1 = -1:
        one-token context), as {token: probability}; with ``aded`` the
        matrix's entries (Eq. 1 as adjusted)."""
        k = self.config.candidates if k is None else int(k)
        if self._aded is not None:
            return self._aded.distribution(w1, w2, k)
        n_cand = self._cand[2].shape[0]
        out_tok = np.zeros(max(k, 1), np.int32)
        out_p = np.zeros(max(k, 1), np.float64)
        m = _k.successors(self._corpus, self._ov, int(w1), int(w2), self._mix, k, out_tok, out_p,
                          np.zeros(n_cand, np.int32), np.zeros(n_cand, np.float64),
                          np.zeros(n_cand, np.float64))
        return {int(t): float(p) for t, p in zip(out_tok[:m], out_p[:m])}

    def overlay_table(self) -> dict:
        """The overlay's raw window counts: {context: (total, {successor:
        count})} with context (w1, w2) for tri-grams and (w2,) for bi-grams."""
        V = self.n_vocab
        h_key, h_total, h_succ, h_cnt = self._ov
        out = {}
        for i in np.flatnonzero(h_key >= 0):
            key = int(h_key[i])
            ctx = (key - V * V,) if key >= V * V else (key // V, key % V)
            succ = {int(t): int(n) for t, n in zip(h_succ[i], h_cnt[i]) if t >= 0}
            out[ctx] = (int(h_total[i]), succ)
        return out
