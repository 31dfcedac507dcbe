"""MemoryStore: the text of earlier requests, bounded, indexed for suffix lookup.

Every request a SpecModel serves ends in `add()`: the answer (with the last
few prompt tokens before it, or the whole prompt) becomes one *entry*.  The
entries sit one after another in one flat int32 array, each followed by a -1
separator, indexed by two chained hashes of their last K_SHORT and K_LONG
tokens (kernels/memory.py).  `propose()` finds where the end of the current
context occurred in them and merges what followed into a draft tree, as the
suffix drafter does for the context; its nodes carry SOURCE_MEMORY, so the
engine's acceptance model calibrates them apart.

Bounded: the store holds at most `budget` token slots (an entry's tokens and
its separator).  When an entry does not fit, whole oldest entries are
dropped until the store is at most 3/4 full with it (so the arrays move once
per quarter of the budget, not at every request; the index moves with them,
shifted, not rebuilt); an entry longer than the budget keeps its last tokens.  The arrays grow by doubling up to the
budget, so a store that holds little takes little.

Threads: one lock guards the arrays; `add()` extends them under it, and
`propose()` reads them under it, so a lookup sees every entry whole or not
at all.
"""
from __future__ import annotations

import collections
import threading

import numpy as np

from edgespec.kernels import memory as _k

BYTES_PER_SLOT = 16
"""Memory per token slot at the budget: the token, its two chain links (4
bytes each) and half a slot of each of the two head tables (4 bytes each)."""
DEFAULT_BUDGET = (64 << 20) // BYTES_PER_SLOT
"""Token slots of the default budget: 4,194,304, about 64 MB."""
PROMPT_TAIL = 8
"""Prompt tokens kept before each answer (the chat template's turn header,
the end of the question), so that the start of a later answer is found too."""
MIN_CAPACITY = 1 << 12


def _heads_size(capacity: int) -> int:
    """Head-table slots for a capacity: a power of two, about half of it."""
    return max(MIN_CAPACITY, 1 << max(0, (capacity - 1).bit_length() - 1))


