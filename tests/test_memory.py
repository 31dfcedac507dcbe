"""Memory across requests (edgespec/memory/, kernels/memory.py): the lookup
kernels against a pure-Python reference, the budget and its eviction, the
file (round trip; corrupt, truncated, foreign-model and unwritable files),
concurrent extension, and greedy identity to `none` with memory on."""
from __future__ import annotations

import os
import stat
import threading
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgespec.drafters.tree import DraftTree, source_name
from edgespec.drafters import make_drafter
from edgespec.kernels import memory as mk
from edgespec.memory import MemoryFileWarning, MemoryStore, open_memory, save_store
from edgespec.memory.file import open_store
from edgespec.drafters.tree import SOURCE_MEMORY

FP = {"n_vocab": 100, "sha256": "a" * 64}


def reference_matches(slots, ctx, min_len, max_len, max_matches):
    """Every occurrence of the context's end in the slots, best first (longer,
    then more recent), each at least max(min_len, K_SHORT) tokens long."""
    min_len = max(min_len, mk.K_SHORT)
    n, found = len(ctx), []
    for e in range(len(slots) - 1):
        length = 0
        while length < min(max_len, e + 1, n) and slots[e - length] == ctx[n - 1 - length]:
            length += 1
        if length >= min_len:
            found.append((length, e))
    found.sort(key=lambda x: (-x[0], -x[1]))
    return [(e, L) for L, e in found[:max_matches]]


def kernel_matches(store: MemoryStore, ctx, min_len=3, max_len=32, max_matches=8):
    ends, lens = np.zeros(max_matches, np.int32), np.zeros(max_matches, np.int32)
    ctx = np.asarray(ctx, np.int32)
    k = mk.find_matches(store._tokens, store._n, store._heads_s, store._prev_s, store._heads_l, store._prev_l,
                        ctx, len(ctx), min_len, max_len, max_matches, store.max_chain, ends, lens)
    return list(zip(ends[:k].tolist(), lens[:k].tolist()))


def store_of(entries, budget=100_000, max_chain=1_000_000) -> MemoryStore:
    s = MemoryStore(budget, prompts=True, max_chain=max_chain)
    for e in entries:
        s.add(e)
    return s


def buffers(n=64):
    return (np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int8))


# ------------------------------------------------------------------ kernels
def test_index_chains_run_from_the_most_recent_and_skip_separators():
    tokens = np.array([1, 2, 3, 4, -1, 1, 2, 3, 5, -1, 2, 3], np.int32)
    heads, prev = np.full(16, -1, np.int32), np.full(12, -1, np.int32)
    n = mk.index_range(tokens, 0, 12, 3, heads, prev)
    assert n == 4          # windows ending at 2, 3, 7, 8 (11's [-1, 2, 3] and the rest hold a separator)
    h = mk.hash_slot(mk.window_hash(tokens, 2, 3), 15)
    assert heads[h] == 7 and prev[7] == 2 and prev[2] == -1
    assert mk.window_hash(tokens, 4, 3) == -1 and mk.window_hash(tokens, 1, 3) == -1


def test_find_matches_by_hand():
    # entries [9 1 2 3 4] and [1 2 3 5 6]; the context ends in 1 2 3
    s = store_of([[9, 1, 2, 3, 4], [1, 2, 3, 5, 6]])
    assert s.snapshot()[1].tolist() == [9, 1, 2, 3, 4, -1, 1, 2, 3, 5, 6, -1]
    assert kernel_matches(s, [7, 1, 2, 3]) == [(8, 3), (3, 3)]         # equal lengths: the more recent first
    assert kernel_matches(s, [9, 1, 2, 3]) == [(3, 4), (8, 3)]         # the longer first
    assert kernel_matches(s, [1, 2]) == []                             # shorter than the index window
    assert kernel_matches(s, [5, 2, 3]) == []
    assert kernel_matches(s, [9, 1, 2, 3], min_len=4) == [(3, 4)]


