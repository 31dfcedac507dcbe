"""Drafter specs with an engine mode: `auto+aasd@relaxed`, `suffix@hold4`, `suffix@free`.

A spec is a drafter name with switches (drafters.parse_drafter_name) and,
after '@', a setting of the engine that runs it: a verification mode
(core/verify.py), a held batch width (EngineConfig.hold_width), `free`, the
gate's own choice every step without the width chosen by cost
(EngineConfig.hold_choice off), or `holdcost`, that choice on (the default
since 2026-11-28; the name stays for the results files that used it).  The app
resolves both halves (app/engines.py), so the drafters know nothing of the
engine.
"""
from __future__ import annotations

from edgespec.core.verify import VerifyConfig
from edgespec.drafters import Drafter, make_drafter, parse_drafter_name


def split_verify(spec: str) -> tuple[str, str | None]:
    """'auto+aasd@relaxed' -> ('auto+aasd', 'relaxed'): a drafter spec and the
    verification mode after '@' (None without one), 'holdN', a held batch
    width of N tokens (EngineConfig.hold_width), or 'holdcost' / 'free', the
    width chosen by cost on or off (EngineConfig.hold_choice); ConfigError
    for an unknown mode."""
    base, sep, mode = spec.partition("@")
    if sep and not hold_width(mode) and mode not in (HOLD_COST, HOLD_FREE):
        VerifyConfig(mode)
    return base, (mode if sep else None)


HOLD_COST = "holdcost"
HOLD_FREE = "free"


def engine_settings(mode: str | None) -> dict:
    """The EngineConfig fields an '@mode' sets: {} for none."""
    if not mode:
        return {}
    if mode in (HOLD_COST, HOLD_FREE):
        return {"hold_choice": mode == HOLD_COST}
    if hold_width(mode):        # wider than max_nodes: EngineConfig's ConfigError
        return {"hold_width": hold_width(mode)}
    return {"verify": VerifyConfig(mode)}


def hold_width(mode: str | None) -> int:
    """N of an '@holdN' mode (2..256), else 0."""
    if mode and mode.startswith("hold") and mode[4:].isdigit() and 2 <= int(mode[4:]) <= 256:
        return int(mode[4:])
    return 0


def check_drafter_name(name: str) -> None:
    """Raise ValueError unless `name` is a drafter spec, with an optional
    '@mode' (see parse_drafter_name, split_verify)."""
    parse_drafter_name(split_verify(name)[0])


def drafter_from_spec(spec: str, *, n_vocab: int | None = None, model_path: str | None = None,
                      corpora=(), memory_store=None) -> tuple[Drafter, str | None]:
    """The drafter a spec names, built with the loaded corpora unless it says
    -nocorpus (and the memory store, for the drafters that use one), and the
    verification mode it asks for (None: the caller's)."""
    base, mode = split_verify(spec)
    name, use_corpora, switches = parse_drafter_name(base)
    return make_drafter(name, n_vocab=n_vocab, model_path=model_path, corpora=corpora if use_corpora else (),
                        memory_store=memory_store, **switches), mode
