"""Figures in the docs are checked data: every measured figure in README.md,
BENCHMARKS.md and docs/*.md (docs/benchmarks-history.md among them) that
carries a marker is recomputed from its results file with the bench report's
own code, and must read as written.

A marker is an HTML comment right after its figure (invisible on GitHub):

    1.90x<!-- fig benchmarks/results/amd-2026-11-27-qwen05-code-peers.jsonl.gz default/none -->
    0.88x<!-- fig benchmarks/results/a.jsonl.gz+benchmarks/results/b.jsonl.gz suffix/none category=rag -->

FILES (one, or several joined by "+": their rows pooled, decode tokens over
decode time) and one computation:

    A/B          method A's decode tok/s over B's, as bench-report's speedup: "1.23x"
    tps:A        method A's decode tok/s: "45.1"
    identical:A  A's answers identical to none's: "41/48"
    ci:A         the 95% interval of A's speedup over none: "1.96-2.41"

or, on a bench-sessions results file (edgespec bench-sessions, docs/sessions.md):

    swall:A/B    B's wall time over A's, summed over the sessions: "1.15x"
    swall:A      A's wall seconds, summed: "62.9"
    sttft:A      A's median time to first token of the follow-up chat requests, ms: "3834"
    sprefill:A   A's prefill time over the sessions, seconds: "56.1"
    sprefill:A/B A's prefill time over B's (a cost: below 1 is less time): "0.63x"
    sdecode:A    A's decode speed over the sessions (generated tokens over decode time), tok/s: "86.8"
    scached:A    A's cached share of the prompt tokens, percent: "35%"
    sidentical:A/B  A's answers equal to B's, of the requests both answered: "19/21"
    sfirst:A/B   A's time to first token summed over the streamed requests both answered, over B's: "0.55x"

or, on a bench-editor results file (edgespec bench-editor, docs/sessions.md):

    ep50:A/B     A's request latency p50 over B's: "0.15x" (ep95: the p95)
    ep50:A       A's p50 in seconds: "0.77" (ep95: the p95)
    efirst:A     A's suggestions whose first line was right, of its requests: "6/42"

or, on a bench-mix results file (edgespec bench-mix, docs/sessions.md):

    mttft:A      A's side requests' median time to first token, seconds: "3.68" (mworst: the worst)
    mlong:A      when A's long answer was done, seconds after the run's start: "22.55" (mall: the last request)
    mlong:A/B    A's over B's: "0.73x" (mttft, mworst, mall likewise; a time: below 1 is sooner)
    mtps:A/B     A's tokens per second over the run over B's: "1.10x"
    malone:A     A's answers equal to the same request alone: "5/5"

then filters: category=C[,C...] (those categories only), repeat=N (that pass),
requests=A-B (requests A to B of the file's order, counted from 1); on a
sessions file session=NAME[,NAME...] (those sessions only).
Modelled figures (a replay, not a timed run) carry
<!-- modelled COSTFILE --> instead, on a line that says "modelled"; a figure
whose run kept no results file carries <!-- nofile --> on a line that says
"no results file"; a goal, not a measurement, carries <!-- target --> after
the word "target". Every ratio of BENCHMARKS.md (the current report) carries
one of these, and so does every ratio of its history file above the heading
"Older runs (kept for the record)" (the full write-ups of the current sections).
Fast tier: no model is loaded."""
import gzip
import glob
import os
import re

import pytest

from edgespec.bench.results import read_results
from edgespec.bench.stats import method_stats, speedup_ci

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "BENCHMARKS.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(
    os.path.join(ROOT, "docs", "*.md")))
MARKER = re.compile(r"<!--\s*fig\s+(\S+)\s+(\S+)((?:\s+\w+=\S+)*)\s*-->")
MODELLED = re.compile(r"<!--\s*modelled\s+(\S+)\s*-->")
NOTE = re.compile(r"<!--\s*(nofile|target)\s*-->")
OLDER = "## Older runs (kept for the record)"
HISTORY = os.path.join("docs", "benchmarks-history.md")
COMMENT = re.compile(r"<!--.*?-->")
RATIO = re.compile(r"(?<![\w.])\d+\.\d+x(?!\w)")
COUNT = re.compile(r"(?<![\w./:-])\d+/\d+(?![\w/.])")
DECIMAL = re.compile(r"(?<![\w.-])\d+\.\d+(?![\w.])")
_cache: dict = {}


