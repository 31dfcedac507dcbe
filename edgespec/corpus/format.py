"""The compiled corpus file (.esc): the `Corpus` arrays, and reading, checking and writing the file.

A corpus is a set of documents tokenized with the model's own tokenizer and
compiled (edgespec.corpus.compile) into the arrays of the interface contract
(/tmp/es/CORPUS_SPEC.md, summarised in `Corpus`): the tokens with one -1 after
each document, a suffix array over them (cut at `sa_depth` tokens), tri-gram
successor rows in CSR form, and a bi-gram table of each token's most frequent
successors.  This module is the one place that knows how those arrays sit in a
file, so the reader and the writer cannot disagree.

File format (version 1), all little-endian:

    8 bytes   magic b"ESCORPUS"
    u64       length H of the header
    H bytes   UTF-8 JSON header, padded with spaces so the arrays start 64-byte aligned
    arrays    each at the 64-byte aligned byte offset the header's array table gives

The header holds the format version, the tokenizer fingerprint (n_vocab and a
sha256 over every token piece, plus the model it came from), the build
parameters, the sources (path, bytes, documents, tokens), n_tokens (without
separators), n_docs, the build time and the array table (name, dtype, shape,
offset).  `Corpus.load` checks all of it against the file size before mapping
anything, so a truncated or damaged file gives a `CorpusError`, not a crash.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile

import numpy as np

from edgespec.errors import CorpusError
from edgespec.progress import progress_bar as _bar

MAGIC = b"ESCORPUS"
FORMAT = "edgespec-corpus"
FORMAT_VERSION = 1
ALIGN = 64
MAX_HEADER_BYTES = 256 << 20
WRITE_BLOCK = 16 << 20       # bytes per write call

# name -> (dtype, ndim): every array of a corpus file, in file order
ARRAYS = {
    "tokens": ("<i4", 1),
    "sa": ("<i4", 1),
    "tri_w1_offsets": ("<i4", 1),
    "tri_w2": ("<i4", 1),
    "tri_ctx_count": ("<u4", 1),
    "tri_offsets": ("<i4", 1),
    "tri_next": ("<i4", 1),
    "tri_count": ("<u4", 1),
    "adj_next": ("<i4", 2),
    "adj_count": ("<u4", 2),
}


# ===================================================================== Corpus
class Corpus:
    """The arrays of a compiled corpus (see the module docstring and CORPUS_SPEC).

    tokens int32[N]: the documents, each followed by one -1 (N = n_tokens + n_docs).
    sa int32[N - n_docs]: every non-separator position, sorted by
        tokens[p : p + sa_depth] cut at the first -1 (a prefix sorts first), ties by p.
    tri_w1_offsets int32[V+1], tri_w2 int32[C], tri_ctx_count uint32[C],
    tri_offsets int32[C+1], tri_next int32[E], tri_count uint32[E]: tri-gram
        successors of each context (w1, w2), count descending then token ascending,
        at most max_successors per context; tri_ctx_count is the unpruned total.
    adj_next int32[V, k_adj], adj_count uint32[V, k_adj]: each token's most
        frequent successors (count descending, token ascending), -1 / 0 padded.

    Loaded from a file the arrays are read-only np.memmap views.
    """

    def __init__(self, arrays: dict, header: dict, path: str | None = None):
        missing = [n for n in ARRAYS if n not in arrays]
        if missing:
            raise ValueError(f"Corpus needs the arrays {missing}")
        self.header = header
        self.path = path
        for name in ARRAYS:
            setattr(self, name, arrays[name])
        self.n_vocab = int(header["n_vocab"])
        self.sa_depth = int(header["params"]["sa_depth"])

    # ------------------------------------------------------------ properties
    @property
    def arrays(self) -> dict:
        return {name: getattr(self, name) for name in ARRAYS}

    @property
    def n_docs(self) -> int:
        return int(self.header["n_docs"])

    @property
    def n_tokens(self) -> int:
        """Tokens without the separators."""
        return int(self.header["n_tokens"])

    @property
    def max_successors(self) -> int:
        return int(self.header["params"]["max_successors"])

    @property
    def k_adj(self) -> int:
        return int(self.header["params"]["k_adj"])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())

    @property
    def tri_nbytes(self) -> int:
        """Bytes of the tri-gram arrays (tri_*)."""
        return sum(int(a.nbytes) for n, a in self.arrays.items() if n.startswith("tri_"))

    def __repr__(self) -> str:
        where = f" {self.path!r}" if self.path else ""
        return (f"<Corpus{where}: {self.n_tokens} tokens, {self.n_docs} docs, V={self.n_vocab}, "
                f"{len(self.tri_w2)} tri-gram contexts, {len(self.tri_next)} successors>")

    # ------------------------------------------------------------ tokenizer
    def check_tokenizer(self, vocab) -> None:
        """Raise CorpusError unless this corpus was built with `vocab`'s tokenizer."""
        fp = tokenizer_fingerprint(vocab)
        tk = self.header.get("tokenizer") or {}
        ok = fp["n_vocab"] == self.n_vocab and (not tk.get("sha256") or tk["sha256"] == fp["sha256"])
        if not ok:
            built = tk.get("model_name") or tk.get("model_file")
            built = f" ({built}, {self.n_vocab} tokens)" if built else f" ({self.n_vocab} tokens)"
            raise CorpusError(f"{self.path or 'corpus'}: the corpus was built for another tokenizer{built}; "
                              f"this model has {fp['n_vocab']} tokens and a different vocabulary; "
                              "rebuild it with `edgespec build-corpus --model` for this model")

    # ------------------------------------------------------------ files
    def save(self, path: str, progress=False) -> str:
        """Write this corpus to `path` (atomically: a temporary file, then rename)."""
        write_corpus(path, self.header, self.arrays, progress)
        self.path = path
        return path

    @classmethod
    def load(cls, path: str, vocab=None, verify: bool = True) -> Corpus:
        """Map a corpus file read-only.  The header and array table are checked
        against the file size before anything is mapped; with `verify` the array
        contents are range-checked too (indices a drafter follows stay inside
        their arrays).  With `vocab` (edgespec.backend.vocab.Vocab) the tokenizer
        fingerprint must match."""
        path = os.fspath(path)
        header, table, _ = _read_header(path)
        try:
            mm = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise CorpusError(f"{path}: cannot map the corpus file: {e}") from None
        arrays = {}
        for name, (dtype, shape, off, nbytes) in table.items():
            arrays[name] = mm[off:off + nbytes].view(np.dtype(dtype)).reshape(shape)
        _check_contents(path, header, arrays, full=verify)
        c = cls(arrays, header, path)
        if vocab is not None:
            c.check_tokenizer(vocab)
        return c


