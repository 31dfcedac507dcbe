"""The model-matrix tier: exactness and identity on every model family edgespec
is benchmarked with (SmolLM2-135M Q4_1, llama; Gemma-3-270M Q4_K_M, gemma3, a
base model run with raw prompts; Qwen2.5-Coder-0.5B Q4_K_M, qwen2, ChatML),
with the default settings (threads, K cache).

Selected with --matrix or EDGESPEC_MATRIX=1 (.ci/run sets it after fetching
the models with `edgespec get-models`); a model that is not there is then a
failure, not a skip.  Kept lean (about a minute a model on 2 idle cores): no
calibration (the gate is off, so every proposed node is verified: the hardest
case), short answers, one context past 512 cells.

SmolLM2 is the suite's session model, whose identity tests are the rest of the
suite's (with the same shapes and more prompts): every drafter with the gate
off (test_engine.py::test_suffix_drafter_identical_on_dev_prompts, 13 prompts
of 13 categories, and ::test_other_drafters_identical_on_dev_prompts), forced
trees off the first path (::test_forced_tree_shapes_identical_and_kv_exact),
contexts past 512 cells (the long summarization and rag prompts there, and
::test_q8_k_cache_is_exact_with_every_thread_past_512_cells) and the self-check
(test_models_exact.py).  Here it runs the family tests only (end token, bench),
and the identity tests run on the two other families (IDENTITY)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from edgespec import SpecModel
from edgespec.calibration.exactness import check_exactness
from edgespec.core.config import EngineConfig
from edgespec.core.engine import Engine, drain
from edgespec.models.zoo import MODELS, ModelZooError, require_model
from edgespec.core.params import Request

from conftest import OracleDrafter

pytestmark = [pytest.mark.model, pytest.mark.matrix]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EDITS = os.path.join(ROOT, "benchmarks", "prompts", "code_edits.jsonl")
MATRIX = ("smollm2", "gemma3-270m", "qwen2.5-coder-0.5b")
IDENTITY = ("gemma3-270m", "qwen2.5-coder-0.5b")      # SmolLM2's: see above
identity = pytest.mark.parametrize("zoo", IDENTITY, indirect=True)
MAX_TOKENS = 40


def edit_prompt(qid: str) -> str:
    with open(EDITS, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec["question_id"] == qid:
                return rec["turns"][0]
    raise KeyError(qid)


@pytest.fixture(scope="module", params=MATRIX)
def zoo(request):
    """(name, SpecModel) for each model of the matrix, loaded once, default
    threads and K cache, no calibration."""
    name = request.param
    try:
        path = require_model(name)
    except ModelZooError as e:
        pytest.fail(f"the model-matrix tier was selected but {e}", pytrace=False)
    m = SpecModel(path, drafter="none", n_ctx=2048, calibrate=False, cost_gate=False, max_nodes=32)
    yield name, m
    m.close()


def tokens_of(name: str, model: SpecModel, text: str) -> np.ndarray:
    """A chat turn for chat models; raw text for a base model (gemma3-270m)."""
    return model.prompt_tokens(text, raw=not MODELS[name].chat)


def prompts_for(name: str, model: SpecModel) -> list[np.ndarray]:
    """Two prompts whose answers copy from their input (drafts get accepted)."""
    if MODELS[name].chat:
        return [tokens_of(name, model, edit_prompt(q)) for q in ("edit-rename-py", "edit-loop-js")]
    # a base model continues text: code that repeats its own patterns
    code = edit_prompt("edit-rename-go").split("```go\n", 1)[1].split("```")[0]
    return [tokens_of(name, model, code[:900]), tokens_of(name, model, "Copy the list: " + code[:400] + "\nCopy:\n")]


_PLAIN: dict = {}   # plain decodings shared by the tests of a model


def plain(name: str, model: SpecModel, toks: np.ndarray):
    """`none`'s greedy answer to toks (MAX_TOKENS), decoded once per model and prompt."""
    key = (name, toks.tobytes())
    if key not in _PLAIN:
        _PLAIN[key] = model.generate(toks, max_tokens=MAX_TOKENS, drafter="none")
    return _PLAIN[key]


