"""Compiled corpora (edgespec.corpus): the arrays against pure-Python references,
the file format and its checks, atomic writing, and `edgespec build-corpus` with
the real default model's tokenizer (tests marked `model`)."""
from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgespec.corpus.build as B
import edgespec.corpus.compile as CP
import edgespec.corpus.format as F
import edgespec.corpus.sources as S
from edgespec.corpus.compile import compile_tokens, suffix_array
from edgespec.corpus.format import Corpus, CorpusError
from edgespec.progress import NoBar


# ------------------------------------------------------------ references
def ref_tokens(docs):
    out = []
    for d in docs:
        out += list(d) + [-1]
    return out


def ref_sa(tokens, depth):
    def key(p):
        k = []
        for t in tokens[p:p + depth]:
            if t == -1:
                break
            k.append(t)
        return tuple(k), p   # tuples: a prefix sorts before the longer key
    return sorted((p for p, t in enumerate(tokens) if t != -1), key=key)


def ref_rows(grams, k):
    """{context: (total, [(next, count), ...] top k by count desc, next asc)}."""
    rows = {}
    for g, c in grams.items():
        rows.setdefault(g[:-1], []).append((g[-1], c))
    return {ctx: (sum(c for _, c in succ), sorted(succ, key=lambda x: (-x[1], x[0]))[:k])
            for ctx, succ in rows.items()}


def ngrams(docs, n):
    cnt = Counter()
    for d in docs:
        for i in range(len(d) - n + 1):
            cnt[tuple(d[i:i + n])] += 1
    return cnt


def corpus_tri_rows(c):
    rows = {}
    for w1 in range(c.n_vocab):
        for r in range(c.tri_w1_offsets[w1], c.tri_w1_offsets[w1 + 1]):
            a, b = c.tri_offsets[r], c.tri_offsets[r + 1]
            rows[(w1, int(c.tri_w2[r]))] = (int(c.tri_ctx_count[r]),
                                            list(zip(c.tri_next[a:b].tolist(), c.tri_count[a:b].tolist())))
    return rows


docs_strategy = st.integers(1, 6).flatmap(
    lambda V: st.tuples(st.just(V), st.lists(st.lists(st.integers(0, V - 1), max_size=40), max_size=6)))


# -------------------------------------------------------------- compiling
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs_strategy, st.integers(1, 4), st.integers(1, 4))
def test_ngram_rows_match_reference(vd, max_successors, k_adj):
    V, docs = vd
    c = compile_tokens([np.array(d, np.int64) for d in docs], V, max_successors=max_successors, k_adj=k_adj,
                       sa_depth=4)
    assert c.tokens.tolist() == ref_tokens(docs)
    assert c.n_docs == len(docs) and c.n_tokens == sum(map(len, docs))
    # tri-grams: CSR rows, w2 ascending inside each w1 block, pruning, unpruned totals
    assert c.tri_w1_offsets[0] == 0 and c.tri_w1_offsets[-1] == len(c.tri_w2)
    for w1 in range(V):
        w2s = c.tri_w2[c.tri_w1_offsets[w1]:c.tri_w1_offsets[w1 + 1]]
        assert np.all(np.diff(w2s) > 0)
    assert corpus_tri_rows(c) == ref_rows(ngrams(docs, 3), max_successors)
    # bi-grams: K_adj most frequent successors per token, -1 / 0 padded
    ref = ref_rows(ngrams(docs, 2), k_adj)
    for w in range(V):
        succ = ref.get((w,), (0, []))[1]
        want_next = [s for s, _ in succ] + [-1] * (k_adj - len(succ))
        want_cnt = [n for _, n in succ] + [0] * (k_adj - len(succ))
        assert c.adj_next[w].tolist() == want_next and c.adj_count[w].tolist() == want_cnt
    for name, (dtype, ndim) in F.ARRAYS.items():
        a = getattr(c, name)
        assert a.dtype == np.dtype(dtype) and a.ndim == ndim, name


