"""Damaged and malformed input, fuzzed: corpus files, GGUF files and JSON-lines
prompt files that are truncated, bit-flipped or carry forged headers, fed to
Corpus.load / build-corpus, SpecModel / generate and bench.  Every case must
end in a normal result or in one clear error (an EdgespecError, which the CLI
prints as one `Error:` line), never in a crash, a hang, a huge allocation or a
half-written output file.

What only Python reads (corpus headers, the GGUF header walk of
edgespec.models.gguf, prompts files) is fuzzed in this process; whatever reaches
llama.cpp or the numba kernels runs in a child process (tests/fuzz_child.py)
with a timeout and its address space capped, so an abort, a segfault or a
runaway allocation fails the test instead of killing the run.  The number
of cases tried is printed at the end of the module.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from edgespec.bench.prompts import MAX_PROMPTS_BYTES, load_prompts
from edgespec.bench.runner import run_bench
from edgespec.app.cli import main
from edgespec.errors import BenchError, EdgespecError
from edgespec.corpus.build import build_corpus
from edgespec.corpus.format import Corpus, CorpusError
from edgespec.models.gguf import ModelFileError, check_gguf

CHILD = Path(__file__).with_name("fuzz_child.py")
MEM_CAP = 6 << 30          # address space of a child: a loaded model needs ~0.8 GB of it
CHILD_TIMEOUT = 600
CASES: Counter = Counter()
TEXT = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps again.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Speculative decoding drafts tokens and verifies them in one batch; the model keeps what it agrees with.",
    "Lists: apples, bananas, cherries, dates, figs, grapes. Lists: apples, bananas, cherries.",
]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", autouse=True)
def _report_cases(request):
    request.config.fuzz_cases = CASES      # printed by conftest's pytest_terminal_summary


def one_clear_line(e: BaseException) -> str:
    """The message the CLI would print: present, and one line once the CLI
    joins its whitespace."""
    msg = " ".join(str(e).split())
    assert msg, f"{type(e).__name__} without a message"
    return msg


# ------------------------------------------------------------------ helpers
class Quiet(tuple):
    """A fixture's tuple with a short repr (hypothesis prints the arguments of
    a failing case, and these hold whole files)."""

    def __repr__(self):
        return f"<{self[0]}>"


def flips(data: bytes, regions: list[tuple[int, int]]):
    """A strategy of 1-4 bit flips, each inside one of `regions` ([start, end))."""
    regions = [(a, b) for a, b in regions if b > a]

    def one(draw_region):
        a, b = draw_region
        return st.tuples(st.integers(a, b - 1), st.integers(0, 7))
    flip = st.sampled_from(regions).flatmap(one)
    return st.lists(flip, min_size=1, max_size=4).map(
        lambda fl: {"patch": [[off, bytes([data[off] ^ (1 << bit)]).hex()] for off, bit in fl]})


def overwrite(offset: int, raw: bytes) -> dict:
    return {"patch": [[offset, raw.hex()]]}


def apply(data: bytes, case: dict) -> bytes:
    if "truncate" in case:
        return data[:case["truncate"]]
    b = bytearray(data)
    for off, hexbytes in case["patch"]:
        new = bytes.fromhex(hexbytes)
        b[off:off + len(new)] = new
    return bytes(b)


def run_child(target: str, base: str, work: str, cases: list[dict], args: dict | None = None) -> list[dict]:
    """Run `cases` through fuzz_child.py; fail on a crash, a hang or an
    unexpected exception.  Returns one result dict per case."""
    job = {"target": target, "base": base, "work": work, "mem_cap": MEM_CAP, "args": args or {},
           "cases": cases}
    env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1])] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    try:
        p = subprocess.run([sys.executable, str(CHILD)], input=json.dumps(job), capture_output=True, text=True,
                           env=env, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        started = [json.loads(ln)["i"] for ln in out.splitlines() if ln.startswith('{"i"')]
        pytest.fail(f"{target}: case {started[-1] if started else 0} hung "
                    f"({cases[started[-1]] if started else cases[0]})")
    lines = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    results = [ln for ln in lines if "i" in ln and len(ln) > 1]
    if p.returncode != 0:
        started = [ln["i"] for ln in lines if "i" in ln]
        i = started[-1] if started else 0
        pytest.fail(f"{target}: the child died with code {p.returncode} on case {i} ({cases[i]}): "
                    f"{p.stderr[-1500:]}")
    for r in results:
        assert "unexpected" not in r, f"{target}: case {cases[r['i']]}:\n{r['unexpected']}"
        assert "ok" in r or r["error"].strip(), r
    assert len(results) == len(cases), (len(results), len(cases), p.stderr[-1500:])
    CASES[f"{target} (child)"] += len(cases)
    return results


# ============================================================= corpus files
@pytest.fixture(scope="module")
def tiny_corpus(model_path, tmp_path_factory):
    """A small valid corpus built from a few lines of text with the default
    model's tokenizer, its bytes, the offset where its arrays start, and the
    byte range of every array."""
    d = tmp_path_factory.mktemp("tiny")
    src = d / "text.txt"
    src.write_text("\n".join(TEXT * 3) + "\n", encoding="utf-8")
    path = str(d / "tiny.corpus")
    c = build_corpus([str(src)], model_path, path, progress=False)
    data = Path(path).read_bytes()
    hlen = int.from_bytes(data[8:16], "little")
    regions = {e["name"]: (e["offset"], e["offset"] + int(np.prod(e["shape"])) * np.dtype(e["dtype"]).itemsize)
               for e in c.header["arrays"]}
    return Quiet((path, data, 16 + hlen, regions, c.header))


@pytest.fixture(scope="module")
def vocab(model_path):
    from edgespec.corpus.sources import ModelTokenizer
    t = ModelTokenizer(model_path)
    yield t.vocab
    t.close()


WEIRD = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64), st.floats(allow_nan=True),
                  st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=3), st.just({}))


def forged_header(header: dict, hlen: int):
    """A strategy of headers with one field (top level, params, tokenizer or an
    array table entry) set to a weird value, or dropped."""
    paths = [(k,) for k in header] + [("params", k) for k in header["params"]] + \
        [("arrays", i, k) for i in range(len(header["arrays"])) for k in ("name", "dtype", "shape", "offset")]

    def build(path_value):
        path, value, drop = path_value
        h = json.loads(json.dumps(header))
        node = h
        for p in path[:-1]:
            node = node[p]
        if drop:
            node.pop(path[-1]) if isinstance(node, dict) else node.__setitem__(path[-1], None)
        else:
            node[path[-1]] = value
        raw = json.dumps(h).encode()
        raw += b" " * max(0, hlen - len(raw))
        return raw
    return st.tuples(st.sampled_from(paths), WEIRD, st.booleans()).map(build)


def corpus_damage(tiny):
    path, data, start, regions, header = tiny
    table = [(a, b) for a, b in regions.values()]
    return st.one_of(
        st.integers(0, len(data) - 1).map(lambda n: {"truncate": n}),
        flips(data, [(0, 16), (16, start)] + table),
        st.integers(0, 2**64 - 1).map(lambda n: overwrite(8, n.to_bytes(8, "little"))),
        forged_header(header, start - 16).map(lambda raw: {"header": raw.hex()}),
    )


def damaged_corpus(data: bytes, start: int, case: dict) -> bytes:
    if "header" in case:      # the forged header, padded to the old length if shorter, then the arrays
        raw = bytes.fromhex(case["header"])
        return data[:8] + len(raw).to_bytes(8, "little") + raw + data[start:]
    return apply(data, case)


@settings(max_examples=250, **SETTINGS)
@given(data=st.data())
def test_damaged_corpus_loads_or_fails_clearly(tiny_corpus, vocab, tmp_path, data):
    path, raw, start, regions, header = tiny_corpus
    case = data.draw(corpus_damage(tiny_corpus))
    p = tmp_path / f"c{CASES['corpus load']}.corpus"
    p.write_bytes(damaged_corpus(raw, start, case))
    CASES["corpus load"] += 1
    try:
        c = Corpus.load(str(p), vocab=vocab)
    except CorpusError as e:
        assert str(p) in one_clear_line(e)
        return
    # it loaded: every index a drafter follows is inside its array (Corpus.load's
    # checks), so the damage is in values a drafter may read but not follow
    assert c.tokens.max() < c.n_vocab and c.tokens.min() >= -1
    assert c.sa.size == 0 or (c.sa.min() >= 0 and c.sa.max() < len(c.tokens))


@settings(max_examples=3, **SETTINGS)
@given(data=st.data())
def test_damaged_corpora_that_load_are_safe_to_draft_from(tiny_corpus, vocab, model_path, tmp_path, data):
    """Bit flips inside the arrays that still load: generating with every
    drafter that reads the corpus (cost gate off, so their drafts reach the
    model) gives a normal answer, in a child process."""
    path, raw, start, regions, header = tiny_corpus
    cases = data.draw(st.lists(flips(raw, list(regions.values())), min_size=4, max_size=4))
    keep = []
    for case in cases:      # the child gets the damage that loads; the rest is the test above
        p = tmp_path / "probe.corpus"
        p.write_bytes(apply(raw, case))
        try:
            Corpus.load(str(p), vocab=vocab)
            keep.append(case)
        except CorpusError:
            CASES["corpus load"] += 1
    assume(keep)
    results = run_child("corpus", path, str(tmp_path / "work.corpus"), keep,
                        {"model": model_path, "prompt": TEXT[0][:40] + " " + TEXT[3][:30], "max_tokens": 8})
    assert all("ok" in r for r in results), results


# ================================================================ GGUF files
def gguf_layout(data: bytes):
    """Offsets in a GGUF file: end of the fixed header (24), of each metadata
    key/value pair ((key, type, value offset, end)), and of the tensor infos
    ((name, n_dims offset, dims offset, n_dims, type offset, data offset field))."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def skip(t, o):
        if t in sizes:
            return o + sizes[t]
        if t == 8:
            return o + 8 + struct.unpack_from("<Q", data, o)[0]
        et, cnt = struct.unpack_from("<IQ", data, o)
        o += 12
        if et in sizes:
            return o + sizes[et] * cnt
        for _ in range(cnt):
            o = skip(et, o)
        return o
    kv, o = [], 24
    for _ in range(n_kv):
        k0 = o
        o += 8 + struct.unpack_from("<Q", data, o)[0]
        key = data[k0 + 8:o].decode()
        (t,) = struct.unpack_from("<I", data, o)
        end = skip(t, o + 4)
        kv.append((key, t, o + 4, end))
        o = end
    infos = []
    for _ in range(n_tensors):
        n0 = o
        o += 8 + struct.unpack_from("<Q", data, o)[0]
        (nd,) = struct.unpack_from("<I", data, o)
        infos.append((data[n0 + 8:o].decode(), o, o + 4, nd, o + 4 + 8 * nd, o + 8 + 8 * nd))
        o += 4 + 8 * nd + 4 + 8
    return kv, infos, o


