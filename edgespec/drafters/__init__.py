"""Drafters: cheap proposers of draft trees (no draft model)."""
from __future__ import annotations

from .base import Drafter, StepResult
from .suffix import SuffixConfig, SuffixDrafter

_FACTORIES = {
    "none": lambda **kw: Drafter(**kw),
    "suffix": lambda **kw: SuffixDrafter(SuffixConfig(**kw)),
}


def make_drafter(name: str, **kw) -> Drafter:
    """Build a drafter by name.

    "none"    the base Drafter, which proposes nothing (takes no keywords)
    "suffix"  SuffixDrafter; keywords are SuffixConfig fields, e.g.
              make_drafter("suffix", max_nodes=32)
    """
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown drafter {name!r}; known drafters: {', '.join(sorted(_FACTORIES))}"
        ) from None
    return factory(**kw)


__all__ = ["Drafter", "StepResult", "SuffixConfig", "SuffixDrafter", "make_drafter"]
