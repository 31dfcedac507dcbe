"""The memory file: a MemoryStore kept across processes.

Format (version 1), little-endian:

    8 bytes   magic b"ESMEMORY"
    u64       length H of the header
    H bytes   UTF-8 JSON header: format, version, the tokenizer's fingerprint
              (n_vocab and a sha256 over its token pieces, as a corpus
              file's), n_entries, n_slots, the payload's sha256, the date
    payload   int32 [n_entries] each entry's slot count, then int32
              [n_slots] the slots (each entry's tokens and a -1 after it)

`open_store` reads it: a missing file starts an empty store; a file that is
not a memory file, is truncated or damaged, or was made with another
tokenizer gives one warning (MemoryFileWarning) and an empty store that
stays in the process: such a file is never overwritten (it may be another
model's memory), `edgespec memory clear FILE` or removing it starts it
afresh.  `save_store` writes a temporary file in the same directory (mode
0600: it holds the user's text), flushes it to disk and renames it over the
old one, so a crash mid-write leaves the old file.  A file that cannot be
written gives one warning (once per store); the store goes on in memory.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import struct
import tempfile
import threading
import warnings

import numpy as np

from edgespec.memory.store import MemoryStore

MAGIC = b"ESMEMORY"
FORMAT = "edgespec-memory"
FORMAT_VERSION = 1
MAX_HEADER_BYTES = 1 << 20
_save_lock = threading.Lock()


class MemoryFileWarning(UserWarning):
    """A memory file that could not be read or written (the store goes on)."""


class _Bad(Exception):
    """Why a memory file was not used."""


def _warn(message: str) -> None:
    warnings.warn(message, MemoryFileWarning, stacklevel=3)


def read_header(data: bytes) -> tuple[dict, int]:
    """(header, payload offset) of a memory file's bytes; _Bad when they are not one."""
    if len(data) < 16 or data[:8] != MAGIC:
        raise _Bad("not an edgespec memory file")
    (h,) = struct.unpack("<Q", data[8:16])
    if h > MAX_HEADER_BYTES or 16 + h > len(data):
        raise _Bad("truncated or damaged header")
    try:
        header = json.loads(data[16:16 + h].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _Bad("damaged header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _Bad("not an edgespec memory file")
    if header.get("version") != FORMAT_VERSION:
        raise _Bad(f"format version {header.get('version')!r}, this edgespec reads {FORMAT_VERSION}")
    return header, 16 + h


def _payload(data: bytes, header: dict, offset: int, n_vocab: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The entry lengths and slots, checked against the header; _Bad if not whole."""
    try:
        n_entries, n_slots = int(header["n_entries"]), int(header["n_slots"])
    except (KeyError, TypeError, ValueError):
        raise _Bad("damaged header") from None
    if n_entries < 0 or n_slots < 0 or len(data) - offset != 4 * (n_entries + n_slots):
        raise _Bad("truncated file (its size does not match its header)")
    body = data[offset:]
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise _Bad("damaged file (checksum mismatch)")
    arr = np.frombuffer(body, "<i4").astype(np.int32)
    lengths, slots = arr[:n_entries].astype(np.int64), arr[n_entries:]
    if (lengths < 2).any() or int(lengths.sum()) != n_slots:
        raise _Bad("damaged file (entry table)")
    ends = np.cumsum(lengths) - 1
    sep = np.zeros(n_slots, bool)
    sep[ends] = True
    if (slots[sep] != -1).any() or (slots[~sep] < 0).any() or (n_vocab and (slots >= n_vocab).any()):
        raise _Bad("damaged file (token ids)")
    return lengths, slots


def open_store(path: str, fingerprint: dict | None, **store_args) -> MemoryStore:
    """The store kept in `path` (module doc); store_args go to MemoryStore."""
    store = MemoryStore(**store_args)
    store.path, store.fingerprint = os.fspath(path), fingerprint
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return store
    except OSError as e:
        _warn(f"cannot read the memory file {path} ({e.strerror or e}): starting with an empty memory kept in "
              "this process only")
        store.path = None
        return store
    try:
        header, offset = read_header(data)
        if fingerprint is not None and header.get("tokenizer") != fingerprint:
            raise _Bad("it was made with another model's tokenizer")
        n_vocab = fingerprint.get("n_vocab") if fingerprint else None
        lengths, slots = _payload(data, header, offset, n_vocab)
    except _Bad as e:
        _warn(f"memory file {path} not used: {e}; starting with an empty memory kept in this process only "
              "(the file is left as it is)")
        store.path = None
        return store
    store.load(lengths, slots)
    store.saved_version = store.version
    return store


def encode(store: MemoryStore, fingerprint: dict | None) -> bytes:
    """The file's bytes for the store's contents now."""
    lengths, slots = store.snapshot()
    body = np.concatenate([lengths.astype("<i4"), slots.astype("<i4")]).tobytes()
    header = {"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": fingerprint,
              "n_entries": int(len(lengths)), "n_slots": int(len(slots)),
              "sha256": hashlib.sha256(body).hexdigest(),
              "saved": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    h = json.dumps(header).encode("utf-8")
    return MAGIC + struct.pack("<Q", len(h)) + h + body


def write_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` through a temporary file (mode 0600) renamed over it."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".memory-", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def save_store(store: MemoryStore, path: str | None = None) -> bool:
    """Write the store to its file (or `path`); False, with one warning, when
    it cannot be written.  A store unchanged since it was read or last
    written is not written again."""
    path = path or store.path
    if path is None:
        return False
    with _save_lock:
        version = store.version
        if path == store.path and store.saved_version == version:
            return True
        try:
            write_atomic(path, encode(store, store.fingerprint))
        except OSError as e:
            if not store.save_failed:
                _warn(f"cannot write the memory file {path} ({e.strerror or e}); the memory stays in this "
                      "process only")
            store.save_failed = True
            return False
        if path == store.path:
            store.saved_version = version
    return True


def file_stats(path: str) -> dict:
    """What a memory file holds, read without a model: entries, tokens,
    bytes, the tokenizer's n_vocab, when it was saved; `problem` says why it
    would not be used (None when it is whole)."""
    with open(path, "rb") as f:
        data = f.read()
    out = {"path": os.fspath(path), "bytes": len(data), "problem": None}
    try:
        header, offset = read_header(data)
        out.update(entries=header.get("n_entries"), slots=header.get("n_slots"), saved=header.get("saved"),
                   n_vocab=(header.get("tokenizer") or {}).get("n_vocab"))
        lengths, slots = _payload(data, header, offset, None)
        out["tokens"] = int(len(slots) - len(lengths))
    except _Bad as e:
        out["problem"] = str(e)
    return out


def clear_file(path: str) -> None:
    """Empty a memory file: rewritten with no entries for the same tokenizer
    (removed when its header cannot be read)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        header, _ = read_header(data)
    except _Bad:
        os.remove(path)
        return
    empty = MemoryStore(2)
    write_atomic(path, encode(empty, header.get("tokenizer")))
