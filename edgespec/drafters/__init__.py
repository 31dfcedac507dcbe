"""Drafters: cheap proposers of draft trees (no draft model).

The registry (drafters/registry.py) lists them; the spec language
(drafters/spec.py) names one with its switches; `make_drafter` builds one.
"""
from __future__ import annotations

from edgespec.drafters.base import Drafter, StepResult
from edgespec.drafters.registry import NAMES, REGISTRY, make_drafter
from edgespec.drafters.spec import NO_CORPUS_SUFFIX, parse_drafter_name
from edgespec.drafters.suffix import SuffixConfig, SuffixDrafter

__all__ = ["Drafter", "NAMES", "NO_CORPUS_SUFFIX", "REGISTRY", "StepResult", "SuffixConfig", "SuffixDrafter",
           "make_drafter", "parse_drafter_name"]
