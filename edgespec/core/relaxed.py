"""The lossy verification modes' rules (opt-in, VerifyConfig.mode): which
draft tokens a relaxed mode accepts where they are not the model's own choice.

* "relaxed": ReSpec's source-aware relaxed verification with look-ahead
  tolerance (section 3.4): retrieved tokens in the model's top k within tau of
  its best log-probability, up to phi attempts a candidate, each kept when
  followed by m greedy matches or by a later attempt that is (a chain); the
  longest candidate wins.
* "entropy": AASD's conditional verification: prompt-retrieved and
  alignment-sampled tokens whose probability reaches
  delta = min(alpha H + beta, max P); the longest candidate whose tokens all
  pass, no look-ahead, no cap.
* "entropy_inv": edgespec's earlier rule (greedy first, then the retrieved
  child with probability >= eps exp(-H) and a look-ahead, capped per step).

relaxed_path decides the accepted path over a verified batch; the engine
commits it.  Nothing here runs in the exact (default) mode.
"""
from __future__ import annotations

import numpy as np

from edgespec.core.verify import VerifyConfig


def _entropy(row: np.ndarray) -> tuple[np.ndarray, float]:
    """(probabilities, entropy in nats) of softmax(row), in float64."""
    x = np.asarray(row, np.float64)
    x = x - x.max()
    p = np.exp(x)
    z = p.sum()
    p /= z
    return p, float(-(p * (x - np.log(z))).sum())


def aasd_threshold(row: np.ndarray, alpha: float, beta: float) -> float:
    """AASD's adaptive threshold delta = min(alpha * H + beta, max P)."""
    p, h = _entropy(row)
    return min(alpha * h + beta, float(p.max()))


def relaxed_accepts(row: np.ndarray, token: int, cfg: VerifyConfig) -> float:
    """Score of draft `token` under the relaxed rule at a position with logits
    `row`: a value > -inf (its log-probability gap to the best token, <= 0) when
    the rule accepts it, -inf otherwise."""
    row = np.asarray(row)
    best = float(row.max())
    v = float(row[token])
    if cfg.mode == "relaxed":
        if v < best - cfg.tau:
            return -np.inf
        if int(np.count_nonzero(row > v)) >= cfg.top_k:
            return -np.inf
        return v - best
    p, h = _entropy(row)
    if cfg.mode == "entropy":
        ok = p[token] >= min(cfg.alpha * h + cfg.beta, float(p.max()))
    else:   # entropy_inv
        ok = p[token] >= cfg.eps * np.exp(-h)
    return v - best if ok else -np.inf


class _Slots:
    """The verified batch as a tree (slot 0 the root), with the model's argmax
    and the relaxed rule's verdict per slot computed once, on demand."""

    def __init__(self, logits, parents, tokens, sources, cfg: VerifyConfig):
        self.logits, self.parents, self.tokens, self.sources, self.cfg = logits, parents, tokens, sources, cfg
        self.kids: list[list[int]] = [[] for _ in tokens]
        for t in range(1, len(tokens)):
            self.kids[parents[t]].append(t)        # batch order: likeliest child first
        self.relaxable = cfg.relax_sources
        self._top: dict[int, int] = {}
        self._ok: dict[int, bool] = {}

    def top(self, s: int) -> int:
        """The model's own token after slot s (argmax: ties to the lowest id)."""
        v = self._top.get(s)
        if v is None:
            v = self._top[s] = int(np.argmax(self.logits[s]))
        return v

    def greedy(self, t: int) -> bool:
        """Slot t carries the model's own token after its parent."""
        return self.tokens[t] == self.top(self.parents[t])

    def passes(self, t: int) -> bool:
        """Slot t's token passes verification: the model's own token, or a
        token of a relaxable source that the mode's rule accepts."""
        v = self._ok.get(t)
        if v is None:
            v = self.greedy(t) or (self.sources[t] in self.relaxable and
                                   relaxed_accepts(self.logits[self.parents[t]], self.tokens[t], self.cfg) > -np.inf)
            self._ok[t] = v
        return v

    def paths(self):
        """Every root-to-leaf path (slots below the root), in batch order."""
        stack: list[tuple[int, list[int]]] = [(0, [])]
        while stack:
            s, path = stack.pop()
            if not self.kids[s]:
                if path:
                    yield path
                continue
            for t in reversed(self.kids[s]):
                stack.append((t, path + [t]))


