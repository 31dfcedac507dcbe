"""`edgespec rpc-worker`: serve this machine's CPU or GPU over llama.cpp's RPC.

Refuses a non-loopback address without --allow-remote (the protocol has no
authentication), and stops on Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import os
import sys

import click

from edgespec.app.cli.options import log_settings, user_errors


@click.command("rpc-worker")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback needs --allow-remote.")
@click.option("--port", "-p", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option("--threads", "-t", type=click.IntRange(min=1), default=None,
              help="CPU threads for the layers served (default: one per physical core available).")
@click.option("--cache", "cache", type=click.Path(file_okay=False), default=None,
              help="Keep the tensors clients send in DIR, so a model reloads without sending them again.")
@click.option("--device", default=None, help="The ggml device to serve (CPU, CUDA0, ...; default: the first GPU, "
                                             "else the CPU).")
@click.option("--kernels", type=click.Choice(("exact", "fast")), default="exact", show_default=True,
              help="exact: the CPU kernels under which a client's verification batches stay bit-identical to "
                   "one-token decoding (the tiled K-quant product off); fast: llama.cpp's fastest.")
@click.option("--allow-remote", is_flag=True,
              help="Listen on a non-loopback address: llama.cpp's RPC has no authentication and has had "
                   "remote-code-execution advisories, so only on a network you trust.")
def rpc_worker(host, port, threads, cache, device, kernels, allow_remote):
    """Serve this machine's CPU or GPU to edgespec (or llama.cpp) over RPC.

    A client started with --rpc HOST:PORT puts the model's layers here.  Stops
    on Ctrl-C or SIGTERM."""
    import signal
    import socket
    import threading

    from edgespec.backend import ggml
    from edgespec.backend.process import TILED_MM_ENV, default_threads, init_backend

    if not ggml.is_loopback(host) and not allow_remote:
        raise click.ClickException(f"refusing to listen on {host}: llama.cpp's RPC has no authentication and "
                                   "anyone who reaches the port can run code on this machine; pass "
                                   "--allow-remote to do it anyway on a network you trust")
    if not ggml.is_loopback(host):
        click.echo(f"WARNING: listening on {host}: never expose an RPC worker to an open network; it is not "
                   "authenticated and not secure", err=True)
    os.environ.setdefault(TILED_MM_ENV, "0" if kernels == "exact" else "1")
    with user_errors():
        ggml.require_rpc()
        init_backend(log_settings()["verbose"])
        dev = ggml.worker_device(device)
    try:        # the port must be free: ggml would only print that it failed
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    free, total = ggml.device_memory(dev)
    n = threads or default_threads()
    click.echo(f"edgespec rpc-worker: {ggml.device_label(dev)}, {free / 2**20:.0f} of {total / 2**20:.0f} MiB "
               f"free, {n} threads, {kernels} kernels, on {host}:{port}; Ctrl-C stops", err=True)
    done = threading.Event()

    def run():
        ggml.serve_forever(f"{host}:{port}", dev, n, cache)
        done.set()

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    threading.Thread(target=run, daemon=True, name="rpc-worker").start()
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        click.echo("edgespec rpc-worker: stopped", err=True)
        sys.stderr.flush()
        os._exit(0)         # the server thread is blocked in C; nothing else to clean up
    raise click.ClickException(f"the RPC server on {host}:{port} stopped (llama.cpp's message above)")
