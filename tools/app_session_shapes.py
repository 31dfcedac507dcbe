#!/usr/bin/env python3
"""Drive the request shapes of Open WebUI and Continue with the `openai`
client, against edgespec record-session, to record their session traces.

    edgespec record-session --out benchmarks/sessions/openwebui-chat.jsonl --app open-webui-shape \\
        --forward http://127.0.0.1:8080 --port 8099 &
    python tools/app_session_shapes.py openwebui --base http://127.0.0.1:8099/v1

The apps themselves are not run: the shapes follow their documentation.

openwebui  a streamed chat of a few turns (system prompt, growing history);
           after each answer two side requests, not streamed, each one user
           message holding a task and the chat so far: a title, then tags
           (Open WebUI's "title generation" and "tags generation" tasks).
continue   a streamed chat about a code file (system rules, the file as
           context, growing history) with autocomplete requests between the
           turns: /v1/completions, streamed, a fill-in-the-middle prompt of
           the file around the cursor, a small max_tokens and stop strings
           (Continue's tab autocomplete with an OpenAI-compatible provider).

The prompts' wording is this project's own; the answers are the forwarded
server's (greedy).  Needs `pip install openai`.
"""
from __future__ import annotations

import argparse
import sys

CODE = '''import csv


def load_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def total_by(rows, key, value):
    out = {}
    for r in rows:
        out[r[key]] = out.get(r[key], 0) + float(r[value])
    return out


def main(path):
    rows = load_rows(path)
    for name, total in sorted(total_by(rows, "region", "amount").items()):
        print(f"{name}: {total:.2f}")
'''

OWUI_SYSTEM = "You are a helpful assistant. Answer clearly and briefly; use Markdown where it helps."
OWUI_TURNS = ["How do I read a CSV file in Python and sum one column?",
              "Can you make it skip rows where the column is empty?",
              "And how would I write the totals to a new CSV file?"]
TITLE_TASK = ("Task: write a short title of 3 to 5 words, with one emoji, that sums up the chat below. "
              "Answer with the title only, no quotes.\n\nChat:\n{chat}")
TAGS_TASK = ("Task: give 1 to 3 broad topic tags for the chat below, most general first. Answer only with "
             'JSON of the form {{"tags": ["tag1", "tag2"]}}.\n\nChat:\n{chat}')

CONTINUE_SYSTEM = ("You are an expert programming assistant. Keep answers short. When you change code, show the "
                   "whole changed function in a fenced code block with the language and file name.")
CONTINUE_TURNS = ["Explain what total_by does in sales.py.",
                  "Change total_by so rows with an empty value are skipped.",
                  "Add a docstring to load_rows."]
FIM_STOPS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>", "\n\n\n"]


def _chat_text(messages) -> str:
    return "\n".join(f"{m['role'].upper()}: {m['content']}" for m in messages if m["role"] != "system")


def _stream(client, role: str, **kw) -> str:
    out = []
    for ev in client.chat.completions.create(stream=True, extra_headers={"X-Trace-Role": role}, **kw):
        if ev.choices and ev.choices[0].delta.content:
            out.append(ev.choices[0].delta.content)
    return "".join(out)


def openwebui(client, model: str) -> None:
    messages = [{"role": "system", "content": OWUI_SYSTEM}]
    for turn in OWUI_TURNS:
        messages.append({"role": "user", "content": turn})
        answer = _stream(client, "chat", model=model, messages=messages)
        messages.append({"role": "assistant", "content": answer})
        for role, task in (("title", TITLE_TASK), ("tags", TAGS_TASK)):
            client.chat.completions.create(model=model, stream=False, extra_headers={"X-Trace-Role": role},
                                           messages=[{"role": "user", "content": task.format(
                                               chat=_chat_text(messages))}])


def _fim(client, model: str, cut: int) -> None:
    prefix, suffix = CODE[:cut], CODE[cut:]
    prompt = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    for _ in client.completions.create(model=model, prompt=prompt, max_tokens=64, temperature=0.01, stream=True,
                                       stop=FIM_STOPS, extra_headers={"X-Trace-Role": "autocomplete"}):
        pass


def continue_(client, model: str) -> None:
    context = f"```python sales.py\n{CODE}```\n\n"
    messages = [{"role": "system", "content": CONTINUE_SYSTEM}]
    cuts = [CODE.index("    out = {}"), CODE.index("    rows = load_rows(path)"), CODE.index("    return list")]
    for i, turn in enumerate(CONTINUE_TURNS):
        _fim(client, model, cuts[i])
        messages.append({"role": "user", "content": (context if i == 0 else "") + turn})
        answer = _stream(client, "chat", model=model, messages=messages, max_tokens=512)
        messages.append({"role": "assistant", "content": answer})
        _fim(client, model, cuts[i] + 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=("openwebui", "continue"))
    ap.add_argument("--base", default="http://127.0.0.1:8099/v1")
    a = ap.parse_args(argv)
    from openai import OpenAI

    client = OpenAI(base_url=a.base, api_key="x")
    model = client.models.list().data[0].id
    (openwebui if a.shape == "openwebui" else continue_)(client, model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
