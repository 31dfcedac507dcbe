"""The verify cost curve: interpolation between measured contexts (hand-written
curves), its measurement on the real backend, and the engine's gate reading the
table of the context it is at."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.calibration.curve import CostCurve, measure_cost_curve
from edgespec.core.config import EngineConfig
from edgespec.core.engine import Engine, drain
from edgespec.drafters import make_drafter
from edgespec.core.params import Request

TS = [1, 2, 4, 8]


def curve():
    # after 300 cells a batch of 8 costs 3x one token; after 1300 cells 5x,
    # and one token 10 ms -> 20 ms
    return CostCurve(TS, [1.0, 1.2, 1.8, 3.0], 0.010, {"prefix": 300}, 0.005,
                     [{"n_kv": 1300, "t1_s": 0.020, "rel": [1.0, 1.4, 2.6, 5.0]}])


def test_table_without_context_is_the_shortest_measured_curve():
    t = curve().table(10)
    # between measured sizes a step: a batch is charged (and padded to) the
    # next measured size; beyond them extrapolated from the last two (0.3 per token)
    assert t[:9] == pytest.approx([0, 1.0, 1.2, 1.8, 1.8, 3.0, 3.0, 3.0, 3.0])
    assert t[10] == pytest.approx(3.6)


def test_table_interpolates_between_contexts():
    c = curve()
    mid = c.table(8, n_kv=800)           # halfway between 300 and 1300 cells
    assert mid[8] == pytest.approx(4.0) and mid[2] == pytest.approx(1.3) and mid[1] == 1.0
    assert c.t1_at(800) == pytest.approx(0.015)
    # below the first context: the first curve; at a measured one: that curve
    assert c.table(8, n_kv=100)[8] == pytest.approx(3.0) and c.t1_at(100) == pytest.approx(0.010)
    assert c.table(8, n_kv=1300)[8] == pytest.approx(5.0)
    # beyond the last: extrapolated linearly (attention grows with the cells), at most to twice it
    assert c.table(8, n_kv=2300)[8] == pytest.approx(7.0)
    assert c.t1_at(2300) == pytest.approx(0.030)
    assert c.table(8, n_kv=10_000)[8] == pytest.approx(c.table(8, n_kv=2600)[8]) == pytest.approx(7.6)
    # short regime, old caches (no curve of its own): one token with every
    # thread relative to the single-thread t1, batches as after 300 cells
    assert c.table(8, short=True)[1] == pytest.approx(0.5)
    assert c.table(8, short=True)[8] == pytest.approx(3.0)
    # with its own curve (relative to its 5 ms token), in units of the 10 ms t1
    c.short_rel = [1.0, 2.0, 3.0, 5.0]
    t = c.table(8, short=True)
    assert t[1] == pytest.approx(0.5) and t[2] == pytest.approx(1.0) and t[8] == pytest.approx(2.5)
    assert c.table(8)[2] == pytest.approx(1.2)          # the other regime is unchanged


def test_after_batch_cost_is_charged_to_batches():
    """The one-token decode after a batch costs after_s more; the tables add it
    (in units of the context's t1) to every batch size, never to T = 1."""
    c = curve()
    c.after_s = 0.001                    # 0.1 of the 10 ms token after 300 cells
    c.longer[0]["after_s"] = 0.004       # 0.2 of the 20 ms token after 1300 cells
    t = c.table(8)
    assert t[1] == 1.0 and t[2] == pytest.approx(1.3) and t[8] == pytest.approx(3.1)
    assert c.table(8, n_kv=800)[8] == pytest.approx(4.15)     # halfway: (3.1 + 5.2) / 2
    c.short_rel = [1.0, 2.0, 3.0, 5.0]
    c.after_short_s = 0.0005                # in units of the 10 ms t1: + 0.05
    s = c.table(8, short=True)
    assert s[1] == pytest.approx(0.5) and s[2] == pytest.approx(1.05)
    d = CostCurve.from_json(c.to_json())
    assert (d.after_s, d.after_short_s, d.longer[0]["after_s"]) == (0.001, 0.0005, 0.004)
    with pytest.raises(ValueError):
        CostCurve.from_json(dict(c.to_json(), after_s=-0.001))


def test_interpolated_table_never_falls_with_T():
    # noise made the longer curve dip at T=4; an interpolated cost must stay monotone
    c = CostCurve(TS, [1.0, 1.2, 1.8, 3.0], 0.01, {"prefix": 300}, 0.0,
                  [{"n_kv": 1300, "t1_s": 0.02, "rel": [1.0, 3.0, 2.0, 4.0]}])
    t = c.table(8, n_kv=1000)
    assert np.all(np.diff(t[1:]) >= 0)


def test_json_round_trip_and_malformed_curves():
    c = curve()
    d = CostCurve.from_json(c.to_json())
    assert d.contexts() == c.contexts() and d.t1_short_s == c.t1_short_s and d.short_rel == []
    c.short_rel = [1.0, 1.5, 2.0, 3.0]
    assert CostCurve.from_json(c.to_json()).short_rel == c.short_rel
    # a cache written before context-dependent curves still loads (one context)
    old = {"ts": TS, "rel": [1.0, 1.2, 1.8, 3.0], "t1_s": 0.01, "meta": {"prefix": 300}}
    assert CostCurve.from_json(old).table(8, n_kv=2000)[8] == pytest.approx(3.0)
    for bad in ({"n_kv": 200, "t1_s": 0.02, "rel": [1, 2, 3, 4]},      # not after the first context
                {"n_kv": 900, "t1_s": 0.02, "rel": [1, 2, 3]},         # wrong length
                {"n_kv": 900, "t1_s": 0.0, "rel": [1, 2, 3, 4]}):      # no time
        with pytest.raises(ValueError):
            CostCurve.from_json(dict(c.to_json(), longer=[bad]))
    with pytest.raises(ValueError):
        CostCurve.from_json(dict(c.to_json(), short_rel=[1.0, 2.0]))


def test_measure_on_the_real_backend(model):
    """Contexts are capped by the context size, one within 1.5x of the previous is
    skipped (400 after 300); every curve starts at 1 and rises."""
    be = model.backend
    c = measure_cost_curve(be, ts=(1, 2, 4), prefixes=(300, 400, 600, 5000), reps=1)
    cap = min(be.n_ctx - 4 - 2, be.n_ctx // 2)
    assert [n for n, _, _ in c.contexts()] == [300, 600, cap]
    for _, t1, rel in c.contexts():
        assert t1 > 0 and rel[0] == 1.0 and rel == sorted(rel)
    assert c.t1_short_s > 0 and c.short_rel[0] == 1.0 and len(c.short_rel) == 3
    assert c.after_s >= 0 and c.after_short_s >= 0 and all(d["after_s"] >= 0 for d in c.longer)
    assert be.n_past == 0           # the backend is left empty


def test_gate_reads_the_cost_of_its_context(model):
    """The same copyable answer is drafted under a curve where batches are cheap
    and decoded plainly where the curve for the context says they never pay
    (the calibrated prior alone: these curves are made up, and the learned
    step costs would correct them from the real decodes)."""
    prompt = model.prompt_tokens([{"role": "user", "content": "Repeat exactly: " + ", ".join(
        f"item {i} is {w}" for i, w in enumerate(["red", "green", "blue", "amber", "teal", "plum"] * 7))}])
    n0 = len(prompt)
    assert 256 < n0 < 1000
    flat = [1.0, 1.0, 1.0, 1.0]
    steep = [1.0, 2.0, 4.0, 8.0]            # a batch of T costs T plain steps: drafting cannot pay
    eng = Engine(model.backend, make_drafter("suffix"), None, EngineConfig(max_nodes=16, learn_costs=False, guard=False))
    try:
        results = {}
        for name, longer_n in (("cheap here", 4 * n0), ("dear here", n0 // 2 + 128)):
            # below `longer_n` cells the interpolation is still near the flat curve
            eng.set_cost(CostCurve(TS, flat, 0.01, {"prefix": n0 // 2}, 0.0,
                                   [{"n_kv": longer_n, "t1_s": 0.01, "rel": steep}]))
            eng.reset()
            results[name] = drain(eng.run(eng.resolve(Request(prompt, max_tokens=48, reuse_prefix=False))))
        assert results["cheap here"].n_draft_accepted > 10
        assert results["dear here"].n_draft_nodes == 0
        assert results["cheap here"].tokens == results["dear here"].tokens
    finally:
        eng.reset()


def test_cached_curve_reused_only_when_it_covers_the_context(tmp_path, monkeypatch):
    """A curve cached by a run with a small context (contexts capped) is measured
    again for a larger one; one measured with a larger context serves a smaller."""
    from edgespec.calibration import curve
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(backend, progress=None):
        calls.append(1)
        return CostCurve(TS, [1.0, 1.2, 1.8, 3.0], 0.01, {"prefix": 300}, 0.0,
                         [{"n_kv": 1000, "t1_s": 0.02, "rel": [1.0, 1.4, 2.6, 5.0]}])

    monkeypatch.setattr(curve, "measure_cost_curve", fake_measure)
    assert curve.plan_contexts(2048) == [300, 1000]
    assert curve.plan_contexts(4096) == [300, 1000, 2000]
    assert curve.plan_contexts(512) == [256]
    curve.load_or_measure(None, "k", needed=1000)
    curve.load_or_measure(None, "k", needed=256)         # covered: from the cache
    assert len(calls) == 1
    curve.load_or_measure(None, "k", needed=2000)        # not covered: measured again
    assert len(calls) == 2


def test_calibration_key_follows_the_file_content_not_its_place(tmp_path):
    """A copy (or a reinstall: a new path and mtime) keeps the calibration; a
    file that differs in size, in its first MiB (the GGUF header) or in its
    last MiB gets its own; so do other settings."""
    import shutil

    from edgespec.calibration.cache import calibration_key, model_fingerprint

    rng = np.random.default_rng(1)
    a = tmp_path / "a.gguf"
    a.write_bytes(rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())
    b = tmp_path / "elsewhere" / "b.gguf"
    b.parent.mkdir()
    shutil.copyfile(a, b)
    key = calibration_key(str(a), 0, 2, "k=q8_0")
    assert calibration_key(str(b), 0, 2, "k=q8_0") == key
    assert calibration_key(str(b), 0, 1, "k=q8_0") != key
    assert calibration_key(str(b), 0, 2, "k=f16") != key
    data = bytearray(a.read_bytes())
    for pos in (10, len(data) - 10):
        changed = bytearray(data)
        changed[pos] ^= 1
        b.write_bytes(bytes(changed))
        assert model_fingerprint(str(b)) != model_fingerprint(str(a)), pos
    b.write_bytes(bytes(data) + b"\0")
    assert model_fingerprint(str(b)) != model_fingerprint(str(a))
    tiny = tmp_path / "tiny.gguf"          # smaller than the hashed spans
    tiny.write_bytes(b"GGUF")
    assert len(model_fingerprint(str(tiny))) == 32
