"""The calibration cache under races, failures and corruption, and the
background calibration (a first answer before the measurement has finished,
then the switch to the measured curve).

Every test uses a cache of its own (EDGESPEC_CACHE_DIR in tmp_path); the unit
tests replace the measurement with a quick stand-in, the model test runs a
small real measurement of SmolLM2 in the background."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgespec.calibration import curve as C
from edgespec.calibration import exactness as E
from edgespec.calibration.background import BackgroundTask, Pacer
from edgespec.calibration.cache import CalibrationCacheWarning, CalibrationStopped, cache_lock, curve_path
from edgespec.calibration.curve import CostCurve

ROOT = Path(__file__).resolve().parent.parent


def small_curve(t1: float = 0.01) -> CostCurve:
    return CostCurve([1, 2, 4], [1.0, 1.5, 2.5], t1, {"prefix": 300, "measured_at": "now"}, t1, [],
                     [1.0, 1.6, 2.6])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(d))
    return d


@pytest.fixture
def measured(monkeypatch):
    """Replace the measurement by a quick one that counts its calls."""
    calls = []

    def fake(backend, progress=None, pause=None):
        calls.append(backend)
        return small_curve()
    monkeypatch.setattr(C, "measure_cost_curve", fake)
    return calls


# ------------------------------------------------------------- corrupt entries
@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_non_finite_cache_entry_is_measured_again_with_a_warning(cache, measured, bad):
    path = Path(curve_path("k"))
    path.parent.mkdir(parents=True)
    text = json.dumps(small_curve().to_json()).replace('"rel": [1.0, 1.5, 2.5]', f'"rel": [1.0, {bad}, 2.5]')
    assert bad in text
    path.write_text(text)
    with pytest.warns(CalibrationCacheWarning, match="malformed"):
        assert C.cached_curve("k") is None
    with pytest.warns(CalibrationCacheWarning, match="malformed"):
        c = C.load_or_measure("backend", "k")
    assert len(measured) == 1 and c.rel == [1.0, 1.5, 2.5]
    again = C.cached_curve("k")                     # rewritten whole and valid
    assert again is not None and again.origin == "cached" and again.rel == c.rel


def test_a_measured_curve_with_nan_is_refused(cache, monkeypatch):
    bad = small_curve()
    bad.longer = [{"n_kv": 1000, "t1_s": float("nan"), "rel": [1.0, 2.0, 3.0], "after_s": 0.0}]
    monkeypatch.setattr(C, "measure_cost_curve", lambda backend, progress=None, pause=None: bad)
    from edgespec import BackendError
    with pytest.raises(BackendError, match="not usable"):
        C.load_or_measure("backend", "k")
    assert not Path(curve_path("k")).exists()


def test_a_non_finite_exactness_entry_is_rejected(cache):
    r = E.ExactnessReport(False, 8, [100, 600], 0.5, [2], 1).to_json()
    r["max_abs_diff"] = float("inf")
    path = Path(curve_path("k").replace(".json", ".exact.json"))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(r))

    class Be:
        max_nodes, n_ctx = 8, 1024
    with pytest.warns(CalibrationCacheWarning, match="malformed"):
        assert E.load_or_check_exactness(Be(), "k", cached_only=True) is None


# ------------------------------------------------------------- write failures
def test_an_unwritable_cache_is_a_warning_and_the_curve_is_used(tmp_path, monkeypatch, measured):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(blocker / "cache"))    # cannot be created
    with pytest.warns(CalibrationCacheWarning, match="could not write the calibration cache"):
        c = C.load_or_measure("backend", "k")
    assert c.rel == [1.0, 1.5, 2.5] and len(measured) == 1


def test_a_failed_write_leaves_no_temporary_file(cache, monkeypatch, measured):
    def full(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full)
    with pytest.warns(CalibrationCacheWarning, match="No space left"):
        c = C.load_or_measure("backend", "k")
    assert c.rel == [1.0, 1.5, 2.5]
    left = sorted(p.name for p in (cache / "calibration").iterdir())
    assert left == ["k.json.lock"], left                 # no k.json, no *.tmp


# ------------------------------------------------------------- two processes
RACER = r"""
import json, sys, time
from edgespec.calibration import curve as C
log = sys.argv[1]

