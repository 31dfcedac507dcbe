"""Shared fixtures: the real SmolLM2 GGUF in the real llama.cpp, loaded once."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgespec import SpecModel
from edgespec.drafters.base import Drafter
from edgespec.tree import DraftTree

DEV_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_dev.jsonl"


def load_dev_prompts():
    with open(DEV_PROMPTS) as f:
        return [json.loads(line) for line in f if line.strip()]


def pick_prompts(n: int, seed: int = 0):
    """n dev prompts covering every category (round robin over categories)."""
    rows = load_dev_prompts()
    by_cat: dict = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r)
    rng = np.random.default_rng(seed)
    for v in by_cat.values():
        rng.shuffle(v)
    out, i = [], 0
    cats = sorted(by_cat)
    while len(out) < n:
        c = cats[i % len(cats)]
        k = i // len(cats)
        if k < len(by_cat[c]):
            out.append(by_cat[c][k])
        i += 1
    return out


@pytest.fixture(scope="session")
def model():
    m = SpecModel(drafter="none", n_ctx=2048)
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
                          "`python tools/get_models.py`); EDGESPEC_MATRIX=1 does the same")


def matrix_selected(config) -> bool:
    import os
    expr = config.getoption("-m") or ""
    return bool(config.getoption("--matrix") or os.environ.get("EDGESPEC_MATRIX") == "1"
                or ("matrix" in expr and "not matrix" not in expr))


def pytest_collection_modifyitems(config, items):
    """The matrix tier needs models fetched from PyPI (tools/get_models.py):
    it runs when selected (--matrix, EDGESPEC_MATRIX=1 as .ci/run sets it, or
    -m matrix), and then a missing model is a failure, not a skip.  Otherwise
    its tests are deselected, and the summary says so."""
    if matrix_selected(config):
        return
    keep = [i for i in items if i.get_closest_marker("matrix") is None]
    dropped = [i for i in items if i.get_closest_marker("matrix") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        config._matrix_deselected = len(dropped)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = getattr(config, "_matrix_deselected", 0)
    if n:
        terminalreporter.write_line(f"model-matrix tier: {n} tests not selected (fetch the models with "
                                    "`python tools/get_models.py`, then run with --matrix)")
