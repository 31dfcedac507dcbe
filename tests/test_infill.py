"""Fill in the middle (issue 65): the FIM prompt's layout from a model's own
tokens (edgespec.app.infill), /infill and /completion as llama-server
answers them (edgespec.app.native), `suffix` on /v1/completions and in the
drop-in, and exactness: under exact kernels an /infill answer is plain
decoding's of the same FIM prompt, before and after the prompt cache's reuse.

SmolLM2 (the session model) has repository tokens but no FIM prefix/suffix/
middle tokens: the 400s, /completion, the time limit and a client's
disconnect run on it.  Qwen2.5-Coder-0.5B (repository-level FIM) is the
model-matrix tier's (`matrix`, tools/get_models.py), as is Gemma-3-270M,
which has no FIM tokens either."""
from __future__ import annotations

import json
import socket

import pytest
from serving import request, running_server
from starlette.testclient import TestClient

from edgespec import SpecModel
from edgespec.app.infill import FimTokens, Infill, fim_prompt, fim_tokens
from edgespec.app.request_fields import SERVE_DEFAULTS
from edgespec.app.server import Server
from edgespec.core.params import Request
from edgespec.errors import RequestFieldError
from edgespec.models.zoo import ModelZooError, require_model

pytestmark = pytest.mark.model

PREFIX = "def fib(n):\n    \"\"\"The n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n    return "
SUFFIX = "\n\n\nprint(fib(10))\n"
EXTRA = [{"filename": "util.py", "text": "def square(x):\n    return x * x\n"},
         {"filename": "main.py", "text": "from util import square\nprint(square(3))\n"}]


def client_for(model, **defaults) -> TestClient:
    """The server's app in this process (no lifespan: the model stays open)."""
    s = Server(model, model_id="m", defaults=SERVE_DEFAULTS.but(**defaults))
    return TestClient(s.app, base_url="http://127.0.0.1")


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_a_sliding_prefix_window_keeps_its_anchor_line_in_front():
    """A 256-line window sliding one line at a time down a file: the anchored
    prefix is the window's tail from its first anchor line (a non-blank line
    whose crc32 is 0 modulo ANCHOR_EVERY, among the first ANCHOR_MAX_DROP),
    so consecutive windows start at the same line until that line leaves the
    window; short prefixes and Infill(anchor=False) stay whole."""
    import zlib

    from edgespec.app import infill as I
    file = [f"    value_{i} = compute({i}, {i * 7 % 13})\n" if i % 5 else "\n" for i in range(2000)]
    is_anchor = [bool(x.strip()) and zlib.crc32(x.encode()) % I.ANCHOR_EVERY == 0 for x in file]
    starts, changes = [], 0
    for top in range(0, 300):
        window = "".join(file[top:top + 256]) + "    tail = "
        got = I.anchored(window)
        assert window.endswith(got) and got.endswith("    tail = ")
        first = next((i for i in range(top, top + I.ANCHOR_MAX_DROP) if is_anchor[i]), None)
        assert got == ("".join(file[first:top + 256]) + "    tail = " if first is not None else window)
        if starts and first != starts[-1]:
            changes += 1
        starts.append(first)
    assert 0 < changes < 300 // 8       # the start moves once per anchor gap, not at every line
    short = "".join(file[:100])
    assert I.anchored(short) == short
    assert I.Infill("x").anchor is True and I.Infill("x", anchor=False).anchor is False


