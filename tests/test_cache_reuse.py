"""Cache reuse by shifting (Request.cache_reuse, `serve --cache-reuse N`,
n_cache_reuse): the matching on hand-written token arrays
(core/cache_reuse.find_splice), and on Qwen2.5-Coder-0.5B (the model-matrix
tier) the splice itself: an /infill a keystroke after another reads at
most 32 prompt tokens, its cached cells cover the suffix and the answer
says it is inexact; the cache holds what kv_tokens says afterwards; a
request without cache_reuse never reads a spliced cell and answers plain
decoding's tokens, as the same prompt again does."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.core.cache_reuse import MAX_OCCURRENCES, Splice, find_splice
from edgespec.core.params import Request
from edgespec.errors import ConfigError


def arr(*parts) -> np.ndarray:
    return np.concatenate([np.asarray(p, np.int32) for p in parts])


A = np.arange(100, 105)         # the common prefix
B = np.arange(200, 220)         # the chunk after the edit (20 tokens)
R = [900, 901, 902]             # the old middle token and answer
T = [999]                       # the new prompt's tail (its middle token)


def test_insertion_at_the_cursor():
    sp = find_splice(arr(A, B, R), arr(A, [300, 301], B, T), 16)
    assert sp == Splice(n_prefix=5, cache_start=5, prompt_start=7, n_chunk=20)
    assert (sp.shift, sp.n_reused, sp.n_held) == (2, 25, 27)


def test_deletion_at_the_cursor():
    sp = find_splice(arr(A, [300, 301, 302], B, R), arr(A, B, T), 16)
    assert sp == Splice(5, 8, 5, 20) and sp.shift == -3


def test_replacement_at_the_cursor():
    sp = find_splice(arr(A, [300, 301], B, R), arr(A, [400, 401, 402], B, T), 16)
    assert sp == Splice(5, 7, 8, 20) and sp.shift == 1


def test_no_chunk_long_enough():
    cached, prompt = arr(A, [300], B, R), arr(A, [301], B, T)
    assert find_splice(cached, prompt, 20) == Splice(5, 6, 6, 20)
    assert find_splice(cached, prompt, 21) is None
    assert find_splice(arr(A, R), arr(A, [301], B, T), 4) is None          # B is not in the cache
    assert find_splice(np.zeros(0, np.int32), prompt, 4) is None


def test_chunk_at_the_very_end():
    """B may end where the cache ends; in the prompt it stops before the last token (T >= 1)."""
    assert find_splice(arr(A, [300], B), arr(A, [301, 302], B, T), 16) == Splice(5, 6, 7, 20)
    assert find_splice(arr(A, [300], B, R), arr(A, [301], B), 16) == Splice(5, 6, 6, 19)


def test_the_same_prompt_again_is_the_exact_prefix():
    """Nothing follows A when the prompt is the cache's (all but its last token are reused exactly)."""
    p = arr(A, [300], B, T)
    assert find_splice(arr(p, R), p, 4) is None and find_splice(p, p, 1) is None


def test_the_longest_chunk_and_then_the_smallest_shift():
    b2 = np.arange(500, 530)    # 30 tokens: longer than B
    sp = find_splice(arr(A, [300], B, [301], b2, R), arr(A, [302], B, [303], b2, T), 8)
    assert sp == Splice(5, 5 + 1 + 20 + 1, 5 + 1 + 20 + 1, 30)
    # the same chunk held twice: the copy that moves least
    sp = find_splice(arr(A, [300] * 6, B, [301] * 3, B, R), arr(A, [302] * 9, B, T), 16)
    assert sp == Splice(5, 11, 14, 20) and sp.shift == 3


def test_a_window_held_too_often_anchors_nothing():
    """A chunk made only of a window the cache holds more than MAX_OCCURRENCES times is not
    found (the price of bounded matching); one window of its own is enough."""
    filler = [7] * (MAX_OCCURRENCES + 12)
    assert find_splice(arr(A, [300], filler, R), arr(A, [301], filler, T), 4) is None
    assert find_splice(arr(A, [300], filler, [8], R), arr(A, [301], filler, [8], T), 4) \
        == Splice(5, 6, 6, len(filler) + 1)


def test_the_request_value_checks_cache_reuse():
    assert Request([1]).cache_reuse == 0
    with pytest.raises(ConfigError, match="cache_reuse"):
        Request([1], cache_reuse=-1)
    with pytest.raises(ValueError):
        find_splice(arr(A), arr(A), 0)


def test_a_model_that_cannot_splice_refuses_the_request():
    from edgespec.core.params import resolve
    from edgespec.errors import RequestFieldError
    assert resolve(Request([1, 2]), [1, 2], n_ctx=10, n_vocab=5, splice_refusal="no").request.cache_reuse == 0
    with pytest.raises(RequestFieldError, match="no second sequence") as e:
        resolve(Request([1, 2], cache_reuse=4), [1, 2], n_ctx=10, n_vocab=5, splice_refusal="no second sequence")
    assert e.value.param == "n_cache_reuse"


# ------------------------------------------------------------ Qwen2.5-Coder-0.5B (model matrix)
PREFIX = "def fib(n):\n    \"\"\"The n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n    return "
SUFFIX = "".join(f"\n\ndef scaled_{i}(x):\n    \"\"\"x times {i}, plus fib({i}).\"\"\"\n    return x * {i} + fib({i})\n"
                 for i in range(10)) + "\n\nprint(fib(10))\n"
EXTRA = (("util.py", "def square(x):\n    return x * x\n"),)


def infill_body(prefix: str, **more) -> dict:
    return {"input_prefix": prefix, "input_suffix": SUFFIX, "n_predict": 16, "cache_prompt": True,
            "input_extra": [{"filename": n, "text": t} for n, t in EXTRA], **more}


