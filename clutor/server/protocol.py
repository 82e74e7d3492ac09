"""HTTP/1.1 connections: uvicorn's protocol (httptools' llhttp parser, else h11) with the bounds it lacks.

uvicorn times out only idle keep-alive connections. Here, per connection (the numbers are Limits'):

- the head of a request must arrive within ``header_timeout`` of its first byte (of the connection
  for the first request), its body within ``body_timeout`` plus a second per ``min_body_rate``
  bytes: a client dribbling a byte every few seconds gets 408 and is closed (slowloris);
- a client that reads nothing for ``write_timeout`` while its response waits in our buffer is cut
  off; the app sees it leave, which cancels its generation;
- beyond ``max_connections`` a new connection gets 503 and is closed at once, before it can hold
  a file descriptor for long;
- a client that half-closes (sends FIN after its request) still gets its answer: the connection
  stays open for writing until the response is complete, then closes. A client that closed its
  socket and left sends the same FIN; until the response starts, a ``100 Continue`` each second
  (which HTTP/1.1 clients skip before the final response) tells the two apart, as the socket of a
  client that left answers it with a reset: the connection is then dropped and the app sees the
  client leave (which cancels its generation);
- a request head (request line and headers) over ``max_head`` bytes or ``max_headers`` lines gets
  431 and is closed, counted as its bytes arrive, before the parser holds them (httptools itself
  bounds neither: a client could make the server hold gigabytes of headers);
- a response that closes the connection while the client is still sending the request's body (a
  413) does not close it at once: the server sends its FIN and reads and drops what the client
  sends, up to ``_LINGER_BYTES`` or ``_LINGER_SECONDS`` (nginx's lingering close). Closed at once,
  the unread bytes would make the kernel reset the connection, and a client still writing (httpx,
  so the OpenAI and Anthropic clients) would see a broken pipe, never the 413;
- a request the parser refuses gets a JSON error body and is counted, not a text/plain page;
- each request's fate is told to the app as ``scope["extensions"]["clutor.delivery"]``, a future:
  True once the last bytes of its response left our buffer (into the kernel's), False if the
  connection was cut or lost first, or the app ended without completing a response. A handler
  returns as soon as it has written its response; a client that then reads nothing is still cut
  after ``write_timeout``, and the app logs and counts the request when the future says what it was.

Every cut is counted in ``clutor_connections_closed_total{reason}`` and logged at INFO (at most one
line per reason a second, so a flood does not flood the log).
"""
from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from dataclasses import dataclass, field

from .errors import error_body
from .limits import Limits
from .metrics import Metrics
from .responses import json_bytes

__all__ = ["Connection", "protocol_class", "available"]

log = logging.getLogger("clutor.server")


@dataclass
class Connection:
    """What a connection tells the app about itself, as ``scope["extensions"]["clutor.connection"]``."""

    eof: asyncio.Event = field(default_factory=asyncio.Event)  # the client half-closed: it sends no more
    lost: bool = False           # the connection is gone: writes are dropped
    closed: str | None = None    # why the server cut it ("write_timeout", "body_timeout", ...), or None


def available() -> tuple[str, ...]:
    """The HTTP parsers uvicorn can use here, preferred first."""
    out = []
    try:
        import httptools  # noqa: F401

        out.append("httptools")
    except ImportError:
        pass
    out.append("h11")
    return tuple(out)


def protocol_class(http: str, limits: Limits, metrics: Metrics) -> type:
    """uvicorn's ``http`` protocol ("httptools" or "h11") with the bounds above."""
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    elif http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        raise ValueError(f"http must be one of {', '.join(available())}, got {http!r}")
    return type(f"Bounded{base.__name__}", (_Bounded, base),
                {"limits": limits, "metrics": metrics, "max_connections": limits.connections(), "http": http})


def _raw_response(status: int, reason: str, message: str, code: str, extra: bytes = b"",
                  path: str | None = None) -> bytes:
    """A whole error response written straight to the transport, shaped for ``path``'s API when known."""
    body = json_bytes(error_body(status, message, code=code, path=path))
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n").encode() + extra + b"\r\n" + body


