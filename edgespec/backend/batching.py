"""The slots' decodes of one round in one llama_decode: a batch broker (issue 62, docs/scheduler.md).

A LlamaBackend with slots (backend/slots.py) has one Broker, shared by its
slot views.  `Broker.run(jobs)` runs one callable per slot (an engine
generator's next step) each in a thread of its own, cooperatively: exactly
one of the threads (or the caller's, which coordinates) runs at a time, and
the run passes from one to the next only where a job waits in the broker,
because llama_memory_seq_* calls, the Cells' counts and the one batch the
views share are not thread safe.  Inside a run a view's decode does not call
llama_decode: it claims rows of the shared batch (`claim`: the offset its
rows start at; its cells reserved), lays its rows there, and waits
(`submit`).  When every job waits or has ended, the coordinator decodes all
laid rows at once (`_flush`), tells each view where its output rows start
(llama.cpp's output buffer holds only the rows with logits set, in batch
order), and resumes the views whose rows were decoded one at a time, in
batch order: each reads its logits and keeps its cells before another
decode can happen, since the next decode waits until no job runs.  Then the
jobs waiting to claim are resumed, in the order they came (first come,
first served: a prefill's next chunk does not pass a neighbour's tree).

A job may also *park* between two prompt chunks (`park`, called by a slot
view's prefill): it leaves the run as if it had ended (its outcome is a
`Parked`, the run returns once every job has ended or parked), its thread
waits, and a later run resumes it where it stopped when the Parked is passed
as that run's job for the slot.  So a long prompt is read one chunk per
round, between the other slots' steps, and the scheduler can admit a request
or choose whom to step between two chunks (app/scheduler.py).

Exactness (docs/scheduler.md, "Exactness", measured: a row's logits do not
depend on the other sequences' rows and cells):
* under exact kernels a combined batch holds at most EXACT_MAX_BATCH rows
  (`capacity`), and a prompt chunk is decoded alone (`solo`): combining
  prompt chunks was measured exact but is not proven by the tests;
* a claim whose cells might not fit waits for an empty batch, so a
  compaction (backend/slots.py) never runs while rows are laid: it would
  empty the path sequences those rows were laid against; a view resumed
  after the decode keeps its cells before anyone else runs, so no
  compaction falls between a view's decode and its keep either;
* the threads of one-token decodes (exact kernels, f16 K cache) are chosen
  for the whole batch: every thread for more than one row.

Each view's `clock` (the engine's and its gate's timing) skips the view's
waits for the others and counts its rows' share of a combined decode (its
rows over the batch's), so a drafting slot beside others is not charged its
neighbours' rows (its speed guard would stop drafting).
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time

import llama_cpp as L
import numpy as np


@dataclasses.dataclass
class _Claim:
    worker: "_Worker"
    view: object
    off: int
    n: int
    solo: bool


class _Worker:
    """One job of a run and the thread that runs it."""

    def __init__(self, fn):
        self.fn = fn
        self.go = threading.Semaphore(0)
        self.state = "ready"        # ready, running, claim (waits to claim rows), decode (waits for its rows),
        #                             parked (between prompt chunks, until a later run), done
        self.value = self.error = None
        self.rc = 0                 # llama_decode's code for its rows
        self.decode_s = 0.0         # its rows' share of that decode's seconds


class Parked:
    """A run's outcome for a job that parked between two prompt chunks: pass it as a later run's job
    (in place of a callable) to resume the job where it stopped."""

    def __init__(self, worker: "_Worker"):
        self.worker = worker


class Broker:
    """Gathers the slot views' rows of one round into one llama_decode (the module doc)."""

    def __init__(self, cells, capacity: int):
        self.cells = cells
        self.capacity = capacity    # rows a combined batch may hold (a lone claim may hold more)
        self.claims: list[_Claim] = []
        self.rows = 0               # rows laid in the pending batch
        self.queue: collections.deque[_Worker] = collections.deque()     # jobs waiting to claim, in order
        self._local = threading.local()
        self._back = threading.Semaphore(0)     # the run is back with the coordinator
        self._running = False
        self.decodes = 0            # llama_decode calls made by runs
        self.combined = 0           # of them, with rows of two or more jobs
        self.max_rows = 0           # the widest of them
        for v in cells.views:       # each view's clock leaves out its waits for other slots (_yield)
            v._idle = 0.0
            v.clock = (lambda v=v: time.perf_counter() - v._idle)

    # ------------------------------------------------------------ the coordinator
    def run(self, jobs: list) -> list[tuple[object, BaseException | None]]:
        """Run the callables `jobs` (one per slot; a Parked resumes its job), their decodes gathered;
        (value, error) per job, in order: a job that parked gives (Parked, None)."""
        if self._running or self.driving():
            raise RuntimeError("Broker.run is not reentrant")
        self._running = True
        try:
            ws = [self._job(i, fn) for i, fn in enumerate(jobs)]
            ready = list(ws)
            while True:
                for w in ready:
                    if w.state not in ("done", "parked"):
                        self._resume(w)
                if all(w.state in ("done", "parked") for w in ws):
                    return [(Parked(w), None) if w.state == "parked" else (w.value, w.error) for w in ws]
                if self.claims:
                    ready = self._flush() + list(self.queue)
                else:
                    ready = list(self.queue)
                    if not ready:
                        raise RuntimeError("a slot job waits in the broker with nothing to decode")
        finally:
            self._running = False

    def _job(self, i: int, fn) -> _Worker:
        """Job i's worker: a parked one resumed (a Parked), or a new one in a thread of its own."""
        if isinstance(fn, Parked):
            if fn.worker.state != "parked":
                raise RuntimeError("a Parked job was resumed twice")
            fn.worker.state = "ready"
            return fn.worker
        w = _Worker(fn)
        threading.Thread(target=self._work, args=(w,), name=f"edgespec-slot-job-{i}", daemon=True).start()
        return w

    def _resume(self, w: _Worker) -> None:
        w.state = "running"
        w.go.release()
        self._back.acquire()

    def _flush(self) -> list[_Worker]:
        """One llama_decode of every laid row; the jobs whose rows they were, in batch order."""
        claims, rows = self.claims, self.rows
        self.claims, self.rows = [], 0
        be = self.cells.views[0]
        outputs = np.cumsum(be._logits[:rows] != 0)
        for c in claims:        # output rows before c's: llama.cpp keeps only rows with logits, in order
            c.view._out_off = int(outputs[c.off - 1]) if c.off else 0       # type: ignore[attr-defined]
        self._threads(be, rows)
        be._batch.n_tokens = rows
        t = time.perf_counter()
        rc = int(L.llama_decode(be.ctx, be._batch))
        dt = time.perf_counter() - t
        self.decodes += 1
        self.combined += len({id(c.worker) for c in claims}) > 1
        self.max_rows = max(self.max_rows, rows)
        for c in claims:        # each job's clock counts its rows' share of the decode (Broker's doc)
            c.worker.rc, c.worker.decode_s = rc, dt * c.n / max(1, rows)
        return [c.worker for c in claims]

    def _threads(self, be, rows: int) -> None:
        """Exact kernels: every thread for a batch; one row decides as a lone decode does (backend/llama.py)."""
        if not be.exact:
            return
        lim = be.one_thread_after
        want = be.n_threads if (rows > 1 or lim is None or self.cells.used <= lim) else 1
        if want != be._single_threads:
            be.set_single_threads(want)

    # -------------------------------------------------------------- the jobs
    def driving(self) -> bool:
        """Whether the calling thread runs one of a run's jobs (its decodes then go through the broker)."""
        return getattr(self._local, "worker", None) is not None

    def _work(self, w: _Worker) -> None:
        w.go.acquire()
        self._local.worker = w
        try:
            w.value = w.fn()
        except BaseException as e:      # the job's own outcome (StopIteration included): the caller's to read
            w.error = e
        finally:
            self._withdraw(w)
            self._local.worker = None
            w.state = "done"
            self._back.release()

    def _yield(self, w: _Worker, state: str) -> float:
        """Hand the run back to the coordinator until it resumes w; the seconds w waited."""
        w.state = state
        t = time.perf_counter()
        self._back.release()
        w.go.acquire()
        return time.perf_counter() - t

    def park(self, view) -> None:
        """Between two prompt chunks of view's prefill: leave this run (its outcome a Parked) and wait
        until a later run resumes the job.  Its clock skips the wait."""
        w: _Worker = self._local.worker
        assert all(c.worker is not w for c in self.claims), "a job parked with rows in the batch"
        view._idle += self._yield(w, "parked")

    def claim(self, view, n: int, solo: bool, rows: bool) -> int:
        """Before view lays n rows (rows False: only restores n cells): wait until they may join the
        pending batch, reserve their cells; the row they start at."""
        w: _Worker = self._local.worker
        while not self._may_claim(w, n, solo, rows):
            if w not in self.queue:
                self.queue.append(w)
            view._idle += self._yield(w, "claim")      # its clock skips the wait (the gate times its steps)
        if w in self.queue:
            self.queue.remove(w)
        self.cells.reserve(n)       # compacts only on an empty batch (_may_claim)
        if not rows:
            return 0
        off = self.rows
        self.claims.append(_Claim(w, view, off, n, solo))
        self.rows += n
        return off

    def _may_claim(self, w: _Worker, n: int, solo: bool, rows: bool) -> bool:
        if self.queue and self.queue[0] is not w:
            return False            # an earlier claim waits: first come, first served
        if not self.claims:
            return True
        if self.cells.used + n > self.cells.size:
            return False            # a compaction waits for an empty batch
        if not rows:
            return True
        return not solo and not self.claims[0].solo and self.rows + n <= self.capacity

    def submit(self, view, off: int, n: int) -> int:
        """view's n rows at off are laid: wait for their decode; llama_decode's code."""
        w: _Worker = self._local.worker
        if not self.claims or self.claims[-1].worker is not w or (self.claims[-1].off, self.claims[-1].n) != (off, n):
            raise RuntimeError(f"rows {off}..{off + n - 1} were laid without their claim")
        view._idle += max(0.0, self._yield(w, "decode") - w.decode_s)    # the decode counts, the wait not
        return w.rc

    def _withdraw(self, w: _Worker) -> None:
        """A job that ended with rows claimed but not submitted (it raised in between): they leave the batch.
        A job runs alone from its claim to its submit, so its claim is the last one."""
        if w in self.queue:
            self.queue.remove(w)
        if self.claims and self.claims[-1].worker is w:
            self.rows -= self.claims.pop().n
        assert all(c.worker is not w for c in self.claims), "a job's rows stayed in the batch"