def _rows(files: str) -> list[dict]:
    if files not in _cache:
        rows = []
        for f in files.split("+"):
            rows += [r for r in read_results(os.path.join(ROOT, f))[1] if r.get("kind", "result") == "result"]
        _cache[files] = rows
    return _cache[files]


def _session_figure(path: str, expr: str, filters: str) -> str:
    """A figure of a bench-sessions results file (see the module doc)."""
    from statistics import median

    from edgespec.bench.sessions import read_results as read_sessions
    rows = read_sessions(os.path.join(ROOT, path))[1]
    for f in filters.split():
        key, value = f.split("=", 1)
        if key != "session":
            raise ValueError(f"unknown sessions filter {f}")
        rows = [r for r in rows if r.get("session") in value.split(",")]
    kind, _, arg = expr.partition(":")
    of = lambda t, k: [r for r in rows if r.get("kind") == k and r["target"] == t]  # noqa: E731
    wall = lambda t: sum(r["wall_s"] for r in of(t, "session"))  # noqa: E731
    if kind == "swall" and "/" in arg:
        a, b = arg.split("/")
        return f"{wall(b) / wall(a):.2f}x"
    if kind == "swall":
        return f"{wall(arg):.1f}"
    prefill = lambda t: sum(r["prefill_ms"] for r in of(t, "session")) / 1e3  # noqa: E731
    if kind == "sprefill" and "/" in arg:
        a, b = arg.split("/")
        return f"{prefill(a) / prefill(b):.2f}x"
    if kind == "sprefill":
        return f"{sum(r['prefill_ms'] for r in of(arg, 'session')) / 1e3:.1f}"
    if kind == "sdecode":
        ss = of(arg, "session")
        return f"{sum(r['predicted_n'] for r in ss) / sum(r['predicted_n'] / r['decode_tok_s'] for r in ss if r['decode_tok_s']):.1f}"
    if kind == "sttft":
        return f"{median(r['ttft_followup_ms'] for r in of(arg, 'session') if r['ttft_followup_ms'] is not None):.0f}"
    if kind == "scached":
        ss = of(arg, "session")
        return f"{100 * sum(r['cache_n'] for r in ss) / sum(r['prompt_tokens'] for r in ss):.0f}%"
    if kind == "sfirst":
        a, b = arg.split("/")
        ttft = lambda t: {(r.get("round"), r["session"], r["index"]): r["ttft_ms"] for r in of(t, "request")  # noqa: E731
                          if r["status"] == 200 and r["ttft_ms"] is not None}
        ta, tb = ttft(a), ttft(b)
        both = [k for k in ta if k in tb]
        return f"{sum(ta[k] for k in both) / sum(tb[k] for k in both):.2f}x"
    if kind == "sidentical":
        a, b = arg.split("/")
        ref = {(r.get("round"), r["session"], r["index"]): r["text"] for r in of(b, "request") if r["status"] == 200}
        got = [((r.get("round"), r["session"], r["index"]), r["text"]) for r in of(a, "request") if r["status"] == 200]
        both = [t == ref[k] for k, t in got if k in ref]
        return f"{sum(both)}/{len(both)}"
    raise ValueError(f"unknown sessions computation {expr}")


def _editor_figure(path: str, expr: str) -> str:
    """A figure of a bench-editor results file (see the module doc), from its summary rows."""
    from edgespec.bench.editor_replay import read_results as read_editor
    rows = [r for r in read_editor(os.path.join(ROOT, path))[1] if r.get("kind") == "summary"]
    of = lambda t: next(r for r in rows if r["target"] == t)  # noqa: E731
    kind, _, arg = expr.partition(":")
    if kind == "efirst":
        return f"{of(arg)['first_lines_right']}/{of(arg)['n_requests']}"
    key = {"ep50": "p50_ms", "ep95": "p95_ms"}[kind]
    if "/" in arg:
        a, b = arg.split("/")
        return f"{of(a)[key] / of(b)[key]:.2f}x"
    return f"{of(arg)[key] / 1e3:.2f}"


