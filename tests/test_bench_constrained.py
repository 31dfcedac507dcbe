"""The bench on constrained prompts (issue 29): prompt lines with a
`json_schema` or `grammar`, the answer checks, the report's `valid` column,
the JSON-extraction prompt set, and the constraint reaching each kind of
method.

Without a model: reading and refusing constraints, the JSON answer check on
hand-written answers, the report, and the llama-server request (its body, and
a request answered by a stand-in HTTP server replaying a recorded response).
With SmolLM2: the grammar answer check, a bench of none and suffix on two
prompts of the set (identical and valid answers), llama-cpp-python's prompt
lookup under a grammar, and, where a built llama-server exists, llama-server
under the same grammar."""
from __future__ import annotations

import http.server
import json
import os
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgespec.bench.answers import grammar_answer_error, json_answer_error, schema_error
from edgespec.bench.divergence import divergence, plain_logits_at
from edgespec.bench.prompts import BenchPrompt, Constraint, constraint_summary, load_prompts, prompt_constraint
from edgespec.bench.report import divergence_lines, format_report
from edgespec.bench.results import read_results
from edgespec.bench.runner import WARMUP_SCHEMA, _Methods, run_bench
from edgespec.bench import peer_server as S
from edgespec.app.cli import main
from edgespec.errors import BenchError, PeerError

ROOT = Path(__file__).resolve().parent.parent
JSON_SET = ROOT / "benchmarks" / "prompts" / "json_extraction.jsonl"
RECORDED = Path(__file__).resolve().parent / "data" / "llama_server_completion.json"
# two prompts of the set that SmolLM2 answers in full within 96 tokens (63 each)
SMALL = ("json-log-auth", "json-bug-api")
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "plan"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "plan": {"type": "string", "enum": ["free", "pro"]}, "active": {"type": "boolean"}}}


def write_prompts(tmp_path, *recs) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def line(**kw) -> dict:
    return dict({"question_id": 1, "category": "c", "turns": ["Extract it as JSON."]}, **kw)


# ------------------------------------------------------------------ prompts
def test_load_prompts_reads_constraints(tmp_path):
    path = write_prompts(tmp_path, line(question_id=1, json_schema=SCHEMA),
                         line(question_id=2, grammar='root ::= "yes" | "no"'), line(question_id=3))
    a, b, c = load_prompts(path)
    assert a.json_schema == SCHEMA and a.grammar is None and a.constrained
    assert b.grammar == 'root ::= "yes" | "no"' and b.json_schema is None and b.constrained
    assert c.json_schema is None and c.grammar is None and not c.constrained
    s = constraint_summary([a, b, c])
    assert (s["json_schema"], s["grammar"], s["n_prompts"]) == (1, 1, 3)
    assert constraint_summary([c]) is None


