"""Editor traces: the requests llama.vim sends to `POST /infill` while a
person types a source file, written from a real file (issue 65).

The rule (docs/sessions.md, "Editor traces"): the person re-types the file's
lines from top to bottom, in the file as it stands: the lines above the
cursor are the real file's (already written), the lines below are the real
file's too (an existing file edited by typing each line anew), and the
current line holds only what has been typed of it, so nothing stands right
of the cursor.  A blank line gets no request.  A line indented by w
characters gets a request at each of the columns w, w + m//3 and w + 2m//3
(m: its characters after the indentation; a column is used once, so a line
of one or two characters gets fewer): the editor has indented the new line,
then the person has typed none, a third and two thirds of the rest.

Each request is llama.vim's (autoload/llama.vim): input_prefix is the up to
N_PREFIX lines above the cursor, each ending in a newline (llama.vim joins
them and adds one: the first line's prefix is "\\n"); prompt is the current
line up to the cursor; input_suffix is what follows the cursor on its line
(nothing), a newline, the up to N_SUFFIX lines below and a newline; on a
line of only indentation prompt and the line's part of the suffix are
empty and n_indent is 0, as llama.vim starts such a line from its first
column, else n_indent is the line's indentation.  input_extra is the ring:
chunks of CHUNK_LINES lines of other files of the project (`extra`), cut
one after another from each file and taken in turn from each; the ring
holds ring_chunks of them, and with ring_every > 0 one more enters at the
back (the oldest leaving the front) after every ring_every lines typed,
until none is left.  llama.vim sends the ring to the server when it changes
(n_predict 0, its cells read and cached, no answer): such a request, role
"ring", comes before the first request and after each change.  The other
fields are llama.vim's: n_predict, t_max_prompt_ms, t_max_predict_ms
(N_PREDICT, T_MAX_MS: the values of llama.vim's README setup), top_k 40,
top_p 0.99, samplers [top_k, top_p, infill], cache_prompt, stream false,
and its response_fields with timings/cache_n added (the replay reports the
reused tokens).  llama.vim's client-side cache of earlier suggestions and
its chunk picks from the current file are not modelled.

Each request line records `typed`: the rest of the line, what the person
typed next (on a line of only indentation, the whole line, since the
request stands at the line's start), which the replay compares with the
suggestion's first line (edgespec.bench.editor_replay).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
from dataclasses import asdict, dataclass

from edgespec.bench.sessions import Session
from edgespec.errors import BenchError

TRACE_MARK = "edgespec-editor"
N_PREFIX, N_SUFFIX = 256, 64
CHUNK_LINES = 64
N_PREDICT = 128
T_MAX_MS = 500
SAMPLERS = ["top_k", "top_p", "infill"]
PLUGIN_TOP_K, PLUGIN_TOP_P = 40, 0.99   # llama.vim's sampling (not edgespec's defaults)
RESPONSE_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                   "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                   "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached",
                   "timings/cache_n"]
ROLES = ("line", "keystroke", "ring")


@dataclass(frozen=True)
class TraceSpec:
    """What part of the file is typed and what the ring holds."""
    start: int = 1              # the first line typed (1-based)
    n_lines: int | None = None  # how many non-blank lines are typed (None: to the end)
    ring_chunks: int = 4
    chunk_lines: int = CHUNK_LINES
    ring_every: int = 0         # lines typed between two ring changes (0: the ring stays)

    def __post_init__(self):
        if self.start < 1 or (self.n_lines is not None and self.n_lines < 1):
            raise BenchError("the first line is >= 1 and the number of lines >= 1")
        if self.ring_chunks < 0 or self.chunk_lines < 3 or self.ring_every < 0:
            raise BenchError("ring chunks >= 0, chunk lines >= 3, ring every >= 0")


def _read_lines(path: str) -> tuple[list[str], str]:
    """The file's lines (without their newlines) and its sha256."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")
    except OSError as e:
        raise BenchError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise BenchError(f"{path} is not UTF-8 text") from None
    return text.splitlines(), hashlib.sha256(raw).hexdigest()


