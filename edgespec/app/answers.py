"""The answer to one request to `edgespec serve`, from the chunks its
generation hands over: one OpenAI JSON response, or its server-sent events
(each text chunk with edgespec's spans, the last with usage and timings),
with the model's logprobs and tool calls in OpenAI's shapes.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

from starlette.responses import JSONResponse

from edgespec.app import tools as tooling
from edgespec.app.openai_format import (SSE_DONE, chat_chunk, chat_response, completion_response, new_id, sse_error,
                                        sse_event, timings, usage)
from edgespec.app.concurrency import StreamChunk
from edgespec.app.scheduler import CANCELLED, STARTED, Event  # noqa: F401 (a request's events: one definition)
from edgespec.app.request_fields import RequestError, ServeRequest, cancelled, shutting_down
from edgespec.core.logprobs import LogprobFormatter
from edgespec.core.params import Request


async def receive(queue: asyncio.Queue) -> StreamChunk | None:
    """The next event of a request decoded, the one place that reads them:
    a chunk, None for STARTED; an error raises its RequestError, CANCELLED
    the 499 (request_fields.cancelled)."""
    e: Event = await queue.get()
    if e.kind == "error":
        assert e.error is not None
        raise e.error
    if e.kind == "cancelled":
        raise cancelled()
    return e.chunk


async def last_chunk(queue: asyncio.Queue) -> StreamChunk:
    """The request's last chunk (the one with the result), the ones before it
    read and dropped; an error or a cancel raises as in receive."""
    while (c := await receive(queue)) is None or c.result is None:
        pass
    return c


class Answers:
    """The answers of one server: its model (for logprobs and the drafter's
    name) and default drafter; draining() is true once the server stops,
    when a cancelled generation is answered with 503."""

    def __init__(self, model, defaults: Request, draining: Callable[[], bool]):
        self.model, self.defaults, self._draining = model, defaults, draining

    def drafter_name(self) -> str:
        d = self.defaults.drafter
        return d if isinstance(d, str) else self.model.drafter_name

    def shut_down(self, r) -> bool:
        """A generation the server's shutdown cancelled (answered 503, not as an answer)."""
        return r.stop_reason == "cancelled" and self._draining()

    def formatter(self, call: ServeRequest) -> LogprobFormatter:
        """Offsets of a completion's text_offset count from the prompt text's start."""
        return LogprobFormatter(self.model.vocab, call.text_offset)

    @staticmethod
    def _logprobs(call: ServeRequest, fmt: LogprobFormatter, entries: list) -> dict:
        return fmt.chat(entries) if call.chat else fmt.completion(entries)

    async def collect(self, call: ServeRequest, queue: asyncio.Queue):
        """The JSON answer of a request not streamed (or its error)."""
        try:
            r = (await last_chunk(queue)).result
        except RequestError as e:
            return e.response()
        cid, created = new_id("chatcmpl" if call.chat else "cmpl"), int(time.time())
        if self.shut_down(r):
            return shutting_down().response()
        n_prompt = len(call.resolved.prompt)
        if call.chat:
            d = chat_response(cid, created, call.model, r.text, r.stop_reason, n_prompt, r.n_generated)
            if call.tools is not None:
                msg, finish = tooling.answer(r.text, r.stop_reason, call.tools)
                d["choices"][0].update(message=msg, finish_reason=finish)
        else:
            d = completion_response(cid, created, call.model, r.text, r.stop_reason, n_prompt, r.n_generated)
        if call.request.logprobs is not None:
            d["choices"][0]["logprobs"] = self._logprobs(call, self.formatter(call), r.logprobs)
        d["timings"] = timings(r, self.drafter_name())
        return JSONResponse(d)

    async def sse(self, call: ServeRequest, queue: asyncio.Queue, cancel: threading.Event):
        """The server-sent events of a streamed answer; cancelling this
        generator (the client left) cancels the generation."""
        chat, name = call.chat, call.model
        cid, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
        n_tok = n_drafted = 0           # of chunks whose text is still held back (a possible stop string)
        lp, fmt = [], self.formatter(call) if call.request.logprobs is not None else None
        try:
            if chat:
                yield sse_event(chat_chunk(cid, created, name, {"role": "assistant", "content": ""}))
            while True:
                try:
                    c = await receive(queue)
                except RequestError as e:
                    yield sse_error(e)
                    break
                if c is None:
                    continue
                if c.result is None:
                    n_tok, n_drafted = n_tok + len(c.tokens), n_drafted + c.n_drafted
                    lp += c.logprobs or []
                    if not c.text:
                        continue
                    d = (chat_chunk(cid, created, name, {"content": c.text}) if chat
                         else completion_response(cid, created, name, c.text, None))
                    if fmt is not None:
                        d["choices"][0]["logprobs"], lp = self._logprobs(call, fmt, lp), []
                    d["edgespec"] = {"spans": [[t, bool(f)] for t, f in c.spans], "tokens": n_tok,
                                     "drafted": n_drafted}
                    n_tok = n_drafted = 0
                    yield sse_event(d)
                    continue
                for e in self._tail(call, (cid, created), c.result, c.result.stop_reason, lp, fmt):
                    yield e
                break
            yield SSE_DONE
        finally:
            cancel.set()          # a no-op once the answer is complete

    def _tail(self, call: ServeRequest, ids: tuple[str, int], r, finish: str, lp: list, fmt) -> list[str]:
        """A stream's last events: the chunk with finish_reason, usage and
        timings (and the logprobs still held back), then the usage chunk
        if asked for (ids: the answer's id and creation time)."""
        (cid, created), chat, name = ids, call.chat, call.model
        d = (chat_chunk(cid, created, name, {}, finish) if chat
             else completion_response(cid, created, name, "", finish))
        if fmt is not None and lp:
            d["choices"][0]["logprobs"] = self._logprobs(call, fmt, lp)
        d["usage"] = usage(len(call.resolved.prompt), r.n_generated)
        d["timings"] = timings(r, self.drafter_name())
        events = [sse_event(d)]
        if call.include_usage:
            u = (chat_chunk(cid, created, name, {}) if chat
                 else completion_response(cid, created, name, "", None))
            u["choices"] = []
            u["usage"] = d["usage"]
            events.append(sse_event(u))
        return events

    async def sse_tools(self, call: ServeRequest, queue: asyncio.Queue, cancel: threading.Event):
        """The events of a streamed answer to a request with tools: the answer
        is gathered first (a call is known only once its block has closed),
        then sent as its content and tool_calls deltas and the last events
        (its logprobs on the last chunk)."""
        name, cid, created = call.model, new_id("chatcmpl"), int(time.time())
        fmt = self.formatter(call) if call.request.logprobs is not None else None
        try:
            yield sse_event(chat_chunk(cid, created, name, {"role": "assistant", "content": ""}))
            r = None
            try:
                r = (await last_chunk(queue)).result
            except RequestError as e:
                yield sse_error(e)
            if r is not None:
                msg, finish = tooling.answer(r.text, r.stop_reason, call.tools)
                for delta in tooling.deltas(msg):
                    yield sse_event(chat_chunk(cid, created, name, delta))
                for e in self._tail(call, (cid, created), r, finish, r.logprobs or [], fmt):
                    yield e
            yield SSE_DONE
        finally:
            cancel.set()          # a no-op once the answer is complete
