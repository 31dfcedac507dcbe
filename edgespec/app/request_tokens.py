"""The model-side half of taking a request to `edgespec serve`: its prompt
rendered and tokenized, its prediction tokenized and its grammar converted,
each checked against the context and the limits.  This runs beside the event
loop and the model thread, and only for a request that holds a queue slot;
the cheap field checks before it are edgespec.app.request_fields.
"""
from __future__ import annotations

import numpy as np

from edgespec.app import tools as tooling
from edgespec.app.request_fields import Limits, RequestError, ServeRequest, shutting_down, utf8_len
from edgespec.app.structured import ConstraintError, grammar_text, schema_gbnf
from edgespec.errors import ConfigError, ModelClosedError, PromptTooLongError


def _grammar(call: ServeRequest) -> str | None:
    """The GBNF of a request's constraint (a tool call's, for tool_choice
    "required" or a named function), bounded; ConstraintError or ToolError
    name the field at fault."""
    tools, req = call.tools, call.request
    if tools is not None and tools.mode != "auto":
        return tooling.call_grammar(tools)
    if req.json_schema is not None:
        return schema_gbnf(req.json_schema, call.grammar_param)
    return grammar_text(req.grammar, "grammar") if req.grammar is not None else None


def _max_piece_bytes(vocab) -> int:
    """The most bytes of text one token stands for (control tokens as their
    text).  Tokenizing keeps every byte of a text (byte-level BPE and
    SentencePiece do), so a text of B bytes needs at least B / this tokens:
    what is longer than n_ctx times this cannot fit the context."""
    return max(1, max(len(vocab.piece(t, special=True)) for t in range(vocab.n_vocab)))


class RequestTokenizer:
    """The tokens of a parsed request (RequestParser's ServeRequest) for one
    model, refused with a RequestError where they cannot fit."""

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

    def _prompt_tokens(self, call: ServeRequest, where: str) -> np.ndarray:
        """The prompt's tokens, its text checked against the context first."""
        m, prompt = self.model, call.request.prompt
        tools = call.tools.tools if call.tools is not None else None
        if call.chat and tools:
            self._fits(self._render(prompt, tools), self.n_ctx, where)
            return tooling.prompt_tokens(m, prompt, tools)
        if call.chat:
            self._fits(self._render(prompt), self.n_ctx, where)
            return m.prompt_tokens(prompt)
        if isinstance(prompt, str):
            self._fits(prompt, self.n_ctx, where)
            return m.tokenize(prompt, add_special=True, parse_special=True)
        return np.asarray(prompt, np.int32)

    def _prediction_tokens(self, text: str) -> np.ndarray:
        limit = self.limits.max_prediction_tokens
        self._fits(text, limit, "prediction")
        pred = self.model.tokenize(text, add_special=False)
        if len(pred) > limit:
            raise RequestError(400, f"the prediction has {len(pred)} tokens, more than {limit} "
                               "(--max-prediction-tokens)", "prediction", "invalid_value")
        return pred

    def _text_offset(self, call: ServeRequest) -> int:
        """Where a completion's answer starts in its prompt's text (logprobs'
        text_offset counts from the prompt text's start)."""
        p = call.request.prompt
        if call.chat or call.request.logprobs is None:
            return 0
        return len(p) if isinstance(p, str) else len(self.model.detokenize(p))

    def tokens(self, call: ServeRequest) -> ServeRequest:
        """The request resolved: its prompt and prediction as token ids and
        its grammar as GBNF, checked against the context and the limits
        (runs beside the model thread), as a new value.  A max_tokens of None
        stays (Request.max_tokens: until the end of the turn or a full
        context)."""
        m, req = self.model, call.request
        where = "messages" if call.chat else "prompt"
        try:
            toks = self._prompt_tokens(call, where)
            m.check_request(toks, req.max_tokens, req.sampling)
            pred = self._prediction_tokens(req.prediction) if req.prediction else None
            gbnf = _grammar(call)
            offset = self._text_offset(call)
        except (ConstraintError, tooling.ToolError) as e:
            raise RequestError(400, str(e)[:300], e.param, e.code) from None
        except PromptTooLongError as e:
            raise RequestError(400, str(e), where, "context_length_exceeded") from None
        except ModelClosedError:
            raise shutting_down() from None
        except ConfigError as e:
            raise RequestError(400, str(e)[:300], None, "invalid_value") from None
        resolved = req.but(prompt=toks, prediction=pred, grammar=gbnf, json_schema=None)
        return call.but(request=resolved, text_offset=offset)
