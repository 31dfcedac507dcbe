"""Prompt prefixes kept across requests: the live KV cache and saved ones.

An app's requests share long prefixes without extending each other (a
rewritten last message, the same system prompt and examples for every task,
a title or tags asked for between two turns).  Before each request the
engine keeps the longest common prefix (LCP) of the prompt with the tokens
whose KV cells the backend holds (`common_prefix`); a PrefixCache adds
several saved conversations in host memory, each a (tokens, KV state) entry
the backend saves and restores (Backend.save_state / restore_state: llama.cpp's
per-sequence state), bounded by a byte budget and evicted least recently
used.

The policy (PrefixCache.choose, at a request's start): the longest match
among the live cache and the saved entries wins; a saved entry is restored
only when it matches at least `min_gain` tokens more than the live cache
(restoring costs a copy of its cells).  Before the live cache is replaced or
cut by `min_gain` tokens or more, it is saved, when it holds that many tokens
and no saved entry already starts with all of them; an entry whose tokens
are a prefix of the new one is dropped (the new one matches every prompt at
least as far).

The disk tier (core/prompt_disk.py's PromptDisk, `disk`) lies under both:
after every request the live cache's cells are copied and handed to its
writer thread (`persist`, skipped when a file holds them already or the
writer is behind; a model's close() offers them once more), and a
request whose prompt a file matches `min_gain` tokens further than the live
cache and the saved entries restores it from disk, when reading it costs less
than prefilling the difference (at this process's measured prefill rate,
`observe_prefill`).

A background calibration's slice clears the KV cache between requests:
`keep_live` holds the live cells first (however few; an entry too when
worth keeping), and `back_from_slice` puts them back before the next
request's choose(), so that request reuses what it would have reused
without the slice, and the measurement's own cells are never saved.

The KV cells of a prefix do not depend on what follows it, so with exact
kernels an answer does not depend on which of these the prefix came from
(tests/test_prefix_cache.py).  A cache a splice made inexact
(Backend.spliced_from, core/cache_reuse.py) is never saved, in memory or
on disk.  The cache holds no lock of its own: the engine
uses it inside a request, and a model runs one request at a time
(app/concurrency.py's Turnstile), or with parallel slots one model thread
steps them all (app/scheduler.py).
"""
from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from edgespec.errors import BackendError
from edgespec.backend.slots import common_prefix     # its home: the slots compare prompts with it too

MIN_GAIN = 64       # tokens: a smaller difference is prefilled rather than restored or saved
# seconds a prefilled token costs before this process has timed one: nearly three times the
# fastest CPU prefill in BENCHMARKS.md (Gemma-3-270M, 548 tokens/s on 2 AVX2 cores), so that
# the first request after a start does not prefer a disk read that a fast prefill would beat
PREFILL_S_PER_TOKEN = 1 / 1500


@dataclasses.dataclass
class Entry:
    tokens: np.ndarray      # int32: the tokens whose KV cells `state` holds, from position 0
    state: np.ndarray       # uint8: the backend's save_state()


