"""`edgespec serve` through the real `openai` client: a real server subprocess
on a random free 127.0.0.1 port, the default SmolLM2 model, greedy answers
checked token for token against the library and against each other."""
from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
from serving import request, running_server, streams_at_once

pytestmark = pytest.mark.model

openai = pytest.importorskip("openai")

KEY = "test-key-18"
CTX = 2048
PROMPTS = [f"Name {n} {thing}." for n in ("two", "three") for thing in
           ("fruits", "colors", "animals", "cities", "planets", "flowers", "metals", "rivers", "birds",
            "trees", "countries", "instruments")]


@pytest.fixture(scope="module")
def server(model):
    """(base url, model id); the session model is loaded first so the
    calibration is cached when the server starts."""
    # --no-gate: drafts are verified whatever this machine's c(T) says, so the prediction test's
    # "fewer steps" does not hang on the calibration (with a steep one the gate verified none)
    with running_server("--ctx", str(CTX), "--api-key", KEY, "--queue", "8", "--max-tokens", "16",
                        "--no-gate") as (base, proc):
        status, _, body = request(base, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200
        yield base, json.loads(body)["data"][0]["id"], proc
        assert proc.poll() is None          # alive after every test of the module


def client(server, **kw):
    base, _, _ = server
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=600, **kw)


def chat(server, prompt: str, **kw):
    return client(server).chat.completions.create(model=server[1], messages=[{"role": "user", "content": prompt}],
                                                  **kw)


def test_models_health_and_auth(server):
    base, mid, _ = server
    models = client(server).models.list()
    assert [m.id for m in models.data] == [mid] and mid == "SmolLM2-135M-Instruct.Q4_1"
    status, _, body = request(base, "GET", "/health")                 # no key needed
    assert status == 200 and json.loads(body)["status"] == "ok"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    status, _, body = request(base, "GET", "/")                       # the chat page
    assert status == 200 and b"edgespec chat" in body