def slow(backend, progress=None, pause=None):
    with open(log, "a") as f:
        f.write(f"start {time.time()}\n")
    time.sleep(2.0)
    c = C.CostCurve([1, 2, 4], [1.0, 1.5, 2.5], 0.01, {"prefix": 300, "who": sys.argv[2]}, 0.01, [], [])
    with open(log, "a") as f:
        f.write(f"end {time.time()}\n")
    return c
C.measure_cost_curve = slow
c = C.load_or_measure("backend", "race")
print(json.dumps({"who": c.meta["who"], "origin": c.origin, "done": time.time()}))
"""


def test_two_processes_calibrating_the_same_key_measure_once(cache, tmp_path):
    """The second process waits on the lock, then reads the first one's curve."""
    log = tmp_path / "log"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(log), who], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for who in ("a", "b")]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append((json.loads(out), err))
    events = log.read_text().split()
    assert events[0::2] == ["start", "end"], events           # one measurement
    (first, _), (second, _) = sorted(outs, key=lambda o: o[0]["origin"] != "measured")
    assert first["origin"] == "measured" and second["origin"] == "cached"
    assert second["who"] == first["who"]                         # the waiter uses the measurer's curve
    assert second["done"] >= float(events[3])                    # ... after it was written
    waiter_err = [e for o, e in outs if o["origin"] == "cached"][0]
    assert "waiting for another edgespec process" in waiter_err


def test_a_stopped_pacer_ends_a_wait_for_the_lock(cache):
    path = curve_path("held")
    p = Pacer()
    with cache_lock(path):
        got = []

        def wait():
            try:
                with cache_lock(path, p):
                    got.append("lock")
            except CalibrationStopped:
                got.append("stopped")
        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.3)
        p.stop()
        t.join(5)
    assert got == ["stopped"]


# ------------------------------------------------------------- pacing
def test_requests_wait_at_most_one_slice_and_come_first():
    """A measurement in 0.1 s slices: a request entering mid-slice waits for
    that slice only, the measurement takes no slice while a request runs,
    and its next pause() reports that the backend was used."""
    p = Pacer()
    log, reports = [], []

    def measure(pacer):
        for _ in range(30):             # 3 s in all: a request that waited for all of it would show
            reports.append(pacer.pause())
            log.append(("slice", time.monotonic()))
            time.sleep(0.1)
            log.append(("end", time.monotonic()))
    task = BackgroundTask(measure, p)
    time.sleep(0.25)
    t0 = time.monotonic()
    p.enter()
    waited = time.monotonic() - t0
    n_before = len(log)
    time.sleep(0.4)                                   # a request of 0.4 s
    assert len(log) == n_before                       # no slice while it runs
    p.exit()
    time.sleep(0.25)
    task.stop()
    assert not task.running and task.error is None
    assert waited < 1.0, waited                        # one slice (0.1 s), with room for a loaded machine
    assert True in reports[1:] and reports.count(True) == 1


def test_background_task_failure_is_kept():
    def boom(pacer):
        pacer.pause()
        raise RuntimeError("measurement failed")
    t = BackgroundTask(boom, Pacer())
    assert t.wait(5) and isinstance(t.error, RuntimeError)


# ------------------------------------------------------------- the real model
PROMPT = "Repeat exactly: the quick brown fox jumps over the lazy dog, twice."