_last_log: dict[str, float] = {}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LINGER_BYTES = 64 << 20  # of a refused body, read and dropped before the connection closes
_LINGER_SECONDS = 5.0
_TCP_CLOSE = 7  # tcp_info's state once the peer's reset arrived (linux/tcp_states.h)
_HEAD_END = re.compile(rb"\r?\n\r?\n")  # the blank line that ends a head (llhttp and h11 take a bare LF too)


def _tcp_state(sock) -> int | None:
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
    except (AttributeError, OSError):
        return None


def _note(metrics: Metrics, reason: str, message: str) -> None:
    metrics.closed[reason] += 1
    now = time.monotonic()
    if now - _last_log.get(reason, -1e9) >= 1.0:
        _last_log[reason] = now
        log.info("connection closed: %s", message)


class _Lingering:
    """The connection's transport as uvicorn's request cycles see it: its ``close`` lingers while the
    client is still sending a body (the protocol's ``_linger`` decides)."""

    def __init__(self, transport, protocol: "_Bounded"):
        self._t, self._p = transport, protocol

    def close(self) -> None:
        if not self._p._linger():
            self._t.close()

    def is_closing(self) -> bool:
        return self._p._lingering or self._t.is_closing()

    def __getattr__(self, name):
        return getattr(self._t, name)


