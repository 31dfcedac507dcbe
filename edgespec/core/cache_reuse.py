"""Cache reuse by shifting (Request.cache_reuse): the one inexact way a prompt reuses cached cells.

An editor's successive fill-in-the-middle prompts differ at the cursor, and
the cursor stands before the suffix: the cached tokens are C = A + Y + B + R
and the new prompt P = A + X + B + T, where A is the common prefix, Y what
the edit removed, X what it inserted, B a chunk of the cache equal to P's
text after the edit and T the rest of P (at least its last token, whose
logits choose the first token).  The exact path (core/prefix_cache.py) keeps
A and prefills X + B + T.  A splice keeps A's cells, drops Y's and R's,
moves B's cells len(X) - len(Y) positions (the backend's splice: llama.cpp
rotates their keys to the new positions), decodes X between them and
prefills T after them.  B's cells were computed after Y, not after X, so
the answer may differ from exact decoding: it is opt-in (cache_reuse 0, the
default, never splices) and labelled (GenerationResult.n_shifted_tokens;
the server's timings.cache_shifted_n).

`find_splice` is the matching, a pure function of two token arrays: the
longest chunk B of at least min_chunk tokens, found through windows of
min_chunk tokens that occur in both, grown while the tokens agree (a window
the cache holds more than MAX_OCCURRENCES times anchors nothing, so a chunk
made only of such windows, a long run of one repeated line, is missed, and
of MAX_CANDIDATES anchored chunks the longest is taken).  `splice_request` applies
it to what a backend holds at a request's start (core/engine.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgespec.core.prefix_cache import common_prefix

if TYPE_CHECKING:
    from edgespec.core.request import RunState

MAX_OCCURRENCES = 8     # a window held more often than this in the cache anchors no chunk
MAX_CANDIDATES = 8      # chunks checked and grown, the most anchored first
_RNG_SEED = 0x5EED      # the windows' hash weights: fixed, so a match does not depend on the run


@dataclass(frozen=True)
class Splice:
    """P = A + X + B + T against C = A + Y + B + R: A is n_prefix tokens, B
    n_chunk tokens from cache_start in C and prompt_start in P."""
    n_prefix: int
    cache_start: int
    prompt_start: int
    n_chunk: int

    @property
    def shift(self) -> int:
        """Positions B's cells move by: len(X) - len(Y)."""
        return self.prompt_start - self.cache_start

    @property
    def n_reused(self) -> int:
        """Prompt tokens whose cells are kept: A and B."""
        return self.n_prefix + self.n_chunk

    @property
    def n_held(self) -> int:
        """Prompt tokens in the cache after the splice: A, X and B."""
        return self.prompt_start + self.n_chunk


def _window_hashes(tokens: np.ndarray, k: int) -> np.ndarray:
    """A 64-bit hash of every window of k tokens (a random linear form,
    wrapping: equal windows hash equal; the caller checks a match exactly)."""
    w = np.random.default_rng(_RNG_SEED).integers(1, 2**63, size=k, dtype=np.uint64) | np.uint64(1)
    win = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.uint64), k)
    with np.errstate(over="ignore"):
        return win @ w


