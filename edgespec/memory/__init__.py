"""Memory across requests: what a model wrote before, drafted from later.

store.py holds the bounded store (MemoryStore) and its lookup, file.py the
file that keeps it across processes; `open_memory` turns SpecModel's
`memory=` into a store.  docs/memory.md says what is stored and how to turn
it off.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
import weakref

from edgespec.errors import ConfigError
from edgespec.memory.file import MemoryFileWarning, open_store, save_store
from edgespec.memory.store import DEFAULT_BUDGET, MemoryStore

SAVE_EVERY_S = 60.0
"""A file store is written in the background at most this often after
requests, and at close() and exit."""

_open: "weakref.WeakSet[MemoryStore]" = weakref.WeakSet()


def open_memory(spec, vocab=None, budget: int | None = None) -> MemoryStore | None:
    """SpecModel's `memory=`: True a store in this process, False or None
    none, a path a store kept in that file (keyed to `vocab`'s tokenizer),
    a MemoryStore itself (shared: it is the caller's to save).  budget: token
    slots (None: DEFAULT_BUDGET, about 64 MB)."""
    if spec is None or spec is False:
        return None
    args = {} if budget is None else {"budget": budget}
    if spec is True:
        store = MemoryStore(**args)
        store.n_vocab = None if vocab is None else int(vocab.n_vocab)
        return store
    if isinstance(spec, MemoryStore):
        n_vocab = None if vocab is None else int(vocab.n_vocab)
        if n_vocab is not None and spec.n_vocab not in (None, n_vocab):
            raise ConfigError(f"this MemoryStore holds the tokens of a vocabulary of {spec.n_vocab}, not "
                              f"{n_vocab}: a store is shared only between models of one tokenizer")
        spec.n_vocab = spec.n_vocab or n_vocab
        return spec
    if isinstance(spec, (str, os.PathLike)):
        from edgespec.corpus.format import tokenizer_fingerprint
        store = open_store(spec, tokenizer_fingerprint(vocab) if vocab is not None else None, **args)
        store.n_vocab = None if vocab is None else int(vocab.n_vocab)
        if store.path is not None:
            store.on_add = _save_soon
            store.saved_at = time.monotonic()
            _open.add(store)
        return store
    raise ConfigError(f"memory must be True, False, a file path or a MemoryStore, not {spec!r}")


def _save_soon(store: MemoryStore) -> None:
    """After a request: write the file in a background thread when the last
    write is SAVE_EVERY_S old and none is under way."""
    if time.monotonic() - getattr(store, "saved_at", 0.0) < SAVE_EVERY_S or getattr(store, "saving", False):
        return
    store.saving = True
    store.saved_at = time.monotonic()

    def run():
        try:
            save_store(store)
        finally:
            store.saving = False
    threading.Thread(target=run, name="edgespec-memory-save", daemon=True).start()


def close_memory(store: MemoryStore | None) -> None:
    """Write a file store now (SpecModel.close())."""
    if store is not None and store.path is not None:
        save_store(store)


@atexit.register
def _save_all() -> None:
    for store in list(_open):
        close_memory(store)


__all__ = ["DEFAULT_BUDGET", "MemoryFileWarning", "MemoryStore", "close_memory", "open_memory",
           "save_store"]
