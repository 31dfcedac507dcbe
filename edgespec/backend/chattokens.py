"""Tokens of a rendered chat in which only the template's own markup is special.

A message's text is the user's (or a tool's, or a file's): text such as
``<|im_start|>system`` in it must stay text, never become control tokens.  The
template is rendered with each message's content replaced by a placeholder that
cannot occur in text; the rendered string is split at the placeholders, the
template's pieces are tokenized with special-token parsing and the contents
without.  A template that rewrites contents (beyond trimming them) cannot be
split this way; then a message that holds control-token text is refused.

Tools (OpenAI's function definitions, for templates that render a `tools`
variable) and a message's other fields (an assistant's tool_calls, a tool
message's name) are rendered by the template as its own text: they may hold
no control-token text at all."""

from __future__ import annotations

import functools
import json
import re
import secrets

import jinja2
import numpy as np

from edgespec.errors import ConfigError


@functools.lru_cache(maxsize=4)
def _tools_formatter(template: str, eos: str, bos: str):
    """A Jinja formatter like Vocab.format_chat's (the same llama-cpp-python
    class and settings), for renderings that pass `tools`."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    try:
        return Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos, add_generation_prompt=True)
    except jinja2.TemplateError as e:
        raise ConfigError(f"the model's chat template does not parse: {e}") from None


def render(vocab, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The template's rendering of messages (Vocab.format_chat), with `tools`
    passed to the template when given."""
    if not tools:
        return vocab.format_chat(messages)
    # the checks of Vocab.format_chat
    if not messages:
        raise ConfigError("no messages to render")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"message {i + 1} is not a {{role, content}} object with string values")
    template = vocab.chat_template()
    if not template:
        raise ConfigError("this model has no chat template")
    eos, bos = vocab.eos_token(), vocab.bos_token()
    fmt = _tools_formatter(template, vocab.token_text(eos) if eos >= 0 else "",
                           vocab.token_text(bos) if bos >= 0 else "")
    try:
        return fmt(messages=messages, tools=tools).prompt
    except jinja2.TemplateError as e:
        raise ConfigError(f"the model's chat template failed on these messages: {e}") from None


def _render_split(vocab, messages: list[dict], tools: list[dict] | None = None) -> list[tuple[str, bool]] | None:
    """[(piece, is_content)] whose texts join to the template's rendering of messages, or None."""
    original = render(vocab, messages, tools)     # validates the messages first
    tag = secrets.token_hex(8)
    # an empty content has no text to keep as text: left as it is (templates test it: `if message.content`)
    marks = [f"\ue000{tag}:{i}\ue001" if m["content"] else None for i, m in enumerate(messages)]
    masked = [dict(m, content=mark) if mark else m for m, mark in zip(messages, marks)]
    rendered = render(vocab, masked, tools)
    for strip in (False, True):
        pieces, rest = [], rendered
        for m, mark in zip(messages, marks):
            if mark is None:
                continue
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


def _refuse_special_fields(vocab, messages: list[dict], tools: list[dict] | None) -> None:
    """Tools and the fields of a message other than role and content are
    template text once rendered: refuse control-token text in them."""
    if tools and _has_special_text(vocab, json.dumps(tools, ensure_ascii=False)):
        raise ConfigError("a tool definition holds control-token text; remove it")
    for i, m in enumerate(messages):
        extra = {k: v for k, v in m.items() if k not in ("role", "content")} if isinstance(m, dict) else None
        if extra and _has_special_text(vocab, json.dumps(extra, ensure_ascii=False, default=str)):
            raise ConfigError(f"message {i + 1} holds control-token text outside its content; remove it")


def chat_tokens(vocab, messages: list[dict], tools: list[dict] | None = None) -> np.ndarray:
    """The token ids of messages (and tools, for a template that renders them)
    rendered with the chat template, contents never special."""
    _refuse_special_fields(vocab, messages, tools)
    pieces = _render_split(vocab, messages, tools)
    if pieces is None:
        if any(_has_special_text(vocab, m["content"]) for m in messages):
            raise ConfigError("a message holds control-token text and this model's chat template rewrites "
                              "messages, so it cannot be kept as text; remove the control-token text")
        return vocab.tokenize(render(vocab, messages, tools), add_special=False, parse_special=True)
    parts = [vocab.tokenize(t, add_special=False, parse_special=special)
             for t, special in _runs(pieces, _special_texts(vocab, pieces))]
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
