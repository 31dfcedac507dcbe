"""`edgespec serve`: an OpenAI-compatible HTTP server over one SpecModel.

Starlette routes on uvicorn (the `serve` extra).  Endpoints:

    GET  /                      the chat page (edgespec/app/static/chat.html)
    GET  /health                {"status": "ok", "model": ..., "requests": {counters}}
    GET  /v1/models             the one model this server runs
    GET  /props                 the model, context, drafter and request defaults (llama-server's /props)
    GET  /metrics               Prometheus counters (edgespec/app/metrics.py)
    POST /v1/chat/completions   OpenAI chat completions, streamed as server-sent events or not
    POST /v1/completions        OpenAI (legacy) text completions, likewise (`suffix`: fill in the middle)
    POST /completion            llama-server's native completion (edgespec.app.native)
    POST /infill                llama-server's fill-in-the-middle (edgespec.app.native, edgespec.app.infill)

Requests run one at a time on one model thread, from a FIFO queue of at most
`max_queue` waiting requests (a full queue answers 503 with Retry-After);
every answer's X-Queue-Position header says how many requests were ahead of
it when it was admitted (0: it ran at once), /metrics has the queue's depth.
A client that disconnects has its generation cancelled before the next step.
Every request keeps the KV cells of the longest prefix its prompt shares with
the live cache or with a prefix saved in the model's prompt cache
(edgespec.core.prefix_cache) and prefills only the rest (`cache_n`); the
cells of a prefix do not depend on what followed it, so with exact kernels
an answer does not depend on what was served before it.  The log has a line
per request: prompt and cached tokens, prefill time, tokens generated, and
whether the request ran without max_tokens (to the end of its turn or of the
context).

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
names it: edgespec.app.request_fields), then admission to the queue, and
only then is its prompt rendered and tokenized, after a check that its text
could fit the context at all (edgespec.app.request_tokens).  Its answer, JSON
or server-sent events, is edgespec.app.answers'.  docs/serving.md lists every
limit with its default and flag.  On SIGTERM the server stops accepting,
answers what waits with 503, gives the running request --shutdown-timeout
seconds, cancels it, exits 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgespec.app.answers import CANCELLED, STARTED, Answers, Event, receive
from edgespec.app.guard import Access, Guard, error_body
from edgespec.app.native import NativeAnswers
from edgespec.app.native import parse as native_request
from edgespec.app.request_fields import (SERVE_DEFAULTS, Limits, RequestError, RequestParser, ServeRequest,
                                         parse_json, shutting_down)
from edgespec.app.request_tokens import RequestTokenizer
from edgespec.core import params
from edgespec.errors import ConfigError, ModelClosedError

log = logging.getLogger("edgespec.app.server")


def pacer_waits(model) -> dict | None:
    """How long requests waited for the background calibration's slices
    (milliseconds: n, p50, p95, max; None without a pacer)."""
    pacer = getattr(model, "_pacer", None)
    if pacer is None:
        return None
    w = sorted(1000 * x for x in list(pacer.waits))
    at = (lambda q: round(w[min(len(w) - 1, int(q * (len(w) - 1) + 0.5))], 2)) if w else (lambda q: None)
    return {"n": len(w), "interrupts": pacer.interrupts, "p50": at(0.5), "p95": at(0.95), "max": at(1.0)}


def _internal(what: str) -> RequestError:
    """A failure the client cannot fix: its details go to the server's log only."""
    log.exception("edgespec serve: %s failed", what)
    return RequestError(500, "internal error (details are in the server's log)", None, "internal_error",
                        "server_error")


async def _http_error(request: Request, exc) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    return Response(error_body(exc.status_code, f"{request.method} {request.url.path[:100]!a}: {exc.detail}",
                               code), status_code=exc.status_code, media_type="application/json")


