"""`edgespec serve`: an OpenAI-compatible HTTP server over one SpecModel.

Starlette routes on uvicorn (the `serve` extra).  Endpoints:

    GET  /                      the chat page (edgespec/app/static/chat.html)
    GET  /health                {"status": "ok", "model": ..., "requests": {counters}}
    GET  /v1/models             the one model this server runs
    GET  /props                 the model, context, drafter and request defaults (llama-server's /props)
    GET  /metrics               Prometheus counters (edgespec/app/metrics.py)
    POST /v1/chat/completions   OpenAI chat completions, streamed as server-sent events or not
    POST /v1/completions        OpenAI (legacy) text completions, likewise

Requests run one at a time on one model thread, from a FIFO queue of at most
`max_queue` waiting requests (a full queue answers 503 with Retry-After).  A
client that disconnects has its generation cancelled before the next step.  A
request whose prompt extends the previous request's prompt (the next turn of
the same conversation) keeps the KV cache of their common prefix; any other
request starts from an empty cache, so its answer does not depend on what was
served before it.

Every response has `timings` with llama-server's field names (prompt_n,
prompt_ms, predicted_n, predicted_ms, predicted_per_second, draft_n,
draft_n_accepted, cache_n, ...) plus edgespec's own (tokens_per_step, steps,
drafter); a stream has them on its last chunk.  Every streamed chunk that
carries text also carries `edgespec.spans`: that text cut into runs
[text, from_draft], from_draft true where the tokens arrived as accepted
drafts.  `prediction: {"type": "content", "content": ...}` (OpenAI's Predicted
Outputs) is drafted from, losslessly.  `logprobs` (chat: `logprobs: true`
with `top_logprobs` 0..20; completions: `logprobs` 0..20) are the model's
own, from the logits verification computes.  `response_format`,
`json_schema` and `grammar` constrain the answer to a grammar (converted
and bounded beside the event loop, compiled by the SpecModel on the model
thread: edgespec.app.structured); chat's `tools` / `tool_choice` render tools
with the model's template and answer `tool_calls` (edgespec.app.tools).  A
request without max_tokens runs to the end of its turn or a full context,
unless the server was started with --max-tokens.  docs/api.md lists every
request field.
Mistakes get OpenAI-style error JSON ({"error": {"message", "type",
"param", "code"}}) with a 4xx status; an unexpected failure is a 500 whose
details stay in the server's log.

Before any work a request passes edgespec.app.guard (Host, Origin, API key,
Content-Type, body size), then the checks of its fields (every field is
honoured, or accepted only at its "off" value, or refused with a 400 that
names it: HONOURED and _NEUTRAL), then admission to the queue, and only then
is its prompt rendered and tokenized, after a check that its text could fit
the context at all.  docs/serving.md lists every limit with its default and
flag.  On SIGTERM the server stops accepting, answers what waits with 503,
gives the running request --shutdown-timeout seconds, cancels it, exits 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import math
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgespec.app import tools as tooling
from edgespec.backend.grammar import MAX_GRAMMAR_BYTES
from edgespec.app.compat import chat_chunk, chat_response, completion_response, new_id, usage
from edgespec.errors import ConfigError, ModelClosedError, PromptTooLongError
from edgespec.app.guard import Access, Guard, error_body
from edgespec.core.logprobs import MAX_TOP_LOGPROBS, LogprobFormatter
from edgespec.app.structured import ConstraintError, grammar_text, response_format_schema, schema_gbnf
from edgespec.core.verify import SamplingConfig

log = logging.getLogger("edgespec.app.server")

BODY_BASE = 1 << 20        # default body limit: this many bytes ...
BODY_PER_TOKEN = 64        # ... plus this many per context token
PREDICTION_CONTEXTS = 2    # default prediction limit: this many contexts' worth of tokens
INT_MAX = 2**31 - 1        # the largest count, id or top_k a request may give

# The request fields of both endpoints.  HONOURED ones are read by _parse (the
# last six are accepted and change nothing: edgespec stores, meters and
# routes nothing); a field of _NEUTRAL is not implemented and accepted only
# at one of its "off" values; any other field gets a 400 that names it.
# Implementing a field is moving its name from _NEUTRAL to HONOURED.  tools
# and tool_choice are honoured by chat only: on /v1/completions (no chat
# template to render them) they are accepted only off.
HONOURED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_k", "top_p",
            "min_p", "seed", "stop", "stream", "stream_options", "prediction", "logprobs", "top_logprobs",
            "response_format", "grammar", "json_schema", "tools", "tool_choice",
            "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
_NEUTRAL = {"frequency_penalty": (0,), "presence_penalty": (0,), "n": (1,), "best_of": (1,), "echo": (False,),
            "suffix": (None, ""), "logit_bias": (None, {}),
            "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
            "function_call": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
            "modalities": (None, ["text"]), "audio": (None,), "reasoning_effort": (None,), "verbosity": (None,),
            "web_search_options": (None,)}
_ONLY = {"messages": True, "prompt": False, "tools": True, "tool_choice": True}   # one endpoint's only (chat: True)


@dataclasses.dataclass
class Limits:
    """What one request may ask for (docs/serving.md; each has a `serve` flag).
    None: derived from the context size n_ctx (see resolve())."""
    max_body_bytes: int | None = None     # BODY_BASE + BODY_PER_TOKEN * n_ctx
    max_stop: int = 16                    # stop strings per request
    max_stop_chars: int = 1000            # characters of one stop string
    max_prediction_tokens: int | None = None   # PREDICTION_CONTEXTS * n_ctx
    shutdown_timeout: float = 5.0         # seconds the running request gets on SIGTERM

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


def _utf8_len(s: str, name: str) -> int:
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


def _shutting_down() -> RequestError:
    return RequestError(503, "the server is shutting down; retry later", None, "server_shutting_down",
                        "server_error", {"Retry-After": "5"})


def _internal(what: str) -> RequestError:
    """A failure the client cannot fix: its details go to the server's log only."""
    log.exception("edgespec serve: %s failed", what)
    return RequestError(500, "internal error (details are in the server's log)", None, "internal_error",
                        "server_error")


