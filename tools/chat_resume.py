"""`edgespec chat`'s /load with and without the prompt cache's disk tier (issue 57).

    python tools/chat_resume.py [MODEL] [--tokens 4000] [-t 2] [--out FILE]

Builds a saved conversation of about --tokens tokens (a system message, then
user questions from tests/data/spec_bench_prompts.jsonl answered with
paragraphs of this repository's docs/, so it is real text and the same on
every machine), then runs `edgespec chat MODEL` three times, each a new
process, input piped, in a cache folder of its own holding a copy of the
calibration and no saved prompts:

  first    /load the conversation, ask one question, /save it: the whole
           history is prefilled (what every /load paid before the disk tier)
  resumed  /load the saved conversation, ask the next question: the disk
           tier restores the history, only the new message is prefilled
  cold     the same as resumed with --no-prompt-cache-disk (the same
           prompt, prefilled whole)

and prints, for each, chat's own line: prompt tokens prefilled, reused, and
the seconds before the first token (restore and prefill; chat's
"prefill ... in X s").  The target of issue 57: resumed at most 0.1x cold.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from edgespec.bench.session_targets import seeded_cache  # noqa: E402
from edgespec.models.resolve import resolve_model  # noqa: E402

PREFILL = re.compile(r"prefill (\d+) new tokens in ([\d.]+)s \((\d+) reused\)")


def paragraphs() -> list[str]:
    out = []
    for name in sorted(os.listdir(os.path.join(REPO, "docs"))):
        if name.endswith(".md"):
            with open(os.path.join(REPO, "docs", name), encoding="utf-8") as f:
                out += [p.strip() for p in f.read().split("\n\n") if len(p.strip()) > 200]
    return out


def conversation(tokens: int) -> list[dict]:
    """System, then question / answer pairs until about `tokens` tokens (4 characters a token)."""
    with open(os.path.join(REPO, "tests", "data", "spec_bench_prompts.jsonl"), encoding="utf-8") as f:
        questions = [json.loads(x)["turns"][0] for x in f]
    answers = paragraphs()
    msgs = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
    i = 0
    while sum(len(m["content"]) for m in msgs) < 4 * tokens:
        msgs.append({"role": "user", "content": questions[i % len(questions)][:600]})
        msgs.append({"role": "assistant", "content": "\n\n".join(answers[3 * i:3 * i + 3])})
        i += 1
    return msgs


def chat(model: str, script: str, cache: str, threads: int, extra=()) -> tuple[int, float, int]:
    """One `edgespec chat` process fed `script`: (prefilled, seconds, reused) of its last answer."""
    args = [sys.executable, "-m", "edgespec", "chat", model, "-t", str(threads), "-c", "8192", "-n", "16",
            "--no-color", *extra]
    r = subprocess.run(args, input=script, capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, EDGESPEC_CACHE_DIR=cache))
    found = PREFILL.findall(r.stdout)
    if r.returncode != 0 or not found:
        raise SystemExit(f"edgespec chat failed ({r.returncode}): {r.stdout[-800:]} {r.stderr[-800:]}")
    new, secs, reused = found[-1]
    return int(new), float(secs), int(reused)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", help="append the figures as one JSON line here")
    a = ap.parse_args()
    a.model = resolve_model(a.model)        # the model folder is the environment's, not the run's cache folder
    with tempfile.TemporaryDirectory(prefix="chat-resume-") as work:
        conv, saved = os.path.join(work, "conv.json"), os.path.join(work, "saved.json")
        with open(conv, "w", encoding="utf-8") as f:
            json.dump(conversation(a.tokens), f)
        cache = seeded_cache(os.path.join(work, "cache"))
        first = chat(a.model, f"/load {conv}\n\nName one prime number.\n\n/save {saved}\n", cache, a.threads)
        step = f"/load {saved}\n\nName one even number.\n"
        resumed = chat(a.model, step, cache, a.threads)
        cold_cache = seeded_cache(os.path.join(work, "cold"))
        cold = chat(a.model, step, cold_cache, a.threads, ("--no-prompt-cache-disk",))
    rows = {"first": first, "resumed": resumed, "cold": cold}
    for name, (new, secs, reused) in rows.items():
        print(f"{name:8} prefilled {new:5} tokens, reused {reused:5}, {secs * 1e3:8.0f} ms before the first token")
    ratio = resumed[1] / cold[1]
    print(f"resumed / cold: {ratio:.3f}")
    if a.out:
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"model": a.model, "tokens": a.tokens, "threads": a.threads,
                                **{k: {"prefilled": v[0], "s": v[1], "reused": v[2]} for k, v in rows.items()},
                                "resumed_over_cold": ratio}) + "\n")


if __name__ == "__main__":
    main()
