"""`edgespec chat` as a user runs it: the `edgespec` console script driven
through a real pseudo-terminal (pexpect), with the default SmolLM2 model and
the real llama.cpp; and with stdin piped.

The spawned processes find the c(T) calibration in the cache the session's
`model` fixture has filled (same EDGESPEC_CACHE_DIR, a larger context), so
none of them measures it again.  Each gets its own EDGESPEC_DATA_DIR, so the
user's chat history is never touched."""
from __future__ import annotations

import json
import os
import re
import signal
import shutil
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]
PROMPT_ON = "\x1b[?2004h"       # prompt_toolkit reads keys (bracketed paste on)
PROMPT_OFF = "\x1b[?2004l"      # ... and has handed the terminal back: the answer follows
SUMMARY = r"(?:\x1b\[90m)?\[(\d+) tokens, (\d+) from drafts, [^\]]*\]"
DRAFT_SGR = "\x1b[36m"          # cyan, chat_session.DRAFT_COLOR
# about 600 tokens of plain notes: their prefill takes seconds with the exact kernels
LONG_NOTES = "\n".join(f"Note {i}: the shipment of crate {i} left the north depot on day {i % 28 + 1} "
                        f"and reached the harbour {i % 5 + 2} days later." for i in range(24))
COPY_PROMPT = "Copy this list exactly: 1. apples, 2. bananas, 3. cherries, 4. dates, 5. figs, 6. grapes"


def edgespec_command() -> list[str]:
    """The installed console script beside this Python (the venv's), else on PATH."""
    exe = os.path.join(os.path.dirname(sys.executable), "edgespec")
    exe = exe if os.access(exe, os.X_OK) else shutil.which("edgespec")
    assert exe, "the edgespec console script is not installed (pip install -e '.[test]')"
    return [exe]


@pytest.fixture(scope="module")
def calibrated(model):
    """The c(T) curve is cached (the session model measured it if needed) for
    contexts up to 2048, which covers the --ctx the chats below use."""
    assert model.cost is not None
    return model


def child_env(data_dir, **extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               EDGESPEC_DATA_DIR=str(data_dir), TERM="xterm-256color",
               PROMPT_TOOLKIT_NO_CPR="1")    # pexpect does not answer cursor position requests
    env.pop("NO_COLOR", None)
    env.update(extra)
    return env