def test_a_capped_prefix_starts_at_an_anchor_line_that_stays_while_the_file_grows():
    """prefix_tokens: a file typed line by line from the top; the capped prefix is the text from the
    first anchor line whose rest fits the cap (a hand-written tokenizer: one token per word), so it
    stays the same from one new line to the next until the prefix has outgrown the cap; a prefix
    that fits stays whole, and one without a fitting anchor line is left whole for the token cut."""
    import zlib

    from edgespec.app import infill as I
    file = [f"    value_{i} = compute({i}, {i * 7 % 13})\n" if i % 5 else "\n" for i in range(600)]
    is_anchor = [bool(x.strip()) and zlib.crc32(x.encode()) % I.ANCHOR_EVERY == 0 for x in file]

    def tok(text):
        return text.split()
    cap, starts = 200, []
    for n in range(1, len(file)):
        prefix = "".join(file[:n])
        got = I.fitted(prefix, cap, tok)
        assert prefix.endswith(got) and len(tok(got)) <= cap or got == prefix
        if len(tok(prefix)) <= cap:
            assert got == prefix
            continue
        first = next((i for i in range(1, n) if is_anchor[i] and len(tok("".join(file[i:n]))) <= cap), None)
        assert got == ("".join(file[first:n]) if first is not None else prefix)
        starts.append(first)
    moves = sum(a != b for a, b in zip(starts, starts[1:]))
    assert 0 < moves < len(starts) // 8         # once per anchor gap, not at every new line
    one_line = "    " + " ".join(["word"] * 500) + "\n"
    assert I.fitted(one_line, cap, tok) == one_line
    with pytest.raises(ValueError):
        I.Infill("x", prefix_tokens=-1)


def test_request_checks_its_stop_tokens_and_time_limit():
    """Request.stop_tokens are checked where a request resolves (in the
    vocabulary), t_max_predict_ms where it is built (> 0)."""
    from edgespec.core.params import resolve
    from edgespec.errors import ConfigError
    r = resolve(Request([1], stop_tokens=[7, 9]), [1], n_ctx=10, n_vocab=50)
    assert r.request.stop_tokens == (7, 9) and r.truncated is False
    with pytest.raises(RequestFieldError) as e:
        resolve(Request([1], stop_tokens=[50]), [1], n_ctx=10, n_vocab=50)
    assert e.value.param == "stop_tokens"
    with pytest.raises(ConfigError, match="t_max_predict_ms"):
        Request([1], t_max_predict_ms=0)


