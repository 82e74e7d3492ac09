"""The app's front door: what every HTTP request passes before a route, and what every response is
counted as on its way out.

In order, a request is refused when:
1. it carries both Content-Length and Transfer-Encoding (a smuggling attempt, RFC 9112 6.1): 400,
   and the connection is closed so nothing pipelined behind it is read;
2. it arrived on a loopback address under a Host that is not a local name (DNS rebinding: a page
   on evil.example whose name now resolves to 127.0.0.1): 403, unless ``allowed_hosts`` names it;
3. a browser sent it from another origin (``Origin`` is neither this server nor an allowed one):
   403; a page elsewhere cannot drive the server, with or without an API key;
4. with an API key, a /v1 route lacks ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (compared
   as bytes, so a non-ASCII key sent as UTF-8 works): 401 (KeyCheck, inside CORS so preflights are
   answered).

Every response is counted in ``clutor_requests_total`` by (route template, status) — unknown paths
all as "other" — and one the client did not get whole as 499: it left before the response was
complete, or (served by clutor's Server) the connection was cut or lost before the response's last
bytes left our buffer. An exception no route handled becomes a JSON 500 and one log record, never a
text/plain page.
"""
from __future__ import annotations

import functools
import hmac
import ipaddress
import logging
import socket

from .errors import error_body
from .labels import for_log, route_label, shown
from .responses import JSON

__all__ = ["FrontDoor", "KeyCheck"]

log = logging.getLogger("clutor.server")


