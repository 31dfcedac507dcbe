"""Drafters: cheap proposers of draft trees (no draft model)."""
from __future__ import annotations

import inspect

from edgespec.errors import ConfigError, EdgespecError
from edgespec.drafters.base import Drafter, StepResult
from edgespec.drafters.suffix import SuffixConfig, SuffixDrafter

NAMES = ("none", "suffix", "trigram", "adjacency", "auto")
"""Every drafter `make_drafter` knows, in the order the CLI lists them."""


def _drafter_class(name: str):
    if name == "suffix":
        return SuffixDrafter, SuffixConfig
    if name == "trigram":
        from edgespec.drafters.trigram import TrigramConfig, TrigramDrafter
        return TrigramDrafter, TrigramConfig
    if name == "adjacency":
        from edgespec.drafters.adjacency import AdjacencyConfig, AdjacencyDrafter
        return AdjacencyDrafter, AdjacencyConfig
    if name == "auto":
        from edgespec.drafters.hybrid import HybridConfig, HybridDrafter
        return HybridDrafter, HybridConfig
    raise ConfigError(f"unknown drafter {name!r}; known drafters: {', '.join(NAMES)}")


NO_CORPUS_SUFFIX = "-nocorpus"


def _fields(name: str, types) -> list[str]:
    """The config fields of a drafter whose type is one of `types`."""
    if name == "none":
        return []
    import dataclasses
    _, config_cls = _drafter_class(name)
    return [f.name for f in dataclasses.fields(config_cls) if f.type in types]


def _bool_fields(name: str) -> list[str]:
    """The on/off switches of a drafter's config (its bool fields)."""
    return _fields(name, ("bool", bool))


def parse_drafter_name(name: str) -> tuple[str, bool, dict]:
    """Split a drafter spec into (drafter, use_corpora, config settings).

    "auto"                         -> ("auto", True, {})
    "suffix-nocorpus"              -> ("suffix", False, {}): without the loaded corpora
    "auto-notrigram-noadjacency"   -> ("auto", True, {"trigram": False, "adjacency": False})
    "auto+aasd"                    -> ("auto", True, {"aasd": True})
    "auto+copy_len=30"             -> ("auto", True, {"copy_len": 30})

    `-noX` / `+X` switch the bool field X of the drafter's config off / on, and
    `+X=V` sets its int or float field X (V may not contain '-' or '+'), so one
    bench run can hold an ablation side by side.  Raises ValueError for an
    unknown drafter, switch or setting (a ConfigError, which is a ValueError)."""
    import re
    parts = re.split(r"(?=[-+])", name)
    base = parts[0]
    if base not in NAMES:
        raise ConfigError(f"unknown drafter {name!r}; known drafters: {', '.join(NAMES)} "
                         f"(add {NO_CORPUS_SUFFIX} to run one without the loaded corpora, "
                         f"-noX / +X to switch a component X off / on)")
    use_corpora, switches = True, {}
    fields = _bool_fields(base)
    numeric = {f: t for t, cls in (("int", int), ("float", float)) for f in _fields(base, (t, cls))}
    for p in parts[1:]:
        if p == NO_CORPUS_SUFFIX:
            use_corpora = False
            continue
        on = p.startswith("+")
        if on and "=" in p:
            field, _, value = p[1:].partition("=")
            if field not in numeric:
                raise ValueError(f"drafter spec {name!r}: {field!r} is not a numeric setting of {base!r} "
                                 f"(its settings: {', '.join(numeric) or 'none'})")
            try:
                switches[field] = int(value) if numeric[field] == "int" else float(value)
            except ValueError:
                raise ValueError(f"drafter spec {name!r}: {value!r} is not a valid {numeric[field]} "
                                 f"for {field!r}") from None
            continue
        field = p[1:] if on else (p[3:] if p.startswith("-no") else "")
        if field not in fields:
            known = ", ".join(fields) or "none"
            raise ConfigError(f"drafter spec {name!r}: {p!r} is not a switch of {base!r} "
                             f"(its switches: {known}; and -nocorpus)")
        switches[field] = on
    return base, use_corpora, switches


def make_drafter(name: str, *, n_vocab: int | None = None, corpora=(), model_path: str | None = None,
                 memory_store=None, **kw) -> Drafter:
    """Build a drafter by name.

    "none"       the base Drafter, which proposes nothing
    "suffix"     SuffixDrafter: matches in the prompt, the generation so far and
                 the corpora
    "trigram"    TrigramDrafter: tri-gram matrix searched with MCTS (ADED)
    "adjacency"  AdjacencyDrafter: successor table refreshed from the model's
                 top-k (Token Recycling)
    "auto"       HybridDrafter: the three above merged into one tree, retrieval
                 first; the engine's gate keeps what pays

    n_vocab: the model's vocabulary size (needed by trigram and adjacency).
    corpora: compiled corpora (edgespec.corpus.format.Corpus) for drafters that use them.
    model_path: the GGUF, for drafters that read the model's token embeddings
        (auto's semantic fallback; without it that part is left out).
    memory_store: a MemoryStore of earlier requests (edgespec.memory), for
        the drafters that draft from one (suffix, auto; their `memory`
        switch, `suffix-nomemory`, leaves it out).
    Other keywords are fields of the drafter's config, e.g.
    make_drafter("suffix", max_nodes=32).
    """
    if name == "none":
        if kw:
            raise ConfigError(f"drafter 'none' takes no settings, got {sorted(kw)}")
        return Drafter()
    cls, config_cls = _drafter_class(name)
    try:
        config = config_cls(**kw)
    except ValueError as e:      # the config classes check their own fields
        if isinstance(e, EdgespecError):
            raise
        raise ConfigError(f"drafter {name!r}: {e}") from None
    params = inspect.signature(cls).parameters
    args = {"config": config}
    if "corpora" in params:
        args["corpora"] = tuple(corpora)
    if "n_vocab" in params:
        if n_vocab is None:
            raise ConfigError(f"drafter {name!r} needs n_vocab (the model's vocabulary size)")
        args["n_vocab"] = int(n_vocab)
    if "model_path" in params:
        args["model_path"] = model_path
    if "memory" in params:
        args["memory"] = memory_store
    return cls(**args)


__all__ = ["Drafter", "NAMES", "parse_drafter_name", "StepResult", "SuffixConfig", "SuffixDrafter", "make_drafter"]