def _mix_figure(path: str, expr: str) -> str:
    """A figure of a bench-mix results file (see the module doc), from the report's own figures."""
    from edgespec.bench.mix_report import figures, read_results as read_mix
    rows = [r for r in read_mix(os.path.join(ROOT, path))[1] if r.get("kind") == "request"]
    of = lambda t: figures([r for r in rows if r["target"] == t])  # noqa: E731
    kind, _, arg = expr.partition(":")
    if kind == "malone":
        same, n = of(arg)["alone_same"]
        return f"{same}/{n}"
    key = {"mttft": "side_ttft_median_s", "mworst": "side_ttft_worst_s", "mlong": "long_done_s",
           "mall": "all_done_s", "mtps": "tokens_per_s"}[kind]
    if "/" in arg:
        a, b = arg.split("/")
        return f"{of(a)[key] / of(b)[key]:.2f}x"
    return f"{of(arg)[key]:.2f}"


def figure(files: str, expr: str, filters: str = "") -> str:
    """The figure a marker names, formatted as the docs write it."""
    if expr.split(":")[0] in ("mttft", "mworst", "mlong", "mall", "mtps", "malone"):
        return _mix_figure(files, expr)
    if expr.split(":")[0] in ("ep50", "ep95", "efirst"):
        return _editor_figure(files, expr)
    if expr.split(":")[0] in ("swall", "sttft", "scached", "sidentical", "sprefill", "sdecode", "sfirst"):
        return _session_figure(files, expr, filters)
    rows = _rows(files)
    for f in filters.split():
        key, value = f.split("=", 1)
        if key == "category":
            rows = [r for r in rows if r["category"] in value.split(",")]
        elif key == "repeat":
            rows = [r for r in rows if r.get("repeat", 0) == int(value)]
        elif key == "requests":
            first, last = (int(v) for v in value.split("-"))
            rows = [r for r in rows if first <= r["prompt_index"] + 1 <= last]
        else:
            raise ValueError(f"unknown filter {f}")
    kind, _, arg = expr.rpartition(":")
    pick = lambda m: [r for r in rows if r["method"] == m]  # noqa: E731
    if not kind:
        a, b = arg.split("/")
        return f"{method_stats(pick(a))['tokens_per_s'] / method_stats(pick(b))['tokens_per_s']:.2f}x"
    if kind == "tps":
        return f"{method_stats(pick(arg))['tokens_per_s']:.1f}"
    if kind == "identical":
        s = method_stats(pick(arg))
        return f"{s['identical']}/{s['n_compared']}"
    if kind == "ci":
        lo, hi = speedup_ci(rows, arg)
        return f"{lo:.2f}-{hi:.2f}"
    raise ValueError(f"unknown computation {expr}")


def _doc_lines():
    """(doc, line number, line) of every line of README.md, BENCHMARKS.md and docs/*.md."""
    for doc in DOCS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                yield doc, n, line


def _markers():
    """(doc, line number, visible text before the marker, files, expr, filters) of every marker."""
    out = []
    for doc, n, line in _doc_lines():
        for m in MARKER.finditer(line):
            before = COMMENT.sub("", line[:m.start()])
            out.append((doc, n, before, m.group(1), m.group(2), m.group(3)))
    return out


def test_markers_exist():
    assert len(_markers()) >= 40


def test_every_marked_figure_reads_as_its_results_file_says():
    wrong = []
    for doc, n, before, files, expr, filters in _markers():
        want = figure(files, expr, filters)
        text = before.rstrip(" *")
        if not text.endswith(want) or text[:-len(want)][-1:] in tuple("0123456789."):
            wrong.append(f"{doc}:{n}: {files} {expr}{filters} is {want}; the text before it: ...{text[-30:]!r}")
    assert not wrong, "\n".join(wrong)


