"""Answer checks of constrained prompts: whether an answer follows its JSON
schema or GBNF grammar, checked apart from the grammar that produced it.

A JSON schema is checked with a small validator of the keywords in
SCHEMA_CHECKED (JSON Schema's meaning of each; those the prompt sets use, and
no new dependency), a GBNF grammar by running the answer through llama.cpp's
grammar engine.  An answer cut off by max_tokens is invalid.
"""
from __future__ import annotations

import json

import numpy as np

SCHEMA_CHECKED = ("type", "enum", "const", "properties", "required", "additionalProperties", "items",
                  "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum",
                  "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf", "allOf")
SCHEMA_ANNOTATIONS = ("title", "description", "$schema", "$id", "$comment", "default", "examples", "format")
"""Keywords that constrain nothing the check looks at (JSON Schema treats `format` as an annotation too)."""
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf")


def json_type(value) -> str:
    """JSON's name for a parsed value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "integer" if isinstance(value, int) else "number"
    return {dict: "object", list: "array", str: "string"}.get(type(value), type(value).__name__)


def unchecked_keywords(schema, path: str = "$") -> list[str]:
    """What in a schema the answer check cannot check: keywords outside
    SCHEMA_CHECKED and SCHEMA_ANNOTATIONS, and subschemas of the wrong
    shape, each as "'KEYWORD' at PATH"; empty when it checks all of it."""
    if isinstance(schema, bool):
        return []
    if not isinstance(schema, dict):
        return [f"a {json_type(schema)} where a schema belongs at {path}"]
    out = [f"{k!r} at {path}" for k in schema if k not in SCHEMA_CHECKED and k not in SCHEMA_ANNOTATIONS]
    out += _shape_problems(schema, path)
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        return out + [f"'properties' that is not an object at {path}"]
    for k, sub in props.items():
        out += unchecked_keywords(sub, f"{path}.{k}")
    for k in ("items", "additionalProperties"):
        if k in schema:
            out += unchecked_keywords(schema[k], f"{path}.{k}")
    for k in _SUBSCHEMA_LISTS:
        subs = schema.get(k, [])
        if not isinstance(subs, list):
            out.append(f"{k!r} that is not a list at {path}")
            continue
        for i, sub in enumerate(subs):
            out += unchecked_keywords(sub, f"{path}.{k}[{i}]")
    return out


_COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _shape_problems(schema: dict, path: str) -> list[str]:
    """The checked keywords of one schema level whose values have a shape the
    check cannot read (a count that is no whole number, draft 4's boolean
    exclusiveMinimum, ...)."""
    def bad(key, ok):
        return key in schema and not ok(schema[key])

    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    def names(x):
        return isinstance(x, list) and all(isinstance(n, str) for n in x)

    out = [f"{k!r} that is not a whole number at {path}" for k in _COUNTS
           if bad(k, lambda x: number(x) and float(x).is_integer())]
    out += [f"{k!r} that is not a number at {path}" for k in _BOUND_KEYS if bad(k, number)]
    if bad("type", lambda x: isinstance(x, str) or names(x)):
        out.append(f"'type' that is not a name or a list of names at {path}")
    if bad("required", names):
        out.append(f"'required' that is not a list of names at {path}")
    if bad("enum", lambda x: isinstance(x, list)):
        out.append(f"'enum' that is not a list at {path}")
    if bad("pattern", lambda x: isinstance(x, str)):
        out.append(f"'pattern' that is not text at {path}")
    return out


def _is_type(value, kind: str) -> bool:
    """Whether a parsed JSON value is of a JSON Schema type (1.0 is an integer, true is no number)."""
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or \
            (isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return json_type(value) == kind


def _same(a, b) -> bool:
    """JSON equality (enum, const): 1 == 1.0, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def schema_error(value, schema, path: str = "$") -> str | None:
    """The first way a parsed JSON value breaks a schema (the SCHEMA_CHECKED
    keywords, with JSON Schema's meaning), as "PATH: what"; None when it
    follows it."""
    if schema is True or schema == {}:
        return None
    if schema is False:
        return f"{path}: no value is allowed here"
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_is_type(value, k) for k in kinds):
            return f"{path}: expected {' or '.join(kinds)}, got {json_type(value)}"
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        return f"{path}: {_short(value)} is not one of {_short(schema['enum'])}"
    if "const" in schema and not _same(value, schema["const"]):
        return f"{path}: {_short(value)} is not {_short(schema['const'])}"
    if isinstance(value, dict):
        err = _object_error(value, schema, path)
    elif isinstance(value, list):
        err = _array_error(value, schema, path)
    else:
        err = _scalar_error(value, schema, path)
    return err or _subschemas_error(value, schema, path)


