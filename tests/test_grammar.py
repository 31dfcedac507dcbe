"""Grammar-constrained generation (edgespec.backend.grammar, Engine._pick):
every committed token, accepted drafts included, is the model's choice under
the grammar, so each drafter's greedy output equals constrained plain decoding
(`none` with the same grammar), and answers follow their schema."""
import json

import numpy as np
import pytest

from edgespec.backend.grammar import Grammar, _forced_choice, gbnf_for
from edgespec.drafters import Drafter
from edgespec.core.config import EngineConfig
from edgespec.core.engine import Engine, drain
from edgespec.errors import ConfigError
from edgespec.core.verify import SamplingConfig
from edgespec.core.params import Request

from conftest import OracleDrafter

PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
ITEMS = {"type": "object",
         "properties": {"items": {"type": "array", "items": {
             "type": "object", "properties": {"item": {"type": "string"}, "qty": {"type": "integer"}},
             "required": ["item", "qty"]}}},
         "required": ["items"]}
TASKS = [
    ("Extract the person as JSON with name, age and city: Maria Lopez is 34 and lives in Valencia, "
     "where she works as a nurse.", PERSON),
    ("Extract the order lines as JSON: 3 apples, 2 loaves of bread and 12 eggs.", ITEMS),
    ("Return the person as JSON: name John Smith, age 51, city Leeds.", PERSON),
]
YES_NO = 'root ::= ("yes" | "no") "."\n'


class Silent(Drafter):
    """Proposes nothing, but is not plain decoding: forced text is drafted."""
    name = "silent"


def follows(value, schema) -> bool:
    """A small checker for the schemas above (object, array, string, integer)."""
    t = schema["type"]
    if t == "object":
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", ()))
                and all(follows(value[k], s) for k, s in schema["properties"].items() if k in value))
    if t == "array":
        return isinstance(value, list) and all(follows(v, schema["items"]) for v in value)
    if t == "string":
        return isinstance(value, str)
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    raise AssertionError(t)


# ------------------------------------------------------------------ no model
def test_gbnf_for_requests():
    assert gbnf_for() is None
    assert gbnf_for(grammar=YES_NO) == YES_NO
    assert "root" in gbnf_for(json_schema=PERSON) and '"name"' in gbnf_for(json_schema=PERSON).replace('\\"', '"')
    assert gbnf_for(json_schema=json.dumps(PERSON)) == gbnf_for(json_schema=PERSON)
    assert "object" in gbnf_for(json_schema={})           # any JSON object
    # JSON strings hold no raw control characters
    assert r'char ::= [^"\\\x7F\x00-\x1F]' in gbnf_for(json_schema=PERSON)
    for bad in [dict(grammar=YES_NO, json_schema=PERSON), dict(grammar=""), dict(grammar=3),
                dict(json_schema="{not json"), dict(json_schema=[1, 2]), dict(grammar="x" * (1 << 21))]:
        with pytest.raises(ConfigError):
            gbnf_for(**bad)


def test_forced_choice_rules():
    assert _forced_choice(["{"], "", "") == "{"
    assert _forced_choice([], "{", "{") is None
    assert _forced_choice(['"', "a", "b"], "{", "") is None
    assert _forced_choice([" ", '"'], "", "") == " "              # no habit yet: a space
    assert _forced_choice([" ", '"'], ",", '{"a": 1,"b"') == '"'    # the answer wrote ',"' before
    assert _forced_choice([" ", '"'], ",", '{"a": 1, "b"') == " "
    assert _forced_choice([" ", '"'], ":", '{"a":1') == '"'


# ---------------------------------------------------------------- the model
def test_forced_text_of_hand_made_grammars(model):
    cases = [(r'root ::= "{\"key\": " [0-9]+ "}"', "", '{"key": '),
             ('root ::= "[" space "1" space "]"\nspace ::= " "?', "", "[ 1 ]"),
             ('root ::= "[" space "1" space "]"\nspace ::= " "?', "x [1]", "[1]"),
             ('root ::= "The answer is: " ("yes" | "no") "."', "", "The answer is: "),
             (YES_NO, "", "")]
    for gbnf, history, want in cases:
        g = Grammar(model.vocab, gbnf)
        try:
            assert g.forced_text(history) == want, (gbnf, history)
            assert g.n_accepted == 0          # probing never moves the request's own state
            assert g.forced_text(history) == want
        finally:
            g.close()