def _section(text: str, title: str) -> list[str]:
    lines, inside, fence = [], False, False
    for line in text.splitlines():
        if line.startswith("## "):
            inside = line[3:].strip() == title
        elif line.startswith("```"):
            fence = not fence
        elif inside and not fence:
            lines.append(line)
    return lines


def _unmarked(line: str, pattern) -> list[str]:
    """Figures matching `pattern` on a line (outside comments) that no marker follows."""
    spans = [m.span() for m in COMMENT.finditer(line)]
    out = []
    for m in pattern.finditer(line):
        if any(a <= m.start() < b for a, b in spans):
            continue
        if not re.match(r"\**\s*<!--\s*(fig|modelled|nofile|target)\s", line[m.end():]):
            out.append(m.group(0))
    return out


@pytest.mark.parametrize("title", ["Speed", "Limitations"])
def test_every_figure_in_the_readme_speed_sections_carries_a_marker(title):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = _section(f.read(), title)
    assert lines, title
    bare = []
    for line in lines:
        for pattern in (RATIO, COUNT, DECIMAL):
            bare += [f"{g} in: {COMMENT.sub('', line)[:80]}" for g in _unmarked(line, pattern)]
    assert not bare, "\n".join(bare)


def test_every_ratio_in_the_readme_carries_a_marker():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    bare = [f"{g} in: {COMMENT.sub('', line)[:80]}" for line in _prose(text) for g in _unmarked(line, RATIO)]
    assert not bare, "\n".join(bare)


def _prose(text: str) -> list[str]:
    """Every prose line of a Markdown text (outside ``` fences)."""
    out, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            out.append(line)
    return out


def test_modelled_figures_say_so_and_name_their_cost_file():
    bad = []
    for doc, n, line in _doc_lines():
        for m in MODELLED.finditer(line):
            if "modelled" not in COMMENT.sub("", line) or not os.path.isfile(os.path.join(ROOT, m.group(1))):
                bad.append(f"{doc}:{n}: {m.group(1)}")
    assert not bad, bad


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.gz"))),
                         ids=os.path.basename)
def test_results_files_named_gz_are_gzip(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        first = f.readline()
    assert first.startswith("{")


def _read(doc: str) -> str:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


def _current_report() -> list[str]:
    """The prose lines of BENCHMARKS.md, and of its history file above its "Older runs" heading."""
    history = _read(HISTORY)
    assert OLDER in history.splitlines(), OLDER
    return _prose(_read("BENCHMARKS.md")) + _prose(history.split("\n" + OLDER + "\n")[0])


def test_the_report_is_current_and_its_history_holds_the_older_runs_then_the_changelog():
    heads = [line.strip() for line in _read("BENCHMARKS.md").splitlines() if line.startswith("## ")]
    assert OLDER not in heads and "## Changelog" not in heads
    assert len(heads) >= 6, "the current report has a section per question"
    names = [line.strip() for line in _read(HISTORY).splitlines() if line.startswith("## ")]
    assert OLDER in names and names.index(OLDER) == len(names) - 2 and names[-1] == "## Changelog"
    assert names.index(OLDER) >= 6, "the history keeps the full write-up of each current section"


def test_every_ratio_in_the_current_benchmarks_carries_a_marker():
    lines = _current_report()
    bare = [f"{g} in: {COMMENT.sub('', line)[:80]}" for line in lines for g in _unmarked(line, RATIO)]
    assert not bare, f"{len(bare)} unmarked ratios:\n" + "\n".join(bare)


def test_notes_say_what_they_mark():
    bad = []
    for doc, n, line in _doc_lines():
        for m in NOTE.finditer(line):
            visible = COMMENT.sub("", line)
            if m.group(1) == "nofile" and "no results file" not in visible:
                bad.append(f"{doc}:{n}: nofile on a line that does not say 'no results file'")
            if m.group(1) == "target" and "target" not in COMMENT.sub("", line[:m.start()])[-120:].lower():
                bad.append(f"{doc}:{n}: target marker with no 'target' in the 120 visible characters before it")
    assert not bad, "\n".join(bad)