class FrontDoor:
    def __init__(self, app, inner, state, *, allowed_hosts=(), allowed_origins=()):
        """``app``: the Starlette app (its routes name the labels); ``inner``: what to call (the app,
        possibly wrapped in CORS and KeyCheck); ``state``: the ServerState whose metrics count."""
        self.routes = app.router.routes
        self.inner = inner
        self.state = app.state  # so callers reach app.state.clutor on what create_app returns
        self._server = state
        self.allowed_hosts = frozenset(_norm_host(h) for h in allowed_hosts)
        self.allowed_origins = frozenset(_norm_origin(o) for o in allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        label = route_label(self.routes, scope)
        refused = self._refusal(scope)
        if refused is not None:
            status, message, code, close = refused
            self._server.metrics.requests[(label, status)] += 1
            log.info("- %s %s %d %s", scope.get("method", "-"), label, status, for_log(message))
            headers = {"connection": "close"} if close else {}
            await JSON(error_body(status, message, code=code, path=_route_path(scope)), status,
                       headers)(scope, receive, send)
            return
        out = _Outcome()

        async def counted_receive():
            msg = await receive()
            if msg["type"] == "http.disconnect" and not out.complete:
                out.client_left = True
            return msg

        async def counted_send(msg):
            if msg["type"] == "http.response.start":
                out.status = msg["status"]
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                out.complete = True
            await send(msg)

        try:
            await self.inner(scope, counted_receive, counted_send)
        except Exception as e:
            log.error("unexpected error on %s %s: %s: %s", scope.get("method", "-"), label, type(e).__name__,
                      for_log(str(e)), exc_info=e)
            if out.status is None:
                await JSON(error_body(500, f"internal error: {type(e).__name__}", code="internal_error",
                                      path=_route_path(scope)), 500)(scope, receive, counted_send)
        status = out.status if out.complete or not out.client_left else 499
        requests = self._server.metrics.requests

        def count(delivered: bool) -> None:
            requests[(label, status if delivered and status is not None else 499)] += 1

        delivery = (scope.get("extensions") or {}).get("clutor.delivery")
        if not out.complete or delivery is None:
            count(True)
        elif delivery.done():
            count(delivery.result())
        else:  # written, not yet read: counted once the client has taken it all, or was cut off
            delivery.add_done_callback(lambda d: count(d.result()))

    def _refusal(self, scope) -> tuple[int, str, str, bool] | None:
        """(status, message, code, close the connection) for a request refused at the door, else None."""
        headers = scope.get("headers") or []
        host = origin = None
        cl = te = False
        for name, value in headers:
            if name == b"host":
                host = value
            elif name == b"origin":
                origin = value
            elif name == b"content-length":
                cl = True
            elif name == b"transfer-encoding":
                te = True
        if cl and te:
            return (400, "the request has both Content-Length and Transfer-Encoding: refused, and the "
                         "connection closed (RFC 9112 6.1)", "bad_framing", True)
        if not _host_allowed(host, scope.get("server"), self.allowed_hosts):
            h = host.decode("latin-1")
            return (403, f"Host {shown(h)} is not a name of this server (it listens on a loopback address; "
                         "start it with --allow-host NAME to accept that name)", "host_not_allowed", False)
        if origin is not None and not _origin_allowed(origin, host, self.allowed_origins):
            o = origin.decode("latin-1")
            return (403, f"requests from the web page origin {shown(o)} are not allowed (start the server with "
                         "--allow-origin ORIGIN to let that page call the API)", "origin_not_allowed", False)
        return None


class _Outcome:
    __slots__ = ("status", "complete", "client_left")

    def __init__(self):
        self.status: int | None = None
        self.complete = False
        self.client_left = False


KEYED = ("/v1", "/slots", "/completion", "/tokenize", "/detokenize", "/apply-template", "/props", "/api/")  # the routes a key guards


class KeyCheck:
    """With an API key, every /v1 route, /slots (which writes files) and llama-server's own routes need
    ``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``); /health, /metrics and the chat page
    stay open."""

    def __init__(self, app, key: str):
        self.app = app
        self._keys = {key.encode("utf-8"), key.encode("latin-1", "ignore") if _latin1(key) else b""} - {b""}

    async def __call__(self, scope, receive, send):
        path = _route_path(scope) if scope["type"] == "http" else ""
        if path.startswith(KEYED):
            auth = x_key = b""
            for name, value in scope.get("headers") or []:
                if name == b"authorization":
                    auth = value
                elif name == b"x-api-key":  # how Anthropic's clients send it
                    x_key = value
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else x_key.strip()
            ok = False
            for k in self._keys:  # (UTF-8, the usual; Latin-1, what some clients send): both compared
                ok |= hmac.compare_digest(given, k)
            if not ok:
                resp = JSON(error_body(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                       code="invalid_api_key", path=path), 401, {"www-authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _latin1(s: str) -> bool:
    try:
        s.encode("latin-1")
        return True
    except UnicodeEncodeError:
        return False


def _route_path(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path  # mounted: Starlette keeps the prefix


# -- Host and Origin ------------------------------------------------------------------------------
def _split_host(hostport: str) -> tuple[str, str]:
    """("example.com", "8000") from "example.com:8000"; IPv6 literals keep their brackets off."""
    hostport = hostport.strip()
    if hostport.startswith("["):
        end = hostport.find("]")
        return hostport[1:end] if end > 0 else hostport, hostport[end + 2:] if end > 0 else ""
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return hostport, ""
    return host, port


def _norm_host(h: str) -> str:
    return "*" if h == "*" else _split_host(h)[0].lower().rstrip(".")


@functools.lru_cache(maxsize=1)
def _local_names() -> frozenset[str]:
    names = {"localhost"}
    try:
        name = socket.gethostname().lower()
        names |= {name, name.split(".")[0]}
    except OSError:
        pass
    return frozenset(names)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _host_allowed(host: bytes | None, server, allowed: frozenset[str]) -> bool:
    if "*" in allowed or host is None or not server:  # no Host: not a browser; no address: a Unix socket
        return True
    try:
        if not ipaddress.ip_address(server[0]).is_loopback:
            return True  # listening on a public address is the operator's choice (protect it with --api-key)
    except ValueError:
        return True
    name = _norm_host(host.decode("latin-1"))
    # An IP literal cannot be rebound: a page can only reach it under its own origin's address.
    return (_is_ip(name) or name in _local_names() or name.endswith(".localhost") or name in allowed)


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _norm_origin(o: str) -> str:
    if o in ("*", "null"):
        return o
    scheme, sep, rest = o.strip().rstrip("/").partition("://")
    if not sep:
        return o.strip().lower()
    host, port = _split_host(rest)
    host = f"[{host}]" if ":" in host else host
    port = "" if port == _DEFAULT_PORTS.get(scheme.lower()) else port
    return f"{scheme.lower()}://{host.lower()}" + (f":{port}" if port else "")


def _origin_allowed(origin: bytes, host: bytes | None, allowed: frozenset[str]) -> bool:
    if "*" in allowed:
        return True
    o = _norm_origin(origin.decode("latin-1"))
    if o in allowed:
        return True
    if host is None or "://" not in o:
        return False
    scheme = o.split("://", 1)[0]
    return scheme in _DEFAULT_PORTS and o == _norm_origin(f"{scheme}://{host.decode('latin-1')}")  # same origin