# ------------------------------------------------------------ SmolLM2 (always)
def test_model_without_fim_tokens_is_refused(model):
    """SmolLM2 has <repo_name> and <file_sep> but no FIM prefix/suffix/middle:
    /infill and /v1/completions' suffix get a 400 naming it, the library a
    RequestFieldError; a bad field is refused by name, /v1's table unchanged."""
    f = fim_tokens(model.vocab)
    assert not f.usable and f.rep == model.vocab.special_token("<repo_name>") >= 0
    with pytest.raises(RequestFieldError):
        model.infill("def f(", ")")
    c = client_for(model, drafter="none")
    r = c.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")\n"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
    assert "fill-in-the-middle" in r.json()["error"]["message"]
    r = c.post("/v1/completions", json={"prompt": "def f(", "suffix": ")\n", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
    for path, body, param in (("/infill", {"input_prefix": "a", "nonsense": 1}, "nonsense"),
                              ("/infill", {"input_extra": [{"filename": "a"}]}, "input_extra"),
                              ("/infill", {"repeat_penalty": 1.3}, "repeat_penalty"),
                              ("/completion", {"prompt": "a", "input_prefix": "b"}, "input_prefix"),
                              ("/completion", {"prompt": "a", "n_predict": -2}, "n_predict"),
                              ("/v1/completions", {"prompt": "a", "input_prefix": "b"}, "input_prefix"),
                              ("/v1/completions", {"prompt": [1, 2], "suffix": "b"}, "suffix"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                        "suffix": "b"}, "suffix")):
        r = c.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


def test_native_completion_json_and_stream(model):
    """/completion: llama-server's fields, the answer the library gives (the
    same tokens), a stream of `data:` events whose text adds up to it, the
    last with stop true and the timings; n_predict 0 reads the prompt only;
    response_fields filters by path."""
    prompt = "The capital of France is"
    ref = model.run(Request(model.tokenize(prompt, parse_special=True), max_tokens=12, drafter="none", raw=True))
    c = client_for(model, drafter="none")
    d = c.post("/completion", json={"prompt": prompt, "n_predict": 12, "cache_prompt": True}).json()
    assert d["content"] == ref.text and d["tokens"] == [int(t) for t in ref.tokens] and d["stop"] is True
    assert d["stop_type"] == "limit" and d["tokens_predicted"] == 12 and d["truncated"] is False
    assert d["tokens_evaluated"] == d["timings"]["prompt_n"] + d["timings"]["cache_n"]
    assert {"prompt_ms", "predicted_n", "predicted_ms"} <= set(d["timings"]) and d["stopping_word"] == ""
    r = c.post("/completion", json={"prompt": prompt, "n_predict": 12, "stream": True})
    ev = sse_events(r.text)
    assert "[DONE]" not in r.text and all(e["stop"] is False for e in ev[:-1]) and ev[-1]["stop"] is True
    assert "".join(e["content"] for e in ev) == ref.text and ev[-1]["timings"]["predicted_n"] == 12
    assert sum(len(e["tokens"]) for e in ev[:-1]) == 12
    d = c.post("/completion", json={"prompt": prompt, "n_predict": 0}).json()
    assert d["content"] == "" and d["tokens_predicted"] == 0 and d["stop_type"] == "limit"
    word = ref.text.split()[1]
    d = c.post("/completion", json={"prompt": model.tokenize(prompt, parse_special=True).tolist(),
                                    "n_predict": 12, "stop": [word],
                                    "response_fields": ["content", "stop_type", "stopping_word",
                                                        "timings/cache_n"]}).json()
    assert set(d) == {"content", "stop_type", "stopping_word", "timings/cache_n"}
    assert d["stop_type"] == "word" and d["stopping_word"] == word and ref.text.startswith(d["content"])
    assert d["timings/cache_n"] > 0        # the same prompt again: its prefix reused


def test_t_max_predict_ms_stops_after_a_newline(model):
    """t_max_predict_ms counts from the prompt's end and ends the answer only
    once it has a newline: a 1 ms limit stops a long answer at most a token
    after its first newline, as a prefix of the unlimited answer."""
    prompt = "List the numbers from 1 to 50, one per line:\n1\n2\n"
    c = client_for(model, drafter="none")
    full = c.post("/completion", json={"prompt": prompt, "n_predict": 60}).json()
    assert full["content"].count("\n") > 3
    d = c.post("/completion", json={"prompt": prompt, "n_predict": 60, "t_max_predict_ms": 1}).json()
    assert d["stop_type"] == "limit" and "\n" in d["content"] and full["content"].startswith(d["content"])
    toks = full["tokens"]
    first_nl = next(i for i, t in enumerate(toks) if "\n" in model.detokenize([t]))
    assert first_nl + 1 <= d["tokens_predicted"] <= first_nl + 2 < len(toks)


def test_n_indent_ends_the_answer_at_a_line_indented_less(model):
    """n_indent as llama-server applies it: a line after the first newline
    indented less ends the answer before its first character (stop_type
    limit); here every line of the answer has no indentation, so n_indent 1
    keeps the first line and its newline; the rest of the tokens is the
    answer without n_indent's."""
    prompt = "List the numbers from 1 to 50, one per line:\n1\n2\n"
    c = client_for(model, drafter="none")
    full = c.post("/completion", json={"prompt": prompt, "n_predict": 12}).json()
    assert full["content"].count("\n") >= 2 and not full["content"].startswith(("\n", " "))
    d = c.post("/completion", json={"prompt": prompt, "n_predict": 12, "n_indent": 1}).json()
    first = full["content"][:full["content"].index("\n") + 1]
    assert d["content"] == first and d["stop_type"] == "limit" and d["stop"] is True
    assert d["tokens"] == full["tokens"][:len(d["tokens"])] and 0 < len(d["tokens"]) < len(full["tokens"])
    r = c.post("/completion", json={"prompt": prompt, "n_predict": 12, "n_indent": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_indent"


def test_n_indent_cut_inside_a_drafted_step_streams_only_the_answers_tokens(model):
    """A step that commits several drafted tokens across the n_indent cut:
    the streamed events' tokens are the answer's tokens (those before the
    cut), the same as the non-streamed answer's, and decode to its text.
    The prompt repeats its lines, so the suffix drafter's copy runs past the
    first newline of the answer, where n_indent 1 cuts it."""
    lines = "".join(f"v{i} = {i}\n" for i in range(12))
    prompt = lines + lines + lines[:4]
    c = client_for(model, drafter="suffix")
    body = {"prompt": prompt, "n_predict": 24, "n_indent": 1}
    d = c.post("/completion", json=body).json()
    assert d["stop_type"] == "limit" and d["content"].count("\n") == 1
    assert model.detokenize(d["tokens"]) == d["content"]
    ev = sse_events(c.post("/completion", json={**body, "stream": True}).text)
    streamed = [t for e in ev for t in e["tokens"]]
    assert streamed == d["tokens"] and "".join(e["content"] for e in ev) == d["content"]
    assert ev[-1]["timings"]["predicted_n"] == len(d["tokens"])


def test_an_abandoned_request_frees_the_model(model):
    """A client that closes its connection mid-stream: the next request is
    served, and in full (a real server subprocess)."""
    with running_server("--ctx", "2048", "--drafter", "none") as (base, proc):
        host, port = base.removeprefix("http://").split(":")
        prompt = "<|im_start|>user\nCount from 1 to 2000, separated by commas.<|im_end|>\n<|im_start|>assistant\n1, 2,"
        body = json.dumps({"prompt": prompt, "n_predict": 1500, "stream": True}).encode()
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert b"data: " in s.recv(4096) or b"data: " in s.recv(4096)
        s.close()
        status, _, raw = request(base, "POST", "/completion", {"prompt": "Hello", "n_predict": 8}, timeout=120)
        d = json.loads(raw)
        assert status == 200 and d["tokens_predicted"] == 8
        h = json.loads(request(base, "GET", "/health")[2])
        assert h["requests"]["cancelled"] >= 1 and proc.poll() is None


# ------------------------------------------------------------ FIM models (matrix)
def ids(model, text: str) -> list[int]:
    return model.tokenize(text, add_special=False).tolist() if text else []


@pytest.mark.matrix
def test_qwen_layout_repo_level_and_text_stays_text(coder):
    """Qwen2.5-Coder's repository pattern, each part tokenized alone, the
    FIM tokens in place once each; "<|fim_prefix|>" in the user's text is text."""
    v, f = coder.vocab, fim_tokens(coder.vocab)
    assert f.usable and f.repo_level and f.pre == v.special_token("<|fim_prefix|>")
    prefix = PREFIX + "# <|fim_prefix|> <|file_sep|>\n    return "
    p = fim_prompt(v, Infill(prefix, SUFFIX, tuple((e["filename"], e["text"]) for e in EXTRA)), 2048, 64)
    want = [f.rep] + ids(coder, "myproject\n")
    for e in EXTRA:
        want += [f.sep] + ids(coder, e["filename"] + "\n") + ids(coder, e["text"])
    want += [f.sep] + ids(coder, "filename\n") + [f.pre] + ids(coder, prefix) + [f.suf] + ids(coder, SUFFIX) + [f.mid]
    assert p.ids.tolist() == want and not p.truncated
    assert p.ids.tolist().count(f.pre) == 1 and p.ids.tolist().count(f.sep) == 3
    assert set(p.stop_tokens) == {f.pad, f.rep, f.sep}


@pytest.mark.matrix
def test_qwen_typed_text_ends_the_prefix_or_follows_the_middle_token(coder):
    """The text typed on the cursor's line (llama-server's `prompt`, each part
    tokenized alone): layout psm (the default, llama-server's) puts it after
    the prefix, before the suffix token; layout mid after the middle token."""
    v, f = coder.vocab, fim_tokens(coder.vocab)
    typed = "    return fi"
    psm = fim_prompt(v, Infill(PREFIX, SUFFIX, (), typed), 2048, 64).ids.tolist()
    mid = fim_prompt(v, Infill(PREFIX, SUFFIX, (), typed, layout="mid"), 2048, 64).ids.tolist()
    tail = [f.pre] + ids(coder, PREFIX)
    assert psm[-len(tail) - len(ids(coder, SUFFIX)) - len(ids(coder, typed)) - 2:] == \
        tail + ids(coder, typed) + [f.suf] + ids(coder, SUFFIX) + [f.mid]
    assert mid[-len(tail) - len(ids(coder, SUFFIX)) - len(ids(coder, typed)) - 2:] == \
        tail + [f.suf] + ids(coder, SUFFIX) + [f.mid] + ids(coder, typed)
    assert Infill("x").layout == "psm"
    with pytest.raises(ValueError, match="layout"):
        Infill("x", layout="spm")


@pytest.mark.matrix
def test_qwen_truncation_keeps_the_ends_nearest_the_cursor(coder):
    """Parts that do not fit: the prefix's tail, the suffix's head, the
    newest chunks whole; truncated says so."""
    v, f = coder.vocab, fim_tokens(coder.vocab)
    prefix = "".join(f"x{i} = {i}\n" for i in range(200))
    suffix = "".join(f"y{i} = {i}\n" for i in range(200))
    extra = tuple((f"f{i}.py", f"z{i} = {i}\n" * 3) for i in range(6))
    p = fim_prompt(v, Infill(prefix, suffix, extra), 512, 64)
    got = p.ids.tolist()
    assert p.truncated and len(got) <= 512 - 64
    pre, suf, mid = got.index(f.pre), got.index(f.suf), got.index(f.mid)
    full_pre, full_suf = ids(coder, prefix), ids(coder, suffix)
    assert 0 < suf - pre - 1 < len(full_pre) and got[pre + 1:suf] == full_pre[len(full_pre) - (suf - pre - 1):]
    assert 0 < mid - suf - 1 < len(full_suf) and got[suf + 1:mid] == full_suf[:mid - suf - 1]
    names = coder.detokenize(got[:pre])
    kept = [i for i in range(6) if f"f{i}.py" in names]
    assert kept == list(range(6 - len(kept), 6))      # the newest, whole
    assert not fim_prompt(v, Infill(prefix[:50], suffix[:50], extra), 2048, 64).truncated


@pytest.mark.matrix
def test_qwen_suffix_is_read_to_its_budget(coder):
    """The suffix's head, at most suffix_tokens (SUFFIX_TOKENS by default;
    serve --fim-suffix-tokens), and truncated says so; None in the request
    is the default, a larger budget reads more, 0 none."""
    from edgespec.app.infill import SUFFIX_TOKENS
    v, f = coder.vocab, fim_tokens(coder.vocab)
    suffix = "".join(f"y{i} = {i}\n" for i in range(200))
    full = ids(coder, suffix)
    assert len(full) > 2 * SUFFIX_TOKENS

    def suf(**kw):
        p = fim_prompt(v, Infill("x = 1\n", suffix, **kw), 4096, 64)
        got = p.ids.tolist()
        return got[got.index(f.suf) + 1:got.index(f.mid)], p.truncated
    assert suf() == (full[:SUFFIX_TOKENS], True)
    assert suf(suffix_tokens=2 * SUFFIX_TOKENS) == (full[:2 * SUFFIX_TOKENS], True)
    assert suf(suffix_tokens=0) == ([], True)
    assert suf(suffix_tokens=len(full)) == (full, False)
    with pytest.raises(ValueError):
        Infill("x", "y", suffix_tokens=-1)


def plain(model, infill: Infill, max_tokens: int, n_indent: int = 0):
    """Plain decoding (drafter none, nothing reused) of the FIM prompt (cut at n_indent as /infill cuts it)."""
    p = fim_prompt(model.vocab, infill, model.n_ctx, max_tokens)
    return model.run(Request(p.ids, max_tokens=max_tokens, drafter="none", reuse_prefix=False,
                             stop_tokens=p.stop_tokens, n_indent=n_indent))


@pytest.mark.matrix
def test_qwen_infill_is_plain_decoding_before_and_after_reuse(coder):
    """/infill (suffix drafter, every node verified) answers plain decoding's
    tokens: a request, the same one keystroke longer, the first again (both
    after reusing cached cells), and streamed; the library and the drop-in's
    suffix build the same prompt and answer."""
    c = client_for(coder)
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "n_predict": 32,
            "cache_prompt": True, "samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.9,
            "id_slot": 0, "t_max_prompt_ms": 500}
    longer = dict(body, input_prefix=PREFIX + "f")
    answers = []
    for b in (body, longer, body):
        d = c.post("/infill", json=b).json()
        ref = plain(coder, Infill(b["input_prefix"], SUFFIX, tuple((e["filename"], e["text"]) for e in EXTRA)), 32)
        assert d["tokens"] == [int(t) for t in ref.tokens] and d["content"] == ref.text, b["input_prefix"][-5:]
        assert d["stop_type"] in ("eos", "limit") and d["truncated"] is False
        answers.append(d)
    assert answers[0]["tokens"] == answers[2]["tokens"] and answers[0]["content"]
    assert answers[1]["timings"]["cache_n"] > 0 and answers[2]["timings"]["cache_n"] > 0
    ev = sse_events(c.post("/infill", json=dict(body, stream=True)).text)
    assert "".join(e["content"] for e in ev) == answers[0]["content"] and ev[-1]["stop"] is True
    r = coder.infill(PREFIX, SUFFIX, [(e["filename"], e["text"]) for e in EXTRA], max_tokens=32)
    assert r.tokens == answers[0]["tokens"]
    d = c.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 32}).json()
    ref = plain(coder, Infill(PREFIX, SUFFIX), 32)
    assert d["choices"][0]["text"] == ref.text and d["usage"]["completion_tokens"] == ref.n_generated