@pytest.fixture(scope="module")
def model_gguf(model_path):
    with open(model_path, "rb") as f:
        head = f.read(4 << 20)        # the metadata and tensor infos (the default GGUF's: 1.8 MB)
    kv, infos, end = gguf_layout(head)
    return Quiet((model_path, head, kv, infos, end))


@pytest.fixture(scope="module")
def vocab_gguf(model_gguf, tmp_path_factory):
    """The default GGUF's metadata (vocabulary, chat template, hyperparameters)
    with no tensors: a valid GGUF that a vocab-only load accepts."""
    path, head, kv, infos, end = model_gguf
    data = bytearray(head[:kv[-1][3]])
    struct.pack_into("<Q", data, 8, 0)
    p = tmp_path_factory.mktemp("gguf") / "vocab.gguf"
    p.write_bytes(bytes(data))
    return Quiet((str(p), bytes(data), kv))


def gguf_header_damage(data: bytes, kv):
    """Truncations, bit flips (in the fixed header, in the bytes around each
    key's type and length fields, anywhere in the metadata) and forged counts,
    value types and lengths."""
    near = [(max(24, v - 16), min(len(data), v + 12)) for _, _, v, _ in kv]
    lengths = [v for _, t, v, _ in kv if t in (8, 9)]      # string length / array type fields
    return st.one_of(
        st.integers(0, len(data) - 1).map(lambda n: {"truncate": n}),
        flips(data, [(0, 24), (24, len(data))] + near),
        st.tuples(st.sampled_from([8, 16]), st.integers(0, 2**64 - 1)).map(
            lambda a: overwrite(a[0], a[1].to_bytes(8, "little"))),
        st.tuples(st.sampled_from([v - 4 for _, _, v, _ in kv]), st.integers(0, 2**32 - 1)).map(
            lambda a: overwrite(a[0], a[1].to_bytes(4, "little"))),
        st.tuples(st.sampled_from(lengths), st.integers(0, 2**64 - 1)).map(
            lambda a: overwrite(a[0], a[1].to_bytes(8, "little"))),
    )


