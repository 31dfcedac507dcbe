"""`edgespec chat`: the command, and the terminal it reads from.

In a terminal, input is read with prompt_toolkit: Enter sends, Alt-Enter /
Esc-Enter inserts a newline, a pasted block (bracketed paste) is one message,
a message whose first line is \"\"\" runs to a closing \"\"\" line, and history
is kept between runs.  With stdin not a terminal, the whole input is read and
split into messages at blank lines (the same \"\"\" blocks keep blank lines
inside a message).  The conversation itself (messages, /commands, answers) is
chat_session.ChatSession.
"""
from __future__ import annotations

import os
import sys

import click

from edgespec.app.cli.chat_session import DRAFT_COLOR, ChatSession, fence_open, history_path, split_blocks, unfence
from edgespec.app.cli.loading import load_model, with_chat_template
from edgespec.app.cli.options import complete_model, generation_options, make_sampling, model_options
from edgespec.app.cli.output import calibration_line, exactness_notice
from edgespec.app.termsafe import private_file


@click.command()
@click.argument("model", required=False, shell_complete=complete_model)
@model_options
@generation_options
@click.option("-sys", "--system", default=None, help="A system message that opens the conversation.")
@click.option("--no-color", is_flag=True, help="No colours (NO_COLOR=1 does the same).")
def chat(model, **options):
    """Chat with MODEL in the terminal (the code is in edgespec/app/cli/chat.py).

    \b
    Enter sends; Alt-Enter (or Esc, then Enter) inserts a newline; a pasted
    block is one message; a message whose first line is \"\"\" runs to a
    closing \"\"\" line.  Each turn reuses the KV cache of the earlier ones.
    Text that arrived as accepted drafts is drawn in cyan.  Commands: /file,
    /system, /save, /load, /retry, /stats, /reset, /help, /exit (or Ctrl-D).
    Ctrl-C stops an answer; at the prompt it clears the line, on an empty
    line it leaves.  Up/Down recall earlier messages, also from earlier runs
    (history in $EDGESPEC_DATA_DIR, else $XDG_DATA_HOME/edgespec, else
    ~/.local/share/edgespec).

    With stdin not a terminal, the whole input is read and sent as one
    message per blank-line-separated block (a \"\"\" block keeps its blank
    lines; a block starting with /name is a command).
    """
    model = with_chat_template(model, "chat needs one; `edgespec generate --raw MODEL PROMPT` continues a text instead")
    run_chat(model, **options)


def use_color(no_color: bool) -> bool:
    """Colour only on a terminal, without --no-color or NO_COLOR (no-color.org)."""
    return (not no_color and not os.environ.get("NO_COLOR") and sys.stdout.isatty()
            and os.environ.get("TERM") != "dumb")


# ------------------------------------------------------------------ input loops
def _key_bindings():
    from prompt_toolkit.key_binding import KeyBindings

    kb = KeyBindings()

    @kb.add("enter")
    def _enter(event):
        buf = event.current_buffer
        if fence_open(buf.text):
            buf.insert_text("\n")
        else:
            buf.validate_and_handle()

    @kb.add("escape", "enter")
    def _newline(event):
        event.current_buffer.insert_text("\n")

    @kb.add("c-c")
    def _clear_or_leave(event):
        buf = event.current_buffer
        if buf.text:
            buf.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt)

    return kb


def _history():
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    path = history_path()
    try:
        private_file(path)
        return FileHistory(path)
    except OSError as e:
        click.echo(f"(history not kept: {path}: {e.strerror or e})", err=True)
        return InMemoryHistory()


def interactive(session: ChatSession) -> None:
    from prompt_toolkit import PromptSession

    ps = PromptSession(history=_history(), key_bindings=_key_bindings(), multiline=True,
                       prompt_continuation=lambda width, line_no, soft: ". ".rjust(width))
    while True:
        try:
            text = ps.prompt("> ")
        except (EOFError, KeyboardInterrupt):     # Ctrl-D, or Ctrl-C on an empty line
            click.echo()
            return
        try:
            if not session.handle(unfence(text)):
                return
        except KeyboardInterrupt:                 # Ctrl-C during a command
            click.echo()


def piped(session: ChatSession, text: str) -> None:
    for block in split_blocks(text):
        if not session.handle(block):
            return


def run_chat(model, *, max_tokens, temperature, top_k, top_p, min_p, seed, stop, config, system,
             no_color) -> None:
    """The `edgespec chat` command (its options are generate's: options.generation_options)."""
    sampling = make_sampling(temperature, top_k, top_p, min_p, seed)
    m = load_model(model, config.but(calibrate="background"))
    try:
        if not m.backend.chat_template():
            raise click.ClickException(f"{m.model_path} has no chat template (a base model?), so it cannot chat; "
                                       "`edgespec generate --raw` continues plain text")
        notice = exactness_notice(m)
        if notice:
            click.echo(notice, err=True)
        color = use_color(no_color)
        session = ChatSession(m, max_tokens=max_tokens, sampling=sampling, stop=stop, system=system, color=color)
        if not sys.stdin.isatty():
            piped(session, sys.stdin.read())
            return
        session.dim(f"edgespec chat: {m.model_path} (drafter {config.drafter}); /help for commands, Ctrl-D to leave")
        if m.calibration_state == "measuring":
            session.dim(calibration_line(m))
        if color:
            click.echo(f"{click.style(DRAFT_COLOR, fg=DRAFT_COLOR)} text arrived as accepted drafts "
                       "(several tokens in one step)", color=True)
        interactive(session)
    finally:
        m.close()
