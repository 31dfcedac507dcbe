"""What a request to `edgespec serve` may ask, checked field by field on the
event loop before any work: the table of fields (HONOURED and _NEUTRAL: every
field is honoured, or accepted only at its "off" value, or refused with a 400
that names it), the Limits a request must stay within, one check per field,
and RequestParser, which turns a request body into the one value the server
runs (ServeRequest: a core Request and what only HTTP needs) over the
server's defaults (SERVE_DEFAULTS, which `edgespec serve`'s options change).
Nothing here tokenizes (edgespec.app.request_tokens does, once the request
holds a queue slot).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math

from starlette.responses import Response

from edgespec.app import tools as tooling
from edgespec.app.infill import Infill
from edgespec.app.structured import ConstraintError, response_format_schema
from edgespec.backend.grammar import MAX_GRAMMAR_BYTES
from edgespec.core.logprobs import MAX_TOP_LOGPROBS
from edgespec.core.params import Request, Resolved
from edgespec.core.verify import SamplingConfig

BODY_BASE = 1 << 20        # default body limit: this many bytes ...
BODY_PER_TOKEN = 64        # ... plus this many per context token
PREDICTION_CONTEXTS = 2    # default prediction limit: this many contexts' worth of tokens
INT_MAX = 2**31 - 1        # the largest count, id or top_k a request may give

# The request fields of both endpoints.  HONOURED ones are read by
# RequestParser (the last six are accepted and change nothing: edgespec
# stores, meters and routes nothing); a field of _NEUTRAL is not implemented and accepted only
# at one of its "off" values; any other field gets a 400 that names it.
# Implementing a field is moving its name from _NEUTRAL to HONOURED.  tools
# and tool_choice are honoured by chat only: on /v1/completions (no chat
# template to render them) they are accepted only off; suffix and
# n_cache_reuse by completions only (a chat takes n_cache_reuse 0 alone).
HONOURED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_k", "top_p",
            "min_p", "seed", "stop", "stream", "stream_options", "prediction", "logprobs", "top_logprobs",
            "response_format", "grammar", "json_schema", "tools", "tool_choice", "cache_prompt",
            "suffix", "n_cache_reuse", "user", "metadata", "store", "service_tier", "safety_identifier",
            "prompt_cache_key"}
_NEUTRAL = {"frequency_penalty": (0,), "presence_penalty": (0,), "n": (1,), "best_of": (1,), "echo": (False,),
            "suffix": (None, ""), "logit_bias": (None, {}),
            "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
            "function_call": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
            "modalities": (None, ["text"]), "audio": (None,), "reasoning_effort": (None,), "verbosity": (None,),
            "web_search_options": (None,), "n_cache_reuse": (None, 0)}
_ONLY = {"messages": True, "prompt": False, "suffix": False, "n_cache_reuse": False, "tools": True,
         "tool_choice": True}   # one endpoint's only (chat: True)


SERVE_DEFAULTS = Request(max_tokens=None)
"""What a request to the server gets for a field it leaves out: Request's
defaults, but max_tokens None (until the end of the turn or a full context,
OpenAI's and llama-server's meaning).  `edgespec serve`'s options change
them (app/cli/serve.py: --max-tokens, --temp, ..., --drafter,
--no-cache-prompt, --cache-reuse: a chat request never gets the last, it
stays exact); the server takes the result as its `defaults`."""


@dataclasses.dataclass(frozen=True)
class ServeRequest:
    """One request to `edgespec serve`, built whole by RequestParser.parse
    before any work and never changed after: the Request the model runs and
    what only HTTP needs.  request is as the body asked (the messages, or
    the prompt as text or token ids); RequestTokenizer.tokens resolves it
    once against the model into `resolved` (a new value), which the model
    thread runs and the answer reads (the prompt's token ids)."""
    request: Request
    chat: bool                      # /v1/chat/completions (else /v1/completions)
    model: str                      # the model id the answer names
    stream: bool = False
    include_usage: bool = False     # stream_options.include_usage: a last chunk with the usage
    tools: tooling.ToolRequest | None = None      # the tools a chat may call
    grammar_param: str | None = None    # the field to name when llama.cpp refuses the grammar
    text_offset: int = 0            # a completion's logprobs' text_offset base: the prompt text's length
    resolved: Resolved | None = None    # the request resolved against the model (core.params.Resolved)
    native: str = ""                # llama-server's native endpoint ("completion", "infill": app/native.py), or ""
    response_fields: tuple[str, ...] = ()   # native: the answer's fields to return ("timings/prompt_n"); (): all
    quiet: bool = False             # native n_predict 0: the prompt is read and cached, the answer left empty

    def but(self, **changes) -> "ServeRequest":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class Limits:
    """What one request may ask for (docs/serving.md; each has a `serve` flag).
    None: derived from the context size n_ctx (see resolve())."""
    max_body_bytes: int | None = None     # BODY_BASE + BODY_PER_TOKEN * n_ctx
    max_stop: int = 16                    # stop strings per request
    max_stop_chars: int = 1000            # characters of one stop string
    max_prediction_tokens: int | None = None   # PREDICTION_CONTEXTS * n_ctx
    shutdown_timeout: float = 5.0         # seconds the running request gets on SIGTERM
    fim_suffix_tokens: int | None = None  # an FIM prompt's suffix, at most (None: app/infill.SUFFIX_TOKENS)
    fim_prefix_tokens: int | None = None  # an FIM prompt's prefix, at most (None: as the context allows)
    fim_layout: str = "psm"               # where /infill's `prompt` goes (app/infill.LAYOUTS)

    def resolve(self, n_ctx: int) -> "Limits":
        body = self.max_body_bytes if self.max_body_bytes is not None else BODY_BASE + BODY_PER_TOKEN * n_ctx
        pred = self.max_prediction_tokens
        return dataclasses.replace(self, max_body_bytes=body,
                                   max_prediction_tokens=pred if pred is not None else PREDICTION_CONTEXTS * n_ctx)


def _show(v) -> str:
    """A value of a request, short and ASCII, for an error message."""
    if isinstance(v, (dict, list)):
        return type(v).__name__
    r = ascii(v[:40] if isinstance(v, str) else v)
    return r if len(r) <= 40 else r[:37] + "..."


def utf8_len(s: str, name: str) -> int:
    try:
        return len(s.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise RequestError(400, f"{name} is not valid Unicode (an unpaired surrogate at character {e.start})",
                           name, "invalid_value") from None


class RequestError(Exception):
    """A request the server refuses: becomes OpenAI-style error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 etype: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.etype = status, message, param, code, etype
        self.headers = headers

    def response(self) -> Response:
        # ASCII JSON: a message that quotes a request's text cannot fail to encode
        body = json.dumps({"error": {"message": self.message, "type": self.etype, "param": self.param,
                                     "code": self.code}})
        return Response(body, status_code=self.status, headers=self.headers, media_type="application/json")


def shutting_down() -> RequestError:
    return RequestError(503, "the server is shutting down; retry later", None, "server_shutting_down",
                        "server_error", {"Retry-After": "5"})


def cancelled() -> RequestError:
    """The answer to a request whose client left before it ran (499, nginx's "client closed request")."""
    return RequestError(499, "cancelled", None, "cancelled")


def parse_json(raw: bytes) -> dict:
    """The JSON object of a request body (its size already bounded by the Guard)."""
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column "
                           f"{e.colno}", None, "invalid_json") from None
    except (ValueError, RecursionError):     # not UTF-8; a number of > 4300 digits; nested too deep
        raise RequestError(400, "the request body is not valid JSON, or nests deeper than this server "
                           "parses, or has an integer of more than 4300 digits", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", None, "invalid_json")
    return body


# ------------------------------------------------------------ one field each
def _number(body: dict, name: str, lo: float, hi: float, default, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise RequestError(400, f"{name} must be a finite number", name, "invalid_type")
    # int against float compares exactly in Python: a huge int is out of range, not an OverflowError
    if v < lo or v > hi or (lo_open and v == lo):
        raise RequestError(400, f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {_show(v)}",
                           name, "invalid_value")
    return float(v)


def _integer(body: dict, name: str, lo: int, default, hi: int = INT_MAX):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(400, f"{name} must be an integer", name, "invalid_type")
    if v < lo or v > hi:
        raise RequestError(400, f"{name} must be in [{lo}, {hi}], got {_show(v)}", name, "invalid_value")
    return v


def _seed(body: dict, default):
    """Any integer, reduced modulo 2**32 as llama-cpp-python's uint32 seed is
    (so -1 is 4294967295, its LLAMA_DEFAULT_SEED)."""
    v = body.get("seed", default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(400, "seed must be an integer", "seed", "invalid_type")
    return v % 2**32


def _text(content, name: str) -> str:
    """A message content: a string or a list of text parts."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if isinstance(content, str):
        utf8_len(content, name)
        return content
    raise RequestError(400, f"{name} must be a string or a list of text parts", name, "invalid_type")


def _stop(body: dict, default: list, limits: Limits) -> list[str]:
    stop = body.get("stop", default)
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError(400, "stop must be a string or a list of strings", "stop", "invalid_type")
    if len(stop) > limits.max_stop:
        raise RequestError(400, f"stop has {len(stop)} strings, more than {limits.max_stop} (--max-stop)", "stop",
                           "invalid_value")
    for s in stop:
        if len(s) > limits.max_stop_chars:
            raise RequestError(400, f"a stop string has {len(s)} characters, more than {limits.max_stop_chars} "
                               "(--max-stop-chars)", "stop", "invalid_value")
        utf8_len(s, "stop")
    return stop


def _check_fields(body: dict, chat: bool) -> None:
    """Every field is honoured, or at an "off" value of a field edgespec does
    not implement; anything else is refused by name."""
    for name, v in body.items():
        if name in HONOURED and _ONLY.get(name, chat) == chat:
            continue
        offs = _NEUTRAL.get(name)
        if offs is None:
            where = "/v1/chat/completions" if chat else "/v1/completions"
            raise RequestError(400, f"unknown field {_show(name)} for {where}", name[:100], "unknown_field")
        if not any(v == off and isinstance(v, bool) == isinstance(off, bool) for off in offs):
            raise RequestError(400, f"{name}={_show(v)} is not supported by edgespec (leave it out or set it to "
                               f"{' or '.join(json.dumps(o) for o in offs)})", name, "unsupported")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "messages must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a string role", "messages",
                               "invalid_type")
        utf8_len(m["role"], "messages")
        content = m.get("content")
        if content is None and m["role"] == "assistant":
            content = ""
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _text(content, f"messages[{i}].content"), **_tool_fields(m, i)})
    return out


def _tool_fields(m: dict, i: int) -> dict:
    """A message's fields for tools (an assistant's tool_calls, a tool
    message's tool_call_id and name), as the template gets them."""
    try:
        h = tooling.history_message(m, i)
    except tooling.ToolError as e:
        raise RequestError(400, str(e), e.param, e.code) from None
    return {k: v for k, v in h.items() if k not in ("role", "content")}


def _constraint(body: dict) -> tuple[str, object] | None:
    """The one grammar a request asks for: (field, GBNF text or JSON schema;
    True for any JSON object), or None.  Only types and sizes are checked
    here; converting and bounding run beside the event loop (request_tokens)."""
    given = []
    try:
        schema = response_format_schema(body.get("response_format"))
    except ConstraintError as e:
        raise RequestError(400, str(e), e.param, e.code) from None
    if schema is not None:
        given.append(("response_format", schema))
    js = body.get("json_schema")
    if js is not None:
        if not isinstance(js, dict):
            raise RequestError(400, "json_schema must be a JSON schema object", "json_schema", "invalid_type")
        given.append(("json_schema", js or True))
    g = body.get("grammar")
    if g is not None and g != "":
        if not isinstance(g, str):
            raise RequestError(400, "grammar must be GBNF text (a string)", "grammar", "invalid_type")
        if utf8_len(g, "grammar") > MAX_GRAMMAR_BYTES:
            raise RequestError(400, f"the grammar has more than {MAX_GRAMMAR_BYTES} bytes", "grammar",
                               "invalid_value")
        given.append(("grammar", g))
    if len(given) > 1:
        (a, _), (b, _) = given[:2]
        raise RequestError(400, f"give one of response_format, json_schema and grammar, not both {a} and {b}", b,
                           "invalid_value")
    return given[0] if given else None


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token a request wants with its logprobs, or
    None for no logprobs (chat: logprobs true/false and top_logprobs 0..20;
    completions: logprobs 0..20)."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if top is not None:
            raise RequestError(400, "top_logprobs is a chat field; completions take logprobs: N", "top_logprobs",
                               "unsupported")
        return None if lp is None or lp is False else _integer(body, "logprobs", 0, None, hi=MAX_TOP_LOGPROBS)
    if lp is not None and not isinstance(lp, bool):
        raise RequestError(400, "logprobs must be a boolean (the number of alternatives is top_logprobs)",
                           "logprobs", "invalid_type")
    if not lp:
        if top is not None:
            raise RequestError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        return None
    return _integer(body, "top_logprobs", 0, 0, hi=MAX_TOP_LOGPROBS)


def _prediction(body: dict) -> str | None:
    p = body.get("prediction")
    if p is None:
        return None
    if not isinstance(p, dict) or p.get("type") != "content":
        raise RequestError(400, 'prediction must be {"type": "content", "content": ...}', "prediction",
                           "invalid_type")
    return _text(p.get("content"), "prediction.content") or None


def _sampling(body: dict, d: SamplingConfig) -> SamplingConfig:
    """The request's sampling over the server's default sampling d."""
    return SamplingConfig(temperature=_number(body, "temperature", 0.0, 2.0, d.temperature),
                          top_k=_integer(body, "top_k", 0, d.top_k),
                          top_p=_number(body, "top_p", 0.0, 1.0, d.top_p, lo_open=True),
                          min_p=_number(body, "min_p", 0.0, 0.999, d.min_p), seed=_seed(body, d.seed))


def _stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be a boolean", "stream", "invalid_type")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise RequestError(400, "stream_options must be an object like {\"include_usage\": true}",
                           "stream_options", "invalid_type")
    return stream, bool(opts.get("include_usage"))


def _with_suffix(prompt, suffix, suffix_tokens: int | None = None, prefix_tokens: int | None = None):
    """/v1/completions' prompt with OpenAI's suffix: the Infill of the text
    before and after the answer (filled in the middle: edgespec.app.infill)."""
    if suffix is None or suffix == "":
        return prompt
    if not isinstance(suffix, str):
        raise RequestError(400, "suffix must be a string", "suffix", "invalid_type")
    if not isinstance(prompt, str):
        raise RequestError(400, "suffix needs the prompt as text (fill in the middle)", "suffix", "invalid_value")
    utf8_len(suffix, "suffix")
    return Infill(prompt, suffix, suffix_tokens=suffix_tokens, prefix_tokens=prefix_tokens)


# ------------------------------------------------------------ a whole request
class RequestParser:
    """A request body of one endpoint, checked, into the ServeRequest the
    server runs (the model id, the defaults and the limits of one server)."""

    def __init__(self, model, model_id: str, defaults: Request, limits: Limits):
        self.model, self.model_id, self.defaults, self.limits = model, model_id, defaults, limits

    @functools.cached_property
    def chat_template(self) -> str | None:
        return self.model.vocab.chat_template()

    def parse(self, body: dict, chat: bool) -> ServeRequest:
        d = self.defaults
        _check_fields(body, chat)
        # one model is served: whatever name the app sends (Continue's model:, Aider's openai/<name>)
        # is answered by it, and the answer names it (llama-server does the same)
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise RequestError(400, "model must be a string (the model's name)", "model", "invalid_type")
        max_tokens = _integer(body, "max_completion_tokens", 1, None)
        max_tokens = _integer(body, "max_tokens", 1, max_tokens or d.max_tokens)    # None: to the end
        stream, include_usage = _stream(body)
        sampling = _sampling(body, d.sampling)
        reuse = body.get("cache_prompt", d.reuse_prefix)     # llama-server's name for prefix reuse
        if not isinstance(reuse, bool):
            raise RequestError(400, "cache_prompt must be a boolean", "cache_prompt", "invalid_type")
        stop, prediction, logprobs = _stop(body, list(d.stop), self.limits), _prediction(body), _logprobs(body, chat)
        constraint = _constraint(body)
        field, value = constraint or (None, None)
        prompt = (_messages(body) if chat else
                  _with_suffix(self._prompt(body.get("prompt")), body.get("suffix"), self.limits.fim_suffix_tokens,
                               self.limits.fim_prefix_tokens))
        tools = self._tools(body, constraint) if chat else None
        # llama-server's n_cache_reuse (inexact: core/cache_reuse.py) for completions; a chat stays exact
        cache_reuse = 0 if chat else _integer(body, "n_cache_reuse", 0, d.cache_reuse)
        request = d.but(prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop=tuple(stop),
                        reuse_prefix=reuse, prediction=prediction, logprobs=logprobs, cache_reuse=cache_reuse,
                        grammar=value if field == "grammar" else None,
                        json_schema=value if field not in (None, "grammar") else None)
        return ServeRequest(request, chat, self.model_id, stream, include_usage, tools,
                            "tools" if tools is not None else field)

    def _tools(self, body: dict, constraint) -> tooling.ToolRequest | None:
        """The request's tools, when it may call one (see edgespec.app.tools)."""
        try:
            template = self.chat_template if body.get("tools") else None     # read only when there are tools
            tools = tooling.tool_request(body.get("tools"), body.get("tool_choice"), template)
        except tooling.ToolError as e:
            raise RequestError(400, str(e), e.param, e.code) from None
        if tools is not None and constraint is not None:
            raise RequestError(400, f"tools cannot be combined with {constraint[0]} (the answer is either a "
                               'tool call or follows the format; tool_choice "none" leaves the tools out)',
                               constraint[0], "invalid_value")
        return tools

    def _prompt(self, p):
        """/v1/completions' prompt: a string, token ids, or a list of one of those."""
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            utf8_len(p, "prompt")
            return p
        if not (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
            raise RequestError(400, "prompt must be a string or a list of token ids (one prompt per request)",
                               "prompt", "invalid_type")
        return p        # its ids and length are checked where it is resolved (edgespec.app.resolve)
