"""A chat conversation in the terminal: its messages, /commands and answers.

ChatSession holds the messages, runs the lines starting with /name as
commands (attach a file, set the system message, save, load, retry, stats,
reset) and prints each answer as it arrives, accepted drafts in colour.  The
text helpers beside it split piped input into messages, read attachments and
saved conversations; the terminal input loop is chat.py's.
"""
from __future__ import annotations

import json
import os
import re
import sys

import click

from edgespec.app.cli.options import user_errors
from edgespec.app.cli.output import acceptance_lines, calibration_line, kernels_line
from edgespec.app.termsafe import read_bounded, visible


DRAFT_COLOR = "cyan"
FENCE = '"""'
FILE_LIMIT = 256 * 1024        # bytes of one /file attachment
COMMANDS = {
    "/file PATH": f"attach a text file (up to {FILE_LIMIT // 1024} KiB) to your next message",
    "/system TEXT": "set the system message (/system alone shows it)",
    "/save FILE": "save the conversation as JSON (OpenAI messages format)",
    "/load FILE": "replace the conversation with a saved one (its KV cache comes from disk when kept)",
    "/retry": "drop the last answer and generate it again",
    "/stats": "acceptance report and totals of this session",
    "/reset": "forget the conversation (the system message stays)",
    "/help": "this list",
    "/exit": "leave (Ctrl-D does too)",
}
KEYS = [
    "Enter sends; Alt-Enter (or Esc, then Enter) inserts a newline; a pasted block is one message",
    f'a first line {FENCE} starts a block: Enter adds lines until a line {FENCE} closes it',
    "Up/Down recall earlier messages (history: {history})",
    "Ctrl-C clears the line, on an empty line leaves; during an answer it stops the answer",
]
_COMMAND = re.compile(r"/([A-Za-z]+)(?:\s+|$)")


# ------------------------------------------------------------------ text helpers
def unfence(text: str) -> str:
    """A message whose first line is \"\"\" without those fence lines."""
    lines = text.split("\n")
    if len(lines) > 1 and lines[0].rstrip() == FENCE:
        lines = lines[1:-1] if lines[-1].rstrip() == FENCE else lines[1:]
        return "\n".join(lines)
    return text


def fence_open(text: str) -> bool:
    """True while a message opened with a \"\"\" line has not been closed."""
    lines = text.split("\n")
    return lines[0].rstrip() == FENCE and (len(lines) == 1 or lines[-1].rstrip() != FENCE)


def split_blocks(text: str) -> list[str]:
    """Piped input as messages: blocks separated by blank lines; a block whose
    first line is \"\"\" runs to the next \"\"\" line, blank lines included."""
    blocks: list[str] = []
    cur: list[str] = []
    fenced = False
    for line in text.splitlines():
        if fenced or (not cur and line.rstrip() == FENCE):
            cur.append(line)
            fenced = len(cur) == 1 or line.rstrip() != FENCE
            if not fenced:                      # a closing fence ends the block
                blocks.append(unfence("\n".join(cur)))
                cur = []
        elif line.strip():
            cur.append(line)
        elif cur:
            blocks.append("\n".join(cur))
            cur = []
    if cur:
        blocks.append(unfence("\n".join(cur)))
    return [b for b in blocks if b.strip()]


def read_attachment(path: str) -> str:
    """A file's text for /file; ValueError (one line) for a missing, binary or
    too-large file."""
    p = os.path.expanduser(path)
    if not os.path.exists(p):
        raise ValueError(f"{path}: no such file")
    if not os.path.isfile(p):
        raise ValueError(f"{path}: not a file")
    size = os.path.getsize(p)
    if size > FILE_LIMIT:
        raise ValueError(f"{path} is {size / 1024:.0f} KiB; /file takes text files up to {FILE_LIMIT // 1024} KiB")
    data = read_bounded(p, FILE_LIMIT)
    if len(data) > FILE_LIMIT:
        raise ValueError(f"{path} is over {FILE_LIMIT // 1024} KiB; /file takes text files up to {FILE_LIMIT // 1024} KiB")
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} looks binary (not UTF-8 text); /file takes text files") from None


def with_attachments(message: str, files: list[tuple[str, str]]) -> str:
    """The message followed by each attached file, named and fenced."""
    parts = [message] if message.strip() else []
    for name, text in files:
        fence = "```"
        while fence in text:
            fence += "`"
        parts.append(f"{name}:\n{fence}\n{text.rstrip(chr(10))}\n{fence}")
    return "\n\n".join(parts)