class PrefixCache:
    """Saved KV prefixes, at most `budget_bytes` of state in all (see the module doc)."""

    def __init__(self, budget_bytes: int, min_gain: int = MIN_GAIN, disk=None):
        self.budget = int(budget_bytes)
        self.min_gain = int(min_gain)
        self.disk = disk            # a core.prompt_disk.PromptDisk, or None
        self.prefill_s_per_token = PREFILL_S_PER_TOKEN      # EMA of this process's prefills
        self.copy_s = 0.0           # the last persist()'s copy of the cells, in seconds
        # (the backend's kv_tokens array, its save_state()) of the last persist(): the
        # same cells saved again before anything changed them are not copied twice
        self._snapshot: tuple[np.ndarray, int, np.ndarray] | None = None
        self.entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()   # oldest use first
        self.parked: Entry | None = None    # the live cache while a calibration slice holds the backend
        self._next_key = 0
        self.n_bytes = 0
        self.n_saved = self.n_restored = self.n_evicted = self.n_disk_restored = 0

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.n_bytes = 0

    def choose(self, backend, prompt: np.ndarray, reuse: bool) -> int:
        """Before a request: leave in the backend the cells of the longest
        prefix of `prompt` (all but its last token at most) that the live cache,
        a saved entry or the disk tier holds, saving the live cache first when
        it is worth keeping.  Returns that prefix's length (the caller truncates
        to it); reuse False: 0 (the live cache may still be saved)."""
        limit = len(prompt) - 1
        live = backend.kv_tokens[:backend.n_past]
        n_live = common_prefix(live, prompt, limit) if reuse else 0
        key, n_best = None, n_live + self.min_gain - 1
        if reuse:
            for k, e in self.entries.items():
                n = common_prefix(e.tokens, prompt, limit)
                if n > n_best:
                    key, n_best = k, n
            have = n_live if key is None else n_best
            n_disk = self._from_disk(backend, prompt, limit, live, have)
            if n_disk is not None:
                return n_disk
        kept = n_live if key is None else 0
        if len(live) - kept >= self.min_gain:
            self._save(backend, live, keep=key)
        self._snapshot = None
        if key is None:
            return n_live
        return self._restore(backend, key, n_best)

    def _from_disk(self, backend, prompt: np.ndarray, limit: int, live: np.ndarray, have: int) -> int | None:
        """Restore the disk tier's longest match when it beats `have` tokens
        (the live cache's or a saved entry's) by min_gain and reading it costs
        less than prefilling the difference; its length (0 if llama.cpp refused
        it), or None to go on without it."""
        disk = self.disk
        if disk is None or disk.off is not None:
            return None
        e, n = disk.lookup(prompt, limit)
        if e is None or n < have + self.min_gain or not disk.worth_loading(e, n - have, self.prefill_s_per_token):
            return None
        state = disk.load(e)
        if state is None:
            return None
        if len(live) >= self.min_gain:
            self._save(backend, live)
        self._snapshot = None
        try:
            backend.restore_state(state, e.tokens)
        except BackendError:
            disk.refused(e)
            backend.reset()
            return 0
        self.n_disk_restored += 1
        return n

    def observe_prefill(self, n_tokens: int, seconds: float) -> None:
        """A prefill of n_tokens took `seconds`: the rate worth_loading compares a disk read with."""
        if n_tokens >= self.min_gain and seconds > 0:
            self.prefill_s_per_token = 0.5 * self.prefill_s_per_token + 0.5 * seconds / n_tokens

    def persist(self, backend) -> None:
        """After a request: hand the live cache's cells to the disk tier
        (copied now, with the model held; written by its writer thread) unless
        it is short, a file holds it already or the writer is behind."""
        disk = self.disk
        live = backend.kv_tokens[:backend.n_past]
        if disk is None or disk.off is not None or len(live) < self.min_gain or disk.busy or disk.covers(live) \
                or backend.spliced_from is not None:
            return
        t0 = time.perf_counter()
        try:
            state = backend.save_state()
        except BackendError:        # nothing to keep; the request's own outcome stands
            return
        self.copy_s = time.perf_counter() - t0
        self._snapshot = (backend.kv_tokens, backend.n_past, state)
        disk.put(live, state)

    def close(self, backend=None) -> None:
        """Write what the disk tier has queued, then (a model's close(), its
        backend given) the live cache unless a file holds it already: the
        last request's persist() skips it while the writer is behind."""
        if self.disk is not None:
            if backend is not None:
                self.disk.flush()
                self.persist(backend)
            self.disk.close()

    def keep_live(self, backend) -> None:
        """Before something else clears the KV cache (a background
        calibration's slice): hold the live cache's cells, however few, for
        back_from_slice, and save them as an entry when worth keeping.  A
        spliced cache is cut to its exact part first (nothing inexact is kept)."""
        if backend.spliced_from is not None:
            backend.truncate(backend.spliced_from)
        live = backend.kv_tokens[:backend.n_past]
        self.parked = None
        if not len(live):
            return
        snap = self._snapshot       # the last persist()'s copy, when the cells are still those
        if snap is None or snap[0] is not backend.kv_tokens or snap[1] != backend.n_past:
            self._snapshot = snap = (backend.kv_tokens, backend.n_past, backend.save_state())
        self.parked = Entry(live.copy(), snap[2])
        if len(live) >= self.min_gain:
            self._save(backend, live)

    def back_from_slice(self, backend) -> None:
        """The first request after a slice, before choose(): the cells keep_live
        held go back into the backend (a copy in memory; the request then reuses
        them as if no slice had run), else the KV cache is emptied: the
        measurement's cells are never a prefix to save."""
        e, self.parked = self.parked, None
        self._snapshot = None
        if e is None:
            backend.reset()
            return
        try:
            backend.restore_state(e.state, e.tokens)
        except BackendError:
            backend.reset()
            return
        self._snapshot = (backend.kv_tokens, backend.n_past, e.state)     # the cells are e's again

    def _restore(self, backend, key: int, n: int) -> int:
        """Put entry `key` into the backend (it becomes the most recently used); n, or 0 if that failed."""
        e = self.entries[key]
        self.entries.move_to_end(key)
        try:
            backend.restore_state(e.state, e.tokens)
        except BackendError:        # the backend refused the state: forget it, prefill instead
            self._drop(key)
            backend.reset()
            return 0
        self.n_restored += 1
        return n

    def _save(self, backend, live: np.ndarray, keep: int | None = None) -> None:
        """Keep the live cache's cells as the most recently used entry (unless
        an entry already holds them), within the budget, evicting the least
        recently used entries but `keep` (the one about to be restored)."""
        if self.budget <= 0 or backend.spliced_from is not None:     # no memory tier; inexact cells
            return
        for k, e in self.entries.items():
            if len(e.tokens) >= len(live) and np.array_equal(e.tokens[:len(live)], live):
                self.entries.move_to_end(k)
                return
        snap = self._snapshot       # the engine replaces kv_tokens whenever the cells change
        if snap is not None and snap[0] is backend.kv_tokens and snap[1] == backend.n_past:
            state = snap[2]
        else:
            state = backend.save_state()
        if state.nbytes > self.budget:
            return
        for k in [k for k, e in self.entries.items()
                  if k != keep and len(e.tokens) < len(live) and np.array_equal(live[:len(e.tokens)], e.tokens)]:
            self._drop(k)
        for k in [k for k in self.entries if k != keep]:
            if self.n_bytes + state.nbytes <= self.budget:
                break
            self._drop(k)
            self.n_evicted += 1
        if self.n_bytes + state.nbytes > self.budget:
            return
        self.entries[self._next_key] = Entry(live.copy(), state)
        self._next_key += 1
        self.n_bytes += state.nbytes
        self.n_saved += 1

    def _drop(self, key: int) -> None:
        self.n_bytes -= self.entries.pop(key).state.nbytes

    def stats(self) -> dict:
        """Entries, bytes held, the budget, and how many saves, restores and
        evictions so far; with the disk tier its counters too (PromptDisk.stats)."""
        s = {"entries": len(self.entries), "bytes": self.n_bytes, "budget_bytes": self.budget,
             "saved": self.n_saved, "restored": self.n_restored, "evicted": self.n_evicted}
        if self.disk is not None:
            s.update(self.disk.stats(), disk_restored=self.n_disk_restored)
        return s
