"""Compiled corpora: token statistics the drafters read, in one memory-mappable file.

A corpus is a set of documents tokenized with the model's own tokenizer and
compiled into the arrays of the interface contract (/tmp/es/CORPUS_SPEC.md,
summarised in `Corpus`): the tokens with one -1 after each document, a suffix
array over them (cut at `sa_depth` tokens), tri-gram successor rows in CSR
form, and a bi-gram table of each token's most frequent successors.

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

`compile_tokens` compiles token arrays in memory (no model needed);
`build_corpus` tokenizes files (text, source code, JSON lines) with a
vocab-only load of the model and writes a corpus file, in bounded memory:
tokens go to a temporary file on disk, n-grams are counted block by block and
the counts merged, and the suffix array is built by prefix doubling.
"""
from __future__ import annotations

import codecs
import fnmatch
import hashlib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from dataclasses import field as dc_field

import numpy as np
from numba import njit

from edgespec.errors import CorpusError  # re-exported
from edgespec.corpus.presets import preset_inputs
from edgespec.progress import progress_bar as _bar

MAGIC = b"ESCORPUS"
FORMAT = "edgespec-corpus"
FORMAT_VERSION = 1
ALIGN = 64
MAX_HEADER_BYTES = 256 << 20
CHUNK_BYTES = 1 << 16        # text is tokenized in pieces of about this size, cut at line ends
MAX_RECORD_BYTES = 64 << 20  # the longest line of a JSON-lines input
COUNT_BLOCK = 1 << 20        # tokens per n-gram counting block
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

