"""The prompt cache's disk tier: saved prefixes that outlive the process.

A PromptDisk keeps prompt prefixes' KV cells (the backend's save_state(),
llama.cpp's per-sequence state) in files under `<cache dir>/prompts`
(edgespec.paths.cache_dir: $EDGESPEC_CACHE_DIR, else
$XDG_CACHE_HOME/edgespec, else ~/.cache/edgespec), so that a restarted server, a resumed `edgespec chat` or an app's
next launch restores its system prompt and conversation instead of
prefilling them again.  core/prefix_cache.py's PrefixCache drives it: at the
end of every request it hands over the live cache (`put`), at the start of
one it asks for the longest saved prefix of the prompt (`lookup`, `load`).

Keyed by what changes the cells.  A file holds the cells of one token
prefix computed under one `cells_key`, the backend's identity
(backend/identity.py, which the calibration's key hashes too): the model file
by content (size and the hash of its first and last MiB:
model_fingerprint), the K cache type (f16 or q8_0) and the
V cache's (f16: edgespec never changes it), flash attention, the exact or
fast kernel setting, the tiled K-quant product and the CPU weight repacking
(each picks another kernel for the K and V projections, whose last bits then
differ), the layers offloaded and the RPC workers (a GPU's kernels differ
from the CPU's), the llama.cpp version (its state format and kernels change
between builds), the machine's architecture and CPU model (another
instruction set rounds otherwise), and this module's FORMAT.  Not in the key:
the context size and the thread count (llama.cpp writes a cell from the
token and its position, and its CPU kernels split work over threads by rows,
never a sum, so neither changes a cell's bits).  The files of every key share
one folder and one budget, so an old llama.cpp's or a removed model's files
age out by the same LRU order.

Found by the longest match.  A prefix's tokens are hashed in blocks of BLOCK
tokens, each block's hash chained to the one before (block_hashes), so block
i's hash names the whole prefix up to it; the index maps every block hash of
every file to the file.  A prompt's lookup walks its own chain from the
deepest block down, and the first hit is the file sharing the longest prefix
in whole blocks with it (a shared system prompt, not only an exact prompt);
the match is then measured token by token against the file's tokens, which
are kept in memory (4 bytes a token), so it may run into the last block.

The file (FORMAT 1): MAGIC, the header's length (u32, little endian), the
header as JSON (format, key, n_tokens, state_bytes, and the CRC-32 of the
tokens and of the state), the tokens (int32, little endian), the state bytes.
A file is written to a temporary name in the folder and renamed over its
final name (os.replace: atomic), so a reader sees a whole file or none; the
final name is the key and a hash of the tokens, so two processes that save
the same prefix write the same name and either copy wins.  No file is ever
changed in place, so two processes (servers, a chat and a server) share the
folder without a lock: each keeps its own index, refreshed when the folder's
mtime changes; a file deleted by the other process is a miss.  Use counts as
the file's mtime (touched on every restore): eviction deletes the files used
least recently, of every key, until the folder holds at most the budget.
Files are 0600 in a 0700 folder: they hold the users' prompts.

Bad files lose nothing.  A truncated, corrupt (CRC), foreign (another key:
another model, llama.cpp or setting) or unreadable file is skipped with one
warning line (deleted when it is ours to delete), the prompt is prefilled.
A folder that cannot be made or written (read-only, full) turns the tier off
for this process with one warning line; requests are served as without it.

Written behind the request.  The copy of the cells (save_state, a memcpy
with the model held) happens as a request ends; the file is written by one
writer thread per PromptDisk.  Read where it pays: worth_loading compares the
measured cost of reading and restoring the file with the prefill it saves
(docs/serving.md has the figures); the estimate of the read rate follows
this process's own loads.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import queue
import struct
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass

import numpy as np

from edgespec.backend.identity import identity
from edgespec.core.prefix_cache import MIN_GAIN, common_prefix
from edgespec.paths import cache_dir

log = logging.getLogger("edgespec.prompt_cache")

FORMAT = 1
MAGIC = b"ESPKVC\x00\x01"
SUFFIX = ".kv"
BLOCK = MIN_GAIN                # tokens per hashed block: a smaller match is prefilled anyway
MAX_PENDING = 2                 # files queued for the writer at most: a slow disk skips snapshots, not memory
STALE_PART_S = 3600             # a temporary file this old was left by a writer that died: deleted
# What a restore costs before this process has timed one: reading the file, its CRC check and
# llama.cpp's copy into the KV cache ran at 230-670 MB/s, from the page cache or not, on a loaded
# 2-core machine (tools/prompt_disk_cost.py, in git at 414aa94; docs/serving.md has the figures).
LOAD_OVERHEAD_S = 0.002
LOAD_S_PER_BYTE = 1 / 400e6
_HEAD = struct.Struct("<I")


class BadEntry(Exception):
    """A cache file that cannot be used (the message says why); `ours`: it
    is this key's file and may be deleted."""

    def __init__(self, why: str, ours: bool = True):
        super().__init__(why)
        self.ours = ours


