"""Write a held-out bench set of long-context prompts from installed packages'
own README texts (their PyPI long descriptions), which no dev prompt, test or
corpus preset contains.

    python tools/make_heldout_docs.py [-n 40] [-o benchmarks/results/heldout-docs-40.jsonl]

Packages with at least 1,500 characters of description, sorted by name (edgespec
itself left out); each text is cut at a paragraph boundary near 2,500
characters.  Even-numbered packages give a summarization prompt (category
`doc-summary`), odd-numbered ones a question answered from the text
(`doc-qa`).  The set depends on what is installed: the committed file is the
one the benchmarks used.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json

MIN_CHARS = 1500
CUT = 2500


def texts():
    seen = set()
    for d in sorted(md.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = d.metadata["Name"] or ""
        body = (d.metadata.get_payload() or "").replace("\r\n", "\n")
        if name.lower() in seen or name.lower() == "edgespec" or len(body) < MIN_CHARS:
            continue
        seen.add(name.lower())
        cut = body.rfind("\n\n", 0, CUT)
        yield name, body[:cut if cut > CUT // 2 else CUT].strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=40)
    ap.add_argument("-o", "--out", default="benchmarks/results/heldout-docs-40.jsonl")
    a = ap.parse_args()
    rows = []
    for i, (name, text) in enumerate(texts()):
        if i >= a.n:
            break
        if i % 2 == 0:
            cat, turn = "doc-summary", f"Summarize the following text in a few sentences.\n\n{text}"
        else:
            cat, turn = "doc-qa", (f"Answer the question using only the document below.\n\nDocument:\n{text}\n\n"
                                   f"Question: What is {name} for, and how do you install or start using it?")
        rows.append({"question_id": i, "category": cat, "turns": [turn], "source": name})
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
