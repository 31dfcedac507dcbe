"""The `adjacency` drafter: Token Recycling.

The drafter keeps a table ``adj[V, k]`` of likely successors for every token in
the vocabulary. Every verification step computes the model's next-token
ranking at each committed slot anyway. The engine hands over the top k of each
(``Drafter.topk``), and ``observe()`` writes them into the row of the token
decoded there. Candidates that would otherwise be thrown away get reused
("recycled") the next time that token is the end of the context. To draft, the
drafter expands a fixed tree template from the last context token through the
table: node (parent, rank r) carries ``adj[parent token, r]``.

The table outlives requests (a warm table is the whole point). Rows the model
has not written yet can be seeded from compiled corpora (summed bi-gram counts)
and from the prompt's own bi-grams. Both kinds of seed rank below the model's
rows (see ``AdjacencyConfig.corpus_scale`` / ``prompt_scale``).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from edgespec.kernels import adjacency as _k
from edgespec.kernels import topk as _topk
from edgespec.drafters.tree import SOURCE_ADJACENCY, DraftTree
from edgespec.drafters.base import Drafter


def default_rank_probs(k: int) -> tuple[float, ...]:
    """The default score by rank: ``0.4 * (r + 1) ** -1.5`` (0.40, 0.14, 0.077,
    0.05, 0.036, 0.027, 0.022, 0.018 for k = 8; the sum stays below 1 for
    every k <= 32). Rank 0 is the model's argmax the last time it saw the
    parent token in *some* context. How often that is also the next token here
    depends on the text, and 0.4 is a starting guess. The engine's acceptance
    model calibrates each (source, score bucket) from what it observes."""
    return tuple(0.4 * (r + 1) ** -1.5 for r in range(k))


def best_rank_paths(rank_probs, n_nodes: int, max_depth: int) -> tuple[tuple[int, ...], ...]:
    """The ``n_nodes`` rank paths with the largest product of ``rank_probs``,
    of depth <= ``max_depth``, best first (ties: the smaller path first).

    A rank path (r1, ..., rd) is the node reached from the root by taking the
    r1-th successor, then the r2-th successor of that, and so on. It is
    enumerated best-first. Each path has one predecessor: the same path with
    its last rank lowered by one, or its parent when that rank is 0. Neither
    move can raise the product, so parents always come before children.
    """
    rp = [float(p) for p in rank_probs]
    out: list[tuple[int, ...]] = []
    if not rp or n_nodes <= 0 or max_depth <= 0:
        return ()
    def key(path):
        return -float(np.prod([rp[r] for r in path])), path

    heap = [key((0,))]
    while heap and len(out) < n_nodes:
        _, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < max_depth:
            heapq.heappush(heap, key(path + (0,)))
        if path[-1] + 1 < len(rp):
            heapq.heappush(heap, key(path[:-1] + (path[-1] + 1,)))
    return tuple(out)


@dataclass
class AdjacencyConfig:
    """Settings of the adjacency drafter."""

    k: int = 8
    """Row width: successors kept per token. It is also the top-k the engine
    computes at every committed slot. Each extra column costs about nothing
    in ``topk_rows``, but ranks beyond 8 are rarely accepted."""

    template: tuple | None = None
    """The fixed tree template as rank paths, e.g. ``((0,), (0, 0), (1,))``:
    the root's best successor, that token's best successor, the root's second
    best successor. Every path's parent (the path minus its last rank) must
    come earlier, and ranks must be < k. None: ``best_rank_paths`` with
    rank r weighted ``0.6 * (r + 1) ** -1.5`` (``template_nodes`` paths, depth
    <= ``template_depth``). This shape is deeper than the scores' own table.
    On the dev CPU, verifying T tokens costs about c(2) = 1.15, c(4) = 1.6,
    c(8) = 2.7 and c(16) = 4.9 one-token steps. At the default scores the cost
    gate keeps only the first node or two. Where the observed rank-0
    acceptance climbs to 0.6-0.9 (repetitive text), the best trees turn into
    rank-0 chains 2-5 deep with a few second choices near the root. The
    default template holds those (rank-0 chain to depth 6, second and third
    choices at the first levels), 24 nodes in all."""

    template_nodes: int = 24
    """Size of the generated default template (ignored when ``template`` is given)."""

    template_depth: int = 8
    """Depth limit of the generated default template."""

    rank_probs: tuple | None = None
    """Score of a node by its rank, an estimate of P(accepted | parent
    accepted). It must have k entries, each in [0, 1], non-increasing, with a
    sum <= 1. None: ``default_rank_probs(k)``."""

    corpus_scale: float = 0.5
    """Score factor for nodes read from a row seeded by corpus bi-grams. Such a
    row knows what usually follows the token, not what the model said after it
    in a real context, so its successors are less likely than a recycled
    row's. 0 stops drafting from such rows."""

    prompt_scale: float = 0.75
    """Score factor for nodes read from a row seeded by the prompt's bi-grams
    (in-context, but not the model's ranking). 0 stops drafting from them."""

    seed_prompt: bool = True
    """At ``begin()``, fill rows that nothing else has written (empty, or
    seeded by an earlier prompt) with the prompt's bi-grams, most recent
    successor first. Without it, a token that occurs in the prompt but was
    never generated drafts nothing until the model has decoded it once. Cost:
    about 12 us per 4000 prompt tokens."""

    def __post_init__(self):
        for name in ("k", "template_nodes", "template_depth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"AdjacencyConfig.{name} must be an integer, got {v!r}")
            if v < 1:
                raise ValueError(f"AdjacencyConfig.{name} must be >= 1, got {v}")
            setattr(self, name, int(v))
        if self.k > _topk.MAX_K:
            raise ValueError(f"AdjacencyConfig.k must be <= {_topk.MAX_K}, got {self.k}")
        for name in ("corpus_scale", "prompt_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
                    or not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"AdjacencyConfig.{name} must be a number in [0, 1], got {v!r}")
            setattr(self, name, float(v))
        if not isinstance(self.seed_prompt, (bool, np.bool_)):
            raise ValueError(f"AdjacencyConfig.seed_prompt must be a bool, got {self.seed_prompt!r}")
        self.seed_prompt = bool(self.seed_prompt)

        if self.rank_probs is None:
            self.rank_probs = default_rank_probs(self.k)
        try:
            rp = tuple(float(p) for p in self.rank_probs)
        except (TypeError, ValueError):
            raise ValueError(f"AdjacencyConfig.rank_probs must be numbers, got {self.rank_probs!r}") from None
        if len(rp) != self.k:
            raise ValueError(f"AdjacencyConfig.rank_probs needs k = {self.k} entries, got {len(rp)}")
        if any(not 0.0 <= p <= 1.0 for p in rp):
            raise ValueError(f"AdjacencyConfig.rank_probs must lie in [0, 1], got {rp}")
        if any(a < b for a, b in zip(rp, rp[1:])):
            raise ValueError(f"AdjacencyConfig.rank_probs must be non-increasing, got {rp}")
        if sum(rp) > 1.0 + 1e-6:
            raise ValueError(f"AdjacencyConfig.rank_probs must sum to <= 1, got {sum(rp):.3f}")
        self.rank_probs = rp

        if self.template is None:
            shape = [0.6 * (r + 1) ** -1.5 for r in range(self.k)]
            self.template = best_rank_paths(shape, self.template_nodes, self.template_depth)
        self.template = _check_template(self.template, self.k)


def _check_template(template, k: int) -> tuple[tuple[int, ...], ...]:
    """Normalise ``template`` to a tuple of int tuples, or raise ValueError."""
    try:
        paths = tuple(tuple(int(r) for r in p) for p in template)
    except (TypeError, ValueError):
        raise ValueError(f"AdjacencyConfig.template must be a sequence of rank paths, got {template!r}") from None
    if not paths:
        raise ValueError("AdjacencyConfig.template must not be empty")
    if len(paths) > 256:
        raise ValueError(f"AdjacencyConfig.template has {len(paths)} nodes; at most 256")
    seen = set()
    for p in paths:
        if not p:
            raise ValueError("AdjacencyConfig.template: a rank path must not be empty (the root is implicit)")
        if any(r < 0 or r >= k for r in p):
            raise ValueError(f"AdjacencyConfig.template: path {p} has a rank outside 0..{k - 1}")
        if p in seen:
            raise ValueError(f"AdjacencyConfig.template: path {p} appears twice")
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"AdjacencyConfig.template: path {p} comes before its parent {p[:-1]}")
        seen.add(p)
    return paths


