"""SpecModel's prompt cache: its two tiers and the KV cache as one value.

PromptCaching is a base class of SpecModel (it works on the attributes the
constructor sets: backend, prefix_cache, _engines, and its _request()).  The
cache itself is edgespec.core.prefix_cache's PrefixCache (host memory) over
edgespec.core.prompt_disk's PromptDisk (files); this module sets them up,
replaces them (use_prompt_cache: the drop-in's set_cache), and copies the KV
cache out and back in as one checked value (save_prefix / restore_prefix:
the drop-in's save_state / load_state).
"""
from __future__ import annotations

import functools

import numpy as np

from edgespec.core.prefix_cache import PrefixCache
from edgespec.core.prompt_disk import BadEntry, PromptDisk, cells_key, decode_state, encode_state
from edgespec.errors import ConfigError


class PromptCaching:
    """The prompt cache's part of SpecModel (see the module doc)."""

    @functools.cached_property
    def cells_key(self) -> str:
        """What this model's KV cells depend on, hashed (edgespec.core.prompt_disk.cells_key)."""
        return cells_key(self.backend)

    def use_prompt_cache(self, memory_mib: float, disk_mib: float = 0, folder: str | None = None) -> None:
        """Replace the prompt cache (RunConfig's prompt_cache_mib and
        prompt_cache_disk_mib): `memory_mib` MiB of host memory and `disk_mib`
        MiB of files in `folder` (None: the cache directory's prompts/; see
        edgespec.core.prompt_disk); 0 turns a tier off.  The prefixes the old
        one held in memory are dropped; its files stay for the next use."""
        with self._request():
            self._set_prompt_cache(memory_mib, disk_mib, folder)

    def _set_prompt_cache(self, memory_mib: float, disk_mib: float | None, folder: str | None) -> None:
        if not (memory_mib >= 0 and (disk_mib or 0) >= 0):
            raise ConfigError("the prompt cache's sizes must be >= 0 MiB")
        if self.prefix_cache is not None:
            self.prefix_cache.close()
        disk_bytes = int((disk_mib or 0) * 2**20)
        disk = PromptDisk(self.cells_key, disk_bytes, folder) if disk_bytes > 0 else None
        self.prefix_cache = PrefixCache(int(memory_mib * 2**20), disk=disk) if (memory_mib or disk) else None
        for e in self._engines.values():
            e.prefix_cache = self.prefix_cache

    def save_prefix(self) -> tuple[np.ndarray, bytes]:
        """The KV cache as one value: (the tokens whose cells it holds, those
        cells as bytes: a prompt cache file's format, with this model's key
        and CRC-32s, which restore_prefix checks).  A cache that cache reuse by
        shifting spliced is cut where its first moved cell stands first: a
        saved prefix is always exact (core/cache_reuse.py)."""
        with self._request():
            be = self.backend
            if be.spliced_from is not None:
                be.truncate(be.spliced_from)
            tokens = be.kv_tokens[:be.n_past].copy()
            return tokens, encode_state(self.cells_key, tokens, be.save_state())

    def restore_prefix(self, tokens, blob: bytes) -> None:
        """Put back a save_prefix() value: the next request reuses its cells
        as it would the live cache's.  ConfigError for a value of another
        model or setting, a damaged one, or tokens that are not its own."""
        with self._request():
            try:
                held, state = decode_state(bytes(blob), self.cells_key)
            except BadEntry as e:
                raise ConfigError(f"cannot restore this state: {e}") from None
            if not np.array_equal(np.asarray(tokens, np.int32), held):
                raise ConfigError("cannot restore this state: its tokens are not the ones given")
            self.backend.restore_state(state, held)