def test_background_calibration_answers_first_then_switches(model_path, cache, monkeypatch):
    """On a fresh cache SpecModel measures a quick curve at load and answers
    with it while the full calibration runs (exact unknown), then switches
    every engine to the measured curve and caches it; the text is the same
    under both curves.  The measurements are small real ones (few batch
    sizes), the background one held back until the first answer has arrived
    so that the order is certain."""
    from edgespec import ConfigError, SpecModel

    go = threading.Event()
    real_measure, real_check = C.measure_cost_curve, E.check_exactness

    def measure(backend, progress=None, pause=None):
        while not go.is_set():          # slices of 10 ms that yield to requests
            pause()
            time.sleep(0.01)
        return real_measure(backend, ts=(1, 2, 4, 8), reps=1, pause=pause)

    def check(backend, progress=None, pause=None):
        return real_check(backend, ts=(2, 3, 8), pause=pause)
    monkeypatch.setattr(C, "measure_cost_curve", measure)
    monkeypatch.setattr(E, "check_exactness", check)
    t0 = time.perf_counter()
    m = SpecModel(model_path, drafter="suffix", n_ctx=512)
    try:
        assert m.calibration_state == "measuring" and m.cost.meta.get("quick") and m.exact is None
        assert m.cost.ts == [1, 2, 4, 8, 16, 32] and not m.cost.builtin
        first = m.generate(PROMPT, max_tokens=24)
        took = time.perf_counter() - t0
        assert m.calibration_state == "measuring" and m.engine.cost.meta.get("quick")
        # every way a request ends gives the measurement its turn back
        with m.stream(PROMPT, max_tokens=4) as s:
            next(s)                                         # closed early
        assert list(m.stream(PROMPT, max_tokens=4))[-1].finish_reason
        for call in (m.generate, m.stream):
            with pytest.raises(ConfigError):
                call(PROMPT, max_tokens=0)
        assert m._pacer._requests == 0
        go.set()
        assert m.wait_for_calibration(300)
        assert m.calibration_state == "measured" and m.calibration_error is None
        assert not m.cost.meta.get("quick") and m.engine.cost is m.cost and m.cost.ts == [1, 2, 4, 8]
        assert m.exact is not None
        assert os.path.isfile(curve_path(m._calibration_key()))
        after = m.generate(PROMPT, max_tokens=24)
        assert after.tokens == first.tokens
        print(f"first answer {took:.2f} s after SpecModel() began")
    finally:
        m.close()
    again = SpecModel(model_path, drafter="none", n_ctx=512)          # the next load reads the cache
    try:
        assert again.calibration_state == "cached" and again.cost.rel == pytest.approx(m.cost.rel, abs=1e-4)
    finally:
        again.close()


def test_close_stops_a_background_calibration(model_path, cache, monkeypatch):
    """close() during a background calibration stops it within a slice and
    caches nothing."""
    from edgespec import SpecModel

    def endless(backend, progress=None, pause=None):
        while True:
            pause()
            time.sleep(0.01)
    monkeypatch.setattr(C, "measure_cost_curve", endless)
    m = SpecModel(model_path, drafter="none", n_ctx=256)
    assert m.calibration_state == "measuring"
    r = m.generate(PROMPT, max_tokens=4)
    assert r.n_generated == 4 and np.all(np.asarray(r.tokens) >= 0)
    t0 = time.perf_counter()
    m.close()
    assert time.perf_counter() - t0 < 5
    assert m.calibration_state == "built-in" and m.exact is None
    assert not os.path.exists(curve_path(m._calibration_key()))


def test_stats_and_json_say_where_the_calibration_comes_from(model):
    """generate (synchronous, a one-shot command) finds the session model's
    calibration in the cache and says so in --stats and --json."""
    from click.testing import CliRunner

    from edgespec.app.cli import main
    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    r = runner.invoke(main, ["generate", "--ctx", "2048", "--max-tokens", "4", "--stats", "Say hi."])
    assert r.exit_code == 0, r.output
    assert "calibration: cached: c(T) and the self-check from the calibration cache" in r.stderr
    assert "measuring the verify cost" not in r.stderr
    r = runner.invoke(main, ["generate", "--ctx", "2048", "--max-tokens", "4", "--json", "Say hi."])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["calibration"] == "cached"


