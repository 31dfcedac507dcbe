"""edgespec chat's input and file handling, without a model: how piped input
is cut into messages, the \"\"\" blocks, attachments, saved conversations, the
history location and when colour is used."""
from __future__ import annotations

import json

import pytest

from edgespec.app.cli import chat_session as C
from edgespec.app.cli.chat import use_color
from edgespec.errors import PromptTooLongError


def test_split_blocks_at_blank_lines():
    # two blank-line-separated paragraphs are two messages; runs of blank
    # lines and surrounding whitespace-only lines add no empty message
    text = "Name a fruit.\nBe brief.\n\n\n  \n/stats\n\nAnd a vegetable?\n"
    assert C.split_blocks(text) == ["Name a fruit.\nBe brief.", "/stats", "And a vegetable?"]
    assert C.split_blocks("") == [] and C.split_blocks("\n\n \n") == []


def test_split_blocks_keeps_fenced_blank_lines():
    # a block opened by a line that is exactly """ runs to the next such line,
    # blank lines included; the fence lines themselves are not sent
    code = "def f(x):\n    y = x + 1\n\n    return y"
    text = f'"""\nRename x to total:\n\n{code}\n"""\n\nThanks.\n'
    assert C.split_blocks(text) == [f"Rename x to total:\n\n{code}", "Thanks."]
    # an unclosed fence runs to the end of the input
    assert C.split_blocks('"""\na\n\nb\n') == ["a\n\nb"]
    # a """ that does not open a block (Python docstrings) is text like any other
    doc = 'def g():\n    """Doc."""\n    return 1'
    assert C.split_blocks(doc) == [doc]


def test_unfence_and_fence_open():
    # what the Enter key asks: is a block opened with """ still open?
    assert C.fence_open('"""') and C.fence_open('"""\nline') and C.fence_open('"""\n\n')
    assert not C.fence_open('"""\nline\n"""')          # closed: Enter sends
    assert not C.fence_open("plain text") and not C.fence_open('x = """')
    assert C.unfence('"""\na\n\nb\n"""') == "a\n\nb"
    assert C.unfence("a\nb") == "a\nb"
    assert C.unfence('"""') == '"""'                     # a lone fence line is text


def test_with_attachments_names_and_fences_each_file():
    out = C.with_attachments("Rename x to total.", [("a.py", "x = 1\n"), ("b.md", "has ``` inside\n")])
    # the message first, then each file under its name; a file containing ```
    # gets a longer fence so that its text cannot close the block
    assert out == "Rename x to total.\n\na.py:\n```\nx = 1\n```\n\nb.md:\n````\nhas ``` inside\n````"
    assert C.with_attachments("hi", []) == "hi"


def test_read_attachment_errors(tmp_path):
    good = tmp_path / "ok.txt"
    good.write_text("héllo\n", encoding="utf-8")
    assert C.read_attachment(str(good)) == "héllo\n"
    with pytest.raises(ValueError, match="no such file"):
        C.read_attachment(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="not a file"):
        C.read_attachment(str(tmp_path))
    binary = tmp_path / "x.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x00\x00")       # a NUL byte: not text
    with pytest.raises(ValueError, match="looks binary"):
        C.read_attachment(str(binary))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))        # \xe9 alone is invalid UTF-8
    with pytest.raises(ValueError, match="not UTF-8"):
        C.read_attachment(str(latin))
    big = tmp_path / "big.txt"
    big.write_text("a" * (C.FILE_LIMIT + 1))
    with pytest.raises(ValueError, match=f"up to {C.FILE_LIMIT // 1024} KiB"):
        C.read_attachment(str(big))
    at_limit = tmp_path / "limit.txt"
    at_limit.write_text("a" * C.FILE_LIMIT)              # exactly the limit is allowed
    assert len(C.read_attachment(str(at_limit))) == C.FILE_LIMIT


def test_load_conversation_formats_and_errors(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    p = tmp_path / "c.json"
    p.write_text(json.dumps(msgs))
    assert C.load_conversation(str(p)) == msgs
    # an OpenAI request body, with content given as text parts
    p.write_text(json.dumps({"model": "x", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]}))
    assert C.load_conversation(str(p)) == [{"role": "user", "content": "Hi there"}]
    with pytest.raises(ValueError, match="no such file"):
        C.load_conversation(str(tmp_path / "none.json"))
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON conversation"):
        C.load_conversation(str(p))
    p.write_text(json.dumps({"turns": []}))
    with pytest.raises(ValueError, match="expected a list of messages"):
        C.load_conversation(str(p))
    p.write_text(json.dumps([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]))
    with pytest.raises(ValueError, match="message 2 needs a role"):
        C.load_conversation(str(p))