@pytest.mark.parametrize("block", [1, 2, 7, 64])
def test_counting_in_blocks(block, monkeypatch):
    """N-grams across block boundaries are counted once; block runs merge exactly."""
    rng = np.random.default_rng(block)
    docs = [rng.integers(0, 9, n) for n in rng.integers(0, 60, 25)]
    whole = compile_tokens(docs, 9, max_successors=3, k_adj=2)
    monkeypatch.setattr(CP, "COUNT_BLOCK", block)
    c = compile_tokens(docs, 9, max_successors=3, k_adj=2)
    for name in F.ARRAYS:
        assert np.array_equal(getattr(c, name), getattr(whole, name)), name
    assert corpus_tri_rows(c) == ref_rows(ngrams([d.tolist() for d in docs], 3), 3)


@settings(max_examples=150, deadline=None)
@given(docs_strategy, st.sampled_from([1, 2, 4, 8, 32]))
def test_suffix_array_matches_sorted(vd, depth):
    _, docs = vd
    tokens = ref_tokens(docs)
    sa = suffix_array(np.array(tokens, np.int32), depth)
    assert sa.dtype == np.int32
    assert sa.tolist() == ref_sa(tokens, depth)


def test_suffix_array_long_repeats():
    """Long runs and repeated documents: keys tie at the depth cap, ties by position."""
    rng = np.random.default_rng(1)
    docs = [[0] * 100, [0] * 40 + [1] + [0] * 40, rng.integers(0, 2, 600).tolist(),
            ([2, 3, 4] * 30), [2, 3, 4] * 30, [5]]
    tokens = ref_tokens(docs)
    c = compile_tokens([np.array(d) for d in docs], 6)
    assert c.sa_depth == 32 and len(c.sa) == len(tokens) - len(docs)
    assert c.sa.tolist() == ref_sa(tokens, 32)
    assert suffix_array(np.array(tokens, np.int32), 8).tolist() == ref_sa(tokens, 8)


def test_compile_checks_arguments():
    with pytest.raises(ValueError):
        compile_tokens([np.array([0, 5])], 5)          # token out of range
    with pytest.raises(ValueError):
        compile_tokens([np.array([0, 1])], 5, sa_depth=24)
    with pytest.raises(ValueError):
        compile_tokens([np.array([0, 1])], 5, max_successors=0)


def test_empty_corpus():
    c = compile_tokens([], 3)
    assert len(c.tokens) == 0 and len(c.sa) == 0 and len(c.tri_w2) == 0
    assert c.tri_w1_offsets.tolist() == [0, 0, 0, 0] and (c.adj_next == -1).all()


# ----------------------------------------------------------------- files
class FakeVocab:
    def __init__(self, n, salt=b""):
        self.n_vocab = n
        self.salt = salt

    def piece(self, t, special=False):
        return b"tok%d" % t + self.salt


@pytest.fixture
def small():
    rng = np.random.default_rng(0)
    return compile_tokens([rng.integers(0, 50, n) for n in (300, 0, 120, 7)], 50, max_successors=3)


def test_round_trip(tmp_path, small):
    p = str(tmp_path / "c.corpus")
    small.header["tokenizer"] = F.tokenizer_fingerprint(FakeVocab(50))
    small.save(p)
    d = Corpus.load(p, vocab=FakeVocab(50))
    assert d.path == p and d.n_vocab == 50 and d.sa_depth == 32 and d.n_docs == 4
    for name in F.ARRAYS:
        a, b = getattr(small, name), getattr(d, name)
        assert isinstance(b, np.memmap) and not b.flags.writeable, name
        assert b.dtype == a.dtype and np.array_equal(a, b), name
        assert b.ctypes.data % F.ALIGN == 0 or b.size == 0
    assert d.header["params"] == small.header["params"]
    assert os.listdir(tmp_path) == ["c.corpus"]
    with open(p, "rb") as f:
        assert f.read(8) == F.MAGIC


def read_bytes(p):
    with open(p, "rb") as f:
        return f.read()


def _header(p):
    with open(p, "rb") as f:
        f.seek(8)
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), n


def _rewrite_header(p, mutate):
    """Change the header in place (re-serialised compactly, padded to the old length)."""
    h, n = _header(p)
    mutate(h)
    raw = json.dumps(h, separators=(",", ":")).encode()
    assert len(raw) <= n
    with open(p, "r+b") as f:
        f.seek(16)
        f.write(raw + b" " * (n - len(raw)))


