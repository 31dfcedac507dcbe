"""A SpecModel shared by threads: one request at a time, in arrival order,
streams that hold the model, cancellation from another thread, close().

Greedy decoding is deterministic and lossless, so "not corrupted" is checked
the strict way: every answer must equal the same request run alone."""
from __future__ import annotations

import threading
import time

import pytest

import edgespec
from edgespec import ModelBusyError, ModelClosedError, SpecModel

pytestmark = pytest.mark.model

PROMPTS = ["Name three fruits.", "Name three colors.", "Count from one to five.", "What is the capital of France?",
           "Name two planets.", "Say hello in French.", "Name three animals.", "What is 2 + 2?",
           "Name a famous painter.", "Name three vegetables.", "What color is the sky?", "Name two oceans."]
N_TOK = 12


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt's answer run alone (suffix drafter, greedy)."""
    return {p: model.generate(p, max_tokens=N_TOK, drafter="suffix").tokens for p in PROMPTS}


def _request(model, kind: str, prompt: str) -> list:
    """One request through generate(), stream() or chat(): its tokens."""
    if kind == "generate":
        return model.generate(prompt, max_tokens=N_TOK, drafter="suffix").tokens
    if kind == "stream":
        chunks = list(model.stream(prompt, max_tokens=N_TOK, drafter="suffix"))
        assert chunks[-1].result is not None
        toks = [t for c in chunks for t in c.tokens]
        assert toks[:chunks[-1].result.n_generated] == chunks[-1].result.tokens
        return chunks[-1].result.tokens
    return model.chat([{"role": "user", "content": prompt}], max_tokens=N_TOK, drafter="suffix",
                      reuse_prefix=False).tokens


def test_four_threads_three_requests_each_equal_alone(model, alone):
    """4 threads x 3 requests (generate, stream, chat) started together on one
    model: every answer is token-identical to the same request run alone."""
    barrier = threading.Barrier(4)
    got: dict = {}
    errors: list = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            for j, kind in enumerate(("generate", "stream", "chat")):
                p = PROMPTS[3 * i + j]
                got[p] = _request(model, kind, p)
        except BaseException as e:          # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert got == alone


def test_generate_while_a_stream_is_paused(model, alone):
    """A stream paused half-way holds the model: another thread's generate()
    waits for it (and then runs), the same thread's gets ModelBusyError at
    once, and neither answer is corrupted."""
    p_stream, p_other = PROMPTS[0], PROMPTS[1]
    s = model.stream(p_stream, max_tokens=N_TOK, drafter="suffix")
    first = [next(s), next(s)]
    with pytest.raises(ModelBusyError, match="own stream"):
        model.generate(p_other, max_tokens=N_TOK)          # same thread: would wait forever
    done: dict = {}

    def other() -> None:
        done["tokens"] = model.generate(p_other, max_tokens=N_TOK, drafter="suffix").tokens
        done["t"] = time.monotonic()

    t = threading.Thread(target=other)
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and "tokens" not in done            # it waits for the paused stream
    nowait: list = []
    th = threading.Thread(target=lambda: nowait.append(_try_nowait(model)))
    th.start()
    th.join()
    assert isinstance(nowait[0], ModelBusyError) and "wait=False" in str(nowait[0])
    rest = list(s)
    t_stream_end = time.monotonic()
    t.join(timeout=300)
    result = rest[-1].result
    assert rest[-1].finish_reason == result.stop_reason and all(c.result is None for c in first + rest[:-1])
    assert "".join(c.text for c in first + rest) == result.text
    assert result.tokens == alone[p_stream]
    assert done["tokens"] == alone[p_other] and done["t"] >= t_stream_end
    assert list(s) == [] and s.closed                        # an ended stream stays ended


def _try_nowait(model):
    try:
        model.generate(PROMPTS[2], max_tokens=2, wait=False)
    except ModelBusyError as e:
        return e
    return AssertionError("generate(wait=False) ran while a stream held the model")


