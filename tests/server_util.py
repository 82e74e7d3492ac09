"""A real `clutor serve` app on uvicorn in a background thread (its own event loop), on a free port."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx

from clutor.server.run import Server, bind


class LiveServer:
    """create_app(...) served on 127.0.0.1:<free port>; ``call(coro_fn)`` runs a coroutine on its loop.

    The loop's exception handler collects whatever the loop logs; ``stop()`` fails if anything was."""

    def __init__(self, app, *, drain_timeout: float = 5.0, ready: bool = True, timeout: float = 180.0,
                 http: str | None = None, loop: str = "uvloop"):
        self.app = app
        self.state = app.state.clutor
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        kw = {} if http is None else {"http": http}
        self.server = Server(app, drain_timeout=drain_timeout, log_level="warning", **kw)
        self._loop_kind = loop
        self.logged: list[dict] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self.error is not None or not self.thread.is_alive():
                raise RuntimeError(f"server thread died: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.02)
        if ready:
            self.wait_ready(deadline - time.monotonic())

    def _main(self) -> None:
        try:
            if self._loop_kind != "uvloop":
                raise ImportError
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        self.thread_id = threading.get_ident()
        loop.set_exception_handler(lambda _loop, ctx: self.logged.append(ctx))
        self.loop = loop
        try:
            loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        except BaseException as e:  # surfaced by stop()
            self.error = e
        finally:
            loop.close()

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.get(self.url + "/health", timeout=5)
            if r.status_code == 200:
                return
            if r.json().get("status") == "error" or time.monotonic() > deadline:
                raise RuntimeError(f"server not ready: {r.text}")
            time.sleep(0.05)

    def call(self, fn, timeout: float = 30.0):
        """Run the coroutine fn() on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def metrics(self) -> dict[str, float]:
        """/metrics as {name{labels}: value}."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def stop(self, timeout: float = 30.0) -> None:
        self.server.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not stop"
        assert self.error is None, f"server failed: {self.error!r}"
        assert not self.logged, f"server loop logged: {self.logged}"
