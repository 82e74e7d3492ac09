"""Every bound the server puts on a client, in one place: sizes, timeouts, connections.

``create_app(limits=Limits(...))`` takes them; ``clutor serve`` sets them from its flags; the
connection layer (clutor.server.protocol) and the routes read them from here and nowhere else. An
endpoint that reads a body or runs for long takes its bound from this class, so a new bound is one
field here, one flag, one check.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["Limits"]


@dataclass(frozen=True)
class Limits:
    """What one client may make the server hold, and for how long.

    A request's head (its request line and headers) may be at most ``max_head`` bytes and
    ``max_headers`` lines, counted as the bytes arrive, before the HTTP parser holds them.
    Timeouts are in seconds. A request's head (request line and headers) must arrive within
    ``header_timeout`` of its first byte (of the connection's opening for the first request); its
    body within ``body_timeout`` of the head, plus one second per ``min_body_rate`` bytes received,
    so a large upload at a reasonable rate always fits and a dribble never does (408, closed). A
    client that takes none of a response's bytes for ``write_timeout`` while the server has more for
    it is cut off (its generation is cancelled). Beyond ``max_connections`` open connections a new
    one gets 503 and is closed; None sizes it from the process's file-descriptor limit.
    """

    max_body: int = 8 << 20          # request body bytes (413 beyond)
    max_head: int = 16 << 10         # request line and headers, bytes (431 beyond; uvicorn's h11 bound)
    max_headers: int = 100           # header lines (431 beyond; llama-server's bound)
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    min_body_rate: int = 64 << 10    # bytes/s that buy one more second of body_timeout
    write_timeout: float = 30.0
    keep_alive_timeout: float = 5.0  # an idle connection between two requests is closed after this
    max_connections: int | None = None
    tokenize_concurrency: int = 2    # prompts parsed and tokenised at once (each in a worker thread)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name == "max_connections":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"Limits.{f.name} must be a positive number, got {v!r}")
        for name in ("max_body", "max_head", "max_headers", "min_body_rate", "tokenize_concurrency",
                     "max_connections"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, int):
                raise ValueError(f"Limits.{name} must be an integer, got {v!r}")

    def connections(self) -> int:
        """max_connections, or what the file-descriptor limit leaves after the model's own files."""
        if self.max_connections is not None:
            return self.max_connections
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except (ImportError, OSError, ValueError):
            return 1024
        if soft == resource.RLIM_INFINITY:
            return 1024
        return max(8, min(1024, soft - 64))  # 64: the model's files, its I/O, logs, the listening socket