def fresh(coder, **defaults):
    """A server's app over the model, its caches emptied (the answers of plain runs computed first)."""
    from starlette.testclient import TestClient

    from edgespec.app.request_fields import SERVE_DEFAULTS
    from edgespec.app.server import Server
    if coder.prefix_cache is not None:
        coder.prefix_cache.clear()
    coder.backend.reset()
    return TestClient(Server(coder, model_id="m", defaults=SERVE_DEFAULTS.but(**defaults)).app,
                      base_url="http://127.0.0.1")


def plain(coder, prefix: str):
    """Plain decoding (drafter none, nothing reused) of the FIM prompt, and the prompt."""
    from edgespec.app.infill import Infill, fim_prompt
    p = fim_prompt(coder.vocab, Infill(prefix, SUFFIX, EXTRA), coder.n_ctx, 16)
    r = coder.run(Request(p.ids, max_tokens=16, drafter="none", reuse_prefix=False, stop_tokens=p.stop_tokens))
    return r, p.ids


def check_kv(be, prompt) -> None:
    """The cache holds what kv_tokens says: the prompt's cells first, seq 0 at positions
    0..n_past-1, the splice's second sequence empty."""
    assert be.kv_tokens[:len(prompt)].tolist() == prompt.tolist() and len(be.kv_tokens) == be.n_past
    assert be.seq_positions(0) == (0, be.n_past - 1) and be.seq_positions(1) == (-1, -1)


@pytest.mark.matrix
def test_qwen_a_keystroke_reads_the_edit_and_the_tail(coder):
    """`serve --cache-reuse 16`: the same prompt again reuses its prefix exactly (the
    answer is plain decoding's); a keystroke later the suffix's cells are shifted, not
    read: at most 32 prompt tokens decoded, cache_n covers the suffix, the answer says
    so; the next keystroke splices the spliced cache again."""
    ref, p1 = plain(coder, PREFIX)
    c = fresh(coder, cache_reuse=16)
    from edgespec.app.infill import SUFFIX_TOKENS
    n_suffix = min(len(coder.tokenize(SUFFIX, add_special=False)), SUFFIX_TOKENS)     # the part the prompt reads
    for _ in range(2):
        d = c.post("/infill", json=infill_body(PREFIX)).json()
        assert d["tokens"] == ref.tokens and d["timings"]["cache_shifted_n"] == 0
    assert d["timings"]["prompt_n"] == 1
    for prefix in (PREFIX + "f", PREFIX + "fi"):
        t = c.post("/infill", json=infill_body(prefix)).json()["timings"]
        p = plain_prompt(coder, prefix)
        assert t["prompt_n"] <= 32 and t["cache_n"] + t["prompt_n"] == len(p), t
        assert t["cache_shifted_n"] >= n_suffix and t["cache_n"] >= len(p) - 32
        check_kv(coder.backend, p)
        assert coder.backend.spliced_from is not None and coder.backend.spliced_from <= len(p) - n_suffix


def plain_prompt(coder, prefix: str):
    from edgespec.app.infill import Infill, fim_prompt
    return fim_prompt(coder.vocab, Infill(prefix, SUFFIX, EXTRA), coder.n_ctx, 16).ids


@pytest.mark.matrix
def test_qwen_an_exact_request_never_reads_a_spliced_cell(coder):
    """After a splice, a request without cache_reuse (n_cache_reuse 0 over the server's
    --cache-reuse) cuts the cache where the splice began: plain decoding's answer, cache_n
    the prompt up to the edit; then with the per-request n_cache_reuse on a server at 0,
    a keystroke splices, as does /v1/completions' suffix without the other file's chunk,
    and a normal request after them works on the cache they left; a chat takes none."""
    ref, p = plain(coder, PREFIX + "f")
    c = fresh(coder, cache_reuse=16)
    c.post("/infill", json=infill_body(PREFIX))
    c.post("/infill", json=infill_body(PREFIX + "f"))
    cut = coder.backend.spliced_from
    d = c.post("/infill", json=infill_body(PREFIX + "f", n_cache_reuse=0)).json()
    assert d["tokens"] == ref.tokens and d["timings"]["cache_shifted_n"] == 0 and d["timings"]["cache_n"] == cut
    assert coder.backend.spliced_from is None
    check_kv(coder.backend, p)
    c = fresh(coder)        # the server's default: exact
    c.post("/infill", json=infill_body(PREFIX))
    t = c.post("/infill", json=infill_body(PREFIX + "f")).json()["timings"]
    from edgespec.app.infill import SUFFIX_TOKENS
    assert t["cache_shifted_n"] == 0 and t["prompt_n"] > min(len(coder.tokenize(SUFFIX, add_special=False)),
                                                             SUFFIX_TOKENS)     # the suffix the prompt holds, again
    t = c.post("/infill", json=infill_body(PREFIX + "fi", n_cache_reuse=16)).json()["timings"]
    assert t["cache_shifted_n"] > 0 and t["prompt_n"] <= 32
    # /v1/completions with suffix: the same FIM prompt without the other file's chunk (a chunk evicted
    # in front of the cursor: a deletion), spliced with its n_cache_reuse
    d = c.post("/v1/completions", json={"prompt": PREFIX + "fi", "suffix": SUFFIX, "max_tokens": 8,
                                        "n_cache_reuse": 16}).json()
    assert d["timings"]["cache_shifted_n"] > 0 and d["timings"]["prompt_n"] <= 32
    d = c.post("/v1/completions", json={"prompt": "def add(a, b):\n    return", "max_tokens": 8}).json()
    assert d["usage"]["completion_tokens"] >= 1 and d["timings"]["cache_shifted_n"] == 0
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n_cache_reuse": 16})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_cache_reuse"
