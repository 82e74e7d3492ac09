"""Run the app on uvicorn: bind, serve, and on SIGINT/SIGTERM drain for a bounded time, then exit.

uvicorn's own signal handling re-raises the signal after shutting down (so the process dies of it);
here the first SIGINT/SIGTERM starts a drain (health turns 503, the listening socket closes, requests
in flight finish for up to ``drain_timeout`` seconds, then are cancelled) and the process exits 0; a
second SIGINT stops at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket

import uvicorn

__all__ = ["Server", "bind", "SWITCH_INTERVAL"]

log = logging.getLogger("clutor.server")

# How long a thread may keep the GIL while another waits for it (Python's default is 5 ms). In a
# server the event loop's Python (a few hundred microseconds per streamed token) and the compute
# thread's per-layer glue between kernels take turns on it: at 5 ms, a step that wants the GIL back
# after a kernel can wait behind the loop's whole turn, and the loop's wake-up for a finished step
# behind the compute thread's. At 0.5 ms, 8 clients on the real-text model in RAM (AMD EPYC Zen 3, 2
# cores): the loop's gap between two steps 2.7-3.0 -> 1.6-1.8 ms, the 8-row step 24-26 -> 21-24 ms.
# `clutor serve` sets it for its process (a library user's process keeps its own).
SWITCH_INTERVAL = 0.0005


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one: read it back from getsockname())."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class Server(uvicorn.Server):
    """uvicorn.Server whose signals drain the app (app.state.clutor) instead of re-raising, and whose
    connections keep the app's Limits (clutor.server.protocol): header, body and write timeouts, a cap
    on connections. ``http``: "httptools" (llhttp, the default where installed) or "h11"."""

    def __init__(self, app, *, drain_timeout: float = 30.0, http: str | None = None, **config):
        from .limits import Limits
        from .metrics import Metrics
        from .protocol import available, protocol_class

        state = getattr(getattr(app, "state", None), "clutor", None)
        limits = state.limits if state is not None else Limits()
        metrics = state.metrics if state is not None else Metrics()
        self.http = http or available()[0]
        cfg = uvicorn.Config(app, lifespan="on", access_log=False, log_config=None,
                             timeout_graceful_shutdown=max(float(drain_timeout), 0.0),
                             http=protocol_class(self.http, limits, metrics),
                             timeout_keep_alive=limits.keep_alive_timeout,
                             # (the connection layer bounds the head first, with its JSON 431)
                             h11_max_incomplete_event_size=limits.max_head + (64 << 10), **config)
        super().__init__(cfg)
        self._app = app

    def stop(self) -> None:
        """Begin the drain (what SIGINT/SIGTERM do); callable from another thread."""
        state = getattr(getattr(self._app, "state", None), "clutor", None)
        if state is not None:
            state.drain()
        self.should_exit = True

    def _on_signal(self, sig: int) -> None:
        if self.should_exit:
            log.warning("second signal: stopping now")
            self.force_exit = True
            return
        log.info("%s: draining requests in flight (up to %ss), then exiting", signal.Signals(sig).name,
                 self.config.timeout_graceful_shutdown)
        self.stop()

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass
        try:
            yield
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