def timings(r, drafter: str) -> dict:
    """A GenerationResult's timings under llama-server's names, plus edgespec's."""
    prompt_n = r.n_prompt_tokens - r.n_reused_tokens
    prompt_ms, pred_ms = r.prefill_s * 1e3, r.decode_s * 1e3
    return {"cache_n": r.n_reused_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / r.prefill_s if r.prefill_s > 0 else 0.0,
            "predicted_n": r.n_generated, "predicted_ms": pred_ms,
            "predicted_per_token_ms": pred_ms / (r.n_generated - 1) if r.n_generated > 1 else 0.0,
            "predicted_per_second": r.tokens_per_s,
            "draft_n": r.n_draft_nodes, "draft_n_accepted": r.n_draft_accepted,
            "tokens_per_step": r.mean_accepted, "steps": r.n_steps, "drafter": drafter}


# ------------------------------------------------------------ request parsing
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
        _utf8_len(content, name)
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
        _utf8_len(s, "stop")
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
        _utf8_len(m["role"], "messages")
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
    here; converting and bounding run beside the event loop (_grammar)."""
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
        if _utf8_len(g, "grammar") > MAX_GRAMMAR_BYTES:
            raise RequestError(400, f"the grammar has more than {MAX_GRAMMAR_BYTES} bytes", "grammar",
                               "invalid_value")
        given.append(("grammar", g))
    if len(given) > 1:
        (a, _), (b, _) = given[:2]
        raise RequestError(400, f"give one of response_format, json_schema and grammar, not both {a} and {b}", b,
                           "invalid_value")
    return given[0] if given else None


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


def _max_piece_bytes(vocab) -> int:
    """The most bytes of text one token stands for (control tokens as their
    text).  Tokenizing keeps every byte of a text (byte-level BPE and
    SentencePiece do), so a text of B bytes needs at least B / this tokens:
    what is longer than n_ctx times this cannot fit the context."""
    return max(1, max(len(vocab.piece(t, special=True)) for t in range(vocab.n_vocab)))


async def _http_error(request: Request, exc) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    return Response(error_body(exc.status_code, f"{request.method} {request.url.path[:100]!a}: {exc.detail}",
                               code), status_code=exc.status_code, media_type="application/json")


class Server:
    """The ASGI app (self.app) over one loaded SpecModel.

    defaults: the request settings used where a request leaves them out
    (max_tokens, temperature, top_k, top_p, min_p, seed, stop, drafter);
    max_tokens None (the default) runs to the end of the turn or a full context.
    limits: what a request may ask for (Limits); access: who may ask
    (edgespec.app.guard.Access; by default loopback names, no CORS, api_key)."""

    def __init__(self, model, *, model_id: str, api_key: str | None = None, max_queue: int = 16,
                 defaults: dict | None = None, limits: Limits | None = None, access: Access | None = None):
        self.model = model
        self.model_id = model_id
        self.aliases = {model_id, model.model_path, model.model_path.rsplit("/", 1)[-1]}
        self.max_queue = max_queue
        self.n_ctx, self.n_vocab = model.n_ctx, model.vocab.n_vocab
        self.limits = (limits or Limits()).resolve(self.n_ctx)
        self.max_piece = _max_piece_bytes(model.vocab)
        self.defaults = {"max_tokens": None, "temperature": 0.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                         "seed": None, "stop": [], "drafter": None, **(defaults or {})}
        self.created = int(time.time())
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgespec-model")
        self._pending = 0                    # running + queued requests (event loop thread only)
        self._avg_s = 2.0                    # moving average of a request's time, for Retry-After
        self._last_prompt: np.ndarray | None = None     # the model thread's
        self._stats_lock = threading.Lock()
        self.stats = {"completed": 0, "cancelled": 0, "failed": 0, "rejected_busy": 0, "rejected_bad": 0,
                      "last_cancelled_tokens": None}
        self._draining = False               # SIGTERM came: admit nothing more
        self._jobs_lock = threading.Lock()   # guards the next two
        self._waiting: dict[int, tuple] = {} # admitted requests not started: id -> (cancel, emit)
        self._running: threading.Event | None = None   # the cancel event of the running request
        self.metrics = self._new_metrics()
        self.app = Starlette(routes=[
            Route("/", self.page, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/props", self.props, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ], lifespan=self._lifespan, exception_handlers={404: _http_error, 405: _http_error})
        self.app = Guard(self.app, access or Access(api_key=api_key), self.limits.max_body_bytes)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        yield
        await run_in_threadpool(self.close)

    def close(self) -> None:
        """Cancel what runs and close the model (what still waits then fails with 500)."""
        self.model.close()
        self._worker.shutdown(wait=True)

    @functools.cached_property
    def chat_template(self) -> str | None:
        return self.model.vocab.chat_template()

    # ---------------------------------------------------------------- small
    async def page(self, request: Request):
        html = resources.files("edgespec.app").joinpath("static/chat.html").read_text(encoding="utf-8")
        return HTMLResponse(html)

    async def health(self, request: Request):
        with self._stats_lock:
            stats = dict(self.stats)
        return JSONResponse({"status": "ok", "model": self.model_id, "queued": max(0, self._pending - 1),
                             "running": min(1, self._pending), "requests": stats})

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": self.model_id, "object": "model",
                                                         "created": self.created, "owned_by": "edgespec"}]})

    def _count(self, key: str, tokens: int | None = None) -> None:
        with self._stats_lock:
            self.stats[key] += 1
            if key == "cancelled":
                self.stats["last_cancelled_tokens"] = tokens

    # ------------------------------------------------- props, metrics, logprobs
    def _new_metrics(self):
        """This server's Prometheus counters, or None without prometheus-client."""
        try:
            from edgespec.app.metrics import ServerMetrics
            return ServerMetrics(lambda: max(0, self._pending - 1), lambda: min(1, self._pending))
        except ImportError:
            return None

    def _counted(self, endpoint: str, response):
        if self.metrics is not None:
            self.metrics.request(endpoint, response.status_code)
        return response

    async def prometheus(self, request: Request):
        """GET /metrics (behind the API key, as llama-server's: edgespec.app.guard.KEYED)."""
        if self.metrics is None:
            return RequestError(501, "/metrics needs prometheus-client: pip install 'edgespec[serve]'", None,
                                "not_implemented", "server_error").response()
        body, ctype = self.metrics.exposition()
        return Response(body, media_type=ctype)

    async def props(self, request: Request):
        """GET /props: llama-server's fields that apply, plus edgespec's own
        (behind the API key: edgespec.app.guard.KEYED)."""
        m, d = self.model, self.defaults
        n_predict = -1 if d["max_tokens"] is None else d["max_tokens"]
        params = {"n_predict": n_predict, "max_tokens": n_predict, "temperature": d["temperature"],
                  "top_k": d["top_k"], "top_p": d["top_p"], "min_p": d["min_p"],
                  "seed": -1 if d["seed"] is None else d["seed"], "stop": list(d["stop"]), "n_probs": 0}
        drafter = self._drafter_name()
        from edgespec import __version__
        from edgespec.backend.llama import llama_cpp_version
        return self._counted("/props", JSONResponse({
            "default_generation_settings": {"id": 0, "n_ctx": m.n_ctx, "model": self.model_id,
                                            "speculative": drafter != "none", "params": params},
            "total_slots": 1, "model_path": m.model_path, "chat_template": m.vocab.chat_template() or "",
            "modalities": {"vision": False, "audio": False},
            "build_info": f"edgespec {__version__}, llama-cpp-python {llama_cpp_version()}",
            "edgespec": {"drafter": drafter, "verify": m.config.verify.mode, "kernels": m.kernels,
                         "max_nodes": m.config.max_nodes, "exact": m.exact, "max_queue": self.max_queue}}))

    def _formatter(self, req: dict) -> LogprobFormatter:
        """Offsets of a completion's text_offset count from the prompt text's start."""
        base = 0
        if not req["chat"]:
            p = req["prompt"]
            base = len(p) if isinstance(p, str) else len(self.model.detokenize(p))
        return LogprobFormatter(self.model.vocab, base)

    @staticmethod
    def _logprobs(req: dict, fmt: LogprobFormatter, entries: list) -> dict:
        return fmt.chat(entries) if req["chat"] else fmt.completion(entries)

    # ------------------------------------------------------------ endpoints
    async def chat_completions(self, request: Request):
        return self._counted("/v1/chat/completions", await self._handle(request, chat=True))

    async def completions(self, request: Request):
        return self._counted("/v1/completions", await self._handle(request, chat=False))

    async def _handle(self, request: Request, chat: bool):
        """Parse and check, admit, tokenize, queue, answer: the cheap refusals
        first, the tokenizer only for a request that holds a queue slot."""
        try:
            req = self._parse(await self._body(request), chat)
            self._admit()
        except RequestError as e:
            if e.status != 503:
                self._count("rejected_bad")
            return e.response()
        except Exception:
            return _internal("checking a request").response()
        try:
            req["tokens"], req["prediction"] = await run_in_threadpool(self._tokens, req)
        except Exception as e:
            self._release(None)
            if not isinstance(e, RequestError):
                return _internal("tokenizing a request").response()
            if e.status != 503:
                self._count("rejected_bad")
            return e.response()
        return await self._queue(request, req)

    async def _queue(self, request: Request, req: dict):
        """Hand an admitted request to the model thread and answer it."""
        if self._draining:
            self._release(None)
            return _shutting_down().response()
        cancel = threading.Event()
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        with self._jobs_lock:
            self._waiting[id(cancel)] = (cancel, emit)
        self._worker.submit(self._job, req, cancel, emit, loop)
        watch = asyncio.ensure_future(self._watch_disconnect(request, cancel))
        try:
            kind, item = await queue.get()          # ("started", None) once the model runs it
            if kind == "error":
                return item.response()
            if kind == "cancelled":
                return RequestError(499, "cancelled", None, "cancelled").response()
            if req["stream"]:
                # the status is sent once the model has started: an error before that gets its own
                events = (self._sse_tools if req["tools"] is not None else self._sse)(req, queue, cancel)
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return await self._collect(req, queue)
        finally:
            watch.cancel()

    async def _body(self, request: Request) -> dict:
        """The JSON object of a request (its size already bounded by the
        Guard), parsed beside the event loop."""
        raw = await request.body()
        try:
            body = await run_in_threadpool(json.loads, raw)
        except json.JSONDecodeError as e:
            raise RequestError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column "
                               f"{e.colno}", None, "invalid_json") from None
        except (ValueError, RecursionError):     # not UTF-8; a number of > 4300 digits; nested too deep
            raise RequestError(400, "the request body is not valid JSON, or nests deeper than this server "
                               "parses, or has an integer of more than 4300 digits", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object", None, "invalid_json")
        return body

    def _parse(self, body: dict, chat: bool) -> dict:
        d = self.defaults
        _check_fields(body, chat)
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or model not in self.aliases):
            raise RequestError(404, f"the model {_show(model)} does not exist; this server runs "
                               f"{self.model_id!a}", "model", "model_not_found")
        max_tokens = _integer(body, "max_completion_tokens", 1, None)
        max_tokens = _integer(body, "max_tokens", 1, max_tokens or d["max_tokens"])    # None: see _tokens
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(400, "stream must be a boolean", "stream", "invalid_type")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise RequestError(400, "stream_options must be an object like {\"include_usage\": true}",
                               "stream_options", "invalid_type")
        sampling = SamplingConfig(temperature=_number(body, "temperature", 0.0, 2.0, d["temperature"]),
                                  top_k=_integer(body, "top_k", 0, d["top_k"]),
                                  top_p=_number(body, "top_p", 0.0, 1.0, d["top_p"], lo_open=True),
                                  min_p=_number(body, "min_p", 0.0, 0.999, d["min_p"]), seed=_seed(body, d["seed"]))
        req = {"chat": chat, "stream": stream, "include_usage": bool(opts.get("include_usage")),
               "max_tokens": max_tokens, "stop": _stop(body, d["stop"], self.limits),
               "sampling": sampling, "prediction": _prediction(body), "model": self.model_id,
               "logprobs": _logprobs(body, chat), "constraint": _constraint(body), "tools": None}
        if chat:
            req["messages"] = _messages(body)
            req["tools"] = self._tools(body, req["constraint"])
        else:
            req["prompt"] = self._prompt(body.get("prompt"))
        # the field to name when llama.cpp refuses the grammar (on the model thread)
        req["grammar_param"] = "tools" if req["tools"] is not None else (req["constraint"] or (None,))[0]
        return req

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
            _utf8_len(p, "prompt")
            return p
        if not (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
            raise RequestError(400, "prompt must be a string or a list of token ids (one prompt per request)",
                               "prompt", "invalid_type")
        if len(p) >= self.n_ctx:
            raise RequestError(400, f"the prompt has {len(p)} tokens, which does not fit the context of "
                               f"{self.n_ctx} tokens", "prompt", "context_length_exceeded")
        if not all(0 <= t < self.n_vocab for t in p):
            raise RequestError(400, f"prompt token ids must be in 0..{self.n_vocab - 1}", "prompt", "invalid_value")
        return p

    def _fits(self, text: str, n_tokens: int, name: str) -> None:
        """Refuse, before tokenizing it, a text that needs more than n_tokens
        (see _max_piece_bytes)."""
        n = _utf8_len(text, name)
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

    def _tokens(self, req: dict) -> tuple[np.ndarray, np.ndarray | None]:
        """The prompt's and the prediction's tokens, checked against the
        context and the limits (runs beside the model thread)."""
        m = self.model
        where = "messages" if req["chat"] else "prompt"
        tools = req["tools"].tools if req["tools"] is not None else None
        try:
            if req["chat"] and tools:
                self._fits(self._render(req["messages"], tools), self.n_ctx, where)
                toks = tooling.prompt_tokens(m, req["messages"], tools)
            elif req["chat"]:
                self._fits(self._render(req["messages"]), self.n_ctx, where)
                toks = m.prompt_tokens(req["messages"])
            elif isinstance(req["prompt"], str):
                self._fits(req["prompt"], self.n_ctx, where)
                toks = m.tokenize(req["prompt"], add_special=True, parse_special=True)
            else:
                toks = np.asarray(req["prompt"], np.int32)
            if req["max_tokens"] is None:        # until the end of the turn or a full context
                req["max_tokens"] = max(1, m.n_ctx - len(toks))
            m.check_request(toks, req["max_tokens"], req["sampling"])
            pred = None
            if req["prediction"]:
                limit = self.limits.max_prediction_tokens
                self._fits(req["prediction"], limit, "prediction")
                pred = m.tokenize(req["prediction"], add_special=False)
                if len(pred) > limit:
                    raise RequestError(400, f"the prediction has {len(pred)} tokens, more than {limit} "
                                       "(--max-prediction-tokens)", "prediction", "invalid_value")
            req["gbnf"] = _grammar(req)
        except (ConstraintError, tooling.ToolError) as e:
            raise RequestError(400, str(e)[:300], e.param, e.code) from None
        except PromptTooLongError as e:
            raise RequestError(400, str(e), where, "context_length_exceeded") from None
        except ModelClosedError:
            raise _shutting_down() from None
        except ConfigError as e:
            raise RequestError(400, str(e)[:300], None, "invalid_value") from None
        return toks, pred

    def _admit(self) -> None:
        if self._pending >= self.max_queue + 1:
            self._count("rejected_busy")
            wait = max(1, math.ceil(self._avg_s * self._pending))
            raise RequestError(503, f"the server is busy ({self._pending - 1} requests queued); retry later",
                               None, "server_busy", "server_error", {"Retry-After": str(wait)})
        self._pending += 1

    def _release(self, seconds: float | None) -> None:
        self._pending -= 1
        if seconds is not None:
            self._avg_s = 0.8 * self._avg_s + 0.2 * seconds

    # ---------------------------------------------------------- model thread
    def _job(self, req: dict, cancel: threading.Event, emit, loop) -> None:
        """Run one request on the model thread, handing ("started", None), then
        ("chunk", StreamChunk)s, or ("error", RequestError) or ("cancelled",
        None) to the event loop."""
        t0 = time.perf_counter()
        took = None
        with self._jobs_lock:
            mine = self._waiting.pop(id(cancel), None) is not None     # else answered 503 at shutdown
            if mine:
                self._running = cancel
        try:
            if mine and cancel.is_set():    # the client left while queued
                self._count("cancelled", 0)
                emit(("cancelled", None))
            elif mine:
                self._run(req, cancel, emit)
                took = time.perf_counter() - t0
        except Exception as e:
            self._last_prompt = None
            if isinstance(e, ModelClosedError):
                err = _shutting_down()
            elif isinstance(e, ConfigError):     # llama.cpp refused the grammar, or the like
                param = req["grammar_param"] if str(e).startswith("the grammar") else None
                err = RequestError(400, str(e)[:300], param, "invalid_value")
            else:                        # llama.cpp failed, or a bug: the details go to the log
                self._count("failed")
                err = _internal("a generation")
            emit(("error", err))
        finally:
            with self._jobs_lock:
                if self._running is cancel:
                    self._running = None
            loop.call_soon_threadsafe(self._release, took)

    def _run(self, req: dict, cancel: threading.Event, emit) -> None:
        toks = req["tokens"]
        last = self._last_prompt
        extends = last is not None and len(toks) > len(last) and np.array_equal(toks[:len(last)], last)
        with self.model.stream(toks, max_tokens=req["max_tokens"], sampling=req["sampling"], stop=req["stop"],
                               drafter=self.defaults["drafter"], reuse_prefix=bool(extends), cancel=cancel,
                               prediction=req["prediction"], logprobs=req["logprobs"], grammar=req["gbnf"]) as s:
            self._last_prompt = toks
            emit(("started", None))
            for c in s:
                emit(("chunk", c))
                if c.result is not None:
                    r = c.result
                    self._count("cancelled" if r.stop_reason == "cancelled" else "completed", r.n_generated)
                    if self.metrics is not None:
                        self.metrics.observe(r)

    def begin_shutdown(self) -> None:
        """On the event loop when the server stops: admit nothing more, answer
        the admitted requests that have not started with 503, and cancel the
        running one after limits.shutdown_timeout seconds."""
        self._draining = True
        with self._jobs_lock:
            waiting, self._waiting = self._waiting, {}
            running = self._running
        for cancel, emit in waiting.values():
            cancel.set()
            emit(("error", _shutting_down()))
        if running is not None:
            asyncio.get_running_loop().call_later(self.limits.shutdown_timeout, running.set)

    # ------------------------------------------------------------- answers
    async def _watch_disconnect(self, request: Request, cancel: threading.Event) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                cancel.set()
                return

    def _drafter_name(self) -> str:
        d = self.defaults["drafter"]
        return d if isinstance(d, str) else self.model.drafter_name

    async def _collect(self, req: dict, queue: asyncio.Queue):
        text = []
        while True:
            kind, item = await queue.get()
            if kind == "error":
                return item.response()
            if kind == "cancelled":
                return RequestError(499, "cancelled", None, "cancelled").response()
            text.append(item.text)
            if item.result is not None:
                break
        r, cid, created = item.result, new_id("chatcmpl" if req["chat"] else "cmpl"), int(time.time())
        if r.stop_reason == "cancelled" and self._draining:
            return _shutting_down().response()
        n_prompt = len(req["tokens"])
        if req["chat"]:
            d = chat_response(cid, created, req["model"], r.text, r.stop_reason, n_prompt, r.n_generated)
            if req["tools"] is not None:
                msg, finish = tooling.answer(r.text, r.stop_reason, req["tools"])
                d["choices"][0].update(message=msg, finish_reason=finish)
        else:
            d = completion_response(cid, created, req["model"], r.text, r.stop_reason, n_prompt, r.n_generated)
        if req["logprobs"] is not None:
            d["choices"][0]["logprobs"] = self._logprobs(req, self._formatter(req), r.logprobs)
        d["timings"] = timings(r, self._drafter_name())
        return JSONResponse(d)

    async def _sse(self, req: dict, queue: asyncio.Queue, cancel: threading.Event):
        """The server-sent events of a streamed answer; cancelling this
        generator (the client left) cancels the generation."""
        chat, name = req["chat"], req["model"]
        cid, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
        n_tok = n_drafted = 0           # of chunks whose text is still held back (a possible stop string)
        lp, fmt = [], self._formatter(req) if req["logprobs"] is not None else None
        try:
            if chat:
                yield _event(chat_chunk(cid, created, name, {"role": "assistant", "content": ""}))
            while True:
                kind, c = await queue.get()
                if kind != "chunk":
                    if kind == "error":
                        yield _error_event(c)
                    break
                if c.result is None:
                    n_tok, n_drafted = n_tok + len(c.tokens), n_drafted + c.n_drafted
                    lp += c.logprobs or []
                    if not c.text:
                        continue
                    d = (chat_chunk(cid, created, name, {"content": c.text}) if chat
                         else completion_response(cid, created, name, c.text, None))
                    if fmt is not None:
                        d["choices"][0]["logprobs"], lp = self._logprobs(req, fmt, lp), []
                    d["edgespec"] = {"spans": [[t, bool(f)] for t, f in c.spans], "tokens": n_tok,
                                     "drafted": n_drafted}
                    n_tok = n_drafted = 0
                    yield _event(d)
                    continue
                for e in self._tail(req, cid, created, c.result, c.result.stop_reason, lp, fmt):
                    yield e
                break
            yield "data: [DONE]\n\n"
        finally:
            cancel.set()          # a no-op once the answer is complete

    def _tail(self, req: dict, cid: str, created: int, r, finish: str, lp: list, fmt) -> list[str]:
        """A stream's last events: the chunk with finish_reason, usage and
        timings (and the logprobs still held back), then the usage chunk
        if asked for."""
        chat, name = req["chat"], req["model"]
        d = (chat_chunk(cid, created, name, {}, finish) if chat
             else completion_response(cid, created, name, "", finish))
        if fmt is not None and lp:
            d["choices"][0]["logprobs"] = self._logprobs(req, fmt, lp)
        d["usage"] = usage(len(req["tokens"]), r.n_generated)
        d["timings"] = timings(r, self._drafter_name())
        events = [_event(d)]
        if req["include_usage"]:
            u = (chat_chunk(cid, created, name, {}) if chat
                 else completion_response(cid, created, name, "", None))
            u["choices"] = []
            u["usage"] = d["usage"]
            events.append(_event(u))
        return events

    async def _sse_tools(self, req: dict, queue: asyncio.Queue, cancel: threading.Event):
        """The events of a streamed answer to a request with tools: the answer
        is gathered first (a call is known only once its block has closed),
        then sent as its content and tool_calls deltas and the last events
        (its logprobs on the last chunk)."""
        name, cid, created = req["model"], new_id("chatcmpl"), int(time.time())
        fmt = self._formatter(req) if req["logprobs"] is not None else None
        try:
            yield _event(chat_chunk(cid, created, name, {"role": "assistant", "content": ""}))
            while True:
                kind, c = await queue.get()
                if kind == "error":
                    yield _error_event(c)
                if kind != "chunk" or c.result is not None:
                    break
            if kind == "chunk":
                r = c.result
                msg, finish = tooling.answer(r.text, r.stop_reason, req["tools"])
                for delta in tooling.deltas(msg):
                    yield _event(chat_chunk(cid, created, name, delta))
                for e in self._tail(req, cid, created, r, finish, r.logprobs or [], fmt):
                    yield e
            yield "data: [DONE]\n\n"
        finally:
            cancel.set()          # a no-op once the answer is complete


def _event(d: dict) -> str:
    return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"


def _error_event(e: RequestError) -> str:
    return _event({"error": {"message": e.message, "type": e.etype, "code": e.code}})


def _uvicorn_server(config, app: Server):
    """uvicorn's Server, telling ours when it starts to shut down (before it
    waits for the open requests)."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            app.begin_shutdown()
            await super().shutdown(sockets)
    return _Server(config)


def serve(model, *, host: str = "127.0.0.1", port: int = 8080, model_id: str, api_key: str | None = None,
          max_queue: int = 16, defaults: dict | None = None, log_level: str = "info", limits: Limits | None = None,
          allow_hosts=(), cors=()) -> None:
    """Run the server until SIGTERM or Ctrl-C (blocks); returns normally then."""
    import uvicorn

    server = Server(model, model_id=model_id, max_queue=max_queue, defaults=defaults, limits=limits,
                    access=Access(host, allow_hosts, cors, api_key))
    # uvicorn ends the running request after this (a backstop: begin_shutdown cancels it before)
    grace = server.limits.shutdown_timeout + 10
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace)
    # uvicorn raises the signal again once it has stopped: with these handlers that ends serve() normally
    main = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        _uvicorn_server(config, server).run()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