def indentation(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def cursor_columns(line: str) -> list[int]:
    """The columns of a line's requests (the module's doc): after its
    indentation and a third and two thirds of the rest; none for a blank line."""
    w, m = indentation(line), len(line.strip(" \t"))
    if not line.strip():
        return []
    return sorted({w, w + m // 3, w + 2 * m // 3})


def ring_candidates(paths: list[str], names: list[str], chunk_lines: int) -> list[dict]:
    """Every file cut into chunks of chunk_lines lines ({filename, text}), taken
    in turn from each file; chunks of fewer than 3 lines are left out, as
    llama.vim leaves them out."""
    per_file = []
    for path, name in zip(paths, names):
        lines, _ = _read_lines(path)
        cut = [lines[i:i + chunk_lines] for i in range(0, len(lines), chunk_lines)]
        per_file.append([{"filename": name, "text": "".join(x + "\n" for x in c)} for c in cut if len(c) >= 3])
    out = []
    for k in range(max((len(c) for c in per_file), default=0)):
        out += [c[k] for c in per_file if k < len(c)]
    return out


def ring_at(candidates: list[dict], n_typed: int, spec: TraceSpec) -> list[dict]:
    """The ring after n_typed lines: ring_chunks candidates, moved on by one
    every ring_every lines until the last one is in (oldest first)."""
    n = min(spec.ring_chunks, len(candidates))
    moved = n_typed // spec.ring_every if spec.ring_every else 0
    first = min(moved, len(candidates) - n)
    return candidates[first:first + n]


def infill_body(lines: list[str], i: int, col: int, ring: list[dict]) -> dict:
    """llama.vim's /infill body with the cursor at column col of line i
    (0-based), the line holding only its first col characters."""
    typed = lines[i][:col]
    blank = not typed.strip()
    above = lines[max(0, i - N_PREFIX):i]
    below = lines[i + 1:i + 1 + N_SUFFIX]
    return {"input_prefix": "\n".join(above) + "\n", "input_suffix": "\n" + "\n".join(below) + "\n",
            "input_extra": [dict(c) for c in ring], "prompt": "" if blank else typed, "n_predict": N_PREDICT,
            "n_indent": 0 if blank else indentation(typed), "top_k": PLUGIN_TOP_K, "top_p": PLUGIN_TOP_P, "stream": False,
            "samplers": list(SAMPLERS), "cache_prompt": True, "t_max_prompt_ms": T_MAX_MS,
            "t_max_predict_ms": T_MAX_MS, "response_fields": list(RESPONSE_FIELDS)}


def ring_body(ring: list[dict]) -> dict:
    """llama.vim's request when its ring changes: the chunks read and cached, no answer."""
    return {"input_prefix": "", "input_suffix": "", "input_extra": [dict(c) for c in ring], "prompt": "",
            "n_predict": 0, "temperature": 0.0, "stream": False, "samplers": [], "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}


def _requests(lines: list[str], candidates: list[dict], spec: TraceSpec) -> list[dict]:
    out: list[dict] = []
    ring: list[dict] | None = None
    n_typed = 0
    for i in range(spec.start - 1, len(lines)):
        cols = cursor_columns(lines[i])
        if not cols:
            continue
        if spec.n_lines is not None and n_typed >= spec.n_lines:
            break
        now = ring_at(candidates, n_typed, spec)
        if now and now != ring:
            out.append({"path": "/infill", "role": "ring", "line": i + 1, "col": 0, "typed": "",
                        "body": ring_body(now)})
        ring = now
        for k, col in enumerate(cols):
            typed = lines[i] if col == indentation(lines[i]) else lines[i][col:]
            out.append({"path": "/infill", "role": "keystroke" if k else "line", "line": i + 1, "col": col,
                        "typed": typed, "body": infill_body(lines, i, col, now)})
        n_typed += 1
    return out


def editor_trace(source: str, extra: list[str], spec: TraceSpec) -> Session:
    """The trace of typing `source` (the module's doc), its ring from the
    files `extra` (named by their paths relative to the source's folder)."""
    lines, sha = _read_lines(source)
    if spec.start > len(lines):
        raise BenchError(f"{source} has {len(lines)} lines: no line {spec.start}")
    here = os.path.dirname(os.path.abspath(source))
    names = [os.path.relpath(os.path.abspath(p), here) for p in extra]
    reqs = _requests(lines, ring_candidates(list(extra), names, spec.chunk_lines), spec)
    if not reqs:
        raise BenchError(f"{source}: no non-blank line from line {spec.start}")
    from edgespec.version import __version__
    header = {"trace": TRACE_MARK, "app": "llama.vim-protocol", "source": os.path.basename(source),
              "source_sha256": sha, "source_lines": len(lines), "extra": names,
              "lines_typed": sorted({r["line"] for r in reqs if r["role"] != "ring"}),
              "spec": asdict(spec), "n_prefix": N_PREFIX, "n_suffix": N_SUFFIX,
              "recorded": f"edgespec {__version__} editor-trace (edgespec/bench/editor.py's rule)",
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    name = os.path.splitext(os.path.basename(source))[0]
    return Session(name, header, reqs)


def write_trace(session: Session, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in [session.header] + session.requests:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _check(where: str, r) -> dict:
    if not (isinstance(r, dict) and r.get("path") == "/infill" and isinstance(r.get("body"), dict)
            and r.get("role") in ROLES and isinstance(r.get("typed"), str)):
        raise BenchError(f"{where}: a request line is {{\"path\": \"/infill\", \"role\": one of {', '.join(ROLES)}, "
                         "\"typed\": text, \"body\": {...}}")
    return r


def load_editor_trace(path: str) -> Session:
    """An editor trace file; BenchError saying which line is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            rows = [(i + 1, json.loads(line)) for i, line in enumerate(f) if line.strip()]
    except OSError as e:
        raise BenchError(f"cannot read the trace {path}: {e.strerror}") from None
    except ValueError as e:
        raise BenchError(f"{path}: not JSON lines ({e})") from None
    if not rows or not isinstance(rows[0][1], dict) or rows[0][1].get("trace") != TRACE_MARK:
        raise BenchError(f"{path}: the first line must be the header, with \"trace\": \"{TRACE_MARK}\" "
                         "(edgespec editor-trace writes it)")
    reqs = [_check(f"{path}:{no}", r) for no, r in rows[1:]]
    if not reqs:
        raise BenchError(f"{path}: no requests after the header")
    return Session(os.path.basename(path).removesuffix(".jsonl"), rows[0][1], reqs)
