"""Drafters: cheap proposers of draft trees (no draft model)."""
from __future__ import annotations

import inspect

from .base import Drafter, StepResult
from .suffix import SuffixConfig, SuffixDrafter

NAMES = ("none", "suffix", "trigram", "adjacency", "auto")
"""Every drafter `make_drafter` knows, in the order the CLI lists them."""


def _drafter_class(name: str):
    if name == "suffix":
        return SuffixDrafter, SuffixConfig
    if name == "trigram":
        from .trigram import TrigramConfig, TrigramDrafter
        return TrigramDrafter, TrigramConfig
    if name == "adjacency":
        from .adjacency import AdjacencyConfig, AdjacencyDrafter
        return AdjacencyDrafter, AdjacencyConfig
    if name == "auto":
        from .hybrid import HybridConfig, HybridDrafter
        return HybridDrafter, HybridConfig
    raise ValueError(f"unknown drafter {name!r}; known drafters: {', '.join(NAMES)}")


NO_CORPUS_SUFFIX = "-nocorpus"


def split_drafter_name(name: str) -> tuple[str, bool]:
    """"suffix" -> ("suffix", True); "suffix-nocorpus" -> ("suffix", False): the
    second form runs the drafter without the loaded corpora (for side-by-side
    comparisons in one bench run)."""
    if name.endswith(NO_CORPUS_SUFFIX):
        return name[:-len(NO_CORPUS_SUFFIX)], False
    return name, True


def check_drafter_name(name: str) -> None:
    """Raise ValueError unless `name` (optionally with -nocorpus) is a drafter."""
    base, _ = split_drafter_name(name)
    if base not in NAMES:
        raise ValueError(f"unknown drafter {name!r}; known drafters: {', '.join(NAMES)} "
                         f"(add {NO_CORPUS_SUFFIX} to run one without the loaded corpora)")


def make_drafter(name: str, *, n_vocab: int | None = None, corpora=(), **kw) -> Drafter:
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
    corpora: compiled corpora (edgespec.corpus.Corpus) for drafters that use them.
    Other keywords are fields of the drafter's config, e.g.
    make_drafter("suffix", max_nodes=32).
    """
    if name == "none":
        if kw:
            raise ValueError(f"drafter 'none' takes no settings, got {sorted(kw)}")
        return Drafter()
    cls, config_cls = _drafter_class(name)
    config = config_cls(**kw)
    params = inspect.signature(cls).parameters
    args = {"config": config}
    if "corpora" in params:
        args["corpora"] = tuple(corpora)
    if "n_vocab" in params:
        if n_vocab is None:
            raise ValueError(f"drafter {name!r} needs n_vocab (the model's vocabulary size)")
        args["n_vocab"] = int(n_vocab)
    return cls(**args)


__all__ = ["Drafter", "NAMES", "check_drafter_name", "split_drafter_name", "StepResult", "SuffixConfig", "SuffixDrafter", "make_drafter"]