def test_chat_and_completion_match_the_library(server, model):
    """Non-streaming and streaming answers equal SpecModel.generate's (same
    greedy tokens), and streamed chunks say which text came from drafts."""
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog."
    lib = model.generate(prompt, max_tokens=24, drafter="none")
    r = chat(server, prompt, max_tokens=24)
    assert r.choices[0].message.content == lib.text and r.choices[0].finish_reason == lib.stop_reason
    assert r.usage.completion_tokens == lib.n_generated and r.usage.prompt_tokens == lib.n_prompt_tokens
    t = r.model_extra["timings"]
    assert t["predicted_n"] == lib.n_generated and t["drafter"] == "suffix" and t["steps"] >= 1
    assert {"prompt_n", "prompt_ms", "predicted_ms", "predicted_per_second", "draft_n", "draft_n_accepted",
            "cache_n", "tokens_per_step"} <= set(t)
    chunks = list(chat(server, prompt, max_tokens=24, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == lib.text
    spans = [s for c in chunks for s in (c.model_extra.get("edgespec") or {}).get("spans", [])]
    assert "".join(s for s, _ in spans) == lib.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["timings"]["predicted_n"] == lib.n_generated
    # drafted tokens of the answer; draft_n_accepted also counts an accepted end-of-turn token
    drafted = sum(c.model_extra["edgespec"]["drafted"] for c in chunks if c.model_extra.get("edgespec"))
    assert drafted <= finals[0].model_extra["timings"]["draft_n_accepted"]
    assert (drafted > 0) == any(flag for _, flag in spans)
    assert sum(c.model_extra["edgespec"]["tokens"] for c in chunks if c.model_extra.get("edgespec")) == lib.n_generated
    assert chunks[-1].usage.completion_tokens == lib.n_generated and chunks[-1].choices == []
    # text completions, with and without streaming
    raw = "The capital of France is"
    lib = model.generate(model.tokenize(raw, add_special=True, parse_special=True), max_tokens=12, drafter="none")
    c = client(server).completions.create(model=server[1], prompt=raw, max_tokens=12)
    assert c.choices[0].text == lib.text and c.usage.completion_tokens == lib.n_generated
    s = list(client(server).completions.create(model=server[1], prompt=raw, max_tokens=12, stream=True))
    assert "".join(x.choices[0].text for x in s) == lib.text
    assert s[-1].choices[0].finish_reason == lib.stop_reason


def test_stop_strings(server):
    q = "Describe the sea in two sentences."
    text = chat(server, q, max_tokens=32).choices[0].message.content
    k = len(text) // 2
    stop = text[k:k + 3]                      # a string the answer contains half-way
    assert len(stop) == 3
    cut = chat(server, q, max_tokens=32, stop=[stop, "NEVER-SEEN"])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(server, q, max_tokens=32, stop=stop,
                                                                        stream=True))
    assert streamed == text[:text.index(stop)]
    c = client(server).completions.create(model=server[1], prompt=q, max_tokens=16)
    t = c.choices[0].text
    if len(t) > 4:
        cut = client(server).completions.create(model=server[1], prompt=q, max_tokens=16, stop=t[3:5])
        assert cut.choices[0].text == t[:t.index(t[3:5])] and cut.choices[0].finish_reason == "stop"


def test_prediction_gives_the_same_text_in_fewer_steps(server):
    """OpenAI's Predicted Outputs: the expected answer (here the code as the
    model writes it back) is drafted from; the text is the same, the steps fewer."""
    prompt = ("Rename the function to `total` and return the code only.\n\n"
              "def add_all(numbers):\n    result = 0\n    for n in numbers:\n        result += n\n    return result\n")
    plain = chat(server, prompt, max_tokens=48)
    text = plain.choices[0].message.content
    fast = chat(server, prompt, max_tokens=48, prediction={"type": "content", "content": text})
    assert fast.choices[0].message.content == text
    t0, t1 = plain.model_extra["timings"], fast.model_extra["timings"]
    assert t1["steps"] < t0["steps"] and t1["draft_n_accepted"] > t0["draft_n_accepted"]
    # a prediction given as text parts works the same
    parts = chat(server, prompt, max_tokens=48, prediction={"type": "content", "content": [{"type": "text",
                                                                                           "text": text}]})
    assert parts.choices[0].message.content == text


@pytest.fixture(scope="module")
def sequential(server):
    """The answers to the first 8 PROMPTS one after the other (chat and completion)."""
    return {(kind, p): _ask(server, kind, p) for p in PROMPTS[:8] for kind in ("chat", "completion")}


def _ask(server, kind: str, prompt: str, stream: bool = False) -> str:
    cl = client(server)
    if kind == "chat":
        r = cl.chat.completions.create(model=server[1], messages=[{"role": "user", "content": prompt}],
                                       max_tokens=8, stream=stream)
        return "".join(c.choices[0].delta.content or "" for c in r) if stream else r.choices[0].message.content
    r = cl.completions.create(model=server[1], prompt=prompt, max_tokens=8, stream=stream)
    return "".join(c.choices[0].text for c in r) if stream else r.choices[0].text


def test_eight_concurrent_clients_get_their_own_answers(server, sequential):
    """8 clients x 3 requests at once (chat, streamed chat, completion): all
    answered, each identical to the same request served alone."""
    barrier = threading.Barrier(8)
    got: dict = {}
    errors: list = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            jobs = [("chat", PROMPTS[i], False), ("chat", PROMPTS[(i + 3) % 8], True),
                    ("completion", PROMPTS[(i + 5) % 8], False)]
            for kind, p, stream in jobs:
                got[(i, kind, p, stream)] = _ask(server, kind, p, stream)
        except BaseException as e:     # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not errors, errors
    assert len(got) == 24
    for (i, kind, p, stream), text in got.items():
        assert text == sequential[(kind, p)], (kind, p, stream)


def _stats(base: str) -> dict:
    return json.loads(request(base, "GET", "/health")[2])


def test_a_dropped_client_is_cancelled_and_the_next_request_is_unaffected(server, sequential):
    base, mid, _ = server
    before = _stats(base)["requests"]["cancelled"]
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"model": mid, "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
            "max_tokens": 400, "stream": True}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 4:
        line = resp.fp.readline()
        assert line, "the stream ended early"
        events += line.startswith(b"data: ")
    conn.sock.shutdown(2)
    conn.close()                                  # the client drops mid-stream
    deadline = time.monotonic() + 120
    while _stats(base)["requests"]["cancelled"] == before:
        assert time.monotonic() < deadline, "the dropped request was not cancelled"
        time.sleep(0.1)
    stats = _stats(base)
    assert stats["requests"]["last_cancelled_tokens"] < 100    # stopped right away, not after 400 tokens
    p = PROMPTS[4]
    assert _ask(server, "chat", p) == sequential[("chat", p)]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    base, mid, proc = server
    auth = {"Authorization": f"Bearer {KEY}"}
    msg = [{"role": "user", "content": "Hi"}]
    cases = [
        (b"{not json", 400, "invalid_json"),
        ([1, 2], 400, "invalid_json"),
        ({"model": mid, "messages": "Hi"}, 400, "invalid_type"),
        ({"model": mid, "messages": [{"content": "Hi"}]}, 400, "invalid_type"),
        ({"model": mid, "messages": msg, "max_tokens": "ten"}, 400, "invalid_type"),
        ({"model": mid, "messages": msg, "max_tokens": 0}, 400, "invalid_value"),
        ({"model": mid, "messages": msg, "temperature": 2.5}, 400, "invalid_value"),
        ({"model": mid, "messages": msg, "temperature": "hot"}, 400, "invalid_type"),
        ({"model": mid, "messages": msg, "top_p": 0}, 400, "invalid_value"),
        ({"model": mid, "messages": msg, "stream": "yes"}, 400, "invalid_type"),
        ({"model": mid, "messages": msg, "n": 2}, 400, "unsupported"),
        ({"model": ["gpt-4o"], "messages": msg}, 400, "invalid_type"),
        ({"model": mid, "messages": [{"role": "user", "content": "word " * (CTX + 50)}]}, 400,
         "context_length_exceeded"),
        ({"model": mid, "messages": msg, "prediction": {"type": "file"}}, 400, "invalid_type"),
    ]
    for body, status, code in cases:
        st, _, raw = request(base, "POST", "/v1/chat/completions", body, auth)
        err = json.loads(raw)["error"]
        assert (st, err["code"]) == (status, code), body
        assert err["message"] and err["type"]
    st, _, raw = request(base, "POST", "/v1/completions", {"model": mid, "prompt": {"x": 1}}, auth)
    assert st == 400 and json.loads(raw)["error"]["param"] == "prompt"
    st, _, raw = request(base, "POST", "/v1/completions", {"model": mid, "prompt": "word " * (CTX + 50)}, auth)
    assert st == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
    st, _, raw = request(base, "POST", "/v1/chat/completions", {"model": mid, "messages": msg})    # no key
    assert st == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.BadRequestError):
        chat(server, "Hi", max_tokens=4, temperature=3)
    assert proc.poll() is None
    assert chat(server, "Hi", max_tokens=4).choices[0].message.content