def test_long_matches_are_found_past_a_long_short_chain():
    """A common 3-gram fills its chain; the long index still finds the old
    occurrence that matches 12+ tokens."""
    rng = np.random.default_rng(0)
    old = rng.integers(10, 90, 20).tolist()
    s = MemoryStore(100_000, prompts=True, max_chain=16)
    s.add(old)
    for _ in range(100):
        s.add(rng.integers(10, 90, 5).tolist() + old[-3:])       # the same last 3 tokens, over and over
    got = kernel_matches(s, [1] + old[:-1])
    assert got and got[0] == (len(old) - 2, len(old) - 1)


@settings(max_examples=150, deadline=None)
@given(entries=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=12),
       ctx=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       min_len=st.integers(1, 6), max_len=st.integers(3, 40), max_matches=st.integers(1, 8))
def test_find_matches_equals_the_reference(entries, ctx, min_len, max_len, max_matches):
    s = store_of(entries)
    want = reference_matches(s.snapshot()[1].tolist(), ctx, min_len, max_len, max_matches) \
        if max_len >= max(min_len, mk.K_SHORT) else []
    assert kernel_matches(s, ctx, min_len, max_len, max_matches) == want


def test_propose_builds_a_tree_of_memory_nodes():
    s = store_of([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7]])
    out, ends, lens, mlen = buffers(), np.zeros(8, np.int32), np.zeros(8, np.int32), np.zeros(64, np.int32)
    ctx = np.array([0, 1, 2, 3], np.int32)
    m = s.propose(ctx, 4, 3, 32, 8, 32, 64, out, ends, lens, mlen, SOURCE_MEMORY)
    t = DraftTree(*(a[:m] for a in out))
    t.validate()
    assert sorted(zip(t.parents.tolist(), t.tokens.tolist())) == [(-1, 4), (-1, 6), (0, 7), (1, 5)] or \
        sorted(zip(t.parents.tolist(), t.tokens.tolist())) == [(-1, 4), (-1, 6), (0, 5), (1, 7)]
    assert set(t.source.tolist()) == {SOURCE_MEMORY} and source_name(SOURCE_MEMORY) == "memory"


# ------------------------------------------------------------ the budget
def test_eviction_keeps_the_budget_and_the_newest_entries():
    rng = np.random.default_rng(1)
    s = MemoryStore(5_000, prompts=True, max_chain=1_000_000)
    added = []
    for i in range(1_500):
        e = rng.integers(0, 50, int(rng.integers(1, 40))).tolist()
        s.add(e)
        added.append(e)
        st_ = s.stats()
        assert st_["slots"] <= 5_000 and len(s._tokens) <= 5_000
    lengths, slots = s.snapshot()
    kept = added[-len(lengths):]
    assert slots.tolist() == [t for e in kept for t in e + [-1]]
    assert s.stats()["evicted"] == len(added) - len(kept) > 0
    for _ in range(30):       # the index was rebuilt right: lookups still equal the reference
        ctx = rng.integers(0, 50, 6).tolist()
        assert kernel_matches(s, ctx) == reference_matches(slots.tolist(), ctx, 3, 32, 8)


def test_an_entry_longer_than_the_budget_keeps_its_end():
    s = MemoryStore(10)
    s.add(list(range(30)), [])
    assert s.snapshot()[1].tolist() == list(range(21, 30)) + [-1]


def test_the_prompt_tail_goes_before_the_answer():
    s = MemoryStore()
    s.add([50, 51], list(range(20)))
    assert s.snapshot()[1].tolist() == list(range(12, 20)) + [50, 51, -1]
    s.add([], [1, 2, 3])          # no answer: nothing kept
    assert len(s) == 1


