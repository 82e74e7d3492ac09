"""What every route shares before its own work: the server's readiness, a request body read within the
server's Limits and parsed off the event loop, and the empty reply to a client that left.

    ready(state)                                  # APIError 503 while loading, failed or draining
    body = await read_json(request, state, parse, *args)   # parse(decoded body, *args) in a worker thread
    except ClientLeft: return Nothing()
"""
from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .errors import APIError
from .labels import shown
from .requests import decode_body

__all__ = ["ClientLeft", "Nothing", "read_json", "ready"]


def ready(state) -> None:
    """Refuse a request the model cannot take now (state: clutor.server.app.ServerState)."""
    if state.status == "loading":
        raise APIError(503, "the model is still loading; retry shortly", code="model_loading",
                       headers={"retry-after": "2"})
    if state.status == "error":
        raise APIError(503, f"the model failed to load: {state.error}", code="model_load_failed")
    if state.status == "draining":
        raise APIError(503, "the server is shutting down", code="shutting_down")


class ClientLeft(Exception):
    """The client went away while sending its request."""


async def read_json(request: Request, state, parse, *args):
    """A route's request body, bounded by the server's Limits, then ``parse(body, *args)`` in a worker
    thread (decoding included: a body may be megabytes; at most Limits.tokenize_concurrency at once).
    What every route that takes a body goes through (APIError: a 4xx to send; ClientLeft: nobody to answer)."""
    raw = await _read_body(request, state.limits.max_body)

    def run():
        return parse(decode_body(raw), *args)

    async with state.parsing:
        return await asyncio.to_thread(run)


async def _read_body(request: Request, limit: int) -> bytes:
    too_big = {"connection": "close"}  # (the rest of the body is not read: the connection cannot be reused)
    cl = request.headers.get("content-length", "")
    if cl.isdigit() and int(cl) > limit:
        raise APIError(413, f"the request body is {shown(int(cl))} bytes, over the server's limit of {limit}",
                       code="request_too_large", headers=too_big)
    chunks, n = [], 0
    try:
        async for c in request.stream():
            n += len(c)
            if n > limit:
                raise APIError(413, f"the request body is over the server's limit of {limit} bytes",
                               code="request_too_large", headers=too_big)
            chunks.append(c)
    except ClientDisconnect:
        raise ClientLeft() from None
    return b"".join(chunks)


class Nothing(Response):
    """No response: the client is gone."""

    def __init__(self):
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        return
