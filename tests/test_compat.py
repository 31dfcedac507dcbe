"""edgespec.Llama, the drop-in for llama-cpp-python: one script written
against llama_cpp.Llama's API runs unchanged on both, with the same response
shapes, and edgespec's text equals its own plain decoding (`none`)."""
from __future__ import annotations

import warnings

import pytest

import edgespec
from edgespec.bench.llamacpp import llama_cpp_python_repack

pytestmark = pytest.mark.model

MESSAGES = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
            {"role": "user", "content": "Name three fruits."}]


def script(llm) -> tuple[dict, dict]:
    """Code as a llama-cpp-python user writes it.  Returns (texts, responses)."""
    texts, resp = {}, {}
    r = llm.create_chat_completion(messages=MESSAGES, max_tokens=24, temperature=0.0)
    texts["chat"] = r["choices"][0]["message"]["content"]
    resp["chat"] = r
    assert r["usage"]["completion_tokens"] <= 24
    chunks = list(llm.create_chat_completion(messages=MESSAGES + [{"role": "assistant", "content": texts["chat"]},
                                                                  {"role": "user", "content": "And three colors?"}],
                                             max_tokens=24, temperature=0.0, stream=True))
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    texts["chat_stream"] = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    resp["chat_chunk"] = chunks[1]
    c = llm.create_completion("Q: What is the capital of France?\nA:", max_tokens=16, stop=[".", "\n\n"],
                              temperature=0.0)
    texts["stop"] = c["choices"][0]["text"]
    assert "." not in texts["stop"] and "\n\n" not in texts["stop"]
    resp["completion"] = c
    c = llm("The days of the week are Monday,", max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=42)
    texts["sampled"] = c["choices"][0]["text"]
    assert c["usage"]["completion_tokens"] <= 8
    pieces = list(llm("Once upon a time", max_tokens=10, temperature=0.0, stream=True))
    assert pieces[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    texts["completion_stream"] = "".join(p["choices"][0]["text"] for p in pieces)
    resp["completion_chunk"] = pieces[0]
    return texts, resp


def keys(obj, path: str = "") -> set:
    """Key paths of a response (lists: their first item)."""
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(path + "." + k)
            out |= keys(v, path + "." + k)
    elif isinstance(obj, list) and obj:
        out |= keys(obj[0], path + "[]")
    return out


@pytest.fixture(scope="module")
def runs(model):
    """The script on llama_cpp.Llama and on edgespec.Llama with `suffix` and `none`
    (the session model is loaded first, so the calibration is cached)."""
    import llama_cpp

    with llama_cpp_python_repack(False):
        ref = llama_cpp.Llama(model_path=model.model_path, n_ctx=2048, seed=1, verbose=False)
    try:
        out = {"llama_cpp": script(ref)}
    finally:
        ref.close()
    for drafter in ("suffix", "none"):
        llm = edgespec.Llama(model_path=model.model_path, n_ctx=2048, seed=1, verbose=False, drafter=drafter)
        try:
            out[drafter] = script(llm)
        finally:
            llm.close()
    return out


def test_script_runs_on_both_with_the_same_shapes(runs):
    ref_texts, ref_resp = runs["llama_cpp"]
    texts, resp = runs["suffix"]
    assert set(texts) == set(ref_texts)
    for name in ref_resp:
        assert keys(resp[name]) == keys(ref_resp[name]), name
    assert resp["chat"]["object"] == "chat.completion" and resp["chat"]["id"].startswith("chatcmpl-")
    assert resp["chat_chunk"]["object"] == "chat.completion.chunk"
    assert resp["completion"]["object"] == "text_completion"
    assert all(isinstance(t, str) for t in texts.values()) and texts["chat"]


def test_text_equals_edgespecs_own_plain_decoding(runs):
    """Greedy and seeded sampling alike: drafting changes no character."""
    assert runs["suffix"][0] == runs["none"][0]


def test_constructor_and_call_arguments(model):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        llm = edgespec.Llama(model.model_path, n_ctx=512, use_mmap=True, n_batch=256, verbose=False,
                             calibrate=False, drafter="none")
    try:
        assert any("use_mmap" in str(x.message) for x in w) and any("n_batch" in str(x.message) for x in w)
        assert llm.n_ctx() >= 512 and llm.model_path == model.model_path
        toks = llm.tokenize(b"Hello world")
        assert llm.detokenize(toks).decode().strip() == "Hello world"
        with pytest.raises(edgespec.ConfigError, match="grammar"):
            llm("Hi", grammar=object())
        with pytest.raises(edgespec.ConfigError, match="repeat_penalty"):
            llm.create_chat_completion(MESSAGES, repeat_penalty=1.3)
        r = llm("Count: one, two,", max_tokens=5, temperature=0, echo=True)
        assert r["choices"][0]["text"].startswith("Count: one, two,") and r["usage"]["completion_tokens"] <= 5
        long_prompt = "word " * 600
        with pytest.raises(edgespec.PromptTooLongError):
            llm(long_prompt, max_tokens=4)
    finally:
        llm.close()
    with pytest.raises(TypeError, match="no_such_argument"):
        edgespec.Llama(model.model_path, no_such_argument=1)
    with pytest.raises(edgespec.ConfigError, match="embedding"):
        edgespec.Llama(model.model_path, embedding=True)


def test_max_tokens_follows_llama_cpp_pythons_rule(model):
    """One token limit (core.params.token_limit) with llama-cpp-python's
    differences: create_completion's default is 16, create_chat_completion's
    None; None and <= 0 run to the context's end, and a larger max_tokens
    than the context leaves stops there too."""
    import inspect

    from edgespec.app.compat import _max_tokens
    from edgespec.core.params import token_limit
    sig = lambda f: inspect.signature(f).parameters["max_tokens"].default   # noqa: E731
    assert sig(edgespec.Llama.create_completion) == 16 and sig(edgespec.Llama.create_chat_completion) is None
    assert [_max_tokens(n) for n in (None, 0, -1, 5)] == [None, None, None, 5]
    assert token_limit(None, 100, 30) == 70 and token_limit(5, 100, 30) == 5 and token_limit(500, 100, 30) == 70
    llm = edgespec.Llama(model.model_path, n_ctx=256, verbose=False, calibrate=False, drafter="none")
    try:
        counting = "1, 2, 3, 4, 5, 6,"
        assert llm(counting, temperature=0)["usage"]["completion_tokens"] == 16
        for n in (None, -1, 10**6):
            r = llm(counting, max_tokens=n, temperature=0)
            assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["total_tokens"] == llm.n_ctx(), n
    finally:
        llm.close()