# ================================================================ reading
def _read_header(path: str):
    """Parse and check the header of a corpus file without mapping it.
    Returns (header, {name: (dtype, shape, offset, nbytes)}, file size)."""
    size, hlen, raw = _read_raw_header(path)
    header = _parse_header(path, raw)
    table = _array_table(path, header, 16 + hlen, size)
    _check_shapes(path, header, table)
    return header, table, size


def _bad(path: str, msg: str) -> CorpusError:
    return CorpusError(f"{path}: {msg}")


def _read_raw_header(path: str) -> tuple[int, int, bytes]:
    """(file size, header length, header bytes), after the magic and length checks."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 8 or head[:8] != MAGIC:
                raise _bad(path, "not an edgespec corpus file (bad magic bytes)")
            if len(head) < 16:
                raise _bad(path, f"truncated corpus file ({size} bytes)")
            hlen = int.from_bytes(head[8:16], "little")
            if hlen > MAX_HEADER_BYTES or 16 + hlen > size:
                raise _bad(path, f"truncated or corrupt corpus file (header of {hlen} bytes, file of {size} bytes)")
            raw = f.read(hlen)
    except FileNotFoundError:
        raise CorpusError(f"corpus file not found: {path}") from None
    except IsADirectoryError:
        raise CorpusError(f"not a file: {path}") from None
    except OSError as e:
        raise CorpusError(f"cannot read {path}: {e.strerror or e}") from None
    return size, hlen, raw


def _parse_header(path: str, raw: bytes) -> dict:
    """The JSON header, checked to be an edgespec corpus header of this format version."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _bad(path, "corrupt corpus header (not valid JSON)") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _bad(path, "corrupt corpus header (not an edgespec corpus header)")
    if header.get("version") != FORMAT_VERSION:
        raise _bad(path, f"corpus format version {header.get('version')!r} is not supported "
                   f"(this edgespec reads version {FORMAT_VERSION}); rebuild the corpus")
    return header


