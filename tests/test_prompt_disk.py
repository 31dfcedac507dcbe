"""The prompt cache's disk tier (edgespec.core.prompt_disk, issue 57).

First the files themselves, without a model: the chained block hashes find
the longest shared prefix, files are 0600 in a 0700 folder and written
whole, the budget evicts the least recently used file (of any key), two
PromptDisks on one folder (two processes) see each other's files, and bad
files are skipped.  Then with SmolLM2 in the real llama.cpp (and, in the
matrix tier, Qwen2.5-Coder-0.5B): under exact kernels (the tests run with
EDGESPEC_KERNELS=exact) an answer after a restore from disk, by a new model
in this process or in another process, equals the answer after a full
prefill, for a prompt shared whole, in part and after a cancelled request;
every kind of bad file, and a full or read-only folder, loses nothing.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edgespec.core import prompt_disk as pd
from edgespec.core.prefix_cache import common_prefix

from conftest import dev_prompts

ROOT = Path(__file__).resolve().parents[1]
KEY = "k" * 24
MAX_TOKENS = 16
SYSTEM = dev_prompts(136)[0]["turns"][0]           # ~300 tokens: an app's long system prompt
QUESTIONS = [r["turns"][0] for r in dev_prompts(108, 144, 152)]


def convo(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def toks(*runs) -> np.ndarray:
    """Tokens made of (start, length) runs of consecutive ids."""
    return np.concatenate([np.arange(a, a + n, dtype=np.int32) for a, n in runs])


def written(disk: pd.PromptDisk, tokens: np.ndarray, nbytes: int = 1000) -> np.ndarray:
    """Put a file of `tokens` with a state of nbytes recognisable bytes; wait for it."""
    state = (np.arange(nbytes) % 251).astype(np.uint8) ^ np.uint8(len(tokens) % 256)
    disk.put(tokens, state)
    assert disk.flush(30)
    return state


# ------------------------------------------------------------- the files
def test_block_hashes_chain_the_prefix():
    a, b = toks((0, 200)), toks((0, 150), (999, 50))
    ha, hb = pd.block_hashes(a), pd.block_hashes(b)
    assert len(ha) == 200 // pd.BLOCK and ha[:2] == hb[:2] and ha[2] != hb[2]
    # a block's hash names everything before it: the same block after another prefix differs
    assert pd.block_hashes(toks((5, 64), (0, 64)))[1] != pd.block_hashes(toks((0, 128)))[0]


def test_the_longest_shared_prefix_is_found(tmp_path):
    disk = pd.PromptDisk(KEY, 1 << 20, str(tmp_path / "prompts"))
    sys_a, sys_b = toks((0, 300), (5000, 100)), toks((0, 300), (7000, 400))
    state_a = written(disk, sys_a)
    written(disk, sys_b)
    e, n = disk.lookup(toks((0, 300), (7000, 130), (1, 9)), 10**6)     # shares 430 tokens with sys_b
    assert e is not None and n == 430 and np.array_equal(e.tokens, sys_b)
    e, n = disk.lookup(toks((0, 300), (9000, 200)), 10**6)             # only the system prompt: either
    assert e is not None and n == 300
    e, n = disk.lookup(toks((0, 300), (5000, 100), (1, 50)), 399)      # the limit caps the match
    assert n == 399 and np.array_equal(disk.load(e), state_a)
    assert disk.lookup(toks((1, 300)), 10**6) == (None, 0)            # nothing shared
    assert disk.lookup(toks((0, 63), (9, 100)), 10**6) == (None, 0)    # less than one whole block
    s = disk.stats()
    assert s["disk_entries"] == 2 and s["disk_hits"] == 1 and s["disk_misses"] == 2 and s["disk_written"] == 2
    disk.close()


def test_files_are_private_whole_and_superseded(tmp_path):
    folder = tmp_path / "prompts"
    disk = pd.PromptDisk(KEY, 1 << 20, str(folder))
    written(disk, toks((0, 200)))
    written(disk, toks((0, 200), (400, 100)))        # extends the first: the first goes
    names = os.listdir(folder)
    assert len(names) == 1 and names[0].startswith(KEY + "-") and names[0].endswith(pd.SUFFIX)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(folder / names[0]).st_mode) == 0o600
    assert disk.covers(toks((0, 150))) and disk.covers(toks((0, 200), (400, 100), (7, 40)))  # within a block
    assert not disk.covers(toks((0, 200), (9000, 100)))
    disk.close()


def test_the_budget_evicts_the_least_recently_used_file_of_any_key(tmp_path):
    folder = str(tmp_path / "prompts")
    other = pd.PromptDisk("o" * 24, 1 << 20, folder)
    written(other, toks((50_000, 100)))                      # another model's file, used long ago
    os.utime(os.path.join(folder, os.listdir(folder)[0]), (1, 1))
    size = os.path.getsize(os.path.join(folder, os.listdir(folder)[0]))
    disk = pd.PromptDisk(KEY, int(3.5 * size), folder)      # room for three files
    a, b, c, d = (toks((i * 1000, 100)) for i in range(4))
    for t in (a, b, c):
        written(disk, t)
    assert len(os.listdir(folder)) == 3 and disk.n_evicted == 1     # the other key's file went first
    for t, when in ((a, 2), (b, 3), (c, 4)):                 # (an mtime order without waiting for the clock)
        os.utime(disk.lookup(t, 100)[0].path, (when, when))
    assert disk.load(disk.lookup(a, 100)[0]) is not None     # a restore marks a as just used
    written(disk, d)
    assert disk.lookup(b, 100)[0] is None and disk.lookup(a, 100)[0] is not None
    assert disk.lookup(c, 100)[0] is not None and disk.n_evicted == 2
    assert sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)) <= disk.budget
    other.close()
    disk.close()


def test_two_disks_on_one_folder_see_each_others_files(tmp_path):
    folder = str(tmp_path / "prompts")
    one, two = pd.PromptDisk(KEY, 1 << 20, folder), pd.PromptDisk(KEY, 1 << 20, folder)
    assert two.lookup(toks((0, 128)), 128) == (None, 0)
    state = written(one, toks((0, 128)))
    e, n = two.lookup(toks((0, 128)), 128)
    assert n == 128 and np.array_equal(two.load(e), state)
    os.unlink(e.path)                                        # the other one evicted it: a miss, no warning
    assert two.lookup(toks((0, 128)), 128) == (None, 0)
    one.close()
    two.close()


WRITER = """
import sys
import numpy as np
from edgespec.core.prompt_disk import PromptDisk
folder, seed = sys.argv[1], int(sys.argv[2])
disk = PromptDisk("k" * 24, 60_000, folder)
for i in range(60):            # half the prefixes are the other process's too (same names), all share a head
    start = 1000 * (i % 30) + (0 if i % 2 else 10**6 * (seed + 1))
    t = np.concatenate([np.arange(64, dtype=np.int32), np.arange(start, start + 64 + i, dtype=np.int32)])
    disk.put(t, np.full(4000 + i, (i * 7 + seed) % 256, np.uint8))
    disk.flush()               # (a put while two wait is dropped)
    if i % 10 == 0:
        disk.lookup(t, len(t))
