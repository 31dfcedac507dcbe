"""`edgespec serve`: an OpenAI-compatible HTTP server over one SpecModel.

Starlette routes on uvicorn (the `serve` extra).  Endpoints:

    GET  /                      the chat page (edgespec/static/chat.html)
    GET  /health                {"status": "ok", "model": ..., "requests": {counters}}
    GET  /v1/models             the one model this server runs
    GET  /props                 the model, context, drafter and request defaults (llama-server's /props)
    GET  /metrics               Prometheus counters (edgespec/metrics.py)
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
own, from the logits verification computes.  A request without max_tokens
runs to the end of its turn or a full context, unless the server was
started with --max-tokens.  docs/api.md lists every request field.
Mistakes get OpenAI-style error JSON ({"error": {"message", "type",
"param", "code"}}) with a 4xx status.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
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

from .compat import chat_chunk, chat_response, completion_response, new_id, usage
from .errors import ConfigError, PromptTooLongError
from .logprobs import MAX_TOP_LOGPROBS, LogprobFormatter
from .verify import SamplingConfig

MAX_BODY = 64 << 20       # bytes of one request body

# request fields edgespec does not implement, with the values that mean "off"
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0,
            "logit_bias": None, "tools": None, "functions": None, "tool_choice": None, "function_call": None,
            "suffix": None, "echo": False, "best_of": 1, "n": 1}


class RequestError(Exception):
    """A request the server refuses: becomes OpenAI-style error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 etype: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.etype = status, message, param, code, etype
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.etype, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


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
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(400, f"{name} must be a number", name, "invalid_type")
    if v < lo or v > hi or (lo_open and v == lo):
        raise RequestError(400, f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}", name,
                           "invalid_value")
    return v


