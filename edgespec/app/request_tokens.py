"""The model-side half of taking a request to `edgespec serve`: the
server's own bounds on its texts (before anything is tokenized), what only
HTTP has (a completion's text prompt with its special tokens, a chat's tools
rendered, a tool call's grammar), then the request resolved once against the
model (SpecModel.resolve: the one check, edgespec.app.resolve), its errors
answered by their type.  This runs beside the event loop and the model
thread, and only for a request that holds a queue slot; the cheap field
checks before it are edgespec.app.request_fields.
"""
from __future__ import annotations

from edgespec.app import tools as tooling
from edgespec.app.infill import Infill
from edgespec.app.request_fields import Limits, RequestError, ServeRequest, shutting_down, utf8_len
from edgespec.errors import ConfigError, GrammarError, ModelClosedError, RequestFieldError


def _grammar(call: ServeRequest):
    """The grammar field the model resolves: a tool call's GBNF for
    tool_choice "required" or a named function (ToolError names the field),
    else the request's own."""
    tools, req = call.tools, call.request
    if tools is not None and tools.mode != "auto":
        return tooling.call_grammar(tools)
    return req.grammar


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

    def _prompt(self, call: ServeRequest, where: str):
        """The prompt the model resolves, its text bounded first: a chat's
        messages as they are (tools rendered into token ids), a completion's
        text as token ids with its special tokens read as such (llama-server's
        and OpenAI's meaning), token ids as given."""
        m, prompt = self.model, call.request.prompt
        tools = call.tools.tools if call.tools is not None else None
        if call.chat and tools:
            self._fits(self._render(prompt, tools), self.n_ctx, where)
            return tooling.prompt_tokens(m, prompt, tools)
        if call.chat:
            self._fits(self._render(prompt), self.n_ctx, where)
            return prompt
        if isinstance(prompt, str):
            self._fits(prompt, self.n_ctx, where)
            return m.tokenize(prompt, add_special=True, parse_special=True)
        return prompt       # token ids; or an Infill, bounded by the body's size and cut to fit where it resolves

    def _check_prediction(self, resolved) -> None:
        """The server's bound on a prediction's tokens (--max-prediction-tokens)."""
        limit = self.limits.max_prediction_tokens
        if resolved.prediction is not None and len(resolved.prediction) > limit:
            resolved.close()
            raise RequestError(400, f"the prediction has {len(resolved.prediction)} tokens, more than {limit} "
                               "(--max-prediction-tokens)", "prediction", "invalid_value")

    def _text_offset(self, call: ServeRequest) -> int:
        """Where a completion's answer starts in its prompt's text (logprobs'
        text_offset counts from the prompt text's start)."""
        p = call.request.prompt
        if call.chat or call.request.logprobs is None:
            return 0
        if isinstance(p, Infill):
            return len(p.prefix)
        return len(p) if isinstance(p, str) else len(self.model.detokenize(p))

    def tokens(self, call: ServeRequest) -> ServeRequest:
        """The request resolved against the model (call.resolved), its texts
        bounded first; every refusal a RequestError naming the field at
        fault.  A max_tokens of None stays (Request.max_tokens: until the end
        of the turn or a full context)."""
        req = call.request
        where = "messages" if call.chat else "prompt"
        try:
            if req.prediction:
                self._fits(req.prediction, self.limits.max_prediction_tokens, "prediction")
            prompt, grammar = self._prompt(call, where), _grammar(call)      # the server's bounds first
            resolved = self.model.resolve(req.but(prompt=prompt, grammar=grammar))
            self._check_prediction(resolved)
            offset = self._text_offset(call)
        except tooling.ToolError as e:
            raise RequestError(400, str(e)[:300], e.param, e.code) from None
        except GrammarError as e:
            param = e.param if call.grammar_param in (None, "grammar") else call.grammar_param
            raise RequestError(400, str(e)[:300], param, e.code) from None
        except RequestFieldError as e:
            param = where if e.param == "prompt" else e.param
            raise RequestError(400, str(e)[:300], param, e.code) from None
        except ModelClosedError:
            raise shutting_down() from None
        except ConfigError as e:
            raise RequestError(400, str(e)[:300], None, "invalid_value") from None
        return call.but(resolved=resolved, text_offset=offset)
