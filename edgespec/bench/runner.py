"""Benchmark: edgespec drafters against plain decoding and llama-cpp-python.

One process loads the model once (`SpecModel(drafter="none")`) and runs every
requested method on every prompt, prompt-major (for each prompt, each method in
turn) so that machine noise falls on all methods alike.  Greedy decoding only:
then every edgespec method must give exactly the tokens of `none`, and the
results file records whether it did.

Methods
  none, suffix, ...        edgespec engines (`model.generate(..., drafter=name)`)
  llama-cpp-python         llama_cpp.Llama.create_chat_completion (create_completion
                           with raw prompts), streamed, at that library's defaults
  llama-cpp-python-expert  the same as an expert runs it: one thread per physical
                           core for single tokens and batches, flash attention
                           and the K cache type edgespec uses
  llama-cpp-python-pld     llama-cpp-python with LlamaPromptLookupDecoding (its
                           defaults: 10 draft tokens; logits_all=True, which its
                           draft path needs)
  llama-cpp-python-pld-cpu the same with num_pred_tokens=2, which llama-cpp-python's
                           README recommends for CPU-only machines
  llama-server, llama-server-ngram-simple, -ngram-map-k, -ngram-map-k4v,
  -ngram-mod, -ngram-cache
                           llama.cpp's own server, plain or with its draftless
                           speculative decoding, each with the settings
                           llama.cpp's docs recommend; built by `edgespec
                           build-peers` (see edgespec.bench.peer_server, docs/peers.md)
  default                  what `edgespec generate MODEL PROMPT` runs with no
                           options (its drafter; the bench's model must be loaded
                           with generate's default settings; the header says
                           what it resolved to)
A peer method ending in @tN (llama-server@t1, llama-cpp-python-pld@t2) runs
with N threads for single tokens and batches instead of its own default.
The llama-cpp-python methods run in a child process, in the environment the
bench was started with (llama.cpp reads some switches once per process, and
edgespec turns one of them off for exactness: see backend.llama.TILED_MM_ENV).

Divergences: an edgespec method whose greedy tokens differ from `none`'s gets
a `divergence` record: the first differing position, and the logits plain
decoding gives there (re-decoded: the prompt prefilled and none's tokens
decoded one at a time, as `none` ran), as the gap between its top token and
the method's token.  The report sets each gap against the exactness
self-check's largest |logit difference|: a gap wider than twice that is no
near-tie and points at a bug.

Constraints: a prompt line may carry `json_schema` (a JSON schema object) or
`grammar` (GBNF text) that its answer must follow.  Every method then runs
under the same grammar (the GBNF edgespec derives, see Constraint): edgespec's
through SpecModel.generate(json_schema=, grammar=), llama-cpp-python's with
grammar=LlamaGrammar, llama-server's in the request's grammar field.  Each
row of such a prompt records whether its answer follows the constraint
("valid", checked apart from the grammar: see json_answer_error and
grammar_answer_error), and the report counts them per method.

Results file (JSON lines)
  line 1: {"kind": "header", ...}   model path, threads, context, llama_cpp
          version, date, host and CPU, the measured cost curve, the settings
  then:   {"kind": "result", ...}   one line per (prompt, method); see
          RESULT_FIELDS.  For llama-cpp-python methods `tokens` is the
          re-tokenized text and n_steps / mean_accepted are null; for
          llama-server methods `tokens` are the server's ids and
          `server_timings` its own timing figures.

Timing: prefill_s runs from the request to the first generated token (edgespec)
or the first streamed content chunk (llama-cpp-python); decode_s from there to
the end; llama-server's come from its own timings (prompt_ms, predicted_ms).
Decode speed is (n_generated - 1) / decode_s.
"""
from __future__ import annotations

import datetime
import gzip
import multiprocessing
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from edgespec.errors import BenchError  # re-exported
from edgespec.bench.peer_server import SERVER_METHODS as _SERVER_ARGS
from edgespec.core.verify import rouge_l

LLAMA_METHODS = ("llama-cpp-python", "llama-cpp-python-expert", "llama-cpp-python-pld", "llama-cpp-python-pld-cpu")
SERVER_METHODS = tuple(_SERVER_ARGS)
PEER_METHODS = LLAMA_METHODS + SERVER_METHODS
DEFAULT_METHODS = ("none", "suffix") + LLAMA_METHODS[:3]
PLD_DRAFT_TOKENS = {"llama-cpp-python-pld": None, "llama-cpp-python-pld-cpu": 2}
"""num_pred_tokens of the prompt-lookup methods (None = LlamaPromptLookupDecoding's default, 10)."""
WARMUP_PROMPT = "Say hello."
MAX_PROMPTS_BYTES = 64 << 20     # Spec-Bench's 480 questions take 0.7 MB

RESULT_FIELDS = ("question_id", "category", "method", "text", "tokens", "n_prompt_tokens",
                 "n_generated", "n_steps", "mean_accepted", "prefill_s", "decode_s",
                 "tokens_per_s", "stop_reason", "identical_to_none")


# ------------------------------------------------------------------ prompts
@dataclass
class BenchPrompt:
    question_id: object
    category: str
    turn: str          # the first turn, sent as one user message
    # what the answer must follow, at most one of the two (the line's
    # `json_schema` or `grammar`): every method that can runs constrained
    json_schema: dict | None = None
    grammar: str | None = None      # GBNF text (llama.cpp's format)

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.grammar is not None