def prompt_folder() -> str:
    """Where the files live: <cache dir>/prompts ($EDGESPEC_CACHE_DIR/prompts when set)."""
    return os.path.join(cache_dir(), "prompts")


def cells_key(backend) -> str:
    """Everything that changes a prefix's KV cells (the module doc says what and
    why: the backend's identity, backend/identity.py) and this FORMAT, hashed."""
    return hashlib.sha256(f"{identity(backend)}|format={FORMAT}".encode()).hexdigest()[:24]


def block_hashes(tokens: np.ndarray) -> list[bytes]:
    """The chained hashes of tokens' whole blocks: entry i names tokens[:(i + 1) * BLOCK]."""
    toks = np.ascontiguousarray(tokens, np.int32)
    out, prev = [], b""
    for i in range(len(toks) // BLOCK):
        prev = hashlib.blake2b(prev + toks[i * BLOCK:(i + 1) * BLOCK].tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


@dataclass
class DiskEntry:
    """One file as the index knows it (its state stays on disk until loaded)."""
    path: str
    tokens: np.ndarray          # int32: the prefix whose cells the file holds
    state_offset: int
    state_bytes: int
    state_crc: int

    @property
    def file_bytes(self) -> int:
        return self.state_offset + self.state_bytes


def encode_head(key: str, tokens: np.ndarray, state: np.ndarray) -> bytes:
    """Everything of a file before its state bytes."""
    toks = np.ascontiguousarray(tokens, "<i4")
    head = json.dumps({"format": FORMAT, "key": key, "n_tokens": len(toks), "state_bytes": int(state.nbytes),
                       "tokens_crc": zlib.crc32(toks.tobytes()), "state_crc": zlib.crc32(state.data)}).encode()
    return MAGIC + _HEAD.pack(len(head)) + head + toks.tobytes()


def read_head(path: str, key: str) -> DiskEntry:
    """The index entry of a file; BadEntry for a file that is not a whole,
    intact file of this key; OSError where it cannot be read."""
    with open(path, "rb") as f:
        return _parse_head(f, os.fstat(f.fileno()).st_size, key, path)


def _parse_head(f, size: int, key: str, path: str) -> DiskEntry:
    lead = f.read(len(MAGIC) + _HEAD.size)
    if len(lead) < len(MAGIC) + _HEAD.size or lead[:len(MAGIC)] != MAGIC:
        raise BadEntry("not a prompt cache file (truncated or overwritten)")
    (n_head,) = _HEAD.unpack(lead[len(MAGIC):])
    try:
        head = json.loads(f.read(min(n_head, 4096)))
        n, fmt, their_key = int(head["n_tokens"]), head["format"], head["key"]
        state_bytes, state_crc, tokens_crc = int(head["state_bytes"]), int(head["state_crc"]), int(head["tokens_crc"])
    except (ValueError, KeyError, TypeError) as e:
        raise BadEntry(f"its header is corrupt ({e})") from None
    if fmt != FORMAT or their_key != key:
        raise BadEntry("it was saved for another model, llama.cpp build or setting", ours=False)
    raw = f.read(4 * n)
    offset = len(MAGIC) + _HEAD.size + n_head + 4 * n
    if len(raw) < 4 * n or size != offset + state_bytes:
        raise BadEntry(f"it is truncated ({size} bytes, {offset + state_bytes} expected)")
    if zlib.crc32(raw) != tokens_crc:
        raise BadEntry("its tokens are corrupt (CRC mismatch)")
    return DiskEntry(path, np.frombuffer(raw, "<i4").astype(np.int32), offset, state_bytes, state_crc)


def encode_state(key: str, tokens: np.ndarray, state: np.ndarray) -> bytes:
    """A prefix's cells as one value: a cache file's bytes (the drop-in's LlamaState.llama_state)."""
    return encode_head(key, tokens, state) + state.tobytes()


def decode_state(blob: bytes, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, state) of an encode_state() value, checked as a file is (BadEntry)."""
    e = _parse_head(io.BytesIO(blob), len(blob), key, "")
    state = np.frombuffer(blob, np.uint8, e.state_bytes, e.state_offset)
    if zlib.crc32(state.data) != e.state_crc:
        raise BadEntry("its KV state is corrupt (CRC mismatch)")
    return e.tokens, state


def read_state(e: DiskEntry) -> np.ndarray:
    """The state bytes of an entry, checked; BadEntry / OSError as read_head."""
    buf = np.empty(e.state_bytes, np.uint8)
    with open(e.path, "rb") as f:
        f.seek(e.state_offset)
        n = f.readinto(buf.data)
    if n != e.state_bytes:
        raise BadEntry(f"it is truncated ({n} of {e.state_bytes} state bytes)")
    if zlib.crc32(buf.data) != e.state_crc:
        raise BadEntry("its KV state is corrupt (CRC mismatch)")
    return buf


class PromptDisk:
    """The files of one cells_key under `folder` (default prompt_folder()),
    at most `budget_bytes` in the folder in all (see the module doc).

    Threads: the request thread calls lookup / load / put, the writer thread
    writes; the index (entries, chain), the pending prefixes and the counters
    are guarded by `_lock`, file IO runs outside it."""

    def __init__(self, key: str, budget_bytes: int, folder: str | None = None):
        if budget_bytes <= 0:
            raise ValueError("a PromptDisk needs a budget > 0 bytes (0 turns the disk tier off: use none)")
        self.key, self.budget = key, int(budget_bytes)
        self.folder = folder or prompt_folder()
        self.off: str | None = None         # why the tier is off in this process (None: on)
        self._lock = threading.Lock()
        self.entries: dict[str, DiskEntry] = {}     # by file name
        self._chain: dict[bytes, set[str]] = {}     # block hash -> the files whose prefix it names
        self._pending: list[np.ndarray] = []        # prefixes queued for writing
        self._warned: set[str] = set()              # names of bad files (each warned about once)
        self._mtime: int | None = None              # the folder's mtime at the last scan
        self.load_s_per_byte = LOAD_S_PER_BYTE      # EMA of this process's restores
        self.n_hits = self.n_misses = self.n_written = self.n_evicted = 0
        self.bytes_read = self.bytes_written = 0
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            os.chmod(self.folder, 0o700)
        except OSError as e:
            self._turn_off(f"cannot use {self.folder}: {e.strerror or e}")

    # -------------------------------------------------------------- lookup
    def lookup(self, prompt: np.ndarray, limit: int) -> tuple[DiskEntry | None, int]:
        """The file sharing the longest prefix with prompt[:limit] and that
        prefix's length in tokens; (None, 0) when none shares a whole block."""
        if self.off is not None:
            return None, 0
        self.refresh()
        hashes = block_hashes(prompt[:limit])
        with self._lock:
            for h in reversed(hashes):
                names = self._chain.get(h)
                if names:       # any of them: they share this prefix, the tokens say how far each goes
                    e = max((self.entries[n] for n in names), key=lambda e: common_prefix(e.tokens, prompt, limit))
                    return e, common_prefix(e.tokens, prompt, limit)
            self.n_misses += 1
        return None, 0

    def worth_loading(self, e: DiskEntry, gain_tokens: int, prefill_s_per_token: float) -> bool:
        """Whether restoring e (reading all of it) costs less than prefilling
        the `gain_tokens` it saves, at this process's measured rates."""
        return LOAD_OVERHEAD_S + e.file_bytes * self.load_s_per_byte < gain_tokens * prefill_s_per_token

    def load(self, e: DiskEntry) -> np.ndarray | None:
        """e's state bytes, checked (and e marked as just used); None, with one
        warning line, for a file that turned out bad or unreadable."""
        t0 = time.perf_counter()
        try:
            state = read_state(e)
        except FileNotFoundError:           # evicted by another process meanwhile: a miss
            self._forget(os.path.basename(e.path))
            return None
        except (BadEntry, OSError) as err:
            self._bad(os.path.basename(e.path), err)
            return None
        dt = time.perf_counter() - t0
        with contextlib.suppress(OSError):
            os.utime(e.path)                # the LRU order is the files' mtime
        with self._lock:
            self.n_hits += 1
            self.bytes_read += e.file_bytes
            self.load_s_per_byte = 0.5 * self.load_s_per_byte + 0.5 * dt / max(1, e.file_bytes)
        return state

    def refused(self, e: DiskEntry) -> None:
        """llama.cpp refused e's state (a file it cannot take after all): skipped from now on."""
        self._bad(os.path.basename(e.path), BadEntry("llama.cpp refused its KV state"))

    def refresh(self) -> None:
        """Bring the index up to the folder: read the heads of new files, drop vanished ones."""
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)     # (deleted by hand meanwhile: made again)
            mtime = os.stat(self.folder).st_mtime_ns
            if mtime == self._mtime:
                return
            names = {n for n in os.listdir(self.folder) if n.startswith(self.key + "-") and n.endswith(SUFFIX)}
        except OSError as e:
            self._turn_off(f"cannot read {self.folder}: {e.strerror or e}")
            return
        # the clock the folder's mtime is set from is coarse (a few ms): a file another process
        # adds within the same tick leaves it unchanged, so a recent mtime is not trusted
        self._mtime = mtime if time.time_ns() - mtime > 2 * 10**9 else None
        with self._lock:
            gone = [n for n in self.entries if n not in names]
            new = [n for n in names if n not in self.entries and n not in self._warned]
        for n in gone:
            self._forget(n)
        for n in new:
            try:
                self._add(n, read_head(os.path.join(self.folder, n), self.key))
            except FileNotFoundError:
                pass
            except (BadEntry, OSError) as err:
                self._bad(n, err)

    def _add(self, name: str, e: DiskEntry) -> None:
        with self._lock:
            self.entries[name] = e
            for h in block_hashes(e.tokens):
                self._chain.setdefault(h, set()).add(name)

    def _forget(self, name: str) -> None:
        with self._lock:
            e = self.entries.pop(name, None)
            if e is not None:
                for h in block_hashes(e.tokens):
                    names = self._chain.get(h, set())
                    names.discard(name)
                    if not names:
                        self._chain.pop(h, None)

    def _bad(self, name: str, err: Exception) -> None:
        """Skip a bad file: one warning line; deleted when it is this key's and corrupt."""
        self._forget(name)
        with self._lock:
            first = name not in self._warned
            self._warned.add(name)
        why = str(err) if isinstance(err, BadEntry) else f"it cannot be read: {getattr(err, 'strerror', None) or err}"
        if isinstance(err, BadEntry) and err.ours:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.folder, name))
        if first:
            log.warning("prompt cache: skipping %s: %s; the prompt is prefilled", os.path.join(self.folder, name), why)

    def _turn_off(self, why: str) -> None:
        if self.off is None:
            self.off = why
            log.warning("prompt cache: the disk tier is off in this process (%s); requests are served without it",
                        why)

    # --------------------------------------------------------------- write
    def covers(self, tokens: np.ndarray) -> bool:
        """Whether a file (or one queued) holds all but fewer than BLOCK of these tokens already."""
        need = len(tokens) - BLOCK + 1
        with self._lock:
            held = [e.tokens for e in self.entries.values()] + self._pending
        return any(common_prefix(t, tokens, len(tokens)) >= need for t in held)

    @property
    def busy(self) -> bool:
        """MAX_PENDING files wait for the writer: a new one would be dropped (the caller need not copy it)."""
        with self._lock:
            return len(self._pending) >= MAX_PENDING

    def put(self, tokens: np.ndarray, state: np.ndarray) -> None:
        """Queue the cells of `tokens` (a save_state() copy the caller no
        longer changes) for the writer thread; dropped when it is busy."""
        if self.off is not None or state.nbytes > self.budget or self.busy:
            return
        tokens = np.array(tokens, np.int32)
        with self._lock:
            self._pending.append(tokens)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="edgespec-prompt-disk", daemon=True)
                self._writer.start()
        self._queue.put((tokens, state))

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self.off is None:
                    self._write(*job)
            except OSError as e:        # full, read-only, removed: the tier is off, requests go on
                self._turn_off(f"cannot write to {self.folder}: {e.strerror or e}")
            except Exception as e:      # a bug must not kill the thread that flush() waits on
                log.exception("prompt cache: the disk writer failed")
                self._turn_off(f"the writer failed: {e}")
            finally:
                if job is not None:
                    with self._lock:
                        self._pending = [t for t in self._pending if t is not job[0]]
                self._queue.task_done()

    def _write(self, tokens: np.ndarray, state: np.ndarray) -> None:
        """Write one file (temporary name, then rename), index it, drop the
        files it supersedes (this key's whose tokens are a prefix of its own),
        then keep the folder within the budget."""
        name = f"{self.key}-{hashlib.sha256(tokens.tobytes()).hexdigest()[:24]}{SUFFIX}"
        path = os.path.join(self.folder, name)
        head = encode_head(self.key, tokens, state)
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".", suffix=".part")    # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(state.data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        e = DiskEntry(path, tokens, len(head), state.nbytes, zlib.crc32(state.data))
        self._add(name, e)
        with self._lock:
            self.n_written += 1
            self.bytes_written += e.file_bytes
            old = [n for n, o in self.entries.items()
                   if n != name and len(o.tokens) < len(tokens) and np.array_equal(tokens[:len(o.tokens)], o.tokens)]
        for n in old:
            self._forget(n)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.folder, n))
        self.evict(keep=name)

    def evict(self, keep: str | None = None) -> None:
        """Delete the least recently used files (of every key) until the
        folder holds at most the budget; also temporary files left by a dead writer."""
        files, now = [], time.time()
        for n in os.listdir(self.folder):
            try:
                st = os.stat(os.path.join(self.folder, n))
            except OSError:
                continue
            if n.endswith(".part"):
                if now - st.st_mtime > STALE_PART_S:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.folder, n))
            elif n.endswith(SUFFIX):
                files.append((st.st_mtime, n, st.st_size))
        total = sum(f[2] for f in files)
        for _, n, size in sorted(files):
            if total <= self.budget:
                break
            if n == keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.folder, n))
            self._forget(n)
            total -= size
            with self._lock:
                self.n_evicted += 1

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queued files are written; False if some still are after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    def stats(self) -> dict:
        """This process's counters and what this key's files hold."""
        with self._lock:
            return {"disk_entries": len(self.entries), "disk_bytes": sum(e.file_bytes for e in self.entries.values()),
                    "disk_budget_bytes": self.budget, "disk_hits": self.n_hits, "disk_misses": self.n_misses,
                    "disk_bytes_read": self.bytes_read, "disk_bytes_written": self.bytes_written,
                    "disk_written": self.n_written, "disk_evicted": self.n_evicted, "disk_off": self.off}
