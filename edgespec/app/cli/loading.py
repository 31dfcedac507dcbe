"""Loading the model a command names, with the invocation's settings.

load_model resolves the model's name once, applies the log file and shows
the kernel timing (--kernels auto, one-shot commands), calibration and
upload progress on stderr;
with_chat_template refuses a model without a chat template before any of
that.  One place turns the parsed options into a SpecModel, so generate,
chat, serve, calibrate and bench load it the same way.
"""
from __future__ import annotations

import sys
import warnings

import click

from edgespec.app.cli.options import log_settings, user_errors
from edgespec.run.settings import RunConfig


def load_model(model, config: RunConfig):
    """The SpecModel of `config` with this invocation's log file.
    config.calibrate True (one-shot commands: generate, bench) times the
    kernels (auto) and measures a missing calibration before the first
    answer, with a note on stderr; "background" (chat, serve) loads the
    cached verdict or fast kernels, answers at once and measures between
    requests, silently.  A memory file not used says why in one line."""
    from edgespec.app.api import SpecModel
    from edgespec.backend.process import log_to_file
    from edgespec.models.resolve import resolve_model

    log = log_settings()
    if log["log_file"]:
        try:
            log_to_file(log["log_file"])
        except OSError as e:
            raise click.ClickException(f"cannot write the log file {log['log_file']}: {e.strerror or e}") from None
        ctx = click.get_current_context(silent=True)
        if ctx is not None:
            ctx.find_root().call_on_close(lambda: log_to_file(None))
    with user_errors():
        path = resolve_model(model)
        one_line_warnings()
        return SpecModel(path, config=config, load_progress=_upload_bar(config.rpc) if config.rpc else None,
                         progress=calibration_note() if config.calibrate is True else quick_note(),
                         kernel_progress=kernel_note() if config.calibrate is True else None)


def one_line_warnings() -> None:
    """Print the memory file's warnings (edgespec.memory.MemoryFileWarning)
    as one line each, without Python's source line (for this process)."""
    from edgespec.memory import MemoryFileWarning

    orig = warnings.formatwarning
    if getattr(orig, "edgespec_memory", False):
        return

    def fmt(message, category, filename, lineno, line=None):
        if issubclass(category, MemoryFileWarning):
            return f"warning: {message}\n"
        return orig(message, category, filename, lineno, line)
    fmt.edgespec_memory = True
    warnings.formatwarning = fmt


def calibration_note(intro: str | None = "measuring the verify cost c(T) and checking that batched logits equal "
                     "one-token logits, for this model on this machine (once, a minute or more on 2 cores; "
                     "cached afterwards)..."):
    """A progress callback for the c(T) measurement: says once, on stderr, what
    is going on, then (on a terminal) counts the measurement rounds."""
    said = []
    tty = sys.stderr is not None and sys.stderr.isatty()
    if log_settings()["quiet"]:
        return None

    def cb(done, total):
        from edgespec.progress import progress_bar

        if not said:
            if intro:
                click.echo(intro, err=True)
            said.append(progress_bar(tty, total=total, desc="calibrating", unit="round"))
        bar = said[0]
        bar.update(done - getattr(bar, "n", done))
        if done >= total:
            bar.close()
    return cb


def quick_note():
    """A progress callback for the quick c(T) that serve and chat measure at
    load on a fresh cache: one line on stderr, once."""
    said = []
    if log_settings()["quiet"]:
        return None

    def cb(done, total):
        if not said:
            said.append(True)
            click.echo("measuring a first c(T) for this model on this machine (a few seconds; the full "
                       "calibration follows between requests)...", err=True)
    return cb


def _upload_bar(endpoints):
    """A progress callback for sending the weights to RPC workers (a bar on a
    terminal, else nothing)."""
    if log_settings()["quiet"] or sys.stderr is None or not sys.stderr.isatty():
        return None
    from edgespec.progress import progress_bar

    bar = progress_bar(True, total=100, desc=f"sending the model to {', '.join(endpoints)}", unit="%")

    def cb(fraction):
        bar.update(int(fraction * 100) - bar.n)
        if fraction >= 1.0:
            bar.close()
    return cb


KERNEL_NOTE = ("timing llama.cpp's exact against its fastest CPU kernels for this model on this machine: a prompt, "
               "one-token decodes and batches (--kernels auto; once, cached afterwards)...")


def kernel_note():
    """A progress callback for the kernel timing: the note on stderr as it starts."""
    if log_settings()["quiet"]:
        return None

    def cb(done, total):
        if done == 0:
            click.echo(KERNEL_NOTE, err=True)
    return cb


def remeasure_kernel_price(model, threads, note: bool = True):
    """`edgespec calibrate` with --kernels auto: time exact against fast
    kernels for this model again (two child processes, a note on stderr)."""
    from edgespec.backend.process import default_threads
    from edgespec.calibration.kernelchoice import measure_price
    from edgespec.models.resolve import resolve_model

    measure_price(resolve_model(model), threads or default_threads(), progress=kernel_note() if note else None)


def with_chat_template(model, advice: str) -> str:
    """The resolved model path, or a one-line error (before the model is
    loaded and calibrated) when its GGUF has no chat template."""
    from edgespec.models.gguf import gguf_metadata
    from edgespec.models.resolve import resolve_model

    with user_errors():
        path = resolve_model(model)
        if "tokenizer.chat_template" not in gguf_metadata(path):
            raise click.ClickException(f"{path} has no chat template (a base or completion model): {advice}")
    return path
