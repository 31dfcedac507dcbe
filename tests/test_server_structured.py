"""Structured output on every surface: response_format, json_schema and
grammar through a real `edgespec serve` (SmolLM2, the real openai client and
raw HTTP) and through the drop-in Llama.  Answers follow their schema or
grammar and equal the library's own constrained answer (greedy, lossless
under the constraint); every bad constraint is a 400 that names its field,
before the queue where it can be (types, sizes, conflicts, schema bounds,
the converter) and from the model thread where llama.cpp refuses the
grammar.  Generations are a few dozen tokens."""
from __future__ import annotations

import json

import pytest
from serving import request, running_server

pytestmark = pytest.mark.model

openai = pytest.importorskip("openai")

KEY = "structured-key-29"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                         "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de"]},
                                       "maxItems": 2}},
          "required": ["name", "age", "languages"]}
ASK = [{"role": "user", "content": "Describe a made-up person as JSON: name, age, languages."}]
YES_NO = 'root ::= " yes" | " no"'


def follows_person(d) -> bool:
    return (isinstance(d, dict) and set(d) == {"name", "age", "languages"} and isinstance(d["name"], str)
            and len(d["name"]) <= 16 and type(d["age"]) is int and isinstance(d["languages"], list)
            and len(d["languages"]) <= 2 and all(x in ("en", "fr", "de") for x in d["languages"]))


@pytest.fixture(scope="module")
def server(model):
    """(base url, model id); the session model first, so the calibration is cached."""
    with running_server("--ctx", "2048", "--api-key", KEY, "--max-tokens", "60") as (base, proc):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=600)
        yield base, client, client.models.list().data[0].id
        assert proc.poll() is None


def post(base: str, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    status, _, raw = request(base, "POST", path, body, headers={"Authorization": f"Bearer {KEY}"})
    return status, json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode()}


