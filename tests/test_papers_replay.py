"""The replay tooling for the papers' ablation (edgespec/replay/simulator.py): the
published GPU cost curves and their rule beyond T = 8, the fake rows that
carry a teacher pass's top-k logits and entropy, and (with the model) that a
teacher-backed replay of drafters that read rankings and entropies takes the
real engine's decisions."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.kernels.topk import row_entropy, topk_rows_vals
from edgespec.replay.curves import gpu_curve
from edgespec.replay.simulator import ReplayBackend, Teacher, tail_for_entropy
from edgespec.core.params import Request

from conftest import AMD


def test_gpu_curves_are_the_published_points_extended_linearly():
    c = gpu_curve("rtx3090")
    t = c.table(32)
    # llama.cpp PR #15802: c(2) = 1.12, c(4) = 1.33, c(8) = 2.15; between points linear
    # (c(3) = 1.225, c(6) = 1.74); beyond 8 the slope of c(4)..c(8), 0.205 per token:
    # c(16) = 2.15 + 8 * 0.205 = 3.79, c(32) = 2.15 + 24 * 0.205 = 7.07
    assert t[[1, 2, 3, 4, 6, 8, 16, 32]] == pytest.approx([1.0, 1.12, 1.225, 1.33, 1.74, 2.15, 3.79, 7.07])
    m2 = gpu_curve("m2").table(16)       # llama.cpp PR #10581: 1.11, 1.41, 2.16; slope 0.1875
    assert m2[[2, 4, 8, 16]] == pytest.approx([1.11, 1.41, 2.16, 3.66])
    # one context, no attention growth: the same table at any KV position
    assert c.table(16, n_kv=3000) == pytest.approx(c.table(16))


def test_tail_for_entropy_reproduces_the_rows_entropy():
    V, K = 1000, 8
    rng = np.random.default_rng(0)
    full = rng.standard_normal((6, V)).astype(np.float32) * np.array([[0.5], [1], [2], [3], [5], [8]], np.float32)
    ids, vals, h = np.zeros((6, K), np.int32), np.zeros((6, K), np.float32), np.zeros(6, np.float32)
    topk_rows_vals(full, np.arange(6, dtype=np.int64), 6, K, ids, vals)
    row_entropy(full, 6, h)
    t = tail_for_entropy(vals, h, V)
    # the stand-in row: the top 8 logits, every other token at t; its entropy is the
    # real row's (flat rows need a high tail, peaked ones a low one), and t stays below
    # the top 8, so their order is unchanged
    fake = np.repeat(t[:, None], V, axis=1)
    np.put_along_axis(fake, ids.astype(np.int64), vals, axis=1)
    hf = np.zeros(6, np.float32)
    row_entropy(fake, 6, hf)
    assert hf == pytest.approx(h, abs=1e-3)
    assert (t <= vals.min(axis=1) + 1e-6).all() and t[0] > t[-1] - 100


class _Vocab:
    n_vocab = 50

    def eog_mask(self):
        return np.zeros(50, bool)


def test_replay_rows_on_the_record_carry_the_teachers_numbers():
    from edgespec.calibration.curve import CostCurve
    cost = CostCurve([1, 2, 4], [1.0, 1.5, 2.0], 0.01)
    be = ReplayBackend(_Vocab(), 64, 8, cost, eog_token=49)
    truth = np.array([3, 4, 5, 6, 7, 8], np.int32)          # prompt 3 4 5, answer 6 7 8
    n = len(truth)
    ids = np.tile(np.arange(8, dtype=np.int32) + 10, (n, 1))
    ids[np.arange(n - 1), 0] = truth[1:]                     # row p ranks truth[p + 1] first
    vals = np.tile(np.linspace(4.0, 0.5, 8, dtype=np.float32), (n, 1))
    ent = np.full(n, 2.0, np.float32)     # the top 8 alone have 1.61 nats: the tail adds the rest
    hid = np.arange(n * 4, dtype=np.float16).reshape(n, 4)
    tch = Teacher(ids, vals, ent, tail_for_entropy(vals, ent, 50), hid)
    be.set_truth(truth, None, 3, tch)
    be.set_hidden(True)
    pre = (np.zeros((3, 8), np.int32), np.zeros((3, 8), np.float32))
    hout = np.zeros((3, 4), np.float32)
    be.prefill(truth[:3], topk_out=pre, hidden_out=hout)
    # the prefill's rankings and hidden states are the teacher's rows 0..2
    assert (pre[0] == ids[:3]).all() and np.allclose(pre[1], vals[:3]) and np.allclose(hout, hid[:3])
    # the last prompt row predicts 6 with the teacher's top-8 logits and entropy 2.0
    row = be.logits()[0]
    assert int(row.argmax()) == 6
    h = np.zeros(1, np.float32)
    row_entropy(be.logits(), 1, h)
    assert h[0] == pytest.approx(2.0, abs=1e-3)
    # a verification batch: root 6 (on the record), its child 7 (on), a sibling 9 (off)
    be.decode_tree(np.array([6, 7, 9], np.int32), np.array([0, 1, 1], np.int32), np.array([0, 0, 1], np.int32),
                   np.array([2, 1, 1], np.int32), 2)
    lg = be.logits()
    assert int(lg[0].argmax()) == 7 and int(lg[1].argmax()) == 8      # rows 3 and 4 of the teacher
    assert np.allclose(be.hidden()[:2], hid[3:5]) and (be.hidden()[2] == 0).all()
    assert lg[2].max() == 1.0 and (lg[2] > 0).sum() == 1                # off the record: a plain stand-in


@pytest.mark.model
def test_teacher_backed_replay_matches_the_real_engine(model):
    """A drafter that reads the prefill's rankings (AdaPLD branch drafting) and
    every committed row's entropy (ReSpec's trigger), replayed over a teacher
    pass, takes the real engine's decisions step for step."""
    from edgespec.backend.llama import LlamaBackend
    from edgespec.drafters import make_drafter, parse_drafter_name
    from edgespec.core.config import EngineConfig
    from edgespec.core.engine import Engine, drain
    from edgespec.replay.simulator import ReplayRequest, replay, teacher_pass

    from conftest import dev_prompts
    # the schedule off: it weighs parts by their timed propose() and decode time, so under
    # load the real engine's schedule idles a part the replay's keeps (the verdict would
    # depend on the machine and what else runs on it)
    name = "auto+branch+trigger-notrigram-noadjacency-nobranch_depth-nosemantic_pair-noschedule"
    rows = dev_prompts(504, 132)     # rag, extraction
    # the gate's inputs fixed in both: its overhead term, and the calibrated curve alone (the
    # learned step costs and the guard read timings, which differ between the two)
    config = EngineConfig(max_nodes=model.config.max_nodes, gate_overhead=0.02, learn_costs=False, guard=False)

    def drafter():
        b, _, sw = parse_drafter_name(name)
        return make_drafter(b, n_vocab=model.vocab.n_vocab, **sw)

    reqs, real = [], []
    eng = Engine(model.backend, drafter(), AMD, config)
    for i, row in enumerate(rows):
        toks = model.prompt_tokens([{"role": "user", "content": row["turns"][0]}])
        ref = model.generate(toks, max_tokens=48 + 32, drafter="none", record_topk=8)
        reqs.append(ReplayRequest(str(i), row["category"], toks, np.asarray(ref.tokens, np.int32),
                                  ref.stop_reason == "stop", ref.topk))
        res = drain(eng.run(eng.resolve(Request(toks, max_tokens=48, reuse_prefix=False))))
        assert res.tokens == ref.tokens[:48]
        real.append((res.n_steps, res.n_draft_nodes, res.n_draft_accepted))
    eng.reset()
    tb = LlamaBackend(model.model_path, n_ctx=model.backend.n_ctx, max_nodes=512, max_leaves=1, exact=False,
                      n_threads=model.backend.n_threads, cache_type_k=model.backend.cache_type_k)
    try:
        for r in reqs:
            r.teacher = teacher_pass(tb, np.concatenate([r.prompt, r.output]), len(r.prompt))
    finally:
        tb.close()
    eog = int(np.nonzero(model.vocab.eog_mask())[0][0])
    be = ReplayBackend(model.vocab, model.backend.n_ctx, model.backend.max_nodes, AMD, eog)
    d = drafter()
    out = replay(Engine(be, d, AMD, config), be, reqs, 48)
    assert [(r["n_steps"], r["n_draft_nodes"], r["n_draft_accepted"]) for r in out] == real
    assert d.trigger.n_trigger_checks > 0 and 0 < d.trigger.n_triggered     # the trigger ran on the teacher's entropies
