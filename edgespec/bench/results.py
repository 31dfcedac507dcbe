"""Reading bench results files (JSON lines, plain or gzip), one at a time or
several runs of the same model and settings pooled into one."""
from __future__ import annotations

import gzip
import os
from typing import Sequence

from edgespec.bench.prompts import json_objects
from edgespec.errors import BenchError


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
            for lineno, rec in json_objects(path, f):
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
