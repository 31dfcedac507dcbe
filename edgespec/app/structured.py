"""Structured-output requests: the shapes clients send, checked and bounded.

Three request shapes ask for an answer that follows a grammar:

* `response_format` (OpenAI, llama-server, llama-cpp-python):
  `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON
  object), `{"type": "json_object", "schema": {...}}` (llama-server's and
  llama-cpp-python's schema form) and `{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}, "strict": ...}}` (OpenAI's; the answer always
  follows the schema, strict or not);
* `json_schema` (llama-server): a schema object;
* `grammar` (llama-server: GBNF text; llama-cpp-python: a LlamaGrammar).

A schema becomes GBNF through edgespec.backend.grammar.gbnf_for (llama.cpp's
converter as llama-cpp-python ships it).  That converter writes a repetition
count out in full (`minItems: 10**9` is a billion copies of a rule), so the
counts of a schema are bounded here first, and the GBNF it yields is bounded
like a grammar a client sends.  Errors are ConstraintErrors: ConfigErrors
that name the request field at fault.
"""
from __future__ import annotations

import json
import re

from edgespec.backend.grammar import MAX_GRAMMAR_BYTES, gbnf_for
from edgespec.errors import ConfigError, GrammarError

# The largest repetition count a schema may ask for (minItems, maxLength, ...):
# the converter writes a count out as that many (nested) copies of a rule.
MAX_REPEAT = 1000
# A pattern's text times the product of its {m,n} counts, at most: the
# converter copies a repeated part of a pattern out in full, nested counts
# multiplying (an over-estimate: counts side by side only add).
MAX_PATTERN_COST = 1 << 20
# The deepest nesting of parentheses a grammar may have: llama.cpp's GBNF
# parser recurses once per level on the thread's stack (20000 levels crashed
# the process on an 8 MiB stack); the converter nests MAX_REPEAT levels for
# a count, so this leaves room for that.
MAX_NESTING = 1500
_COUNTS = frozenset({"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"})
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# what parentheses inside do not nest: literals, character classes, comments
_EXCEPTION_NAME = re.compile(r"\b[A-Z]\w*(?:Error|Exception): ")
_GBNF_OPAQUE = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*', re.S)


class ConstraintError(GrammarError):
    """A grammar or schema that cannot be used; `param` is the request field
    at fault, `code` an OpenAI-style error code."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message, param, code)


def response_format_schema(rf, param: str = "response_format"):
    """The schema a response_format asks for: None (text), True (any JSON
    object) or a schema dict."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ConstraintError(f'{param} must be an object with a string "type"', param, "invalid_type")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _schema_or_any(rf.get("schema"), f"{param}.schema", param)
    if kind == "json_schema":
        inner = rf.get("json_schema")
        if not isinstance(inner, dict):
            raise ConstraintError(f'{param}.json_schema must be an object like {{"name": ..., "schema": {{...}}}}',
                                  param, "invalid_type")
        return _schema_or_any(inner.get("schema"), f"{param}.json_schema.schema", param)
    raise ConstraintError(f'{param}.type must be "text", "json_object" or "json_schema", got {kind[:40]!a}',
                          param)


def _schema_or_any(schema, where: str, param: str):
    if schema is None or schema == {}:
        return True
    if not isinstance(schema, dict):
        raise ConstraintError(f"{where} must be a JSON schema object", param, "invalid_type")
    return schema


def check_gbnf(text: str, param: str, what: str = "the grammar") -> str:
    """GBNF text within MAX_GRAMMAR_BYTES and MAX_NESTING (ConstraintError naming param)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise ConstraintError(f"{what} has more than {MAX_GRAMMAR_BYTES} bytes", param)
    depth = deepest = 0
    for ch in re.findall(r"[()]", _GBNF_OPAQUE.sub(" ", text)):
        depth += 1 if ch == "(" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        raise ConstraintError(f"{what} nests parentheses {deepest} deep, more than {MAX_NESTING}", param)
    return text


def grammar_text(grammar, param: str = "grammar") -> str | None:
    """GBNF text from a string or a llama_cpp.LlamaGrammar (whose text is
    its `_grammar`), bounded (check_gbnf); None and "" are no grammar."""
    if grammar is None or grammar == "":
        return None
    text = grammar if isinstance(grammar, str) else getattr(grammar, "_grammar", None)
    if not isinstance(text, str):
        raise ConstraintError(f"{param} must be GBNF text or a llama_cpp.LlamaGrammar, got {type(grammar).__name__}",
                              param, "invalid_type")
    if getattr(grammar, "_root", "root") != "root":
        raise ConstraintError(f"{param}: only grammars whose start rule is `root` are supported", param)
    return check_gbnf(text, param)


def _check_pattern(pattern: str, param: str) -> None:
    cost = max(1, len(pattern))
    for m in _QUANTIFIER.finditer(pattern):
        # (a count of more than 9 digits is over any bound: not parsed, so no int() of 5000 digits)
        cost *= max([1] + [int(n) if len(n) <= 9 else 10**9 for n in m.groups() if n])
        if cost > MAX_PATTERN_COST:
            raise ConstraintError(f"a pattern of the JSON schema repeats too much: its length times its {{m,n}} "
                                  f"counts is over {MAX_PATTERN_COST}", param)


def check_schema(schema, param: str) -> None:
    """Refuse a schema whose counts would grow the grammar past MAX_REPEAT
    copies of a rule, or a pattern past MAX_PATTERN_COST (walked without
    recursion: a deep schema is the converter's to refuse)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, v in node.items():
            if key in _COUNTS and isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_REPEAT:
                raise ConstraintError(f"the JSON schema's {key} is {v!r:.20}, more than {MAX_REPEAT}", param)
            if key == "pattern" and isinstance(v, str):
                _check_pattern(v, param)
            elif isinstance(v, (dict, list)):
                stack.append(v)


def schema_gbnf(schema, param: str) -> str:
    """The GBNF of a schema (True: any JSON object), bounded; ConstraintError
    naming `param` when the converter cannot take it."""
    if schema is not True:
        check_schema(schema, param)
    try:
        gbnf = gbnf_for(json_schema=schema)
    except ConfigError as e:
        # the converter's own exception names ("AssertionError: ...") say nothing to a client
        raise ConstraintError(_EXCEPTION_NAME.sub("", str(e)), param) from None
    return check_gbnf(gbnf, param, "the JSON schema's grammar")


def constraint_gbnf(grammar=None, json_schema=None) -> str | None:
    """The bounded GBNF of a library call's grammar= (GBNF text or a
    LlamaGrammar) or json_schema= (a schema dict, its JSON text, or True / {}
    for any JSON object); None when neither is given."""
    if grammar is not None and json_schema is not None:
        raise ConstraintError("give a grammar or a JSON schema, not both", "grammar")
    if grammar is not None:
        return grammar_text(grammar)
    if json_schema is None:
        return None
    if isinstance(json_schema, str):
        try:
            json_schema = json.loads(json_schema)
        except ValueError as e:
            raise ConstraintError(f"the JSON schema is not valid JSON: {e}", "json_schema") from None
    return schema_gbnf(True if json_schema == {} else json_schema, "json_schema")
