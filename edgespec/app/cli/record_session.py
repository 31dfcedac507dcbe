"""`edgespec record-session`: record an app's requests as a session trace for
`edgespec bench-sessions`.  The recorder is edgespec/bench/recorder.py;
docs/sessions.md says how the traces in benchmarks/sessions were recorded."""
from __future__ import annotations

import signal
import sys

import click


@click.command("record-session")
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="The trace to write (appended to if it exists).")
@click.option("--port", type=int, default=8099, show_default=True, help="The recorder's port on 127.0.0.1.")
@click.option("--app", required=True, help="The app that sends the requests (aider, ...), for the header.")
@click.option("--app-version", default="", help="Its version, for the header.")
@click.option("--how", default="", help="How the app was run (its command lines), for the header.")
@click.option("--model-note", default="", help="The model the answers came from, for the header.")
@click.option("--forward", default=None, metavar="URL", help="http://HOST:PORT of a server that answers.")
@click.option("--forward-max-tokens", type=int, default=300, show_default=True,
              help="max_tokens added to forwarded requests that have none (the trace keeps them without).")
@click.option("--canned", default="OK.", show_default=True, help="The answer without --forward.")
@click.option("--model-id", default="recorded", show_default=True,
              help="The model /v1/models names without --forward.")
def record_session(**options):
    """Record an app's requests as a session trace for bench-sessions.

    An OpenAI-compatible endpoint on 127.0.0.1 appends every chat or text
    completion request to the trace (--out), exactly as the app sent it, and
    answers it by forwarding it to a real server (--forward) or with a canned
    answer.  A request's X-Trace-Role header sets its role (default: `summary`
    for Aider's history summaries, else chat).  Ctrl-C or SIGTERM stops."""
    from edgespec.bench.recorder import Recording, recorder

    rec = Recording(**options)
    srv = recorder(rec)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    click.echo(f"recording to {rec.out} on http://127.0.0.1:{rec.port}/v1", err=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