def test_history_path(monkeypatch, tmp_path):
    monkeypatch.delenv("EDGESPEC_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert C.history_path() == str(tmp_path / "xdg" / "edgespec" / "chat_history")
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert C.history_path() == str(tmp_path / "home" / ".local" / "share" / "edgespec" / "chat_history")
    monkeypatch.setenv("EDGESPEC_DATA_DIR", str(tmp_path / "d"))
    assert C.history_path() == str(tmp_path / "d" / "chat_history")


def test_use_color(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.setattr(C.sys, "stdout", Tty())
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert use_color(False) is True
    assert use_color(True) is False                     # --no-color
    monkeypatch.setenv("NO_COLOR", "1")                  # no-color.org: any non-empty value
    assert use_color(False) is False
    monkeypatch.setenv("NO_COLOR", "")                   # ... an empty one does not count
    assert use_color(False) is True
    monkeypatch.setenv("TERM", "dumb")
    assert use_color(False) is False


def test_stop_label_names_a_full_context():
    from types import SimpleNamespace

    assert C._stop_label(SimpleNamespace(stop_reason="length", n_generated=64), 64) == "length"
    assert C._stop_label(SimpleNamespace(stop_reason="length", n_generated=40), 64) == "context full"
    assert C._stop_label(SimpleNamespace(stop_reason="stop", n_generated=10), 64) == "stop"


def test_split_blocks_closing_fence_ends_the_block():
    # text right after a closing fence starts a new message, and a fence line
    # inside a block that did not open with one is plain text
    assert C.split_blocks('"""\na\n"""\nb\n') == ["a", "b"]
    assert C.split_blocks('x:\n"""\ny\n') == ['x:\n"""\ny']
    assert C.split_blocks('"""\n"""\nz') == ["z"]       # an empty fenced block sends nothing


# ---------------------------------------------------------------- the session over a stand-in model
class FakeModel:
    """Stands in for SpecModel where only the conversation bookkeeping is
    tested: chat() answers from a script (text, or an exception to raise)."""

    def __init__(self, script):
        from types import SimpleNamespace
        self.script = list(script)
        self.calls = []
        self.backend = SimpleNamespace(n_ctx=4096)
        self.engine = SimpleNamespace(reset=lambda: None)

    def fit_messages(self, messages, reserve=0):
        return list(messages), 0

    def chat(self, messages, on_chunk=None, **kw):
        from types import SimpleNamespace

        from edgespec.core.stream import Chunk
        self.calls.append([dict(m) for m in messages])
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        on_chunk(Chunk(step, [1], 0, [(step, False)]))
        return SimpleNamespace(text=step, n_generated=1, n_draft_accepted=0, tokens_per_s=1.0, mean_accepted=1.0,
                               n_prompt_tokens=5, n_reused_tokens=0, prefill_s=0.1, decode_s=0.1, n_steps=1,
                               n_draft_nodes=0, stop_reason="stop")


def session(script, system=None):
    return C.ChatSession(FakeModel(script), max_tokens=8, sampling=None, stop=(), system=system, color=False)


def test_system_command_and_reset_keep_the_system_message(capsys):
    s = session(["A1"])
    s.handle("/system")
    assert "system message: (none)" in capsys.readouterr().out
    s.handle("Hi")
    s.handle("/system Be brief.")                   # inserted before the conversation
    assert s.messages[0] == {"role": "system", "content": "Be brief."} and len(s.messages) == 3
    s.handle("/system Be terse.")                   # replaced, not added
    assert s.messages[0]["content"] == "Be terse." and len(s.messages) == 3
    s.handle("/reset")
    assert s.messages == [{"role": "system", "content": "Be terse."}]


def test_retry_replaces_the_last_answer_and_restores_it_on_failure(capsys):
    s = session(["first", "second", PromptTooLongError("the prompt has 9999 tokens, which does not fit")])
    s.handle("/retry")                              # nothing answered yet
    assert "nothing to retry" in capsys.readouterr().err
    s.handle("Q")
    s.handle("/retry")
    assert s.messages == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "second"}]
    assert s.m.calls[1] == [{"role": "user", "content": "Q"}]    # the old answer was not sent again
    s.handle("/retry")                              # fails: the previous answer comes back
    assert "Error: the prompt has 9999 tokens" in capsys.readouterr().err
    assert s.messages[-1] == {"role": "assistant", "content": "second"}


def test_interrupt_before_the_first_token_drops_the_message(capsys):
    s = session([KeyboardInterrupt(), "ok"])
    s.handle("Q1")
    assert s.messages == [] and "stopped before it began" in capsys.readouterr().out
    s.handle("Q2")
    assert s.messages == [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "ok"}]


def test_attachments_go_with_the_next_message_only(tmp_path, capsys):
    f = tmp_path / "a.txt"
    f.write_text("alpha\n")
    s = session(["r1", "r2"])
    s.handle(f"/file {f}")
    s.handle("/file")                               # no path: usage, nothing attached
    assert "usage: /file PATH" in capsys.readouterr().err
    s.handle("Summarize.")
    s.handle("Again.")
    assert s.messages[0]["content"] == f"Summarize.\n\n{f}:\n```\nalpha\n```"
    assert s.messages[2]["content"] == "Again."
    # a message that starts with a path is text, not an unknown command
    s2 = session(["r"])
    s2.handle("/usr/bin/python crashed, why?")
    assert s2.messages[0]["content"] == "/usr/bin/python crashed, why?"
