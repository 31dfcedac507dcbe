"""Chat's files are private and bounded; terminal output shows control characters."""

import os
import stat

import pytest

from edgespec.app.cli import chat, chat_session
from edgespec.app.termsafe import private_file, read_bounded, visible


def test_visible_shows_controls_keeps_newline_and_tab():
    assert visible("a\x1b[2Jb\n\tc\x07\x7f\x9b") == "a^[[2Jb\n\tc^G^?\\x9b"
    assert visible("plain text, ünïcode ✓") == "plain text, ünïcode ✓"


def test_history_file_is_private(tmp_path, monkeypatch):
    pytest.importorskip("prompt_toolkit")
    monkeypatch.setenv("EDGESPEC_DATA_DIR", str(tmp_path / "data"))
    old = os.umask(0o022)
    try:
        chat._history()
    finally:
        os.umask(old)
    path = chat_session.history_path()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


def test_private_file_narrows_an_existing_file(tmp_path):
    p = tmp_path / "h"
    p.write_text("x")
    os.chmod(p, 0o644)
    private_file(str(p))
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert p.read_text() == "x"


def test_attachment_read_is_bounded(tmp_path, monkeypatch):
    p = tmp_path / "grows.txt"
    p.write_text("a" * 100)
    # the size check passes, yet the file is larger when read: only limit+1 bytes are read
    monkeypatch.setattr(os.path, "getsize", lambda _p: 1)
    monkeypatch.setattr(chat_session, "FILE_LIMIT", 50)
    with pytest.raises(ValueError, match="over"):
        chat_session.read_attachment(str(p))
    assert len(read_bounded(str(p), 50)) == 51


def test_chat_show_makes_escapes_visible(capsys):
    s = chat_session.ChatSession.__new__(chat_session.ChatSession)
    s.color, s.tty = False, True

    class Chunk:
        spans = [("hi\x1b]0;title\x07", False)]
        text = ""
    s.show(Chunk())
    assert capsys.readouterr().out == "hi^[]0;title^G"


def test_generate_streaming_to_a_terminal_shows_escapes(capsys, monkeypatch):
    from edgespec.app.cli import output
    monkeypatch.setattr(output.sys.stdout, "isatty", lambda: True)
    output.echo_stream("a\x1b[31mb\n")
    monkeypatch.setattr(output.sys.stdout, "isatty", lambda: False)
    output.echo_stream("\x1b")
    assert capsys.readouterr().out == "a^[[31mb\n\x1b"