disk.close()
"""


def test_two_processes_write_one_folder_without_corruption(tmp_path):
    """Two processes writing, replacing the same names, looking up and
    evicting in one folder at once: every file left is whole and intact,
    no temporary file is left, the folder is within the budget (give or
    take the one file the other process wrote meanwhile)."""
    folder = str(tmp_path / "prompts")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), folder, str(seed)], env=env,
                              stderr=subprocess.PIPE, text=True) for seed in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    names = os.listdir(folder)
    assert names and all(n.endswith(pd.SUFFIX) for n in names)
    sizes = 0
    for n in names:
        e = pd.read_head(os.path.join(folder, n), KEY)
        assert pd.read_state(e).nbytes == e.state_bytes
        sizes += e.file_bytes
    assert sizes <= 60_000 + 5_000


def test_a_writer_that_is_behind_drops_new_files_not_memory(tmp_path, monkeypatch):
    import threading
    gate = threading.Event()
    real = pd.PromptDisk._write

    def slow(self, tokens, state):
        gate.wait(30)
        real(self, tokens, state)
    monkeypatch.setattr(pd.PromptDisk, "_write", slow)
    disk = pd.PromptDisk(KEY, 1 << 20, str(tmp_path / "prompts"))
    for i in range(pd.MAX_PENDING + 2):
        assert disk.busy == (i >= pd.MAX_PENDING)
        disk.put(toks((i * 1000, 128)), np.zeros(100, np.uint8))
    gate.set()
    assert disk.flush(30) and not disk.busy
    assert disk.n_written == pd.MAX_PENDING == len(os.listdir(tmp_path / "prompts"))
    disk.close()


def corrupt(path: str, how: str) -> None:
    """Damage a cache file the way a crash, a disk or a copy would."""
    data = bytearray(Path(path).read_bytes())
    if how == "truncated":
        data = data[:-10]
    elif how == "state":
        data[-5] ^= 0xFF
    elif how == "tokens":
        data[len(data) - 1000 - 7] ^= 0x01           # inside the tokens (the state is the last 1000 bytes)
    elif how == "foreign":
        data = data.replace(KEY.encode(), b"f" * 24, 1)
    Path(path).write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "state", "tokens", "foreign", "unreadable"])
def test_a_bad_file_is_skipped_with_one_warning(tmp_path, caplog, how):
    folder = str(tmp_path / "prompts")
    t = toks((0, 256))
    written(pd.PromptDisk(KEY, 1 << 20, folder), t)
    path = os.path.join(folder, os.listdir(folder)[0])
    if how == "unreadable":                      # (the tests may run as root, who reads a 0000 file)
        os.unlink(path)
        os.mkdir(path)
    else:
        corrupt(path, how)
    disk = pd.PromptDisk(KEY, 1 << 20, folder)
    with caplog.at_level(logging.WARNING, logger="edgespec.prompt_cache"):
        for _ in range(3):
            e, n = disk.lookup(t, 256)
            if e is not None:                    # a state found bad only when it is read
                assert disk.load(e) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "edgespec.prompt_cache"]
    assert len(lines) == 1 and "skipping" in lines[0] and "prefilled" in lines[0], lines
    assert disk.off is None and disk.lookup(t, 256) == (None, 0)
    # a damaged file of this key is deleted; another key's, or one that cannot be read, is left alone
    assert os.path.exists(path) == (how in ("foreign", "unreadable"))


def test_a_folder_that_cannot_be_made_turns_the_tier_off(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="edgespec.prompt_cache"):
        disk = pd.PromptDisk(KEY, 1 << 20, str(blocker / "prompts"))
        disk.put(toks((0, 128)), np.zeros(10, np.uint8))
        assert disk.flush(5) and disk.lookup(toks((0, 128)), 128) == (None, 0)
    assert disk.off is not None
    assert sum("is off" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_folder_turns_the_tier_off(tmp_path, caplog, monkeypatch, code):
    disk = pd.PromptDisk(KEY, 1 << 20, str(tmp_path / "prompts"))

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(pd.tempfile, "mkstemp", refuse)
    with caplog.at_level(logging.WARNING, logger="edgespec.prompt_cache"):
        disk.put(toks((0, 128)), np.zeros(10, np.uint8))
        assert disk.flush(30)
        disk.put(toks((0, 256)), np.zeros(10, np.uint8))     # off: not queued, no second warning
        assert disk.flush(30)
    lines = [r.getMessage() for r in caplog.records if r.name == "edgespec.prompt_cache"]
    assert len(lines) == 1 and "is off" in lines[0] and os.strerror(code) in lines[0]
    assert disk.off is not None and os.listdir(tmp_path / "prompts") == []
    disk.close()


# ------------------------------------------------------- with llama.cpp
@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """A cache directory of the test's own (its prompts/ is the disk tier's folder); the
    benchmark models stay where they are."""
    from edgespec.models.zoo import models_dir
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", models_dir())
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def restarted(path=None, **kw):
    """A model as a new process loads it: the disk tier on, the rest as the `model` fixture's."""
    from edgespec import SpecModel
    kw = {"drafter": "none", "n_ctx": 2048, "calibrate": False, "prompt_cache_disk_mib": 512, **kw}
    return SpecModel(path, **kw)