def _array_table(path: str, header: dict, data_start: int, size: int) -> dict:
    """{name: (dtype, shape, offset, nbytes)} from the header's array table, every
    field checked and every array inside the file; the counts and params checked too."""
    try:
        V = header["n_vocab"]
        params = header["params"]
        for v in (V, header["n_docs"], header["n_tokens"], params["sa_depth"], params["max_successors"],
                  params["k_adj"]):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise TypeError
        if V < 1 or params["sa_depth"] < 1:
            raise TypeError
        entries = header["arrays"]
        if not isinstance(entries, list):
            raise TypeError
        table = {}
        for e in entries:
            name, dtype, shape, off = e["name"], e["dtype"], e["shape"], e["offset"]
            if name not in ARRAYS or name in table or dtype != ARRAYS[name][0]:
                raise TypeError
            if (not isinstance(shape, list) or len(shape) != ARRAYS[name][1]
                    or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 40
                               for s in shape)):
                raise TypeError
            if not isinstance(off, int) or isinstance(off, bool) or off < data_start or off % ALIGN:
                raise TypeError
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            if off + nbytes > size:
                raise _bad(path, f"truncated or corrupt corpus file (array {name} ends at byte {off + nbytes}, "
                           f"the file has {size})")
            table[name] = (dtype, tuple(shape), off, nbytes)
    except (KeyError, TypeError, AttributeError):
        raise _bad(path, "corrupt corpus header (missing or invalid fields)") from None
    missing = [n for n in ARRAYS if n not in table]
    if missing:
        raise _bad(path, f"corrupt corpus header (no array {missing[0]})")
    return table


def _check_shapes(path: str, header: dict, table: dict) -> None:
    """Every array's shape against the counts of the header and the other arrays."""
    V, n_docs, n_tokens = header["n_vocab"], header["n_docs"], header["n_tokens"]
    N = n_tokens + n_docs
    C = table["tri_w2"][1][0]
    E = table["tri_next"][1][0]
    K = table["adj_next"][1][1]
    want = {"tokens": (N,), "sa": (n_tokens,), "tri_w1_offsets": (V + 1,), "tri_w2": (C,),
            "tri_ctx_count": (C,), "tri_offsets": (C + 1,), "tri_next": (E,), "tri_count": (E,),
            "adj_next": (V, K), "adj_count": (V, K)}
    for name, shape in want.items():
        if table[name][1] != shape:
            raise _bad(path, f"corrupt corpus header (array {name} has shape {list(table[name][1])}, "
                       f"expected {list(shape)})")


def _check_contents(path: str, header: dict, a: dict, full: bool) -> None:
    """Offsets tables always (cheap); token and index ranges when `full`."""
    V = int(header["n_vocab"])
    C, E = len(a["tri_w2"]), len(a["tri_next"])

    def csr_ok(off, end):
        return off[0] == 0 and off[-1] == end and bool(np.all(off[1:] >= off[:-1]))

    problems = []
    if not csr_ok(a["tri_w1_offsets"], C):
        problems.append("tri_w1_offsets")
    if not csr_ok(a["tri_offsets"], E):
        problems.append("tri_offsets")
    if full:
        t = a["tokens"]
        if len(t) and (t[-1] != -1 or t.min() < -1 or t.max() >= V
                       or int(np.count_nonzero(t == -1)) != int(header["n_docs"])):
            problems.append("tokens")
        for name, lo, hi in (("sa", 0, len(t)), ("tri_w2", 0, V), ("tri_next", 0, V), ("adj_next", -1, V)):
            x = a[name]
            if x.size and (x.min() < lo or x.max() >= hi):
                problems.append(name)
    if problems:
        raise CorpusError(f"{path}: corrupt corpus file (bad values in {', '.join(problems)})")