def test_forced_text_is_drafted_and_accepted(model):
    """A grammar that forces a sentence: with forced drafts the engine commits
    exactly what it commits without them, in far fewer steps, the forced
    tokens as accepted drafts from the grammar source."""
    gbnf = 'root ::= "The answer to the question you asked is: " ("yes" | "no") "."'
    toks = model.prompt_tokens("Is water wet?")
    runs = {}
    for drafter, forced in ((Drafter(), True), (Silent(), False), (Silent(), True)):
        eng = Engine(model.backend, drafter, model.cost, EngineConfig(cost_gate=False, forced_drafts=forced))
        g = Grammar(model.vocab, gbnf)
        try:
            runs[drafter.name, forced] = drain(eng.run(eng.resolve(Request(toks, max_tokens=32, grammar=g, reuse_prefix=False))))
        finally:
            g.close()
    plain, off, fast = runs["none", True], runs["silent", False], runs["silent", True]
    assert fast.tokens == plain.tokens == off.tokens
    assert plain.text.startswith("The answer to the question you asked is: ")
    for r in (plain, off):             # `none` stays plain decoding under a grammar
        assert r.n_draft_nodes == 0 and r.n_forced == 0 and r.constrained
    assert fast.n_forced >= 1 and fast.n_draft_accepted >= 5 and fast.n_steps <= plain.n_steps - 5
    rows = {r["source"]: r for r in eng.acceptance.report()}
    assert rows["grammar"]["tested"] >= 5



def test_grammar_object_admits_what_the_grammar_says(model):
    vocab = model.vocab
    g = Grammar(vocab, YES_NO)
    try:
        allowed = g.allowed()
        texts = {vocab.piece(int(t)).decode("utf-8", "replace") for t in allowed}
        assert texts and all(("yes".startswith(s) or "no".startswith(s) or s in ("yes.", "no.")) for s in texts), texts
        yes = vocab.tokenize("yes", add_special=False)
        assert len(yes) == 1 and g.allows(int(yes[0]))
        assert not g.allows(int(vocab.tokenize(" maybe", add_special=False)[0]))
        row = np.zeros(vocab.n_vocab, np.float32)
        row[int(vocab.tokenize(" maybe", add_special=False)[0])] = 10.0     # the model's favourite, rejected
        row[int(yes[0])] = 1.0
        assert g.argmax(row) == int(yes[0])
        masked = g.mask(row)
        assert np.isfinite(masked).sum() == len(allowed)
        g.accept(int(yes[0]))
        dot = int(vocab.tokenize(".", add_special=False)[0])
        assert g.allows(dot) and not g.allows(int(yes[0]))
        g.accept(dot)
        # complete: only end-of-generation tokens are left
        left = g.allowed()
        assert len(left) and all(vocab.is_eog(int(t)) for t in left)
    finally:
        g.close()