class Chat:
    """One `edgespec chat` in a pseudo-terminal."""

    def __init__(self, data_dir, *args, max_tokens=16, **env):
        cmd = edgespec_command()
        self.child = pexpect.spawn(cmd[0], cmd[1:] + ["chat", "--max-tokens", str(max_tokens), "--ctx", "1024",
                                                      *args],
                                   env=child_env(data_dir, **env), encoding="utf-8", codec_errors="replace",
                                   timeout=300, dimensions=(40, 200),
                                   # a test run started in the background of a non-interactive shell
                                   # ignores SIGINT, and a child would inherit that: Ctrl-C must reach it
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.ready()
        # what chat printed before prompt_toolkit's first private-mode sequence
        self.header = self.child.before.split("\x1b[?", 1)[0]
        assert "Ctrl-D to leave" in self.header

    def ready(self):
        self.child.expect_exact(PROMPT_ON)

    def send(self, keys: str):
        self.child.send(keys)

    def line(self, text: str):
        self.child.send(text + "\r")

    def answer(self) -> tuple[str, int, int]:
        """Wait for the answer's summary line: (what was printed between the
        prompt and the summary, tokens, tokens from drafts); then the next prompt."""
        self.child.expect(SUMMARY)
        n, drafted = int(self.child.match.group(1)), int(self.child.match.group(2))
        text = self.child.before.rsplit(PROMPT_OFF, 1)[-1]
        self.ready()
        return text, n, drafted

    def expect(self, pattern: str):
        self.child.expect(pattern)
        self.ready()

    def save(self, path) -> list:
        self.line(f"/save {path}")
        self.expect(r"saved \d+ messages")
        return json.loads(Path(path).read_text())

    def leave(self, keys="\x04") -> int:
        self.send(keys)
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus


def summaries(text: str) -> list:
    return re.findall(SUMMARY, text)


# ---------------------------------------------------------------- in a terminal
def test_paste_typed_lines_files_save_load_retry(calibrated, tmp_path):
    chat = Chat(tmp_path / "data")
    # a pasted 20-line block (bracketed paste) and one Enter: one message, one answer
    code = "\n".join(["def total_of(items):"] + [f"    x = x + items[{i}]  # item {i}" for i in range(17)]
                     + ["    return x"])
    block = "Rename x to total in this code:\n" + code
    assert block.count("\n") == 19
    chat.send("\x1b[200~" + block + "\x1b[201~")
    chat.send("\r")
    text, n, _ = chat.answer()
    assert n >= 1 and text.strip()
    saved = chat.save(tmp_path / "one.json")
    assert saved == [{"role": "user", "content": block}, {"role": "assistant", "content": saved[1]["content"]}]

    # typed: Alt-Enter (Esc, Enter) inserts a newline; a """ block keeps blank lines
    chat.line("/reset")
    chat.expect("conversation cleared")
    chat.send("Name a fruit\x1b\rand a color.\r")
    chat.answer()
    chat.send('"""\rFirst line.\r\rSecond line.\r"""\r')
    chat.answer()
    users = [m["content"] for m in chat.save(tmp_path / "typed.json") if m["role"] == "user"]
    assert users == ["Name a fruit\nand a color.", "First line.\n\nSecond line."]

    # /file: a real file goes with the next message, under its name; a missing one is an error
    src = tmp_path / "calc.py"
    src.write_text("def add(a, b):\n    return a + b\n")
    chat.line("/file " + str(tmp_path / "missing.py"))
    chat.expect(r"Error: \S*missing.py: no such file")
    chat.line(f"/file {src}")
    chat.expect(r"attached \S*calc.py \(2 lines\)")
    chat.line("Add a docstring.")
    chat.answer()
    last_user = [m for m in chat.save(tmp_path / "file.json") if m["role"] == "user"][-1]["content"]
    assert last_user == f"Add a docstring.\n\n{src}:\n```\ndef add(a, b):\n    return a + b\n```"

    # /retry drops the last answer and generates it again (greedy, from the same
    # KV cells: the same answer)
    before = chat.save(tmp_path / "a.json")
    chat.line("/retry")
    chat.answer()
    assert chat.save(tmp_path / "retried.json") == before

    # /save then /load gives the same conversation, and the chat goes on from it
    chat.line("/reset")
    chat.expect("conversation cleared")
    chat.line(f"/load {tmp_path / 'a.json'}")
    chat.expect(f"loaded {len(before)} messages")
    assert chat.save(tmp_path / "b.json") == before
    chat.line("Thanks.")
    chat.answer()
    after = chat.save(tmp_path / "c.json")
    assert after[:len(before)] == before and after[len(before)] == {"role": "user", "content": "Thanks."}

    # Ctrl-C at the prompt clears a typed line; on an empty line it leaves
    chat.send("this line is dropped")
    chat.send("\x03")
    assert chat.save(tmp_path / "d.json") == after
    assert chat.leave("\x03") == 0


def test_history_across_runs_and_ctrl_c_stops_an_answer(calibrated, tmp_path):
    data = tmp_path / "data"
    chat = Chat(data)
    chat.line("Say the word apple.")
    chat.answer()
    assert chat.leave() == 0                              # Ctrl-D leaves
    assert "Say the word apple." in (data / "chat_history").read_text()

    chat = Chat(data)
    chat.send("\x1b[A")                                   # Up: the last message of the earlier run
    chat.send("\r")
    chat.answer()
    before = chat.save(tmp_path / "h.json")
    assert [m["content"] for m in before if m["role"] == "user"] == ["Say the word apple."]

    # Ctrl-C while a long message is read (its prefill takes seconds): the real
    # SIGINT stops the answer before it began and the message is not kept.  (An
    # answer's length is the model's to choose, so Ctrl-C while one streams is
    # test_chat_ctrl_c_stops_the_answer_only's, in process.)
    chat.send("\x1b[200~Summarize these notes.\n" + LONG_NOTES + "\x1b[201~\r")
    chat.child.expect_exact(PROMPT_OFF)                   # the chat took the message
    chat.send("\x03")
    chat.expect(r"answer stopped before it began; the message was not kept")
    assert chat.save(tmp_path / "stopped.json") == before
    chat.line("Thanks.")                                  # the chat goes on
    chat.answer()
    assert chat.leave() == 0


def test_drafts_in_colour(calibrated, tmp_path):
    # --no-gate verifies every draft: the copied list arrives mostly as drafts
    chat = Chat(tmp_path / "data", "--no-gate", max_tokens=24)
    assert DRAFT_SGR in chat.header                       # the legend, in the draft colour
    chat.line(COPY_PROMPT)
    text, n, drafted = chat.answer()
    assert drafted > 0
    assert DRAFT_SGR in text and "bananas" in re.sub(r"\x1b\[[0-9;]*m", "", text)
    assert chat.leave() == 0


@pytest.mark.parametrize("how", ["NO_COLOR", "--no-color"])
def test_no_color_means_no_escape_codes(calibrated, tmp_path, how):
    args, env = (("--no-gate",), {"NO_COLOR": "1"}) if how == "NO_COLOR" else (("--no-gate", "--no-color"), {})
    chat = Chat(tmp_path / "data", *args, max_tokens=24, **env)
    assert "\x1b" not in chat.header
    chat.line(COPY_PROMPT)
    chat.child.expect(SUMMARY)
    answer_and_summary = chat.child.before.rsplit(PROMPT_OFF, 1)[-1] + chat.child.after
    assert int(chat.child.match.group(2)) > 0             # drafts were accepted, and not drawn
    assert "bananas" in answer_and_summary and "\x1b" not in answer_and_summary
    chat.ready()
    assert chat.leave() == 0


# ---------------------------------------------------------------- piped
def test_piped_stdin(calibrated, tmp_path):
    saved = tmp_path / "piped.json"
    text = ("Name a fruit.\n\n"
            "/system Answer in one word.\n\n"
            '"""\nRepeat this:\n\none two\n"""\n'
            "/stats\n\n"
            f"/save {saved}\n")
    p = subprocess.run(edgespec_command() + ["chat", "--max-tokens", "16", "--ctx", "1024"], input=text,
                       capture_output=True, text=True, env=child_env(tmp_path / "data"), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert len(summaries(p.stdout)) == 2 and "session: answers 2" in p.stdout
    assert "\x1b" not in p.stdout                         # not a terminal: no colour
    conv = json.loads(saved.read_text())
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "user", "assistant"]
    assert conv[0]["content"] == "Answer in one word."
    assert conv[1]["content"] == "Name a fruit." and conv[3]["content"] == "Repeat this:\n\none two"
    assert not (tmp_path / "data" / "chat_history").exists()   # piped input is not history


def test_base_model_says_it_cannot_chat(tmp_path):
    """A GGUF without a chat template (a base model): one line, non-zero exit.
    The default model with its template key renamed stands in for one."""
    from edgespec.models.sources import ModelFileError, default_model_path

    try:
        src = default_model_path()
    except ModelFileError as e:
        pytest.fail(str(e))
    dst = tmp_path / "base.gguf"
    shutil.copyfile(src, dst)
    key = b"tokenizer.chat_template"
    with open(dst, "r+b") as f:
        head = f.read(16 << 20)
        at = head.find(key)
        assert at > 0 and head.count(key) == 1
        f.seek(at + len(key) - 1)
        f.write(b"X")                                     # same length: the file stays valid
    p = subprocess.run(edgespec_command() + ["chat", str(dst)], input="hello\n", capture_output=True, text=True,
                       env=child_env(tmp_path / "data"), timeout=600)
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and "has no chat template" in lines[0], p.stderr


# ---------------------------------------------------------------- piped, in process (click's CliRunner)
def invoke(args, input):
    """`edgespec chat ...` in this process.  Without --ctx, the run's context is
    1024: the calibration cached for 2048 covers it, where chat's default (4096)
    would measure the curve again (a minute and a half of the suite)."""
    from click.testing import CliRunner

    from edgespec.app.cli import main
    if "--ctx" not in args:
        args = args + ["--ctx", "1024"]
    try:
        runner = CliRunner(mix_stderr=False)       # click 8.1 needs the flag to keep stderr apart
    except TypeError:
        runner = CliRunner()
    return runner.invoke(main, args, input=input)


def test_chat_commands_stats_and_reset(calibrated):
    r = invoke(["chat", "--max-tokens", "16"],
               input="/help\n\nhello\n\n/stats\n\n/reset\n\nhi again\n\n/exit\n\nnot sent\n")
    assert r.exit_code == 0, r.output
    out = r.stdout
    for word in ("/file PATH", "/retry", "/load FILE", "Alt-Enter", "chat_history"):    # /help
        assert word in out, word
    assert len(summaries(out)) == 2 and out.count("tok/s") == 3    # two answers and the /stats totals
    assert "tokens/step" in out
    assert "session: answers 1" in out      # /stats after the first answer
    assert "conversation cleared" in out
    # after /reset the second message starts a new conversation: nothing to reuse
    assert "(0 reused)" in out.split("conversation cleared")[1]


def test_chat_reuses_the_cache_and_ends_at_eof(calibrated):
    r = invoke(["chat", "--max-tokens", "12", "--system", "Answer briefly."],
               input="Name a fruit.\n\nName another one.\n")
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stdout.splitlines() if re.match(SUMMARY, ln)]
    assert len(lines) == 2
    assert "(0 reused)" in lines[0] and "(0 reused)" not in lines[1]


