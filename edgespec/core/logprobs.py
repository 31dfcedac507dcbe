"""Per-token log-probabilities of an answer, and their API shapes.

The engine computes them from the logits rows it already has: the committed
token i of a step was chosen from batch row i (the root's row for the first
one, the row of the accepted draft before it for the next ones), and for a
verified draft that row is bit-identical to the row plain decoding computes
(see engine.py), so a drafted token's log-probability equals plain decoding's.
They are log_softmax of the model's raw logits: the distribution before
temperature, top-k, top-p and min-p, as llama-cpp-python and llama-server
report them.  Nothing is computed unless a request asks for them.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass

import numpy as np

from edgespec.errors import ConfigError

MAX_TOP_LOGPROBS = 20      # the most alternatives one position reports (OpenAI's limit)


@dataclass
class TokenLogprob:
    """One generated token: its id, its log-probability under the model and the
    model's `n` likeliest tokens there as (id, log-probability), likeliest first
    (ties by ascending id)."""
    token: int
    logprob: float
    top: list


def check_top(n) -> None:
    """Raise ConfigError unless n is None (no log-probabilities) or 0..MAX_TOP_LOGPROBS."""
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ConfigError(f"logprobs (alternatives per token) must be an integer in 0..{MAX_TOP_LOGPROBS} "
                          f"or None, got {n!r}")


def token_logprobs(rows: np.ndarray, tokens, n_top: int) -> list[TokenLogprob]:
    """TokenLogprobs of tokens[i] chosen from logits rows[i] (float32 [m, n_vocab]),
    vectorised over the rows, in float64."""
    m = len(tokens)
    if m == 0:
        return []
    x = np.asarray(rows[:m], np.float64)
    mx = x.max(axis=1, keepdims=True)
    lse = mx[:, 0] + np.log(np.exp(x - mx).sum(axis=1))
    tok = np.asarray(tokens, np.int64)
    chosen = (x[np.arange(m), tok] - lse).tolist()
    if not n_top:
        return [TokenLogprob(int(t), c, []) for t, c in zip(tok.tolist(), chosen)]
    n_top = min(n_top, x.shape[1])
    idx = np.argpartition(-x, n_top - 1, axis=1)[:, :n_top]
    vals = np.take_along_axis(x, idx, axis=1)
    order = np.lexsort((idx, -vals), axis=-1)          # likeliest first, ties by ascending id
    idx = np.take_along_axis(idx, order, axis=1)
    vals = np.take_along_axis(vals, order, axis=1) - lse[:, None]
    # a token whose logit is -inf (masked) is no alternative: JSON has no -Infinity
    return [TokenLogprob(int(t), c, [(a, b) for a, b in zip(i, v) if b != -np.inf])
            for t, c, i, v in zip(tok.tolist(), chosen, idx.tolist(), vals.tolist())]


class LogprobFormatter:
    """TokenLogprobs in the shapes of the OpenAI API (and llama-cpp-python's),
    for a whole answer or for its streamed pieces in order: it keeps the
    answer's decoded length, so text offsets run on across pieces.

    text_offset (legacy completions) counts characters from the start of the
    prompt text, as OpenAI and llama-cpp-python do: `base` is the prompt's
    length.  Token strings show special tokens by name (<|im_end|>)."""

    def __init__(self, vocab, base: int = 0):
        self.vocab = vocab
        self.offset = base
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _text(self, token: int) -> str:
        return self.vocab.token_text(token)

    def chat(self, entries: list | None) -> dict | None:
        """choices[].logprobs of a chat completion (or of one stream chunk)."""
        if entries is None:
            return None
        piece = self.vocab.piece
        content = []
        for e in entries:
            self._advance(e.token)
            top = [{"token": self._text(t), "logprob": v, "bytes": list(piece(t, special=True))} for t, v in e.top]
            content.append({"token": self._text(e.token), "logprob": e.logprob,
                            "bytes": list(piece(e.token, special=True)), "top_logprobs": top})
        return {"content": content, "refusal": None}

    def completion(self, entries: list | None) -> dict | None:
        """choices[].logprobs of a legacy text completion: tokens, token_logprobs,
        top_logprobs (a dict per token of the n likeliest and the chosen one)
        and text_offset."""
        if entries is None:
            return None
        d: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            d["text_offset"].append(self._advance(e.token))
            s = self._text(e.token)
            d["tokens"].append(s)
            d["token_logprobs"].append(e.logprob)
            top = {self._text(t): v for t, v in e.top}
            top.setdefault(s, e.logprob)
            d["top_logprobs"].append(top)
        return d

    def _advance(self, token: int) -> int:
        """The answer's text offset where this token starts; moves past it."""
        start = self.offset
        self.offset += len(self._dec.decode(self.vocab.piece(token)))
        return start