def test_constrained_argmax_is_the_masked_rows_argmax(model):
    """Grammar.argmax checks the likeliest tokens (above thresholds) before
    masking the whole row: at every state along a JSON answer, for rows with
    distinct logits, with many ties, with the 64 likeliest tokens rejected and
    with 5000 rejected ones above the rest, it picks what the masked row's
    argmax picks."""
    vocab = model.vocab
    g = Grammar(vocab, gbnf_for(json_schema=PERSON))
    rng = np.random.default_rng(7)
    text = '{"name": "Maria Lopez", "age": 34, "city": "Valencia"}'
    try:
        for tok in vocab.tokenize(text, add_special=False)[:12]:
            rejected = np.flatnonzero(~np.isfinite(g.mask(np.zeros(vocab.n_vocab, np.float32))))
            rows = [rng.normal(size=vocab.n_vocab).astype(np.float32),
                    np.round(rng.normal(size=vocab.n_vocab)).astype(np.float32)]    # thousands of ties
            shut = rng.normal(size=vocab.n_vocab).astype(np.float32)
            shut[rng.choice(rejected, 64, replace=False)] = 50.0     # the 64 likeliest all rejected
            rows.append(shut)
            wide = rng.normal(size=vocab.n_vocab).astype(np.float32)
            wide[rng.choice(rejected, min(5000, len(rejected)), replace=False)] += 10.0     # past every threshold
            rows.append(wide)
            rows.append(np.round(wide))     # ties among the rejected and at the admitted top
            for row in rows:
                assert g.argmax(row) == int(g.mask(row).argmax())
            assert g.allows(int(tok))
            g.accept(int(tok))
    finally:
        g.close()


def test_bad_grammar_is_a_clear_error(model):
    with pytest.raises(ConfigError, match="grammar cannot be used"):
        model.generate("hi", max_tokens=4, grammar='root ::= "a" | (')
    with pytest.raises(ConfigError, match="grammar cannot be used"):
        model.generate("hi", max_tokens=4, grammar='start ::= "a"')     # no root rule
    with pytest.raises(ConfigError):
        model.generate("hi", max_tokens=4, grammar=YES_NO, json_schema=PERSON)
    # the model is still usable
    assert model.generate("hi", max_tokens=4, grammar=YES_NO).text in ("yes.", "no.")


@pytest.mark.parametrize("drafter,n_tasks", [("suffix", 3), ("auto", 3), ("trigram", 1), ("adjacency", 1)])
def test_constrained_answers_identical_to_constrained_none_and_valid(model, drafter, n_tasks):
    """Cost gate off (every proposed node verified, drafts the grammar rejects
    among them): each drafter commits exactly what constrained plain decoding
    commits, and the answers parse and follow their schema."""
    eng = model.engine_for(drafter)
    eng.config.cost_gate = False
    drafted = accepted = 0
    try:
        for prompt, schema in TASKS[:n_tasks]:
            ref = model.generate(prompt, max_tokens=96, drafter="none", json_schema=schema)
            r = model.generate(prompt, max_tokens=96, drafter=drafter, json_schema=schema)
            assert r.tokens == ref.tokens, (drafter, prompt, r.text, ref.text)
            if ref.stop_reason == "stop":
                assert follows(json.loads(r.text), schema), r.text
            drafted += r.n_draft_nodes
            accepted += r.n_draft_accepted
    finally:
        eng.config.cost_gate = True
    assert drafted > 0, drafter
    if drafter in ("suffix", "auto"):
        assert accepted > 5, (drafter, drafted, accepted)


def test_constraint_changes_the_answer_and_every_token_is_admitted(model):
    prompt = "Is the sky green? Answer in one word."
    free = model.generate(prompt, max_tokens=16, drafter="none")
    r = model.generate(prompt, max_tokens=16, drafter="suffix", grammar=YES_NO)
    assert r.text in ("yes.", "no.") and r.stop_reason == "stop" and r.text != free.text
    # replayed through a fresh grammar, every committed token was admitted
    prompt2, schema = TASKS[0]
    r2 = model.generate(prompt2, max_tokens=96, drafter="suffix", json_schema=schema)
    g = Grammar(model.vocab, gbnf_for(json_schema=schema))
    try:
        for t in r2.tokens:
            assert g.allows(t), (t, model.vocab.piece(t))
            g.accept(t)
    finally:
        g.close()


