"""The exactness self-check on the default model: it passes with the default
settings, it catches a setting that is not exact, it is cached beside the
calibration, and its verdict reaches SpecModel.exact, generate --json/--stats
and the notice of chat/generate."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from edgespec.calibration import exactness as E
from edgespec.paths import cache_dir
from edgespec.backend.llama import EXACT_MAX_BATCH, LlamaBackend
from edgespec.app.cli import main

pytestmark = pytest.mark.model


def test_default_settings_pass_the_self_check(model):
    """SpecModel ran the check at calibration: batches of every size up to 48
    after 100 and 600 KV cells, bit-identical; the verdict is cached beside
    the cost curve, under the same key."""
    r = model.exactness
    assert model.exact is True and r.exact and r.failed == [] and r.max_abs_diff == 0.0
    assert r.max_t == EXACT_MAX_BATCH and r.contexts == [100, 600]
    path = os.path.join(cache_dir(), "calibration", model._calibration_key() + ".exact.json")
    with open(path) as f:
        assert E.ExactnessReport.from_json(json.load(f)).exact is True
    assert os.path.isfile(path.replace(".exact.json", ".json"))


def test_the_check_catches_split_kv_numerics(model):
    """Not every setting is exact: an f16 K cache with two threads for every
    decode (exact=False: no one-thread policy) makes a one-token decode past
    512 cells take llama.cpp's split-KV attention, which sums in another
    order than a batch.  The check must see that, and only past 512 cells."""
    be = LlamaBackend(model.model_path, n_ctx=1024, n_threads=2, max_nodes=8, exact=False, cache_type_k="f16")
    try:
        r = E.check_exactness(be, contexts=(100, 600), ts=(2, 3, 8))
    finally:
        be.close()
    assert not r.exact
    assert r.per_context["100"]["failed"] == []                  # below 512 cells: one kernel, exact
    assert r.per_context["600"]["failed"] == [2, 3, 8] and r.max_abs_diff > 0
    assert "NOT exact" in r.describe() and "2-3, 8" in r.describe()


def test_verdict_is_cached_and_rechecked_when_it_covers_less(model, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path))
    be = model.backend
    calls = []

    def fake_check(backend, progress=None, **kw):
        calls.append(1)
        return E.ExactnessReport(True, backend.max_nodes, E._exact_contexts(backend, backend.max_nodes))

    monkeypatch.setattr(E, "check_exactness", fake_check)
    r = E.load_or_check_exactness(be, "k1")
    assert r.exact and len(calls) == 1
    assert E.load_or_check_exactness(be, "k1").exact and len(calls) == 1            # from the cache
    E.load_or_check_exactness(be, "k1", recheck=True)
    assert len(calls) == 2                                                       # edgespec calibrate
    # a verdict for smaller batches (an older max_nodes) is not trusted
    path = tmp_path / "calibration" / "k1.exact.json"
    d = json.loads(path.read_text())
    path.write_text(json.dumps(dict(d, max_t=8)))
    E.load_or_check_exactness(be, "k1")
    assert len(calls) == 3
    assert E.load_or_check_exactness(be, "missing", cached_only=True) is None and len(calls) == 3


INEXACT = E.ExactnessReport(False, 48, [100, 600], 0.31, [8, 16, 48], 2)


def test_generate_reports_the_verdict(model, monkeypatch):
    """generate --json carries `exact` (and the detail when false); --stats
    prints the check's line; a false verdict adds a one-line notice."""
    r = CliRunner().invoke(main, ["generate", "--json", "--stats", "--max-tokens", "4", "Say hi."])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["exact"] is True and "exactness" not in out
    assert "exact: batches of 2..48 tokens give logits bit-identical" in r.stderr
    assert "note: on this model" not in r.stderr
    import edgespec.app.engines
    monkeypatch.setattr(edgespec.app.engines, "load_or_check_exactness", lambda *a, **k: INEXACT)
    r = CliRunner().invoke(main, ["generate", "--max-tokens", "4", "Say hi."])
    assert r.exit_code == 0, r.output
    assert "note: on this model and machine a verification batch's logits differ from one-token decoding " \
           "(by up to 0.31)" in r.stderr
    r = CliRunner().invoke(main, ["generate", "--json", "--max-tokens", "4", "Say hi."])
    out = json.loads(r.stdout)
    assert out["exact"] is False and out["exactness"]["failed"] == [8, 16, 48]
    r = CliRunner().invoke(main, ["chat"], input="/exit\n")
    assert r.exit_code == 0 and "note: on this model" in r.output


def test_fast_kernels_are_faster_settings_and_not_exact(model):
    """--kernels fast: flash attention off and a q8_0 K cache, every decode on
    every thread; the self-check must find that batched logits then differ
    (llama.cpp's attention products take other kernels for a batch), at short
    and long contexts alike, and the calibration is cached under its own key."""
    from edgespec import SpecModel
    fast = SpecModel(model.model_path, drafter="suffix", n_ctx=1024, calibrate=False, kernels="fast")
    try:
        be = fast.backend
        assert be.flash_attn is False and be.cache_type_k == "q8_0" and be.one_thread_after is None
        assert fast._calibration_key() != model._calibration_key()
        r = E.check_exactness(be, contexts=(100, 600), ts=(2, 8, 16))
        assert not r.exact and r.failed and r.max_abs_diff > 0
        toks = fast.prompt_tokens("Repeat exactly: alpha beta gamma delta, alpha beta gamma delta.")
        out = fast.generate(toks, max_tokens=16)
        assert out.n_generated == 16 or out.stop_reason == "stop"
    finally:
        fast.close()
    with pytest.raises(ValueError, match="kernels must be"):
        SpecModel(model.model_path, kernels="quick", calibrate=False)


def test_fast_kernels_turn_the_tiled_product_on_in_a_fresh_process(model):
    """The tiled K-quant product is one switch per process: a process whose
    first model is loaded with kernels="fast" gets it on, one whose first
    model is exact gets it off; a value in the environment wins."""
    import subprocess
    import sys
    code = ("import os; from edgespec import SpecModel; "
            "m = SpecModel(os.environ['M'], drafter='none', calibrate=False, n_ctx=256, kernels=os.environ['K']); "
            "from edgespec.backend.process import tiled_mm_setting; print(tiled_mm_setting())")
    for kernels, env, want in (("fast", None, "1"), ("exact", None, "0"), ("fast", "0", "0")):
        e = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
        e.update(M=model.model_path, K=kernels, **({"GGML_CPU_TILED_MM": env} if env else {}))
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-1] == want, (kernels, env, out.stdout)
