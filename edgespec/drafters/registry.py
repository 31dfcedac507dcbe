"""The drafter registry: every drafter `make_drafter` builds, in one table.

An entry names a drafter, says in one line what it proposes, where its class
and config class live, and what the app must hand its constructor.  The CLI's
names and help, the spec language's switches (drafters/spec.py),
`make_drafter` and the table in docs/drafters.md are read from it, so adding
a drafter is its module, its entry here and its test.

The classes are named by "module:Class" and imported when a drafter is
built: listing the names (every CLI start) imports no drafter module and
none of their numba kernels.

A drafter's plug-ins (PlugIn) are mechanisms off its product path (the
suffix drafter's position EMA, ReSpec's feedback, the learned edits), each
with its own config class: a spec switches one on by its name (`+edits`) and
sets its fields as the drafter's own (`+edit_gap=4`), so the spec strings
results files record keep their meaning while the drafter's config holds
only what it uses by default and what a user tunes.  A plug-in's modules are
imported only when a spec switches it on or names one of its settings.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

from edgespec.errors import ConfigError, EdgespecError

RESOURCES = ("n_vocab", "corpora", "model_path", "memory")
"""What a drafter's constructor may take besides its config: the model's
vocabulary size, the compiled corpora, the GGUF's path (for its token
embeddings) and the memory store of earlier requests."""


@dataclass(frozen=True)
class PlugIn:
    """name: its switch; cls / config: "module:Class" of the mechanism (built
    with its config) and of its settings."""
    name: str
    cls: str
    config: str

    def load(self) -> tuple[type, type]:
        return _import(self.cls), _import(self.config)

    def field_types(self) -> dict:
        """{field: its type's name} of its settings (imports its config's module)."""
        return {f.name: _type_name(f.type) for f in dataclasses.fields(self.load()[1])}


def _type_name(t) -> str:
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


@dataclass(frozen=True)
class DrafterEntry:
    """name: the spec's base name; summary: one line for the CLI and docs;
    cls / config: "module:Class" (config "" for a drafter without settings);
    takes: the RESOURCES its constructor accepts, as keyword arguments;
    plugins: its PlugIns, in the order the drafter calls them (its
    constructor takes the built ones as `plugins`)."""
    name: str
    summary: str
    cls: str
    config: str = ""
    takes: tuple[str, ...] = ()
    plugins: tuple[PlugIn, ...] = ()

    def __post_init__(self):
        unknown = set(self.takes) - set(RESOURCES)
        if unknown:
            raise ValueError(f"drafter {self.name!r}: unknown resources {sorted(unknown)}")

    def load(self) -> tuple[type, type | None]:
        """(drafter class, config class or None), imported now."""
        return _import(self.cls), (_import(self.config) if self.config else None)

    def fields(self, *types) -> list[str]:
        """The names of its own config's fields whose type is one of `types`."""
        config = self.load()[1]
        if config is None:
            return []
        return [f.name for f in dataclasses.fields(config) if f.type in types]

    def switches(self) -> list[str]:
        """What `-noX` / `+X` may name: its config's bool fields, then its plug-ins."""
        return self.fields("bool", bool) + [p.name for p in self.plugins]

    def setting_type(self, field: str) -> str | None:
        """"int" or "float" for a numeric setting of its config or of a plug-in
        (whose config is imported only when its own config lacks the field), else None."""
        own = {**{f: "int" for f in self.fields("int", int)}, **{f: "float" for f in self.fields("float", float)}}
        if field in own:
            return own[field]
        for p in self.plugins:
            t = p.field_types().get(field)
            if t is not None:
                return t if t in ("int", "float") else None
        return None

    def numeric(self) -> list[str]:
        """Every numeric setting's name (its plug-ins' too: imports them)."""
        names = self.fields("int", int) + self.fields("float", float)
        return names + [f for p in self.plugins for f, t in p.field_types().items() if t in ("int", "float")]

    def sources(self) -> tuple[str, ...]:
        """The names of the draft sources its proposals carry (drafters/tree.py)."""
        from edgespec.drafters.tree import source_name
        return tuple(source_name(s) for s in self.load()[0].sources)