def test_timeout_and_closing_a_stream_from_another_thread(model, alone):
    s = model.stream(PROMPTS[3], max_tokens=200, drafter="suffix")
    next(s)
    t0 = time.monotonic()
    errs: list = []

    def wait_briefly() -> None:
        try:
            model.generate("hi", max_tokens=2, timeout=0.3)
        except ModelBusyError as e:
            errs.append(e)

    th = threading.Thread(target=wait_briefly)
    th.start()
    th.join()
    assert "timeout" in str(errs[0]) and time.monotonic() - t0 >= 0.3
    closer = threading.Thread(target=s.close)              # close() is safe from any thread
    closer.start()
    closer.join()
    assert s.closed and list(s) == []
    assert model.generate(PROMPTS[4], max_tokens=N_TOK, drafter="suffix").tokens == alone[PROMPTS[4]]


def test_stream_chunks_carry_tokens_drafts_and_the_result(model):
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox."
    with model.stream(prompt, max_tokens=40, drafter="suffix") as s:
        chunks = list(s)
    r = chunks[-1].result
    assert isinstance(chunks[-1], edgespec.StreamChunk) and chunks[-1].finish_reason == r.stop_reason
    assert chunks[-1].text == "" and chunks[-1].tokens == [] and s.result is r
    assert "".join(c.text for c in chunks) == r.text
    assert [t for c in chunks for t in c.tokens][:r.n_generated] == r.tokens
    assert sum(c.n_drafted for c in chunks) == r.n_draft_accepted
    for c in chunks:
        assert "".join(t for t, _ in c.spans) == c.text
    drafted = "".join(t for c in chunks for t, d in c.spans if d)
    assert (len(drafted) > 0) == (r.n_draft_accepted > 0)
    assert not hasattr(model, "last_result")


def test_cancel_from_another_thread_stops_within_one_step(model):
    """cancel= set by another thread: the request ends with stop_reason
    "cancelled" after at most one more step, and the next request (reusing the
    KV cache) equals a freshly loaded model's answer."""
    prompt = "Write a long story about a dragon who learns to fly."
    ev = threading.Event()
    seen_after: list = []
    n_chunks = [0]

    def on_chunk(c) -> None:
        if c.tokens:
            n_chunks[0] += 1
            if ev.is_set():
                seen_after.append(c)

    res: dict = {}
    t = threading.Thread(target=lambda: res.setdefault("r", model.generate(
        prompt, max_tokens=400, drafter="suffix", cancel=ev, on_chunk=on_chunk)))
    t.start()
    while n_chunks[0] < 3 and t.is_alive():
        time.sleep(0.005)
    ev.set()
    t.join(timeout=300)
    r = res["r"]
    assert r.stop_reason == "cancelled" and r.n_generated < 400
    assert len(seen_after) <= 1                               # the step in progress, then no more
    again = model.generate(prompt, max_tokens=24, drafter="suffix", reuse_prefix=True)
    assert again.n_reused_tokens > 0
    fresh = SpecModel(model.model_path, drafter="none", n_ctx=2048)
    try:
        assert fresh.generate(prompt, max_tokens=24).tokens == again.tokens
        # a callable works as cancel too: cancelled before the first step
        r2 = fresh.generate(prompt, max_tokens=24, cancel=lambda: True)
        assert r2.stop_reason == "cancelled" and r2.n_generated == 1
        _close_while_running(fresh)
    finally:
        fresh.close()


def _close_while_running(m: SpecModel) -> None:
    """close() from another thread cancels the running request, waits for it,
    and every later use raises ModelClosedError; close() again is a no-op."""
    started = threading.Event()
    out: dict = {}

    def run() -> None:
        out["r"] = m.generate("Write a long poem about the sea.", max_tokens=400,
                              on_chunk=lambda c: started.set())

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(300)
    m.close()
    t.join(timeout=60)
    assert out["r"].stop_reason == "cancelled"
    m.close()
    for call in (lambda: m.generate("hi"), lambda: m.stream("hi"), lambda: m.tokenize("hi"),
                 lambda: m.new_session()):
        with pytest.raises(ModelClosedError):
            call()
    assert m.closed


def test_close_from_inside_the_own_request_fails_loudly(model):
    with pytest.raises(ModelBusyError, match="inside"):
        model.generate("Hi", max_tokens=3, on_text=lambda t: model.close())
    assert not model.closed
    assert model.generate("Hi", max_tokens=3).n_generated >= 1


