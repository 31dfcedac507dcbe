"""Per-token log-probabilities (edgespec.core.logprobs) against a direct computation
from the model's own one-token logits, for plain decoding, a drafting method
and sampling; and their shapes in edgespec.Llama."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.errors import ConfigError
from edgespec.core.logprobs import MAX_TOP_LOGPROBS, LogprobFormatter, token_logprobs

# the answer repeats the prompt, so the suffix drafter's drafts are accepted
PROMPT = "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
N_TOP = 5


def direct_rows(model, prompt_tokens, answer) -> np.ndarray:
    """The model's logits before every answer token, by a prefill and one-token
    decodes on the backend (no engine, no drafts)."""
    be = model.backend
    be.reset()
    be.prefill(np.asarray(prompt_tokens, np.int32))
    rows = [be.logits()[0].astype(np.float64)]
    for t in answer[:-1]:
        be.prefill(np.array([t], np.int32))
        rows.append(be.logits()[0].astype(np.float64))
    be.reset()
    return np.array(rows)


def assert_matches_direct(model, prompt_tokens, r, n_top: int = N_TOP) -> None:
    rows = direct_rows(model, prompt_tokens, r.tokens)
    assert len(r.logprobs) == len(r.tokens) == len(rows) > 0
    for e, tok, row in zip(r.logprobs, r.tokens, rows):
        logz = np.logaddexp.reduce(row)
        assert e.token == tok
        assert abs(e.logprob - (row[tok] - logz)) < 1e-4
        want = np.sort(row)[::-1][:n_top] - logz
        assert len(e.top) == n_top
        np.testing.assert_allclose([v for _, v in e.top], want, atol=1e-4)
        assert all(abs(v - (row[t] - logz)) < 1e-4 for t, v in e.top)


def test_token_logprobs_by_hand():
    rows = np.log(np.array([[0.5, 0.25, 0.25, 1e-9], [0.1, 0.2, 0.3, 0.4]], np.float32))
    out = token_logprobs(rows, [1, 3], 3)
    assert [e.token for e in out] == [1, 3]
    assert abs(out[0].logprob - np.log(0.25)) < 1e-6 and abs(out[1].logprob - np.log(0.4)) < 1e-6
    assert [t for t, _ in out[0].top] == [0, 1, 2]          # a tie goes to the lower id
    assert [t for t, _ in out[1].top] == [3, 2, 1]
    assert token_logprobs(rows, [0, 0], 0)[0].top == []
    rows[0, 2:] = -np.inf                                    # masked tokens are no alternatives
    assert [t for t, _ in token_logprobs(rows, [1], 4)[0].top] == [0, 1]


def test_greedy_logprobs_match_the_models_logits_with_and_without_drafts(model):
    toks = model.prompt_tokens(PROMPT)
    plain = model.generate(toks, max_tokens=24, drafter="none", logprobs=N_TOP)
    assert_matches_direct(model, toks, plain)
    # drafts must be verified here, whatever came before and whatever this machine's c(T) says
    # (a 10-token answer is at the gate's break-even on a steep curve)
    guard, gate = model.config.guard, model.config.cost_gate
    model.config.guard = model.config.cost_gate = False
    try:
        spec = model.generate(toks, max_tokens=24, drafter="suffix", logprobs=N_TOP)
    finally:
        model.config.guard, model.config.cost_gate = guard, gate
    assert spec.tokens == plain.tokens and spec.n_draft_accepted > 0
    # a drafted token's row is the row plain decoding computed (exact kernels)
    assert [(e.logprob, e.top) for e in spec.logprobs] == [(e.logprob, e.top) for e in plain.logprobs]
    streamed = []
    with model.stream(toks, max_tokens=24, drafter="suffix", logprobs=2) as s:
        for c in s:
            streamed += c.logprobs or []
    assert [e.token for e in streamed] == plain.tokens
    assert [e.logprob for e in streamed] == [e.logprob for e in plain.logprobs]
    assert model.generate(toks, max_tokens=4).logprobs is None
    with pytest.raises(ConfigError):
        model.generate(toks, max_tokens=4, logprobs=MAX_TOP_LOGPROBS + 1)


def test_sampled_logprobs_are_the_models_before_temperature(model):
    from edgespec import SamplingConfig
    toks = model.prompt_tokens("Write one sentence about rain.")
    r = model.generate(toks, max_tokens=12, sampling=SamplingConfig(temperature=1.5, seed=3), logprobs=3)
    assert_matches_direct(model, toks, r, n_top=3)


def test_stop_string_cuts_the_logprobs_with_the_text(model):
    toks = model.prompt_tokens(PROMPT)
    full = model.generate(toks, max_tokens=24, drafter="suffix")
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 4]
    r = model.generate(toks, max_tokens=24, drafter="suffix", stop=[stop], logprobs=0)
    # the tokens wholly before the stop string (a token it starts inside is not one)
    assert [e.token for e in r.logprobs] == r.tokens and len(r.tokens) < len(full.tokens)
    assert r.text.startswith(model.detokenize(r.tokens)) and stop not in r.text


def test_formatter_shapes(model):
    toks = model.prompt_tokens(PROMPT)
    r = model.generate(toks, max_tokens=8, logprobs=2)
    chat = LogprobFormatter(model.vocab).chat(r.logprobs)
    first = chat["content"][0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"} and len(first["top_logprobs"]) == 2
    assert bytes(first["bytes"]).decode() == first["token"]
    legacy = LogprobFormatter(model.vocab, base=7).completion(r.logprobs)
    assert legacy["text_offset"][0] == 7 and len(legacy["tokens"]) == len(r.tokens)
    assert "".join(legacy["tokens"]) == r.text
    assert all(legacy["tokens"][i] in legacy["top_logprobs"][i] for i in range(len(r.tokens)))


def shape(obj, path: str = "") -> set:
    """Key paths of a response (lists: their first item)."""
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(path + "." + k)
            out |= shape(v, path + "." + k)
    elif isinstance(obj, list) and obj:
        out |= shape(obj[0], path + "[]")
    return out


def test_llama_compat_logprobs_in_llama_cpp_pythons_shapes(model):
    """edgespec.Llama's logprobs have llama_cpp.Llama's keys (its logits_all=True
    run as the reference) and the library's values."""
    import llama_cpp

    import edgespec
    from edgespec.bench.llamacpp import llama_cpp_python_repack
    raw = "The capital of France is"
    msgs = [{"role": "user", "content": "Name three fruits."}]
    with llama_cpp_python_repack(False):
        ref = llama_cpp.Llama(model_path=model.model_path, n_ctx=512, seed=1, verbose=False, logits_all=True)
    try:
        want = ref(raw, max_tokens=6, temperature=0, logprobs=3)
        want_chat = ref.create_chat_completion(msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    finally:
        ref.close()
    llm = edgespec.Llama(model_path=model.model_path, n_ctx=512, verbose=False, drafter="suffix")
    try:
        got = llm(raw, max_tokens=6, temperature=0, logprobs=3)
        got_chat = llm.create_chat_completion(msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
        chunks = list(llm(raw, max_tokens=6, temperature=0, logprobs=3, stream=True))
        with pytest.raises(ConfigError, match="echo"):
            llm(raw, max_tokens=2, logprobs=1, echo=True)
    finally:
        llm.close()
    assert shape(got) == shape(want) and shape(got_chat) == shape(want_chat)
    lp, ref_lp = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
    assert lp["text_offset"][0] == ref_lp["text_offset"][0] == len(raw)
    # another K cache and batch layout: close, not equal, to llama-cpp-python's
    assert abs(lp["token_logprobs"][0] - ref_lp["token_logprobs"][0]) < 0.05
    lib = model.generate(model.tokenize(raw, parse_special=True), max_tokens=6, logprobs=3)
    assert lp["token_logprobs"] == [e.logprob for e in lib.logprobs]
    assert [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])] == \
        lp["token_logprobs"]
    content = got_chat["choices"][0]["logprobs"]["content"]
    assert len(content) == got_chat["usage"]["completion_tokens"] and len(content[0]["top_logprobs"]) == 3
