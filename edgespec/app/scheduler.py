"""Several requests at once on one SpecModel: its Scheduler (issue 62, docs/scheduler.md).

A SpecModel loaded with parallel=N > 1 holds N request slots in one llama.cpp
context (backend/slots.py: each slot its own KV sequences) and one Scheduler:
every generation entry point submits a `Resolved` and gets a Ticket, whose
events (Event: started, a chunk per step, the last chunk with the result, or
an error) one model thread pushes into the ticket's queue.  The model thread
steps every running slot once per round, each slot with its own engines
(drafter, gate, guard state), through the backend's batch broker
(backend/batching.py): each slot's step runs in a thread of its own, one at
a time, and their verification decodes go into one llama_decode (a prompt
chunk under exact kernels alone).  Per round, every request past its first
token takes one step, and ONE request still reading its prompt reads one
chunk of it (SLOT_PREFILL_CHUNK tokens; it parks between chunks): the one
with the fewest prompt tokens left to read, counting the cells another slot
could lend it (backend/slots.py, Cells.borrow), so a short side request is
answered before a long prompt is finished, a stream keeps moving while a
prompt is read, and requests that embed the same conversation read it once.
A ticket whose reader lags `QUEUE_CHUNKS` chunks behind is
skipped for a round (back-pressure on its own request only).  A request
whose cancel fires ends at its next step (its sequences are dropped then); a
stream closed by its reader is closed at the next round without a step.

The model thread holds the SpecModel's Turnstile while any slot runs, so the
calls that need the model alone (calibrate, new_session, use_drafter,
save_prefix, close) wait until the slots have drained; while one waits no new
request is admitted.  With parallel=1 there is no Scheduler: requests hold
the Turnstile one at a time, as before slots existed.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
from typing import Iterator

import numpy as np

from edgespec.app.concurrency import ClosingStream, StreamChunk
from edgespec.backend.batching import Parked
from edgespec.core.params import Resolved
from edgespec.errors import ModelBusyError, ModelClosedError

QUEUE_CHUNKS = 64       # chunks a reader may lag behind before its request is skipped for a round
_arrivals = itertools.count()


@dataclasses.dataclass(frozen=True)
class Event:
    """What the model thread hands the reader of one request, in order:
    STARTED once the model runs it, then a chunk per step (the last one
    carries the result); or, instead of all that, one error (the exception:
    a RequestError at the server) or CANCELLED (the client left before it ran)."""
    kind: str                           # "started", "chunk", "error" or "cancelled"
    chunk: StreamChunk | None = None
    error: BaseException | None = None


STARTED = Event("started")
CANCELLED = Event("cancelled")


class Ticket:
    """One request submitted to a Scheduler: its events, its cancel event, its place."""

    def __init__(self, resolved: Resolved, stop: threading.Event, slot0_only: bool):
        self.resolved, self.stop, self.slot0_only = resolved, stop, slot0_only
        self.events: queue.Queue = queue.Queue()
        self.arrival = next(_arrivals)
        self.started = False        # its first token is out
        self.abandoned = False      # its reader closed it: no more events wanted
        self.gen = None
        self.on_end = None
        self.parked = None          # a Broker's Parked: its prefill stopped between two chunks

    def chunks(self) -> Iterator[StreamChunk]:
        """The request's chunks as the model thread pushes them; the last carries the result.
        An error event raises its exception."""
        while True:
            e: Event = self.events.get()
            if e.kind == "error":
                assert e.error is not None
                raise e.error
            if e.kind == "chunk":
                assert e.chunk is not None
                yield e.chunk
                if e.chunk.result is not None:
                    return


class TicketStream(ClosingStream):
    """SpecModel.stream()'s iterator over a Ticket (the parallel counterpart of concurrency.Stream):
    StreamChunks, the last with finish_reason and the result; close() ends the request from any thread."""

    def __init__(self, ticket: Ticket, scheduler: "Scheduler"):
        self._ticket, self._scheduler = ticket, scheduler
        self._it = ticket.chunks()
        self._done = False
        self.result = None

    def __next__(self) -> StreamChunk:
        if self._done:
            raise StopIteration
        try:
            c = next(self._it)
        except BaseException:
            self._done = True
            raise
        if c.result is not None:
            self.result, self._done = c.result, True
        return c

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._scheduler.abandon(self._ticket)


class Scheduler:
    """N request slots of one SpecModel stepped by one model thread (the module doc)."""

    def __init__(self, model, n_slots: int):
        self.model, self.n_slots = model, n_slots
        self.cond = threading.Condition()
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.slots: list[Ticket | None] = [None] * n_slots
        self._held = False
        self.broken: BaseException | None = None     # the model thread's own failure (_fail)
        self.thread = threading.Thread(target=self._loop, name="edgespec-scheduler", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------ callers
    def submit(self, resolved: Resolved, stop: threading.Event, wait: bool = True,
               timeout: float | None = None) -> Ticket:
        """Queue a request; returns once it has started (a slot holds it).  wait=False: ModelBusyError
        when no slot is free now; timeout=S: when none was free for S seconds."""
        t = Ticket(resolved, stop, slot0_only=not isinstance(resolved.engine_key[0] or self.model._drafter, str))
        with self.cond:
            if self.broken is not None:
                raise self.broken
            if self.model._gate.closed:
                raise ModelClosedError("this SpecModel was closed")
            if not wait and (self.waiting or all(s is not None for s in self.slots)):
                raise ModelBusyError("every parallel slot is serving a request (wait=False)")
            self.waiting.append(t)
            self.cond.notify_all()
        try:
            first = t.events.get(timeout=timeout)
        except queue.Empty:
            with self.cond:
                if t in self.waiting:
                    self.waiting.remove(t)
                    raise ModelBusyError(f"every parallel slot stayed busy for {timeout:g}s (timeout)") from None
            first = t.events.get()
        if first.kind == "error":
            raise first.error           # type: ignore[misc]
        return t

    def abandon(self, t: Ticket) -> None:
        """The reader of t is gone: end it at the next round, without another step."""
        t.abandoned = True
        t.stop.set()
        with self.cond:
            self.cond.notify_all()

    def wake(self) -> None:
        """close() was called: the model thread ends every request and stops."""
        with self.cond:
            self.cond.notify_all()

    # -------------------------------------------------------- model thread
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:      # a fault of the scheduler itself: every request hears it, none hangs
            self._fail(e)
            raise

    def _fail(self, e: BaseException) -> None:
        """The model thread failed: every running and waiting request gets the error, later ones too."""
        err = RuntimeError(f"edgespec's scheduler failed: {type(e).__name__}: {e}")
        err.__cause__ = e
        with self.cond:
            self.broken = err
            tickets = [t for t in self.slots if t is not None] + list(self.waiting)
            self.slots, self.waiting = [None] * self.n_slots, collections.deque()
        for t in tickets:
            t.events.put(Event("error", error=err))
        self._release()

    def _serve(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not any(self.slots):
                    self._release()
                    if self.model._gate.closed:
                        return
                    self.cond.wait()
            if not any(self.slots) and self.model._gate.queue:
                self._release()         # an exclusive call waits: it goes first (_hold queues behind it)
            if not self._hold():
                continue
            self._admit()
            if not self._round():       # every reader lags (or nothing was admitted): wait a little
                with self.cond:
                    self.cond.wait(0.01)

    def _hold(self) -> bool:
        """The Turnstile for the model thread (waits for an exclusive call); False when the model closed."""
        if self._held:
            return True
        try:
            self.model._gate.acquire()
        except ModelClosedError as e:
            with self.cond:
                waiting, self.waiting = list(self.waiting), collections.deque()
            for t in waiting:
                t.events.put(Event("error", error=e))
            return False
        self._held = True
        self.model._pacer.enter()
        return True

    def _release(self) -> None:
        if self._held:
            self._held = False
            try:
                self.model._pacer.exit()
            finally:
                self.model._gate.release()

    def _admit(self) -> None:
        """Start waiting requests in free slots, in arrival order (none while an exclusive call waits)."""
        if self.model._gate.closed:
            with self.cond:
                waiting, self.waiting = list(self.waiting), collections.deque()
            for t in waiting:
                t.events.put(Event("error", error=ModelClosedError("this SpecModel was closed")))
            return
        if self.model._gate.queue:
            return
        with self.cond:
            for k in range(self.n_slots):
                if self.slots[k] is not None:
                    continue
                t = next((t for t in self.waiting if k == 0 or not t.slot0_only), None)
                if t is None:
                    continue
                self.waiting.remove(t)
                try:
                    t.gen, t.on_end = self.model._start(t.resolved, t.stop, slot=k)
                except BaseException as e:      # a spent grammar, a drafter that cannot load
                    t.events.put(Event("error", error=e))
                    continue
                self.slots[k] = t
                t.events.put(STARTED)

    def _round(self) -> bool:
        """One step of every request past its first token and one prompt chunk of the request with the
        least prompt left to read (the module doc); their decodes gathered into one llama_decode per
        round (the backend's broker).  Whether any request moved."""
        running = [(k, t) for k, t in enumerate(self.slots) if t is not None]
        moved, step, reading = False, [], []
        for k, t in sorted(running, key=lambda kt: kt[1].arrival):
            if t.abandoned and t.parked is None:
                self._guarded(k, t, self._end, k, t)
                moved = True
            elif t.abandoned:
                step.append((k, t))         # resumed to see its cancel at the chunk boundary and end
            elif not t.started:
                reading.append((k, t))
            elif t.events.qsize() < QUEUE_CHUNKS:
                step.append((k, t))
        if reading:
            step.insert(0, min(reading, key=lambda kt: self._to_read(*kt)))
        jobs = [t.parked or t.gen.__next__ for _, t in step]   # type: ignore[union-attr]
        for _, t in step:
            t.parked = None
        outcomes = self._run(jobs)
        for (k, t), (value, error) in zip(step, outcomes):
            if error is None and isinstance(value, Parked):
                t.parked = value
            else:
                self._guarded(k, t, self._took, k, t, value, error)
            moved = True
        return moved

    def _to_read(self, k: int, t: Ticket) -> int:
        """Prompt tokens request t in slot k has still to read, at most (what another slot holds counted)."""
        be = self.model.backend
        prompt = np.asarray(t.resolved.prompt)
        if t.parked is not None:
            return len(prompt) - be.slot(k).n_past
        cells = getattr(be, "_cells", None)
        return len(prompt) - (cells.best_prefix(prompt, len(prompt) - 1)[0] if cells is not None else 0)

    def _run(self, jobs: list) -> list:
        """Each job called once: (value, error) per job.  With slots the backend's broker runs them, one
        thread each, their decodes in one llama_decode (backend/batching.py); else one after another."""
        broker = getattr(self.model.backend, "broker", None)
        if broker is not None:
            return broker.run(jobs)
        out: list = []
        for fn in jobs:
            try:
                out.append((fn(), None))
            except BaseException as e:      # the job's own outcome, for _took
                out.append((None, e))
        return out

    def _guarded(self, k: int, t: Ticket, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:      # its end failed (a prefix cache's write): the request's error
            t.events.put(Event("error", error=e))
            with self.cond:
                self.slots[k] = None

    def _took(self, k: int, t: Ticket, c, error: BaseException | None) -> None:
        """Slot k's step gave chunk c, or ended (StopIteration: the result) or failed with error."""
        if isinstance(error, StopIteration):    # the slot is free before the reader has the result
            r = error.value
            self._end(k, t)
            t.events.put(Event("chunk", StreamChunk("", [], 0, [], finish_reason=r.stop_reason, result=r)))
            return
        if error is not None:
            self._end(k, t)
            t.events.put(Event("error", error=error))
            return
        t.started = True
        t.events.put(Event("chunk", StreamChunk(c.text, c.tokens, c.n_drafted, c.spans, c.logprobs)))

    def _end(self, k: int, t: Ticket) -> None:
        """Free slot k: the engine generator closed (its cells dropped), the request's end run."""
        try:
            t.gen.close()           # type: ignore[union-attr]
        finally:
            with self.cond:
                self.slots[k] = None
            t.on_end()              # type: ignore[misc]
