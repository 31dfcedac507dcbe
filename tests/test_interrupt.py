"""A request interrupts a background measurement's decode (edgespec.backend.interrupt,
calibration.background.Pacer): the decode stops, the committed prefix is all the KV
cache holds, and what is decoded after it is bit-identical to an uninterrupted run."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from edgespec.backend.interrupt import attach, new_flag
from edgespec.backend.llama import LlamaBackend
from edgespec.calibration.background import BackgroundTask, Pacer
from edgespec.calibration.curve import retried
from edgespec.errors import Interrupted

TOKS = np.arange(100, 140, dtype=np.int32)


def _backend(model_path):
    return LlamaBackend(model_path, n_ctx=512, n_threads=2, max_nodes=16, max_leaves=1)


def _chain(be, toks):
    """The logits of a chain decoded after the committed prefix, whose cells are then dropped."""
    n = len(toks)
    be.decode_tree(toks, np.arange(n, dtype=np.int32), np.zeros(n, np.int32), np.ones(n, np.int32), 1)
    out = be.logits().copy()
    be.keep(0)
    return out


def test_a_set_flag_stops_decodes_and_prefills_and_the_cache_keeps_the_prefix(model_path):
    ref = _backend(model_path)
    be = _backend(model_path)
    try:
        ref.prefill(TOKS[:20], want_last_logits=False)
        want = _chain(ref, TOKS[20:28])
        be.prefill(TOKS[:20], want_last_logits=False)
        flag = new_flag()
        attach(be, flag)
        flag[0] = 1
        with pytest.raises(Interrupted):
            _chain(be, TOKS[20:28])
        assert be.n_past == 20
        with pytest.raises(Interrupted):
            be.prefill(TOKS[20:40], want_last_logits=False)
        assert be.n_past == 20
        flag[0] = 0
        got = _chain(be, TOKS[20:28])         # the interrupted cells left nothing behind
        assert np.array_equal(got, want)
        attach(be, None)
        flag[0] = 1                          # detached: the flag no longer matters
        assert np.array_equal(_chain(be, TOKS[20:28]), want)
    finally:
        ref.close()
        be.close()


def test_a_request_interrupts_the_slice_in_progress_and_the_sample_is_taken_again(model_path):
    """A measurement whose one slice would run up to 3,000 decodes: a request
    that enters once the slice has begun stops it (the pacer's flag), waits
    only for that, runs, and the measurement lays its context down again
    (relay) and takes the sample again afterwards."""
    be = _backend(model_path)
    p = Pacer()
    attach(be, p.flag)
    started, log, runs = threading.Event(), [], []

    def long_sample():
        runs.append(1)
        started.set()
        for _ in range(3000 if len(runs) == 1 else 3):
            _chain(be, TOKS[20:21])
        return "sampled"

    def measure(pacer):
        pacer.pause()
        be.prefill(TOKS[:20], want_last_logits=False)
        log.append(retried(long_sample, pacer.pause, lambda: log.append("relaid")))
    try:
        task = BackgroundTask(measure, p)
        assert started.wait(60)
        p.enter()
        log.append("request")
        time.sleep(0.05)
        p.exit()
        assert task.wait(600) and task.error is None
        assert log == ["request", "relaid", "sampled"] and len(runs) == 2, log
        assert p.interrupts == 1 and len(p.waits) == 1
    finally:
        be.close()


def test_answers_while_a_real_calibration_is_interrupted_equal_plain_decoding(model_path, tmp_path, monkeypatch):
    """A fresh cache: the quick curve at load, the full measurement (small
    here) between requests sent back to back, which interrupt its slices;
    every answer equals plain decoding's (exact kernels), and the measurement
    still ends with a curve."""
    from edgespec import SpecModel
    from edgespec.calibration import curve as C

    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))
    real = C.measure_cost_curve

    def small(backend, progress=None, pause=None):
        return real(backend, ts=(1, 2, 4, 8), prefixes=(300,), reps=2, progress=progress, pause=pause)
    monkeypatch.setattr(C, "measure_cost_curve", small)
    prompts = [f"Repeat exactly: item {i} costs {i * 7} coins, item {i} costs {i * 7} coins." for i in range(4)]
    with SpecModel(model_path, drafter="none", n_ctx=1024, calibrate=False) as ref:
        want = [ref.generate(p, max_tokens=24).tokens for p in prompts]
    m = SpecModel(model_path, drafter="suffix", n_ctx=1024)
    try:
        assert m.calibration_state == "measuring" and m.cost.meta.get("quick")
        got = [m.generate(p, max_tokens=24).tokens for p in prompts]
        assert got == want
        assert m.wait_for_calibration(600) and m.calibration_state == "measured"
        assert not m.cost.meta.get("quick") and m.engine.cost is m.cost
    finally:
        m.close()
