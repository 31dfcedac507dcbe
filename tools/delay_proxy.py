"""A TCP proxy on loopback that adds a fixed delay and an optional bandwidth cap per direction.

Used to try a remote worker (e.g. an RPC worker) as if it sat across a slower network:

    python tools/delay_proxy.py --listen 50053 --target 127.0.0.1:50052 --delay-ms 5 --mbit 100

Every chunk read from one side is forwarded to the other side after `delay_ms`; with `--mbit` the
forwarding of each direction is paced so that it never exceeds that rate. Memory is bounded: each
direction holds at most `--max-buffer` bytes in flight (reading pauses while the queue is full).
"""

import argparse
import asyncio
import time

CHUNK = 64 * 1024


async def _pump(reader, writer, delay_s, bytes_per_s, max_buffer):
    """Forward reader -> writer, each chunk released `delay_s` after it arrived, paced to bytes_per_s."""
    queue = asyncio.Queue(maxsize=max(1, max_buffer // CHUNK))

    async def read_side():
        while True:
            data = await reader.read(CHUNK)
            await queue.put((time.monotonic() + delay_s, data))
            if not data:
                return

    async def write_side():
        next_free = time.monotonic()
        while True:
            due, data = await queue.get()
            if not data:
                break
            if bytes_per_s:
                due = max(due, next_free)
                next_free = due + len(data) / bytes_per_s
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    reading = asyncio.ensure_future(read_side())
    try:
        await write_side()
    finally:
        reading.cancel()


async def _handle(client_r, client_w, target, delay_s, bytes_per_s, max_buffer):
    host, port = target
    try:
        server_r, server_w = await asyncio.open_connection(host, port)
    except OSError:
        client_w.close()
        return
    try:
        await asyncio.gather(
            _pump(client_r, server_w, delay_s, bytes_per_s, max_buffer),
            _pump(server_r, client_w, delay_s, bytes_per_s, max_buffer),
        )
    except (ConnectionError, OSError):
        pass
    finally:
        server_w.close()
        client_w.close()


async def serve(listen_port, target, delay_ms, mbit=None, max_buffer=8 << 20):
    """Run the proxy on 127.0.0.1:listen_port until cancelled."""
    bytes_per_s = mbit * 1e6 / 8 if mbit else None
    server = await asyncio.start_server(
        lambda r, w: _handle(r, w, target, delay_ms / 1000, bytes_per_s, max_buffer),
        "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", type=int, required=True, help="loopback port to listen on")
    p.add_argument("--target", required=True, help="HOST:PORT to forward to")
    p.add_argument("--delay-ms", type=float, default=0.0, help="delay added per direction")
    p.add_argument("--mbit", type=float, default=None, help="bandwidth cap per direction (Mbit/s)")
    a = p.parse_args(argv)
    host, _, port = a.target.rpartition(":")
    try:
        asyncio.run(serve(a.listen, (host, int(port)), a.delay_ms, a.mbit))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
