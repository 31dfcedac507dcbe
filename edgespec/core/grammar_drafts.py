"""Drafts under a request's grammar: the text it forces, and values copied
from the prompt's text.

A structured answer (JSON extraction, a tool call) is mostly keys and
punctuation the grammar forces, and values copied from the input.  The forced
text is drafted as a chain (jump-forward decoding, verified like any draft).
Token-level prompt lookup then misses the values, for two reasons: the tokens
before a value were forced (`"name": "` never occurs in the prompt), and a
value's first token is often another token than in the prompt (`Pri` after a
quote, ` Pri` after a space).  So values are looked up by characters:

* copied: inside a value, the longest tail of the answer's text (at least
  MIN_CHARS) that occurs in the prompt's text; what followed its latest
  occurrences is drafted (SOURCE_VALUE);
* labelled: where the forced text opens a value, the prompt text after a
  label naming its key (`Order ID: A-17` for `"order_id": "`) is drafted
  under the forced chain (SOURCE_LABEL).

Each chain is tokenized afresh and cut where the grammar would reject a
token.  The gate calibrates both sources on their own, and nothing here
decides what is committed: every drafted token is verified against the
model's own choice under the grammar.
"""
from __future__ import annotations

import re

import numpy as np

from edgespec.drafters.tree import SOURCE_LABEL, SOURCE_VALUE   # noqa: F401  (the sources of this module's drafts)

MIN_CHARS = 2       # a shorter tail matches anywhere
MAX_KEY_CHARS = 32  # longer tails rank equal (the latest occurrence wins)
MAX_COPIES = 3      # occurrences drafted, newest first
COPY_CHARS = 64     # characters taken after a match, before tokenizing
TOKEN_CACHE = 512   # texts whose tokens a request's drafts remember
EMPTY = np.zeros(0, np.int32)

# the answer ends by opening the value of a JSON key: `"order_id": "` or `"total": `
_OPEN_VALUE = re.compile(r'"([A-Za-z][A-Za-z0-9_ \-]{0,47})"\s*:\s*"?$')


class GrammarDrafts:
    """One request's grammar drafts over its prompt text and vocabulary
    (`vocab`: tokenize / detokenize, as backend.vocab.Vocab)."""

    def __init__(self, grammar, vocab, prompt_text: str):
        self.grammar = grammar
        self.vocab = vocab
        self.prompt_text = prompt_text
        self._labels: dict = {}   # key -> where its label's value starts in the prompt text (-1: none)
        self._tokens: dict = {}   # text -> its tokens (a chain a step did not take is asked again)

    def forced(self, answer_text: str) -> tuple[str, np.ndarray]:
        """The text the grammar forces after the answer and its tokens; none
        when nothing is forced or the tokens do not spell it back."""
        text = self.grammar.forced_text(answer_text)
        if not text:
            return "", EMPTY
        toks = self.tokens(text)
        if self.vocab.detokenize(toks) != text:
            return "", EMPTY
        return text, toks

    def tokens(self, text: str) -> np.ndarray:
        """`text`'s tokens (no special tokens), remembered: a tokenize call
        costs tens of microseconds, and a chain the model did not take is
        drafted from the same text again.  At most TOKEN_CACHE texts are
        kept (all are dropped when full)."""
        toks = self._tokens.get(text)
        if toks is None:
            if len(self._tokens) >= TOKEN_CACHE:
                self._tokens.clear()
            toks = self._tokens[text] = np.asarray(self.vocab.tokenize(text, add_special=False), np.int32)
        return toks

    def copied(self, answer_text: str, max_tokens: int) -> list:
        """Chains of the prompt text after the latest occurrences (newest
        first) of the answer's longest matching tail, each as many tokens as
        the grammar admits in a row (at most max_tokens), distinct in their
        first token."""
        chains: list = []
        for at in match_ends(self.prompt_text, answer_text, MAX_COPIES):
            toks = self._admitted(self.prompt_text[at:at + COPY_CHARS], max_tokens, EMPTY)
            if len(toks) and all(c[0] != toks[0] for c in chains):
                chains.append(toks)
        return chains

    def labelled(self, text: str, forced: np.ndarray, max_tokens: int) -> np.ndarray:
        """Where `text` (the answer, then the forced text) ends by opening a
        JSON value, the prompt text after the label of its key, as many
        tokens as the grammar admits after the `forced` tokens; else none."""
        m = _OPEN_VALUE.search(text[-64:])
        if m is None:
            return EMPTY
        key = m.group(1)
        if key not in self._labels:
            self._labels[key] = label_end(self.prompt_text, key)
        at = self._labels[key]
        if at < 0:
            return EMPTY
        return self._admitted(self.prompt_text[at:at + COPY_CHARS], max_tokens, forced)

    def _admitted(self, text: str, max_tokens: int, before: np.ndarray) -> np.ndarray:
        """`text`'s tokens (at most max_tokens) up to the first the grammar
        rejects once the `before` tokens are accepted."""
        if not text or max_tokens <= 0:
            return EMPTY
        toks = self.tokens(text)[:max_tokens]
        n = self.grammar.admits(np.concatenate([before, toks])) - len(before)
        return toks[:max(n, 0)]


def match_ends(source: str, text: str, k: int) -> list:
    """Where the longest tail of `text` (MIN_CHARS to MAX_KEY_CHARS
    characters) ends in `source`, at its latest k occurrences, newest first;
    empty when no tail of MIN_CHARS occurs.  A tail that occurs implies each
    shorter one does, so the tail grows until it is no longer found."""
    best = ""
    for n in range(MIN_CHARS, min(len(text), MAX_KEY_CHARS) + 1):
        if source.rfind(text[-n:]) < 0:
            break
        best = text[-n:]
    ends: list = []
    hi = len(source)
    while best and len(ends) < k:
        pos = source.rfind(best, 0, hi)
        if pos < 0:
            break
        ends.append(pos + len(best))
        hi = pos + len(best) - 1
    return ends


def label_end(source: str, key: str) -> int:
    """Where the value after the first label naming `key` starts in
    `source`: the key's words in any case, separated by a space, `_`, `-` or
    nothing (`order_id`, `orderId`: "Order ID", "order-id", "OrderID"),
    then `:` or `=` and optional spaces; -1 when there is none."""
    words = re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", key)
    if not words:
        return -1
    sep = r"[ _\-]?"
    pat = r"(?<![A-Za-z0-9])" + sep.join(re.escape(w) for w in words) + r"[ \t]*[:=][ \t]*"
    m = re.search(pat, source, flags=re.IGNORECASE)
    return m.end() if m else -1