def _respec_accepted(sl: _Slots, path: list, m: int, phi: int) -> int:
    """ReSpec's look-ahead tolerance on one candidate: how many of its tokens
    are accepted.  l0 is the greedy-matched prefix; current = last = l0; up to
    phi relaxed attempts at `current`: a failed check ends the walk; a pass
    followed by xi >= m greedy matches moves last (and current) past them; a
    pass followed by fewer moves current one position on, so a chain of
    relaxed tokens is kept when a later attempt's look-ahead succeeds.
    Returns last."""
    n = len(path)
    last = 0
    while last < n and sl.greedy(path[last]):
        last += 1
    cur = last
    for _ in range(phi):
        if cur >= n or not sl.passes(path[cur]):
            break
        xi = 0
        while cur + 1 + xi < n and sl.greedy(path[cur + 1 + xi]):
            xi += 1
        if xi >= m:
            last = cur = cur + 1 + xi
        else:
            cur += 1
    return last


def _aasd_longest(sl: _Slots, s: int) -> tuple[int, int, list[int]]:
    """AASD: the longest path below slot s whose tokens all pass, as
    (length, relaxed tokens on it, slots); equal lengths: fewer relaxed
    tokens, then batch order."""
    best: tuple[int, int, list[int]] = (0, 0, [])
    for t in sl.kids[s]:
        if not sl.passes(t):
            continue
        n, r, p = _aasd_longest(sl, t)
        cand = (n + 1, r + (not sl.greedy(t)), [t] + p)
        if cand[0] > best[0] or (cand[0] == best[0] and cand[1] < best[1]):
            best = cand
    return best


def _inv_child(sl: _Slots, s: int) -> int:
    """entropy_inv: the child of s with the best relaxed score whose subtree
    continues with `lookahead` greedy matches, or -1."""
    cfg = sl.cfg
    best, best_c = -np.inf, -1
    for t in sl.kids[s]:
        if sl.sources[t] not in sl.relaxable:
            continue
        sc = relaxed_accepts(sl.logits[s], sl.tokens[t], cfg)
        if sc > best:
            best, best_c = sc, t
    s2 = best_c
    for _ in range(cfg.n_lookahead if best_c >= 0 else 0):
        s2 = next((t for t in sl.kids[s2] if sl.greedy(t)), -1)
        if s2 < 0:
            return -1
    return best_c


def _inv_path(sl: _Slots) -> list:
    """entropy_inv (edgespec's variant): greedy first; where no child carries
    the model's token, _inv_child, at most max_relaxed times a step (0 = no cap)."""
    cap = sl.cfg.max_relaxed or (1 << 30)
    path: list[int] = []
    s = n = 0
    while True:
        c = next((t for t in sl.kids[s] if sl.greedy(t)), -1)
        if c < 0 and n < cap:
            c = _inv_child(sl, s)
            n += c >= 0
        if c < 0:
            return path
        path.append(c)
        s = c


def relaxed_path(logits, parents: list, tokens: list, sources: list, cfg: VerifyConfig) -> list:
    """The batch slots of the drafts a relaxed mode accepts, root's child
    first: a path of the verified tree.  logits: one row per batch slot (slot
    0 the root, the pending token); parents, tokens, sources: per slot (the
    root's parent -1, its source unused).

    "relaxed" (ReSpec) and "entropy" (AASD) take the longest accepted
    candidate over the tree's root-to-leaf paths (AASD: "We accept the longest
    draft candidate that passes verification"; ReSpec returns "the longest
    path found"); among equally long ones, the one with fewer relaxed tokens,
    then the first in batch order (not given by the papers)."""
    sl = _Slots(logits, parents, tokens, sources, cfg)
    if cfg.mode == "entropy":
        return _aasd_longest(sl, 0)[2]
    if cfg.mode == "entropy_inv":
        return _inv_path(sl)
    best, best_key = [], (0, 0)
    for path in sl.paths():
        n = _respec_accepted(sl, path, cfg.n_lookahead, cfg.phi)
        key = (n, -sum(not sl.greedy(t) for t in path[:n]))
        if key > best_key:
            best, best_key = path[:n], key
    return best
