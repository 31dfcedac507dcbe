"""--kernels auto (edgespec.calibration.kernelchoice): the choice on hand-made prices, the
cache, and the real measurement of both settings in child processes."""
from __future__ import annotations

import pytest

from edgespec.calibration import kernelchoice as kc
from edgespec.errors import ConfigError


@pytest.fixture
def real_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_exact_is_kept_within_five_percent_of_fast_at_every_size():
    fast = {1: 0.020, 16: 0.080}
    assert kc.choose({1: 0.0209, 16: 0.0839}, fast) == "exact"      # 4.5% and 4.9% dearer
    assert kc.choose({1: 0.0200, 16: 0.0850}, fast) == "fast"       # the batch 6% dearer
    assert kc.choose({1: 0.0300, 16: 0.0800}, fast) == "fast"       # one-token decodes 1.5x (the Xeon)
    assert kc.choose({1: 0.0190, 16: 0.0700}, fast) == "exact"      # exact faster


def test_price_round_trips_and_malformed_ones_are_refused():
    p = kc.KernelPrice({1: 0.03, 16: 0.09}, {1: 0.02, 16: 0.06}, "fast", "2026-11-25 13:00:00")
    q = kc.KernelPrice.from_json(p.to_json())
    assert q == p and q.ratio(1) == pytest.approx(1.5)
    assert "1.50x fast on a one-token decode, 1.50x on a batch of 16: fast" in p.describe()
    for bad in (dict(p.to_json(), choice="quick"), dict(p.to_json(), version=0),
                dict(p.to_json(), fast_s={"1": 0.02}), dict(p.to_json(), exact_s={"1": 0.0, "16": 1.0})):
        with pytest.raises((ValueError, KeyError)):
            kc.KernelPrice.from_json(bad)


def test_resolve_passes_settings_through_and_reads_the_cached_verdict(real_cache, model_path):
    assert kc.resolve("exact", model_path, 2, gpu=False, measure=False) == ("exact", None)
    assert kc.resolve("fast", model_path, 2, gpu=False, measure=False) == ("fast", None)
    assert kc.resolve("auto", model_path, 2, gpu=True, measure=False) == ("exact", None)
    with pytest.raises(ConfigError, match="kernels must be one of auto, exact, fast"):
        kc.resolve("quick", model_path, 2, gpu=False, measure=False)
    # nothing measured yet: exact, no price, and no child processes
    assert kc.resolve("auto", model_path, 2, gpu=False, measure=False) == ("exact", None)
    assert kc.cached_price("/no/such/model.gguf", 2) is None
    # a cached verdict is used, per thread count
    p = kc.KernelPrice({1: 0.03, 16: 0.09}, {1: 0.02, 16: 0.06}, "fast", "x")
    from edgespec.calibration.cache import write_cache
    assert write_cache(kc._path(model_path, 2), p.to_json())
    assert kc.resolve("auto", model_path, 2, gpu=False, measure=False) == ("fast", p)
    assert kc.resolve("auto", model_path, 3, gpu=False, measure=False) == ("exact", None)


def test_both_settings_are_timed_in_child_processes_and_cached(real_cache, model_path):
    done = []
    p = kc.measure_price(model_path, 2, progress=lambda d, t: done.append((d, t)))
    assert done == [(1, 2), (2, 2)]
    assert set(p.exact_s) == set(p.fast_s) == set(kc.SIZES)
    assert all(v > 0 for v in list(p.exact_s.values()) + list(p.fast_s.values()))
    assert p.exact_s[16] > p.exact_s[1] and p.fast_s[16] > p.fast_s[1]      # a batch costs more than a token
    assert p.choice == kc.choose(p.exact_s, p.fast_s)
    assert kc.cached_price(model_path, 2) == p
    assert kc.resolve("auto", model_path, 2, gpu=False, measure=False) == (p.choice, p)


def test_spec_model_loads_what_auto_resolves_to(real_cache, model_path):
    from edgespec import SpecModel
    from edgespec.app.cli.output import kernels_line
    from edgespec.calibration.cache import write_cache
    p = kc.KernelPrice({1: 0.03, 16: 0.09}, {1: 0.02, 16: 0.06}, "fast", "x")
    assert write_cache(kc._path(model_path, 2), p.to_json())
    m = SpecModel(model_path, drafter="none", n_ctx=512, n_threads=2, calibrate=False, kernels="auto")
    try:
        assert (m.kernels_setting, m.kernels, m.kernel_price) == ("auto", "fast", p)
        assert m.backend.exact is False and m.backend.flash_attn is False
        assert kernels_line(m).startswith("kernels: auto -> fast (exact kernels cost 1.50x fast")
    finally:
        m.close()
    m = SpecModel(model_path, drafter="none", n_ctx=512, n_threads=2, calibrate=False, kernels="exact")
    try:
        assert (m.kernels, m.kernel_price, m.backend.exact) == ("exact", None, True)
        assert kernels_line(m) == "kernels: exact (--kernels exact)"
    finally:
        m.close()


def test_the_default_setting_comes_from_the_environment(real_cache, model_path, monkeypatch):
    """SpecModel(kernels=None) and the CLI's --kernels default read
    $EDGESPEC_KERNELS (the tests set it to exact), else auto."""
    assert kc.resolve(None, model_path, 2, gpu=False, measure=False) == ("exact", None)
    monkeypatch.setenv("EDGESPEC_KERNELS", "fast")
    assert kc.resolve(None, model_path, 2, gpu=False, measure=False) == ("fast", None)
    monkeypatch.delenv("EDGESPEC_KERNELS")
    p = kc.KernelPrice({1: 0.02, 16: 0.06}, {1: 0.02, 16: 0.06}, "exact", "x")
    from edgespec.calibration.cache import write_cache
    assert write_cache(kc._path(model_path, 2), p.to_json())
    assert kc.resolve(None, model_path, 2, gpu=False, measure=False) == ("exact", p)
    monkeypatch.setenv("EDGESPEC_KERNELS", "quick")
    with pytest.raises(ConfigError, match="kernels must be one of"):
        kc.resolve(None, model_path, 2, gpu=False, measure=False)


def test_stats_name_the_auto_verdict(monkeypatch, model_path):
    """`generate --kernels auto --stats` says what auto chose and why (a cached
    verdict of exact here: the session's calibration is reused)."""
    from click.testing import CliRunner

    from edgespec.app.cli import main
    p = kc.KernelPrice({1: 0.0202, 16: 0.0808}, {1: 0.02, 16: 0.08}, "exact", "x")
    monkeypatch.setattr(kc, "cached_price", lambda path, n: p)
    r = CliRunner().invoke(main, ["generate", "--kernels", "auto", "--stats", "-n", "4", "Say hi."])
    assert r.exit_code == 0, r.output
    assert ("kernels: auto -> exact (exact kernels cost 1.01x fast on a one-token decode, 1.01x on a batch "
            "of 16: exact)") in r.output
