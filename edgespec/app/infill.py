"""Fill-in-the-middle (FIM): the prompt a code model completes at a cursor,
built from the model's own FIM tokens, for every door that asks for one
(`/infill`, `/completion`'s neighbour `/v1/completions` with `suffix`, the
drop-in's `create_completion(suffix=...)`, `SpecModel.infill`): a request
whose prompt is an `Infill` is turned into token ids here, once, where
SpecModel resolves it (edgespec.app.resolve).

The FIM tokens are read from the GGUF metadata
(tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id) and, where the
metadata lacks one, looked up by its text (Qwen2.5-Coder's `<|fim_prefix|>`
..., StarCoder's and SmolLM's `<fim_prefix>` ...).  The layout is
prefix-suffix-middle; with repository-level tokens (rep and sep) it is
llama-server's repository pattern:

    [rep]myproject\\n [sep]name0\\n text0 ... [sep]filename\\n [pre]prefix [suf]suffix [mid]prompt

Without them the extra chunks stand as plain text before [pre].  Every part
is tokenized on its own, without special-token parsing (a file holding
"<|fim_prefix|>" stays text), and the ids are concatenated: an unchanged
part has the same ids from one keystroke to the next, and the parts that
change least (the repository line, the extra chunks, the prefix) come first,
so the prompt cache (core/prefix_cache.py) keeps the longest prefix.

The suffix is read at most `suffix_tokens` tokens deep (SUFFIX_TOKENS by
default; `serve --fim-suffix-tokens`; None: as deep as the context allows).
With prefix-suffix-middle every new cursor line changes what stands before
the suffix, so its tokens are read again at each one (what bounds an
editor's request on a CPU: issue 65, BENCHMARKS.md); llama-server reads at
most a quarter of its batch of the suffix for the same reason (256 tokens
with its FIM preset's -b 1024).  The text typed on the cursor's line (the
middle, llama-server's `prompt`) ends the prefix, as llama-server lays it
out (layout "psm"), so a keystroke reads the suffix again too; layout "mid"
puts it after the middle token, where a keystroke reads only itself, but
Qwen2.5-Coder then continues a half-typed word less often as it was typed
(bench-editor, BENCHMARKS.md: first lines right 8/60 against 14/60).

A long prefix starts at an anchor line.  Past the first 256 lines of a
file an editor's prefix window slides with the cursor: each new line drops
the window's first line, and with it (the cache being exact) every cell
after it, so the whole prefix would be read again at each new line (about
2,000 tokens: 30 s on two CPU cores).  So a prefix of ANCHOR_MIN_LINES lines
or more starts at its first anchor line among the first ANCHOR_MAX_DROP: a
non-blank line whose text hashes (crc32) to 0 modulo ANCHOR_EVERY.  The
choice depends on the text alone (the same request gives the same prompt),
and the same anchor stays first while the window slides, until it leaves
the window (once per ANCHOR_EVERY lines on average); the prefix loses
ANCHOR_EVERY / 2 lines on average.  Infill(anchor=False) keeps it whole.

The prefix may be capped (`prefix_tokens`; `serve --fim-prefix-tokens`;
None, the default: no cap but the context's).  llama-server reads at most
three quarters of its batch of the prefix's tail (768 tokens with its FIM
preset), cut at a token, so the prompt's start moves with every character
typed; edgespec's cap starts the prefix at the first anchor line from which
the rest fits (the same anchor stays first until the prefix has grown past
the cap: one prefix read again per ANCHOR_EVERY new lines on average), and
cuts at a token only where no anchor line fits (and with anchor=False).

When the parts do not fit the context (room is left for the answer: its
max_tokens, at most a quarter of the context), what is kept is the prefix's
tail nearest the cursor, the suffix's head (at most a quarter of the room
while the prefix wants more) and the newest extra chunks, whole; the answer
says `truncated`.  FIM's end tokens (pad, rep, sep) end the answer as the
model's end-of-generation tokens do (Request.stop_tokens).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from edgespec.errors import RequestFieldError

SUFFIX_TOKENS = 128     # the suffix's head read by default (see the module doc; chosen by bench-editor)
FIM_ROLES = ("pre", "suf", "mid", "pad", "rep", "sep")
FIM_TEXTS = {     # the texts where the metadata lacks an id: Qwen2.5-Coder's, StarCoder's, CodeGemma's file separator
    "pre": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>"),
    "suf": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>"),
    "mid": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>"),
    "pad": ("<|fim_pad|>", "<fim_pad>", "<fim-pad>"),
    "rep": ("<|repo_name|>", "<repo_name>", "<reponame>"),
    "sep": ("<|file_sep|>", "<file_sep>", "<filename>", "<|file_separator|>"),
}
LAYOUTS = ("psm", "mid")   # where the text typed on the cursor's line goes (module doc)
ANSWER_RESERVE = 256      # room left for an answer without max_tokens (at most a quarter of the context)
ANCHOR_MIN_LINES = 128    # a prefix this long may slide (llama.vim sends 256 lines): it starts at an anchor
ANCHOR_EVERY = 32         # one non-blank line in this many is an anchor, by its text's hash
ANCHOR_MAX_DROP = 96      # lines an anchor may drop at most (none among them: the prefix stays whole)


@dataclass(frozen=True)
class Infill:
    """What a cursor's completion is asked from: the text before the cursor
    (prefix), after it (suffix), chunks of other files (extra: (filename,
    text) pairs, oldest first) and text the answer starts with after the
    middle token (middle: llama-server's `prompt`).  repo and filename name
    the repository and the current file where the model has repository
    tokens (llama-server's names)."""
    prefix: str = ""
    suffix: str = ""
    extra: tuple[tuple[str, str], ...] = ()
    middle: str = ""
    repo: str = "myproject"
    filename: str = "filename"
    suffix_tokens: int | None = None        # None: SUFFIX_TOKENS; 0 or more: at most this many suffix tokens
    prefix_tokens: int | None = None        # None: the prefix as the context allows; N: at most N (module doc)
    anchor: bool = True                     # a long prefix starts at its first anchor line (module doc)
    layout: str = "psm"                     # "psm": middle ends the prefix; "mid": middle after the middle token

    def __post_init__(self):
        object.__setattr__(self, "extra", tuple((str(n), str(t)) for n, t in self.extra))
        if self.suffix_tokens is not None and self.suffix_tokens < 0:
            raise ValueError("suffix_tokens must be 0 or more")
        if self.prefix_tokens is not None and self.prefix_tokens < 0:
            raise ValueError("prefix_tokens must be 0 or more")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {self.layout!r}")


@dataclass(frozen=True)
class FimTokens:
    """A model's FIM token ids (-1: the model has none)."""
    pre: int = -1
    suf: int = -1
    mid: int = -1
    pad: int = -1
    rep: int = -1
    sep: int = -1

    @property
    def usable(self) -> bool:
        return min(self.pre, self.suf, self.mid) >= 0

    @property
    def repo_level(self) -> bool:
        return self.rep >= 0 and self.sep >= 0

    @property
    def ends(self) -> tuple[int, ...]:
        """The tokens that end an answer (besides the model's EOG)."""
        return tuple(t for t in (self.pad, self.rep, self.sep) if t >= 0)


def fim_tokens(vocab) -> FimTokens:
    """The model's FIM tokens: each from the GGUF metadata, else by its text."""
    ids = {}
    for role in FIM_ROLES:
        v = vocab.metadata(f"tokenizer.ggml.fim_{role}_token_id")
        t = int(v) if v is not None and v.strip().lstrip("-").isdigit() else -1
        if not 0 <= t < vocab.n_vocab:
            t = next((i for i in map(vocab.special_token, FIM_TEXTS[role]) if i >= 0), -1)
        ids[role] = t
    return FimTokens(**ids)


@dataclass(frozen=True)
class FimPrompt:
    """An Infill as token ids: the prompt, whether a part was cut to fit, and
    the tokens that end its answer."""
    ids: np.ndarray
    truncated: bool
    stop_tokens: tuple[int, ...]


def anchored(prefix: str) -> str:
    """The prefix from its first anchor line on (the module doc); the whole
    prefix when it is short or has no anchor among its first ANCHOR_MAX_DROP lines."""
    lines = prefix.splitlines(keepends=True)
    if len(lines) < ANCHOR_MIN_LINES:
        return prefix
    for i, line in enumerate(lines[:ANCHOR_MAX_DROP]):
        if _is_anchor(line):
            return "".join(lines[i:])
    return prefix


def _is_anchor(line: str) -> bool:
    return bool(line.strip()) and zlib.crc32(line.encode("utf-8")) % ANCHOR_EVERY == 0


def fitted(prefix: str, n_max: int, tok) -> str:
    """The prefix from its first anchor line on from which the rest is at most n_max tokens (tok: text ->
    ids); the whole prefix where it fits or no anchor line does (the caller then cuts at a token)."""
    if len(tok(prefix)) <= n_max:
        return prefix
    starts, at = [], 0
    for line in prefix.splitlines(keepends=True):
        if at and _is_anchor(line):
            starts.append(at)
        at += len(line)
    lo, hi = 0, len(starts)         # the first start whose rest fits: later starts leave fewer tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tok(prefix[starts[mid]:])) <= n_max:
            hi = mid
        else:
            lo = mid + 1
    return prefix[starts[lo]:] if lo < len(starts) else prefix


def _take(prefix: list, suffix: list, room: int) -> tuple[int, int]:
    """How many tokens of the prefix (its tail) and the suffix (its head) fit
    in room: the suffix gets at most a quarter while the prefix wants more."""
    n_pre = min(len(prefix), room - min(len(suffix), room // 4))
    return n_pre, min(len(suffix), room - n_pre)


def fim_prompt(vocab, infill: Infill, n_ctx: int, max_tokens: int | None) -> FimPrompt:
    """The FIM prompt of `infill` for a model (its Vocab) with a context of
    n_ctx tokens, leaving room for an answer of max_tokens (see the module's
    doc).  RequestFieldError (HTTP 400) for a model without FIM tokens."""
    fim = fim_tokens(vocab)
    if not fim.usable:
        raise RequestFieldError("this model has no fill-in-the-middle tokens (tokenizer.ggml.fim_pre/suf/mid "
                                "or their texts): use a code model such as Qwen2.5-Coder", "input_prefix",
                                "unsupported")

    def tok(text: str) -> list[int]:
        return vocab.tokenize(text, add_special=False, parse_special=False).tolist() if text else []
    head = [vocab.bos_token()] if vocab.add_bos and vocab.bos_token() >= 0 else []
    if fim.repo_level:
        head += [fim.rep] + tok(infill.repo + "\n")
        chunks = [[fim.sep] + tok(name + "\n") + tok(text) for name, text in infill.extra]
        current = [fim.sep] + tok(infill.filename + "\n")
    else:       # no repository tokens: the chunks as plain text before the prefix
        chunks = [tok(text) for _, text in infill.extra]
        current = []
    text = anchored(infill.prefix) if infill.anchor else infill.prefix
    prefix, cap = tok(text), infill.prefix_tokens
    if cap is not None and len(prefix) > cap:
        if infill.anchor:
            prefix = tok(fitted(text, cap, tok))
        prefix = prefix[max(0, len(prefix) - cap):]     # no anchor line fits (or none wanted): a token's cut
    suffix, middle = tok(infill.suffix), tok(infill.middle)
    budget = SUFFIX_TOKENS if infill.suffix_tokens is None else infill.suffix_tokens
    cut = len(suffix) > budget
    suffix = suffix[:budget]
    reserve = max(1, min(max_tokens or ANSWER_RESERVE, n_ctx // 4))
    room = max(0, n_ctx - reserve - len(head) - len(current) - 3 - len(middle))
    n_pre, n_suf = _take(prefix, suffix, room)
    left = room - n_pre - n_suf
    kept: list[list[int]] = []
    for c in reversed(chunks):          # the newest chunks, whole, while they fit
        if len(c) > left:
            break
        kept.insert(0, c)
        left -= len(c)
    truncated = cut or n_pre < len(prefix) or n_suf < len(suffix) or len(kept) < len(chunks)
    ids = head + [t for c in kept for t in c] + current + [fim.pre] + prefix[len(prefix) - n_pre:]
    if infill.layout == "psm":
        ids += middle + [fim.suf] + suffix[:n_suf] + [fim.mid]
    else:
        ids += [fim.suf] + suffix[:n_suf] + [fim.mid] + middle
    return FimPrompt(np.asarray(ids, dtype=np.int32), truncated, fim.ends)
