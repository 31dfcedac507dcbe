"""The server's /metrics, /props, logprobs and max_tokens default, in process
(Starlette's TestClient over edgespec.app.server.Server on the session model)."""
from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("starlette")
prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from edgespec.app.request_fields import SERVE_DEFAULTS  # noqa: E402
from edgespec.app.server import Server  # noqa: E402
from edgespec import SpecModel  # noqa: E402

KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def server(model_path):
    """A server over a model of its own that verifies every draft (no cost
    gate, c(T) = T): whether suffix drafts are tried must not depend on this
    machine's calibrated costs (on the 2-core EPYC the shared model's gate
    drafted nothing for this short prompt)."""
    m = SpecModel(model_path, drafter="none", n_ctx=2048, calibrate=False, cost_gate=False)
    s = Server(m, model_id="smol", api_key=KEY, defaults=SERVE_DEFAULTS.but(drafter="suffix"))
    yield s, TestClient(s.app, base_url="http://127.0.0.1")       # no lifespan: closed here
    s._worker.shutdown(wait=True)
    m.close()


def scrape(client) -> dict:
    """{(sample name, sorted labels): value} parsed by prometheus-client's own parser."""
    r = client.get("/metrics", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_metrics_move_after_requests(server, model):
    s, client = server
    assert client.get("/metrics").status_code == 401              # behind the key, as llama-server's
    before = scrape(client)
    ok = ("edgespec_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))
    bad = ("edgespec_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "400")))
    r = client.post("/v1/chat/completions", headers=AUTH,
                    json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24})
    assert r.status_code == 200
    u = r.json()["usage"]
    assert client.post("/v1/chat/completions", headers=AUTH, json={"messages": []}).status_code == 400
    after = scrape(client)

    def moved(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)
    assert moved(*ok) == 1 and moved(*bad) == 1
    assert moved("edgespec_generated_tokens_total") == u["completion_tokens"]
    assert moved("edgespec_prompt_tokens_total") == u["prompt_tokens"]
    assert moved("edgespec_generations_total", (("stop_reason", r.json()["choices"][0]["finish_reason"]),)) == 1
    assert moved("edgespec_steps_total") >= 1 and moved("edgespec_prefill_seconds_total") > 0
    assert moved("edgespec_decode_seconds_total") > 0
    drafted, accepted = moved("edgespec_draft_tokens_total"), moved("edgespec_draft_tokens_accepted_total")
    assert 0 < accepted <= drafted           # the answer repeats the prompt: suffix drafts are accepted
    # the model thread gives its slot back just after the answer is sent: wait for it (bounded)
    deadline = time.monotonic() + 10
    while scrape(client)[("edgespec_requests_running", ())] != 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    idle = scrape(client)
    assert idle[("edgespec_queue_depth", ())] == 0 and idle[("edgespec_requests_running", ())] == 0
    # a second server in the same process counts apart (a registry of its own)
    other = Server(model, model_id="other", defaults=SERVE_DEFAULTS.but(drafter="none"))
    try:
        fresh = scrape(TestClient(other.app, base_url="http://127.0.0.1"))
        assert fresh.get(ok, 0.0) == 0 and fresh[("edgespec_generated_tokens_total", ())] == 0
    finally:
        other._worker.shutdown(wait=True)


def test_props(server, model):
    s, client = server
    assert client.get("/props").status_code == 401
    p = client.get("/props", headers=AUTH).json()
    g = p["default_generation_settings"]
    assert g["n_ctx"] == model.n_ctx and g["model"] == "smol" and g["speculative"] is True
    assert g["params"]["n_predict"] == -1 and g["params"]["temperature"] == 0.0   # no --max-tokens: unbounded
    assert p["total_slots"] == 1 and p["model_path"] == model.model_path
    assert "im_start" in p["chat_template"]
    assert p["edgespec"]["drafter"] == "suffix" and p["edgespec"]["verify"] == "exact"


def test_logprobs_over_http(server, model):
    """The server's logprobs are the library's (which test_logprobs checks
    against the model's logits), in OpenAI's chat and legacy shapes, streamed
    or not."""
    s, client = server
    lib = model.generate(PROMPT, max_tokens=12, drafter="none", logprobs=3)
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "logprobs": True, "top_logprobs": 3}
    r = client.post("/v1/chat/completions", headers=AUTH, json=body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [e.logprob for e in lib.logprobs]
    assert [len(c["top_logprobs"]) for c in content] == [3] * len(lib.tokens)
    assert "".join(c["token"] for c in content) == lib.text
    with client.stream("POST", "/v1/chat/completions", headers=AUTH, json={**body, "stream": True}) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: {")]
    streamed = [c for e in events for ch in json.loads(e[6:])["choices"] for c in (ch.get("logprobs") or {}).get("content", [])]
    assert [c["logprob"] for c in streamed] == [e.logprob for e in lib.logprobs]
    raw = "The capital of France is"
    lib = model.generate(model.tokenize(raw, parse_special=True), max_tokens=6, drafter="none", logprobs=2)
    c = client.post("/v1/completions", headers=AUTH, json={"prompt": raw, "max_tokens": 6, "logprobs": 2}).json()
    lp = c["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [e.logprob for e in lib.logprobs] and lp["text_offset"][0] == len(raw)
    assert all(2 <= len(t) <= 3 for t in lp["top_logprobs"])
    plain = {"messages": body["messages"], "max_tokens": 2}
    for bad in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}, {"logprobs": 3}):
        r = client.post("/v1/chat/completions", headers=AUTH, json={**plain, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] in bad
    r = client.post("/v1/completions", headers=AUTH, json={"prompt": raw, "max_tokens": 2, "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_max_tokens_left_out_runs_to_the_end(model_path):
    """Without max_tokens (and no --max-tokens) an answer ends at the end of its
    turn or at a full context, not at a fixed count."""
    from edgespec import SpecModel
    small = SpecModel(model_path, drafter="none", n_ctx=256, calibrate=False)
    s = Server(small, model_id="small")
    try:
        client = TestClient(s.app, base_url="http://127.0.0.1")
        raw = "1, 2, 3, 4, 5, 6,"
        r = client.post("/v1/completions", json={"prompt": raw}).json()
        u = r["usage"]
        assert r["choices"][0]["finish_reason"] == "length" and u["total_tokens"] == small.n_ctx
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say hi."}]}).json()
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["total_tokens"] < small.n_ctx
    finally:
        s._worker.shutdown(wait=True)
        small.close()


@pytest.mark.parametrize("args, want", [((), None), (("--max-tokens", "64"), 64)])
def test_serve_max_tokens_default_is_unbounded_unless_given(monkeypatch, args, want):
    """`edgespec serve` without --max-tokens leaves requests' max_tokens unbounded
    (None); with it, the flag is the default (no model is loaded here)."""
    from click.testing import CliRunner

    import edgespec.app.cli as cli
    import edgespec.app.cli.serve as serve_cmd
    import edgespec.app.server as S
    seen = {}

    class Fake:
        model_path = "/models/fake.gguf"
        calibration_state = "cached"

        def close(self):
            pass
    monkeypatch.setattr(serve_cmd, "load_model", lambda *a, **k: Fake())
    monkeypatch.setattr(serve_cmd, "exactness_notice", lambda m: None)
    monkeypatch.setattr(S, "serve", lambda m, **kw: seen.update(defaults=kw["defaults"]))
    r = CliRunner().invoke(cli.main, ["serve", *args])
    assert r.exit_code == 0, r.output
    # the server's defaults (SERVE_DEFAULTS) with the options' values: the drafter is serve's default one
    assert seen["defaults"].but(drafter=None) == SERVE_DEFAULTS.but(max_tokens=want)