def fresh(model, prompt) -> list[int]:
    """The answer after a prefill of the whole prompt from an empty cache."""
    return model.generate(prompt, max_tokens=MAX_TOKENS, reuse_prefix=False).tokens


def check_restarts(path, ref) -> None:
    """Answers after restores from disk by new models equal those after a
    full prefill (by `ref`): a prompt shared whole, the next turn of a
    conversation (its answer's cells were decoded, not prefilled), a prompt
    shared in part (the system prompt), and one cut short by a cancel."""
    a, a2 = (ref.prompt_tokens(convo(q)) for q in QUESTIONS[:2])
    a3 = ref.prompt_tokens([{"role": "user", "content": QUESTIONS[2] + "\n\n" + SYSTEM}])   # its own file
    shared = common_prefix(a, a2, len(a2))
    assert shared > 200 and len(a3) - common_prefix(a, a3, len(a3)) > 2 * pd.BLOCK
    refs = {"a": fresh(ref, a), "a2": fresh(ref, a2), "a3": fresh(ref, a3)}
    turn = ref.prompt_tokens(convo(QUESTIONS[0]) + [{"role": "assistant", "content": ref.detokenize(refs["a"])},
                                                    {"role": "user", "content": "Say it again, shorter."}])
    refs["turn"] = fresh(ref, turn)
    with restarted(path) as m:
        assert m.generate(a, max_tokens=MAX_TOKENS).tokens == refs["a"]      # its cells go to a file
        answered = m.backend.kv_tokens.copy()       # what the file holds: a and the answer's decoded tokens
        with m.stream(a3, max_tokens=MAX_TOKENS) as s:                      # a cancelled request
            for i, _ in enumerate(s):
                if i == 3:
                    break
    expect = {"a": len(a) - 1, "turn": common_prefix(turn, answered, len(turn) - 1),
              "a2": max(common_prefix(a2, a, len(a2)), common_prefix(a2, a3, len(a2))), "a3": len(a3) - 1}
    assert expect["turn"] > len(a) and expect["a2"] == shared
    for prompt, name in ((a, "a"), (turn, "turn"), (a2, "a2"), (a3, "a3")):
        with restarted(path) as m:
            r = m.generate(prompt, max_tokens=MAX_TOKENS)
            assert r.tokens == refs[name], name
            assert m.prefix_cache.n_disk_restored == 1 and r.n_reused_tokens == expect[name], name