@settings(max_examples=120, **SETTINGS)
@given(data=st.data())
def test_damaged_gguf_header_is_caught_or_parses(vocab_gguf, tmp_path, data):
    """edgespec's own header walk (models.check_gguf, before llama.cpp sees the
    file): a clear ModelFileError, or a header it can walk."""
    path, raw, kv = vocab_gguf
    case = data.draw(gguf_header_damage(raw, kv))
    p = tmp_path / f"g{CASES['gguf header walk']}.gguf"
    p.write_bytes(apply(raw, case))
    CASES["gguf header walk"] += 1
    try:
        check_gguf(str(p))
    except ModelFileError as e:
        assert str(p) in one_clear_line(e)


@settings(max_examples=2, **SETTINGS)
@given(data=st.data())
def test_damaged_gguf_vocab_builds_a_corpus_or_fails_clearly(vocab_gguf, tmp_path, data):
    """build-corpus with a damaged GGUF's tokenizer (a vocab-only load in
    llama.cpp), in a child: a corpus, or one clear error and nothing left in
    the output directory."""
    path, raw, kv = vocab_gguf
    cases = data.draw(st.lists(gguf_header_damage(raw, kv), min_size=12, max_size=12))
    out = tmp_path / f"out{CASES['build_corpus (child)']}"
    out.mkdir()
    text = tmp_path / "t.txt"
    text.write_text("\n".join(TEXT), encoding="utf-8")
    run_child("build_corpus", path, str(tmp_path / "work.gguf"), cases, {"out_dir": str(out), "text": str(text)})