class Server:
    """The ASGI app (self.app) over one loaded SpecModel.

    defaults: the Request whose fields a request gets where it leaves them
    out (max_tokens, sampling, stop, drafter, reuse_prefix); None:
    SERVE_DEFAULTS (max_tokens None: to the end of the turn or a full context).
    limits: what a request may ask for (Limits); access: who may ask
    (edgespec.app.guard.Access; by default loopback names, no CORS, api_key)."""

    def __init__(self, model, *, model_id: str, api_key: str | None = None, max_queue: int = 16,
                 defaults: params.Request | None = None, limits: Limits | None = None,
                 access: Access | None = None):
        self.model = model
        self.model_id = model_id
        self.max_queue = max_queue
        self.n_ctx = model.n_ctx
        self.limits = (limits or Limits()).resolve(self.n_ctx)
        self.defaults = defaults if defaults is not None else SERVE_DEFAULTS
        self.parser = RequestParser(model, model_id, self.defaults, self.limits)
        self.tokenizer = RequestTokenizer(model, self.limits)
        self.answers = Answers(model, self.defaults, lambda: self._draining)
        self.native = NativeAnswers(self.answers)
        self.created = int(time.time())
        # requests at once: the model's parallel slots (edgespec.app.scheduler), each read by a worker here
        self.parallel = int(getattr(getattr(model, "run_config", None), "parallel", 1))
        self._worker = ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="edgespec-model")
        self._pending = 0                    # running + queued requests (event loop thread only)
        self._avg_s = 2.0                    # moving average of a request's time, for Retry-After
        self._stats_lock = threading.Lock()
        self.stats = {"completed": 0, "cancelled": 0, "failed": 0, "rejected_busy": 0, "rejected_bad": 0,
                      "last_cancelled_tokens": None}
        self._draining = False               # SIGTERM came: admit nothing more
        self._jobs_lock = threading.Lock()   # guards the next two
        self._waiting: dict[int, tuple] = {} # admitted requests not started: id -> (cancel, emit)
        self._running: set[threading.Event] = set()    # the cancel events of the running requests
        self.metrics = self._new_metrics()
        self.app = Starlette(routes=[
            Route("/", self.page, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/props", self.props, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/completion", self.native_completion, methods=["POST"]),
            Route("/infill", self.infill, methods=["POST"]),
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

    # ---------------------------------------------------------------- small
    async def page(self, request: Request):
        html = resources.files("edgespec.app").joinpath("static/chat.html").read_text(encoding="utf-8")
        return HTMLResponse(html)

    async def health(self, request: Request):
        with self._stats_lock:
            stats = dict(self.stats)
        return JSONResponse({"status": "ok", "model": self.model_id, "queued": self._queued(),
                             "running": min(self.parallel, self._pending), "requests": stats,
                             "calibration": getattr(self.model, "calibration_state", None),
                             "calibration_waits_ms": pacer_waits(self.model)})

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": self.model_id, "object": "model",
                                                         "created": self.created, "owned_by": "edgespec"}]})

    def _count(self, key: str, tokens: int | None = None) -> None:
        with self._stats_lock:
            self.stats[key] += 1
            if key == "cancelled":
                self.stats["last_cancelled_tokens"] = tokens

    # ------------------------------------------------------ props, metrics
    def _new_metrics(self):
        """This server's Prometheus counters, or None without prometheus-client."""
        try:
            from edgespec.app.metrics import ServerMetrics
            def cache_stats() -> dict:      # the model's cache now (use_prompt_cache replaces it)
                cache = getattr(self.model, "prefix_cache", None)
                return cache.stats() if cache is not None else {}
            return ServerMetrics(self._queued, lambda: min(self.parallel, self._pending), cache_stats)
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
        m, d, sp = self.model, self.defaults, self.defaults.sampling
        n_predict = -1 if d.max_tokens is None else d.max_tokens
        params = {"n_predict": n_predict, "max_tokens": n_predict, "temperature": sp.temperature,
                  "top_k": sp.top_k, "top_p": sp.top_p, "min_p": sp.min_p,
                  "seed": -1 if sp.seed is None else sp.seed, "stop": list(d.stop), "n_probs": 0}
        drafter = self.answers.drafter_name()
        from edgespec.version import __version__
        from edgespec.backend.process import llama_cpp_version
        return self._counted("/props", JSONResponse({
            "default_generation_settings": {"id": 0, "n_ctx": m.n_ctx, "model": self.model_id,
                                            "speculative": drafter != "none", "params": params},
            "total_slots": 1, "model_path": m.model_path, "chat_template": m.vocab.chat_template() or "",
            "modalities": {"vision": False, "audio": False},
            "build_info": f"edgespec {__version__}, llama-cpp-python {llama_cpp_version()}",
            "edgespec": {"drafter": drafter, "verify": m.config.verify.mode, "kernels": m.kernels,
                         "max_nodes": m.config.max_nodes, "exact": m.exact, "max_queue": self.max_queue}}))

    # ------------------------------------------------------------ endpoints
    async def chat_completions(self, request: Request):
        return self._counted("/v1/chat/completions", await self._handle(request, chat=True))

    async def completions(self, request: Request):
        return self._counted("/v1/completions", await self._handle(request, chat=False))

    async def native_completion(self, request: Request):
        return self._counted("/completion", await self._handle(request, chat=False, native="completion"))

    async def infill(self, request: Request):
        return self._counted("/infill", await self._handle(request, chat=False, native="infill"))

    async def _handle(self, request: Request, chat: bool, native: str = ""):
        """Parse and check, admit, tokenize, queue, answer: the cheap refusals
        first, the tokenizer only for a request that holds a queue slot."""
        try:
            body = await self._body(request)
            call = native_request(self.parser, body, native) if native else self.parser.parse(body, chat)
            ahead = self._admit()
        except RequestError as e:
            if e.status != 503:
                self._count("rejected_bad")
            return e.response()
        except Exception:
            return _internal("checking a request").response()
        try:
            call = await run_in_threadpool(self.tokenizer.tokens, call)
        except Exception as e:
            self._release(None)
            if not isinstance(e, RequestError):
                return _internal("tokenizing a request").response()
            if e.status != 503:
                self._count("rejected_bad")
            return e.response()
        response = await self._queue(request, call, ahead)
        response.headers["X-Queue-Position"] = str(ahead)
        return response

    async def _queue(self, request: Request, call: ServeRequest, ahead: int = 0):
        """Hand an admitted request to the model thread and answer it (ahead:
        the requests running or waiting before it)."""
        if ahead:
            log.info("request queued: %d ahead of it (the running one and %d waiting)", ahead, ahead - 1)
        if self._draining:
            self._release(None)
            return shutting_down().response()
        cancel = threading.Event()
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        with self._jobs_lock:
            self._waiting[id(cancel)] = (cancel, emit)
        self._worker.submit(self._job, call, cancel, emit, loop)
        watch = asyncio.ensure_future(self._watch_disconnect(request, cancel))
        try:
            try:
                await receive(queue)                # STARTED once the model runs it
            except RequestError as e:
                return e.response()
            answers = self.native if call.native else self.answers
            if call.stream:
                # the status is sent once the model has started: an error before that gets its own
                events = (self.answers.sse_tools if call.tools is not None else answers.sse)(call, queue, cancel)
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return await answers.collect(call, queue)
        finally:
            watch.cancel()

    async def _body(self, request: Request) -> dict:
        """The JSON object of a request (its size already bounded by the
        Guard), parsed beside the event loop."""
        return await run_in_threadpool(parse_json, await request.body())

    def _admit(self) -> int:
        """Take a place in the queue (503 with Retry-After when it is full); returns how many requests are ahead."""
        if self._pending >= self.max_queue + self.parallel:
            self._count("rejected_busy")
            wait = max(1, math.ceil(self._avg_s * self._pending / self.parallel))
            raise RequestError(503, f"the server is busy ({self._queued()} requests queued); retry later",
                               None, "server_busy", "server_error", {"Retry-After": str(wait)})
        self._pending += 1
        return self._pending - 1

    def _queued(self) -> int:
        """Admitted requests that wait for a slot."""
        return max(0, self._pending - self.parallel)

    def _release(self, seconds: float | None) -> None:
        self._pending -= 1
        if seconds is not None:
            self._avg_s = 0.8 * self._avg_s + 0.2 * seconds

    # ---------------------------------------------------------- model thread
    def _job(self, call: ServeRequest, cancel: threading.Event, emit, loop) -> None:
        """Run one request on the model thread, handing its Events (answers.Event)
        to the event loop: STARTED, then its chunks; or an error, or CANCELLED."""
        t0 = time.perf_counter()
        took = None
        with self._jobs_lock:
            mine = self._waiting.pop(id(cancel), None) is not None     # else answered 503 at shutdown
            if mine:
                self._running.add(cancel)
        try:
            if mine and cancel.is_set():    # the client left while queued
                self._count("cancelled", 0)
                emit(CANCELLED)
            elif mine:
                self._run(call, cancel, emit)
                took = time.perf_counter() - t0
        except Exception as e:
            if isinstance(e, ModelClosedError):
                err = shutting_down()
            elif isinstance(e, ConfigError):     # a drafter the model cannot build, or the like
                err = RequestError(400, str(e)[:300], None, "invalid_value")
            else:                        # llama.cpp failed, or a bug: the details go to the log
                self._count("failed")
                err = _internal("a generation")
            emit(Event("error", error=err))
        finally:
            if took is None and call.resolved is not None:
                call.resolved.close()       # it never ran (or failed): its grammar is freed now
            with self._jobs_lock:
                self._running.discard(cancel)
            try:
                loop.call_soon_threadsafe(self._release, took)
            except RuntimeError:        # its loop has ended (a test client's loop per request): nothing else runs there
                self._release(took)

    def _run(self, call: ServeRequest, cancel: threading.Event, emit) -> None:
        """Run the request (resolved to token ids and GBNF) with the model,
        handing its chunks to the event loop; cancel: the client left."""
        to_end = call.request.max_tokens is None      # runs to the end of its turn or the context
        assert call.resolved is not None
        with self.model.run_stream(call.resolved.but(cancel=cancel)) as s:
            emit(STARTED)
            for c in s:
                if c.result is not None:        # counted and logged before the client has the answer
                    self._ended(c.result, to_end)
                emit(Event("chunk", chunk=c))

    def _ended(self, r, to_end: bool) -> None:
        """Count and log a generation that ended (to_end: its request gave no
        max_tokens, so it could run to the end of the context)."""
        self._count("cancelled" if r.stop_reason == "cancelled" else "completed", r.n_generated)
        if self.metrics is not None:
            self.metrics.observe(r, to_end)
        log.info("request: prompt %d tokens (%d cached), prefill %.0f ms; generated %d tokens in %.2f s "
                 "(%.1f tok/s), stop: %s%s", r.n_prompt_tokens, r.n_reused_tokens, r.prefill_s * 1e3,
                 r.n_generated, r.decode_s, r.tokens_per_s, r.stop_reason,
                 "; no max_tokens given: ran until the end of its turn or of the context" if to_end else "")

    def begin_shutdown(self) -> None:
        """On the event loop when the server stops: admit nothing more, answer
        the admitted requests that have not started with 503, and cancel the
        running one after limits.shutdown_timeout seconds."""
        self._draining = True
        with self._jobs_lock:
            waiting, self._waiting = self._waiting, {}
            running = list(self._running)
        for cancel, emit in waiting.values():
            cancel.set()
            emit(Event("error", error=shutting_down()))
        for r in running:
            asyncio.get_running_loop().call_later(self.limits.shutdown_timeout, r.set)

    # ------------------------------------------------------------ the client
    async def _watch_disconnect(self, request: Request, cancel: threading.Event) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                cancel.set()
                return


def _uvicorn_server(config, app: Server):
    """uvicorn's Server, telling ours when it starts to shut down (before it
    waits for the open requests)."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            app.begin_shutdown()
            await super().shutdown(sockets)
    return _Server(config)


def _log_to_stderr() -> None:
    """The server's lines (a request's tokens and times, its queue position) on stderr, once."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s edgespec serve: %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def serve(model, *, host: str = "127.0.0.1", port: int = 8080, model_id: str, api_key: str | None = None,
          max_queue: int = 16, defaults: params.Request | None = None, log_level: str = "info",
          limits: Limits | None = None,
          allow_hosts=(), cors=()) -> None:
    """Run the server until SIGTERM or Ctrl-C (blocks); returns normally then."""
    import uvicorn

    server = Server(model, model_id=model_id, max_queue=max_queue, defaults=defaults, limits=limits,
                    access=Access(host, allow_hosts, cors, api_key))
    _log_to_stderr()
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