def _json_objects(path: str, lines):
    """(line number, dict) for each non-blank line; a line that is not a JSON
    object is an error naming it."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise BenchError(f"{path}:{lineno}: not valid JSON (nested too deeply)") from None
        if not isinstance(rec, dict):
            raise BenchError(f"{path}:{lineno}: expected a JSON object")
        yield lineno, rec


def load_prompts(path: str, categories: Sequence[str] | None = None,
                 limit: int | None = None) -> list[BenchPrompt]:
    """Read a JSON-lines prompts file (fields question_id, category, turns,
    and optionally json_schema or grammar: what the answer must follow).

    Every non-blank line must be a JSON object with a non-empty list of string
    `turns`; anything else is a BenchError naming the line, and so is a line
    with both `json_schema` and `grammar`, a `json_schema` that is not a JSON
    object or uses a keyword the bench cannot check answers against (see
    SCHEMA_CHECKED), or a constraint that does not become a grammar.
    `categories` keeps only those categories; `limit` then keeps the first N.
    """
    if not os.path.isfile(path):
        raise BenchError(f"prompts file not found: {path}")
    size = os.path.getsize(path)
    if size > MAX_PROMPTS_BYTES:
        raise BenchError(f"prompts file {path} is {size / 2**20:.0f} MiB; the bench reads at most "
                         f"{MAX_PROMPTS_BYTES >> 20} MiB of prompts")
    prompts: list[BenchPrompt] = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read prompts file {path}: {e}") from None
    for lineno, rec in _json_objects(path, lines):
        turns = rec.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
            raise BenchError(f"{path}:{lineno}: needs `turns`, a list whose first item is a non-empty string")
        category = str(rec.get("category", "none"))
        try:
            turns[0].encode("utf-8")
            category.encode("utf-8")
        except UnicodeEncodeError:
            raise BenchError(f"{path}:{lineno}: an unpaired surrogate escape (\\ud800-\\udfff) in the first "
                             "turn or the category, which is not text") from None
        schema, grammar = _prompt_constraint(path, lineno, rec)
        prompts.append(BenchPrompt(rec.get("question_id", lineno), category, turns[0], schema, grammar))
    if not prompts:
        raise BenchError(f"no prompts in {path}")
    if categories:
        wanted = set(categories)
        known = {p.category for p in prompts}
        missing = wanted - known
        if missing:
            raise BenchError(f"no prompts of category {', '.join(sorted(missing))} in {path} "
                             f"(categories: {', '.join(sorted(known))})")
        prompts = [p for p in prompts if p.category in wanted]
    if limit is not None:
        if limit < 1:
            raise BenchError("--limit must be >= 1")
        prompts = prompts[:limit]
    return prompts


def _prompt_constraint(path: str, lineno: int, rec: dict) -> tuple[dict | None, str | None]:
    """A prompt line's (json_schema, grammar), each None when absent.
    BenchError naming the line for both at once, a schema that is not a JSON
    object or that the answer check cannot check in full, a grammar that is
    not text, or either one that does not become GBNF."""
    schema, grammar = rec.get("json_schema"), rec.get("grammar")
    if schema is None and grammar is None:
        return None, None
    where = f"{path}:{lineno}"
    if schema is not None and grammar is not None:
        raise BenchError(f"{where}: give `json_schema` or `grammar`, not both")
    problem = _schema_problem(schema) if schema is not None else _grammar_problem(grammar)
    if problem:
        raise BenchError(f"{where}: {problem}")
    from edgespec.backend.grammar import gbnf_for
    from edgespec.errors import ConfigError
    try:
        gbnf_for(grammar=grammar, json_schema=schema)
    except ConfigError as e:
        raise BenchError(f"{where}: {e}") from None
    return schema, grammar


def _schema_problem(schema) -> str | None:
    """Why a prompt's json_schema cannot be used: not a JSON object, or parts
    the answer check would not check."""
    if not isinstance(schema, dict):
        return f"`json_schema` must be a JSON object (a JSON schema), not {_json_type(schema)}"
    bad = unchecked_keywords(schema)
    if bad:
        return (f"`json_schema` has {', '.join(bad[:3])}, which the bench's answer check does not check "
                f"(it knows {', '.join(SCHEMA_CHECKED)}; annotations such as title, description and format "
                f"are ignored)")
    return None


def _grammar_problem(grammar) -> str | None:
    if not isinstance(grammar, str) or not grammar.strip():
        return "`grammar` must be a non-empty GBNF text"
    return None


# ------------------------------------------------------------------ answer checks
# The bench checks constrained answers itself, apart from the grammar that
# produced them: a JSON schema with a small validator of the keywords below
# (JSON Schema's meaning of each; those the prompt sets use, and no new
# dependency), a GBNF grammar by running the answer through llama.cpp's
# grammar engine.  An answer cut off by max_tokens is invalid.
SCHEMA_CHECKED = ("type", "enum", "const", "properties", "required", "additionalProperties", "items",
                  "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum",
                  "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf", "allOf")
SCHEMA_ANNOTATIONS = ("title", "description", "$schema", "$id", "$comment", "default", "examples", "format")
"""Keywords that constrain nothing the check looks at (JSON Schema treats `format` as an annotation too)."""
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf")


def _json_type(value) -> str:
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
        return [f"a {_json_type(schema)} where a schema belongs at {path}"]
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
    return _json_type(value) == kind


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
            return f"{path}: expected {' or '.join(kinds)}, got {_json_type(value)}"
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


@dataclass(frozen=True)
class Constraint:
    """What one prompt's answers must follow: the line's json_schema or
    grammar, and the GBNF that either amounts to (edgespec.backend.grammar.gbnf_for,
    through the converter llama-cpp-python ships): edgespec gets the
    schema or grammar as given, the peers this GBNF, so every method decodes
    under the same grammar."""
    json_schema: dict | None
    grammar: str | None
    gbnf: str

    def answer_error(self, vocab, text: str) -> str | None:
        """Why an answer is invalid (see json_answer_error, grammar_answer_error); None when valid."""
        if self.json_schema is not None:
            return json_answer_error(text, self.json_schema)
        return grammar_answer_error(vocab, self.gbnf, text)


def prompt_constraint(vocab, p: BenchPrompt) -> Constraint | None:
    """A prompt's Constraint (None when it has none), its GBNF checked by
    llama.cpp's grammar parser over the model's vocabulary: BenchError naming
    the prompt when the parser rejects it."""
    if not p.constrained:
        return None
    from edgespec.backend.grammar import Grammar, gbnf_for
    from edgespec.errors import ConfigError
    if p.json_schema is not None and p.grammar is not None:
        raise BenchError(f"prompt {p.question_id} ({p.category}): give a JSON schema or a grammar, not both")
    problem = _schema_problem(p.json_schema) if p.json_schema is not None else _grammar_problem(p.grammar)
    if problem:
        raise BenchError(f"prompt {p.question_id} ({p.category}): {problem}")
    try:
        gbnf = gbnf_for(grammar=p.grammar, json_schema=p.json_schema)
        Grammar(vocab, gbnf).close()
    except ConfigError as e:
        raise BenchError(f"prompt {p.question_id} ({p.category}): {e}") from None
    return Constraint(p.json_schema, p.grammar, gbnf)


WARMUP_SCHEMA = {"type": "object", "properties": {"greeting": {"type": "string"}}, "required": ["greeting"]}
"""The constraint of the warm-up's second request when the prompts are constrained
(each method's grammar path runs once before the timed prompts)."""


def constraint_summary(prompts: Sequence[BenchPrompt]) -> dict | None:
    """The header's record of the prompts' constraints; None when there are none."""
    n_schema = sum(p.json_schema is not None for p in prompts)
    n_grammar = sum(p.grammar is not None for p in prompts)
    if not n_schema and not n_grammar:
        return None
    return {"json_schema": n_schema, "grammar": n_grammar, "n_prompts": len(prompts),
            "peers_get": "the GBNF edgespec derives (llama-cpp-python: grammar=LlamaGrammar; llama-server: "
                         "the request's grammar field)"}


def split_peer(method: str) -> tuple[str, int | None] | None:
    """(peer method, threads or None) of a peer method name ("llama-server@t2"
    -> ("llama-server", 2)); None for any other name."""
    base, _, suffix = method.partition("@")
    if base not in PEER_METHODS:
        return None
    if not suffix:
        return base, None
    if suffix[:1] != "t" or not suffix[1:].isdigit() or int(suffix[1:]) < 1:
        raise BenchError(f"method {method!r}: a peer's suffix is @tN, N threads (e.g. {base}@t2)")
    return base, int(suffix[1:])


def is_peer(method: str) -> bool:
    """Whether a method runs another program (llama-cpp-python, llama-server) rather than edgespec."""
    return method.partition("@")[0] in PEER_METHODS


def parse_methods(spec: str | Sequence[str]) -> list[str]:
    """'none,suffix,...' -> a list without duplicates; edgespec drafter names are
    checked against the drafter registry, peer names against PEER_METHODS."""
    from edgespec.drafters import check_drafter_name

    items = spec.split(",") if isinstance(spec, str) else list(spec)
    methods: list[str] = []
    for m in (x.strip() for x in items):
        if not m or m in methods:
            continue
        if split_peer(m) is None and m != "default":
            try:
                check_drafter_name(m)
            except ValueError as e:
                raise BenchError(f"unknown method {m!r}: {e}; or default, or one of {', '.join(PEER_METHODS)} "
                                 f"(with @tN for N threads)") from None
        methods.append(m)
    if not methods:
        raise BenchError("no methods given")
    return methods


# ------------------------------------------------------------------ running
def _llama_kwargs(method: str, threads: int | None, cache_type_k: str) -> dict:
    """llama_cpp.Llama arguments of a llama-cpp-python method (see the module
    doc), but for pld's draft model."""
    kw: dict = {}
    if method in PLD_DRAFT_TOKENS:
        # the draft model (LlamaPromptLookupDecoding) is made in the worker.
        # With a draft model, Llama keeps logits of every token (it forces
        # logits_all internally) but sizes its scores buffer from the
        # logits_all argument: without it any prompt longer than n_batch
        # fails with a numpy broadcast error (llama-cpp-python 0.3.36).
        kw["logits_all"] = True
    if method == "llama-cpp-python-expert":
        from edgespec.backend.llama import CACHE_TYPES_K, default_threads
        n = threads or default_threads()
        kw.update(n_threads=n, n_threads_batch=n, flash_attn=True, type_k=CACHE_TYPES_K[cache_type_k])
    elif threads:
        # otherwise llama-cpp-python as users get it: its own thread defaults
        # (n_threads = cores // 2 for single-token decoding, n_threads_batch =
        # cores), unless the bench was given --threads
        kw["n_threads"] = kw["n_threads_batch"] = threads
    return kw


def _llama_worker(conn, model_path: str, n_ctx: int, n_gpu_layers: int, kw: dict, method: str) -> None:
    """The child process of a llama-cpp-python method: load, then answer
    ("run", turn, max_tokens, raw, gbnf) requests with result dicts until "exit"."""
    try:
        import llama_cpp

        if method in PLD_DRAFT_TOKENS:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            n = PLD_DRAFT_TOKENS[method]
            kw = dict(kw, draft_model=LlamaPromptLookupDecoding() if n is None else
                      LlamaPromptLookupDecoding(num_pred_tokens=n))
        # with CPU weight repacking off, as edgespec runs (backend.llama.load_model:
        # repacked kernels are not exact and llama.cpp's AMX one crashed here)
        from edgespec.backend.llama import llama_cpp_python_repack
        with llama_cpp_python_repack(False):
            llm = llama_cpp.Llama(model_path, n_ctx=n_ctx, n_batch=512, n_gpu_layers=n_gpu_layers,
                                  verbose=False, **kw)
        cp = llm.context_params
        conn.send(("ready", {"n_threads": cp.n_threads, "n_threads_batch": cp.n_threads_batch,
                             "flash_attn": int(cp.flash_attn_type), "type_k": int(cp.type_k)}))
    except Exception as e:  # pragma: no cover - reported by the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        msg = conn.recv()
        if msg[0] != "run":
            break
        try:
            conn.send(("ok", _llama_run(llm, *msg[1:])))
        except Exception as e:  # pragma: no cover - reported by the parent
            conn.send(("error", f"{type(e).__name__}: {e}"))
    llm.close()


def _llama_run(llm, turn: str, max_tokens: int, raw: bool, gbnf: str | None = None) -> dict:
    """One streamed, timed request to a llama_cpp.Llama (in the worker);
    gbnf: the grammar the answer must follow (already checked by llama.cpp's
    parser in the bench: llama-cpp-python does not check what it hands on)."""
    import llama_cpp

    pieces: list[str] = []
    stop_reason = None
    kw = {} if gbnf is None else {"grammar": llama_cpp.LlamaGrammar.from_string(gbnf, verbose=False)}
    t0 = time.perf_counter()
    t_first = None
    if raw:
        stream = llm.create_completion(turn, max_tokens=max_tokens, temperature=0.0, stream=True, **kw)
    else:
        stream = llm.create_chat_completion(messages=[{"role": "user", "content": turn}],
                                            max_tokens=max_tokens, temperature=0.0, stream=True, **kw)
    for chunk in stream:
        choice = chunk["choices"][0]
        content = choice.get("text") if raw else choice.get("delta", {}).get("content")
        if content:
            if t_first is None:
                t_first = time.perf_counter()
            pieces.append(content)
        if choice.get("finish_reason"):
            stop_reason = choice["finish_reason"]
    t_end = time.perf_counter()
    if t_first is None:
        t_first = t_end
    text = "".join(pieces)
    tokens = [int(t) for t in llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)] if text else []
    n = len(tokens)
    decode_s = t_end - t_first
    return {"text": text, "tokens": tokens, "n_generated": n, "n_steps": None, "mean_accepted": None,
            "prefill_s": t_first - t0, "decode_s": decode_s,
            "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            "stop_reason": stop_reason or "length"}


class _LlamaRunner:
    """A llama-cpp-python method in a child process (spawned with the
    environment the user gave, see the module doc), streamed and timed there."""

    def __init__(self, method: str, model_path: str, n_ctx: int, threads: int | None, n_gpu_layers: int,
                 cache_type_k: str = "f16", raw: bool = False):
        from edgespec.backend.llama import TILED_MM_ENV, USER_TILED_MM

        self.method, self.raw = method, raw
        base, n = split_peer(method)
        kw = _llama_kwargs(base, n or threads, cache_type_k)
        mp = multiprocessing.get_context("spawn")
        self.conn, child = mp.Pipe()
        self.proc = mp.Process(target=_llama_worker, args=(child, model_path, n_ctx, n_gpu_layers, kw, base),
                               daemon=True)
        mine = os.environ.get(TILED_MM_ENV)
        _set_env(TILED_MM_ENV, USER_TILED_MM)
        try:
            self.proc.start()
        finally:
            _set_env(TILED_MM_ENV, mine)
        child.close()
        self.settings = self._reply()

    def _reply(self):
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise BenchError(f"{self.method}: the llama-cpp-python process died "
                             f"(exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise BenchError(f"{self.method}: {value}")
        return value

    def run(self, turn: str, max_tokens: int, gbnf: str | None = None) -> dict:
        self.conn.send(("run", turn, max_tokens, self.raw, gbnf))
        return self._reply()

    def close(self) -> None:
        try:
            self.conn.send(("exit",))
        except (OSError, ValueError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():  # pragma: no cover - best effort
            self.proc.terminate()
            self.proc.join(5)
        self.conn.close()


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def header(model, methods: Sequence[str], max_tokens: int, prompts_file: str | None,
           n_prompts: int, llama_threads: int | None = None, raw: bool = False) -> dict:
    """Machine and settings metadata: the first line of a results file.
    `exact` is the exactness self-check's verdict (SpecModel.exact: None when
    it did not run), `exactness` its detail; `exact_mode` says whether the
    backend runs the settings meant to be exact (CPU thread and K cache
    choices), which alone does not make a model exact."""
    from edgespec import __version__
    from edgespec.backend.llama import llama_cpp_version, tiled_mm_setting
    from edgespec.backend.ggml import hello_ms
    from edgespec.calibration.costmodel import _cpu_name

    be = model.backend
    ex = getattr(model, "exactness", None)
    return {
        "kind": "header",
        "edgespec_version": __version__,
        "model": model.model_path,
        "n_threads": be.n_threads,
        "exact": None if ex is None else ex.exact,
        "exactness": None if ex is None else ex.to_json(),
        "exact_mode": be.exact,
        "cache_type_k": be.cache_type_k,
        "kernels": getattr(model, "kernels", "exact"),
        "kernels_setting": getattr(model, "kernels_setting", None),
        "kernel_price": None if getattr(model, "kernel_price", None) is None else model.kernel_price.to_json(),
        "flash_attn": "auto" if getattr(be, "flash_attn", None) is None else bool(be.flash_attn),
        "tiled_mm": tiled_mm_setting(),
        "single_token_threads": (f"{be.n_threads} up to {be.one_thread_after} KV cells, then 1 (exact mode, f16 K cache)"
                                 if be.one_thread_after is not None else str(be.n_threads)),
        "llama_cpp_python": {m: llama_peer_settings(m, llama_threads, be.cache_type_k)
                             for m in methods if is_peer(m) and split_peer(m)[0] in LLAMA_METHODS},
        "n_ctx": be.n_ctx,
        "n_gpu_layers": be.n_gpu_layers,
        "rpc": list(getattr(be, "rpc", [])),
        "rpc_hello_ms": {ep: hello_ms.get(ep) for ep in getattr(be, "rpc", [])},
        "tensor_split": list(getattr(be, "tensor_split", [])),
        "max_nodes": model.config.max_nodes,
        "cost_gate": model.config.cost_gate,
        "llama_cpp_version": llama_cpp_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "cost_curve": model.cost.to_json() if model.cost is not None else None,
        "methods": list(methods),
        "max_tokens": max_tokens,
        "prompts_file": prompts_file,
        "n_prompts": n_prompts,
        "raw": raw,
        "corpora": [{"path": c.path, "n_tokens": int(c.header.get("n_tokens", 0)),
                     "sources": len(c.header.get("sources", []))} for c in getattr(model, "corpora", [])],
        "decoding": "greedy",
    }


def llama_peer_settings(method: str, llama_threads: int | None, cache_type_k: str) -> dict:
    """What a llama-cpp-python method runs with (the header's record; the
    library's defaults: half the logical CPUs for single tokens, all of them
    for batches, no flash attention, an f16 K cache)."""
    from edgespec.backend.llama import default_threads

    base, n = split_peer(method)
    n = n or llama_threads
    cpus = multiprocessing.cpu_count()
    if base == "llama-cpp-python-expert":
        return {"n_threads": n or default_threads(), "n_threads_batch": n or default_threads(),
                "flash_attn": True, "cache_type_k": cache_type_k}
    out = {"n_threads": n or max(cpus // 2, 1), "n_threads_batch": n or cpus, "flash_attn": False,
           "cache_type_k": "f16"}
    if base in PLD_DRAFT_TOKENS:
        k = PLD_DRAFT_TOKENS[base]
        out["draft"] = "LlamaPromptLookupDecoding(" + ("" if k is None else f"num_pred_tokens={k}") + ")"
    return out


def resolve_default(model) -> dict:
    """What method `default` runs: `edgespec generate`'s defaults (drafter,
    kernels, K cache, threads, context, GPU layers, largest batch, cost gate,
    verification), resolved on this machine.  The bench's model must run the
    same backend settings (it is loaded once for every method); BenchError
    naming the differences otherwise.  "drafter" is the spec to run: without
    the corpora the bench loaded (generate loads none by default)."""
    from edgespec.backend.llama import auto_cache_type_k, default_threads
    from edgespec.app.cli import generate_defaults

    d = generate_defaults()
    be = model.backend
    threads = d["threads"] or default_threads()
    kernels = d["kernels"]
    if kernels == "auto":          # what generate would resolve it to here (the cached verdict)
        from edgespec.calibration.kernelchoice import resolve
        kernels, _ = resolve("auto", model.model_path, threads, gpu=bool(d["n_gpu_layers"] or be.rpc),
                             measure=False)
    exact = kernels != "fast" and (not d["n_gpu_layers"] or bool(be.rpc))
    want = {"kernels": kernels, "n_threads": threads, "n_ctx": d["ctx"], "n_gpu_layers": d["n_gpu_layers"],
            "cache_type_k": (auto_cache_type_k(exact, threads) if d["cache_type_k"] == "auto" else d["cache_type_k"]),
            "max_nodes": d["max_nodes"], "cost_gate": not d["no_gate"], "verify": d["verify"]}
    have = {"kernels": getattr(model, "kernels", "exact"), "n_threads": be.n_threads, "n_ctx": be.n_ctx,
            "n_gpu_layers": be.n_gpu_layers, "cache_type_k": be.cache_type_k, "max_nodes": model.config.max_nodes,
            "cost_gate": model.config.cost_gate, "verify": model.config.verify.mode}
    diff = [f"{k} {have[k]} (generate's default: {want[k]})" for k in want if have[k] != want[k]]
    if diff:
        raise BenchError(f"method default runs `edgespec generate`'s defaults, but this bench's model runs "
                         f"{', '.join(diff)}: bench default without those options")
    drafter = d["drafter"] + ("-nocorpus" if getattr(model, "corpora", None) and "-nocorpus" not in d["drafter"]
                              else "")
    return dict(want, drafter=drafter, generate_drafter=d["drafter"])


def fresh_drafter(model, spec: str):
    """A new drafter object for `spec`, built as SpecModel builds a named one.
    Method `default` runs its own (so its own engine, drafter memory and
    acceptance statistics): it never learns from the answers of a method that
    runs the same drafter in this bench."""
    from edgespec.drafters import drafter_from_spec

    return drafter_from_spec(spec, n_vocab=model.vocab.n_vocab, model_path=model.model_path,
                             corpora=model.corpora)[0]


def plain_logits_at(model, prompt_tokens, prefix) -> np.ndarray:
    """The logits plain decoding (`none`) has for the token after prompt +
    prefix, recomputed as `none` computed them: the prompt prefilled in one
    go (in n_batch chunks), then the prefix decoded one token at a time.
    Leaves the KV cache empty."""
    be = model.backend
    be.reset()
    try:
        be.prefill(np.asarray(prompt_tokens, np.int32))
        one = np.ones(1, np.int32)
        zero = np.zeros(1, np.int32)
        for t in prefix:
            be.decode_tree(np.array([t], np.int32), zero, zero, one, 1)
            be.keep(1)
        return be.logits()[0].astype(np.float64)
    finally:
        be.reset()


def divergence(model, prompt_tokens, ref: Sequence[int], other: Sequence[int], gbnf: str | None = None) -> dict | None:
    """Where `other` first leaves `ref` (none's greedy tokens), and how close
    plain decoding was to choosing other's token there: None when they are
    equal, else {"index", "none_token", "token" (None = the answer ended
    there), "gap": none's top logit minus the logit of other's choice (the
    best end-of-generation token's when other ended), "top2_gap", and
    "reproduced": whether the re-decoded argmax is none's token}.  With a
    grammar (gbnf) the logits are those of the tokens it admits there, as
    the constrained run chose among them: a gap is None where the grammar
    rejects other's choice, top2_gap None where it admits one token only."""
    ref, other = list(ref), list(other)
    if ref == other:
        return None
    n = min(len(ref), len(other))
    i = next((k for k in range(n) if ref[k] != other[k]), n)
    lg = plain_logits_at(model, prompt_tokens, ref[:i])
    if gbnf is not None:
        lg = _grammar_row(model.vocab, gbnf, ref[:i], lg)
    eog = model.backend.vocab.eog_mask()
    a = ref[i] if i < len(ref) else None
    b = other[i] if i < len(other) else None
    top = float(lg.max())
    b_logit = float(lg[b]) if b is not None else float(lg[eog].max())
    second = float(np.partition(lg, -2)[-2])
    best = int(lg.argmax())
    return {"index": i, "none_token": a, "token": b, "gap": _finite(top - b_logit), "top2_gap": _finite(top - second),
            "reproduced": best == a if a is not None else bool(eog[best])}


def _finite(x: float) -> float | None:
    return x if np.isfinite(x) else None


def _grammar_row(vocab, gbnf: str, prefix: Sequence[int], row: np.ndarray) -> np.ndarray:
    """A logits row with -inf at the tokens the grammar rejects after
    `prefix` (none's answer so far); the row unchanged when the grammar
    rejects a token of the prefix itself (then it says nothing here)."""
    from edgespec.backend.grammar import Grammar

    g = Grammar(vocab, gbnf)
    try:
        for t in prefix:
            if not g.allows(int(t)):
                return row
            g.accept(int(t))
        return g.mask(row.astype(np.float32)).astype(np.float64)
    finally:
        g.close()


def server_binary(methods: Sequence[str]):
    """The llama-server the methods need (edgespec.bench.peers.find_llama_server),
    None when they need none; PeerError (one line, with the build command)
    when it is not built, does not run or was built from another llama.cpp."""
    if not any(split_peer(m) and split_peer(m)[0] in SERVER_METHODS for m in methods):
        return None
    from edgespec.bench.peers import find_llama_server
    return find_llama_server()


class _Methods:
    """Runs the methods of one bench: edgespec's on the loaded model, the
    peers in their own processes (each started on first use, all closed at
    the end).  `default` runs a drafter of its own, new in every pass."""

    def __init__(self, model, methods: Sequence[str], llama_threads: int | None, raw: bool,
                 peer_rpc: Sequence[str] = ()):
        self.model, self.llama_threads, self.raw = model, llama_threads, raw
        self.peer_rpc = list(peer_rpc)
        self.peers: dict = {}
        servers = [m for m in methods if is_peer(m) and split_peer(m)[0] in SERVER_METHODS]
        on_rpc = bool(getattr(model.backend, "rpc", None))
        others = [m for m in methods if is_peer(m) and m not in servers]
        if on_rpc and others:
            raise BenchError(f"{', '.join(others)} cannot run over --rpc: llama-cpp-python's own rpc_servers "
                             "argument does nothing (the bench would time it on this machine); leave it out")
        # a worker serves one client at a time: edgespec's model holds its
        # workers, and each llama-server method (a process kept for the run) would hold its own
        if on_rpc and servers and not self.peer_rpc:
            raise BenchError("over --rpc the llama-server methods need workers of their own (--peer-rpc): a "
                             "worker serves one client at a time, and edgespec's model holds these")
        if self.peer_rpc and len(servers) > 1:
            raise BenchError(f"over --rpc one llama-server method per run ({', '.join(servers)} given): each "
                             "would hold the --peer-rpc workers for the whole run")
        self.default = resolve_default(model) if "default" in methods else None
        self.default_drafter = None
        self.server = server_binary(methods)

    def new_pass(self) -> None:
        if self.default is not None:
            self.default_drafter = fresh_drafter(self.model, self.default["drafter"])

    def engine(self, m: str):
        return self.model._engine_for(self.default_drafter if m == "default" else m)

    def server_settings(self, methods: Sequence[str]) -> dict | None:
        """The header's record of the llama-server methods: binary, version, arguments, threads."""
        if self.server is None:
            return None
        from edgespec.backend.llama import default_threads
        out = {"binary": self.server.describe(), "methods": {}}
        for m in methods:
            peer = split_peer(m)
            if peer and peer[0] in SERVER_METHODS:
                n = peer[1] or self.llama_threads
                out["methods"][m] = {"spec_args": list(_SERVER_ARGS[peer[0]]),
                                     "threads": n or default_threads(), "threads_default": n is None}
        return out

    def run(self, m: str, turn: str, tokens, n_tok: int, c: Constraint | None = None) -> dict:
        """One request of method m; c: what the answer must follow (edgespec
        gets the schema or grammar as given, the peers its GBNF)."""
        peer = split_peer(m)
        gbnf = None if c is None else c.gbnf
        if peer is None:
            # the plain run also records the model's top-8 at each position, so
            # that tools/replay.py can replay drafters that read the model's ranking
            drafter = self.default_drafter if m == "default" else m
            kw = {} if c is None else {"json_schema": c.json_schema, "grammar": c.grammar}
            r = self.model.generate(tokens, max_tokens=n_tok, drafter=drafter,
                                    record_topk=8 if m == "none" else 0, **kw).to_dict()
            r["tokens"] = [int(t) for t in r["tokens"]]
            return r
        if peer[0] in SERVER_METHODS:
            return self._peer(m).run(tokens, n_tok, grammar=gbnf)
        return self._peer(m).run(turn, n_tok, gbnf)

    def _peer(self, m: str):
        if m not in self.peers:
            be = self.model.backend
            base, n = split_peer(m)
            if base in SERVER_METHODS:
                from edgespec.bench.peer_server import LlamaServerRunner, server_env
                self.peers[m] = LlamaServerRunner(base, self.server.path, self.model.model_path, be.n_ctx,
                                                  be.n_gpu_layers, n or self.llama_threads, env=server_env(),
                                                  rpc=self.peer_rpc, tensor_split=be.tensor_split)
            else:
                self.peers[m] = _LlamaRunner(m, self.model.model_path, be.n_ctx, self.llama_threads,
                                             be.n_gpu_layers, cache_type_k=be.cache_type_k, raw=self.raw)
        return self.peers[m]

    def close(self) -> None:
        for r in self.peers.values():
            r.close()


def _result_row(model, p: BenchPrompt, i: int, rep: int, m: str, r: dict, base: dict | None, tokens,
                c: Constraint | None = None) -> dict:
    """One result line: a method's run set against none's (tokens, or the
    text for llama-cpp-python, whose tokens are re-tokenized); with a
    constraint, whether the answer follows it ("valid", and "invalid_reason"
    when it does not)."""
    text_only = is_peer(m) and split_peer(m)[0] in LLAMA_METHODS
    if base is None:
        same = None
    elif text_only:
        same = r["text"] == base["text"]
    else:
        same = r["tokens"] == base["tokens"]
    rec = {"kind": "result", "question_id": p.question_id, "category": p.category,
           "method": m, "prompt_index": i - 1, "repeat": rep}
    rec.update(r)
    rec["identical_to_none"] = same
    if c is not None:
        why = c.answer_error(model.vocab, r["text"])
        rec["valid"] = why is None
        if why is not None:
            rec["invalid_reason"] = why
    if base is not None and not is_peer(m) and m != "none":
        rec["rouge_l_to_none"] = round(rouge_l(base["tokens"], r["tokens"]), 4)
        if not same and r.get("verify", "exact") == "exact":
            rec["divergence"] = divergence(model, tokens, base["tokens"], r["tokens"],
                                           gbnf=None if c is None else c.gbnf)
    return rec


def _warm_up(model, runner: _Methods, methods: Sequence[str], tokens, constrained: bool) -> None:
    """Each method's untimed first request(s) on the warm-up prompt; with
    constrained prompts a second one under WARMUP_SCHEMA, so that what a
    method does once for grammars is not timed on the first prompt."""
    c = prompt_constraint(model.vocab, BenchPrompt(0, "warm-up", WARMUP_PROMPT, WARMUP_SCHEMA)) if constrained else None
    for m in methods:
        runner.run(m, WARMUP_PROMPT, tokens, 16)
        if c is not None:
            runner.run(m, WARMUP_PROMPT, tokens, 16, c)


def run_bench(model, prompts: Sequence[BenchPrompt], methods: Sequence[str], *, max_tokens: int = 128,
              out_path: str | None = None, prompts_file: str | None = None,
              progress: Callable[[str], None] | None = None,
              llama_threads: int | None = None, repeat: int = 1, raw: bool = False,
              peer_rpc: Sequence[str] = ()) -> tuple[dict, list[dict]]:
    """Run every method on every prompt with `model` (a SpecModel); return the
    header and the result dicts, writing them as JSON lines to `out_path` as
    they come (a run stopped half-way keeps what it finished).  llama_threads:
    threads for the peer methods without an @tN suffix (None = each one's
    defaults).  repeat: run the whole prompt list that many times (passes);
    each pass starts a fresh session (model.new_session(): no acceptance
    statistics or drafter memory carried over, so a later pass cannot copy an
    earlier answer) and rows carry their pass number in "repeat".  raw: send
    each prompt as plain text (no chat template; for base models),
    llama-cpp-python through create_completion, llama-server as the same
    token ids.  An edgespec method whose tokens differ from none's gets a
    "divergence" record (see divergence()).  A prompt with a json_schema or
    grammar runs constrained in every method (see Constraint), its rows
    recording whether the answer follows it ("valid"); the header's
    "constrained" counts such prompts.  peer_rpc: the RPC workers the
    llama-server methods use when the model runs over RPC (workers like the
    model's, on the same machines: one worker serves one client)."""
    if max_tokens < 1:
        raise BenchError("max_tokens must be >= 1")
    if repeat < 1:
        raise BenchError("repeat must be >= 1")
    methods = parse_methods(methods)
    say = progress or (lambda s: None)
    be = model.backend
    # every prompt is tokenized and checked, and the peers found, before the
    # results file is opened: a prompt that does not fit (or a base model
    # without --raw, or a llama-server not built) fails the run before
    # anything is written
    warm_tokens = model.prompt_tokens(WARMUP_PROMPT, raw=raw)
    prompt_tokens = [model.prompt_tokens(p.turn, raw=raw) for p in prompts]
    for p, tokens in zip(prompts, prompt_tokens):
        if len(tokens) >= be.n_ctx:
            raise BenchError(f"prompt {p.question_id} ({p.category}) has {len(tokens)} tokens, "
                             f"more than the context of {be.n_ctx}; raise --ctx")
    constraints = [prompt_constraint(model.vocab, p) for p in prompts]
    runner = _Methods(model, methods, llama_threads, raw, peer_rpc)
    head = header(model, methods, max_tokens, prompts_file, len(prompts), llama_threads, raw=raw)
    head["peer_rpc"] = list(peer_rpc)
    head.update(repeat=repeat, default=runner.default, llama_server=runner.server_settings(methods),
                constrained=constraint_summary(prompts))
    out = None
    try:
        if out_path:
            out = open(out_path, "w", encoding="utf-8")
            out.write(json.dumps(head) + "\n")
            out.flush()
        results: list[dict] = []

        def emit(rec: dict) -> None:
            results.append(rec)
            if out is not None:
                out.write(json.dumps(rec) + "\n")

        for rep in range(repeat):
            tag = f"[pass {rep + 1}/{repeat}] " if repeat > 1 else ""
            if rep:
                model.new_session()
            runner.new_pass()
            say(f"{tag}warming up: {', '.join(methods)}")
            _warm_up(model, runner, methods, warm_tokens, constrained=any(constraints))
            for i, (p, tokens, c) in enumerate(zip(prompts, prompt_tokens, constraints), 1):
                rows = {}
                # rotate the order from prompt to prompt (and pass to pass):
                # whatever running first or second after another method costs
                # (measured: a few percent of decode time on the 2-core machine)
                # falls on every method alike
                k = (i - 1 + rep) % len(methods)
                for m in list(methods[k:]) + list(methods[:k]):
                    rows[m] = dict(runner.run(m, p.turn, tokens, max_tokens, c), n_prompt_tokens=len(tokens))
                for m in methods:
                    emit(_result_row(model, p, i, rep, m, rows[m], rows.get("none"), tokens, c))
                if out is not None:
                    out.flush()
                speeds = "  ".join(f"{m} {rows[m]['tokens_per_s']:.1f} tok/s" for m in methods)
                say(f"{tag}[{i:>{len(str(len(prompts)))}}/{len(prompts)}] {p.category:<14} {speeds}")
            # the acceptance model of each drafter after the pass: predicted
            # against observed acceptance per source (how well the cost gate's
            # inputs held)
            for m in methods:
                if not is_peer(m) and m != "none":
                    emit({"kind": "calibration", "method": m, "repeat": rep,
                          "rows": runner.engine(m).acceptance.report()})
        return head, results
    finally:
        if out is not None:
            out.close()
        runner.close()


# ------------------------------------------------------------------ report
def read_results(path: str) -> tuple[dict | None, list[dict]]:
    """Read a results file written by run_bench, plain or gzip-compressed
    (results.jsonl.gz, as the repository keeps them): (header or None, result dicts)."""
    if not os.path.isfile(path):
        raise BenchError(f"results file not found: {path}")
    head, results = None, []
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8")) as f:
            for lineno, rec in _json_objects(path, f):
                if rec.get("kind") == "header":
                    head = rec
                    continue
                if rec.get("kind") == "calibration":
                    results.append(rec)
                    continue
                missing = [k for k in ("category", "method", "n_generated", "decode_s") if k not in rec]
                if missing:
                    raise BenchError(f"{path}:{lineno}: not a bench result (missing {', '.join(missing)})")
                results.append(rec)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read results file {path}: {e}") from None
    if not results:
        raise BenchError(f"no results in {path}")
    return head, results


POOL_KEYS = ("model", "max_tokens", "raw", "n_threads", "cache_type_k", "kernels", "n_ctx", "n_gpu_layers",
             "cpu", "cost_gate", "max_nodes")
"""Header fields that must agree for results files to be reported together."""
POOL_DEFAULTS = {"kernels": "exact"}
"""What a header field absent from an older results file meant (before --kernels, every run was exact)."""


def _pool_key(r: dict):
    """(prompt, method, pass) of a result row; None for other rows (calibration)."""
    if r.get("kind", "result") != "result":
        return None
    return r.get("question_id"), r.get("method"), r.get("repeat", 0)


def _pool_value(head: dict, key: str):
    return head.get(key, POOL_DEFAULTS.get(key))


def read_results_pooled(paths: Sequence[str]) -> tuple[dict | None, list[dict]]:
    """Several results files of the same model and settings, reported as one
    (a bench stopped part way and completed with --category or --limit on the
    remaining prompts): the first file's header with "pooled" listing every
    file, and every file's rows.  Files whose headers differ in a POOL_KEYS
    field, or that hold the same prompt and method in the same pass, are an
    error: their rows would not be comparable."""
    head, results = read_results(paths[0])
    if len(paths) == 1:
        return head, results
    seen = {_pool_key(r) for r in results} - {None}
    pooled = [{"file": paths[0], "date": (head or {}).get("date")}]
    for path in paths[1:]:
        h, rows = read_results(path)
        if head is None or h is None:
            raise BenchError(f"{path if h is None else paths[0]}: no header, so it cannot be pooled with other runs")
        diff = [f"{k} ({_pool_value(h, k)} vs {_pool_value(head, k)})" for k in POOL_KEYS
                if _pool_value(h, k) != _pool_value(head, k)]
        if diff:
            raise BenchError(f"{path} and {paths[0]} differ in {', '.join(diff)}: runs with different models "
                             f"or settings cannot be pooled")
        for r in rows:
            k = _pool_key(r)
            if k is None:
                continue
            if k in seen:
                raise BenchError(f"{path}: prompt {k[0]} with {k[1]} is also in an earlier file; pool runs of "
                                 f"different prompts (bench --category / --limit)")
            seen.add(k)
        results += rows
        pooled.append({"file": path, "date": h.get("date")})
    return dict(head, pooled=pooled), results


def _is_edgespec(rows: list[dict]) -> bool:
    return any(r.get("n_steps") is not None for r in rows)


def method_stats(rows: list[dict]) -> dict:
    """Aggregate one method's results over a set of prompts."""
    n_tok = sum(max(0, r["n_generated"] - 1) for r in rows)
    dec = sum(r["decode_s"] for r in rows)
    st = {"n": len(rows), "tokens_per_s": n_tok / dec if dec > 0 else 0.0,
          "mean_accepted": None, "engine_ms_per_step": None, "decode_ms_per_step": None,
          "identical": None, "n_compared": 0}
    steps = [r for r in rows if r.get("n_steps")]
    if steps:
        n_steps = sum(r["n_steps"] for r in steps)
        committed = sum(r["mean_accepted"] * r["n_steps"] for r in steps)
        st["mean_accepted"] = committed / n_steps
        eng = [r["engine_s"] / r["n_steps"] * 1000 for r in steps if r.get("engine_s") is not None]
        if eng:
            st["engine_ms_per_step"] = sum(eng) / len(eng)
        dc = [r["decode_call_s"] / r["n_steps"] * 1000 for r in steps if r.get("decode_call_s") is not None]
        if dc:
            st["decode_ms_per_step"] = sum(dc) / len(dc)
    cmp = [r["identical_to_none"] for r in rows if r.get("identical_to_none") is not None]
    if cmp:
        st["identical"] = sum(1 for x in cmp if x)
        st["n_compared"] = len(cmp)
    rl = [r["rouge_l_to_none"] for r in rows if r.get("rouge_l_to_none") is not None]
    st["rouge_l"] = sum(rl) / len(rl) if rl else None
    checked = [r["valid"] for r in rows if r.get("valid") is not None]   # constrained prompts' answers
    st["valid"] = sum(1 for x in checked if x) if checked else None
    st["n_checked"] = len(checked)
    return st


def pass_speedups(rows: list[dict], method: str) -> list[float]:
    """The method's speedup over `none` in each pass (bench --repeat) on its own."""
    out = []
    for rep in sorted({r.get("repeat", 0) for r in rows}):
        here = [r for r in rows if r.get("repeat", 0) == rep]
        a = method_stats([r for r in here if r["method"] == method])
        b = method_stats([r for r in here if r["method"] == "none"])
        if a["n"] and b["n"] and b["tokens_per_s"] > 0:
            out.append(a["tokens_per_s"] / b["tokens_per_s"])
    return out


CI_MIN_UNITS = 4
"""Fewest (prompt, pass) runs for which the report gives a confidence interval."""


def speedup_ci(rows: list[dict], method: str, level: float = 0.95, n_boot: int = 2000,
               seed: int = 0) -> tuple[float, float] | None:
    """A bootstrap confidence interval of the method's speedup over `none`.

    The unit is one (prompt, pass) pair with both runs, so each resample keeps
    a run beside the `none` run it was timed against.  With several passes the
    units are resampled within each prompt: the interval then says how far
    machine noise moves the speedup on these prompts (the drafts are the same
    in every pass).  With one pass the prompts themselves are resampled, so
    the interval also holds the spread between prompts.  The statistic is the
    pooled speedup, sum(tokens) / sum(decode_s) over sum(tokens) / sum(decode_s)
    of `none`, as in the tables.  None when fewer than CI_MIN_UNITS units."""
    def key(r):
        return r.get("question_id", r.get("prompt_index")), r.get("repeat", 0)

    base = {key(r): r for r in rows if r["method"] == "none" and key(r)[0] is not None}
    units: dict = {}
    several = len({k[1] for k in base}) > 1
    for r in rows:
        k = key(r)
        if r["method"] == method and k in base:
            b = base[k]
            units.setdefault(k[0] if several else None, []).append(
                (max(0, r["n_generated"] - 1), r["decode_s"], max(0, b["n_generated"] - 1), b["decode_s"]))
    if sum(len(v) for v in units.values()) < CI_MIN_UNITS:
        return None
    rng = np.random.default_rng(seed)
    tot = np.zeros((n_boot, 4))
    for group in units.values():
        a = np.asarray(group, np.float64)
        pick = rng.integers(0, len(a), size=(n_boot, len(a)))
        tot += a[pick].sum(axis=1)
    ok = (tot[:, 1] > 0) & (tot[:, 2] > 0)
    sp = (tot[ok, 0] / tot[ok, 1]) / (tot[ok, 2] / tot[ok, 3])
    if len(sp) == 0:
        return None
    lo, hi = np.quantile(sp, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _table(title: str, rows: list[dict], methods: list[str]) -> list[str]:
    by_m = {m: [r for r in rows if r["method"] == m] for m in methods}
    stats = {m: method_stats(v) for m, v in by_m.items() if v}
    n_prompts = max((len({r.get("question_id", i) for i, r in enumerate(v)}) for v in by_m.values()), default=0)
    n_passes = len({r.get("repeat", 0) for r in rows})
    base = stats.get("none")
    lossy = any(s.get("rouge_l") is not None and s["identical"] != s["n_compared"] for s in stats.values())
    checked = any(s.get("valid") is not None for s in stats.values())
    cols = ("method", "tok/s", "acc/step", "speedup", "95% CI") + (("passes",) if n_passes > 1 else ()) + \
        ("identical",) + (("valid",) if checked else ()) + \
        (("ROUGE-L",) if lossy else ()) + ("engine ms/step", "decode ms/step")
    body = []
    for m in methods:
        if m not in stats:
            continue
        s = stats[m]
        speed = (f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}x"
                 if base and base["tokens_per_s"] > 0 else "-")
        ci = speedup_ci(rows, m) if base and m != "none" else None
        ci_s = f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-"
        spread = ()
        if n_passes > 1:
            ps = pass_speedups(rows, m) if base and m != "none" else []
            spread = (f"{min(ps):.2f}-{max(ps):.2f}" if ps else "-",)
        ident = "-" if m == "none" or s["identical"] is None else f"{s['identical']}/{s['n_compared']}"
        valid = (("-" if s.get("valid") is None else f"{s['valid']}/{s['n_checked']}"),) if checked else ()
        body.append((m, f"{s['tokens_per_s']:.1f}",
                     "-" if s["mean_accepted"] is None else f"{s['mean_accepted']:.2f}",
                     speed, ci_s) + spread + (ident,) + valid +
                    ((("-" if s.get("rouge_l") is None else f"{s['rouge_l']:.3f}"),) if lossy else ()) + (
                     "-" if s["engine_ms_per_step"] is None else f"{s['engine_ms_per_step']:.2f}",
                     "-" if s["decode_ms_per_step"] is None else f"{s['decode_ms_per_step']:.2f}"))
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(cols)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    passes = f" x {n_passes} passes" if n_passes > 1 else ""
    lines = [f"{title} ({n_prompts} prompt{'s' if n_prompts != 1 else ''}{passes})", fmt(cols),
             fmt(["-" * w for w in widths])]
    lines += [fmt(b) for b in body]
    return lines


def format_report(results: Iterable[dict], head: dict | None = None) -> str:
    """Tables per category (in order of first appearance) and over all prompts.

    tok/s: decode tokens per second, sum(n_generated - 1) / sum(decode_s).
    acc/step: tokens committed per verification step (edgespec methods).
    speedup: tok/s over the tok/s of `none` on the same prompts.
    95% CI: a bootstrap interval of the speedup (see speedup_ci): with
        several passes, how far the machine's noise moves it on these
        prompts; with one pass, across prompts as well.
    passes (with bench --repeat): the lowest and highest speedup of a single
        pass, each pass on its own.
    identical: runs whose output equals `none`'s in the same pass (tokens for
        edgespec and llama-server methods, text for llama-cpp-python methods),
        as k/n.
    valid (when prompts carry a json_schema or grammar): answers of the
        constrained prompts that follow it (parse as JSON and follow the
        schema, or the grammar accepts them whole), as k/n.
    engine ms/step: edgespec's own time per step outside llama_decode
        (drafting, gate, verification, bookkeeping), averaged over prompts;
    decode ms/step: time inside llama_decode per step, averaged over prompts.
    """
    results = list(results)
    calib = [r for r in results if r.get("kind") == "calibration"]
    results = [r for r in results if r.get("kind", "result") == "result"]
    methods, cats = methods_and_categories(results)
    out: list[str] = []
    if head:
        out.append(f"model: {head.get('model')}")
        out.append(f"machine: {head.get('cpu')} ({head.get('hostname')}), {head.get('n_threads')} threads, "
                   f"n_ctx {head.get('n_ctx')}, n_gpu_layers {head.get('n_gpu_layers')}, "
                   f"K cache {head.get('cache_type_k', 'f16')}, "
                   + (f"kernels {head['kernels']}, " if head.get("kernels", "exact") != "exact" else "") +
                   f"llama_cpp {head.get('llama_cpp_version')}, {head.get('date')}")
        if head.get("rpc"):
            rtt = head.get("rpc_hello_ms") or {}
            out.append("RPC workers: " + ", ".join(f"{ep} (HELLO {rtt[ep]:.1f} ms)" if rtt.get(ep) is not None
                                                   else ep for ep in head["rpc"])
                       + (f", split {':'.join(f'{x:g}' for x in head['tensor_split'])}" if head.get("tensor_split")
                          else "")
                       + (f"; llama-server's: {', '.join(head['peer_rpc'])}" if head.get("peer_rpc") else ""))
        reps = int(head.get("repeat", 1) or 1)
        out.append(f"max_tokens {head.get('max_tokens')}, greedy decoding" +
                   (", raw prompts (no chat template)" if head.get("raw") else "") +
                   (f", {reps} passes (each a fresh session)" if reps > 1 else ""))
        out.append(_exact_line(head))
        if head.get("kernel_price"):
            from edgespec.calibration.kernelchoice import KernelPrice
            out.append("kernels auto: " + KernelPrice.from_json(head["kernel_price"]).describe())
        if head.get("constrained"):
            out.append(constraint_line(head["constrained"]))
        out += peer_header_lines(head)
        if head.get("pooled"):
            out.append(f"pooled from {len(head['pooled'])} runs (each prompt's methods side by side in one of them): "
                       + ", ".join(f"{os.path.basename(p['file'])} ({p['date']})" for p in head["pooled"]))
        out.append("")
    for c in cats:
        out += _table(c, [r for r in results if r["category"] == c], methods)
        out.append("")
    out += _table("all", results, methods)
    few = [c for c in cats if len({r.get("question_id") for r in results if r["category"] == c}) < 5]
    if few and len({r.get("repeat", 0) for r in results}) == 1 and "none" in methods:
        out += ["", f"note: {len(few)} categor{'y has' if len(few) == 1 else 'ies have'} fewer than 5 prompts "
                    f"({', '.join(few)}); on a busy machine their speedups can move by 0.1x or more from run "
                    f"to run: --repeat N runs every prompt N times and shows the spread"]
    out += divergence_lines(results, head)
    if calib:
        out += ["", "acceptance calibration (draft nodes whose parent was accepted; predicted = the gate's "
                    "estimate, observed = share accepted)",
                f"{'method':<20} {'source':<10} {'tested':>8} {'predicted':>10} {'observed':>9}"]
        agg: dict = {}          # (method, source) over every pass
        for c in calib:
            for row in c["rows"]:
                a = agg.setdefault((c["method"], row["source"]), [0, 0.0, 0.0])
                a[0] += row["tested"]
                a[1] += row["predicted"] * row["tested"]
                a[2] += row["observed"] * row["tested"]
        for (m, src), (n, pr, ob) in agg.items():
            out.append(f"{m:<20} {src:<10} {n:>8} {pr / n:>10.3f} {ob / n:>9.3f}")
    return "\n".join(out)


def constraint_line(c: dict) -> str:
    """The report header's line on constrained prompts (the header's "constrained")."""
    kinds = [f"{c[k]} by a {what}" for k, what in (("json_schema", "JSON schema"), ("grammar", "GBNF grammar")) if c.get(k)]
    return (f"constrained: {c['json_schema'] + c['grammar']} of {c['n_prompts']} prompts ({', '.join(kinds)}); every "
            f"method decodes under the same grammar, `valid` counts the answers that follow it")


def peer_header_lines(head: dict) -> list[str]:
    """What method `default` resolved to and which llama-server ran, for the report's header."""
    out = []
    d = head.get("default")
    if d:
        out.append(f"default = `edgespec generate` with no options: drafter {d['generate_drafter']}, kernels "
                   f"{d['kernels']}, K cache {d['cache_type_k']}, {d['n_threads']} threads, n_ctx {d['n_ctx']}, "
                   f"max_nodes {d['max_nodes']}, cost gate {'on' if d['cost_gate'] else 'off'}")
    srv = head.get("llama_server")
    if srv:
        b = srv["binary"]
        same = (f"built from llama-cpp-python {b['llama_cpp_python']}'s llama.cpp" if b.get("same_as_llama_cpp_python")
                else "not built by edgespec build-peers (its llama.cpp unchecked)")
        out.append(f"llama-server: {b['version']}, {same}; " + ", ".join(
            f"{m} {s['threads']} thread{'s' if s['threads'] != 1 else ''}" for m, s in srv["methods"].items()))
    return out


def _exact_line(head: dict) -> str:
    ex = head.get("exactness")
    if head.get("exact") is None or not ex:
        return "exact: not checked (the exactness self-check did not run)"
    if ex["exact"]:
        return (f"exact: true (self-check: batches of 2..{ex['max_t']} tokens gave logits bit-identical "
                f"to one-token decoding)")
    return (f"exact: FALSE (self-check: batches of {', '.join(map(str, ex['failed']))} tokens differ from "
            f"one-token decoding by up to {ex['max_abs_diff']:.3g}; greedy text can differ at near-ties)")


def divergence_lines(results: list[dict], head: dict | None) -> list[str]:
    """The divergences of exact edgespec methods from `none`, each with its
    logit gap, set against the self-check: a gap wider than twice its largest
    |logit difference| (or any gap when the check found the model exact) is
    no near-tie that batched arithmetic explains."""
    rows = [r for r in results if r.get("divergence")]
    ex = (head or {}).get("exactness") or {}
    bound = 2 * float(ex.get("max_abs_diff", 0.0)) if ex else None
    compared = [r for r in results if r.get("identical_to_none") is not None and r["method"] != "none"
                and not is_peer(r["method"]) and r.get("verify", "exact") == "exact"]
    if not compared:
        return []
    out = ["", f"divergences from none: {len(rows)} of {len(compared)} runs of exact edgespec methods"
               + (" (gap = none's top logit minus the logit of the method's token, re-decoded plainly)" if rows else "")]
    for r in rows:
        d = r["divergence"]
        tok = "end of answer" if d["token"] is None else f"token {d['token']}"
        if d["gap"] is None:
            verdict = "the grammar rejects the method's token there: look for a bug"
        elif not d.get("reproduced", True):
            verdict = "re-decoding did not reproduce none's token: look for a bug"
        elif bound is None:
            verdict = "no self-check to compare with"
        elif d["gap"] <= bound:
            verdict = f"near-tie (<= 2 x the self-check's {bound / 2:.3g})"
        else:
            verdict = (f"NOT a near-tie batched arithmetic explains (self-check max |dlogit| {bound / 2:.3g}): "
                       "look for a bug")
        out.append(f"  {r['method']:<18} q{r.get('question_id')} ({r.get('category')}), pass {r.get('repeat', 0)}, "
                   f"at token {d['index']} ({tok} instead of {d['none_token']}): gap {_gap(d['gap'])}, "
                   f"top-2 gap {_gap(d['top2_gap'])}: {verdict}")
    return out


def _gap(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def methods_and_categories(results: list[dict]) -> tuple[list[str], list[str]]:
    """The methods and the categories of result rows, each in first-seen order."""
    return list(dict.fromkeys(r["method"] for r in results)), list(dict.fromkeys(r["category"] for r in results))


def plot_results(results: Iterable[dict], path: str, head: dict | None = None) -> None:
    """Decode tokens/s by category (and over all prompts) and method, as
    grouped bars, into an image file (matplotlib: the `plot` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'edgespec[plot]'") from None
    results = [r for r in results if r.get("kind", "result") == "result"]
    methods, cats = methods_and_categories(results)
    cats.append("all")
    speeds = np.array([[method_stats([r for r in results if r["method"] == m and c in ("all", r["category"])])
                        ["tokens_per_s"] for c in cats] for m in methods])
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6.0, (0.5 + 0.12 * len(methods)) * len(cats) + 3), 4.5))
    x = np.arange(len(cats))
    for i, m in enumerate(methods):
        ax.bar(x + (i - (len(methods) - 1) / 2) * width, speeds[i], width, label=m)
    ax.set_xticks(x)
    ax.set_xticklabels(cats, rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s")
    title = os.path.basename(str((head or {}).get("model", "")))
    if head:
        title += f"\n{head.get('cpu')}, {head.get('n_threads')} threads, K cache {head.get('cache_type_k')}, " \
                 f"max_tokens {head.get('max_tokens')}"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot write the plot {path}: {e}") from None
    finally:
        plt.close(fig)


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
