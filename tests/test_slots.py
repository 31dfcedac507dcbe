"""Several requests in one llama.cpp context (backend/slots.py) and the Scheduler that steps them
(app/scheduler.py): under exact kernels an answer beside others equals the same request alone,
token for token, with drafts rejected around it, a neighbour cancelled in the middle and the
cache compacted; SpecModel(parallel=2) serves two threads at once the same way."""
from __future__ import annotations

import threading
import time

import pytest

from conftest import OracleDrafter, dev_prompts
from edgespec import SpecModel
from edgespec.backend.llama import LlamaBackend
from edgespec.core.config import EngineConfig
from edgespec.core.engine import Engine, drain
from edgespec.core.params import Request
from edgespec.drafters import make_drafter
from edgespec.errors import ConfigError

pytestmark = pytest.mark.model
N = 48
CONFIG = EngineConfig(max_nodes=16, cost_gate=False)


@pytest.fixture(scope="module")
def slots(model):
    """Two slots of 256 cells each in one context."""
    be = LlamaBackend(model.model_path, n_ctx=256, max_nodes=16, max_leaves=15, n_slots=2)
    yield be
    be.close()


@pytest.fixture(scope="module")
def prompts(model):
    return [model.prompt_tokens([{"role": "user", "content": r["turns"][0]}])[:80]
            for r in dev_prompts(128, 132, 156)]


@pytest.fixture(scope="module")
def alone(model, prompts):
    """Each prompt's plain greedy answer on a backend of its own (no slots)."""
    eng = Engine(model.backend, make_drafter("none"), None, CONFIG)
    return [drain(eng.run(eng.resolve(Request(p, max_tokens=N, reuse_prefix=False)))).tokens for p in prompts]


def _interleaved(jobs, close=None, compact=None):
    """Step the engine generators of jobs [(engine, resolved)] in turn, one step each, until all end;
    close = (i, steps): close job i's generator after that many steps; compact = (cells, round): compact
    the cache between two steps at that round.  Their results (None: closed)."""
    gens = [e.run(r) for e, r in jobs]
    out: list = [None] * len(gens)
    live, steps, rounds = list(range(len(gens))), [0] * len(gens), 0
    while live:
        rounds += 1
        if compact is not None and compact[1] == rounds:
            compact[0].compact()
        for i in list(live):
            if close is not None and close == (i, steps[i]):
                gens[i].close()
                live.remove(i)
                continue
            try:
                next(gens[i])
                steps[i] += 1
            except StopIteration as e:
                out[i] = e.value
                live.remove(i)
    return out


def test_two_slots_interleaved_equal_alone(slots, prompts, alone):
    """Slot 0 verifies fan trees whose right token is ranked last (rejected siblings in every
    step), slot 1 drafts with the suffix drafter; stepped in turn, each answer is plain
    decoding's alone, also across a compaction of the cache between two steps."""
    before = slots._cells.compactions
    a = Engine(slots.slot(0), OracleDrafter(len(prompts[0]), alone[0], "fan", slots.n_vocab, width=4, depth=4),
               None, CONFIG)
    b = Engine(slots.slot(1), make_drafter("suffix"), None, CONFIG)
    ra, rb = _interleaved([(a, a.resolve(Request(prompts[0], max_tokens=N, reuse_prefix=False))),
                           (b, b.resolve(Request(prompts[1], max_tokens=N, reuse_prefix=False)))],
                          compact=(slots._cells, 6))
    assert ra.tokens == alone[0] and rb.tokens == alone[1]
    assert ra.n_draft_nodes > 0 and ra.n_draft_accepted > 0
    assert slots._cells.compactions > before
    assert slots.slot(1).n_ctx == 256 and slots.n_cells == 512


def test_a_cancelled_neighbour_leaves_the_answer_alone(slots, prompts, alone):
    """Slot 1's request is closed after its first step and another starts in its place while slot 0's
    runs on: the holes the first left are never refilled under slot 0's cells (tombstones)."""
    a = Engine(slots.slot(0), OracleDrafter(len(prompts[0]), alone[0], "chain", slots.n_vocab, depth=3), None, CONFIG)
    b = Engine(slots.slot(1), make_drafter("suffix"), None, CONFIG)
    ra, rb = _interleaved([(a, a.resolve(Request(prompts[0], max_tokens=N, reuse_prefix=False))),
                           (b, b.resolve(Request(prompts[1], max_tokens=N, reuse_prefix=False)))], close=(1, 1))
    assert rb is None and ra.tokens == alone[0]
    a2 = Engine(slots.slot(0), make_drafter("none"), None, CONFIG)
    r0, r2 = _interleaved([(a2, a2.resolve(Request(prompts[1], max_tokens=N, reuse_prefix=False))),
                           (b, b.resolve(Request(prompts[2], max_tokens=N, reuse_prefix=False)))], close=None)
    assert r0.tokens == alone[1] and r2.tokens == alone[2]


def test_slots_refuse_what_they_cannot_hold(model):
    with pytest.raises(ConfigError, match="KV sequences"):
        LlamaBackend(model.model_path, n_ctx=256, max_nodes=16, max_leaves=64, n_slots=5)
    with pytest.raises(ConfigError, match="at least 1"):
        LlamaBackend(model.model_path, n_ctx=256, n_slots=0)


@pytest.fixture(scope="module")
def parallel(model):
    m = SpecModel(model.model_path, drafter="suffix", n_ctx=512, calibrate=False, parallel=2, kernels="exact")
    yield m
    m.close()


QUESTIONS = ["Name three fruits.", "Count from one to ten in words.", "Name three colors."]


def test_threads_share_one_parallel_model(parallel):
    """Two threads at once on SpecModel(parallel=2): both run together (each one's first chunk
    arrives before the other ends) and each answer equals the same request alone."""
    alone = {q: parallel.generate(q, max_tokens=24).tokens for q in QUESTIONS[:2]}
    seen: dict = {}

    def ask(q):
        first = []
        r = parallel.generate(q, max_tokens=24, on_chunk=lambda c: first or first.append(time.monotonic()))
        seen[q] = (r.tokens, first[0], time.monotonic())
    threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    (ta, fa, ea), (tb, fb, eb) = seen[QUESTIONS[0]], seen[QUESTIONS[1]]
    assert ta == alone[QUESTIONS[0]] and tb == alone[QUESTIONS[1]]
    assert fa < eb and fb < ea, "the two requests did not run at once"


def test_a_closed_stream_frees_its_slot(parallel):
    """A stream closed after two chunks, beside a request running to its end: that answer is the
    one alone, and the freed slot takes the next request."""
    alone = parallel.generate(QUESTIONS[2], max_tokens=24).tokens
    s = parallel.stream(QUESTIONS[1], max_tokens=200)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", parallel.generate(QUESTIONS[2], max_tokens=24)))
    t.start()
    next(s), next(s)
    s.close()
    t.join(300)
    assert s.closed and out["r"].tokens == alone
    assert parallel.generate(QUESTIONS[2], max_tokens=24, wait=False).tokens == alone