@pytest.fixture
def saved(tmp_path, small):
    p = str(tmp_path / "c.corpus")
    small.save(p)
    return p


def load_error(p, *fragments, **kw):
    with pytest.raises(CorpusError) as e:
        Corpus.load(p, **kw)
    msg = str(e.value)
    assert p in msg or "corpus" in msg
    for f in fragments:
        assert f in msg, msg
    return msg


def test_load_truncated(saved):
    data = read_bytes(saved)
    for cut in (0, 5, 12, 16, 100, len(data) // 2, len(data) - 1):
        with open(saved, "wb") as f:
            f.write(data[:cut])
        load_error(saved)
    assert "truncated" in load_error(saved)


def test_load_bad_magic(saved):
    with open(saved, "r+b") as f:
        f.write(b"GGUFxxxx")
    load_error(saved, "bad magic")


def test_load_corrupt_header(saved):
    _, n = _header(saved)
    with open(saved, "r+b") as f:
        f.seek(16 + n // 3)
        f.write(b"\xff{{{")
    load_error(saved, "not valid JSON")
    with open(saved, "r+b") as f:           # an absurd header length
        f.seek(8)
        f.write((1 << 62).to_bytes(8, "little"))
    load_error(saved, "header")


def test_load_array_outside_file(saved):
    size = os.path.getsize(saved)

    def far(h):
        h["arrays"][1]["offset"] = (size // 64 + 10) * 64
    _rewrite_header(saved, far)
    load_error(saved, "array sa", "ends at byte")


def test_load_huge_shape_is_an_error_not_an_allocation(saved):
    def huge(h):
        h["arrays"][0]["shape"] = [(1 << 40) - 1]
    _rewrite_header(saved, huge)
    load_error(saved)


def test_load_inconsistent_header(saved):
    _rewrite_header(saved, lambda h: h.update(n_docs=h["n_docs"] + 1))
    load_error(saved, "shape")


def test_load_other_version(saved):
    _rewrite_header(saved, lambda h: h.update(version=99))
    load_error(saved, "version 99")


def test_load_bad_values(saved):
    h, _ = _header(saved)
    off = next(a["offset"] for a in h["arrays"] if a["name"] == "tri_next")
    with open(saved, "r+b") as f:
        f.seek(off)
        f.write(np.array([10 ** 6], np.int32).tobytes())
    load_error(saved, "tri_next")
    Corpus.load(saved, verify=False)   # the cheap checks only


def test_wrong_tokenizer(tmp_path, small):
    p = str(tmp_path / "c.corpus")
    small.header["tokenizer"] = dict(F.tokenizer_fingerprint(FakeVocab(50)), model_name="Other 7B")
    small.save(p)
    Corpus.load(p, vocab=FakeVocab(50))
    msg = load_error(p, "another tokenizer", "Other 7B", vocab=FakeVocab(50, salt=b"!"))
    assert "rebuild" in msg
    load_error(p, "another tokenizer", vocab=FakeVocab(51))


def test_interrupted_write_leaves_nothing(tmp_path, small, monkeypatch):
    p = str(tmp_path / "c.corpus")
    real = F._write_array
    calls = []

    def boom(f, arr, bar):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(f, arr, bar)
    monkeypatch.setattr(F, "_write_array", boom)
    with pytest.raises(KeyboardInterrupt):
        small.save(p)
    assert os.listdir(tmp_path) == []
    # an existing corpus survives an interrupted rewrite
    monkeypatch.setattr(F, "_write_array", real)
    small.save(p)
    before = read_bytes(p)
    calls.clear()
    monkeypatch.setattr(F, "_write_array", boom)
    with pytest.raises(KeyboardInterrupt):
        small.save(p)
    assert os.listdir(tmp_path) == ["c.corpus"] and read_bytes(p) == before


def test_split_text():
    text = "".join(f"line {i}\n" for i in range(5000)) + "x" * 300
    parts = list(S.split_text(text, 1000))
    assert "".join(parts) == text
    assert all(len(s) <= 1000 for s in parts) and all(s.endswith("\n") for s in parts[:-1])


def test_file_chunks(tmp_path):
    p = tmp_path / "a.txt"
    text = "héllo wörld\n" * 20000 + "no newline at the end " * 10
    p.write_text(text, encoding="utf-8")
    parts = list(S._file_chunks(str(p), NoBar(), size=4096))
    assert "".join(parts) == text and len(parts) > 10
    b = tmp_path / "b.bin"
    b.write_bytes(b"\x00\x01binary")
    assert list(S._file_chunks(str(b), NoBar())) == []


# --------------------------------------------------- building (real model)
@pytest.fixture(scope="module")
def model_path():
    from edgespec.models.resolve import resolve_model
    from edgespec.models.sources import ModelFileError
    try:
        return resolve_model(None)
    except ModelFileError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tok(model_path):
    t = S.ModelTokenizer(model_path)
    yield t
    t.close()


def invoke(args):
    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    from edgespec.app.cli import main
    return runner.invoke(main, args)


def assert_one_line_error(r, *fragments):
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("Error:") and "Traceback" not in r.output, r.stderr
    for f in fragments:
        assert f in lines[-1], lines[-1]


def expected_tokens(tok, texts, special=False):
    out = []
    for t in texts:
        out += tok.tokenize(t, special).tolist() + [-1]
    return out


@pytest.mark.model
def test_build_directory_with_glob(tmp_path, tok):
    d = tmp_path / "src"
    (d / "pkg").mkdir(parents=True)
    (d / ".hidden").mkdir()
    files = {"a.py": "def add(a, b):\n    return a + b\n", "pkg/b.py": "import os\nprint(os.getcwd())\n",
             "notes.md": "# Notes\nnot python\n", ".hidden/c.py": "x = 1\n", "pkg/empty.py": ""}
    for name, text in files.items():
        (d / name).write_text(text)
    out = str(tmp_path / "code.corpus")
    r = invoke(["build-corpus", str(d), "--glob", "*.py", "-o", out, "--quiet"])
    assert r.exit_code == 0, r.output
    assert "tokens" in r.stdout and "bytes/token" in r.stdout
    c = Corpus.load(out, vocab=tok.vocab)
    assert c.tokens.tolist() == expected_tokens(tok, [files["a.py"], files["pkg/b.py"]])
    assert [os.path.relpath(s["path"], d) for s in c.header["sources"]] == ["a.py", "pkg/b.py", "pkg/empty.py"]
    assert c.header["tokenizer"]["model_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert c.n_docs == 2 and len(c.sa) == c.n_tokens
    assert sorted(os.listdir(tmp_path)) == ["code.corpus", "src"]   # no temporary files left
    # a path pattern, and the default suffixes (no --glob) take the .md too
    r = invoke(["build-corpus", str(d), "--glob", "pkg/*.py", "-o", out, "--quiet"])
    assert r.exit_code == 0 and Corpus.load(out).n_docs == 1
    r = invoke(["build-corpus", str(d), "-o", out, "--quiet"])
    assert r.exit_code == 0 and Corpus.load(out).n_docs == 3


@pytest.mark.model
def test_build_jsonl_field_and_messages(tmp_path, tok):
    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}]
    rows = [{"body": "The first document.\nIt has two lines."}, {"messages": msgs}, {"body": "Third."}]
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = str(tmp_path / "j.corpus")
    r = invoke(["build-corpus", str(p), "--field", "body", "-o", out, "--quiet"])
    assert r.exit_code == 0, r.output
    c = Corpus.load(out, vocab=tok.vocab)
    rendered = tok.render(msgs)
    assert "<|im_start|>assistant\nBlue.<|im_end|>" in rendered
    want = (expected_tokens(tok, [rows[0]["body"]]) + expected_tokens(tok, [rendered], special=True)
            + expected_tokens(tok, ["Third."]))
    assert c.tokens.tolist() == want
    im_start = tok.tokenize("<|im_start|>", True).tolist()
    assert len(im_start) == 1 and im_start[0] in c.tokens.tolist()
    assert c.header["sources"][0]["docs"] == 3 and c.header["params"]["field"] == "body"
    # without --field: a record without "text" is an error naming the line
    r = invoke(["build-corpus", str(p), "-o", out, "--quiet"])
    assert_one_line_error(r, "data.jsonl line 1", "--field")
    p.write_text('{"text": "ok"}\n{not json\n')
    assert_one_line_error(invoke(["build-corpus", str(p), "-o", out, "--quiet"]), "line 2", "not valid JSON")


@pytest.mark.model
def test_build_errors(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("hello\n")
    out = str(tmp_path / "x.corpus")
    assert_one_line_error(invoke(["build-corpus", str(tmp_path / "missing"), "-o", out]), "input not found")
    assert_one_line_error(invoke(["build-corpus", str(d), "--glob", "*.rs", "-o", out]), "no files matched")
    assert_one_line_error(invoke(["build-corpus", str(d), "-o", str(tmp_path / "no" / "x.corpus")]),
                          "does not exist")
    assert_one_line_error(invoke(["build-corpus", str(d), "-o", str(d)]), "directory")
    assert_one_line_error(invoke(["build-corpus", str(d), "--model", str(tmp_path / "m.gguf"), "-o", out]),
                          "model file not found")
    r = invoke(["build-corpus", "-o", out])
    assert r.exit_code == 2
    assert sorted(os.listdir(tmp_path)) == ["d"]


@pytest.mark.model
def test_interrupted_build_leaves_nothing(tmp_path, model_path, monkeypatch):
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("some text to tokenize\n" * 50)

    def boom(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(B, "compile_arrays", boom)
    with pytest.raises(KeyboardInterrupt):
        B.build_corpus([str(d)], model_path, str(tmp_path / "x.corpus"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["d"]


@pytest.mark.model
def test_presets(tmp_path, model_path, monkeypatch):
    from edgespec.corpus import presets

    out = str(tmp_path / "s.corpus")
    r = invoke(["build-corpus", "--preset", "stdlib", "--limit", "3", "-o", out, "--quiet"])
    assert r.exit_code == 0, r.output
    c = Corpus.load(out)
    assert len(c.header["sources"]) == 3 and all(s["path"].endswith(".py") for s in c.header["sources"])
    assert c.header["params"]["preset"] == "stdlib"

    out = str(tmp_path / "chat.corpus")
    r = invoke(["build-corpus", "--preset", "chat", "--limit", "2", "--max-tokens", "16", "-o", out, "--quiet"])
    assert r.exit_code == 0, r.output
    with open(presets.answers_path(out)) as f:
        cache = [json.loads(x) for x in f]
    instr = presets.chat_instructions()
    assert [x["instruction"] for x in cache] == instr[:2]
    assert all(x["max_tokens"] == 16 and 1 <= x["n_tokens"] <= 16 for x in cache)
    c = Corpus.load(out)
    assert c.n_docs == 2

    # a re-run takes the answers from the cache: no model is loaded for generation
    class NoModel:
        def __init__(self, *a, **k):
            raise AssertionError("answers should come from the cache")
    import edgespec.app.api
    monkeypatch.setattr(edgespec.app.api, "SpecModel", NoModel)
    r = invoke(["build-corpus", "--preset", "chat", "--limit", "2", "--max-tokens", "16", "-o", out, "--quiet"])
    assert r.exit_code == 0, r.output
    assert Corpus.load(out).tokens.tolist() == c.tokens.tolist()


def test_chat_preset_needs_a_model_to_answer_with(tmp_path, model_path):
    """presets.py does not import the API: without load_model, the chat preset
    with answers still to generate is one clear error, and nothing is written."""
    from edgespec.corpus.presets import PresetError
    with pytest.raises(PresetError, match="load_model"):
        B.build_corpus([], model_path, str(tmp_path / "chat.corpus"), preset="chat", limit=1, progress=False)
    assert not (tmp_path / "chat.corpus").exists()


def test_preset_recipes_are_package_data():
    """The recipes ship inside the package (a wheel install has them)."""
    from edgespec.corpus import presets
    assert presets.recipe("stdlib")["suffixes"] == [".py"]
    assert len(presets.chat_instructions()) > 300
    with pytest.raises(presets.PresetError, match="unknown preset"):
        presets.recipe("nope")