def load_conversation(path: str) -> list[dict]:
    """Messages from a JSON file: a list of {role, content} (OpenAI messages) or
    an object with such a `messages` list; content may be a list of text parts."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON conversation ({e})") from None
    if isinstance(data, dict):
        data = data.get("messages")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of messages (OpenAI format)")
    out = []
    for i, msg in enumerate(data, 1):
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):      # [{"type": "text", "text": ...}, ...]
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str) or msg.get("role") not in ("system", "user", "assistant"):
            raise ValueError(f"{path}: message {i} needs a role (system, user or assistant) and text content")
        out.append({"role": msg["role"], "content": content})
    return out


def history_path() -> str:
    """Where typed messages are kept between runs: $EDGESPEC_DATA_DIR, else
    $XDG_DATA_HOME/edgespec, else ~/.local/share/edgespec."""
    base = os.environ.get("EDGESPEC_DATA_DIR")
    if not base:
        data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
        base = os.path.join(data, "edgespec")
    return os.path.join(base, "chat_history")


def _stop_label(r, max_tokens: int) -> str:
    """The stop reason for people: 'length' before max_tokens means the context is full."""
    if r.stop_reason == "length" and r.n_generated < max_tokens:
        return "context full"
    return r.stop_reason


# ------------------------------------------------------------------ the session
class ChatSession:
    """The conversation, the commands and the answers, printed to stdout."""

    def __init__(self, model, *, max_tokens: int, sampling, stop, system: str | None, color: bool):
        self.m = model
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop = list(stop)
        self.color = color
        self.tty = sys.stdout.isatty()
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.files: list[tuple[str, str]] = []
        self.totals = dict.fromkeys(("turns", "tokens", "decode_s", "steps", "draft_nodes", "draft_accepted",
                                     "prefill_tokens", "prefill_s"), 0)

    # ---------------------------------------------------------- output
    def dim(self, s: str) -> None:
        click.echo(click.style(s, fg="bright_black") if self.color else s, color=self.color)

    def error(self, msg: str) -> None:
        click.echo(f"Error: {msg}", err=True)

    def show(self, chunk) -> None:
        """A chunk's text, accepted drafts in DRAFT_COLOR."""
        for text, drafted in chunk.spans or [(chunk.text, False)]:
            text = visible(text) if self.tty else text
            if drafted and self.color:
                text = click.style(text, fg=DRAFT_COLOR)
            click.echo(text, nl=False, color=self.color)

    # ---------------------------------------------------------- input
    def handle(self, text: str) -> bool:
        """One message or command; False when the user leaves."""
        if not text.strip():
            return True
        cmd = _COMMAND.match(text)
        if cmd:
            return self.command(cmd.group(1).lower(), text[cmd.end():].strip())
        self.messages.append({"role": "user", "content": with_attachments(text, self.files)})
        self.files = []
        if not self.answer():
            self.messages.pop()
        return True

    def command(self, name: str, arg: str) -> bool:
        if name in ("exit", "quit"):
            return False
        handler = getattr(self, f"cmd_{name}", None)
        if handler is None:
            self.error(f"unknown command /{name}; commands: {', '.join(c.split()[0] for c in COMMANDS)} "
                       "(start a message with a space to send text that begins with /)")
        else:
            try:
                handler(arg)
            except ValueError as e:
                self.error(str(e))
        return True

    # ---------------------------------------------------------- commands
    def cmd_help(self, arg: str) -> None:
        for k, v in COMMANDS.items():
            click.echo(f"  {k:<13} {v}")
        for k in KEYS:
            click.echo("  " + k.format(history=history_path()))

    def cmd_reset(self, arg: str) -> None:
        self.messages = [x for x in self.messages[:1] if x["role"] == "system"]
        self.files = []
        self.m.engine.reset()
        self.dim("conversation cleared")

    def cmd_stats(self, arg: str) -> None:
        for s in self.stats_lines():
            click.echo(s)

    def cmd_file(self, arg: str) -> None:
        if not arg:
            raise ValueError("usage: /file PATH")
        text = read_attachment(arg)
        self.files.append((arg, text))
        self.dim(f"attached {arg} ({len(text.splitlines())} lines); it goes with your next message")

    def cmd_system(self, arg: str) -> None:
        has = bool(self.messages) and self.messages[0]["role"] == "system"
        if not arg:
            self.dim(f"system message: {self.messages[0]['content'] if has else '(none)'}")
            return
        if has:
            self.messages[0] = {"role": "system", "content": arg}
        else:
            self.messages.insert(0, {"role": "system", "content": arg})
        self.dim("system message set")

    def cmd_save(self, arg: str) -> None:
        if not arg:
            raise ValueError("usage: /save FILE")
        try:
            with open(os.path.expanduser(arg), "w", encoding="utf-8") as f:
                json.dump(self.messages, f, indent=2, ensure_ascii=False)
                f.write("\n")
        except OSError as e:
            raise ValueError(f"{arg}: {e.strerror or e}") from None
        # the last answer's KV cells are on their way to the prompt cache's folder: wait for
        # them, so that a /load in a later run finds the conversation there and prefills only what is new
        pc = getattr(self.m, "prefix_cache", None)
        disk = pc.disk if pc is not None else None
        kept = disk is not None and disk.flush(30) and disk.off is None
        self.dim(f"saved {len(self.messages)} messages to {arg}"
                 + ("; their KV cache is kept on disk: /load resumes without prefilling them" if kept else ""))

    def cmd_load(self, arg: str) -> None:
        if not arg:
            raise ValueError("usage: /load FILE")
        self.messages = load_conversation(arg)
        self.files = []
        self.dim(f"loaded {len(self.messages)} messages from {arg}")

    def cmd_retry(self, arg: str) -> None:
        old = self.messages.pop() if self.messages and self.messages[-1]["role"] == "assistant" else None
        if not self.messages or self.messages[-1]["role"] != "user":
            if old is not None:
                self.messages.append(old)
            raise ValueError("nothing to retry: no message waits for an answer")
        if not self.answer() and old is not None:
            self.messages.append(old)

    # ---------------------------------------------------------- answers
    def answer(self) -> bool:
        """Answer the conversation; True when an answer (maybe a stopped one)
        was added to it."""
        pieces: list[str] = []

        def on_chunk(chunk) -> None:
            pieces.append(chunk.text)
            self.show(chunk)

        try:
            with user_errors():
                self.fit()
                r = self.m.chat(self.messages, max_tokens=self.max_tokens, sampling=self.sampling,
                                stop=self.stop, on_chunk=on_chunk)
        except KeyboardInterrupt:
            click.echo()
            if not "".join(pieces):
                self.dim("[answer stopped before it began; the message was not kept]")
                return False
            self.messages.append({"role": "assistant", "content": "".join(pieces)})
            self.dim("[answer stopped; the partial answer stays in the conversation]")
            return True
        except click.ClickException as e:
            click.echo()
            self.error(e.message)
            return False
        self.messages.append({"role": "assistant", "content": r.text})
        click.echo()
        self.count(r)
        self.dim(f"[{r.n_generated} tokens, {r.n_draft_accepted} from drafts, {r.tokens_per_s:.1f} tok/s, "
                 f"{r.mean_accepted:.2f} tokens/step, prefill {r.n_prompt_tokens - r.n_reused_tokens} new "
                 f"tokens in {r.prefill_s:.2f}s ({r.n_reused_tokens} reused), "
                 f"stop: {_stop_label(r, self.max_tokens)}]")
        return True

    def fit(self) -> None:
        """Drop the oldest turns when the conversation outgrew the context."""
        n_ctx = self.m.backend.n_ctx
        self.messages, dropped = self.m.fit_messages(self.messages, reserve=min(self.max_tokens, n_ctx // 4))
        if dropped:
            self.dim(f"[the conversation outgrew the context of {n_ctx} tokens: dropped its {dropped} oldest "
                     f"message{'s' if dropped > 1 else ''}; /reset starts over, --ctx allows more]")

    def count(self, r) -> None:
        t = self.totals
        t["turns"] += 1
        t["tokens"] += r.n_generated
        t["decode_s"] += r.decode_s
        t["steps"] += r.n_steps
        t["draft_nodes"] += r.n_draft_nodes
        t["draft_accepted"] += r.n_draft_accepted
        t["prefill_tokens"] += r.n_prompt_tokens - r.n_reused_tokens
        t["prefill_s"] += r.prefill_s

    def stats_lines(self) -> list[str]:
        t = self.totals
        if t["turns"]:
            tps = t["tokens"] / t["decode_s"] if t["decode_s"] > 0 else 0.0
            acc = (t["steps"] + t["draft_accepted"]) / t["steps"] if t["steps"] else 0.0
            lines = [f"session: answers {t['turns']}, {t['tokens']} tokens in {t['decode_s']:.2f}s "
                     f"({tps:.1f} tok/s), {t['steps']} steps ({acc:.2f} tokens/step), "
                     f"draft nodes verified {t['draft_nodes']}, accepted {t['draft_accepted']}; "
                     f"prefill {t['prefill_tokens']} tokens in {t['prefill_s']:.2f}s"]
        else:
            lines = ["session: no answers yet"]
        lines.append(calibration_line(self.m))
        lines.append(kernels_line(self.m))
        if self.m.cost is not None:
            lines.append(self.m.cost.describe())
        return lines + acceptance_lines(self.m)