def _import(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


SUFFIX_PLUGINS = (
    PlugIn("position_ema", "edgespec.drafters.mechanisms.position_ema:PositionEma",
           "edgespec.drafters.mechanisms.position_ema:EmaConfig"),
    PlugIn("feedback", "edgespec.drafters.papers.feedback:PositionFeedback",
           "edgespec.drafters.papers.feedback:FeedbackConfig"),
    PlugIn("edits", "edgespec.drafters.mechanisms.edits:EditCopy", "edgespec.drafters.mechanisms.edits:EditConfig"),
)
"""The suffix drafter's plug-ins, in the order it calls them (the position EMA
filters the context's matches before ReSpec's feedback chooses among them,
as they always ran)."""

REGISTRY: tuple[DrafterEntry, ...] = (
    DrafterEntry("none", "proposes nothing: plain decoding through the same engine",
                 "edgespec.drafters.base:Drafter"),
    DrafterEntry("suffix", "continuations of earlier occurrences of the context's end, in the prompt, "
                 "the answer so far, the memory of earlier requests and the corpora",
                 "edgespec.drafters.suffix:SuffixDrafter", "edgespec.drafters.suffix:SuffixConfig",
                 ("corpora", "memory"), SUFFIX_PLUGINS),
    DrafterEntry("trigram", "a tri-gram matrix searched with MCTS (ADED), adapted to the session",
                 "edgespec.drafters.trigram:TrigramDrafter", "edgespec.drafters.trigram:TrigramConfig",
                 ("n_vocab", "corpora")),
    DrafterEntry("adjacency", "the successors of the last token in a table refreshed from the model's "
                 "own top-k (Token Recycling)",
                 "edgespec.drafters.adjacency:AdjacencyDrafter", "edgespec.drafters.adjacency:AdjacencyConfig",
                 ("n_vocab", "corpora")),
    DrafterEntry("auto", "the three above and the papers' mechanisms merged into one tree, retrieval first",
                 "edgespec.drafters.hybrid:HybridDrafter", "edgespec.drafters.hybrid:HybridConfig",
                 ("n_vocab", "corpora", "model_path", "memory")),
)

NAMES = tuple(e.name for e in REGISTRY)
"""Every drafter `make_drafter` knows, in the order the CLI lists them."""


def entry(name: str) -> DrafterEntry:
    """The registry's entry for a drafter name (ConfigError if unknown)."""
    for e in REGISTRY:
        if e.name == name:
            return e
    raise ConfigError(f"unknown drafter {name!r}; known drafters: {', '.join(NAMES)}")


def make_drafter(name: str, *, n_vocab: int | None = None, corpora=(), model_path: str | None = None,
                 memory_store=None, **settings):
    """Build the drafter `name` (a registry name, no switches: see
    drafters/spec.py for specs) with its config made of `settings`, e.g.
    make_drafter("suffix", max_nodes=32).

    n_vocab: the model's vocabulary size; corpora: compiled corpora
    (edgespec.corpus.format.Corpus); model_path: the GGUF, for drafters that
    read the model's token embeddings (auto's semantic fallback; without it
    that part is left out); memory_store: a MemoryStore of earlier requests
    (edgespec.memory).  Each drafter gets the ones its entry takes."""
    e = entry(name)
    cls, config_cls = e.load()
    if config_cls is None:
        if settings:
            raise ConfigError(f"drafter {name!r} takes no settings, got {sorted(settings)}")
        return cls()
    try:
        plugins = _plugins(e, settings)         # takes the plug-ins' switches and settings out of `settings`
        config = config_cls(**settings)
    except ValueError as err:      # the config classes check their own fields
        if isinstance(err, EdgespecError):
            raise
        raise ConfigError(f"drafter {name!r}: {err}") from None
    given = {"n_vocab": n_vocab, "corpora": tuple(corpora), "model_path": model_path, "memory": memory_store}
    if "n_vocab" in e.takes and n_vocab is None:
        raise ConfigError(f"drafter {name!r} needs n_vocab (the model's vocabulary size)")
    args = {k: given[k] for k in e.takes}
    if "n_vocab" in args:
        args["n_vocab"] = int(n_vocab)
    if e.plugins:
        args["plugins"] = plugins
    return cls(config=config, **args)


def _plugins(e: DrafterEntry, settings: dict) -> list:
    """The plug-ins of entry `e` that `settings` switch on, built with their
    settings; both are removed from `settings`.  A plug-in's settings are
    checked (its config is made) even when it stays off."""
    own = {f.name for f in dataclasses.fields(e.load()[1])}
    switched = {p.name: bool(settings.pop(p.name, False)) for p in e.plugins}
    built = []
    for p in e.plugins:
        on = switched[p.name]
        if not on and own >= set(settings):         # nothing of this plug-in asked for: not imported
            continue
        mechanism, config = p.load()
        names = {f.name for f in dataclasses.fields(config)}
        mine = {k: settings.pop(k) for k in [k for k in settings if k in names]}
        if on or mine:
            made = config(**mine)
            if on:
                built.append(mechanism(made))
    return built


def help_text() -> str:
    """The --drafter option's list of drafters, one clause each."""
    return "; ".join(f"{e.name} = {e.summary}" for e in REGISTRY)


def markdown_table() -> str:
    """The registry as the table docs/drafters.md shows (tests/test_registry.py
    checks the docs hold it as generated here)."""
    rows = ["| drafter | proposes | built with | draft sources |", "|---|---|---|---|"]
    for e in REGISTRY:
        takes = ", ".join(f"`{t}`" for t in e.takes) or "nothing"
        sources = ", ".join(f"`{s}`" for s in e.sources()) or "none"
        rows.append(f"| `{e.name}` | {e.summary} | {takes} | {sources} |")
    return "\n".join(rows)
