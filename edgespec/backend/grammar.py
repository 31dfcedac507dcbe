"""Grammar-constrained generation through llama.cpp's own grammar engine.

A `Grammar` wraps llama.cpp's grammar sampler (GBNF) over one vocabulary and
tracks the tokens committed so far.  The engine asks it, at every position it
verifies, which token the model chooses under the constraint:

* greedy: the model's argmax if the grammar admits it (one one-token check),
  else the argmax of the row with every token the grammar rejects set to -inf;
* sampling: a draw from the masked row.

Both are the choice of llama.cpp's own grammar-constrained sampling (which
checks the unconstrained pick first and masks the whole row only when the
grammar rejects it), so a draft token is committed only where it is the model's
choice under the grammar.  JSON schemas become GBNF through the converter
llama-cpp-python ships (a port of llama.cpp's json-schema-to-grammar).

llama.cpp aborts the process when a token the grammar rejects is accepted, so
`accept` is only ever given tokens this object chose or admitted.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import re
import tempfile
import threading

import numpy as np

import llama_cpp as L
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from edgespec.errors import ConfigError, GrammarError

# llama_token_data {id, logit, p}: laid out as numpy records so a whole row is
# handed to llama.cpp without a Python loop
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
MAX_GRAMMAR_BYTES = 1 << 20
# where the grammar rejects the argmax, the tokens above the SCAN_RANKS-th
# largest of every SCAN_STRIDE-th logit are checked (about 64, then 2,048 of
# them) before the whole row is masked
SCAN_STRIDE = 16
SCAN_RANKS = (4, 128)

_init_lock = threading.Lock()     # fd 2 is redirected around a parse (process-wide)


def gbnf_for(grammar: str | None = None, json_schema=None) -> str | None:
    """The GBNF text for a request: `grammar` as given, or the grammar of
    `json_schema` (a dict, its JSON text, or True / {} for any JSON object);
    None when neither is given.  ConfigError for both, or a schema the
    converter cannot handle."""
    if grammar is not None and json_schema is not None:
        raise ConfigError("give a grammar or a JSON schema, not both")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise ConfigError("grammar must be a non-empty GBNF text")
        if len(grammar.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
            raise ConfigError(f"the grammar is over {MAX_GRAMMAR_BYTES} bytes")
        return grammar
    if json_schema is None:
        return None
    if json_schema is True or json_schema == {}:
        return JSON_GBNF
    if isinstance(json_schema, str):
        try:
            json_schema = json.loads(json_schema)
        except ValueError as e:
            raise ConfigError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(json_schema, dict):
        raise ConfigError("a JSON schema must be a JSON object")
    try:
        gbnf = json_schema_to_gbnf(json.dumps(json_schema))
    except RecursionError:
        raise ConfigError("the JSON schema nests too deeply") from None
    except Exception as e:  # the converter raises bare Exceptions, KeyErrors, ...
        raise ConfigError(f"the JSON schema cannot be turned into a grammar: {e}") from None
    # the converter in llama-cpp-python admits raw control characters inside
    # strings, which JSON forbids (llama.cpp's own converter excludes them)
    return re.sub(r'^char ::= \[\^"\\\\\]', lambda m: r'char ::= [^"\\\x7F\x00-\x1F]', gbnf, flags=re.M)


def _init_sampler(vocab_ptr, gbnf: bytes, root: bytes):
    """llama_sampler_init_grammar, with what llama.cpp's parser prints to
    stderr captured (it does not go through the log callback): (sampler or
    None, the parser's message)."""
    with _init_lock, tempfile.TemporaryFile() as err:
        saved = os.dup(2)
        try:
            os.dup2(err.fileno(), 2)
            smpl = L.llama_sampler_init_grammar(vocab_ptr, gbnf, root)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        text = err.read(4096).decode("utf-8", "replace")
    return smpl, text


class Grammar:
    """One request's grammar state over one vocabulary (not thread-safe: one
    request owns it)."""

    def __init__(self, vocab, gbnf: str, root: str = "root"):
        smpl, msg = _init_sampler(vocab.ptr, gbnf.encode("utf-8", "surrogatepass"), root.encode("utf-8"))
        if not smpl:
            lines = [s.strip() for s in msg.splitlines() if "error" in s.lower() or "failed" in s.lower()]
            why = "; ".join(lines[:2]) or "llama.cpp rejected it"
            raise GrammarError(f"the grammar cannot be used: {why}")
        self._smpl = smpl
        n = vocab.n_vocab
        self.n_vocab = n
        self._all = np.zeros(n, TOKEN_DATA)
        self._all["id"] = np.arange(n, dtype=np.int32)
        self._one = L.llama_token_data()         # one token's check: a ctypes struct (a numpy record costs more)
        self._arr_all = L.llama_token_data_array(self._all.ctypes.data_as(L.llama_token_data_p), n, -1, False)
        self._arr_one = L.llama_token_data_array(ctypes.pointer(self._one), 1, -1, False)
        self._scan = np.zeros(4096, TOKEN_DATA)      # argmax's candidates above a threshold
        # forced_text's candidates: the one-character tokens, probed every step
        self._char_ids, self._chars = _char_tokens(vocab)
        self._cand = np.zeros(len(self._char_ids), TOKEN_DATA)
        self._cand["id"] = self._char_ids          # an apply only ever changes the logits
        self._cand_logit = self._cand["logit"]
        self._char_id = dict(zip(self._chars, self._char_ids.tolist()))
        self._arr_cand = L.llama_token_data_array(self._cand.ctypes.data_as(L.llama_token_data_p),
                                                  len(self._cand), -1, False)
        self.n_accepted = 0

    def allows(self, token: int) -> bool:
        """Whether the grammar admits `token` next."""
        return _admitted(self._smpl, self._one, self._arr_one, token)

    def mask(self, row: np.ndarray) -> np.ndarray:
        """A float32 copy of a logits row with -inf at every token the grammar
        rejects next."""
        self._all["logit"] = row[:self.n_vocab]
        self._arr_all.size = self.n_vocab
        self._arr_all.sorted = False
        L.llama_sampler_apply(self._smpl, self._arr_all)
        return self._all["logit"].copy()

    def allowed(self) -> np.ndarray:
        """The ids of every token the grammar admits next."""
        self._all["logit"] = 0.0
        self._arr_all.size = self.n_vocab
        L.llama_sampler_apply(self._smpl, self._arr_all)
        return np.flatnonzero(np.isfinite(self._all["logit"])).astype(np.int32)

    def argmax(self, row: np.ndarray) -> int:
        """The greedy choice under the grammar: the argmax of the masked row
        (the first of equal logits, as numpy's argmax).  The model's own
        argmax is asked first (one token's check, microseconds); where the
        grammar rejects it, the tokens at or above a threshold (about 64,
        then about 2,000 of them: SCAN_RANKS) are checked in one call, in
        order of logit then id: every token left out lies below each one
        checked, so the first admitted is the masked row's argmax.  Only
        when none is admitted is the whole row masked (about 5 ms over 49k
        tokens)."""
        tok = int(row.argmax())
        if self.allows(tok):
            return tok
        n = self.n_vocab
        sample = np.sort(row[:n:SCAN_STRIDE])
        for rank in SCAN_RANKS:
            if rank * SCAN_STRIDE * 4 > n:
                break
            tok = self._first_admitted(row, sample[-rank])
            if tok >= 0:
                return tok
        masked = self.mask(row)
        if not np.isfinite(masked).any():
            raise ConfigError("the grammar admits no token here")
        return int(masked.argmax())

    def _first_admitted(self, row: np.ndarray, floor) -> int:
        """The first token the grammar admits among those whose logit is at
        least `floor`, in order of logit (descending) then id; -1 if none."""
        ids = np.flatnonzero(row[:self.n_vocab] >= floor)
        ids = ids[np.argsort(-row[ids], kind="stable")]     # flatnonzero's ids ascend: ties stay by id
        buf = self._scan if len(ids) <= len(self._scan) else np.zeros(len(ids), TOKEN_DATA)
        buf["id"][:len(ids)] = ids
        buf["logit"][:len(ids)] = 0.0
        arr = L.llama_token_data_array(buf.ctypes.data_as(L.llama_token_data_p), len(ids), -1, False)
        L.llama_sampler_apply(self._smpl, arr)
        ok = np.flatnonzero(np.isfinite(buf["logit"][:len(ids)]))
        return int(ids[ok[0]]) if len(ok) else -1

    def forced_text(self, history: str = "", max_chars: int = 48) -> str:
        """The text the grammar forces next, one character at a time, as far as
        it is forced: where the only choices are a space or one other
        character (JSON grammars' optional spaces), the answer's own habit
        after the same character decides (`history`: the answer so far; a
        space when it has none).  A cheap guess made from the one-character
        tokens (an apply over about a hundred candidates per character), to be
        drafted and verified, never committed as is."""
        chars, logit, arr = self._chars, self._cand_logit, self._arr_cand
        if not chars:
            return ""
        clone = L.llama_sampler_clone(self._smpl)
        out: list[str] = []
        try:
            prev = history[-1:] if history else ""
            for _ in range(max_chars):
                logit[:] = 0.0
                arr.size = len(chars)
                L.llama_sampler_apply(clone, arr)
                ok = np.flatnonzero(np.isfinite(logit))
                if not 0 < len(ok) <= 2:        # nothing, or an open choice
                    break
                pick = _forced_choice([chars[i] for i in ok.tolist()], prev, history + "".join(out))
                if pick is None:
                    break
                out.append(pick)
                L.llama_sampler_accept(clone, self._char_id[pick])
                prev = pick
        finally:
            L.llama_sampler_free(clone)
        return "".join(out)

    def admits(self, tokens) -> int:
        """How many of `tokens`, in order from the current state, the grammar
        admits before the first it rejects (checked on a copy of the state)."""
        clone = L.llama_sampler_clone(self._smpl)
        n = 0
        try:
            for t in tokens.tolist() if isinstance(tokens, np.ndarray) else tokens:
                if not _admitted(clone, self._one, self._arr_one, int(t)):
                    break
                L.llama_sampler_accept(clone, int(t))
                n += 1
        finally:
            L.llama_sampler_free(clone)
        return n

    def accept(self, token: int) -> None:
        """Advance past `token`, which must be one the grammar admits."""
        L.llama_sampler_accept(self._smpl, int(token))
        self.n_accepted += 1

    @property
    def closed(self) -> bool:
        return not self._smpl

    def close(self) -> None:
        if self._smpl:
            L.llama_sampler_free(self._smpl)
            self._smpl = None

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def _admitted(smpl, one, arr, token: int) -> bool:
    """Whether the grammar sampler `smpl` admits `token` next (one: the
    llama_token_data that `arr`, a one-entry array, points at)."""
    one.id, one.logit, one.p = token, 0.0, 0.0
    arr.size = 1
    L.llama_sampler_apply(smpl, arr)
    return not math.isinf(one.logit)


FORCED_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\t"


def _char_tokens(vocab) -> tuple[np.ndarray, list]:
    """The vocabulary's one-character tokens of FORCED_CHARS (id array, their
    characters), computed once per vocabulary."""
    got = getattr(vocab, "_grammar_chars", None)
    if got is None:
        ids, chars = [], []
        for ch in FORCED_CHARS:
            t = vocab.tokenize(ch, add_special=False)
            if len(t) == 1 and vocab.piece(int(t[0])) == ch.encode():
                ids.append(int(t[0]))
                chars.append(ch)
        got = vocab._grammar_chars = (np.array(ids, np.int32), chars)
    return got


def _forced_choice(allowed: list, prev: str, history: str) -> str | None:
    """The next forced character among the one-character tokens the grammar
    admits: the only one; or, between a space and one other character, the
    one the answer used after `prev` more often (a space on a tie); None
    where the choice is open."""
    if len(allowed) == 1:
        return allowed[0]
    if len(allowed) == 2 and " " in allowed:
        other = allowed[0] if allowed[1] == " " else allowed[1]
        if not prev:
            return " "
        spaced = history.count(prev + " ")
        tight = history.count(prev) - spaced - (1 if history.endswith(prev) else 0)
        return " " if spaced >= tight else other
    return None
