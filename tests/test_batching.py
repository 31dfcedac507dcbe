"""The slots' decodes of one round in one llama_decode (backend/batching.py's Broker, app/scheduler.py):
under exact kernels an answer decoded in combined batches beside other slots' trees equals the same
request alone, token for token: fan trees with rejected siblings, the suffix drafter and no drafter on
three slots, a compaction that waits for the pending batch, a neighbour closed mid-stream and another
request in its place, an interrupted combined decode, a job that fails with its rows laid, a long
prompt read one chunk per round (parked between chunks) beside a stream, a prompt that starts from a
neighbour's cells; and SpecModel(parallel=3) serving three threads at once, a short request read
before a long prompt that came first.  Each test also asserts that decodes with rows of
two or more slots happened, so a silent fallback to one decode per slot fails it."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import OracleDrafter, dev_prompts
from edgespec import SpecModel
from edgespec.backend import interrupt
from edgespec.backend.batching import Parked
from edgespec.backend.llama import LlamaBackend
from edgespec.backend.slots import SLOT_PREFILL_CHUNK
from edgespec.core.config import EngineConfig
from edgespec.core.engine import Engine, drain
from edgespec.core.params import Request
from edgespec.drafters import make_drafter
from edgespec.errors import Interrupted

pytestmark = pytest.mark.model
N = 32
CONFIG = EngineConfig(max_nodes=16, cost_gate=False)


@pytest.fixture(scope="module")
def slots(model):
    """Three slots of 256 cells each in one context (exact kernels: the backend's default)."""
    be = LlamaBackend(model.model_path, n_ctx=256, max_nodes=16, max_leaves=15, n_slots=3)
    yield be
    be.close()


@pytest.fixture(scope="module")
def prompts(model):
    return [model.prompt_tokens([{"role": "user", "content": r["turns"][0]}])[:72]
            for r in dev_prompts(128, 132, 156, 160)]


@pytest.fixture(scope="module")
def alone(model, prompts):
    """Each prompt's plain greedy answer on a backend of its own (no slots)."""
    eng = Engine(model.backend, make_drafter("none"), None, CONFIG)
    return [drain(eng.run(eng.resolve(Request(p, max_tokens=N, reuse_prefix=False)))).tokens for p in prompts]


def _req(engine, prompt):
    return engine.run(engine.resolve(Request(prompt, max_tokens=N, reuse_prefix=False)))


def _batched(broker, gens, close=None, every_round=None, late=None):
    """Step the generators `gens` once each per round through broker.run until all end; close = (i, steps):
    close gens[i] after that many steps; every_round(round) runs between rounds; late = (round, gen):
    that generator joins at that round.  Their results (None: closed)."""
    gens = list(gens)
    out: list = [None] * (len(gens) + (late is not None))
    live, steps, rounds = list(range(len(gens))), [0] * len(out), 0
    parked: dict = {}           # a generator parked between two prompt chunks: its Parked resumes it
    while live or (late is not None and rounds < late[0]):
        rounds += 1
        if late is not None and rounds == late[0]:
            gens.append(late[1])
            live.append(len(gens) - 1)
        if every_round is not None:
            every_round(rounds)
        if close is not None and close[0] in live and steps[close[0]] == close[1]:
            gens[close[0]].close()
            live.remove(close[0])
        outcomes = broker.run([parked.pop(i, None) or gens[i].__next__ for i in live])
        for i, (value, err) in list(zip(live, outcomes)):
            if isinstance(value, Parked):
                parked[i] = value
            elif err is None:
                steps[i] += 1
            elif isinstance(err, StopIteration):
                out[i] = err.value
                live.remove(i)
            else:
                raise err
    return out


def test_three_slots_in_one_decode_equal_alone(slots, prompts, alone):
    """No drafter, fan trees whose right token is ranked last, the suffix drafter: one combined decode
    per round (after each prompt, read alone), and each answer is plain decoding's alone.  Now and then
    the cells are made to look full, so that a slot's claim must wait for the pending batch's decode
    before the compaction (the one-token slot claims first, the trees after it)."""
    b, cells = slots.broker, slots._cells
    before = (b.decodes, b.combined, cells.compactions)
    e0 = Engine(slots.slot(0), make_drafter("none"), None, CONFIG)
    e1 = Engine(slots.slot(1), OracleDrafter(len(prompts[1]), alone[1], "fan", slots.n_vocab, width=4, depth=4),
                None, CONFIG)
    e2 = Engine(slots.slot(2), make_drafter("suffix"), None, CONFIG)

    def crowd(r):
        if r % 7 == 0:
            cells.used = cells.size - 1      # an upper bound: a compaction recounts it
    r0, r1, r2 = _batched(b, [_req(e0, prompts[0]), _req(e1, prompts[1]), _req(e2, prompts[2])],
                          every_round=crowd)
    assert r0.tokens == alone[0] and r1.tokens == alone[1] and r2.tokens == alone[2]
    assert r1.n_draft_nodes > 0 and r1.n_draft_accepted > 0 and r1.n_draft_accepted < r1.n_draft_nodes
    assert b.combined - before[1] >= N // 2, "the slots' decodes were not combined"
    assert b.max_rows > 16                  # a fan tree and the others' rows in one batch
    assert cells.compactions > before[2]


def test_a_closed_neighbour_and_a_late_request(slots, prompts, alone):
    """Slot 1's request is closed after three steps; a new request starts in slot 2 while the others
    stream; every answer that ends is its answer alone."""
    b = slots.broker
    before = b.combined
    e0 = Engine(slots.slot(0), OracleDrafter(len(prompts[0]), alone[0], "chain", slots.n_vocab, depth=3), None, CONFIG)
    e1 = Engine(slots.slot(1), make_drafter("suffix"), None, CONFIG)
    e2 = Engine(slots.slot(2), make_drafter("none"), None, CONFIG)
    r0, r1, r3 = _batched(b, [_req(e0, prompts[0]), _req(e1, prompts[1])], close=(1, 3),
                          late=(5, _req(e2, prompts[3])))
    assert r1 is None and r0.tokens == alone[0] and r3.tokens == alone[3]
    assert b.combined > before


def test_an_interrupted_combined_decode_rolls_every_slot_back(slots, prompts, alone):
    """The interrupt flag set during a round: the one combined decode returns 2, every slot in it raises
    Interrupted and drops its step's cells; the next requests on those slots give their answers alone."""
    b, flag = slots.broker, interrupt.new_flag()
    interrupt.attach(slots, flag)
    try:
        engines = [Engine(slots.slot(k), make_drafter("suffix" if k else "none"), None, CONFIG) for k in range(2)]
        gens = [_req(e, prompts[k]) for k, e in enumerate(engines)]
        for _ in range(3):              # prompts read, a first step each
            assert all(err is None for _, err in b.run([g.__next__ for g in gens]))
        flag[0] = 1
        decodes = b.decodes
        outcomes = b.run([g.__next__ for g in gens])
        assert all(isinstance(err, Interrupted) for _, err in outcomes) and b.decodes == decodes + 1
        flag[0] = 0
        r = _batched(b, [_req(engines[0], prompts[2]), _req(engines[1], prompts[3])])
        assert r[0].tokens == alone[2] and r[1].tokens == alone[3]
    finally:
        interrupt.attach(slots, None)


def test_a_job_that_fails_with_rows_laid_leaves_the_batch(slots, prompts, alone):
    """A job claims rows beside slot 0's tree, lays rows for slot 2's empty sequence there and raises before
    its decode: its rows leave the batch (slot 2's sequence stays empty), slot 0's answer is as alone."""
    b = slots.broker
    e0 = Engine(slots.slot(0), make_drafter("suffix"), None, CONFIG)
    g = _req(e0, prompts[0])
    view = slots.slot(2)
    view.reset()

    def bad():
        off = view._cells.room(view, 5)
        r = slice(off, off + 5)
        view._tok[r], view._pos[r], view._nseq[r], view._seq[r, 0], view._logits[r] = 7, np.arange(5), 1, view.seq0, 0
        raise ValueError("failed after its claim")
    out, rounds = None, 0
    while out is None:
        rounds += 1
        (_, err), (_, bad_err) = b.run([g.__next__, bad]) if rounds % 2 else b.run([bad, g.__next__])[::-1]
        assert isinstance(bad_err, ValueError) and b.rows == 0 and not b.claims
        if isinstance(err, StopIteration):
            out = err.value
        else:
            assert err is None
    assert out.tokens == alone[0]
    assert view.seq_positions(view.seq0) == (-1, -1)


@pytest.fixture(scope="module")
def long_prompt(model):
    """A prompt of more than one slot prefill chunk (and short of a slot's 256 cells with N to answer)."""
    text = " ".join(r["turns"][0] for r in dev_prompts(136))
    toks = model.prompt_tokens([{"role": "user", "content": text}])
    assert len(toks) > SLOT_PREFILL_CHUNK + 60
    return toks[:SLOT_PREFILL_CHUNK + 60]


def _alone(model, prompt):
    eng = Engine(model.backend, make_drafter("none"), None, CONFIG)
    return drain(eng.run(eng.resolve(Request(prompt, max_tokens=N, reuse_prefix=False)))).tokens


def test_a_long_prompt_is_read_between_a_neighbours_steps(model, slots, prompts, alone, long_prompt):
    """A prompt longer than SLOT_PREFILL_CHUNK parks after its first chunk: the run returns a Parked for
    it, the neighbour steps in the next round while the rest is read, and both answers equal plain
    decoding alone (whose prompt is read in one chunk)."""
    b = slots.broker
    e0 = Engine(slots.slot(0), make_drafter("none"), None, CONFIG)
    e1 = Engine(slots.slot(1), make_drafter("suffix"), None, CONFIG)
    g0, g1 = _req(e0, prompts[0]), _req(e1, long_prompt)
    (v0, err0), (v1, err1) = b.run([g0.__next__, g1.__next__])
    assert err0 is None and not isinstance(v0, Parked), "the short prompt's first token"
    assert isinstance(v1, Parked) and err1 is None and slots.slot(1).n_past == SLOT_PREFILL_CHUNK
    (v0, err0), (v1, err1) = b.run([g0.__next__, v1])       # the neighbour's step beside the second chunk
    assert err0 is None and err1 is None and not isinstance(v1, Parked)
    r0, r1 = _batched(b, [g0, g1])
    assert r0.tokens == alone[0] and r1.tokens == _alone(model, long_prompt)


def test_a_prompt_starts_from_a_neighbours_cells(model, slots, long_prompt):
    """Slot 0 answers a prompt; slot 1's prompt shares its first 150 tokens: slot 1 borrows those cells
    (nothing read again) and answers as plain decoding of its prompt alone; slot 0's next request on its
    own cells, after slot 1 dropped the shared ones, still answers alone."""
    cells = slots._cells
    other = np.concatenate([long_prompt[:150], long_prompt[20:60]]).astype(np.int32)
    e0 = Engine(slots.slot(0), make_drafter("none"), None, CONFIG)
    e1 = Engine(slots.slot(1), make_drafter("suffix"), None, CONFIG)
    slots.slot(1).reset()

    def run(e, p):
        return _batched(slots.broker, [e.run(e.resolve(Request(p, max_tokens=N, reuse_prefix=True)))])[0]
    r0 = run(e0, long_prompt)
    borrowed = cells.borrowed
    r1 = run(e1, other)
    assert cells.borrowed - borrowed == 150 and r1.n_reused_tokens == 150
    assert r0.tokens == _alone(model, long_prompt) and r1.tokens == _alone(model, other)
    slots.slot(1).reset()
    again = np.concatenate([long_prompt[:100], long_prompt[30:50]]).astype(np.int32)
    assert run(e0, again).tokens == _alone(model, again)


def test_a_decoding_neighbour_lends_what_it_has_committed(slots, prompts, long_prompt):
    """A slot decoding its answer has committed more cells than its prompt (the engine lays its tokens
    down at the end): a longer prompt is compared with the tokens known, the prompt's."""
    e0 = Engine(slots.slot(0), make_drafter("none"), None, CONFIG)
    g = _req(e0, prompts[0])
    for _ in range(3):
        assert b_ok(slots.broker.run([g.__next__]))
    v = slots.slot(0)
    assert v.n_past > len(v.kv_tokens) == len(prompts[0])
    longer = np.concatenate([prompts[0], long_prompt]).astype(np.int32)
    assert slots._cells.best_prefix(longer, len(longer) - 1) == (len(prompts[0]), v)
    g.close()


def b_ok(outcomes) -> bool:
    return all(err is None for _, err in outcomes)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")     # the fault is re-raised, loudly
def test_a_scheduler_fault_reaches_every_request(model):
    """The model thread itself fails (here: its round raises): the running request gets the error
    instead of waiting for ever, and so does every later one."""
    m = SpecModel(model.model_path, drafter="none", n_ctx=256, calibrate=False, parallel=2, kernels="exact")
    try:
        def broken():
            raise ValueError("a fault in the round")
        m._scheduler._round = broken
        with pytest.raises(RuntimeError, match="scheduler failed: ValueError: a fault in the round"):
            m.generate("Name three colors.", max_tokens=4)
        with pytest.raises(RuntimeError, match="scheduler failed"):
            m.generate("Name three colors.", max_tokens=4)
    finally:
        m.close()


@pytest.fixture(scope="module")
def parallel(model):
    m = SpecModel(model.model_path, drafter="suffix", n_ctx=512, calibrate=False, parallel=3, kernels="exact")
    yield m
    m.close()


QUESTIONS = ["Name three fruits.", "Count from one to ten in words.", "Name three colors.", "List two metals."]


def test_threads_on_parallel_3_share_decodes(parallel):
    """Three threads at once on SpecModel(parallel=3): each answer equals the same request alone, and
    the scheduler's rounds decoded rows of two or more slots together."""
    alone = {q: parallel.generate(q, max_tokens=24).tokens for q in QUESTIONS[:3]}
    b = parallel.backend.broker
    before = b.combined
    seen: dict = {}
    start = threading.Barrier(3)

    def ask(q):
        start.wait()
        seen[q] = parallel.generate(q, max_tokens=24).tokens
    threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS[:3]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(seen[q] == alone[q] for q in QUESTIONS[:3])
    assert b.combined > before, "no decode held rows of two slots"


def test_a_stream_closed_beside_others_and_one_arriving(parallel):
    """A stream closed after two chunks while another request runs, and a request arriving while that
    one streams: each finished answer equals the request alone."""
    alone = {q: parallel.generate(q, max_tokens=24).tokens for q in QUESTIONS[2:]}
    out: dict = {}
    s = parallel.stream(QUESTIONS[1], max_tokens=200)
    t = threading.Thread(target=lambda: out.setdefault("a", parallel.generate(QUESTIONS[2], max_tokens=24)))
    t.start()
    next(s), next(s)
    s.close()
    late = parallel.stream(QUESTIONS[3], max_tokens=24)
    toks = [tok for c in late for tok in c.tokens]
    t.join(300)
    assert s.closed and out["a"].tokens == alone[QUESTIONS[2]]
    assert late.result.tokens == alone[QUESTIONS[3]] and toks == alone[QUESTIONS[3]]


def test_a_short_request_is_read_before_a_long_prompt_that_came_first(parallel):
    """A long prompt is being read (its cancel check, polled between its chunks, submits a short request
    and waits until it is queued): the scheduler reads the short prompt next, so the short request's
    first token comes before the long one's, and both answers equal the same requests alone."""
    long_q = "Summarise this: " + " ".join(QUESTIONS * 15)
    alone_long = parallel.generate(long_q, max_tokens=8, reuse_prefix=False).tokens
    alone_short = parallel.generate(QUESTIONS[0], max_tokens=8, reuse_prefix=False).tokens
    sched, order, out = parallel._scheduler, [], {}

    def short():
        r = parallel.generate(QUESTIONS[0], max_tokens=8, reuse_prefix=False, on_chunk=lambda c: order.append("short"))
        out["short"] = r
    started = threading.Event()

    def poll():
        if not started.is_set():
            started.set()
            threading.Thread(target=short).start()
            for _ in range(500):
                if sched.waiting:
                    break
                threading.Event().wait(0.01)
        return False
    chunks = iter(parallel.stream(long_q, max_tokens=8, reuse_prefix=False, cancel=poll))
    first = next(chunks)
    order.append("long")
    rest = [tok for c in chunks for tok in c.tokens]
    for _ in range(3000):
        if "short" in out:
            break
        threading.Event().wait(0.01)
    assert started.is_set(), "the long prompt was read in one chunk"
    assert order[0] == "short", order
    assert first.tokens + rest == alone_long and out["short"].tokens == alone_short