def _anchor_pairs(hc: np.ndarray, hp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(i, j): prompt window i hashes as cache window j, for prompt windows
    whose hash the cache holds 1..MAX_OCCURRENCES times."""
    order = np.argsort(hc, kind="stable")
    sorted_c = hc[order]
    lo = np.searchsorted(sorted_c, hp, "left")
    cnt = np.searchsorted(sorted_c, hp, "right") - lo
    cnt[cnt > MAX_OCCURRENCES] = 0
    i = np.repeat(np.arange(len(hp)), cnt)
    starts = np.repeat(lo - np.concatenate(([0], np.cumsum(cnt)[:-1])), cnt)
    return i, order[starts + np.arange(len(i))]


def _runs(i: np.ndarray, j: np.ndarray) -> list[tuple[int, int, int]]:
    """Anchor pairs grouped into runs (one diagonal, consecutive windows: one
    chunk), as (prompt start, cache start, windows), the most windows first,
    then the smallest shift; at most MAX_CANDIDATES of them."""
    d = j - i
    o = np.lexsort((i, d))
    i, d = i[o], d[o]
    start = np.ones(len(i), np.bool_)
    start[1:] = (d[1:] != d[:-1]) | (i[1:] != i[:-1] + 1)
    first = np.nonzero(start)[0]
    runs = np.diff(np.append(first, len(i)))
    best = np.lexsort((np.abs(d[first]), -runs))[:MAX_CANDIDATES]
    return [(int(i[first[r]]), int(i[first[r]] + d[first[r]]), int(runs[r])) for r in best]


def _extend(c: np.ndarray, p: np.ndarray, c0: int, p0: int, n: int) -> tuple[int, int, int]:
    """A match c[c0:c0+n] == p[p0:p0+n] grown both ways while the tokens agree
    (past windows that anchored nothing)."""
    m = min(c0, p0)
    if m:
        back = c[c0 - m:c0][::-1] != p[p0 - m:p0][::-1]
        k = int(np.argmax(back)) if back.any() else m
        c0, p0, n = c0 - k, p0 - k, n + k
    m = min(len(c) - c0 - n, len(p) - p0 - n)
    if m > 0:
        fwd = c[c0 + n:c0 + n + m] != p[p0 + n:p0 + n + m]
        n += int(np.argmax(fwd)) if fwd.any() else m
    return c0, p0, n


def find_splice(cached: np.ndarray, prompt: np.ndarray, min_chunk: int) -> Splice | None:
    """The splice of `prompt` against `cached` (the tokens a cache holds)
    that keeps the most cells: A their common prefix (all but the prompt's
    last token at most), B the longest chunk of at least min_chunk tokens
    that follows A in both and ends before the prompt's last token (ties:
    the smallest shift).  None when no such chunk is found."""
    cached, prompt = np.asarray(cached, np.int32), np.asarray(prompt, np.int32)
    k = int(min_chunk)
    if k < 1:
        raise ValueError("min_chunk must be >= 1")
    a = common_prefix(cached, prompt, len(prompt) - 1)
    c_reg, p_reg = cached[a:], prompt[a:len(prompt) - 1]
    if len(c_reg) < k or len(p_reg) < k:
        return None
    i, j = _anchor_pairs(_window_hashes(c_reg, k), _window_hashes(p_reg, k))
    best: tuple[int, int, int] | None = None
    for p0, c0, windows in (_runs(i, j) if len(i) else []):
        n = windows + k - 1
        if not np.array_equal(c_reg[c0:c0 + n], p_reg[p0:p0 + n]):      # a hash collision
            continue
        c0, p0, n = _extend(c_reg, p_reg, c0, p0, n)
        if best is None or (n, -abs(p0 - c0)) > (best[2], -abs(best[1] - best[0])):
            best = (p0, c0, n)
    return None if best is None else Splice(a, a + best[1], a + best[0], best[2])


def splice_request(backend, st: RunState, min_chunk: int) -> bool:
    """At a request's start, after the exact prefix reuse chose what the
    backend holds (st.n_common of it is the prompt's): splice those cells
    for st.prompt when find_splice finds a chunk (backend.splice: A kept, B
    shifted, X decoded, the rest dropped) and say whether it did.  Counts
    the shifted cells the prompt reads (st.n_shifted: the chunk's, and the
    reused prefix's past an earlier splice) and the tokens decoded between
    (st.n_spliced); st.n_common becomes the cells held (A + X + B), so the
    prefill reads T only.  The drafter gets no rankings of X: its prefill
    rows start after B (DrafterFeedback.prefilled with st.n_common)."""
    old = backend.spliced_from
    sp = find_splice(backend.kv_tokens[:backend.n_past], st.prompt, min_chunk)
    n_prefix = st.n_common if sp is None else sp.n_prefix
    st.n_shifted = max(0, n_prefix - old) if old is not None else 0
    if sp is None:
        return False
    backend.splice(sp.n_prefix, sp.cache_start, sp.n_chunk, st.prompt[sp.n_prefix:sp.prompt_start])
    st.n_shifted += sp.n_chunk
    st.n_spliced = sp.n_held - sp.n_reused
    st.n_common = sp.n_held
    return True