@pytest.fixture(scope="module")
def ref(model_path):
    """SmolLM2 without the disk tier: the answers after a full prefill."""
    with restarted(model_path, prompt_cache_disk_mib=0) as m:
        yield m


def test_an_answer_after_a_restore_from_disk_equals_a_full_prefill(ref, cache_home):
    check_restarts(None, ref)


@pytest.mark.matrix
def test_the_same_on_qwen(cache_home):
    """Another family: Qwen2.5-Coder-0.5B (another architecture, 151k tokens, grouped-query attention)."""
    from edgespec.models.zoo import ModelZooError, require_model
    try:
        path = require_model("qwen2.5-coder-0.5b")
    except ModelZooError as e:
        pytest.fail(f"the model-matrix tier was selected but {e}", pytrace=False)
    with restarted(path, prompt_cache_disk_mib=0) as ref:
        check_restarts(path, ref)


CHILD = """
import json, sys
from edgespec import SpecModel
with SpecModel(drafter="none", n_ctx=2048, calibrate=False, prompt_cache_disk_mib=512) as m:
    r = m.generate(json.loads(sys.argv[1]), max_tokens=int(sys.argv[2]))
print(json.dumps(r.tokens))
"""


def test_another_process_restores_what_one_wrote(ref, cache_home):
    """Two processes: the first answers and exits, the second finds the
    prompt's cells in its files and answers the same as a full prefill."""
    a = ref.prompt_tokens(convo(QUESTIONS[0]))
    env = dict(os.environ, PYTHONPATH=str(ROOT), EDGESPEC_CACHE_DIR=str(cache_home))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(a.tolist()), str(MAX_TOKENS)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    want = fresh(ref, a)
    assert eval(out.stdout.strip().splitlines()[-1]) == want
    assert len(os.listdir(cache_home / "prompts")) == 1
    with restarted() as m:
        r = m.generate(a, max_tokens=MAX_TOKENS)
        assert r.tokens == want and r.n_reused_tokens == len(a) - 1 and m.prefix_cache.n_disk_restored == 1