def test_chat_on_a_fresh_cache_answers_without_measuring_first(model_path, tmp_path):
    """`edgespec chat` loads with the background calibration: on an empty
    cache it measures a quick curve at load (one note on stderr), answers
    under it (/stats says so) and exits at the end of its input without
    finishing a minute of measurement."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), EDGESPEC_CACHE_DIR=str(tmp_path / "cache"),
               EDGESPEC_DATA_DIR=str(tmp_path / "data"))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "edgespec", "chat", "--max-tokens", "8", "--ctx", "1024"],
                       input="Name a fruit.\n\n/stats\n", capture_output=True, text=True, env=env, timeout=300)
    took = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr[-2000:]
    assert "session: answers 1" in p.stdout
    assert "calibration: measuring" in p.stdout and "c(T) quick (measured at load" in p.stdout
    assert "measuring the verify cost" not in p.stderr and p.stderr.count("measuring a first c(T)") == 1
    assert not list((tmp_path / "cache").glob("calibration/*.exact.json"))     # stopped, nothing cached
    assert took < 60, took


# ---------------------------------------------------------- a busy machine
def busy_curve() -> CostCurve:
    """What a measurement on a machine busy with other work looked like: a
    batch of 2 timed at 7.8 one-token decodes, the short regime at 147."""
    return CostCurve([1, 2, 4], [1.0, 7.76, 7.76], 0.016, {"prefix": 300, "measured_at": "now"}, 0.022,
                     [{"n_kv": 1000, "t1_s": 0.022, "rel": [1.0, 36.9, 36.9], "after_s": 0.0}], [1.0, 147.0, 147.0])


def test_an_implausible_curve_is_measured_again_then_capped_and_not_cached(cache, monkeypatch):
    results = [busy_curve(), busy_curve()]
    calls = []

    def fake(backend, progress=None, pause=None):
        calls.append(1)
        return results.pop(0)
    monkeypatch.setattr(C, "measure_cost_curve", fake)
    assert C.implausible_batch(busy_curve()) == 2 and C.implausible_batch(small_curve()) is None
    with pytest.warns(CalibrationCacheWarning, match="implausible"):
        c = C.load_or_measure("backend", "k")
    assert len(calls) == 2 and not Path(curve_path("k")).exists()
    assert c.rel == [1.0, 2.0, 4.0] and c.short_rel == [1.0, 2.0, 4.0] and c.longer[0]["rel"] == [1.0, 2.0, 4.0]
    assert c.meta["capped"] and C.implausible_batch(c) is None


def test_dear_alternating_widths_with_cheap_steady_ones_are_a_device_not_a_busy_machine():
    """The H200's calibration of 2026-11-28 (a batch of 2 after a one-token
    decode: 5.1 decodes; the same width repeated: 1.13): the alternating
    costs are real (CUDA graphs captured anew at each change of shape), so
    the curve is kept as measured; a busy CPU's, whose steady widths are as
    dear, is still caught."""
    gpu = CostCurve([1, 2, 4, 8], [1.0, 5.14, 5.03, 5.11], 0.00108, {"prefix": 300}, 0.00108, [],
                    [1.0, 5.0, 5.0, 5.1], 0.0054, 0.0047, [1.0, 1.13, 1.24, 1.43])
    assert C.implausible_batch(gpu) is None
    busy = busy_curve()
    busy.steady_rel = [1.0, 7.5, 7.6]
    assert C.implausible_batch(busy) == 2


def test_a_busy_first_measurement_and_a_quiet_second_caches_the_second(cache, monkeypatch):
    results = [busy_curve(), small_curve()]
    monkeypatch.setattr(C, "measure_cost_curve", lambda backend, progress=None, pause=None: results.pop(0))
    c = C.load_or_measure("backend", "k")
    assert c.rel == [1.0, 1.5, 2.5] and "capped" not in c.meta
    assert C.cached_curve("k").rel == [1.0, 1.5, 2.5]


def test_a_slice_waits_until_the_model_has_been_quiet():
    """quiet_s: after a request ends, the measurement's next slice starts
    only once quiet_s have passed with no request (a fixed clock here), so a
    burst of requests is never split by a slice."""
    now = [100.0]
    p = Pacer(quiet_s=3.0, clock=lambda: now[0])
    p.enter()
    p.exit()                                    # a request ended at t = 100
    started = threading.Event()

    def measure(pacer):
        pacer.pause()
        started.set()
    task = BackgroundTask(measure, p)
    try:
        now[0] = 102.9                          # 2.9 s of quiet: not yet
        assert not started.wait(0.3)
        p.enter()                               # the burst goes on: another request at 102.9 ...
        now[0] = 104.0
        p.exit()                                # ... that ends at 104
        now[0] = 106.5
        assert not started.wait(0.3)            # 2.5 s after it: still not
        now[0] = 107.1
        assert started.wait(5)                  # 3.1 s after it: the slice starts
    finally:
        task.stop()


def test_the_first_request_after_a_slice_puts_the_backend_back():
    """after_slice runs once, on the request's side, for the first request
    after one or more slices (before_slice once per request-to-slice turn);
    one that raises leaves no request counted; settle() runs it at close."""
    calls = []
    p = Pacer(before_slice=lambda: calls.append("before"), after_slice=lambda: calls.append("after"))
    p.enter()
    p.exit()
    assert calls == []                          # no slice ran yet
    assert p.pause() is True and calls == ["before"]
    p.end()
    p.enter()
    assert calls == ["before", "after"]
    p.exit()
    p.enter()                                   # no slice since the last request
    p.exit()
    assert p.pause() is True and p.pause() is False and p.slices == 3   # two slices in a row: one before
    p.end()
    p.settle()
    assert calls == ["before", "after", "before", "after"]

    def boom():
        raise RuntimeError("restore failed")
    q = Pacer(after_slice=boom)
    q.pause()
    q.end()
    with pytest.raises(RuntimeError):
        q.enter()
    assert q._requests == 0


@pytest.mark.parametrize("system", ["You are a helpful assistant. Answer briefly.",
                                    "You are a careful assistant who answers in plain words. " * 12])
def test_a_turn_after_a_slice_reads_only_its_new_tokens(model_path, cache, monkeypatch, system):
    """Issue 64 item 4, on real llama.cpp: a background slice lays down the
    measurement's own context between two turns; the next turn reads only
    the tokens that are new to it (the conversation is put back from memory,
    not prefilled: a short one too, under the prompt cache's 64-token
    minimum), answers as without the slice, and the measurement's cells are
    saved nowhere."""
    from edgespec import SpecModel
    from edgespec.core.prefix_cache import common_prefix

    own = np.arange(2000, 2200, dtype=np.int32)        # the measurement's context: no prompt's tokens
    laid = []

    def measure(backend, progress=None, pause=None):
        while True:
            pause()                                         # every use of the backend within a slice
            time.sleep(0.01)
            C.prefill(backend, own, pause, C.PACED_CHUNK)   # as measure_at: reset, 64-token chunks, pauses
            laid.append(len(own))
    monkeypatch.setattr(C, "measure_cost_curve", measure)
    m = SpecModel(model_path, drafter="none", n_ctx=1024)
    try:
        assert m.calibration_state == "measuring"
        m._pacer.quiet_s = 1e9                          # no slice until the reference is taken
        convo = [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]
        first = m.chat(convo, max_tokens=8)
        turn = convo + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And a vegetable?"}]
        want = m.chat(turn, max_tokens=8)               # the next turn without a slice before it
        assert m.chat(convo, max_tokens=8).tokens == first.tokens      # the first turn's cells again
        n = len(laid)
        m._pacer.quiet_s = 0.0
        deadline = time.monotonic() + 120
        while len(laid) <= n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(laid) > n, "no slice laid its context down within 120 s"
        r = m.chat(turn, max_tokens=8)
        assert want.n_reused_tokens > 10 and r.n_reused_tokens == want.n_reused_tokens
        assert r.n_prompt_tokens == want.n_prompt_tokens and r.tokens == want.tokens
        held = [e.tokens for e in m.prefix_cache.entries.values()]
        assert not any(common_prefix(t, own, len(own)) > 0 for t in held)
    finally:
        m.close()