@pytest.mark.parametrize("rec, message", [
    (line(json_schema=SCHEMA, grammar='root ::= "a"'), "give `json_schema` or `grammar`, not both"),
    (line(json_schema=[SCHEMA]), "`json_schema` must be a JSON object (a JSON schema), not array"),
    (line(json_schema="{}"), "`json_schema` must be a JSON object (a JSON schema), not string"),
    (line(json_schema={"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}),
     "`json_schema` has '$ref' at $.a, which the bench's answer check does not check"),
    (line(json_schema={"type": "object", "required": "name", "properties": {"name": {"type": "string"}}}),
     "`json_schema` has 'required' that is not a list of names at $, which the bench's answer check does not check"),
    (line(json_schema={"type": "object", "properties": {"a": {"type": "strin"}}}),
     "the JSON schema cannot be turned into a grammar"),
    (line(grammar=""), "`grammar` must be a non-empty GBNF text"),
    (line(grammar=["root ::= x"]), "`grammar` must be a non-empty GBNF text"),
])
def test_load_prompts_refuses_bad_constraints(tmp_path, rec, message):
    """A bad constraint is a BenchError naming the file and line."""
    path = write_prompts(tmp_path, line(question_id=0), rec)
    with pytest.raises(BenchError) as e:
        load_prompts(path)
    assert str(e.value).startswith(f"{path}:2: {message}"), str(e.value)


def test_json_extraction_set():
    """24 or more JSON-extraction prompts, six of each kind of input, each
    asking for JSON, its input 300-1500 characters, its schema an object of
    3-10 required properties of the plain types (what the answer check and
    llama.cpp's converter both take)."""
    prompts = load_prompts(str(JSON_SET))
    assert len(prompts) >= 24 and len({p.question_id for p in prompts}) == len(prompts)
    cats = [p.category for p in prompts]
    assert {c: cats.count(c) for c in set(cats)} == {"email": 6, "invoice": 6, "log": 6, "bug_report": 6}
    kinds = set()
    for p in prompts:
        ask, _, text = p.turn.partition("\n\n")
        assert "JSON" in ask and 300 <= len(text) <= 1500, p.question_id
        s = p.json_schema
        assert s["type"] == "object" and 3 <= len(s["properties"]) <= 10, p.question_id
        assert sorted(s["required"]) == sorted(s["properties"]) and s["additionalProperties"] is False
        for sub in s["properties"].values():
            kinds.add("enum" if "enum" in sub else sub["type"])
    assert kinds == {"string", "integer", "number", "boolean", "enum", "array"}


# ------------------------------------------------------------------ answer checks
@pytest.mark.parametrize("answer, error", [
    ('{"name": "Ada", "age": 36, "tags": ["x"], "plan": "pro"}', None),
    ('  {"name": "Ada", "age": 36.0, "score": 7, "tags": [], "plan": "free", "active": false}\n', None),
    ('{"name": "Ada", "age": 36, "tags": ["x"], "plan": "pro"', "not JSON: Expecting ',' delimiter: line 1 column 56 (char 55)"),
    ("", "not JSON: Expecting value: line 1 column 1 (char 0)"),
    ('{"name": "Ada", "tags": [], "plan": "pro"}', "$: missing required key 'age'"),
    ('{"name": "Ada", "age": "36", "tags": [], "plan": "pro"}', "$.age: expected integer, got string"),
    ('{"name": "Ada", "age": 36.5, "tags": [], "plan": "pro"}', "$.age: expected integer, got number"),
    ('{"name": "Ada", "age": true, "tags": [], "plan": "pro"}', "$.age: expected integer, got boolean"),
    ('{"name": "Ada", "age": 36, "tags": [1], "plan": "pro"}', "$.tags[0]: expected string, got integer"),
    ('{"name": "Ada", "age": 36, "tags": [], "plan": "gold"}', '$.plan: "gold" is not one of ["free", "pro"]'),
    ('{"name": "Ada", "age": 36, "tags": [], "plan": "pro", "x": 1}', "$: key 'x' is not allowed"),
    ('[{"name": "Ada"}]', "$: expected object, got array"),
])
def test_json_answer_check(answer, error):
    assert json_answer_error(answer, SCHEMA) == error


def test_schema_check_bounds_and_subschemas():
    assert schema_error("abc", {"type": "string", "maxLength": 2}) == "$: 3 characters, more than maxLength 2"
    assert schema_error("ab-12", {"type": "string", "pattern": "^[a-z]+-[0-9]+$"}) is None
    assert schema_error(5, {"type": "integer", "minimum": 1, "exclusiveMaximum": 5}) == "$: 5 breaks exclusiveMaximum 5"
    assert schema_error([1, 2, 3], {"type": "array", "maxItems": 2}) == "$: 3 items, more than maxItems 2"
    either = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert schema_error(None, either) is None and "follows none of anyOf" in schema_error(3, either)
    assert schema_error(1, {"const": True}) == "$: 1 is not true"       # JSON's true is no 1
    assert schema_error({"a": 1}, {"type": "object"}) is None           # other keys allowed by default


# ------------------------------------------------------------------ report
def row(qid, method, valid, **kw):
    r = {"kind": "result", "question_id": qid, "category": "email", "method": method, "n_generated": 21,
         "decode_s": 1.0, "tokens": list(range(21)), "n_steps": 21, "mean_accepted": 1.0,
         "identical_to_none": None if method == "none" else True, "verify": "exact", "valid": valid}
    r.update(kw)
    return r


def valid_column(report: str) -> dict:
    """The `valid` cells of the report's `all` table, by method (columns are right-aligned)."""
    table = report.split("\nall (")[1].split("\n\n")[0].splitlines()[1:]
    assert "  identical  valid  " in table[0]
    end = table[0].index(" valid ") + len(" valid")
    return {ln.split()[0]: ln[:end].split()[-1] for ln in table[2:]}


def test_report_counts_valid_answers(tmp_path):
    """Per method, the answers of constrained prompts that follow the
    constraint (k/n), and a header line saying the prompts were constrained;
    a bench without constraints has neither."""
    head = {"kind": "header", "model": "m.gguf", "max_tokens": 96,
            "constrained": {"json_schema": 2, "grammar": 0, "n_prompts": 2}}
    rows = [row(1, "none", True), row(1, "suffix", True),
            row(2, "none", False, invalid_reason="not JSON"), row(2, "suffix", False), row(2, "llama-server", True)]
    out = format_report(rows, head)
    assert "constrained: 2 of 2 prompts (2 by a JSON schema); every method decodes under the same grammar" in out
    assert valid_column(out) == {"none": "1/2", "suffix": "1/2", "llama-server": "1/1"}
    plain = [{k: v for k, v in r.items() if k != "valid"} for r in rows]
    out = format_report(plain, {"model": "m.gguf"})
    assert " valid " not in out and "constrained:" not in out
    # and from a results file, through bench-report
    res = tmp_path / "r.jsonl"
    res.write_text("".join(json.dumps(r) + "\n" for r in [head] + rows))
    r = CliRunner().invoke(main, ["bench-report", str(res)])
    assert r.exit_code == 0 and "constrained: 2 of 2 prompts" in r.output and " valid " in r.output, r.output


def test_divergence_the_grammar_rejects():
    """A divergence where the grammar rejects the method's token has no gap
    (-inf logit): the report says so instead of failing on it."""
    d = {"index": 3, "none_token": 5, "token": 9, "gap": None, "top2_gap": None, "reproduced": True}
    lines = divergence_lines([row(1, "none", True), row(1, "suffix", True, identical_to_none=False, divergence=d)],
                             {"exactness": {"max_abs_diff": 0.0}})
    assert "gap -, top-2 gap -: the grammar rejects the method's token there: look for a bug" in lines[-1]


# ------------------------------------------------------------------ llama-server requests
def test_llama_server_request_carries_the_constraint():
    body = S.completion_request([1, 2, 3], 16, grammar='root ::= "yes"')
    assert body["grammar"] == 'root ::= "yes"' and "json_schema" not in body and body["n_predict"] == 16
    body = S.completion_request([1, 2, 3], 16, json_schema=SCHEMA)
    assert body["json_schema"] == SCHEMA and "grammar" not in body
    assert not {"grammar", "json_schema"} & set(S.completion_request([1], 4))
    with pytest.raises(PeerError, match="not both"):
        S.completion_request([1], 4, grammar='root ::= "a"', json_schema=SCHEMA)


class _Recorder(http.server.BaseHTTPRequestHandler):
    """/completion of a stand-in llama-server: keeps the body, answers with a recorded response."""
    bodies: list = []
    answer: bytes = b""

    def do_POST(self):  # noqa: N802 - http.server's name
        type(self).bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(type(self).answer)

    def log_message(self, *args):
        pass


def test_llama_server_method_sends_the_prompts_gbnf():
    """The bench's llama-server method sends a constrained prompt's GBNF in
    the request's grammar field (the text edgespec decodes under), and none
    for a plain prompt: through _Methods.run and LlamaServerRunner.run to a
    stand-in server that replays a recorded llama-server response."""
    rec = json.loads(RECORDED.read_text())
    _Recorder.bodies, _Recorder.answer = [], json.dumps(rec["response"]).encode()
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        srv = S.LlamaServerRunner.__new__(S.LlamaServerRunner)       # no process: the stand-in answers
        srv.method, srv.port = "llama-server", httpd.server_address[1]
        methods = _Methods.__new__(_Methods)
        methods.peers = {"llama-server": srv}
        c = Constraint(SCHEMA, None, "root ::= \"{}\"")
        tokens = list(range(rec["n_prompt_tokens"]))
        r = methods.run("llama-server", "turn", tokens, 24, c)
        methods.run("llama-server", "turn", tokens, 24)
    finally:
        httpd.shutdown()
        httpd.server_close()
    constrained, plain = _Recorder.bodies
    assert constrained["grammar"] == c.gbnf and "json_schema" not in constrained
    assert constrained["prompt"] == tokens and constrained["n_predict"] == 24
    assert "grammar" not in plain and "json_schema" not in plain
    assert r["text"] == rec["response"]["content"]


# ------------------------------------------------------------------ with SmolLM2
def test_grammar_answer_check(model):
    """A GBNF prompt's answers are checked by llama.cpp's grammar engine: the
    whole text accepted, a token it rejects, an answer cut short."""
    g = 'root ::= "The answer is " ("yes" | "no") "."'
    assert grammar_answer_error(model.vocab, g, "The answer is no.") is None
    assert grammar_answer_error(model.vocab, g, "The answer is maybe.").startswith("the grammar rejects")
    assert grammar_answer_error(model.vocab, g, "The answer is") == "the answer stops before the grammar's end"
    with pytest.raises(BenchError, match="prompt 7 \\(c\\): the grammar cannot be used"):
        prompt_constraint(model.vocab, BenchPrompt(7, "c", "x", grammar="root ::= undefined-rule"))


def test_divergence_under_a_grammar(model):
    """A divergence under a grammar is measured among the tokens it admits:
    none's constrained choice is the re-decoded argmax there (it need not be
    the model's unconstrained one), and a token the grammar rejects has no gap."""
    toks = model.prompt_tokens("Say hello.")
    gbnf = prompt_constraint(model.vocab, BenchPrompt(1, "c", "x", WARMUP_SCHEMA)).gbnf
    ref = model.generate(toks, max_tokens=8, drafter="none", json_schema=WARMUP_SCHEMA).tokens
    plain = plain_logits_at(model, toks, [])
    assert int(plain.argmax()) != ref[0]            # the grammar chose "{" over the model's own pick
    rejected = int(plain.argmax())
    d = divergence(model, toks, ref, [rejected] + ref[1:], gbnf=gbnf)
    assert d["index"] == 0 and d["reproduced"] and d["gap"] is None
    assert divergence(model, toks, ref, [rejected] + ref[1:])["reproduced"] is False    # without the grammar
    d = divergence(model, toks, ref, ref[:3], gbnf=gbnf)       # ends where the grammar wants more
    assert d["index"] == 3 and d["token"] is None and d["gap"] is None and d["reproduced"]


def small_prompts():
    return [p for p in load_prompts(str(JSON_SET)) if p.question_id in SMALL]


def test_bench_on_json_prompts(model, tmp_path):
    """none and suffix on two prompts of the set under their schemas: the
    same tokens, every answer valid, the header and report saying so."""
    out = tmp_path / "r.jsonl"
    head, rows = run_bench(model, small_prompts(), ["none", "suffix"], max_tokens=96, out_path=str(out))
    assert head["constrained"]["json_schema"] == 2 and head["constrained"]["grammar"] == 0
    res = [r for r in rows if r["kind"] == "result"]
    assert len(res) == 4
    for r in res:
        assert r["valid"] is True and "invalid_reason" not in r, (r["method"], r["text"])
        assert r["stop_reason"] == "stop" and r["text"].lstrip().startswith("{")
        if r["method"] == "suffix":
            assert r["identical_to_none"] is True
    report = format_report(rows, head)
    assert "constrained: 2 of 2 prompts (2 by a JSON schema)" in report
    assert valid_column(report) == {"none": "2/2", "suffix": "2/2"}
    saved_head, saved = read_results(str(out))
    assert saved_head["constrained"] == head["constrained"] and all(r["valid"] for r in saved if r["kind"] == "result")


def test_prompt_lookup_follows_a_grammar(model):
    """llama-cpp-python with its prompt-lookup draft model (in its own
    process) runs the prompt's grammar: none's text, a valid answer."""
    p = small_prompts()[:1]
    head, rows = run_bench(model, p, ["none", "llama-cpp-python-pld@t1"], max_tokens=96)
    r = next(r for r in rows if r["method"] == "llama-cpp-python-pld@t1")
    assert r["valid"] is True and r["identical_to_none"] is True, r["text"]


@pytest.mark.model
def test_llama_server_follows_the_grammar(server_binary):
    """llama-server, plain and with ngram-simple speculation, under the
    GBNF edgespec decodes with: none's tokens, valid answers.  (On an f16 K
    cache, llama-server's default: see tests/test_peers.py.)"""
    from edgespec import SpecModel
    with SpecModel(drafter="none", n_ctx=2048, cache_type_k="f16", calibrate=False) as m:
        head, rows = run_bench(m, small_prompts(), ["none", "llama-server", "llama-server-ngram-simple"],
                               max_tokens=96)
    res = [r for r in rows if r["kind"] == "result"]
    assert len(res) == 6
    for r in res:
        assert r["valid"] is True, (r["method"], r["question_id"], r["text"])
        if r["method"] != "none":
            assert r["identical_to_none"] is True, (r["method"], r["question_id"], r["text"])


def test_set_documented():
    text = (ROOT / "benchmarks" / "prompts" / "README.md").read_text(encoding="utf-8")
    assert "json_extraction.jsonl" in text
    assert os.path.basename(JSON_SET) in (ROOT / "docs" / "bench.md").read_text(encoding="utf-8")