def other_k_type(model) -> str:
    return "f16" if model.backend.cache_type_k == "q8_0" else "q8_0"


@pytest.mark.parametrize("how", ["state", "refused"])
def test_a_bad_file_loses_nothing(ref, cache_home, caplog, how):
    """A corrupt file (found at the read) and one llama.cpp refuses (the
    cells of another K cache type under this key: as another build's would
    be): one warning line, the prompt is prefilled, the answer is right."""
    a = ref.prompt_tokens(convo(QUESTIONS[0]))
    want = fresh(ref, a)
    with restarted() as m:
        if how == "refused":
            with restarted(cache_type_k=other_k_type(m), prompt_cache_disk_mib=0) as o:
                o.generate(a, max_tokens=2)
                state, kept = o.backend.save_state(), o.backend.kv_tokens.copy()
            m.prefix_cache.disk.put(kept, state)
        else:
            m.generate(a, max_tokens=MAX_TOKENS)
        m.prefix_cache.disk.flush()
    if how == "state":
        folder = cache_home / "prompts"
        corrupt(str(folder / os.listdir(folder)[0]), "state")
    with caplog.at_level(logging.WARNING, logger="edgespec.prompt_cache"), restarted() as m:
        r = m.generate(a, max_tokens=MAX_TOKENS)
        assert r.tokens == want and r.n_reused_tokens == 0 and m.prefix_cache.n_disk_restored == 0
        again = m.generate(a, max_tokens=MAX_TOKENS)            # the live cache now; no second warning
        assert again.tokens == want
    lines = [r.getMessage() for r in caplog.records if r.name == "edgespec.prompt_cache"]
    assert len(lines) == 1 and "skipping" in lines[0], lines


def test_a_full_folder_serves_the_request(ref, cache_home, caplog, monkeypatch):
    a = ref.prompt_tokens(convo(QUESTIONS[0]))
    want = fresh(ref, a)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(pd.tempfile, "mkstemp", full)
    with caplog.at_level(logging.WARNING, logger="edgespec.prompt_cache"), restarted() as m:
        assert m.generate(a, max_tokens=MAX_TOKENS).tokens == want
        m.prefix_cache.disk.flush()
        assert m.prefix_cache.disk.off is not None
        assert m.generate(a, max_tokens=MAX_TOKENS).tokens == want
    lines = [r.getMessage() for r in caplog.records if r.name == "edgespec.prompt_cache"]
    assert len(lines) == 1 and "is off" in lines[0], lines


