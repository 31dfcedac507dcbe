"""Text made safe for a terminal, and files made private.

Model output and attached files may hold escape sequences that a terminal
would obey (move the cursor, set the title, rewrite earlier lines).  Every
control character other than newline and tab is shown instead, as caret
notation (ESC as ``^[``); the project's own colour codes are added after this
step, so they still work."""

from __future__ import annotations

import os
import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")


def _caret(m: re.Match) -> str:
    c = ord(m.group(0))
    if c < 0x20:
        return "^" + chr(c + 0x40)
    if c == 0x7F:
        return "^?"
    return f"\\x{c:02x}"


def visible(text: str) -> str:
    """The text with control characters other than newline and tab shown in caret notation."""
    return _CONTROL.sub(_caret, text)


def private_file(path: str) -> None:
    """Create path (if missing) readable by its owner only, in a folder of mode 0700;
    an existing file is narrowed to 0600.  OSError when it cannot."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def read_bounded(path: str, limit: int) -> bytes:
    """At most limit+1 bytes of the file: one more than the limit tells the caller it is too large."""
    with open(path, "rb") as f:
        return f.read(limit + 1)