def test_another_model_name_is_answered_by_the_served_model(server):
    """Apps let users type the model's name (Continue's model:, Aider's
    openai/<name>): with one model served, any name is answered by it, and
    the answer names the served model (as llama-server does)."""
    base, mid, _ = server
    auth = {"Authorization": f"Bearer {KEY}"}
    for name, path, body in (("gpt-4o", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                             ("openai/qwen", "/v1/completions", {"prompt": "Hi"})):
        st, _, raw = request(base, "POST", path, {"model": name, "max_tokens": 3, **body}, auth)
        assert st == 200, raw
        assert json.loads(raw)["model"] == mid != name
    r = client(server).chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3)
    assert r.model == mid


def test_a_full_queue_gets_503_with_retry_after(server):
    """--queue 8: with one request running and eight waiting, more get 503."""
    base, mid, _ = server
    n = 14
    results = streams_at_once(base, mid, n, {"Authorization": f"Bearer {KEY}"})
    statuses = sorted(s for s, _, _ in results)
    assert len(results) == n and set(statuses) <= {200, 503}
    busy = [(ra, body) for s, ra, body in results if s == 503]
    assert len(busy) == n - 9                       # 1 running + 8 queued were admitted
    for retry_after, body in busy:
        assert int(retry_after) >= 1 and json.loads(body)["error"]["code"] == "server_busy"
    deadline = time.monotonic() + 300
    while _stats(base)["running"] or _stats(base)["queued"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert chat(server, "Hi", max_tokens=4).choices[0].message.content