def template_arrays(template) -> tuple[np.ndarray, np.ndarray]:
    """(parent index, rank) int32 arrays of a checked template of rank paths."""
    index = {p: i for i, p in enumerate(template)}
    parent = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in template], np.int32)
    rank = np.array([p[-1] for p in template], np.int32)
    return parent, rank


class AdjacencyDrafter(Drafter):
    """Token Recycling: proposes the template tree read from the successor table.

    ``adj`` (int32 [n_vocab, k], -1 = none) and ``origin`` (int8 [n_vocab],
    ``kernels.adjacency.ORIGIN_*``) are the table. Node scores are
    ``rank_probs[rank]`` times the origin factor of the row the node was read
    from (1 for rows the model wrote). Nodes come ordered by decreasing path
    score, parents before children, so any prefix of a proposal is a valid
    tree of its best nodes.

    corpora: compiled corpora (``edgespec.corpus.format.Corpus`` or anything with
    ``n_vocab``, ``adj_next`` int32 [V, W] and ``adj_count`` [V, W]). Their
    successor counts are summed per (token, successor) and the top k seed the
    table. With none, the table starts empty.
    """

    name = "adjacency"
    sources = (SOURCE_ADJACENCY,)
    topk = 8

    def __init__(self, n_vocab: int, corpora=(), config: AdjacencyConfig | None = None):
        if isinstance(n_vocab, bool) or not isinstance(n_vocab, (int, np.integer)) or n_vocab < 1:
            raise ValueError(f"n_vocab must be a positive integer, got {n_vocab!r}")
        self.n_vocab = int(n_vocab)
        self.config = config if config is not None else AdjacencyConfig()
        c = self.config
        self.topk = c.k
        self.adj = np.full((self.n_vocab, c.k), -1, np.int32)
        self.origin = np.zeros(self.n_vocab, np.int8)
        self._seed_from(list(corpora))
        self._seed_adj = self.adj.copy()
        self._seed_origin = self.origin.copy()

        self._tpl_parent, self._tpl_rank = template_arrays(c.template)
        self._rank_prob = np.array(c.rank_probs, np.float32)
        scale = np.zeros(_k.N_ORIGINS, np.float32)
        scale[_k.ORIGIN_CORPUS] = c.corpus_scale
        scale[_k.ORIGIN_PROMPT] = c.prompt_scale
        scale[_k.ORIGIN_MODEL] = 1.0
        self._scale = scale
        t = len(c.template)
        self._tokens = np.zeros(t, np.int32)
        self._parents = np.zeros(t, np.int32)
        self._probs = np.zeros(t, np.float32)
        self._source = np.full(t, SOURCE_ADJACENCY, np.int8)

    def _seed_from(self, corpora) -> None:
        nexts, counts = [], []
        for corpus in corpora:
            if int(corpus.n_vocab) != self.n_vocab:
                raise ValueError(f"corpus n_vocab {corpus.n_vocab} does not match the model's {self.n_vocab}")
            nx = np.asarray(corpus.adj_next)
            ct = np.asarray(corpus.adj_count)
            if nx.ndim != 2 or nx.shape != ct.shape or nx.shape[0] != self.n_vocab:
                raise ValueError(f"corpus adj_next / adj_count must both be [{self.n_vocab}, W], "
                                 f"got {nx.shape} and {ct.shape}")
            nexts.append(nx.astype(np.int32, copy=False))
            counts.append(ct.astype(np.int64))
        if not nexts:
            return
        _k.merge_seed_rows(np.ascontiguousarray(np.concatenate(nexts, axis=1)),
                           np.ascontiguousarray(np.concatenate(counts, axis=1)),
                           self.adj, self.origin)

    def reset(self) -> None:
        """Forget what the model and the prompts taught: back to the corpus seed."""
        self.adj[...] = self._seed_adj
        self.origin[...] = self._seed_origin

    def warmup(self) -> None:
        _k.warmup()
        _topk.warmup()

    def begin(self, prompt: np.ndarray) -> None:
        # The table is kept across requests; only still-unknown rows learn the
        # prompt's bi-grams.
        if self.config.seed_prompt:
            p = np.ascontiguousarray(prompt, dtype=np.int32)
            _k.seed_bigrams(self.adj, self.origin, p, p.shape[0])

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        # Measured after warm-up on the 2-core dev sandbox (Python 3.11, numba
        # 0.68), vocabulary 49152, default 24-node template, every row full:
        # 3.6 us for the whole 24-node proposal (1.2 us of it in the kernel,
        # 1.8 us building the DraftTree); 1.3 us when the root's row is empty.
        max_nodes = min(int(budget), len(self._tokens))
        if max_nodes <= 0 or len(context) == 0:
            return DraftTree.empty()
        m = _k.expand_template(self.adj, self.origin, self._scale, int(context[-1]),
                               self._tpl_parent, self._tpl_rank, self._rank_prob, max_nodes,
                               self._tokens, self._parents, self._probs)
        if m == 0:
            return DraftTree.empty()
        return DraftTree(self._tokens[:m].copy(), self._parents[:m].copy(),
                         self._probs[:m].copy(), self._source[:m].copy())

    def observe(self, result) -> None:
        # Measured as for propose(): 1 to 4 rows of width 8 -> 0.7 us.
        inp = result.topk_input
        n = len(inp)
        if n == 0:
            return
        _k.update_rows(self.adj, self.origin, np.ascontiguousarray(inp, dtype=np.int32),
                       np.ascontiguousarray(result.topk_tokens, dtype=np.int32), n)
