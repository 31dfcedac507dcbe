"""The prompt prefix kept across requests (edgespec.core.prefix_cache, issue 52).

With exact kernels (the tests run with EDGESPEC_KERNELS=exact) the greedy
answer to a prompt must not depend on what was served before: whether its
prefix came from the live KV cache, from a prefix saved in host memory and
restored, or from a prefill of the whole prompt (reuse_prefix=False, which
starts from an empty cache as a freshly loaded model does).  Checked on
SmolLM2 (the `model` fixture) and, in the matrix tier, Qwen2.5-Coder-0.5B;
then the budget's least-recently-used eviction, and cache_n in the server's
answers, log and /metrics.
"""
from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest

from edgespec.core.prefix_cache import PrefixCache, common_prefix

from conftest import dev_prompts

MAX_TOKENS = 24
SYSTEM = dev_prompts(136)[0]["turns"][0]           # ~300 tokens: an app's long system prompt
QUESTIONS = [r["turns"][0] for r in dev_prompts(108, 144, 152, 156)]
SIDE = dev_prompts(324)[0]["turns"][0]             # a short unrelated request (an app's title or tags)


def convo(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@contextlib.contextmanager
def prompt_cache(model, budget_bytes: int):
    """The model's engines share a PrefixCache of this budget for the block (then the old one again)."""
    old = model.prefix_cache
    pc = PrefixCache(budget_bytes)

    def use(cache) -> None:
        model.prefix_cache = cache
        for e in model._engines.values():
            e.prefix_cache = cache
    use(pc)
    try:
        yield pc
    finally:
        use(old)


def fresh(model, prompt) -> list[int]:
    """The answer from an empty cache, the whole prompt prefilled (what a freshly loaded model answers)."""
    return model.generate(prompt, max_tokens=MAX_TOKENS, reuse_prefix=False).tokens


def check_history_independence(model, drafter: str = "none") -> None:
    """Prompts sharing all, some and none of their tokens with the one before,
    the next turn of a conversation, after a cancelled request, and after a side request (the conversation's
    prefix restored from the host cache): every answer equals a fresh one."""
    model.use_drafter(drafter)
    a, a2, a3 = (model.prompt_tokens(convo(q)) for q in QUESTIONS[:3])
    side = model.prompt_tokens(SIDE)
    shared = common_prefix(a, a2, len(a2))
    assert shared > 200 and common_prefix(a, side, len(side)) < 20
    refs = {name: fresh(model, p) for name, p in (("a", a), ("a2", a2), ("a3", a3), ("side", side))}
    # the next turn: its prefix holds the answer's cells, decoded one step at a time, not prefilled
    turn = model.prompt_tokens(convo(QUESTIONS[0]) + [{"role": "assistant", "content": model.detokenize(refs["a"])},
                                                      {"role": "user", "content": "Say it again, shorter."}])
    refs["turn"] = fresh(model, turn)
    with prompt_cache(model, 64 << 20) as pc:
        model.backend.reset()                                             # nothing live to save
        r = model.generate(a, max_tokens=MAX_TOKENS)
        assert r.tokens == refs["a"]
        again = model.generate(a, max_tokens=MAX_TOKENS)                  # all shared
        assert again.tokens == refs["a"] and again.n_reused_tokens == len(a) - 1
        nxt = model.generate(turn, max_tokens=MAX_TOKENS)
        assert nxt.tokens == refs["turn"] and nxt.n_reused_tokens > len(a)
        some = model.generate(a2, max_tokens=MAX_TOKENS)                  # the system prompt shared
        assert some.tokens == refs["a2"] and some.n_reused_tokens == shared
        other = model.generate(side, max_tokens=MAX_TOKENS)               # (almost) nothing shared
        assert other.tokens == refs["side"] and other.n_reused_tokens < 20
        assert len(pc) >= 1 and pc.n_saved >= 1                          # a2's cells were saved first
        assert any(common_prefix(e.tokens, a2, len(a2)) == len(a2) for e in pc.entries.values())
        with model.stream(a3, max_tokens=MAX_TOKENS) as s:                # a cancelled request
            for i, _ in enumerate(s):
                if i == 3:
                    break
        after_cancel = model.generate(a3, max_tokens=MAX_TOKENS)
        assert after_cancel.tokens == refs["a3"] and after_cancel.n_reused_tokens == len(a3) - 1
        model.generate(side, max_tokens=MAX_TOKENS)                       # a side request: a3 saved
        restored_before = pc.n_restored
        back = model.generate(a, max_tokens=MAX_TOKENS)                   # a's prefix from the host cache
        assert pc.n_restored == restored_before + 1
        assert back.n_reused_tokens >= shared and back.tokens == refs["a"]
    model.use_drafter("none")


def test_answers_do_not_depend_on_what_was_served_before(model):
    check_history_independence(model, "none")


def test_answers_do_not_depend_on_it_with_drafts_either(model):
    check_history_independence(model, "suffix")


@pytest.mark.matrix
def test_answers_do_not_depend_on_it_on_qwen():
    """The same on another model family (Qwen2.5-Coder-0.5B: another
    architecture, a vocabulary of 151k tokens, grouped-query attention)."""
    from edgespec import SpecModel
    from edgespec.models.zoo import ModelZooError, require_model
    try:
        path = require_model("qwen2.5-coder-0.5b")
    except ModelZooError as e:
        pytest.fail(f"the model-matrix tier was selected but {e}", pytrace=False)
    with SpecModel(path, drafter="none", n_ctx=2048, calibrate=False, cost_gate=False, max_nodes=32) as m:
        check_history_independence(m, "none")


def test_the_budget_evicts_the_least_recently_used_prefix(model):
    """Room for two saved prefixes: a third evicts the one used least recently,
    and a prefix restored counts as used."""
    model.use_drafter("none")
    # three conversations of one length, each its own system prompt (a question's text repeated)
    prompts = [model.prompt_tokens([{"role": "system", "content": (q + " ") * 6}, {"role": "user", "content": "Go."}])
               for q in QUESTIONS[:3]]
    prompts = [p[:min(map(len, prompts))] for p in prompts]
    model.generate(prompts[0], max_tokens=4, reuse_prefix=False)
    one = model.backend.save_state().nbytes
    assert one > 0 and all(len(p) > 100 for p in prompts)

    def held() -> list[int]:
        """Which of the prompts the saved entries hold, oldest use first."""
        return [next(i for i, p in enumerate(prompts) if common_prefix(e.tokens, p, len(p)) == len(p))
                for e in pc.entries.values()]
    with prompt_cache(model, int(2.6 * one)) as pc:
        model.backend.reset()
        for p in prompts:
            model.generate(p, max_tokens=4)
        assert held() == [0, 1]                     # the live cache (prompt 2) is not saved yet
        model.generate(prompts[0], max_tokens=4)   # saves 2, evicting 1 (not 0, about to be restored), restores 0
        assert held() == [2, 0] and pc.n_evicted == 1 and pc.n_restored == 1
        assert pc.n_bytes <= pc.budget
        r = model.generate(prompts[1], max_tokens=4)   # 1 is gone: prefilled but for the template's head
        assert r.n_reused_tokens < 20
        assert held() == [2, 0] and pc.stats()["entries"] == 2     # 0's cells were held already: not saved again
    with prompt_cache(model, one // 2) as pc:       # smaller than one prefix: nothing is kept
        for p in prompts[:2]:
            model.generate(p, max_tokens=4)
        assert len(pc) == 0 and pc.n_bytes == 0


def test_a_background_calibration_slice_keeps_the_conversation(model):
    """A background calibration's slice clears the KV cache; the Pacer first
    saves the live conversation (SpecModel._keep_live_prefix), so the next
    turn restores its prefix instead of prefilling it, with the same answer."""
    from edgespec.calibration.background import Pacer
    model.use_drafter("none")
    first, turn = model.prompt_tokens(convo(QUESTIONS[0])), model.prompt_tokens(convo(QUESTIONS[1]))
    want = model.generate(turn, max_tokens=8, reuse_prefix=False).tokens
    with prompt_cache(model, 2**28) as pc:
        model.generate(first, max_tokens=4)
        pacer = Pacer(before_slice=model._keep_live_prefix)
        pacer.enter()                       # a request used the backend since the last slice ...
        pacer.exit()
        assert pacer.pause() is True        # ... so the slice saves the live cells first
        model.backend.reset()               # what the slice's measurement does to the KV cache
        pacer.end()
        assert len(pc) == 1
        r = model.generate(turn, max_tokens=8)
    shared = common_prefix(first, turn, len(turn) - 1)
    assert shared >= 64 and r.n_reused_tokens == shared and r.tokens == want


def test_restore_state_puts_back_the_saved_cells(model):
    """save_state / restore_state: after another prompt ran, the restored
    cells give the first prompt's next-token logits bit for bit."""
    be = model.backend
    toks = model.prompt_tokens(convo(QUESTIONS[0]))
    model.generate(toks, max_tokens=2, reuse_prefix=False)
    be.truncate(len(toks) - 1)
    state, kept = be.save_state(), be.kv_tokens.copy()
    be.prefill(toks[-1:])
    want = be.logits()[0].copy()
    model.generate(model.prompt_tokens(SIDE), max_tokens=2, reuse_prefix=False)
    be.restore_state(state, kept)
    assert be.n_past == len(toks) - 1 and np.array_equal(be.kv_tokens, toks[:-1])
    be.prefill(toks[-1:])
    assert np.array_equal(be.logits()[0], want)
    be.reset()


def test_the_server_reports_cached_tokens(model, caplog):
    """Every request reuses the longest common prefix (not only one that
    extends the last prompt): timings.cache_n, the log line, /metrics."""
    pytest.importorskip("starlette")
    pytest.importorskip("prometheus_client")
    from starlette.testclient import TestClient

    from edgespec.app.request_fields import SERVE_DEFAULTS
    from edgespec.app.server import Server

    s = Server(model, model_id="smol", defaults=SERVE_DEFAULTS.but(drafter="none"))
    client = TestClient(s.app, base_url="http://127.0.0.1")
    try:
        answers = []
        with caplog.at_level(logging.INFO, logger="edgespec.app.server"):
            # the second rewrites the first's last message; it gives no max_tokens (a stop string ends it)
            for q, extra in ((QUESTIONS[0], {"max_tokens": 8}), (QUESTIONS[1], {"stop": [" "]})):
                r = client.post("/v1/chat/completions", json={"messages": convo(q), **extra})
                # (the model thread gives its slot back just after an answer, on the test client's loop)
                assert r.status_code == 200 and r.headers["X-Queue-Position"] in ("0", "1")
                answers.append(r.json())
        t = answers[1]["timings"]
        shared = common_prefix(*(model.prompt_tokens(convo(q)) for q in QUESTIONS[:2]), 10**6)
        assert t["cache_n"] == shared and t["prompt_n"] == answers[1]["usage"]["prompt_tokens"] - shared
        lines = [rec.getMessage() for rec in caplog.records
                 if rec.name == "edgespec.app.server" and rec.getMessage().startswith("request: prompt")]
        assert len(lines) == 2 and f"({shared} cached)" in lines[1] and "no max_tokens given" in lines[1], lines
        assert "no max_tokens" not in lines[0]
        metrics = client.get("/metrics").text
        assert f"edgespec_prompt_tokens_cached_total {float(t['cache_n'] + answers[0]['timings']['cache_n'])}" \
            in metrics
        assert "edgespec_generations_to_context_end_total 1.0" in metrics
        # llama-server's cache_prompt: false prefills the whole prompt; a non-boolean is refused
        body = {"messages": convo(QUESTIONS[1]), "max_tokens": 4}
        again = client.post("/v1/chat/completions", json={**body, "cache_prompt": False}).json()
        assert again["timings"]["cache_n"] == 0 and again["timings"]["prompt_n"] == again["usage"]["prompt_tokens"]
        assert client.post("/v1/chat/completions", json={**body, "cache_prompt": True}).json()["timings"]["cache_n"] \
            == again["usage"]["prompt_tokens"] - 1          # all but the last token, whose logits choose the first
        bad = client.post("/v1/chat/completions", json={**body, "cache_prompt": "no"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_prompt"
    finally:
        s._worker.shutdown(wait=True)