def _integer(body: dict, name: str, lo: int, default, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(400, f"{name} must be an integer", name, "invalid_type")
    if v < lo:
        raise RequestError(400, f"{name} must be >= {lo}, got {v}", name, "invalid_value")
    if hi is not None and v > hi:
        raise RequestError(400, f"{name} must be <= {hi}, got {v}", name, "invalid_value")
    return v


def _text(content, name: str) -> str:
    """A message content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(400, f"{name} must be a string or a list of text parts", name, "invalid_type")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "messages must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a string role", "messages",
                               "invalid_type")
        content = m.get("content")
        if content is None and m["role"] == "assistant":
            content = ""
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _text(content, f"messages[{i}].content")})
    return out


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


class Server:
    """The ASGI app (self.app) over one loaded SpecModel.

    defaults: the request settings used where a request leaves them out
    (max_tokens, temperature, top_k, top_p, min_p, seed, stop, drafter);
    max_tokens None (the default) runs to the end of the turn or a full context."""

    def __init__(self, model, *, model_id: str, api_key: str | None = None, max_queue: int = 16,
                 defaults: dict | None = None):
        self.model = model
        self.model_id = model_id
        self.aliases = {model_id, model.model_path, model.model_path.rsplit("/", 1)[-1]}
        self.api_key = api_key
        self.max_queue = max_queue
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
        self.metrics = self._new_metrics()
        self.app = Starlette(routes=[
            Route("/", self.page, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/props", self.props, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ], lifespan=self._lifespan, max_body_size=MAX_BODY)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        yield
        await run_in_threadpool(self.close)

    def close(self) -> None:
        """Cancel what runs and close the model (what still waits then fails with 500)."""
        self.model.close()
        self._worker.shutdown(wait=True)

    # ---------------------------------------------------------------- small
    async def page(self, request: Request):
        html = resources.files("edgespec").joinpath("static/chat.html").read_text(encoding="utf-8")
        return HTMLResponse(html)

    async def health(self, request: Request):
        with self._stats_lock:
            stats = dict(self.stats)
        return JSONResponse({"status": "ok", "model": self.model_id, "queued": max(0, self._pending - 1),
                             "running": min(1, self._pending), "requests": stats})

    async def models(self, request: Request):
        try:
            self._authorize(request)
        except RequestError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [{"id": self.model_id, "object": "model",
                                                         "created": self.created, "owned_by": "edgespec"}]})

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise RequestError(401, "invalid or missing API key (Authorization: Bearer KEY)", None,
                               "invalid_api_key")

    def _count(self, key: str, tokens: int | None = None) -> None:
        with self._stats_lock:
            self.stats[key] += 1
            if key == "cancelled":
                self.stats["last_cancelled_tokens"] = tokens

    # ------------------------------------------------- props, metrics, logprobs
    def _new_metrics(self):
        """This server's Prometheus counters, or None without prometheus-client."""
        try:
            from .metrics import ServerMetrics
            return ServerMetrics(lambda: max(0, self._pending - 1), lambda: min(1, self._pending))
        except ImportError:
            return None

    def _counted(self, endpoint: str, response):
        if self.metrics is not None:
            self.metrics.request(endpoint, response.status_code)
        return response

    async def prometheus(self, request: Request):
        """GET /metrics (behind the API key, as llama-server's)."""
        try:
            self._authorize(request)
            if self.metrics is None:
                raise RequestError(501, "/metrics needs prometheus-client: pip install 'edgespec[serve]'", None,
                                   "not_implemented", "server_error")
        except RequestError as e:
            return e.response()
        body, ctype = self.metrics.exposition()
        return Response(body, media_type=ctype)

    async def props(self, request: Request):
        """GET /props: llama-server's fields that apply, plus edgespec's own."""
        try:
            self._authorize(request)
        except RequestError as e:
            return self._counted("/props", e.response())
        m, d = self.model, self.defaults
        n_predict = -1 if d["max_tokens"] is None else d["max_tokens"]
        params = {"n_predict": n_predict, "max_tokens": n_predict, "temperature": d["temperature"],
                  "top_k": d["top_k"], "top_p": d["top_p"], "min_p": d["min_p"],
                  "seed": -1 if d["seed"] is None else d["seed"], "stop": list(d["stop"]), "n_probs": 0}
        drafter = self._drafter_name()
        from . import __version__
        from .backend.llama import llama_cpp_version
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
        try:
            self._authorize(request)
            body = await self._body(request)
            req = self._parse(body, chat)
            req["tokens"] = await run_in_threadpool(self._tokens, req)
            self._admit()
        except RequestError as e:
            if e.status != 503:
                self._count("rejected_bad")
            return e.response()
        cancel = threading.Event()
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._worker.submit(self._job, req, cancel, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item),
                            loop)
        if req["stream"]:
            return StreamingResponse(self._sse(req, queue, cancel), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watch = asyncio.ensure_future(self._watch_disconnect(request, cancel))
        try:
            return await self._collect(req, queue)
        finally:
            watch.cancel()

    async def _body(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON ({e})", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object", None, "invalid_json")
        return body

    def _parse(self, body: dict, chat: bool) -> dict:
        d = self.defaults
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or model not in self.aliases):
            raise RequestError(404, f"the model {model!r} does not exist; this server runs {self.model_id!r}",
                               "model", "model_not_found")
        for name, off in _NEUTRAL.items():
            v = body.get(name)
            if v is not None and v != off:
                raise RequestError(400, f"{name}={v!r} is not supported by edgespec", name, "unsupported")
        max_tokens = _integer(body, "max_completion_tokens", 1, None)
        max_tokens = _integer(body, "max_tokens", 1, max_tokens or d["max_tokens"])    # None: see _tokens
        stop = body.get("stop", d["stop"])
        if isinstance(stop, str):
            stop = [stop]
        if stop is None:
            stop = []
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestError(400, "stop must be a string or a list of strings", "stop", "invalid_type")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(400, "stream must be a boolean", "stream", "invalid_type")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise RequestError(400, "stream_options must be an object", "stream_options", "invalid_type")
        seed = body.get("seed", d["seed"])
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError(400, "seed must be an integer", "seed", "invalid_type")
        sampling = SamplingConfig(temperature=_number(body, "temperature", 0.0, 2.0, d["temperature"]),
                                  top_k=_integer(body, "top_k", 0, d["top_k"]),
                                  top_p=_number(body, "top_p", 0.0, 1.0, d["top_p"], lo_open=True),
                                  min_p=_number(body, "min_p", 0.0, 0.999, d["min_p"]), seed=seed)
        req = {"chat": chat, "stream": stream, "include_usage": bool(opts.get("include_usage")),
               "max_tokens": max_tokens, "stop": stop,
               "sampling": sampling, "prediction": _prediction(body), "model": self.model_id,
               "logprobs": _logprobs(body, chat)}
        if chat:
            req["messages"] = _messages(body)
        else:
            req["prompt"] = self._prompt(body.get("prompt"))
        return req

    @staticmethod
    def _prompt(p):
        """/v1/completions' prompt: a string, token ids, or a list of one of those."""
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return p
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise RequestError(400, "prompt must be a string or a list of token ids (one prompt per request)",
                           "prompt", "invalid_type")

    def _tokens(self, req: dict) -> np.ndarray:
        """The prompt's tokens, checked against the context (runs beside the model thread)."""
        m = self.model
        try:
            if req["chat"]:
                toks = m.prompt_tokens(req["messages"])
            elif isinstance(req["prompt"], str):
                toks = m.tokenize(req["prompt"], add_special=True, parse_special=True)
            else:
                toks = np.asarray(req["prompt"], np.int32)
                if toks.min() < 0 or toks.max() >= m.vocab.n_vocab:
                    raise RequestError(400, "prompt token ids must be in the vocabulary", "prompt", "invalid_value")
            if req["max_tokens"] is None:        # until the end of the turn or a full context
                req["max_tokens"] = max(1, m.n_ctx - len(toks))
            m.check_request(toks, req["max_tokens"], req["sampling"])
        except PromptTooLongError as e:
            raise RequestError(400, str(e), "messages" if req["chat"] else "prompt",
                               "context_length_exceeded") from None
        except ConfigError as e:
            raise RequestError(400, str(e), None, "invalid_value") from None
        return toks

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
        """Run one request on the model thread, handing ("chunk", StreamChunk),
        ("error", RequestError) or ("cancelled", None) to the event loop."""
        t0 = time.perf_counter()
        took = None
        try:
            if cancel.is_set():          # the client left while queued
                self._count("cancelled", 0)
                emit(("cancelled", None))
                return
            toks = req["tokens"]
            last = self._last_prompt
            extends = last is not None and len(toks) > len(last) and np.array_equal(toks[:len(last)], last)
            with self.model.stream(toks, max_tokens=req["max_tokens"], sampling=req["sampling"], stop=req["stop"],
                                   drafter=self.defaults["drafter"], reuse_prefix=bool(extends), cancel=cancel,
                                   prediction=req["prediction"], logprobs=req["logprobs"]) as s:
                self._last_prompt = toks
                for c in s:
                    emit(("chunk", c))
                    if c.result is not None:
                        r = c.result
                        self._count("cancelled" if r.stop_reason == "cancelled" else "completed", r.n_generated)
                        if self.metrics is not None:
                            self.metrics.observe(r)
            took = time.perf_counter() - t0
        except Exception as e:           # llama.cpp failed, or the model was closed
            self._last_prompt = None
            self._count("failed")
            emit(("error", RequestError(500, f"{type(e).__name__}: {e}", None, "internal_error", "server_error")))
        finally:
            loop.call_soon_threadsafe(self._release, took)

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
        n_prompt = len(req["tokens"])
        if req["chat"]:
            d = chat_response(cid, created, req["model"], r.text, r.stop_reason, n_prompt, r.n_generated)
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

        def event(d: dict) -> str:
            return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

        n_tok = n_drafted = 0           # of chunks whose text is still held back (a possible stop string)
        lp, fmt = [], self._formatter(req) if req["logprobs"] is not None else None
        try:
            if chat:
                yield event(chat_chunk(cid, created, name, {"role": "assistant", "content": ""}))
            while True:
                kind, c = await queue.get()
                if kind != "chunk":
                    if kind == "error":
                        yield event({"error": {"message": c.message, "type": c.etype, "code": c.code}})
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
                    yield event(d)
                    continue
                r = c.result
                d = (chat_chunk(cid, created, name, {}, r.stop_reason) if chat
                     else completion_response(cid, created, name, "", r.stop_reason))
                if fmt is not None and lp:
                    d["choices"][0]["logprobs"] = self._logprobs(req, fmt, lp)
                d["usage"] = usage(len(req["tokens"]), r.n_generated)
                d["timings"] = timings(r, self._drafter_name())
                yield event(d)
                if req["include_usage"]:
                    u = (chat_chunk(cid, created, name, {}) if chat
                         else completion_response(cid, created, name, "", None))
                    u["choices"] = []
                    u["usage"] = d["usage"]
                    yield event(u)
                break
            yield "data: [DONE]\n\n"
        finally:
            cancel.set()          # a no-op once the answer is complete


def serve(model, *, host: str = "127.0.0.1", port: int = 8080, model_id: str, api_key: str | None = None,
          max_queue: int = 16, defaults: dict | None = None, log_level: str = "info") -> None:
    """Run the server until interrupted (blocks)."""
    import uvicorn

    server = Server(model, model_id=model_id, api_key=api_key, max_queue=max_queue, defaults=defaults)
    uvicorn.run(server.app, host=host, port=port, log_level=log_level)