def test_errors_form_one_exported_hierarchy():
    for name in ("ConfigError", "PromptTooLongError", "ModelFileError", "CorpusError", "EmbeddingsError",
                 "BenchError", "BackendError", "ModelLoadError", "ModelBusyError", "ModelClosedError"):
        assert issubclass(getattr(edgespec, name), edgespec.EdgespecError), name
    for name in ("ConfigError", "PromptTooLongError", "ModelFileError", "CorpusError", "BenchError"):
        assert issubclass(getattr(edgespec, name), ValueError), name     # callers that caught ValueError
    from edgespec.backend.llama import BackendError
    from edgespec.corpus.format import CorpusError
    from edgespec.models.gguf import ModelFileError
    assert (BackendError, CorpusError, ModelFileError) == (edgespec.BackendError, edgespec.CorpusError,
                                                           edgespec.ModelFileError)
    with pytest.raises(edgespec.ConfigError):
        edgespec.SamplingConfig(temperature=-1)


def test_bad_requests_raise_typed_errors_before_running(model):
    with pytest.raises(edgespec.PromptTooLongError) as e:
        model.generate("word " * (model.n_ctx + 10), max_tokens=5)
    assert e.value.n_ctx == model.n_ctx and e.value.n_prompt > model.n_ctx
    with pytest.raises(edgespec.PromptTooLongError):
        model.stream("word " * (model.n_ctx + 10), max_tokens=5)     # raised by stream() itself
    with pytest.raises(edgespec.ConfigError, match="max_tokens"):
        model.generate("Hi", max_tokens=0)
    with pytest.raises(edgespec.ConfigError, match="unknown drafter"):
        model.generate("Hi", max_tokens=2, drafter="bogus")
    # the model is not left held by a failed request
    assert model.generate("Hi", max_tokens=2, wait=False).n_generated >= 1


def test_init_failure_releases_the_backend(model, monkeypatch):
    """A SpecModel whose set-up fails after llama.cpp loaded (a bad drafter, a
    calibration that raises) frees the model and context before raising."""
    import edgespec.app.api as api
    import edgespec.app.engines as engines

    made = []

    class Recorded(api.LlamaBackend):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(api, "LlamaBackend", Recorded)
    with pytest.raises(edgespec.ConfigError, match="unknown drafter"):
        SpecModel(model.model_path, drafter="bogus", n_ctx=256, calibrate=False)
    assert len(made) == 1 and made[0].ctx is None and made[0].model is None

    def boom(done, total):
        raise RuntimeError("calibration interrupted")

    monkeypatch.setattr(engines, "load_or_measure", lambda be, key, **kw: kw["progress"](0, 1))
    with pytest.raises(RuntimeError, match="calibration interrupted"):
        SpecModel(model.model_path, n_ctx=256, progress=boom, calibrate=True)
    assert len(made) == 2 and made[1].ctx is None and made[1].model is None


def test_prediction_drafts_without_changing_the_text(model_path):
    """prediction= is one more draft source: with drafter none (no drafts of its
    own) the same text comes in fewer steps; a wrong prediction costs no text.
    The model verifies every draft (no cost gate, c(T) = T), so whether the
    prediction is drafted does not depend on this machine's calibrated costs."""
    with SpecModel(model_path, drafter="none", n_ctx=512, calibrate=False, cost_gate=False) as model:
        _prediction_drafts(model)


def _prediction_drafts(model) -> None:
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog."
    plain = model.generate(prompt, max_tokens=24, drafter="none")
    fast = model.generate(prompt, max_tokens=24, drafter="none", prediction=plain.text)
    assert fast.tokens == plain.tokens and fast.n_steps < plain.n_steps and fast.n_draft_accepted > 0
    wrong = model.generate(prompt, max_tokens=24, drafter="none", prediction="Completely different words here.")
    assert wrong.tokens == plain.tokens
    again = model.generate(prompt, max_tokens=24, drafter="none")     # the prediction was per request
    assert again.tokens == plain.tokens and again.n_draft_nodes == 0