# ================================================================ writing
def _write_array(f, arr, bar) -> None:
    """Write one array's bytes in blocks (the token array may be a memmap of a temp file)."""
    flat = arr.reshape(-1)
    step = max(1, WRITE_BLOCK // max(1, flat.itemsize))
    for i in range(0, len(flat), step):
        b = np.ascontiguousarray(flat[i:i + step])
        f.write(memoryview(b).cast("B"))
        bar.update(b.nbytes)


def _layout(header: dict, arrays: dict) -> tuple[bytes, list]:
    """The padded header bytes (with the array table filled in) and the offsets."""
    entries = []
    data_start = 0
    for _ in range(20):   # the header's length depends on the offsets it lists: iterate to a fixed point
        off = data_start
        entries = []
        for name in ARRAYS:
            a = arrays[name]
            off = -(-off // ALIGN) * ALIGN
            entries.append({"name": name, "dtype": ARRAYS[name][0], "shape": [int(s) for s in a.shape],
                            "offset": off})
            off += int(a.nbytes)
        h = dict(header, arrays=entries)
        raw = json.dumps(h, indent=1, ensure_ascii=False).encode("utf-8")
        need = -(-(16 + len(raw)) // ALIGN) * ALIGN
        if need == data_start:
            return raw + b" " * (data_start - 16 - len(raw)), entries
        data_start = max(need, data_start)
    raise RuntimeError("corpus header layout did not converge")  # pragma: no cover


def write_corpus(path: str, header: dict, arrays: dict, progress=False) -> None:
    """Write atomically: a temporary file in the same directory, renamed over `path`
    at the end; on any exception (KeyboardInterrupt too) the temporary file is removed."""
    path = os.fspath(path)
    for name in ARRAYS:
        want = np.dtype(ARRAYS[name][0])
        if arrays[name].dtype != want:
            raise TypeError(f"array {name} must be {want}, got {arrays[name].dtype}")
    raw, entries = _layout(header, arrays)
    total = entries[-1]["offset"] + int(arrays[entries[-1]["name"]].nbytes)
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    except OSError as e:
        raise CorpusError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f, _bar(progress, total=total, desc="writing", unit="B",
                                            unit_scale=True) as bar:
            f.write(MAGIC)
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            pos = 16 + len(raw)
            bar.update(pos)
            for e in entries:
                f.write(b"\0" * (e["offset"] - pos))
                bar.update(e["offset"] - pos)
                _write_array(f, arrays[e["name"]], bar)
                pos = e["offset"] + int(arrays[e["name"]].nbytes)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise CorpusError(f"cannot write {path}: {e.strerror or e}") from None
        raise


# ================================================================ tokenizer id
def tokenizer_fingerprint(vocab) -> dict:
    """n_vocab and a sha256 over every token's piece (length-prefixed, special
    tokens rendered), computed once per Vocab object."""
    fp = getattr(vocab, "_edgespec_fingerprint", None)
    if fp is None:
        h = hashlib.sha256()
        n = int(vocab.n_vocab)
        h.update(n.to_bytes(8, "little"))
        for t in range(n):
            p = vocab.piece(t, special=True)
            h.update(len(p).to_bytes(4, "little"))
            h.update(p)
        fp = {"n_vocab": n, "sha256": h.hexdigest()}
        try:
            vocab._edgespec_fingerprint = fp
        except AttributeError:  # pragma: no cover - a vocab with __slots__
            pass
    return dict(fp)
