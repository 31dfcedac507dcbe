"""The gate never strands a thread: abandoned streams are released, the thread
reading a stream is refused at once, close() racing stream() ends, and close()
takes a timeout.  Every wait here is bounded: a hang fails the test."""

import gc
import threading

import pytest

from edgespec import ModelBusyError, ModelClosedError, SpecModel

LIMIT = 20.0   # seconds a thread may take before the test fails instead of hanging


def run_bounded(fn):
    """fn() in a thread; its result or exception, or an AssertionError after LIMIT seconds."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(LIMIT)
    assert not t.is_alive(), f"{fn} still waiting after {LIMIT}s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_an_abandoned_stream_is_released(model):
    s = model.stream("Count to ten.", max_tokens=8)
    next(s)
    del s
    gc.collect()
    # another caller gets the model at once (wait=False would raise if it were still held)
    r = run_bounded(lambda: model.generate("Hi", max_tokens=2, wait=False))
    assert r.n_generated >= 1


def test_the_thread_reading_anothers_stream_is_refused_at_once(model):
    s = model.stream("Count to ten.", max_tokens=8)
    try:
        def reader():
            next(s)
            with pytest.raises(ModelBusyError, match="stream"):
                model.generate("Hi", max_tokens=2)   # no wait=False, no timeout: must not wait
            return True
        assert run_bounded(reader)
    finally:
        s.close()
    assert model.generate("Hi", max_tokens=2, wait=False).n_generated >= 1


def test_close_racing_stream_ends(model_path):
    m = SpecModel(model_path, drafter="none", n_ctx=256, calibrate=False)
    inside, start = threading.Event(), m._start

    def slow_start(*args, **kwargs):     # stream() holds the model, close() comes before it returns
        begun = start(*args, **kwargs)
        inside.set()
        assert m._closing.wait(LIMIT)
        return begun
    m._start = slow_start
    opener = threading.Thread(target=lambda: pytest.raises(ModelClosedError, m.stream, "Hi", max_tokens=4),
                              daemon=True)
    opener.start()
    assert inside.wait(LIMIT)
    run_bounded(m.close)                 # ends although nobody ever reads the stream
    opener.join(LIMIT)
    assert not opener.is_alive() and m.closed
    with pytest.raises(ModelClosedError):
        m.generate("Hi", max_tokens=2)


def test_close_with_an_unread_stream_ends(model_path):
    m = SpecModel(model_path, drafter="none", n_ctx=256, calibrate=False)
    s = m.stream("Hi", max_tokens=4)
    run_bounded(m.close)
    assert m.closed and s.closed and list(s) == []


def test_close_takes_a_timeout(model_path):
    m = SpecModel(model_path, drafter="none", n_ctx=256, calibrate=False)
    held = threading.Event()
    release = threading.Event()

    def hold():
        with m._gate.using():           # a short non-request use that close() must wait for
            held.set()
            release.wait(LIMIT)
    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert held.wait(LIMIT)
    with pytest.raises(ModelBusyError, match="timeout|after"):
        run_bounded(lambda: m.close(timeout=0.2))
    release.set()
    t.join(LIMIT)
    run_bounded(m.close)                       # a second close() finishes the job
    assert m.closed