def model_damage_cases(model_gguf) -> list[dict]:
    """Forged values where llama.cpp trusts the file: hyperparameters, tensor
    types, shapes and offsets, counts, truncations near the end.  (Found this
    way: a NaN or negative norm epsilon and an F16 norm weight made llama.cpp
    abort; models.check_gguf refuses them now.)"""
    path, head, kv, infos, end = model_gguf
    size = os.path.getsize(path)
    cases = []
    for key, t, v, _ in kv:
        if t == 4 and key.startswith("llama."):
            cases += [overwrite(v, struct.pack("<I", x)) for x in (0, 0xFFFFFFFF)]
        if t == 6:
            cases += [overwrite(v, struct.pack("<f", x)) for x in (0.0, -1.0, float("nan"))]
    for name, nd_off, dims_off, nd, type_off, data_off in (infos[0], infos[-1]):
        cases += [overwrite(type_off, struct.pack("<I", x)) for x in (1, 99)]
        cases += [overwrite(dims_off, struct.pack("<Q", x)) for x in (0, 1 << 40)]
        cases += [overwrite(data_off, struct.pack("<Q", 3)), overwrite(nd_off, struct.pack("<I", 0))]
    cases += [overwrite(8, struct.pack("<Q", len(infos) - 1)), overwrite(16, struct.pack("<Q", len(kv) + 1))]
    cases += [{"truncate": n} for n in (size - 1, end + 1)]
    return cases


def test_damaged_model_loads_or_fails_clearly(model_gguf, tmp_path):
    """The whole model with forged hyperparameters, tensor infos and counts,
    loaded by SpecModel and asked for a few tokens, in a child: a normal
    answer or one clear error for every case."""
    path = model_gguf[0]
    cases = model_damage_cases(model_gguf)
    results = run_child("model", path, str(tmp_path / "work.gguf"), cases)
    errors = sum("error" in r for r in results)
    assert errors > len(cases) // 2, "most forged models should be refused"


