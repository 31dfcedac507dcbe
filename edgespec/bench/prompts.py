"""Bench prompts: the prompts file (JSON lines), each prompt's constraint,
and the checks that a constraint can be decoded under and checked.

Constraints: a prompt line may carry `json_schema` (a JSON schema object) or
`grammar` (GBNF text) that its answer must follow.  Every method then runs
under the same grammar (the GBNF edgespec derives, see Constraint): edgespec's
through SpecModel.generate(json_schema=, grammar=), llama-cpp-python's with
grammar=LlamaGrammar, llama-server's in the request's grammar field.  Each
row of such a prompt records whether its answer follows the constraint
("valid", checked apart from the grammar: see edgespec.bench.answers), and
the report counts them per method.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Sequence

from edgespec.bench.answers import SCHEMA_CHECKED, grammar_answer_error, json_answer_error, json_type, unchecked_keywords
from edgespec.errors import BenchError

MAX_PROMPTS_BYTES = 64 << 20     # Spec-Bench's 480 questions take 0.7 MB


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


def json_objects(path: str, lines):
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
    for lineno, rec in json_objects(path, lines):
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
        return f"`json_schema` must be a JSON object (a JSON schema), not {json_type(schema)}"
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


def constraint_summary(prompts: Sequence[BenchPrompt]) -> dict | None:
    """The header's record of the prompts' constraints; None when there are none."""
    n_schema = sum(p.json_schema is not None for p in prompts)
    n_grammar = sum(p.grammar is not None for p in prompts)
    if not n_schema and not n_grammar:
        return None
    return {"json_schema": n_schema, "grammar": n_grammar, "n_prompts": len(prompts),
            "peers_get": "the GBNF edgespec derives (llama-cpp-python: grammar=LlamaGrammar; llama-server: "
                         "the request's grammar field)"}
