"""A backend wrapper that turns chosen reads into failures, for tests of everything above the backend.

``fail(request)`` is asked once per read, at submit time, and returns None (leave it alone), a string
starting with ``"short"`` (report half the bytes read, as if end of file came early), or any other
string (fail the read with ClutorIOError carrying that string as its reason). The fault is applied
only after the inner read has really completed, so the buffer ownership rule still holds: a failed
read's buffer is free exactly when its ``done`` resolves, as with a real failure.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Sequence

from clutor.errors import ClutorIOError
from clutor.io.backend import Backend, ReadHandle, ReadRequest, ReadState

__all__ = ["FaultyBackend", "FaultyHandle", "WrappedHandle"]


class WrappedHandle(ReadHandle):
    """The caller's view of a read a test backend wraps: its state follows the inner read until the
    wrapper resolves ``done`` (one callback after the inner read's)."""

    __slots__ = ("inner",)

    def __init__(self, inner: ReadHandle, loop: asyncio.AbstractEventLoop):
        # ReadHandle.__init__ would assign .state, which here is derived from the inner read.
        self.request = inner.request
        self.inner = inner
        self.done = loop.create_future()
        self.notify = None

    @property
    def state(self) -> ReadState:  # type: ignore[override]
        s = self.inner.state
        if s is ReadState.DONE and not self.done.done():
            return ReadState.INFLIGHT  # the inner read finished; the outcome is one callback away
        return s

    def drop(self) -> bool:
        if not self.inner.drop():
            return False
        if not self.done.done():
            self.done.cancel()
        return True


class FaultyHandle(WrappedHandle):
    """A wrapped read with the fault (or None) chosen for it at submit time."""

    __slots__ = ("fault",)

    def __init__(self, inner: ReadHandle, fault: str | None, loop: asyncio.AbstractEventLoop):
        super().__init__(inner, loop)
        self.fault = fault


class FaultyBackend:
    """Backend protocol around ``inner``; reads chosen by ``fail`` come back failed or short."""

    def __init__(self, inner: Backend, *, fail: Callable[[ReadRequest], str | None]):
        self.inner = inner
        self.fail = fail
        self.name = f"faulty({inner.name})"
        self.direct = inner.direct
        self.align = inner.align
        self.paths: tuple[str, ...] = tuple(getattr(inner, "paths", ()))
        self.fallback_reason = getattr(inner, "fallback_reason", None)
        self.injected = 0  # faults applied so far
        self._loop = asyncio.get_running_loop()
        self._outer_pending = 0

    def submit(self, requests: Sequence[ReadRequest]) -> list[ReadHandle]:
        faults = [self.fail(r) for r in requests]
        inner = self.inner.submit(requests)
        out: list[ReadHandle] = []
        for h, fault in zip(inner, faults):
            o = FaultyHandle(h, fault, self._loop)
            self._outer_pending += 1
            h.done.add_done_callback(lambda f, o=o: self._resolve(o, f))
            out.append(o)
        return out

    def _resolve(self, o: FaultyHandle, f: asyncio.Future) -> None:
        self._outer_pending -= 1
        if o.done.done():
            return
        self._settle(o, f)
        if not f.cancelled():
            o.settled()  # as a real backend does once it resolved a read

    def _settle(self, o: FaultyHandle, f: asyncio.Future) -> None:
        if f.cancelled():
            o.done.cancel()
            return
        err = f.exception()
        if err is not None:
            o.done.set_exception(err)
            return
        nbytes = f.result()
        if o.fault is None:
            o.done.set_result(nbytes)
            return
        self.injected += 1
        r = o.request
        if o.fault.startswith("short"):
            o.done.set_result(nbytes // 2)
        else:
            path = self.paths[r.file] if r.file < len(self.paths) else f"<file #{r.file}>"
            o.done.set_exception(ClutorIOError(path, r.offset, r.length, o.fault))

    def inflight(self) -> int:
        # A read counts until its outcome reached the caller's future (one callback after the inner).
        return self._outer_pending

    async def aclose(self) -> None:
        await self.inner.aclose()