class _Bounded:
    """Mixed in before uvicorn's HttpToolsProtocol or H11Protocol (both keep ``self.cycle``, a
    RequestResponseCycle with ``more_body``, ``response_started``, ``response_complete``,
    ``disconnected`` and ``message_event``, and call ``send_400_response`` on a parse error)."""

    limits: Limits
    metrics: Metrics
    max_connections: int

    # -- connection ---------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.transport = _Lingering(transport, self)
        self._raw = transport
        self._lingering = False
        self._lingered = 0  # bytes dropped while lingering
        self._conn = Connection()
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_phase: str | None = None   # "header" | "body" while a timer runs
        self._phase_start = 0.0
        self._body_seen = 0
        self._seen_cycle = None                # the cycle whose head was complete last
        self._write_timer: asyncio.TimerHandle | None = None
        self._tails: list[asyncio.Future] = []  # deliveries of complete responses still in our buffer
        self._limits: tuple[int, int] | None = None  # the transport's (low, high) while a tail drains
        self._head = 0         # bytes of the head being read (while the header clock runs)
        self._head_lines = 0   # its line breaks
        self._head_tail = b""  # its last bytes: a head's end may straddle two reads
        self._refused = False  # answered at the connection level and closing: the rest is not parsed
        self._probe_timer: asyncio.TimerHandle | None = None  # after a half-close, until the response starts
        self._probed = 0.0     # when the last 100 Continue went out
        conn, app = self._conn, self.app

        async def app_with_connection(scope, receive, send):
            delivery = self.loop.create_future()
            ext = scope.setdefault("extensions", {})
            ext["clutor.connection"], ext["clutor.delivery"] = conn, delivery

            final = False  # the response's last write went out

            async def tracked_send(message):
                nonlocal final
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body", False) and not final:
                    final = True
                    self._track(delivery)

            try:
                await app(scope, receive, tracked_send)
            finally:
                if not final:
                    delivery.set_result(False)  # no complete response went out

        self.app = app_with_connection
        self.metrics.connections = len(self.connections)
        if len(self.connections) > self.max_connections:
            _note(self.metrics, "over_capacity", f"{len(self.connections) - 1} connections open, the limit is "
                                                 f"{self.max_connections}: refused with 503")
            transport.write(_raw_response(503, "Service Unavailable", f"the server has {self.max_connections} "
                                          "connections open, its limit; retry shortly", "too_many_connections",
                                          b"retry-after: 1\r\n"))
            transport.close()
            return
        self._arm_read("header")

    def connection_lost(self, exc) -> None:
        self._conn.lost = True
        self._disarm_read()
        for t in (self._write_timer, self._probe_timer):
            if t is not None:
                t.cancel()
        self._write_timer = self._probe_timer = None
        self._settle_tails(False)  # (a tail that drained was settled in resume_writing, before this)
        super().connection_lost(exc)
        self.metrics.connections = len(self.connections)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._lingering:
            self._lingered += len(data)
            if self._lingered > _LINGER_BYTES:
                self._raw.close()
            return
        if self._read_phase is None and not self._in_request():
            self._arm_read("header")  # the first bytes of the next request on a kept-alive connection
        elif self._read_phase == "body":
            self._body_seen += len(data)
        if self._read_phase == "header" and not self._head_fits(data):
            return
        super().data_received(data)
        self._follow()

    def _head_fits(self, data: bytes) -> bool:
        """Count the head's bytes and lines in ``data`` (up to the blank line that ends it); over a bound,
        answer 431 and close without handing the parser any of it."""
        lim = self.limits
        carry = self._head_tail
        buf = carry + data if carry else data
        end = _HEAD_END.search(buf) if b"\n" in data else None
        part = data if end is None else data[: max(0, end.end() - len(carry))]
        self._head += len(part)
        self._head_lines += part.count(b"\n")
        self._head_tail = buf[-3:] if end is None else b""
        lines = self._head_lines - (1 if end is None else 2)  # header lines: not the request line, nor the blank
        if self._head <= lim.max_head and lines <= lim.max_headers:
            if end is not None:
                self._head = self._head_lines = 0
            return True
        what = (f"over {lim.max_head} bytes" if self._head > lim.max_head else f"over {lim.max_headers} header lines")
        _note(self.metrics, "head_too_large", f"a request head {what}: 431")
        self._refused = True
        self._conn.closed = "head_too_large"
        self._disarm_read()
        self.transport.write(_raw_response(431, "Request Header Fields Too Large",
                                           f"the request's head (request line and headers) is {what}, this "
                                           f"server's limit", "headers_too_large"))
        self.transport.close()
        return False

    def _linger(self) -> bool:
        """On a close: is the client still sending the body of a request already answered? Then send
        our FIN and read on, dropping the bytes, until the client's FIN or a bound, and say so."""
        if self._lingering:
            return True
        c = self.cycle
        if (c is None or not c.response_complete or not c.more_body or self._refused or self._conn.lost
                or self._conn.closed is not None or self._raw.is_closing()):
            return False
        self._lingering = True
        self._disarm_read()
        if self._probe_timer is not None:
            self._probe_timer.cancel()
            self._probe_timer = None
        self._raw.write_eof()  # (after what is buffered: the response)
        self._raw.resume_reading()  # (uvicorn pauses reading a body the app does not take)
        self._read_timer = self.loop.call_later(_LINGER_SECONDS, self._raw.close)
        return True

    def eof_received(self):
        if self._lingering:
            return False  # the client sent all: close
        c = self.cycle
        if c is not None and not c.response_complete and not c.more_body and self._seen_cycle is c:
            self._conn.eof.set()  # a whole request, not answered yet: keep the connection to answer it
            self._probe()
            return True
        return False  # idle, or a request that can never complete: close

    def _probe(self) -> None:
        """After a half-close, until the response starts: has the client left? Every second a
        100 Continue goes out; a socket that was closed answers it with a reset, seen in TCP_INFO
        within a quarter second (at once on a local network)."""
        self._probe_timer = None
        c = self.cycle
        if (c is None or c.response_started or self.transport.is_closing()
                or c.scope.get("http_version") != "1.1"):  # (HTTP/1.0 has no 1xx: it gets its answer unprobed)
            return
        state = _tcp_state(self.transport.get_extra_info("socket"))
        if state is None:  # no TCP_INFO here: answer, whoever is there
            return
        if state == _TCP_CLOSE:
            self.transport.abort()  # the app sees the client leave
            return
        delay = 0.25
        now = time.monotonic()
        if now - self._probed >= 1.0:
            self.transport.write(_CONTINUE)
            self._probed, delay = now, 0.02
        self._probe_timer = self.loop.call_later(delay, self._probe)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (may start a pipelined request already read)
        if self._conn.eof.is_set() and not self.transport.is_closing() and not self._in_request():
            self.transport.close()  # the client said it sends no more: nothing to keep alive for
        self._follow()

    def send_400_response(self, msg: str) -> None:
        _note(self.metrics, "bad_request", "a request the HTTP parser refused: 400")
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()
            return
        self.transport.write(_raw_response(400, "Bad Request", f"invalid HTTP request: {msg.rstrip('.')}",
                                           "bad_http_request", path=self._path()))
        self.transport.close()

    # -- reading: the head and the body, each against its clock ---------------------------------------
    def _path(self) -> str | None:
        """The current request's path, once its head was parsed (its errors take that API's shape)."""
        c = self.cycle
        return c.scope.get("path") if c is not None and not c.response_complete else None

    def _in_request(self) -> bool:
        c = self.cycle
        return c is not None and not c.response_complete

    def _arm_read(self, phase: str) -> None:
        self._disarm_read()
        self._read_phase, self._phase_start, self._body_seen = phase, time.monotonic(), 0
        if phase == "header":
            self._head, self._head_lines, self._head_tail = 0, 0, b""
        self._read_timer = self.loop.call_later(self._read_allowance(), self._read_expired)

    def _disarm_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer, self._read_phase = None, None

    def _read_allowance(self) -> float:
        """Seconds from the phase's start the client has for it (a body earns more as it arrives)."""
        if self._read_phase == "header":
            return self.limits.header_timeout
        return self.limits.body_timeout + self._body_seen / self.limits.min_body_rate

    def _follow(self) -> None:
        """After the parser ran: a head completed starts the body's clock (or stops the clock); a body
        completed stops it."""
        if self.transport.is_closing():
            self._disarm_read()
            return
        c = self.cycle
        if c is not None and c is not self._seen_cycle:
            self._seen_cycle = c
            if c.more_body:
                self._arm_read("body")
            else:
                self._disarm_read()
        elif self._read_phase == "body" and c is not None and not c.more_body:
            self._disarm_read()

    def _read_expired(self) -> None:
        self._read_timer = None
        phase = self._read_phase
        if phase is None or self.transport.is_closing():
            return
        left = self._phase_start + self._read_allowance() - time.monotonic()
        if left > 0:  # the body kept coming: its allowance grew
            self._read_timer = self.loop.call_later(left, self._read_expired)
            return
        self._read_phase = None
        c = self.cycle
        what = "its headers" if phase == "header" else "its body"
        seconds = time.monotonic() - self._phase_start
        _note(self.metrics, f"{phase}_timeout", f"the client took over {seconds:.0f} s to send {what}: 408")
        self._conn.closed = f"{phase}_timeout"
        answerable = c is None or c.response_complete or (phase == "body" and not c.response_started)
        if phase == "body" and c is not None and not c.response_complete:
            c.disconnected = True  # the app, waiting for the body, sees the client leave; its writes are dropped
            c.message_event.set()
        if answerable:
            self.transport.write(_raw_response(408, "Request Timeout", f"the request's {what[4:]} did not arrive "
                                               f"within {seconds:.0f} s", "request_timeout", path=self._path()))
        self.transport.close()

    # -- writing: a client that takes nothing ------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._write_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._tails and not self._conn.lost and self.transport.get_write_buffer_size() == 0:
            self._settle_tails(True)

    # -- delivery: when a complete response's last bytes leave our buffer ----------------------------
    def _track(self, delivery: asyncio.Future) -> None:
        """Right after the final write of a response (uvicorn's send writes into the transport, then
        returns): settle ``delivery`` now if nothing is left in our buffer, else when it drains."""
        if self._conn.lost or self._conn.closed is not None:  # gone, or being cut: the write may be dropped
            delivery.set_result(False)
            return
        if self.transport.get_write_buffer_size() == 0:
            delivery.set_result(True)
            return
        self._tails.append(delivery)
        if self._limits is None:
            # The transport calls resume_writing when its buffer falls to the low-water mark: at 0
            # that is the moment the last byte left. A high-water mark of 0 pauses writing now, even
            # for a tail below the usual mark, which arms the write timer (a client that never reads
            # a small tail is cut, not kept forever) and holds a pipelined response back until this
            # one is out.
            self._limits = self.transport.get_write_buffer_limits()
            self.transport.set_write_buffer_limits(high=0, low=0)

    def _settle_tails(self, delivered: bool) -> None:
        tails, self._tails = self._tails, []
        for d in tails:
            if not d.done():
                d.set_result(delivered)
        if self._limits is not None:
            low, high = self._limits
            self._limits = None
            if not self._conn.lost:
                self.transport.set_write_buffer_limits(high=high, low=low)

    def _write_expired(self) -> None:
        self._write_timer = None
        if self.transport.is_closing() and self._conn.lost:
            return
        _note(self.metrics, "write_timeout", f"the client read nothing for {self.limits.write_timeout:g} s: "
                                             "cut off")
        self._conn.closed = "write_timeout"
        self.transport.abort()  # (close() would wait for the buffer to drain, which it never will)