@pytest.mark.matrix
def test_dropin_suffix_and_n_tokens(coder):
    """The drop-in's create_completion(suffix=...) is the same FIM prompt's
    answer; n_tokens counts the KV cache's tokens."""
    from edgespec.app.compat import Llama
    llm = Llama(coder.model_path, n_ctx=2048, calibrate=False, verbose=False)
    try:
        assert llm.n_tokens == 0
        d = llm.create_completion(PREFIX, suffix=SUFFIX, max_tokens=24, temperature=0.0)
        ref = plain(coder, Infill(PREFIX, SUFFIX), 24)
        n_prompt = len(fim_prompt(coder.vocab, Infill(PREFIX, SUFFIX), coder.n_ctx, 24).ids)
        assert d["choices"][0]["text"] == ref.text and d["usage"]["prompt_tokens"] == n_prompt
        assert n_prompt < llm.n_tokens <= n_prompt + ref.n_generated
    finally:
        llm.close()


@pytest.mark.matrix
def test_gemma_has_no_fim_tokens():
    """Gemma-3-270M's vocabulary has no FIM tokens (by metadata or text):
    an infill is refused, not built from guesses."""
    try:
        path = require_model("gemma3-270m")
    except ModelZooError as e:
        pytest.fail(f"the model-matrix tier was selected but {e}", pytrace=False)
    m = SpecModel(path, drafter="none", n_ctx=512, calibrate=False)
    try:
        assert fim_tokens(m.vocab) == FimTokens()
        with pytest.raises(RequestFieldError, match="fill-in-the-middle"):
            m.infill(PREFIX, SUFFIX, max_tokens=4)
    finally:
        m.close()


def test_serve_fim_suffix_tokens_reaches_every_fim_door():
    """serve --fim-suffix-tokens (Limits.fim_suffix_tokens) is the suffix
    budget of /infill's and /v1/completions' FIM prompts (None: the default)."""
    from edgespec.app import native
    from edgespec.app.request_fields import Limits, RequestParser
    for budget in (None, 5):
        p = RequestParser(None, "m", SERVE_DEFAULTS, Limits(fim_suffix_tokens=budget, fim_prefix_tokens=budget))
        infill = native.parse(p, {"input_prefix": "a", "input_suffix": "b"}, "infill").request.prompt
        completion = p.parse({"prompt": "a", "suffix": "b"}, chat=False).request.prompt
        assert isinstance(infill, Infill) and isinstance(completion, Infill)
        assert infill.suffix_tokens == completion.suffix_tokens == budget
        assert infill.prefix_tokens == completion.prefix_tokens == budget
