"""The front pages stay short (README.md a first screen for users, BENCHMARKS.md
the current report), with links and commands that point at things that exist.
Fast tier: nothing is loaded."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 250
MAX_LINE = 400
MAX_BYTES = {"README.md": 12_000, "BENCHMARKS.md": 40_000}     # issue 63: a door and a report, not logs


def _read(name="README.md"):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def _prose_and_code(text):
    """(prose lines, code lines) of a Markdown text, split at ``` fences."""
    prose, code, inside = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            code.append(line)
        else:
            prose.append(line)
    return prose, code


def test_readme_is_short_and_its_lines_readable():
    text = _read()
    assert len(text.splitlines()) <= MAX_LINES
    prose, _ = _prose_and_code(text)
    visible = [re.sub(r"<!--.*?-->", "", line) for line in prose]     # figure markers (tests/test_figures.py)
    long = [line[:60] for line in visible if len(line) > MAX_LINE]
    assert not long, long


def test_readme_opens_with_the_setup_and_test_commands():
    _, code = _prose_and_code(_read())
    assert code[0].startswith("CMAKE_ARGS=\"-DGGML_RPC=on\" pip install -e '.[smollm2]' && edgespec generate ")
    assert code[1] == "CMAKE_ARGS=\"-DGGML_RPC=on\" pip install -e '.[test]' && python -m pytest -q"


def test_readme_links_and_paths_exist():
    text = _read()
    targets = set(re.findall(r"\]\(([^)#\s]+)\)", text))
    targets |= set(re.findall(r"\b((?:docs|tools|benchmarks|tests|edgespec)/[\w./-]+?\.(?:md|py|png|jsonl|html)(?:\.gz)?)(?![\w.])", text))
    assert targets
    missing = sorted(t for t in targets if not t.startswith("http") and not os.path.exists(os.path.join(ROOT, t)))
    assert not missing, missing


def test_front_pages_stay_short():
    sizes = {name: os.path.getsize(os.path.join(ROOT, name)) for name in MAX_BYTES}
    assert all(sizes[n] <= MAX_BYTES[n] for n in MAX_BYTES), sizes


def _anchors(path):
    """The anchors GitHub gives a Markdown page's headings (lower case, punctuation dropped, spaces to '-')."""
    out = set()
    with open(path, encoding="utf-8") as f:
        fence = False
        for line in f:
            fence ^= line.startswith("```")
            if not fence and line.startswith("#"):
                out.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return out


def test_links_of_the_front_pages_and_docs_resolve():
    """Every relative link in README.md, BENCHMARKS.md and docs/*.md names a
    file that exists (relative to its page), and an anchor into a Markdown
    page names one of its headings."""
    docs = os.path.join(ROOT, "docs")
    pages = ["README.md", "BENCHMARKS.md"] + [os.path.join("docs", n) for n in sorted(os.listdir(docs)) if n.endswith(".md")]
    missing = []
    for page in pages:
        here = os.path.dirname(os.path.join(ROOT, page))
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", _read(page)):
            if target.startswith(("http:", "https:", "mailto:")):
                continue
            path = os.path.join(here, target) if target else os.path.join(ROOT, page)
            if not os.path.exists(path):
                missing.append(f"{page}: {target}")
            elif anchor and path.endswith(".md") and anchor not in _anchors(path):
                missing.append(f"{page}: {target}#{anchor}")
    assert not missing, missing


def test_readme_commands_name_real_subcommands():
    from edgespec.app.cli import main
    _, code = _prose_and_code(_read())
    used = set()
    for line in code:
        for m in re.finditer(r"(?:^|&&\s*|\|\s*|\)\s)edgespec ([a-z][a-z-]*)", line):
            used.add(m.group(1))
    assert used
    unknown = sorted(u for u in used if u not in main.commands)
    assert not unknown, unknown