def _object_error(value: dict, schema: dict, path: str) -> str | None:
    props = schema.get("properties", {})
    for k in schema.get("required", ()):
        if k not in value:
            return f"{path}: missing required key {k!r}"
    extra = schema.get("additionalProperties", True)     # JSON Schema's default: any other key is allowed
    for k, v in value.items():
        sub = props.get(k, extra)
        if sub is False:
            return f"{path}: key {k!r} is not allowed"
        err = schema_error(v, sub, f"{path}.{k}")
        if err:
            return err
    return None


def _array_error(value: list, schema: dict, path: str) -> str | None:
    if "minItems" in schema and len(value) < schema["minItems"]:
        return f"{path}: {len(value)} items, fewer than minItems {schema['minItems']}"
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        return f"{path}: {len(value)} items, more than maxItems {schema['maxItems']}"
    for i, v in enumerate(value):
        err = schema_error(v, schema.get("items", True), f"{path}[{i}]")
        if err:
            return err
    return None


_BOUNDS = (("minimum", lambda v, b: v >= b), ("maximum", lambda v, b: v <= b),
           ("exclusiveMinimum", lambda v, b: v > b), ("exclusiveMaximum", lambda v, b: v < b))


def _scalar_error(value, schema: dict, path: str) -> str | None:
    import re

    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            return f"{path}: {len(value)} characters, fewer than minLength {schema['minLength']}"
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return f"{path}: {len(value)} characters, more than maxLength {schema['maxLength']}"
        if "pattern" in schema:
            try:
                hit = re.search(schema["pattern"], value)
            except (re.error, TypeError) as e:
                return f"{path}: the pattern {_short(schema['pattern'])} cannot be checked ({e})"
            if not hit:
                return f"{path}: {_short(value)} does not match the pattern {_short(schema['pattern'])}"
    elif _is_type(value, "number"):
        for key, ok in _BOUNDS:
            bound = schema.get(key)
            # a number bound only (draft 4's boolean exclusiveMinimum is no bound)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not ok(value, bound):
                return f"{path}: {_short(value)} breaks {key} {bound}"
    return None


def _subschemas_error(value, schema: dict, path: str) -> str | None:
    for i, sub in enumerate(schema.get("allOf", ())):
        err = schema_error(value, sub, path)
        if err:
            return f"{err} (allOf[{i}])"
    if "anyOf" in schema and not any(schema_error(value, s, path) is None for s in schema["anyOf"]):
        return f"{path}: follows none of anyOf's {len(schema['anyOf'])} schemas"
    if "oneOf" in schema:
        n = sum(schema_error(value, s, path) is None for s in schema["oneOf"])
        if n != 1:
            return f"{path}: follows {n} of oneOf's schemas, not exactly one"
    return None


def json_answer_error(text: str, schema: dict) -> str | None:
    """Why an answer is not valid against a JSON schema: not JSON, or the
    first place it breaks the schema; None when it is valid."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    except RecursionError:
        return "not JSON: nested too deeply"
    return schema_error(value, schema)


def grammar_answer_error(vocab, gbnf: str, text: str) -> str | None:
    """Why an answer is not one a GBNF grammar accepts whole, checked by
    llama.cpp's grammar engine over the answer's tokens (any tokenization of
    the same text gives the same verdict: the grammar reads characters):
    the first token it rejects, or an answer that stops before the grammar
    allows it to end; None when it accepts it."""
    from edgespec.backend.grammar import Grammar

    g = Grammar(vocab, gbnf)
    try:
        tokens = vocab.tokenize(text, add_special=False, parse_special=False) if text else []
        done = ""
        for t in (int(x) for x in tokens):
            # allows() before accept(): llama.cpp aborts on accepting a rejected token
            if not g.allows(t):
                return f"the grammar rejects {vocab.token_text(t)!r} after {_short(done)}"
            g.accept(t)
            done += vocab.token_text(t)
        eog = _eog_token(vocab)
        if eog is not None and not g.allows(eog):
            return "the answer stops before the grammar's end"
        return None
    finally:
        g.close()


def _eog_token(vocab) -> int | None:
    """An end-of-generation token (the grammar admits one only where it may end)."""
    eos = vocab.eos_token()
    if eos >= 0 and vocab.is_eog(eos):
        return eos
    ids = np.flatnonzero(vocab.eog_mask())
    return int(ids[0]) if len(ids) else None
