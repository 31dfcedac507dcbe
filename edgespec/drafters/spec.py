"""The drafter spec language: a registry name with switches.

"auto"                         -> ("auto", True, {})
"suffix-nocorpus"              -> ("suffix", False, {}): without the loaded corpora
"auto-notrigram-noadjacency"   -> ("auto", True, {"trigram": False, "adjacency": False})
"auto+aasd"                    -> ("auto", True, {"aasd": True})
"auto+copy_len=30"             -> ("auto", True, {"copy_len": 30})

`-noX` / `+X` switch the bool field X of the drafter's config, or its
plug-in X, off / on, and `+X=V` sets the int or float field X of its config
or of a plug-in's (V may not contain '-' or '+'), so one bench run can hold
an ablation side by side.  The switches are the config classes' fields and
the plug-ins' names, read through the registry (drafters/registry.py).  An engine
mode after '@' is the app's (run/specs.py).
"""
from __future__ import annotations

import re

from edgespec.errors import ConfigError
from edgespec.drafters.registry import NAMES, entry

NO_CORPUS_SUFFIX = "-nocorpus"


def parse_drafter_name(name: str) -> tuple[str, bool, dict]:
    """Split a drafter spec into (drafter, use_corpora, config settings).
    Raises ValueError for an unknown drafter, switch or setting (a
    ConfigError, which is a ValueError)."""
    parts = re.split(r"(?=[-+])", name)
    base = parts[0]
    if base not in NAMES:
        raise ConfigError(f"unknown drafter {name!r}; known drafters: {', '.join(NAMES)} "
                          f"(add {NO_CORPUS_SUFFIX} to run one without the loaded corpora, "
                          f"-noX / +X to switch a component X off / on)")
    e = entry(base)
    use_corpora, switches = True, {}
    for p in parts[1:]:
        if p == NO_CORPUS_SUFFIX:
            use_corpora = False
        elif p.startswith("+") and "=" in p:
            field, _, value = p[1:].partition("=")
            switches[field] = _number(name, e, field, value)
        else:
            field = _switch(name, base, p, e.switches())
            switches[field] = p.startswith("+")
    return base, use_corpora, switches


def _number(name: str, e, field: str, value: str) -> int | float:
    kind = e.setting_type(field)
    if kind is None:
        raise ValueError(f"drafter spec {name!r}: {field!r} is not a numeric setting of {e.name!r} "
                         f"(its settings: {', '.join(e.numeric()) or 'none'})")
    try:
        return int(value) if kind == "int" else float(value)
    except ValueError:
        raise ValueError(f"drafter spec {name!r}: {value!r} is not a valid {kind} "
                         f"for {field!r}") from None


def _switch(name: str, base: str, part: str, fields: list[str]) -> str:
    field = part[1:] if part.startswith("+") else (part[3:] if part.startswith("-no") else "")
    if field not in fields:
        raise ConfigError(f"drafter spec {name!r}: {part!r} is not a switch of {base!r} "
                          f"(its switches: {', '.join(fields) or 'none'}; and -nocorpus)")
    return field