# files a directory input contributes when no --glob is given
DEFAULT_SUFFIXES = (
    ".txt", ".md", ".markdown", ".rst", ".tex", ".org", ".adoc", ".csv", ".tsv", ".html", ".htm", ".xml",
    ".py", ".pyi", ".ipynb", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".cs", ".java", ".kt", ".scala",
    ".go", ".rs", ".swift", ".m", ".js", ".jsx", ".mjs", ".ts", ".tsx", ".css", ".scss", ".vue", ".php", ".rb",
    ".pl", ".lua", ".r", ".jl", ".sh", ".bash", ".zsh", ".fish", ".ps1", ".sql", ".json", ".yaml", ".yml",
    ".toml", ".ini", ".cfg", ".conf", ".cmake", ".mk", ".dockerfile", ".proto", ".graphql",
)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
SKIP_DIRS = {"__pycache__", "node_modules"}


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
        _write_corpus(path, self.header, self.arrays, progress)
        self.path = path
        return path

    @classmethod
    def load(cls, path: str, vocab=None, verify: bool = True) -> Corpus:
        """Map a corpus file read-only.  The header and array table are checked
        against the file size before anything is mapped; with `verify` the array
        contents are range-checked too (indices a drafter follows stay inside
        their arrays).  With `vocab` (edgespec.backend.llama.Vocab) the tokenizer
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


def _read_header(path: str):
    """Parse and check the header of a corpus file without mapping it.
    Returns (header, {name: (dtype, shape, offset, nbytes)}, file size)."""
    def bad(msg):
        return CorpusError(f"{path}: {msg}")

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 8 or head[:8] != MAGIC:
                raise bad("not an edgespec corpus file (bad magic bytes)")
            if len(head) < 16:
                raise bad(f"truncated corpus file ({size} bytes)")
            hlen = int.from_bytes(head[8:16], "little")
            if hlen > MAX_HEADER_BYTES or 16 + hlen > size:
                raise bad(f"truncated or corrupt corpus file (header of {hlen} bytes, file of {size} bytes)")
            raw = f.read(hlen)
    except FileNotFoundError:
        raise CorpusError(f"corpus file not found: {path}") from None
    except IsADirectoryError:
        raise CorpusError(f"not a file: {path}") from None
    except OSError as e:
        raise CorpusError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise bad("corrupt corpus header (not valid JSON)") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise bad("corrupt corpus header (not an edgespec corpus header)")
    if header.get("version") != FORMAT_VERSION:
        raise bad(f"corpus format version {header.get('version')!r} is not supported "
                  f"(this edgespec reads version {FORMAT_VERSION}); rebuild the corpus")
    try:
        V = header["n_vocab"]
        n_docs, n_tokens = header["n_docs"], header["n_tokens"]
        params = header["params"]
        for v in (V, n_docs, n_tokens, params["sa_depth"], params["max_successors"], params["k_adj"]):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise TypeError
        if V < 1 or params["sa_depth"] < 1:
            raise TypeError
        entries = header["arrays"]
        if not isinstance(entries, list):
            raise TypeError
        table = {}
        data_start = 16 + hlen
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
                raise bad(f"truncated or corrupt corpus file (array {name} ends at byte {off + nbytes}, "
                          f"the file has {size})")
            table[name] = (dtype, tuple(shape), off, nbytes)
    except (KeyError, TypeError, AttributeError):
        raise bad("corrupt corpus header (missing or invalid fields)") from None
    missing = [n for n in ARRAYS if n not in table]
    if missing:
        raise bad(f"corrupt corpus header (no array {missing[0]})")
    N = n_tokens + n_docs
    C = table["tri_w2"][1][0]
    E = table["tri_next"][1][0]
    K = table["adj_next"][1][1]
    want = {"tokens": (N,), "sa": (n_tokens,), "tri_w1_offsets": (V + 1,), "tri_w2": (C,),
            "tri_ctx_count": (C,), "tri_offsets": (C + 1,), "tri_next": (E,), "tri_count": (E,),
            "adj_next": (V, K), "adj_count": (V, K)}
    for name, shape in want.items():
        if table[name][1] != shape:
            raise bad(f"corrupt corpus header (array {name} has shape {list(table[name][1])}, "
                      f"expected {list(shape)})")
    return header, table, size


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


def _write_corpus(path: str, header: dict, arrays: dict, progress=False) -> None:
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


# ================================================================== kernels
@njit(cache=True)
def _merge_counts(ka, ca, kb, cb):
    """Merge two runs of (sorted unique key, count) into one, summing counts of equal keys."""
    na, nb = len(ka), len(kb)
    k = np.empty(na + nb, np.int64)
    c = np.empty(na + nb, np.int64)
    i = j = n = 0
    while i < na and j < nb:
        if ka[i] < kb[j]:
            k[n] = ka[i]
            c[n] = ca[i]
            i += 1
        elif kb[j] < ka[i]:
            k[n] = kb[j]
            c[n] = cb[j]
            j += 1
        else:
            k[n] = ka[i]
            c[n] = ca[i] + cb[j]
            i += 1
            j += 1
        n += 1
    while i < na:
        k[n] = ka[i]
        c[n] = ca[i]
        i += 1
        n += 1
    while j < nb:
        k[n] = kb[j]
        c[n] = cb[j]
        j += 1
        n += 1
    return k[:n].copy(), c[:n].copy()


@njit(cache=True)
def _top_successors(keys, counts, V, k):
    """Rows of successors from sorted unique keys ctx * V + next with their counts.

    For each context (a run of equal keys // V) keep the k most frequent nexts,
    count descending, ties by next ascending (the keys are ascending, and a
    later entry only passes entries with a strictly smaller count).
    Returns row_ctx int64[R], row_total int64[R] (every successor, unpruned),
    row_ptr int64[R+1], nxt int32[E], cnt int64[E].
    """
    n = len(keys)
    R = 0
    E = 0
    i = 0
    while i < n:
        c = keys[i] // V
        j = i
        while j < n and keys[j] // V == c:
            j += 1
        R += 1
        E += min(k, j - i)
        i = j
    row_ctx = np.empty(R, np.int64)
    row_total = np.empty(R, np.int64)
    row_ptr = np.empty(R + 1, np.int64)
    nxt = np.empty(E, np.int32)
    cnt = np.empty(E, np.int64)
    buf = np.empty(max(k, 1), np.int64)
    i = 0
    r = 0
    e = 0
    while i < n:
        c = keys[i] // V
        j = i
        tot = 0
        m = 0
        while j < n and keys[j] // V == c:
            x = counts[j]
            tot += x
            p = m
            while p > 0 and counts[buf[p - 1]] < x:
                p -= 1
            if p < k:
                q = min(m, k - 1)
                while q > p:
                    buf[q] = buf[q - 1]
                    q -= 1
                buf[p] = j
                if m < k:
                    m += 1
            j += 1
        row_ctx[r] = c
        row_total[r] = tot
        row_ptr[r] = e
        for q in range(m):
            nxt[e + q] = keys[buf[q]] % V
            cnt[e + q] = counts[buf[q]]
        e += m
        r += 1
        i = j
    row_ptr[R] = e
    return row_ctx, row_total, row_ptr, nxt, cnt


@njit(cache=True)
def _run_lengths(tokens):
    """d[p] = tokens from p up to (not including) the next separator; 0 at a separator."""
    n = len(tokens)
    d = np.empty(n, np.int32)
    run = 0
    for p in range(n - 1, -1, -1):
        if tokens[p] < 0:
            run = 0
        else:
            run += 1
        d[p] = run
    return d


@njit(cache=True)
def _pair_keys(pos, rank, d, k):
    """Prefix-doubling key of each position: (rank of its first k tokens) << 32 |
    (rank of the next k tokens, or 0 when the key ends at a separator before them)."""
    out = np.empty(len(pos), np.int64)
    for i in range(len(pos)):
        p = pos[i]
        second = rank[p + k] if d[p] > k else 0
        out[i] = (np.int64(rank[p]) << 32) | np.int64(second)
    return out


@njit(cache=True)
def _assign_ranks(keys, order, pos, rank):
    """Dense ranks from 1 in sorted order (equal keys share a rank); returns the
    number of distinct keys."""
    r = 0
    prev = np.int64(-1)
    for i in range(len(order)):
        kk = keys[order[i]]
        if i == 0 or kk != prev:
            r += 1
            prev = kk
        rank[pos[order[i]]] = r
    return r


# ================================================================= compiling
def suffix_array(tokens: np.ndarray, depth: int = 32, bar=None) -> np.ndarray:
    """Every position p with tokens[p] != -1, sorted by tokens[p : p + depth] cut
    at the first -1 (a key that is a prefix of another sorts first), ties by p.

    Prefix doubling: rank[p] orders the keys of length k; the keys of length 2k
    are the pairs (rank[p], rank[p + k]) (the second 0 when the key stops at a
    separator first), sorted with a stable numpy argsort so equal keys stay in
    position order.  log2(depth) rounds, fewer once every key is distinct.
    `depth` must be a power of two.  Memory: about 40 bytes per token.
    """
    if depth < 1 or depth & (depth - 1):
        raise ValueError(f"sa_depth must be a power of two, got {depth}")
    tokens = np.asarray(tokens)
    N = len(tokens)
    if N >= 1 << 31:
        raise ValueError("corpora of 2**31 tokens or more are not supported")
    pos = np.flatnonzero(tokens >= 0).astype(np.int32)
    M = len(pos)
    rank = np.zeros(N, np.int32)
    rank[pos] = tokens[pos] + 1
    if M == 0:
        return pos
    d = _run_lengths(tokens)
    order = None
    k = 1
    while k < depth:
        keys = _pair_keys(pos, rank, d, k)
        order = np.argsort(keys, kind="stable")
        distinct = _assign_ranks(keys, order, pos, rank)
        del keys
        k *= 2
        if bar is not None:
            bar.update(1)
        if distinct == M:   # every key distinct: longer keys cannot change the order
            if bar is not None:
                bar.update(int(math.log2(depth // k)))
            break
    if order is None:   # depth 1: sort by the token alone
        order = np.argsort(rank[pos], kind="stable")
    return pos[order]


def _count_runs(tokens: np.ndarray, V: int, bar):
    """Bi-gram and tri-gram counts over tokens (never across a -1), counted block
    by block with np.unique and merged in a stack of runs whose sizes at least
    double downwards (each count is merged O(log blocks) times).
    Returns (bi_keys, bi_counts, tri_keys, tri_counts), keys sorted ascending."""
    stacks = {2: [], 3: []}

    def push(n, keys):
        if not len(keys):
            return
        st = stacks[n]
        st.append(np.unique(keys, return_counts=True))
        while len(st) >= 2 and len(st[-2][0]) <= 2 * len(st[-1][0]):
            b, a = st.pop(), st.pop()
            st.append(_merge_counts(a[0], a[1].astype(np.int64, copy=False), b[0], b[1].astype(np.int64, copy=False)))

    N = len(tokens)
    V = np.int64(V)
    for s in range(0, N, COUNT_BLOCK):
        n = min(COUNT_BLOCK, N - s)
        t = np.asarray(tokens[s:min(N, s + n + 2)], dtype=np.int64)
        m = len(t)
        nb = min(n, m - 1)
        if nb > 0:
            a, b = t[:nb], t[1:nb + 1]
            ok = (a >= 0) & (b >= 0)
            push(2, (a * V + b)[ok])
        nt = min(n, m - 2)
        if nt > 0:
            a, b, c = t[:nt], t[1:nt + 1], t[2:nt + 2]
            ok = (a >= 0) & (b >= 0) & (c >= 0)
            push(3, ((a * V + b) * V + c)[ok])
        bar.update(n)
    out = []
    for n in (2, 3):
        st = stacks[n]
        if not st:
            out += [np.zeros(0, np.int64), np.zeros(0, np.int64)]
            continue
        while len(st) > 1:
            b, a = st.pop(), st.pop()
            st.append(_merge_counts(a[0], a[1].astype(np.int64), b[0], b[1].astype(np.int64)))
        out += [st[0][0], st[0][1].astype(np.int64)]
    return tuple(out)


def _u32(x: np.ndarray) -> np.ndarray:
    """Counts as uint32, saturating."""
    return np.minimum(x, np.iinfo(np.uint32).max).astype(np.uint32)


def _compile_arrays(tokens: np.ndarray, n_vocab: int, max_successors: int, k_adj: int, sa_depth: int,
                    progress=False) -> dict:
    """Every array but `tokens` from a token array with its separators."""
    V = int(n_vocab)
    with _bar(progress, total=len(tokens), desc="counting", unit="tok", unit_scale=True) as bar:
        bi_k, bi_c, tri_k, tri_c = _count_runs(tokens, V, bar)

    # tri-grams: contexts w1 * V + w2, successors w3
    ctx, tot, ptr, nxt, cnt = _top_successors(tri_k, tri_c, np.int64(V), int(max_successors))
    del tri_k, tri_c
    w1 = ctx // V
    out = {
        "tri_w1_offsets": np.searchsorted(w1, np.arange(V + 1), side="left").astype(np.int32),
        "tri_w2": (ctx % V).astype(np.int32),
        "tri_ctx_count": _u32(tot),
        "tri_offsets": ptr.astype(np.int32),
        "tri_next": nxt,
        "tri_count": _u32(cnt),
    }
    del ctx, tot, ptr, nxt, cnt, w1

    # bi-grams: each token's k_adj most frequent successors
    ctx, _, ptr, nxt, cnt = _top_successors(bi_k, bi_c, np.int64(V), int(k_adj))
    adj_next = np.full((V, k_adj), -1, np.int32)
    adj_count = np.zeros((V, k_adj), np.uint32)
    sizes = np.diff(ptr)
    rows = np.repeat(ctx, sizes)
    cols = np.arange(len(nxt)) - np.repeat(ptr[:-1], sizes)
    adj_next[rows, cols] = nxt
    adj_count[rows, cols] = _u32(cnt)
    out["adj_next"], out["adj_count"] = adj_next, adj_count

    rounds = int(math.log2(sa_depth))
    with _bar(progress, total=rounds, desc="suffix array", unit="round") as bar:
        out["sa"] = suffix_array(tokens, sa_depth, bar)
    return out


def _check_params(n_vocab, max_successors, k_adj, sa_depth):
    if not isinstance(n_vocab, (int, np.integer)) or not 1 <= n_vocab < 1 << 21:
        raise ValueError(f"n_vocab must be in 1..2**21, got {n_vocab!r}")
    if max_successors < 1 or k_adj < 1:
        raise ValueError("max_successors and k_adj must be at least 1")
    if sa_depth < 1 or sa_depth & (sa_depth - 1):
        raise ValueError(f"sa_depth must be a power of two, got {sa_depth}")


def _base_header(n_vocab, n_tokens, n_docs, max_successors, k_adj, sa_depth) -> dict:
    from edgespec import __version__
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "edgespec_version": __version__,
        "n_vocab": int(n_vocab),
        "n_tokens": int(n_tokens),
        "n_docs": int(n_docs),
        "params": {"max_successors": int(max_successors), "k_adj": int(k_adj), "sa_depth": int(sa_depth)},
        "tokenizer": None,
        "sources": [],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def compile_tokens(docs, n_vocab: int, max_successors: int = 8, k_adj: int = 8, sa_depth: int = 32,
                   progress=None) -> Corpus:
    """Compile documents (sequences of token ids in 0..n_vocab-1) into an in-memory
    Corpus.  No model is involved; header["tokenizer"] is None (set it before
    saving to pin the corpus to a tokenizer)."""
    _check_params(n_vocab, max_successors, k_adj, sa_depth)
    t0 = time.perf_counter()
    docs = [np.asarray(d).reshape(-1) for d in docs]
    for d in docs:
        if len(d) and (d.min() < 0 or d.max() >= n_vocab):
            raise ValueError(f"token ids must be in 0..{n_vocab - 1}")
    n_tok = sum(len(d) for d in docs)
    tokens = np.full(n_tok + len(docs), -1, np.int32)
    i = 0
    for d in docs:
        tokens[i:i + len(d)] = d
        i += len(d) + 1
    arrays = _compile_arrays(tokens, n_vocab, max_successors, k_adj, sa_depth, progress)
    arrays["tokens"] = tokens
    header = _base_header(n_vocab, n_tok, len(docs), max_successors, k_adj, sa_depth)
    header["build_seconds"] = round(time.perf_counter() - t0, 3)
    return Corpus(arrays, header)


# ================================================================== building
@dataclass
class Source:
    """One input of a build: a text file, a JSON-lines file, or in-memory records
    (dicts with "messages" or "text"), as presets produce."""
    name: str
    kind: str                       # "text", "jsonl" or "records"
    path: str | None = None
    records: list | None = None
    size: int = 0                   # bytes, for the progress bar
    stats: dict = dc_field(default_factory=lambda: {"bytes": 0, "docs": 0, "tokens": 0})


def _matches(rel: str, patterns) -> bool:
    base = rel.rsplit("/", 1)[-1]
    for p in patterns:
        if fnmatch.fnmatch(rel if "/" in p else base, p):
            return True
    return False


def collect_sources(inputs, glob=None) -> list[Source]:
    """Files, directories (walked recursively in sorted order, skipping hidden
    entries, __pycache__ and node_modules; `glob` patterns, or by default the
    DEFAULT_SUFFIXES text and code files) and JSON-lines files (.jsonl/.ndjson)."""
    patterns = [glob] if isinstance(glob, str) else list(glob or [])
    out, seen = [], set()

    def add(path):
        real = os.path.realpath(path)
        if real in seen:
            return
        seen.add(real)
        kind = "jsonl" if path.lower().endswith(JSONL_SUFFIXES) else "text"
        out.append(Source(name=path, kind=kind, path=path, size=os.path.getsize(path)))

    for inp in inputs:
        inp = os.fspath(inp)
        if not os.path.exists(inp):
            raise CorpusError(f"input not found: {inp}")
        if os.path.isfile(inp):
            add(inp)
            continue
        if not os.path.isdir(inp):
            raise CorpusError(f"not a file or directory: {inp}")
        found = 0
        for root, dirs, files in os.walk(inp):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
            for fn in sorted(files):
                if fn.startswith("."):
                    continue
                full = os.path.join(root, fn)
                rel = os.path.relpath(full, inp).replace(os.sep, "/")
                ok = _matches(rel, patterns) if patterns else fn.lower().endswith(DEFAULT_SUFFIXES)
                if ok and os.path.isfile(full):
                    add(full)
                    found += 1
        if not found:
            what = f"--glob {' '.join(patterns)}" if patterns else "text or code files (use --glob)"
            raise CorpusError(f"no files matched in {inp} ({what})")
    return out


def split_text(text: str, size: int = CHUNK_BYTES):
    """Cut text into pieces of about `size` characters at line ends (a line longer
    than that is cut where it reaches it)."""
    i, n = 0, len(text)
    while i < n:
        j = i + size
        if j < n:
            nl = text.rfind("\n", i, j)
            if nl >= i:
                j = nl + 1
        yield text[i:j]
        i = j


def _file_chunks(path: str, bar, size: int = CHUNK_BYTES):
    """Text of a file in pieces of about `size` bytes cut at line ends, decoded as
    UTF-8 (invalid bytes replaced).  Returns nothing for a binary file (a NUL byte
    in its first block)."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    carry = b""
    with open(path, "rb") as f:
        first = True
        while True:
            block = f.read(size)
            if first and b"\0" in block:
                bar.update(os.path.getsize(path))
                return
            first = False
            bar.update(len(block))
            if not block:
                text = dec.decode(carry, final=True)
                if text:
                    yield text
                return
            data = carry + block
            nl = data.rfind(b"\n")
            if nl < 0 and len(data) < 16 * size:
                carry = data
                continue
            cut = nl + 1 if nl >= 0 else len(data)
            carry = data[cut:]
            text = dec.decode(data[:cut])
            if text:
                yield text


class _ModelTokenizer:
    """A vocab-only load of a GGUF model: tokenizer, fingerprint, chat template."""

    def __init__(self, model_path: str):
        from edgespec.backend.llama import Vocab, load_model, model_metadata
        self.model_path = model_path
        self.model = load_model(model_path, vocab_only=True)
        self.vocab = Vocab(self.model)
        self._meta = lambda key: model_metadata(self.model, key)

    def fingerprint(self) -> dict:
        fp = tokenizer_fingerprint(self.vocab)
        fp["model_name"] = self._meta("general.name")
        fp["model_file"] = os.path.basename(self.model_path)
        return fp

    def tokenize(self, text: str, special: bool) -> np.ndarray:
        return self.vocab.tokenize(text, add_special=False, parse_special=special)

    def render(self, messages) -> str:
        """A whole conversation in the model's chat template (no generation prompt)."""
        if not self.vocab.chat_template():
            raise CorpusError(f"{self.model_path} has no chat template: JSON lines with `messages` "
                              "cannot be rendered (give --field NAME for plain text)")
        try:
            return self.vocab.format_chat(messages, add_generation_prompt=False)
        except ValueError as e:
            raise CorpusError(f"{self.model_path}: {e}") from None

    def close(self) -> None:
        if self.model is not None:
            from edgespec.backend.llama import free_model
            free_model(self.model)
            self.model = None


def _check_text(text: str, where: str) -> str:
    """`text`, unless it holds an unpaired surrogate (JSON allows the escape
    \\ud800 alone; it is not text and cannot be tokenized)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise CorpusError(f"{where}: the text holds an unpaired surrogate escape (\\ud800-\\udfff)") from None
    return text


def _record_text(rec, field, tok: _ModelTokenizer, where: str):
    """(text, parse_special) of one JSON record: `field` (default "text") if the
    record has it, else a `messages` list rendered with the chat template; a bare
    JSON string is text."""
    if isinstance(rec, str):
        return _check_text(rec, where), False
    if not isinstance(rec, dict):
        raise CorpusError(f"{where}: expected a JSON object")
    name = field or "text"
    if name in rec:
        if not isinstance(rec[name], str):
            raise CorpusError(f"{where}: field {name!r} is not a string")
        return _check_text(rec[name], where), False
    msgs = rec.get("messages")
    if isinstance(msgs, list):
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in msgs):
            raise CorpusError(f"{where}: `messages` must be a list of {{role, content}} objects with string values")
        for m in msgs:
            _check_text(m["role"], where)
            _check_text(m["content"], where)
        return tok.render(msgs), True
    raise CorpusError(f"{where}: no {name!r} field and no `messages` list"
                      + ("" if field else " (name the text field with --field)"))


def _source_docs(src: Source, tok: _ModelTokenizer, field, bar):
    """Yield each document of a source as an iterator of (text piece, parse_special)."""
    if src.kind == "text":
        yield ((t, False) for t in _file_chunks(src.path, bar))
    elif src.kind == "jsonl":
        with open(src.path, "rb") as f:
            # a line is read whole: one longer than MAX_RECORD_BYTES is refused
            # instead of filling memory
            for i, line in enumerate(iter(lambda: f.readline(MAX_RECORD_BYTES + 1), b""), 1):
                bar.update(len(line))
                if len(line) > MAX_RECORD_BYTES:
                    raise CorpusError(f"{src.path} line {i}: longer than {MAX_RECORD_BYTES >> 20} MiB "
                                      "(one JSON record a line)")
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except (UnicodeDecodeError, ValueError, RecursionError):
                    raise CorpusError(f"{src.path} line {i}: not valid JSON") from None
                text, special = _record_text(rec, field, tok, f"{src.path} line {i}")
                yield ((t, special) for t in split_text(text))
    else:
        for i, rec in enumerate(src.records):
            text, special = _record_text(rec, field, tok, f"{src.name} record {i + 1}")
            bar.update(len(text.encode("utf-8")))
            yield ((t, special) for t in split_text(text))


def _tokenize_to_file(sources, tok: _ModelTokenizer, field, f, progress) -> tuple[int, int]:
    """Tokenize every source into the open binary file `f` (int32, a -1 after each
    document); returns (n_tokens, n_docs) and fills each source's stats."""
    sep = np.array([-1], np.int32)
    n_tokens = n_docs = 0
    t0 = time.perf_counter()
    total = sum(s.size for s in sources)
    with _bar(progress, total=total, desc="tokenizing", unit="B", unit_scale=True) as bar:
        for src in sources:
            for doc in _source_docs(src, tok, field, bar):
                n = 0
                for text, special in doc:
                    src.stats["bytes"] += len(text.encode("utf-8"))
                    ids = tok.tokenize(text, special)
                    if len(ids):
                        f.write(memoryview(ids).cast("B"))
                        n += len(ids)
                if n:
                    f.write(memoryview(sep).cast("B"))
                    n_tokens += n
                    n_docs += 1
                    src.stats["docs"] += 1
                    src.stats["tokens"] += n
                    dt = time.perf_counter() - t0
                    bar.set_postfix_str(f"{n_tokens / 1e6:.2f}M tok, {n_tokens / max(dt, 1e-9) / 1e3:.0f}k tok/s",
                                        refresh=False)
    return n_tokens, n_docs


def _check_output(out_path: str) -> str:
    out_path = os.fspath(out_path)
    if os.path.isdir(out_path):
        raise CorpusError(f"output is a directory: {out_path}")
    d = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(d):
        raise CorpusError(f"output directory does not exist: {d}")
    if not os.access(d, os.W_OK):
        raise CorpusError(f"cannot write {out_path}: directory {d} is not writable")
    return out_path


def _preset_sources(name, model_path, out_path, load_model, limit, max_tokens, progress) -> list[Source]:
    kind, items = preset_inputs(name, model_path, out_path, load_model=load_model, limit=limit,
                                max_tokens=max_tokens, progress=progress)
    if kind == "files":
        return [Source(name=p, kind="text", path=p, size=os.path.getsize(p)) for p in items]
    size = sum(len(json.dumps(r, ensure_ascii=False).encode("utf-8")) for r in items)
    return [Source(name=f"preset:{name}", kind="records", records=items, size=size)]


def build_corpus(inputs, model_path: str | None, out_path: str, glob=None, field: str | None = None, *,
                 preset: str | None = None, limit: int | None = None, max_tokens: int | None = None,
                 load_model=None, max_successors: int = 8, k_adj: int = 8, sa_depth: int = 32,
                 progress=True) -> Corpus:
    """Tokenize `inputs` (and a preset's documents) with the model's tokenizer and
    write a compiled corpus to `out_path`; returns it loaded (memory-mapped).

    inputs: files and directories (see collect_sources); glob: pattern(s) choosing
    files inside directories; field: the text field of JSON-lines records;
    preset: "stdlib" or "chat" (edgespec.corpus.presets): limit keeps its first N files or
    instructions, max_tokens caps the chat answers (default: the recipe's 256);
    the chat preset's missing answers are generated by load_model(model_path,
    n_ctx=N) (e.g. edgespec.SpecModel).
    Memory stays bounded: tokens are written to a temporary file next to the
    output, and only the compiled arrays (O(tokens)) live in memory.
    """
    from edgespec.models.resolve import resolve_model

    t0 = time.perf_counter()
    _check_params(1, max_successors, k_adj, sa_depth)
    out_path = _check_output(out_path)
    model_path = resolve_model(model_path)
    sources = collect_sources(inputs, glob)
    if preset:
        sources += _preset_sources(preset, model_path, out_path, load_model, limit, max_tokens, progress)
    if not sources:
        raise CorpusError("nothing to build: give INPUT files or directories, or --preset")

    d = os.path.dirname(os.path.abspath(out_path))
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(out_path) + ".", suffix=".tokens.tmp")
    except OSError as e:
        raise CorpusError(f"cannot write {out_path}: {e.strerror or e}") from None
    tok = None
    try:
        with os.fdopen(fd, "wb") as f:
            tok = _ModelTokenizer(model_path)
            n_tokens, n_docs = _tokenize_to_file(sources, tok, field, f, progress)
        if n_tokens == 0:
            raise CorpusError("no text found in the inputs")
        fp = tok.fingerprint()
        V = tok.vocab.n_vocab
        tok.close()
        tokens = np.memmap(tmp, dtype=np.int32, mode="r")
        arrays = _compile_arrays(tokens, V, max_successors, k_adj, sa_depth, progress)
        arrays["tokens"] = tokens
        header = _base_header(V, n_tokens, n_docs, max_successors, k_adj, sa_depth)
        header["tokenizer"] = fp
        header["sources"] = [{"path": s.name, **s.stats} for s in sources]
        header["params"].update({"glob": glob, "field": field, "preset": preset,
                                 "limit": limit if preset else None})
        header["build_seconds"] = round(time.perf_counter() - t0, 3)
        _write_corpus(out_path, header, arrays, progress)
        del arrays, tokens
    finally:
        if tok is not None:
            tok.close()
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return Corpus.load(out_path, verify=False)