def test_the_cache_command_shows_and_clears_the_files(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from edgespec.app.cli import main
    monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "prompts"
    disk = pd.PromptDisk(KEY, 1 << 20)
    written(disk, toks((0, 128)))
    written(disk, toks((5000, 128)))
    disk.close()
    (folder / ".x.part").write_bytes(b"half a file")
    size = sum(os.path.getsize(folder / n) for n in os.listdir(folder) if n.endswith(pd.SUFFIX))
    out = CliRunner().invoke(main, ["cache", "stats"])
    assert out.exit_code == 0 and f"{folder}: 2 files, {size:,} bytes" in out.output, out.output
    assert f"{KEY}: 2 files" in out.output
    out = CliRunner().invoke(main, ["cache", "clear"])
    assert out.exit_code == 0 and "deleted 3 files" in out.output and os.listdir(folder) == []


def served(m, requests: list) -> tuple[list, str]:
    """The answers of a server of m to chat requests (messages, max_tokens), then its /metrics."""
    from starlette.testclient import TestClient

    from edgespec.app.request_fields import SERVE_DEFAULTS
    from edgespec.app.server import Server

    s = Server(m, model_id="smol", defaults=SERVE_DEFAULTS.but(drafter="none"))
    client = TestClient(s.app, base_url="http://127.0.0.1")
    try:
        out = [client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": n}).json()
               for msgs, n in requests]
        m.prefix_cache.disk.flush()
        return out, client.get("/metrics").text
    finally:
        s._worker.shutdown(wait=True)


def test_the_server_counts_the_disk_tier(ref, cache_home):
    """A server writes a file, a restarted one answers from it: timings.cache_n,
    and /metrics' disk counters (hits, misses, bytes read and written, evictions, files)."""
    pytest.importorskip("starlette")
    pytest.importorskip("prometheus_client")
    from prometheus_client.utils import floatToGoString     # how the exposition writes a value
    a, side = convo(QUESTIONS[0]), [{"role": "user", "content": "Name three colours."}]
    with restarted() as m:
        (r,), metrics = served(m, [(a, 4)])
    (name,) = os.listdir(cache_home / "prompts")
    size = os.path.getsize(cache_home / "prompts" / name)
    assert r["timings"]["cache_n"] == 0
    for line in ("edgespec_prompt_cache_disk_hits_total 0.0", "edgespec_prompt_cache_disk_misses_total 1.0",
                 f"edgespec_prompt_cache_disk_written_bytes_total {floatToGoString(size)}",
                 "edgespec_prompt_cache_disk_files 1.0", "edgespec_prompt_cache_disk_on 1.0"):
        assert line in metrics, [m for m in metrics.splitlines() if "disk" in m and not m.startswith("#")]
    with restarted() as m:
        (r, _), metrics = served(m, [(a, 4), (side, 4)])     # a from the file; the side request: a miss
    assert r["timings"]["cache_n"] == r["usage"]["prompt_tokens"] - 1
    for line in ("edgespec_prompt_cache_disk_hits_total 1.0", "edgespec_prompt_cache_disk_misses_total 1.0",
                 f"edgespec_prompt_cache_disk_read_bytes_total {floatToGoString(size)}",
                 "edgespec_prompt_cache_disk_written_bytes_total 0.0",     # the file holds a's answer already
                 "edgespec_prompt_cache_disk_evictions_total 0.0"):
        assert line in metrics, [m for m in metrics.splitlines() if "disk" in m and not m.startswith("#")]


def test_chat_load_resumes_without_prefilling_the_history(ref, cache_home, tmp_path, capsys):
    """`edgespec chat`'s session: /save, then in a new model /load and a new
    message: only the new message is prefilled, and the answer is the one a
    full prefill gives."""
    import re

    from edgespec.app.cli.chat_session import ChatSession
    from edgespec.core.verify import SamplingConfig

    saved = tmp_path / "conversation.json"

    def session(m, system=None) -> ChatSession:
        return ChatSession(m, max_tokens=MAX_TOKENS, sampling=SamplingConfig(), stop=(), system=system, color=False)
    with restarted() as m:
        s = session(m, SYSTEM)
        s.handle(QUESTIONS[0])
        s.handle(f"/save {saved}")
    assert "/load resumes without prefilling them" in capsys.readouterr().out
    with restarted() as m:
        s = session(m)
        s.handle(f"/load {saved}")
        s.handle("Say it again, shorter.")
        question = m.prompt_tokens(s.messages[:-3])        # the system message and the first question
        answer = s.messages[-1]["content"]
    line = re.search(r"prefill (\d+) new tokens in [\d.]+s \((\d+) reused\)", capsys.readouterr().out)
    new, reused = int(line.group(1)), int(line.group(2))
    # the question and the answer's cells came from the file; prefilled: the new message and the
    # template's tokens around it (and the answer's last token, which was never decoded)
    assert reused > len(question) and new < 24, (new, reused, len(question))
    full = ref.generate(s.messages[:-1], max_tokens=MAX_TOKENS, reuse_prefix=False)
    assert answer == full.text


def test_the_settings_turn_it_on_and_off(monkeypatch):
    from click.testing import CliRunner

    from edgespec import RunConfig
    from edgespec.app.cli import main
    from edgespec.errors import ConfigError
    from edgespec.run.settings import DISK_MIB, DISK_MIB_ENV

    assert RunConfig().prompt_cache_disk_mib == DISK_MIB == 2048
    monkeypatch.setenv(DISK_MIB_ENV, "64")
    assert RunConfig.defaults().prompt_cache_disk_mib == 64 and RunConfig(prompt_cache_disk_mib=None).prompt_cache_disk_mib == 64
    monkeypatch.setenv(DISK_MIB_ENV, "lots")
    with pytest.raises(ConfigError, match=DISK_MIB_ENV):
        RunConfig.defaults()
    with pytest.raises(ConfigError, match="prompt_cache_disk_mib"):
        RunConfig(prompt_cache_disk_mib=-1)
    monkeypatch.delenv(DISK_MIB_ENV)
    out = CliRunner().invoke(main, ["generate", "--prompt-cache-disk-mib", "5", "--no-prompt-cache-disk", "hi"])
    assert out.exit_code == 2 and "contradict" in out.output
    assert "--no-prompt-cache-disk" in CliRunner().invoke(main, ["serve", "--help"]).output


def test_the_key_is_the_backend_identity_and_keeps_format_1s_text(tmp_path):
    """cells_key hashes the backend's identity (backend/identity.py, which the
    calibration's key hashes too) with FORMAT, spelled as FORMAT 1's key was
    before the identity had a home of its own: files saved then stay valid."""
    import hashlib
    import platform
    from types import SimpleNamespace
    from edgespec.backend.identity import cpu_name, identity, model_fingerprint
    from edgespec.backend.process import llama_cpp_version, tiled_mm_setting
    from edgespec.calibration.cache import backend_key
    from edgespec.core.prompt_disk import cells_key
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 9)
    be = SimpleNamespace(model_path=str(f), cache_type_k="q8_0", flash_attn=None, exact=True, cpu_repack=False,
                         n_gpu_layers=0, rpc=["h:1"], tensor_split=[1.0, 3.0], n_threads=2, rpc_output="local")
    old = "|".join([f"model={model_fingerprint(str(f))}", f"llama.cpp={llama_cpp_version()}", "k=q8_0", "v=f16",
                    "fa=None", "exact=1", f"tiled_mm={tiled_mm_setting()}", "repack=0", "ngl=0", "rpc=h:1",
                    "split=1:3", platform.machine(), cpu_name(), "format=1"])
    assert cells_key(be) == hashlib.sha256(old.encode()).hexdigest()[:24]
    assert identity(be) + "|format=1" == old
    # the calibration's key: the same identity, with what changes only the time
    k = backend_key(be)
    assert backend_key(SimpleNamespace(**{**vars(be), "n_threads": 1})) != k
    assert backend_key(SimpleNamespace(**{**vars(be), "rpc_output": "remote"})) != k
    assert backend_key(SimpleNamespace(**{**vars(be), "flash_attn": False})) != k
    assert cells_key(SimpleNamespace(**{**vars(be), "n_threads": 1, "rpc_output": "remote"})) == cells_key(be)
