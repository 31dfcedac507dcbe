"""tools/delay_proxy.py forwards bytes unchanged and adds its delay in each direction."""

import asyncio
import importlib.util
import pathlib
import time

_PATH = pathlib.Path(__file__).resolve().parent.parent / "tools" / "delay_proxy.py"
_spec = importlib.util.spec_from_file_location("delay_proxy", _PATH)
delay_proxy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(delay_proxy)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _round_trip(delay_ms):
    async def echo(r, w):
        while data := await r.read(1000):
            w.write(data)
            await w.drain()
        w.close()

    target = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = _free_port()
    proxy = asyncio.ensure_future(
        delay_proxy.serve(port, ("127.0.0.1", target.sockets[0].getsockname()[1]), delay_ms))
    try:
        await asyncio.sleep(0.2)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        w.write(b"hello proxy")
        await w.drain()
        data = await asyncio.wait_for(r.readexactly(11), 5)
        elapsed = time.monotonic() - t0
        w.close()
        return data, elapsed
    finally:
        proxy.cancel()
        target.close()


def test_delay_proxy_forwards_and_delays_both_directions():
    data, elapsed = asyncio.run(_round_trip(50))
    assert data == b"hello proxy"
    assert 0.1 <= elapsed < 1.0  # 50 ms out and 50 ms back
