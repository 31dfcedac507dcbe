"""Calibration between requests: a model answers at once with the built-in
cost curve while its own curve and the exactness self-check are measured in
a background thread, in short slices that never overlap a request.

The backend is not thread safe, so the measurement and the requests take
turns: a request enters the Pacer (SpecModel does this after it is given the
model) and waits for the slice in progress to end; the measurement starts a
slice only when no request holds or waits for the model.  A request that
arrives during a slice sets the pacer's interrupt flag, which stops the
measurement's decode in progress within one node of llama.cpp's graph on a
CPU (edgespec.backend.interrupt; SpecModel attaches it to its backend), so
the request waits about a millisecond instead of up to a 64-token decode;
the measurement drops that sample and takes it again in a later slice.  A
slice that follows a request finds the KV cache changed, so the measurement
lays its context down again (the live conversation is kept in the prompt
cache first: before_slice), and the first request after a slice puts it
back before anything else (after_slice, on the request's thread): the
request then finds the KV cache as it would have without the slice.

A slice also waits until the model has been quiet for `quiet_s` since the last
request ended (SpecModel: QUIET_S).  Apps send requests in bursts (a turn and
its side requests, an editor's requests while a person types, an agent's next
step); a slice between two of them costs the next one more than the slice's
own wait: its conversation restored from the prompt cache, caches cold.  A
measurement taken only in the pauses between bursts adds nothing to them.
"""
from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref

from edgespec.backend.interrupt import new_flag
from edgespec.calibration.cache import CalibrationStopped


# SpecModel's quiet_s.  An app's burst arrives within about a second or two: Open WebUI's title
# and tags requests right after an answer, an editor's completion requests while a person types,
# an agent's next step (Aider's lint-fix request); a person reads an answer and types the next
# message for far longer.  3 s lies above the first and well below the second.
QUIET_S = 3.0


class Pacer:
    """Turns between requests and a measurement.  Requests call enter() and
    exit() around their use of the backend; the measurement calls pause()
    before each slice and end() after the last one."""

    def __init__(self, idle=lambda: True, before_slice=None, quiet_s: float = 0.0, clock=time.monotonic,
                 after_slice=None):
        self._cond = threading.Condition()
        self.quiet_s = quiet_s     # a slice starts only this long after the last request ended
        self._clock = clock
        self._last_exit = -float("inf")
        self._idle = idle          # True when nobody holds or waits for the model (SpecModel's gate)
        # called (on the measuring thread, the backend its own) when a slice starts after requests
        # used the backend: a slice clears the KV cache, so the live prefix is saved first
        self._before_slice = before_slice
        # called (on the request's thread, the slices over) by the first request after a slice:
        # the KV cache holds the measurement's cells, and the live prefix is put back
        self._after_slice = after_slice
        self._measured = False     # a slice ran since the last request entered
        self.slices = 0            # slices started so far
        self._requests = 0         # requests in enter()..exit()
        self._admitted = 0         # requests admitted so far
        self._seen = 0             # ... as of the measurement's last slice
        self._slicing = False
        self._stop = False
        self.flag = new_flag()     # set while a request waits for a slice: stops its decode
        self.waits: collections.deque = collections.deque(maxlen=1000)   # seconds requests waited for a slice
        self.interrupts = 0        # slices a request interrupted

    def enter(self) -> None:
        """A request begins: interrupt the slice in progress, if any, and wait
        for it to end; after a slice, after_slice() (no slice starts while a
        request is in: it runs alone)."""
        with self._cond:
            self._requests += 1
            self._admitted += 1
            if self._slicing:
                self.flag[0] = 1
                self.interrupts += 1
                t0 = time.perf_counter()
                while self._slicing:
                    self._cond.wait()
                self.waits.append(time.perf_counter() - t0)
            measured, self._measured = self._measured, False
        if measured and self._after_slice is not None:
            try:
                self._after_slice()
            except BaseException:
                self.exit()         # the caller's exit() never runs when enter() raises
                raise

    def exit(self) -> None:
        with self._cond:
            self._requests -= 1
            self._last_exit = self._clock()
            self._cond.notify_all()

    def _busy(self) -> bool:
        """A request holds or waits for the model, or one ended less than quiet_s ago."""
        return bool(self._requests) or not self._idle() or self._clock() - self._last_exit < self.quiet_s

    def pause(self) -> bool:
        """End the current slice, let every request that holds or waits for
        the model go first, and start the next slice.  True when a request
        used the backend since the last slice.  Raises CalibrationStopped
        after stop()."""
        with self._cond:
            self._slicing = False
            self.flag[0] = 0
            self._cond.notify_all()
            while not self._stop and self._busy():
                self._cond.wait(0.05)       # the gate does not notify this condition: poll it
            if self._stop:
                raise CalibrationStopped()
            self._slicing = self._measured = True
            self.slices += 1
            used, self._seen = self._admitted != self._seen, self._admitted
        if used and self._before_slice is not None:
            self._before_slice()
        return used

    def end(self) -> None:
        with self._cond:
            self._slicing = False
            self.flag[0] = 0
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def settle(self) -> None:
        """After stop(), with no request in: after_slice() if a slice ran since
        the last request (the backend as that request left it, for its close)."""
        self.enter()
        self.exit()

    def stopped(self) -> bool:
        return self._stop


_RUNNING: "weakref.WeakSet[BackgroundTask]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """At interpreter exit, stop every measurement before llama.cpp's objects
    are freed under it (the threads are daemons so that exit never waits for
    a whole measurement, only for the slice in progress)."""
    for task in list(_RUNNING):
        task.stop()


class BackgroundTask:
    """run(pacer) in a daemon thread; stop() makes the pacer raise
    CalibrationStopped at the next slice and waits for the thread."""

    def __init__(self, run, pacer: Pacer, name: str = "edgespec-calibration"):
        pacer._stop = False
        self.pacer = pacer
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._run = run
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def _main(self) -> None:
        try:
            self._run(self.pacer)
        except CalibrationStopped:
            pass
        except BaseException as e:         # reported by the model (calibration_error)
            self.error = e
        finally:
            self.pacer.end()
            self.done.set()
            _RUNNING.discard(self)

    @property
    def running(self) -> bool:
        return not self.done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def stop(self) -> None:
        """Stop and wait for the thread (at most the slice in progress); a
        no-op from the thread itself or once it has ended."""
        self.pacer.stop()
        if self._thread is not threading.current_thread():
            self._thread.join()
        _RUNNING.discard(self)
