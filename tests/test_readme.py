"""The README stays a first screen for users: short, with links and commands that
point at things that exist.  Fast tier: nothing is loaded."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 250
MAX_LINE = 400


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


def test_docs_links_exist():
    """Links between the docs pages resolve (relative to each page)."""
    docs = os.path.join(ROOT, "docs")
    missing = []
    for name in sorted(os.listdir(docs)):
        if not name.endswith(".md"):
            continue
        for t in re.findall(r"\]\(([^)#\s]+)\)", _read(os.path.join("docs", name))):
            if not t.startswith("http") and not os.path.exists(os.path.join(docs, t)):
                missing.append(f"{name}: {t}")
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
