"""From a MODEL name to a checked GGUF path: the one call the API, the command line and the tools make.

It sits on top of the package: edgespec.models.sources turns the name into a
path (the benchmark models of edgespec.models.zoo among them) and
edgespec.models.gguf checks the file before llama.cpp sees it.
"""
from __future__ import annotations

from edgespec.models.gguf import check_gguf


def resolve_model(path: str | None) -> str:
    """The model to load: any MODEL name edgespec.models.sources resolves (a
    GGUF path or folder, hf://user/repo[:QUANT], an Ollama or LM Studio name,
    a benchmark model's name) or the default; checked with check_gguf."""
    from edgespec.models.sources import resolve   # here, not at import: `edgespec --help` starts without it

    p = resolve(path)
    check_gguf(p)
    return p
