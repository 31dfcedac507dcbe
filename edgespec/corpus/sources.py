"""The inputs of a corpus build, read and tokenized: files, directories, JSON lines, records.

Everything between what the user names (paths, globs, a JSON field, a preset's
records) and the token stream a build compiles: choosing the files, reading
text in bounded pieces cut at line ends, turning JSON records and chat
conversations into text, and tokenizing it with a vocab-only load of the model
into a file of int32 tokens with a -1 after each document.
"""
from __future__ import annotations

import codecs
import fnmatch
import json
import os
import time
from dataclasses import dataclass
from dataclasses import field as dc_field

import numpy as np

from edgespec.corpus.format import tokenizer_fingerprint
from edgespec.errors import CorpusError
from edgespec.progress import progress_bar as _bar

CHUNK_BYTES = 1 << 16        # text is tokenized in pieces of about this size, cut at line ends
MAX_RECORD_BYTES = 64 << 20  # the longest line of a JSON-lines input

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


@dataclass
class CorpusInput:
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


def collect_sources(inputs, glob=None) -> list[CorpusInput]:
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
        out.append(CorpusInput(name=path, kind=kind, path=path, size=os.path.getsize(path)))

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


class ModelTokenizer:
    """A vocab-only load of a GGUF model: tokenizer, fingerprint, chat template."""

    def __init__(self, model_path: str):
        from edgespec.backend.llama import load_model, model_metadata
        from edgespec.backend.vocab import Vocab
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


def _record_text(rec, field, tok: ModelTokenizer, where: str):
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


def _source_docs(src: CorpusInput, tok: ModelTokenizer, field, bar):
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


def tokenize_to_file(sources, tok: ModelTokenizer, field, f, progress) -> tuple[int, int]:
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