def test_chat_errors_leave_the_session_going(calibrated, tmp_path):
    # a message longer than the context, an unknown command, a missing file:
    # one `Error:` line each on stderr, and the chat goes on
    r = invoke(["chat", "--ctx", "512", "--max-tokens", "8"],
               input="word " * 700 + "\n\n/frobnicate\n\n/file " + str(tmp_path / "nope.txt") + "\n\nSay hi.\n")
    assert r.exit_code == 0, r.output
    errors = r.stderr.strip().splitlines()
    assert len(errors) == 3 and all(e.startswith("Error:") for e in errors), r.stderr
    assert "does not fit the context" in errors[0]
    assert "unknown command /frobnicate" in errors[1] and "no such file" in errors[2]
    assert len(summaries(r.stdout)) == 1 and "Traceback" not in r.output


def test_chat_ctrl_c_stops_the_answer_only(calibrated, monkeypatch):
    from edgespec.app.api import SpecModel

    real_chat = SpecModel.chat
    calls = []

    def chat(self, messages, **kw):
        calls.append([dict(m) for m in messages])
        if len(calls) == 1:  # interrupt the first answer after a few chunks, as Ctrl-C would
            user_cb = kw["on_chunk"]
            seen = []

            def on_chunk(chunk):
                user_cb(chunk)
                seen.append(chunk)
                if len(seen) >= 3:
                    raise KeyboardInterrupt
            kw["on_chunk"] = on_chunk
        return real_chat(self, messages, **kw)

    monkeypatch.setattr(SpecModel, "chat", chat)
    r = invoke(["chat", "--max-tokens", "24"], input="Tell me a long story.\n\nThanks!\n")
    assert r.exit_code == 0, r.output
    assert "answer stopped" in r.stdout
    assert len(calls) == 2
    # the partial answer stays in the conversation
    assert calls[1][1]["role"] == "assistant" and calls[1][1]["content"]
    assert calls[1][2] == {"role": "user", "content": "Thanks!"}
    assert len(summaries(r.stdout)) == 1    # the second answer completed


def test_chat_drops_old_turns_when_the_context_is_full(calibrated):
    """Past the context, chat forgets its oldest turns (and says so) instead of
    refusing every further message."""
    turns = "".join(f"Tell me a long story about animal number {i}.\n\n" for i in range(7))
    r = invoke(["chat", "--ctx", "512", "--max-tokens", "64"], input=turns + "/exit\n")
    assert r.exit_code == 0, r.output
    assert len(summaries(r.stdout)) == 7, r.output
    assert "outgrew the context of 512 tokens: dropped its 2 oldest messages" in r.stdout
    assert "Error" not in r.output