@settings(max_examples=2, **SETTINGS)
@given(data=st.data())
def test_bit_flipped_model_loads_or_fails_clearly(model_gguf, tmp_path, data):
    path, head, kv, infos, end = model_gguf
    cases = data.draw(st.lists(st.one_of(flips(head, [(0, 24), (24, end)] + [(i[1], i[5] + 8) for i in infos]),
                                         st.integers(0, os.path.getsize(path) - 1).map(lambda n: {"truncate": n})),
                               min_size=8, max_size=8))
    run_child("model", path, str(tmp_path / "work.gguf"), cases)


# ========================================================== prompts files
GOOD = {"question_id": 1, "category": "qa", "turns": ["Name a colour."]}
# lines no prompts file may hold (each is an error naming its line)
BAD_LINES = st.one_of(
    st.text(max_size=40).filter(lambda s: s.strip() and not _is_object(s)),
    st.sampled_from(["[" * 5000, "{" * 5000, '{"turns": ' + "[" * 5000, "null", "[]", "3", '"text"',
                     '{"turns": []}', '{"turns": [""]}', '{"turns": [3]}', '{"turns": "hi"}',
                     '{"turns": [["nested"]]}', '{"turns": ["\\ud800"]}', '{"turns": ["ok"], "category": "\\udfff"}',
                     "\ufeff" + json.dumps(GOOD), "{'turns': ['x']}", '{"turns": ["x"]', json.dumps(GOOD) + "garbage",
                     "NaN"]),
)
# odd lines that are valid prompts
ODD_LINES = st.sampled_from(['{"turns": ["\\u0000"]}', '{"turns": ["a"], "question_id": {"x": [1, 2]}}',
                             '{"turns": ["x", 3, null], "category": 7}', '{"turns": ["' + "y" * 5000 + '"]}'])


def _is_object(s: str) -> bool:
    try:
        v = json.loads(s)
    except (ValueError, RecursionError):
        return False
    return isinstance(v, dict) and isinstance(v.get("turns"), list) and bool(v["turns"]) \
        and isinstance(v["turns"][0], str) and bool(v["turns"][0])


def prompts_file(good_before: int, bad: str | bytes, good_after: int) -> bytes:
    lines = [json.dumps(dict(GOOD, question_id=i)).encode() for i in range(good_before)]
    lines.append(bad.encode("utf-8", "surrogatepass") if isinstance(bad, str) else bad)
    lines += [json.dumps(dict(GOOD, question_id=100 + i)).encode() for i in range(good_after)]
    return b"\n".join(lines) + b"\n"


BAD_FILES = st.one_of(
    st.tuples(st.integers(0, 3), st.one_of(BAD_LINES, ODD_LINES), st.integers(0, 3)).map(lambda a: prompts_file(*a)),
    st.binary(min_size=1, max_size=200).filter(lambda b: b.strip()),
    st.tuples(st.integers(0, 3), st.binary(min_size=1, max_size=20).map(lambda b: b + b"\xff\xfe"),
              st.integers(0, 3)).map(lambda a: prompts_file(*a)),
)


@settings(max_examples=300, **SETTINGS)
@given(content=BAD_FILES)
def test_malformed_prompts_file_is_one_clear_error(tmp_path, content):
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(content)
    CASES["prompts file"] += 1
    try:
        prompts = load_prompts(str(p))
    except BenchError as e:
        assert str(p) in one_clear_line(e)
        return
    # the random bytes happened to hold valid records: each is a usable prompt
    assert prompts and all(isinstance(q.turn, str) and q.turn for q in prompts)
    for q in prompts:
        q.turn.encode("utf-8")