def test_json_schema_through_openai_follows_the_schema_and_equals_the_library(server, model):
    base, client, mid = server
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=mid, messages=ASK, response_format=fmt, max_tokens=60)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and follows_person(json.loads(text)), text
    lib = model.generate(ASK, max_tokens=60, json_schema=PERSON, drafter="none")
    assert text == lib.text                               # the same constrained greedy tokens
    chunks = client.chat.completions.create(model=mid, messages=ASK, response_format=fmt, max_tokens=60,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    # llama-server's shapes: json_object with a schema, and json_schema as a field of its own
    for extra in ({"response_format": {"type": "json_object", "schema": PERSON}}, {"json_schema": PERSON}):
        status, d = post(base, {"messages": ASK, "max_tokens": 60, **extra})
        assert status == 200 and d["choices"][0]["message"]["content"] == text, (extra, d)


def test_json_object_without_a_schema_is_any_object(server):
    _, client, mid = server
    r = client.chat.completions.create(model=mid, messages=[{"role": "user", "content": "List two colours."}],
                                       response_format={"type": "json_object"}, max_tokens=60)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_grammar_and_json_schema_through_completions(server, model):
    base, client, mid = server
    prompt = "Q: Is the sky blue?\nA:"
    c = client.completions.create(model=mid, prompt=prompt, max_tokens=5, extra_body={"grammar": YES_NO})
    assert c.choices[0].text in (" yes", " no") and c.choices[0].finish_reason == "stop"
    toks = model.tokenize(prompt, add_special=True, parse_special=True)
    assert c.choices[0].text == model.generate(toks, max_tokens=5, grammar=YES_NO, drafter="none").text
    s = client.completions.create(model=mid, prompt=prompt, max_tokens=5, stream=True, extra_body={"grammar": YES_NO})
    assert "".join(x.choices[0].text for x in s) == c.choices[0].text
    status, d = post(base, {"prompt": "A person as JSON:", "max_tokens": 60, "json_schema": PERSON}, "/v1/completions")
    assert status == 200 and follows_person(json.loads(d["choices"][0]["text"])), d


BAD = [   # (endpoint, body, param, code)
    ("chat", {"grammar": "root ::= foo"}, "grammar", "invalid_value"),               # llama.cpp refuses it
    ("chat", {"grammar": "root ::= foo", "stream": True}, "grammar", "invalid_value"),   # a 400 before the stream
    ("text", {"grammar": 'root ::= "a" bar'}, "grammar", "invalid_value"),
    ("chat", {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "json_schema",
     "invalid_value"),                                                              # the converter refuses it
    ("chat", {"response_format": {"type": "json_object", "schema": {"$ref": "#/nope"}}}, "response_format",
     "invalid_value"),
    ("chat", {"response_format": {"type": "json_object"}, "grammar": YES_NO}, "grammar", "invalid_value"),
    ("text", {"json_schema": PERSON, "grammar": YES_NO}, "grammar", "invalid_value"),
    ("chat", {"response_format": {"type": "json_object"}, "json_schema": PERSON}, "json_schema", "invalid_value"),
    ("chat", {"grammar": 5}, "grammar", "invalid_type"),
    ("text", {"json_schema": "{}"}, "json_schema", "invalid_type"),
    ("chat", {"response_format": "json"}, "response_format", "invalid_type"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "invalid_value"),
    ("chat", {"response_format": {"type": "json_schema", "schema": PERSON}}, "response_format", "invalid_type"),
    ("chat", {"grammar": "root ::= " + "(" * 20000 + '"a"' + ")" * 20000}, "grammar", "invalid_value"),   # bounded
    ("chat", {"grammar": "root ::= " + "x " * 530_000}, "grammar", "invalid_value"),       # > 1 MiB
    ("chat", {"json_schema": {"type": "array", "minItems": 10**8}}, "json_schema", "invalid_value"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported"),   # no template
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tools",
     "unsupported"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ("text", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported"),
]


def test_bad_constraints_are_400s_that_name_the_field(server):
    base = server[0]
    for endpoint, body, param, code in BAD:
        full = {"messages": ASK, "max_tokens": 2, **body} if endpoint == "chat" else {"prompt": "x", "max_tokens": 2,
                                                                                    **body}
        status, d = post(base, full, "/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
        err = d.get("error") or {}
        assert (status, err.get("param"), err.get("code")) == (400, param, code), (str(body)[:80], status, d)
        assert "Traceback" not in err["message"] and "Error:" not in err["message"], err
    # tool_choice "none" leaves the tools out: SmolLM2 answers as text
    status, d = post(base, {"messages": ASK, "max_tokens": 2, "tool_choice": "none",
                            "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert status == 200 and d["choices"][0]["finish_reason"] == "length"
    with pytest.raises(openai.BadRequestError):        # the openai client sees a 400 too
        server[1].chat.completions.create(model=server[2], messages=ASK, max_tokens=2,
                                          response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                           "schema": {"type": "array", "maxItems": 10**6}}})


# ------------------------------------------------------------- the drop-in
@pytest.fixture(scope="module")
def llm(model):
    import edgespec
    m = edgespec.Llama(model.model_path, n_ctx=1024, verbose=False, calibrate=False, drafter="suffix")
    yield m
    m.close()


def test_drop_in_response_format_and_grammar(llm):
    from llama_cpp import LlamaGrammar
    out = llm.create_chat_completion(ASK, response_format={"type": "json_object", "schema": PERSON}, max_tokens=60,
                                     temperature=0)
    assert follows_person(json.loads(out["choices"][0]["message"]["content"]))
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chunks = list(llm.create_chat_completion(ASK, response_format=fmt, max_tokens=60, temperature=0, stream=True))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        out["choices"][0]["message"]["content"]
    r = llm.create_completion("Q: Is the sky blue?\nA:", max_tokens=5, temperature=0,
                              grammar=LlamaGrammar.from_string(YES_NO))
    assert r["choices"][0]["text"] in (" yes", " no")
    assert "".join(c["choices"][0]["text"] for c in llm("Q: Is the sky blue?\nA:", max_tokens=5, temperature=0,
                                                         grammar=YES_NO, stream=True)) == r["choices"][0]["text"]
    import edgespec
    for kw, match in (({"grammar": YES_NO, "response_format": {"type": "json_object"}}, "not both"),
                      ({"response_format": {"type": "yaml"}}, "response_format.type"),
                      ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "no tool support")):
        with pytest.raises(edgespec.ConfigError, match=match):
            llm.create_chat_completion(ASK, max_tokens=2, **kw)
    with pytest.raises(edgespec.ConfigError, match="the grammar cannot be used"):
        llm("x", max_tokens=2, grammar=LlamaGrammar.from_string("root ::= nothing"))
