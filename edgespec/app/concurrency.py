"""How one SpecModel is shared between threads and streams.

Turnstile: one request holds the model at a time, waiting callers are served in
arrival order, short non-request uses (tokenizing) are counted so that close()
frees nothing under them.  Stream: one request's chunks as an iterator that
holds the model until it is exhausted or closed.  Misuse that could never be
served (a thread waiting on its own request or stream) raises ModelBusyError at
once; any use after close() raises ModelClosedError.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
import weakref

from edgespec.core.result import GenerationResult
from edgespec.core.stream import Chunk
from edgespec.errors import ModelBusyError, ModelClosedError


@dataclasses.dataclass
class StreamChunk(Chunk):
    """What SpecModel.stream() yields: the engine's Chunk (text, tokens,
    n_drafted, spans: see edgespec.core.stream.Chunk) and, on the last chunk only,
    finish_reason ("stop", "length" or "cancelled") and the GenerationResult.
    The last chunk carries no text of its own."""
    finish_reason: str | None = None
    result: GenerationResult | None = None


class Turnstile:
    """Who may use a SpecModel: one request at a time, waiting callers served
    in arrival order; short non-request uses (tokenizing) counted so that
    close() frees nothing under them."""

    def __init__(self):
        self.cond = threading.Condition()
        self.queue: collections.deque = collections.deque()
        self.owner: int | None = None     # thread id of the request holding the model
        # The stream holding it, if it is one, by weak reference: an abandoned stream is
        # collected, and its __del__ gives the model back.
        self._stream_ref: weakref.ref | None = None
        self.reader: int | None = None    # thread id that last read a chunk of that stream
        self.users = 0
        self.closed = False

    @property
    def stream(self) -> Stream | None:
        return self._stream_ref() if self._stream_ref is not None else None

    @stream.setter
    def stream(self, s: Stream | None) -> None:
        self._stream_ref = weakref.ref(s) if s is not None else None
        self.reader = None

    def acquire(self, wait: bool = True, timeout: float | None = None) -> None:
        me = threading.get_ident()
        with self.cond:
            self._check_open()
            if self.owner is not None and me in (self.owner, self.reader):
                what = "stream" if self.stream is not None else "request"
                raise ModelBusyError(f"this thread's own {what} still holds the model: finish or close "
                                     "it first (waiting for it here would never end)")
            if self.owner is None and not self.queue:
                self.owner = me
                return
            if not wait:
                raise ModelBusyError("the model is serving another request (wait=False)")
            ticket = object()
            self.queue.append(ticket)
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                while self.owner is not None or self.queue[0] is not ticket:
                    self._check_open()
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise ModelBusyError(f"the model stayed busy for {timeout:g}s (timeout)")
                    self.cond.wait(left)
                self._check_open()
            except BaseException:
                self.queue.remove(ticket)
                self.cond.notify_all()
                raise
            self.queue.popleft()
            self.owner = me

    def release(self) -> None:
        with self.cond:
            self.owner = None
            self.stream = None
            self.cond.notify_all()

    def _check_open(self) -> None:
        if self.closed:
            raise ModelClosedError("this SpecModel was closed")

    @contextlib.contextmanager
    def using(self):
        """A short use that needs the model loaded but not exclusively (tokenizing)."""
        with self.cond:
            self._check_open()
            self.users += 1
        try:
            yield
        finally:
            with self.cond:
                self.users -= 1
                self.cond.notify_all()


class ClosingStream:
    """What both request streams (Stream here, scheduler.TicketStream with
    parallel slots) share: iteration, `closed`, `with`, and close() when the
    garbage collector takes one that was not read to its end.  A subclass
    sets `_done` and defines __next__ and close()."""
    _done = False

    def __iter__(self):
        return self

    def close(self) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._done

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # pragma: no cover - depends on the garbage collector
        try:
            if not self._done:
                self.close()
        except Exception:
            pass


class Stream(ClosingStream):
    """The chunks of one request (SpecModel.stream()), as an iterator.

    It holds the model from its creation until the last chunk has been read or
    close() is called (also by `with`, or when it is garbage collected); other
    requests wait meanwhile.  close() may be called from any thread: a step in
    progress is finished first (cancelled within one step), the KV cache stays
    consistent.  `result` is the GenerationResult once the stream has ended."""

    def __init__(self, gen, gate: Turnstile, stop: threading.Event, on_end):
        self._gen = gen
        self._gate = gate
        self._stop = stop
        self._on_end = on_end
        self._lock = threading.Lock()
        self._done = False
        self.result: GenerationResult | None = None

    def __next__(self) -> StreamChunk:
        with self._lock:
            if self._done:
                raise StopIteration
            self._gate.reader = threading.get_ident()
            try:
                c = next(self._gen)
            except StopIteration as e:
                self.result = e.value
                self._end()
                return StreamChunk("", [], 0, [], finish_reason=e.value.stop_reason, result=e.value)
            except BaseException:
                self._end()
                raise
            return StreamChunk(c.text, c.tokens, c.n_drafted, c.spans, c.logprobs)

    def close(self) -> None:
        """Stop the request (if it has not ended) and give the model back."""
        self._stop.set()
        with self._lock:
            if not self._done:
                try:
                    self._gen.close()
                finally:
                    self._end()

    def _end(self) -> None:
        self._done = True
        self._gen = None
        try:
            self._on_end()
        finally:
            self._gate.release()