@identity
def test_batched_logits_bit_identical_to_one_token(zoo):
    """The self-check SpecModel runs at calibration: batches of every size up
    to 48 (the CPU limit) after 600 KV cells (past the 512-cell split-KV
    threshold) give exactly the logits of one-token decoding.  This failed for
    the K-quant models while llama.cpp's tiled K-quant matmul was on (T >= 8,
    |dlogit| up to 3.2)."""
    name, m = zoo
    r = check_exactness(m.backend, contexts=(600,))
    assert r.max_t == 48 and r.contexts == [600]
    assert r.exact, f"{name}: {r.describe()}"


@identity
@pytest.mark.parametrize("drafter", ["suffix", "trigram", "adjacency", "auto", "suffix@hold4"])
def test_every_drafter_identical_to_none(zoo, drafter):
    """Greedy output of every drafter, the gate off (every proposed node up to
    32 verified), is token-identical to plain decoding; drafts are verified.
    suffix@hold4: every step a batch of 4, padded with filler (EngineConfig.hold_width)."""
    name, m = zoo
    drafted = 0
    for toks in prompts_for(name, m):
        ref = plain(name, m, toks)
        r = m.generate(toks, max_tokens=MAX_TOKENS, drafter=drafter)
        assert r.tokens == ref.tokens, f"{name}/{drafter} diverged at token " \
            f"{next(i for i, (a, b) in enumerate(zip(r.tokens + [-1], ref.tokens + [-2])) if a != b)}"
        assert r.stop_reason == ref.stop_reason
        drafted += r.n_draft_nodes
    assert drafted > 0


INVOICE = {"type": "object", "required": ["vendor", "invoice_no", "total", "lines"],
           "properties": {"vendor": {"type": "string"}, "invoice_no": {"type": "string"}, "total": {"type": "number"},
                          "lines": {"type": "array", "items": {"type": "object", "required": ["item", "qty"],
                                    "properties": {"item": {"type": "string"}, "qty": {"type": "integer"}}}}}}
INVOICE_TEXT = ("Invoice INV-2291 from Northwind Traders: 4 x USB-C cable, 2 x desk lamp, 1 x monitor arm. "
                "Total due: 187.40 EUR.")


@identity
def test_json_schema_answers_identical_to_constrained_none(zoo):
    """Under a JSON schema, suffix and auto (the gate off, grammar-forced text
    drafted too) commit exactly what constrained plain decoding commits."""
    name, m = zoo
    text = ("Extract the invoice as JSON: " + INVOICE_TEXT if MODELS[name].chat
            else INVOICE_TEXT + "\nThe same invoice as JSON:\n")
    toks = tokens_of(name, m, text)
    ref = m.generate(toks, max_tokens=MAX_TOKENS + 24, drafter="none", json_schema=INVOICE)
    assert ref.constrained and ref.text.lstrip().startswith("{")
    for drafter in ("suffix", "auto"):
        r = m.generate(toks, max_tokens=MAX_TOKENS + 24, drafter=drafter, json_schema=INVOICE)
        assert r.tokens == ref.tokens, (name, drafter, r.text, ref.text)
        assert r.n_forced > 0 and r.n_draft_accepted > 0


@identity
@pytest.mark.parametrize("shape", ["fan", "max"])
def test_forced_trees_off_the_first_path(zoo, shape):
    """Trees whose right token is ranked last at every level (the accepted
    path is never first in batch order; `max` fills the budget): identical
    output, and the KV cache left behind gives bit-identical logits."""
    name, m = zoo
    be = m.backend
    toks = prompts_for(name, m)[0]
    ref = plain(name, m, toks)
    drafter = OracleDrafter(len(toks), ref.tokens, shape, be.n_vocab, width=4, depth=6, seed=1)
    eng = Engine(be, drafter, None, EngineConfig(max_nodes=32, cost_gate=False))
    res = drain(eng.run(eng.resolve(Request(toks, max_tokens=MAX_TOKENS, reuse_prefix=False))))
    assert res.tokens == ref.tokens
    assert res.n_carried > 0 and res.mean_accepted > 1.5
    # the cache: decode the last token again on top of what the run kept
    keep = len(toks) + len(res.tokens) - 1
    be.truncate(keep)
    one, zero = np.ones(1, np.int32), np.zeros(1, np.int32)
    be.decode_tree(np.array(res.tokens[-1:], np.int32), zero, zero, one, 1)
    spec_logits = be.logits()[0].copy()
    ref_logits = _plain_last_logits(m, toks, ref.tokens)
    assert np.array_equal(spec_logits, ref_logits)


