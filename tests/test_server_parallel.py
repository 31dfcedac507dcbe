"""`edgespec serve --parallel 2` (a real server subprocess, the default SmolLM2 model, exact kernels):
two clients at once are served at once, each answer the same as alone, a dropped neighbour leaves
the other's answer alone, and the queue's bound counts the running slots (503 with Retry-After)."""
from __future__ import annotations

import http.client
import json
import threading

import pytest
from serving import request, running_server, streams_at_once

pytestmark = pytest.mark.model

PROMPTS = ["Name three fruits.", "Name three colors.", "Name two planets."]


@pytest.fixture(scope="module")
def server(model):
    with running_server("--ctx", "1024", "--parallel", "2", "--queue", "1", "--max-tokens", "16",
                        "--kernels", "exact") as (base, proc):
        yield base, json.loads(request(base, "GET", "/v1/models")[2])["data"][0]["id"]
        assert proc.poll() is None


def _chat(server, prompt: str, max_tokens: int = 16) -> dict:
    base, mid = server
    status, _, body = request(base, "POST", "/v1/chat/completions",
                              {"model": mid, "messages": [{"role": "user", "content": prompt}],
                               "max_tokens": max_tokens})
    assert status == 200, body
    return json.loads(body)


def test_two_clients_at_once_get_their_answers_alone(server):
    alone = {p: _chat(server, p)["choices"][0]["message"]["content"] for p in PROMPTS[:2]}
    got: dict = {}
    barrier = threading.Barrier(2)

    def ask(p):
        barrier.wait()
        got[p] = _chat(server, p)["choices"][0]["message"]["content"]
    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert got == alone
    assert json.loads(request(server[0], "GET", "/health")[2])["running"] == 0


def test_a_dropped_neighbour_leaves_the_answer_alone(server):
    base, mid = server
    alone = _chat(server, PROMPTS[2])["choices"][0]["message"]["content"]
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"model": mid, "messages": [{"role": "user", "content": "Write a long story about the sea."}],
         "max_tokens": 300, "stream": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", _chat(server, PROMPTS[2])))
    t.start()
    for _ in range(3):
        assert resp.fp.readline()
    conn.sock.shutdown(2)
    conn.close()                                  # the neighbour drops mid-stream
    t.join(600)
    assert out["r"]["choices"][0]["message"]["content"] == alone


def test_the_queue_bound_counts_the_slots(server):
    """--parallel 2 --queue 1: two running and one waiting are admitted, the others get 503."""
    base, mid = server
    n = 6
    results = streams_at_once(base, mid, n)
    assert sorted(s for s, _, _ in results) == [200] * 3 + [503] * (n - 3)
    assert all(int(ra) >= 1 for s, ra, _ in results if s == 503)