@settings(max_examples=25, **SETTINGS)
@given(content=st.tuples(st.integers(0, 3), BAD_LINES, st.integers(0, 3)).map(lambda a: prompts_file(*a)))
def test_bench_with_a_malformed_prompts_file_writes_nothing(tmp_path, content):
    """The CLI: exit code 1, one `Error:` line naming the line, no results file
    (the prompts are read before the model is loaded)."""
    CASES["bench CLI prompts file"] += 1
    p = tmp_path / f"prompts{CASES['bench CLI prompts file']}.jsonl"
    p.write_bytes(content)
    out = tmp_path / f"results{CASES['bench CLI prompts file']}.jsonl"
    r = CliRunner().invoke(main, ["bench", "--prompts", str(p), "--methods", "none", "--out", str(out)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and str(p) in lines[0], lines
    assert not out.exists()


def test_oversized_prompts_file_is_refused_before_reading(tmp_path):
    p = tmp_path / "huge.jsonl"
    with open(p, "wb") as f:
        f.write(json.dumps(GOOD).encode() + b"\n")
        f.truncate(MAX_PROMPTS_BYTES + 1)           # sparse: no disk, no memory
    CASES["prompts file"] += 1
    with pytest.raises(BenchError, match="MiB"):
        load_prompts(str(p))


def test_bench_with_a_prompt_longer_than_the_context_writes_nothing(model, tmp_path):
    """A prompt that does not fit is found before the results file is opened
    (it used to be found at its turn, after the earlier prompts' results)."""
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(json.dumps(dict(GOOD, question_id=i, turns=[t])) for i, t in
                           enumerate(["Name a colour.", "word " * (model.backend.n_ctx + 50)])) + "\n")
    out = tmp_path / "results.jsonl"
    CASES["bench prompt too long"] += 1
    with pytest.raises(BenchError, match="more than the context"):
        run_bench(model, load_prompts(str(p)), ["none"], max_tokens=4, out_path=str(out))
    assert not out.exists()


def test_generate_with_bad_prompts(model, tmp_path):
    """generate's prompt from stdin that is not UTF-8, bytes in argv that are
    not (Python hands them over as lone surrogates), a prompt 20 times the
    context: one clear error each, in a child (a subprocess gives argv bytes
    as a shell would)."""
    ctx = str(model.backend.n_ctx)          # the session's calibration covers this context
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    runs = [(["-"], b"\xff\xfe not utf-8\n", "not UTF-8"),
            ([b"caf\xe9 latin-1".decode("utf-8", "surrogateescape")], None, "not valid Unicode"),
            (["-"], ("word " * (20 * int(ctx))).encode(), "does not fit the context")]
    for args, stdin, expect in runs:
        CASES["generate prompt"] += 1
        argv = [sys.executable, "-m", "edgespec.app.cli", "generate", "--ctx", ctx, "--max-tokens", "4"]
        argv += [os.fsencode(a) if isinstance(a, str) else a for a in args]
        p = subprocess.run(argv, input=stdin or b"", capture_output=True, env=env, timeout=CHILD_TIMEOUT,
                           preexec_fn=_cap_memory)
        err = p.stderr.decode("utf-8", "replace").strip().splitlines()
        assert p.returncode == 1 and err and err[-1].startswith("Error:") and expect in err[-1], err[-3:]
        assert "Traceback" not in p.stderr.decode("utf-8", "replace")


def _cap_memory():
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (MEM_CAP, MEM_CAP))


MESSAGES = st.one_of(
    st.just([]),
    st.lists(st.integers(-2**40, 2**40), min_size=1, max_size=4),      # token ids, mostly out of range
    st.lists(st.one_of(st.text(max_size=5), st.none(), st.lists(st.integers(), max_size=2),
                       st.fixed_dictionaries({"role": st.one_of(st.text(max_size=6), st.integers(), st.none())},
                                             optional={"content": st.one_of(st.text(max_size=20), st.integers(),
                                                                            st.none(), st.lists(st.text(max_size=3)))})),
             min_size=1, max_size=3),
)


@settings(max_examples=60, **SETTINGS)
@given(messages=MESSAGES)
def test_specmodel_with_malformed_messages(model, messages):
    """SpecModel.generate with message lists of any shape: an answer when the
    messages are {role, content} strings, else one ValueError."""
    CASES["SpecModel messages"] += 1
    n_vocab = model.vocab.n_vocab
    if messages and isinstance(messages[0], int):
        valid = all(0 <= t < n_vocab for t in messages)
    else:
        valid = bool(messages) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                       and isinstance(m.get("content"), str) for m in messages)
    try:
        r = model.generate(messages, max_tokens=2)
    except EdgespecError as e:
        one_clear_line(e)
        return
    assert valid, f"{messages!r} was accepted"
    assert r.n_generated >= 1