def test_oracle_trees_under_a_grammar(model):
    """Forced tree shapes built around the constrained answer (wrong siblings,
    the right token ranked last, all-wrong trees) commit exactly it."""
    prompt, schema = TASKS[1]
    toks = model.prompt_tokens(prompt)
    gbnf = gbnf_for(json_schema=schema)
    ref = model.generate(toks, max_tokens=64, drafter="none", grammar=gbnf)
    for k, shape in enumerate(("chain", "fan", "max", "wrong", "ranked")):
        d = OracleDrafter(len(toks), ref.tokens, shape, model.vocab.n_vocab, seed=k)
        eng = Engine(model.backend, d, model.cost, EngineConfig(max_nodes=32, cost_gate=False, forced_drafts=False))
        g = Grammar(model.vocab, gbnf)
        try:
            r = drain(eng.run(eng.resolve(Request(toks, max_tokens=64, grammar=g, reuse_prefix=False))))
        finally:
            g.close()
        assert r.tokens == ref.tokens, shape
        if shape == "chain":
            assert r.mean_accepted > 2.0
        if shape == "wrong":
            assert r.n_draft_accepted == 0 and r.n_draft_nodes > 0


def test_sampling_under_a_grammar_stays_inside_it(model):
    s = SamplingConfig(temperature=1.0, seed=7)
    for drafter in ("none", "suffix"):
        r = model.generate("Say something.", max_tokens=8, sampling=s, drafter=drafter, grammar=YES_NO)
        assert r.text in ("yes.", "no."), r.text
    a = model.generate(TASKS[0][0], max_tokens=64, sampling=s, drafter="none", json_schema=PERSON)
    b = model.generate(TASKS[0][0], max_tokens=64, sampling=s, drafter="none", json_schema=PERSON)
    assert a.tokens == b.tokens       # same seed, same draw
    if a.stop_reason == "stop":
        assert follows(json.loads(a.text), PERSON)


def test_relaxed_verification_refuses_a_grammar(model):
    with pytest.raises(ConfigError, match="grammar"):
        model.generate("hi", max_tokens=4, drafter="auto@relaxed", grammar=YES_NO)


# ------------------------------------------------------------------ the CLI
def test_generate_with_grammar_and_schema_files(model_path, tmp_path):
    from test_cli import assert_clean_error, gen_json, invoke
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    grammar = tmp_path / "yesno.gbnf"
    grammar.write_text(YES_NO)
    d = gen_json("--json-schema", str(schema), "--max-tokens", "64", TASKS[0][0])
    assert d["constrained"] and d["stop_reason"] == "stop" and follows(json.loads(d["text"]), PERSON), d["text"]
    none = gen_json("--json-schema", str(schema), "--max-tokens", "64", "--drafter", "none", TASKS[0][0])
    assert none["tokens"] == d["tokens"]
    assert gen_json("--grammar", str(grammar), "--max-tokens", "8", "Is it raining?")["text"] in ("yes.", "no.")
    r = invoke(["generate", "--grammar", str(grammar), "--stats", "--max-tokens", "8", "Is it raining?"])
    assert r.exit_code == 0 and "constrained by a grammar" in r.stderr
    bad = tmp_path / "bad.gbnf"
    bad.write_text('root ::= "a" | (')
    assert_clean_error(invoke(["generate", "--grammar", str(bad), "hi"]), "grammar cannot be used")
    notjson = tmp_path / "bad.json"
    notjson.write_text("{nope")
    assert_clean_error(invoke(["generate", "--json-schema", str(notjson), "hi"]), "not JSON")
    assert_clean_error(invoke(["generate", "--json-schema", str(tmp_path / "missing.json"), "hi"]), "cannot read")
    r = invoke(["generate", "--grammar", str(grammar), "--json-schema", str(schema), "hi"])
    assert r.exit_code != 0 and "not both" in r.output + r.stderr


def test_json_strings_refuse_control_characters(model):
    vocab = model.vocab
    g = Grammar(vocab, gbnf_for(json_schema=PERSON))
    try:
        for t in vocab.tokenize('{ "name": "Ann', add_special=False):
            g.accept(int(t))
        newline = int(vocab.tokenize("\n", add_special=False)[0])
        assert not g.allows(newline) and g.allows(int(vocab.tokenize(" Lee", add_special=False)[0]))
    finally:
        g.close()
