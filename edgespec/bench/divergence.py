"""Divergences: where an edgespec method's greedy tokens first leave
`none`'s, and how close plain decoding was to choosing the method's token.

The record holds the first differing position and the logits plain decoding
gives there (re-decoded: the prompt prefilled and none's tokens decoded one
at a time, as `none` ran), as the gap between its top token and the method's
token.  The report sets each gap against the exactness self-check's largest
|logit difference|: a gap wider than twice that is no near-tie and points at
a bug.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def plain_logits_at(model, prompt_tokens, prefix) -> np.ndarray:
    """The logits plain decoding (`none`) has for the token after prompt +
    prefix, recomputed as `none` computed them: the prompt prefilled in one
    go (in n_batch chunks), then the prefix decoded one token at a time.
    Leaves the KV cache empty."""
    be = model.backend
    be.reset()
    try:
        be.prefill(np.asarray(prompt_tokens, np.int32))
        one = np.ones(1, np.int32)
        zero = np.zeros(1, np.int32)
        for t in prefix:
            be.decode_tree(np.array([t], np.int32), zero, zero, one, 1)
            be.keep(1)
        return be.logits()[0].astype(np.float64)
    finally:
        be.reset()


def divergence(model, prompt_tokens, ref: Sequence[int], other: Sequence[int], gbnf: str | None = None) -> dict | None:
    """Where `other` first leaves `ref` (none's greedy tokens), and how close
    plain decoding was to choosing other's token there: None when they are
    equal, else {"index", "none_token", "token" (None = the answer ended
    there), "gap": none's top logit minus the logit of other's choice (the
    best end-of-generation token's when other ended), "top2_gap", and
    "reproduced": whether the re-decoded argmax is none's token}.  With a
    grammar (gbnf) the logits are those of the tokens it admits there, as
    the constrained run chose among them: a gap is None where the grammar
    rejects other's choice, top2_gap None where it admits one token only."""
    ref, other = list(ref), list(other)
    if ref == other:
        return None
    n = min(len(ref), len(other))
    i = next((k for k in range(n) if ref[k] != other[k]), n)
    lg = plain_logits_at(model, prompt_tokens, ref[:i])
    if gbnf is not None:
        lg = _grammar_row(model.vocab, gbnf, ref[:i], lg)
    eog = model.backend.vocab.eog_mask()
    a = ref[i] if i < len(ref) else None
    b = other[i] if i < len(other) else None
    top = float(lg.max())
    b_logit = float(lg[b]) if b is not None else float(lg[eog].max())
    second = float(np.partition(lg, -2)[-2])
    best = int(lg.argmax())
    return {"index": i, "none_token": a, "token": b, "gap": _finite(top - b_logit), "top2_gap": _finite(top - second),
            "reproduced": best == a if a is not None else bool(eog[best])}


def _finite(x: float) -> float | None:
    return x if np.isfinite(x) else None


def _grammar_row(vocab, gbnf: str, prefix: Sequence[int], row: np.ndarray) -> np.ndarray:
    """A logits row with -inf at the tokens the grammar rejects after
    `prefix` (none's answer so far); the row unchanged when the grammar
    rejects a token of the prefix itself (then it says nothing here)."""
    from edgespec.backend.grammar import Grammar

    g = Grammar(vocab, gbnf)
    try:
        for t in prefix:
            if not g.allows(int(t)):
                return row
            g.accept(int(t))
        return g.mask(row.astype(np.float32)).astype(np.float64)
    finally:
        g.close()
