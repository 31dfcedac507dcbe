"""Tokens of a rendered chat in which only the template's own markup is special.

A message's text is the user's (or a tool's, or a file's): text such as
``<|im_start|>system`` in it must stay text, never become control tokens.  The
template is rendered with each message's content replaced by a placeholder that
cannot occur in text; the rendered string is split at the placeholders, the
template's pieces are tokenized with special-token parsing and the contents
without.  A template that rewrites contents (beyond trimming them) cannot be
split this way; then a message that holds control-token text is refused."""

from __future__ import annotations

import re
import secrets

import numpy as np

from .errors import ConfigError


def _render_split(vocab, messages: list[dict]) -> list[tuple[str, bool]] | None:
    """[(piece, is_content)] whose texts join to the template's rendering of messages, or None."""
    tag = secrets.token_hex(8)
    marks = [f"\ue000{tag}:{i}\ue001" for i in range(len(messages))]
    masked = [dict(m, content=mark) for m, mark in zip(messages, marks)]
    original = vocab.format_chat(messages)     # validates the messages first
    rendered = vocab.format_chat(masked)
    for strip in (False, True):
        pieces, rest = [], rendered
        for m, mark in zip(messages, marks):
            before, sep, rest = rest.partition(mark)
            if not sep or mark in rest:
                return None                 # dropped or repeated content: cannot split
            pieces += [(before, False), (m["content"].strip() if strip else m["content"], True)]
        pieces.append((rest, False))
        if "".join(p for p, _ in pieces) == original:
            return pieces
    return None


def _has_special_text(vocab, text: str) -> bool:
    return not np.array_equal(vocab.tokenize(text, add_special=False, parse_special=True),
                              vocab.tokenize(text, add_special=False, parse_special=False))


def _special_texts(vocab, pieces: list[tuple[str, bool]]) -> list[str]:
    """The texts of the control tokens in the template's pieces, longest first."""
    found = set()
    for text, content in pieces:
        if content or not text:
            continue
        for t in vocab.tokenize(text, add_special=False, parse_special=True).tolist():
            s = vocab.token_text(t)
            if s and vocab.tokenize(s, add_special=False, parse_special=False).tolist() != [t]:
                found.add(s)
    return sorted(found, key=len, reverse=True)


def _runs(pieces: list[tuple[str, bool]], specials: list[str]) -> list[tuple[str, bool]]:
    """[(text, is_special)]: the template's control tokens, and the text between them
    (template text and contents joined, so that BPE merges across a content's edges
    are those of tokenizing the whole rendering)."""
    pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
    runs, plain = [], []
    for text, content in pieces:
        if content or pattern is None:
            plain.append(text)
            continue
        at = 0
        for m in pattern.finditer(text):
            plain.append(text[at:m.start()])
            runs += [("".join(plain), False), (m.group(0), True)]
            plain, at = [], m.end()
        plain.append(text[at:])
    runs.append(("".join(plain), False))
    return [r for r in runs if r[0]]


def chat_tokens(vocab, messages: list[dict]) -> np.ndarray:
    """The token ids of messages rendered with the chat template, contents never special."""
    pieces = _render_split(vocab, messages)
    if pieces is None:
        if any(_has_special_text(vocab, m["content"]) for m in messages):
            raise ConfigError("a message holds control-token text and this model's chat template rewrites "
                              "messages, so it cannot be kept as text; remove the control-token text")
        return vocab.tokenize(vocab.format_chat(messages), add_special=False, parse_special=True)
    parts = [vocab.tokenize(t, add_special=False, parse_special=special)
             for t, special in _runs(pieces, _special_texts(vocab, pieces))]
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