class MemoryStore:
    """A bounded store of earlier requests' tokens (module doc).

    budget: token slots at most (DEFAULT_BUDGET: about 64 MB).
    prompts: keep each request's whole prompt before its answer, not only
        its last PROMPT_TAIL tokens.
    max_chain: positions walked per hash chain in a lookup (bounds a step's cost).
    """

    def __init__(self, budget: int = DEFAULT_BUDGET, *, prompts: bool = False, max_chain: int = 64):
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 2:
            raise ValueError(f"memory budget must be an integer of at least 2 tokens, got {budget!r}")
        if max_chain < 1:
            raise ValueError("max_chain must be >= 1")
        self.budget = int(budget)
        self.prompts = bool(prompts)
        self.max_chain = int(max_chain)
        self.path: str | None = None          # the file it is kept in (memory/file.py), if any
        self.fingerprint: dict | None = None  # the tokenizer's (a file store's)
        self.n_vocab: int | None = None       # the vocabulary size of the models sharing it (open_memory)
        self._lock = threading.Lock()
        self._entries: collections.deque = collections.deque()   # slots of each entry, oldest first
        self.n_added = 0                      # entries ever added (this process)
        self.n_evicted = 0                    # entries dropped for the budget (this process)
        self.version = 0                      # bumped by every change (the file is written when it moved)
        self.saved_version = -1               # the version the file holds (memory/file.py)
        self.save_failed = False              # a write of the file failed (warned once)
        self.on_add = None                    # called after each add() (outside the lock): a file store's saver
        self._alloc(min(self.budget, MIN_CAPACITY))

    # ------------------------------------------------------------ arrays
    def _alloc(self, capacity: int, keep: int = 0) -> None:
        """Arrays of `capacity` slots holding the first `keep` of the old ones."""
        tokens = np.full(capacity, -1, np.int32)
        prev_s = np.full(capacity, -1, np.int32)
        prev_l = np.full(capacity, -1, np.int32)
        if keep:
            tokens[:keep] = self._tokens[:keep]
            prev_s[:keep] = self._prev_s[:keep]
            prev_l[:keep] = self._prev_l[:keep]
        self._tokens, self._prev_s, self._prev_l = tokens, prev_s, prev_l
        self._n = keep
        size = _heads_size(capacity)
        if keep and size == len(self._heads_s):
            return
        self._heads_s = np.full(size, -1, np.int32)
        self._heads_l = np.full(size, -1, np.int32)
        self._index(0, keep)

    def _index(self, start: int, end: int) -> None:
        _k.index_range(self._tokens, start, end, _k.K_SHORT, self._heads_s, self._prev_s)
        _k.index_range(self._tokens, start, end, _k.K_LONG, self._heads_l, self._prev_l)

    def _make_room(self, need: int) -> None:
        """Drop the oldest entries until `need` more slots fit in 3/4 of the
        budget (all of it for an entry that large), then grow the arrays."""
        if self._n + need > self.budget:
            target = max(self.budget - self.budget // 4, need)
            drop = 0
            while self._entries and self._n - drop + need > target:
                drop += self._entries.popleft()
                self.n_evicted += 1
            self._n = _k.compact(self._tokens, self._n, drop, self._heads_s, self._prev_s, self._heads_l,
                                 self._prev_l)
        if self._n + need > len(self._tokens):
            cap = len(self._tokens)
            while cap < self._n + need:
                cap *= 2
            self._alloc(min(cap, self.budget), keep=self._n)

    # ------------------------------------------------------------ public
    def entry_tokens(self, answer, prompt=()) -> np.ndarray:
        """The tokens one request leaves: the prompt (whole with `prompts`, else
        its last PROMPT_TAIL tokens) then the answer, cut to the budget."""
        answer = np.asarray(answer, np.int32).ravel()
        prompt = np.asarray(prompt, np.int32).ravel()
        if not self.prompts:
            prompt = prompt[-PROMPT_TAIL:] if len(answer) else prompt[:0]
        t = np.concatenate([prompt, answer]) if len(prompt) else answer
        return t[-(self.budget - 1):]

    def add(self, answer, prompt=()) -> None:
        """Keep one finished request (module doc); nothing for an empty answer."""
        t = self.entry_tokens(answer, prompt)
        if not len(t) or not len(answer):
            return
        if t.min() < 0:
            raise ValueError("memory entries hold token ids >= 0")
        need = len(t) + 1
        with self._lock:
            self._make_room(need)
            n = self._n
            self._tokens[n:n + need - 1] = t
            self._tokens[n + need - 1] = -1
            self._index(n, n + need)
            self._n = n + need
            self._entries.append(need)
            self.n_added += 1
            self.version += 1
        if self.on_add is not None:
            self.on_add(self)

    def propose(self, ctx, n, min_len, max_len, max_matches, max_depth, max_nodes, out, ends, lens, mlen,
                source: int) -> int:
        """The continuation tree of the context's matches in the store, written
        into out = (tokens, parents, probs, source) as
        kernels/suffix.build_continuation_tree writes it, every node of `source`
        (the drafter's SOURCE_MEMORY);
        ends / lens / mlen are the caller's scratch.  Returns the node count."""
        with self._lock:
            if self._n < 2:
                return 0
            return _k.propose_tree(self._tokens, self._n, self._heads_s, self._prev_s, self._heads_l,
                                   self._prev_l, ctx, n, min_len, max_len, max_matches, self.max_chain, max_depth,
                                   max_nodes, ends, lens, out[0], out[1], out[2], out[3], mlen, source)

    def clear(self) -> None:
        """Forget every entry (a file store's file is rewritten empty at its next save)."""
        with self._lock:
            self._entries.clear()
            self._alloc(min(self.budget, MIN_CAPACITY))
            self.version += 1

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """(every entry's slot count, the slots: tokens with a -1 after each
        entry), oldest first: copies taken under the lock."""
        with self._lock:
            return np.array(self._entries, np.int64), self._tokens[:self._n].copy()

    def load(self, lengths, slots) -> None:
        """Replace the contents by entries as snapshot() gives them (checked
        by the caller), dropping the oldest that do not fit the budget."""
        lengths = np.asarray(lengths, np.int64)
        start, i = 0, 0
        total = int(lengths.sum())
        while total - start > self.budget and i < len(lengths):
            start += int(lengths[i])
            i += 1
        with self._lock:
            self._entries = collections.deque(int(x) for x in lengths[i:])
            self._alloc(min(self.budget, MIN_CAPACITY))
            self._make_room(total - start)
            self._tokens[:total - start] = slots[start:total]
            self._n = total - start
            self._index(0, self._n)
            self.version += 1

    def stats(self) -> dict:
        """What the store holds: entries, tokens (without separators), slots
        used of the budget, bytes allocated now and at the budget."""
        with self._lock:
            n_entries = len(self._entries)
            used = self._n
            allocated = (len(self._tokens) * 12 + len(self._heads_s) * 8)
        return {"entries": n_entries, "tokens": used - n_entries, "slots": used, "budget": self.budget,
                "bytes": allocated, "bytes_at_budget": self.budget * 12 + _heads_size(self.budget) * 8,
                "added": self.n_added, "evicted": self.n_evicted}

    def __len__(self) -> int:
        return len(self._entries)

    def warmup(self) -> None:
        _k.warmup()
