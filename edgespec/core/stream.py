"""The answer's text as it streams: incremental detokenizing, stop strings
found in time linear in the text, the hold-back of a tail that may begin a
stop string, llama-server's n_indent cut, and which characters came from
accepted drafts; and Chunk, the unit Engine.run yields.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field


class _StopScan:
    """Finds stop strings in a text that arrives in pieces, in time linear in
    the text: one Knuth-Morris-Pratt automaton per string, whose state is the
    length of the longest prefix of the string that ends the text so far.  A
    match must end in the newest piece (an earlier one would have stopped the
    text), so each character is read once per string."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.fail = [_kmp_failure(s) for s in stops]
        self.state = [0] * len(stops)

    def feed(self, piece: str, base: int) -> int:
        """Read `piece`, which starts at index `base` of the text; return where
        the earliest-starting stop string completed in it begins, or -1."""
        best = -1
        for j, s in enumerate(self.stops):
            q, f, n = self.state[j], self.fail[j], len(s)
            if q == 0 and s[0] not in piece:
                continue
            for i, c in enumerate(piece):
                while q and s[q] != c:
                    q = f[q - 1]
                if s[q] == c:
                    q += 1
                if q == n:
                    start = base + i + 1 - n
                    best = start if best < 0 else min(best, start)
                    break
            self.state[j] = q
        return best

    def held(self) -> int:
        """How many characters at the end of the text may begin a stop string."""
        return max(self.state, default=0)


def _kmp_failure(s: str) -> list[int]:
    """f[i]: the length of the longest proper prefix of s[:i+1] that is also its suffix."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class _IndentScan:
    """llama-server's n_indent rule on a text that arrives in pieces: every
    line after the answer's first newline must be indented (spaces and tabs)
    by at least n_indent; the first line that is not, once a character
    follows its indentation (a newline too: a blank line counts), cuts the
    answer there.  Its indentation stays; the rest is dropped.  Each
    character is read once: `line` is where the line being judged begins
    (-1: none is, the scan looks for the next newline from `at`).
    llama-server judges a line a token or two after it appears, so where
    its answer ends within those tokens (n_predict, an end token) it may
    keep a line that this cuts; otherwise both cut at the same character."""

    def __init__(self, n_indent: int):
        self.n_indent = n_indent
        self.line = -1
        self.at = 0

    def feed(self, text: str) -> int:
        """Where the text is cut (the offending line's first character after
        its indentation), or -1."""
        while self.at < len(text):
            if self.line < 0:
                nl = text.find("\n", self.at)
                if nl < 0:
                    self.at = len(text)
                    break
                self.line = self.at = nl + 1
                continue
            k = self.at
            while k < len(text) and text[k] in " \t":
                k += 1
            self.at = k
            if k == len(text):      # the line is all indentation so far: undecided
                break
            if k - self.line < self.n_indent:
                return k
            self.line = -1
        return -1


class TextStream:
    """Incremental detokenizer with stop strings, the n_indent cut and stream
    hold-back.  It also keeps where each token's text ends and whether the
    token was an accepted draft, so streamed text can say which of its
    characters came from drafts.  n_indent > 0: llama-server's rule
    (_IndentScan); a cut by it ends the text as a stop string does, with
    indent_cut set and no stop_word.  The cut needs no hold-back: it drops
    only text from the offending character on, which is never streamed
    before it is judged."""

    def __init__(self, vocab, stop: list[str], n_indent: int = 0):
        self.vocab = vocab
        self.stop = [s for s in stop if s]
        self._scan = _StopScan(self.stop)
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.char_end: list[int] = []   # len(text) after each token
        self.drafted: list[bool] = []   # each token came from an accepted draft
        self.emitted = 0
        self._span_tok = 0              # first token whose text is not all streamed
        self.stopped_at = -1
        self.stop_word = ""             # the stop string that ended the text
        self._indent = _IndentScan(n_indent) if n_indent > 0 else None
        self.indent_cut = False         # the n_indent rule ended the text

    def push(self, token: int, drafted: bool = False) -> bool:
        """Add a token; return True if a stop string is now complete (or the
        n_indent rule cut the text)."""
        base = len(self.text)
        piece = self.dec.decode(self.vocab.piece(token))
        self.text += piece
        self.char_end.append(len(self.text))
        self.drafted.append(drafted)
        best = self._scan.feed(piece, base) if self.stop else -1
        cut = self._indent.feed(self.text) if self._indent is not None else -1
        if cut >= 0 and (best < 0 or cut < best):
            self.stopped_at, self.indent_cut = cut, True
        elif best >= 0:
            self.stopped_at = best
            self.stop_word = next((s for s in self.stop if self.text.startswith(s, best)), "")
        else:
            return False
        self.text = self.text[:self.stopped_at]
        return True

    def push_many(self, tokens: list[int], n_drafted: int = 0) -> bool:
        """push() each token (the first n_drafted were accepted drafts); stop at
        the first completed stop string, as one-token steps would."""
        for i, t in enumerate(tokens):
            if self.push(t, i < n_drafted):
                return True
        return False

    def finish(self) -> None:
        if self.stopped_at < 0:
            self.text += self.dec.decode(b"", final=True)

    def n_tokens_before_stop(self) -> int:
        """Tokens whose text lies entirely before the stop string."""
        return sum(1 for e in self.char_end if e <= self.stopped_at)

    def delta(self, final: bool = False) -> tuple[str, list]:
        """Text not yet streamed, holding back a tail that may start a stop
        string, and the same text cut into runs of (text, from_draft)."""
        end = len(self.text)
        if not final and self.stop and self.stopped_at < 0:
            end -= self._scan.held()
        if end <= self.emitted:
            return "", []
        a, self.emitted = self.emitted, end
        return self.text[a:end], self._spans(a, end)

    def _spans(self, a: int, b: int) -> list:
        ce, dr, i = self.char_end, self.drafted, self._span_tok
        spans: list = []
        pos = a
        while i < len(ce) and pos < b:
            e = min(ce[i], b)
            if e > pos:
                if spans and spans[-1][1] == dr[i]:
                    spans[-1] = (spans[-1][0] + self.text[pos:e], dr[i])
                else:
                    spans.append((self.text[pos:e], dr[i]))
                pos = e
            if ce[i] > b:
                break
            i += 1
        self._span_tok = i
        if pos < b:          # the decoder's final flush belongs to no token
            spans.append((self.text[pos:b], False))
        return spans


@dataclass
class Chunk:
    """What Engine.run yields after the first token and after every step.

    text:      new text to show (a tail that may begin a stop string is held
               back until it is known not to be one)
    tokens:    the token ids this step committed to the answer
    n_drafted: how many of them came from accepted drafts (the first ones; the
               last token of a step is the model's own bonus token)
    spans:     `text` cut into runs of (text, from_draft): which characters
               arrived as accepted drafts
    logprobs:  with run(logprobs=N): a logprobs.TokenLogprob per token of
               `tokens` that lies before a stop string, else None
    """
    text: str
    tokens: list
    n_drafted: int = 0
    spans: list = field(default_factory=list)
    logprobs: list | None = None
