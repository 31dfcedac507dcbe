"""The model-side half of taking a request to `edgespec serve`: its prompt
rendered and tokenized, its prediction tokenized and its grammar converted,
each checked against the context and the limits.  This runs beside the event
loop and the model thread, and only for a request that holds a queue slot;
the cheap field checks before it are edgespec.app.request_fields.
"""
from __future__ import annotations

import numpy as np

from edgespec.app import tools as tooling
from edgespec.app.request_fields import Limits, RequestError, shutting_down, utf8_len
from edgespec.app.structured import ConstraintError, grammar_text, schema_gbnf
from edgespec.errors import ConfigError, ModelClosedError, PromptTooLongError


def _grammar(req: dict) -> str | None:
    """The GBNF of a request's constraint (a tool call's, for tool_choice
    "required" or a named function), bounded; ConstraintError or ToolError
    name the field at fault."""
    tools = req["tools"]
    if tools is not None and tools.mode != "auto":
        return tooling.call_grammar(tools)
    if req["constraint"] is None:
        return None
    field, value = req["constraint"]
    return grammar_text(value, field) if field == "grammar" else schema_gbnf(value, field)


def _max_piece_bytes(vocab) -> int:
    """The most bytes of text one token stands for (control tokens as their
    text).  Tokenizing keeps every byte of a text (byte-level BPE and
    SentencePiece do), so a text of B bytes needs at least B / this tokens:
    what is longer than n_ctx times this cannot fit the context."""
    return max(1, max(len(vocab.piece(t, special=True)) for t in range(vocab.n_vocab)))


class RequestTokenizer:
    """The tokens of a parsed request (RequestParser's dict) for one model,
    refused with a RequestError where they cannot fit."""

    def __init__(self, model, limits: Limits):
        self.model, self.limits = model, limits
        self.n_ctx = model.n_ctx
        self.max_piece = _max_piece_bytes(model.vocab)

    def _fits(self, text: str, n_tokens: int, name: str) -> None:
        """Refuse, before tokenizing it, a text that needs more than n_tokens
        (see _max_piece_bytes)."""
        n = utf8_len(text, name)
        if n > n_tokens * self.max_piece:
            what = f"the context of {self.n_ctx}" if name != "prediction" else "the limit of"
            raise RequestError(400, f"the {name} has {n} bytes of text, more than {n_tokens} tokens can hold "
                               f"(at most {self.max_piece} bytes each): it cannot fit {what} tokens", name,
                               "context_length_exceeded")

    def _render(self, messages: list, tools: list | None = None) -> str:
        try:
            if tools:
                return tooling.render_prompt(self.model, messages, tools)
            return self.model.apply_chat_template(messages)
        except ConfigError:
            raise
        except ValueError as e:         # a template's raise_exception(message)
            raise RequestError(400, f"the model's chat template refused these messages: {str(e)[:200]}",
                               "messages", "invalid_value") from None

    def _prompt_tokens(self, req: dict, where: str) -> np.ndarray:
        """The prompt's tokens, its text checked against the context first."""
        m = self.model
        tools = req["tools"].tools if req["tools"] is not None else None
        if req["chat"] and tools:
            self._fits(self._render(req["messages"], tools), self.n_ctx, where)
            return tooling.prompt_tokens(m, req["messages"], tools)
        if req["chat"]:
            self._fits(self._render(req["messages"]), self.n_ctx, where)
            return m.prompt_tokens(req["messages"])
        if isinstance(req["prompt"], str):
            self._fits(req["prompt"], self.n_ctx, where)
            return m.tokenize(req["prompt"], add_special=True, parse_special=True)
        return np.asarray(req["prompt"], np.int32)

    def _prediction_tokens(self, text: str) -> np.ndarray:
        limit = self.limits.max_prediction_tokens
        self._fits(text, limit, "prediction")
        pred = self.model.tokenize(text, add_special=False)
        if len(pred) > limit:
            raise RequestError(400, f"the prediction has {len(pred)} tokens, more than {limit} "
                               "(--max-prediction-tokens)", "prediction", "invalid_value")
        return pred

    def tokens(self, req: dict) -> tuple[np.ndarray, np.ndarray | None]:
        """The prompt's and the prediction's tokens, checked against the
        context and the limits (runs beside the model thread); sets
        req["gbnf"].  A max_tokens of None stays (Request.max_tokens: until
        the end of the turn or a full context)."""
        m = self.model
        where = "messages" if req["chat"] else "prompt"
        try:
            toks = self._prompt_tokens(req, where)
            m.check_request(toks, req["max_tokens"], req["sampling"])
            pred = self._prediction_tokens(req["prediction"]) if req["prediction"] else None
            req["gbnf"] = _grammar(req)
        except (ConstraintError, tooling.ToolError) as e:
            raise RequestError(400, str(e)[:300], e.param, e.code) from None
        except PromptTooLongError as e:
            raise RequestError(400, str(e), where, "context_length_exceeded") from None
        except ModelClosedError:
            raise shutting_down() from None
        except ConfigError as e:
            raise RequestError(400, str(e)[:300], None, "invalid_value") from None
        return toks, pred
