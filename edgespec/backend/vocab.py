"""A model's tokenizer and chat template.

Vocab wraps llama.cpp's vocabulary of a loaded model (a vocab-only load too):
tokenizing, token pieces, end-of-generation tokens, and rendering messages
with the model's own chat template.  The template is part of the model file,
read through the same handle, so turning messages into text lives with
turning text into tokens.
"""
from __future__ import annotations

import ctypes

import jinja2
import numpy as np

import llama_cpp as L
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from edgespec.errors import BackendError, ConfigError


class Vocab:
    """Tokenizer of a model (works on a vocab-only load too)."""

    def __init__(self, model_ptr) -> None:
        self._model = model_ptr
        self.ptr = L.llama_model_get_vocab(model_ptr)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.ptr))
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.ptr))
        self._eog: np.ndarray | None = None
        self._piece_cache: dict[int, bytes] = {}
        self._formatters: dict = {}      # add_generation_prompt -> Jinja2ChatFormatter

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"the text is not valid Unicode: an unpaired surrogate at character {e.start} "
                              "(bytes that were not UTF-8, decoded with surrogateescape?)") from None
        cap = len(data) + 8
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.ptr, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.ptr, data, len(data), buf, cap, add_special, parse_special)
            if n < 0:
                raise BackendError("tokenization failed")
        return np.ctypeslib.as_array(buf)[:n].astype(np.int32).copy()

    def piece(self, token: int, special: bool = False) -> bytes:
        if not special:
            p = self._piece_cache.get(token)
            if p is None:
                p = self._piece_cache[token] = self._piece(token, False)
            return p
        return self._piece(token, special)

    def _piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.ptr, int(token), buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.ptr, int(token), buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.ptr, int(token)))

    def eog_mask(self) -> np.ndarray:
        if self._eog is None:
            self._eog = np.array([self.is_eog(t) for t in range(self.n_vocab)], dtype=np.bool_)
        return self._eog

    def token_text(self, token: int) -> str:
        return self.piece(token, special=True).decode("utf-8", errors="replace")

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value of the model as text (None if it has none)."""
        buf = ctypes.create_string_buffer(1 << 16)
        n = L.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", errors="replace")

    def special_token(self, text: str) -> int:
        """The id of the one token whose piece is exactly `text` (a control
        token's text, read with special-token parsing), or -1."""
        ids = self.tokenize(text, add_special=False, parse_special=True)
        if len(ids) == 1 and self.piece(int(ids[0]), special=True) == text.encode("utf-8"):
            return int(ids[0])
        return -1

    def eos_token(self) -> int:
        """The end-of-sequence token id (-1 if the model has none)."""
        return int(L.llama_vocab_eos(self.ptr))

    def bos_token(self) -> int:
        """The beginning-of-sequence token id (-1 if the model has none)."""
        return int(L.llama_vocab_bos(self.ptr))

    def chat_template(self) -> str | None:
        """The model's chat template (GGUF key tokenizer.chat_template), or None."""
        t = L.llama_model_chat_template(self._model, None)
        return t.decode("utf-8", errors="replace") if t else None

    def format_chat(self, messages, add_generation_prompt: bool = True) -> str:
        """Messages ({role, content} dicts) rendered with the model's chat
        template, the Jinja rendering llama-cpp-python's create_chat_completion
        uses, with the model's BOS/EOS texts; add_generation_prompt opens the
        assistant's turn at the end.  ConfigError (a ValueError) when a
        message is not a dict with string role and content, the model has no
        template, or the template does not render."""
        messages = list(messages)
        if not messages:
            raise ConfigError("no messages to render")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ConfigError(f"message {i + 1} is not a {{role, content}} object with string values: "
                                  f"{str(m)[:80]}")
        fmt = self._formatters.get(add_generation_prompt)
        if fmt is None:
            template = self.chat_template()
            if not template:
                raise ConfigError("this model has no chat template")
            eos, bos = self.eos_token(), self.bos_token()
            try:
                fmt = Jinja2ChatFormatter(template=template, add_generation_prompt=add_generation_prompt,
                                          eos_token=self.token_text(eos) if eos >= 0 else "",
                                          bos_token=self.token_text(bos) if bos >= 0 else "")
            except jinja2.TemplateError as e:
                raise ConfigError(f"the model's chat template does not parse: {e}") from None
            self._formatters[add_generation_prompt] = fmt
        try:
            return fmt(messages=messages).prompt
        except jinja2.TemplateError as e:
            raise ConfigError(f"the model's chat template failed on these messages: {e}") from None
