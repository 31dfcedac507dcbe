"""The drafter registry: every drafter `make_drafter` builds, in one table.

An entry names a drafter, says in one line what it proposes, where its class
and config class live, and what the app must hand its constructor.  The CLI's
names and help, the spec language's switches (drafters/spec.py),
`make_drafter` and the table in docs/drafters.md are read from it, so adding
a drafter is its module, its entry here and its test.

The classes are named by "module:Class" and imported when a drafter is
built: listing the names (every CLI start) imports no drafter module and
none of their numba kernels.
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
class DrafterEntry:
    """name: the spec's base name; summary: one line for the CLI and docs;
    cls / config: "module:Class" (config "" for a drafter without settings);
    takes: the RESOURCES its constructor accepts, as keyword arguments."""
    name: str
    summary: str
    cls: str
    config: str = ""
    takes: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = set(self.takes) - set(RESOURCES)
        if unknown:
            raise ValueError(f"drafter {self.name!r}: unknown resources {sorted(unknown)}")

    def load(self) -> tuple[type, type | None]:
        """(drafter class, config class or None), imported now."""
        return _import(self.cls), (_import(self.config) if self.config else None)

    def fields(self, *types) -> list[str]:
        """The names of the config fields whose type is one of `types`."""
        config = self.load()[1]
        if config is None:
            return []
        return [f.name for f in dataclasses.fields(config) if f.type in types]

    def sources(self) -> tuple[str, ...]:
        """The names of the draft sources its proposals carry (drafters/tree.py)."""
        from edgespec.drafters.tree import source_name
        return tuple(source_name(s) for s in self.load()[0].sources)


def _import(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


REGISTRY: tuple[DrafterEntry, ...] = (
    DrafterEntry("none", "proposes nothing: plain decoding through the same engine",
                 "edgespec.drafters.base:Drafter"),
    DrafterEntry("suffix", "continuations of earlier occurrences of the context's end, in the prompt, "
                 "the answer so far, the memory of earlier requests and the corpora",
                 "edgespec.drafters.suffix:SuffixDrafter", "edgespec.drafters.suffix:SuffixConfig",
                 ("corpora", "memory")),
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
    return cls(config=config, **args)


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