def test_the_arrays_grow_with_what_is_kept():
    s = MemoryStore()
    assert s.stats()["bytes"] < 200_000 and s.stats()["bytes_at_budget"] <= 64 << 20
    s.add(list(range(10_000)))
    assert s.stats()["slots"] == 10_001 and len(s._tokens) >= 10_001


# ------------------------------------------------------------ the file
def test_file_round_trip_mode_and_no_temporary_left(tmp_path):
    path = tmp_path / "m.mem"
    s = open_store(path, FP)
    s.add([5, 6, 7, 8], [1, 2])
    s.add([9, 10])
    assert save_store(s)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["m.mem"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = open_store(path, FP)
    assert t.path == str(path)
    assert [x.tolist() for x in t.snapshot()] == [x.tolist() for x in s.snapshot()]
    assert kernel_matches(t, [1, 2, 5]) == [(2, 3)]


def _one_warning(path, fp=FP) -> MemoryStore:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = open_store(path, fp)
    assert len(w) == 1 and issubclass(w[0].category, MemoryFileWarning), [str(x.message) for x in w]
    assert "\n" not in str(w[0].message)
    assert len(s) == 0 and s.path is None          # empty, and the file is left alone
    return s


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign", "garbage", "header"])
def test_a_bad_file_warns_once_and_starts_empty(tmp_path, damage):
    path = tmp_path / "m.mem"
    s = open_store(path, FP)
    s.add(list(range(40)))
    save_store(s)
    data = bytearray(path.read_bytes())
    fp = FP
    if damage == "corrupt":
        data[-10] ^= 0xFF
    elif damage == "truncated":
        data = data[:-7]
    elif damage == "foreign":
        fp = {"n_vocab": 100, "sha256": "b" * 64}
    elif damage == "garbage":
        data = bytearray(b"hello, not a memory file\n" * 10)
    elif damage == "header":
        data[20] = 0xFF
    path.write_bytes(bytes(data))
    store = _one_warning(path, fp)
    store.add([1, 2, 3])
    assert not save_store(store)            # never written over
    assert path.read_bytes() == bytes(data)


def test_token_ids_past_the_vocabulary_are_a_damaged_file(tmp_path):
    path = tmp_path / "m.mem"
    s = open_store(path, FP)
    s.add([5, 100])                 # FP's vocabulary has 100 tokens
    save_store(s)
    _one_warning(path)


def test_an_unwritable_file_warns_once_and_goes_on(tmp_path):
    s = open_store(tmp_path / "gone" / "m.mem", FP)      # its directory does not exist: nothing can be written
    s.add([1, 2, 3])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not save_store(s)
        s.add([4, 5, 6])
        assert not save_store(s)
    assert len(w) == 1 and "cannot write the memory file" in str(w[0].message)
    assert len(s) == 2


def test_an_unreadable_file_warns_once(tmp_path):
    (tmp_path / "dir.mem").mkdir()
    _one_warning(tmp_path / "dir.mem")


def test_a_crash_mid_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "m.mem"
    s = open_store(path, FP)
    s.add([1, 2, 3])
    save_store(s)
    old = path.read_bytes()
    s.add([4, 5, 6])

    def crash(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        save_store(s)
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["m.mem"]


def test_open_memory_settings(tmp_path):
    assert open_memory(False) is None and open_memory(None) is None
    assert isinstance(open_memory(True), MemoryStore)
    s = MemoryStore(100)
    assert open_memory(s) is s
    assert open_memory(True, budget=1000).budget == 1000

    class Vocab:
        n_vocab = 50
    assert open_memory(s, Vocab()) is s and s.n_vocab == 50
    Vocab.n_vocab = 60
    with pytest.raises(ValueError, match="one tokenizer"):
        open_memory(s, Vocab())
    with pytest.raises(ValueError):
        open_memory(3)


# ------------------------------------------------------------ threads
def test_concurrent_extension_and_lookup_see_whole_entries():
    """Writers add entries [1 2 3 t t ... t] (t unique, length by t) while
    readers look up [1 2 3]: every proposed branch is a whole entry."""
    s = MemoryStore(1_000_000)
    length = {t: 3 + t % 17 for t in range(10, 410)}
    errors = []

    def write(ts):
        for t in ts:
            s.add([t] * length[t], [1, 2, 3])

    def read():
        out, ends, lens, mlen = buffers(256), np.zeros(8, np.int32), np.zeros(8, np.int32), np.zeros(256, np.int32)
        ctx = np.array([0, 1, 2, 3], np.int32)
        for _ in range(300):
            m = s.propose(ctx, 4, 3, 32, 8, 32, 256, out, ends, lens, mlen, SOURCE_MEMORY)
            depth = {}
            for i in range(m):
                p = int(out[1][i])
                depth[i] = 1 if p < 0 else depth[p] + 1
                t = int(out[0][i])
                if p >= 0 and int(out[0][p]) != t:
                    errors.append(("mixed", t))
            leaves = [i for i in range(m) if i not in set(out[1][:m].tolist())]
            for i in leaves:
                t = int(out[0][i])
                if depth[i] != length[t]:
                    errors.append(("partial", t, depth[i]))

    writers = [threading.Thread(target=write, args=(range(10 + k, 410, 4),)) for k in range(4)]
    readers = [threading.Thread(target=read) for _ in range(3)]
    for th in writers + readers:
        th.start()
    for th in writers + readers:
        th.join()
    assert not errors, errors[:5]
    assert len(s) == 400 and s.stats()["tokens"] == sum(length.values()) + 3 * 400


# ------------------------------------------------------------ drafters
def test_suffix_and_auto_draft_from_the_memory_and_nomemory_does_not():
    s = MemoryStore()
    s.add([40, 41, 42, 43, 44], [30, 31, 32])
    ctx = np.array([5, 6, 31, 32, 40], np.int32)     # the context itself has no match
    for spec, n_vocab in (("suffix", None), ("auto", 100)):
        d = make_drafter(spec, n_vocab=n_vocab, memory_store=s)
        d.warmup()
        t = d.propose(ctx, 16)
        assert t.tokens[:1].tolist() == [41] and t.source[0] == SOURCE_MEMORY, spec
    d = make_drafter("suffix", memory_store=s, memory=False)
    assert len(d.propose(ctx, 16)) == 0


# ------------------------------------------------------------ the real model
def test_memory_keeps_greedy_output_identical_to_none(model):
    """An answer the store holds is drafted from in a later request; every
    drafter that uses the memory still commits none's tokens.  The drafting
    engines run without a cost curve, learned step costs or the guard (every
    draft is verified), so that whether memory drafts are tried does not
    depend on this machine's timings or on what earlier tests taught the
    shared model's engines."""
    from edgespec.core.config import EngineConfig
    from edgespec.core.engine import Engine, drain
    from edgespec.core.params import Request
    from edgespec.run.specs import drafter_from_spec

    assert model.memory is not None
    prompt = "List the planets of the solar system, one per line."
    ref = model.generate(prompt, max_tokens=48, drafter="none")        # the store now holds its answer
    for spec in ("suffix", "auto"):
        d, _ = drafter_from_spec(spec, n_vocab=model.vocab.n_vocab, memory_store=model.memory)
        d.warmup()
        eng = Engine(model.backend, d, None, EngineConfig(max_nodes=16, learn_costs=False, guard=False))
        try:
            r = drain(eng.run(eng.resolve(Request(model.prompt_tokens(prompt), max_tokens=48, reuse_prefix=False))))
        finally:
            eng.reset()
        assert r.tokens == ref.tokens, spec
        assert r.accepted_by_source.get("memory", 0) > 0, (spec, r.accepted_by_source)
    other = "List the planets of the solar system with one fact each."
    ref2 = model.generate(other, max_tokens=48, drafter="none")
    assert model.generate(other, max_tokens=48, drafter="suffix").tokens == ref2.tokens


def test_a_file_memory_survives_a_reload(model_path, tmp_path):
    from edgespec import SpecModel
    path = tmp_path / "m.mem"
    with SpecModel(model_path, memory=str(path), calibrate=False, n_ctx=512) as m:
        m.generate("Say hello.", max_tokens=8)
        n = len(m.memory)
    assert n == 1 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with SpecModel(model_path, memory=str(path), calibrate=False, n_ctx=512) as m:
        assert len(m.memory) == 1
    with SpecModel(model_path, memory=False, calibrate=False, n_ctx=512) as m:
        assert m.memory is None
        m.generate("Say hello.", max_tokens=4)


# ------------------------------------------------------------ the command line
def _invoke(args):
    from click.testing import CliRunner

    from edgespec.app.cli import main
    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    return runner.invoke(main, args)


def test_memory_stats_and_clear_commands(tmp_path):
    path = tmp_path / "m.mem"
    s = open_store(path, FP)
    s.add([5, 6, 7], [1, 2])
    s.add([8, 9])
    save_store(s)
    r = _invoke(["memory", "stats", str(path)])
    assert r.exit_code == 0, r.output
    assert "2 requests, 7 tokens" in r.stdout and "tokenizer of 100 tokens" in r.stdout
    r = _invoke(["memory", "clear", str(path)])
    assert r.exit_code == 0 and "cleared" in r.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(open_store(path, FP)) == 0        # still this tokenizer's file, now empty
    path.write_bytes(b"garbage")
    r = _invoke(["memory", "stats", str(path)])
    assert r.exit_code != 0 and "not an edgespec memory file" in r.stderr and "Traceback" not in r.output
    assert _invoke(["memory", "clear", str(path)]).exit_code == 0 and not path.exists()
    r = _invoke(["memory", "stats", str(path)])
    assert r.exit_code != 0 and "no such file" in r.stderr


def test_bench_method_names_with_memory():
    from edgespec.bench.methods import parse_methods, with_memory
    assert parse_methods("none,suffix+memory,default+memory,auto-nomemory") == [
        "none", "suffix+memory", "default+memory", "auto-nomemory"]
    assert [with_memory(m) for m in ("suffix+memory", "auto+memory@relaxed", "default+memory", "default", "suffix",
                                     "none", "llama-server-ngram-mod")] == [True, True, True] + [False] * 4


def test_memory_options_contradict():
    r = _invoke(["generate", "--memory", "x.mem", "--no-memory", "hi"])
    assert r.exit_code != 0 and "contradict" in r.stderr


def test_bench_memory_methods_keep_a_store_across_the_prompts(model):
    """NAME+memory drafts from the run's earlier answers (and stays identical
    to none); the other methods draft from no memory; the model's own store
    is back after the run."""
    from edgespec.bench.prompts import BenchPrompt
    from edgespec.bench.report import format_report
    from edgespec.bench.runner import run_bench

    own = model.memory
    turn = "Write the word 'alpha' then count from one to twelve in words, separated by commas."
    prompts = [BenchPrompt(i, "stream", turn) for i in range(3)]
    head, rows = run_bench(model, prompts, ["none", "suffix", "suffix+memory"], max_tokens=40)
    res = [r for r in rows if r["kind"] == "result"]
    assert all(r["identical_to_none"] for r in res if r["method"] != "none")
    mem = [r for r in res if r["method"] == "suffix+memory"]
    assert "memory" not in mem[0]["accepted_by_source"]          # an empty store at the first prompt
    assert mem[-1]["accepted_by_source"].get("memory", 0) > 10    # the same answer, drafted from the store
    assert not any("memory" in r["accepted_by_source"] for r in res if r["method"] in ("none", "suffix"))
    assert "suffix+memory: " in format_report(rows, head) and "from the memory" in format_report(rows, head)
    assert model.memory is own