def _plain_last_logits(m: SpecModel, prompt, tokens) -> np.ndarray:
    from edgespec.bench.divergence import plain_logits_at
    return plain_logits_at(m, prompt, tokens).astype(np.float32)


@identity
def test_long_context_past_512_cells(zoo):
    """A prompt of 600+ tokens: one-token decodes and batches both past the
    split-KV threshold, suffix drafting (gate off) identical to none."""
    name, m = zoo
    parts = [edit_prompt(q).split("```")[1].split("\n", 1)[1] for q in ("edit-bug-c", "edit-doc-java", "edit-rename-rs")]
    text = "\n\n".join(parts)
    if MODELS[name].chat:
        text = "Here are three files.\n\n" + text + "\n\nRepeat the last file exactly."
    else:
        # a base model continues text: stop in the middle of the last file
        text = text[:len(text) - len(parts[-1]) // 2]
    toks = tokens_of(name, m, text)
    assert 600 < len(toks) < 2048 - MAX_TOKENS
    ref = m.generate(toks, max_tokens=MAX_TOKENS, drafter="none")
    r = m.generate(toks, max_tokens=MAX_TOKENS, drafter="suffix")
    assert r.tokens == ref.tokens
    assert r.n_draft_accepted > 0


def test_answers_end_at_the_family_end_token(zoo):
    """Chat models: a short answer ends with the template's end-of-turn token
    (ChatML <|im_end|> for Qwen and SmolLM2): stop reason `stop`, no template
    token in the text, the same through chat() with a second turn.  The base
    model has no template: a chat prompt is a clear error, raw text works."""
    name, m = zoo
    if not MODELS[name].chat:
        with pytest.raises(ValueError, match="no chat template"):
            m.prompt_tokens("hello")
        r = m.generate("The capital of France is", raw=True, max_tokens=8, drafter="suffix")
        assert r.n_generated == 8 and r.text.strip()
        return
    msgs = [{"role": "user", "content": "Reply with the single word: yes"}]
    r = m.chat(msgs, max_tokens=48, drafter="suffix")
    assert r.stop_reason == "stop" and 0 < r.n_generated < 48, (r.text, r.stop_reason)
    assert "<|" not in r.text and "im_end" not in r.text
    msgs += [{"role": "assistant", "content": r.text}, {"role": "user", "content": "Now reply with the word: no"}]
    r2 = m.chat(msgs, max_tokens=48, drafter="suffix")
    assert r2.stop_reason == "stop" and "<|" not in r2.text and r2.n_reused_tokens > 0


def test_bench_runs_each_family(zoo, tmp_path):
    """The bench on each family (raw prompts for the base model): none and
    suffix identical, and no divergence records."""
    from edgespec.bench.prompts import BenchPrompt
    from edgespec.bench.runner import run_bench
    name, m = zoo
    raw = not MODELS[name].chat
    prompts = [BenchPrompt("p1", "edit", edit_prompt("edit-param-rs") if not raw else
                           "fn main() {\n    let xs = vec![1, 2, 3];\n    let ys = vec![1, 2, 3];\n")]
    head, rows = run_bench(m, prompts, ["none", "suffix"], max_tokens=24, raw=raw,
                           out_path=str(tmp_path / "r.jsonl"))
    assert head["raw"] is raw and head["exact"] == m.exact    # the self-check's verdict, if cached
    res = [r for r in rows if r["kind"] == "result"]
    assert [r["method"] for r in res] == ["none", "suffix"]
    assert res[1]["identical_to_none"] is True and "divergence" not in res[1]
    if not raw:
        assert "<|" not in res[0]["text"]


def test_base_model_without_raw_is_a_clear_error(tmp_path):
    """chat, generate and bench on a base model (no chat template) stop with
    one line that says so, before loading the model; --raw is the way."""
    from click.testing import CliRunner

    from edgespec.app.cli import main
    try:
        require_model("gemma3-270m")
    except ModelZooError as e:
        pytest.fail(f"the model-matrix tier was selected but {e}", pytrace=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["hello"]}) + "\n")
    for args, advice in ((["chat", "gemma3-270m"], "generate --raw"),
                         (["generate", "gemma3-270m", "hello"], "use --raw"),
                         (["bench", "gemma3-270m", "--prompts", str(prompts)], "use --raw")):
        r = CliRunner().invoke(main, args, input="hi\n")
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
        assert "has no chat template (a base or completion model)" in r.output and advice in r.output
        assert "measuring" not in r.output                 # refused before loading and calibrating
