"""The HTTP checks `edgespec serve` makes before any work: an ASGI middleware.

In this order, each answered with OpenAI-style error JSON:

1. Host (403 invalid_host): the Host header must name this server: an IP
   address (a DNS-rebinding page always sends its own domain name, never an
   IP literal), localhost, the --host it listens on, a name given with
   --allow-host, or, when it listens on every interface, this machine's
   name.  The port is not compared: rebinding is about the name.
2. Origin (403 invalid_origin): a browser names the page that makes a request
   in Origin.  Accepted: the server's own origin (its chat page at /, whose
   Origin is http(s)://HOST for the Host of the request) and the origins
   given with --cors ("*": any).  Cross-origin preflights (OPTIONS) of
   allowed origins are answered here, and their responses carry
   Access-Control-Allow-Origin.
3. API key (401 invalid_api_key) on /v1/*, /props and /metrics, when the
   server has one:
   `Authorization: Bearer KEY`, the scheme in any case, compared in constant
   time.
4. Content-Type (415 unsupported_media_type): a POST must be
   application/json.  A web page can send text/plain or form bodies to any
   address without asking; application/json needs a preflight, which step 2
   refuses for foreign pages.
5. Body size (413 body_too_large): Content-Length above the limit is refused
   before a byte is read; a body without one is read in chunks and refused
   as soon as it passes the limit.  The app then gets the whole body at once.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import socket

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


KEYED = ("/props", "/metrics", "/completion", "/infill")   # paths outside /v1/ that need the API key, as in llama-server


def host_name(value: str) -> str:
    """The name of a Host header value or an origin's authority, without port,
    brackets or a trailing dot, in lower case."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    if v.count(":") == 1:
        v = v.split(":", 1)[0]
    return v.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Access:
    """Who may talk to the server: host names, browser origins, the API key."""

    def __init__(self, bind_host: str = "127.0.0.1", allow_hosts=(), cors=(), api_key: str | None = None):
        names = {*LOCAL_NAMES, host_name(bind_host), *(host_name(h) for h in allow_hosts)}
        if bind_host in WILDCARDS:
            me = socket.gethostname().lower()
            names |= {me, me + ".local", socket.getfqdn().lower()}
        self.hosts = {n for n in names if n}
        self.cors = {o.rstrip("/").lower() for o in cors}
        self.api_key = api_key.encode() if api_key else None

    def host_ok(self, host: str | None) -> bool:
        if host is None:            # HTTP/1.0 without Host: not a browser
            return True
        name = host_name(host)
        return name in self.hosts or _is_ip(name)

    def origin_ok(self, origin: str, host: str | None) -> tuple[bool, bool]:
        """(allowed, cross-origin): an Origin header against this server."""
        o = origin.strip().rstrip("/").lower()
        if host is not None and o in (f"http://{host.lower()}", f"https://{host.lower()}"):
            return True, False
        return ("*" in self.cors or o in self.cors) and o != "null", True

    def key_ok(self, authorization: str | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key)


def error_body(status: int, message: str, code: str, etype: str | None = None) -> bytes:
    etype = etype or ("server_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": etype, "param": None, "code": code}}).encode()


class Guard:
    """ASGI middleware in front of the server's app (see the module doc)."""

    def __init__(self, app, access: Access, max_body: int):
        self.app, self.access, self.max_body = app, access, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        h = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method, path = scope["method"], scope["path"]
        origin, cors = h.get("origin"), None
        if not self.access.host_ok(h.get("host")):
            return await _refuse(send, 403, "the Host header does not name this server (DNS rebinding?); "
                                 "start it with --allow-host NAME to accept that name", "invalid_host")
        if origin is not None:
            ok, cross = self.access.origin_ok(origin, h.get("host"))
            if not ok:
                return await _refuse(send, 403, f"requests from the web page at {origin[:100]!a} are not "
                                     "allowed; start the server with --cors ORIGIN to allow it", "invalid_origin")
            cors = origin if cross else None
        send = _with_cors(send, cors)
        if cors is not None and method == "OPTIONS" and "access-control-request-method" in h:
            return await _preflight(send, h)
        if (path.startswith("/v1/") or path in KEYED) and not self.access.key_ok(h.get("authorization")):
            return await _refuse(send, 401, "invalid or missing API key (Authorization: Bearer KEY)",
                                 "invalid_api_key")
        if method != "POST":
            return await self.app(scope, receive, send)
        if h.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return await _refuse(send, 415, "the request body must be JSON (Content-Type: application/json)",
                                 "unsupported_media_type")
        body = await self._read(h.get("content-length"), receive, send)
        if body is None:
            return
        return await self.app(scope, _replay(body, receive), send)

    async def _read(self, length: str | None, receive, send) -> bytes | None:
        """The whole body, or None once it has been refused (or the client left)."""
        if length is not None and (not length.strip().isdigit() or int(length) > self.max_body):
            await self._too_large(send)
            return None
        parts, n = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            n += len(chunk)
            if n > self.max_body:
                await self._too_large(send)
                return None
            parts.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(parts)

    async def _too_large(self, send) -> None:
        await _refuse(send, 413, f"the request body is larger than {self.max_body} bytes (--max-body-bytes)",
                      "body_too_large", close=True)


def _replay(body: bytes, receive):
    """A receive() that hands the app the body read already, then the real one
    (which reports the client's disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()
    return replay


def _with_cors(send, origin: str | None):
    if origin is None:
        return send

    async def cors_send(msg):
        if msg["type"] == "http.response.start":
            msg = dict(msg)
            msg["headers"] = [*msg.get("headers", []), (b"access-control-allow-origin", origin.encode("latin-1")),
                              (b"access-control-expose-headers", b"retry-after"), (b"vary", b"origin")]
        await send(msg)
    return cors_send


async def _preflight(send, h: dict) -> None:
    asked = h.get("access-control-request-headers", "authorization, content-type")
    await send({"type": "http.response.start", "status": 204, "headers": [
        (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
        (b"access-control-allow-headers", asked.encode("latin-1")),
        (b"access-control-max-age", b"600")]})
    await send({"type": "http.response.body", "body": b""})


async def _refuse(send, status: int, message: str, code: str, close: bool = False) -> None:
    body = error_body(status, message, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
