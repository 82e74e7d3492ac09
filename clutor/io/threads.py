"""Thread-pool read backend: ``os.preadv`` into the registered buffers from a few worker threads.

The portable fallback when io_uring is missing (no liburing wheel, kernel or seccomp refusal).
``os.preadv`` releases the GIL while the kernel copies, so a handful of threads keep a disk busy.

All state changes of a ReadHandle happen on the event loop thread: the loop decides which queued read
goes to a worker (QUEUED -> INFLIGHT), so ``drop()`` and hand-over never race; workers only read and
post the outcome back with ``call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections import deque
from typing import Sequence

import numpy as np

from clutor.errors import ClosedError, ClutorIOError
from clutor.io.backend import FileTable, ReadHandle, ReadRequest, ReadState

__all__ = ["ThreadBackend", "check_requests", "check_buffers"]

_MAX_SHORT_RETRIES = 3


def check_requests(files: FileTable, buffers: Sequence[memoryview], requests: Sequence[ReadRequest]) -> None:
    """Reject a malformed batch before any of it is queued (shared by both backends)."""
    for r in requests:
        if not 0 <= r.file < len(files.paths):
            raise ClutorIOError(f"<file #{r.file}>", r.offset, r.length, f"no such file index (have {len(files.paths)})")
        path = files.paths[r.file]
        if not 0 <= r.buf < len(buffers):
            raise ClutorIOError(path, r.offset, r.length, f"no such buffer index {r.buf} (have {len(buffers)})")
        if r.offset < 0 or r.length <= 0 or r.length > len(buffers[r.buf]):
            raise ClutorIOError(
                path, r.offset, r.length,
                f"need offset >= 0 and 0 < length <= {len(buffers[r.buf])} (size of buffer {r.buf})",
            )
        if files.file_direct[r.file] and (r.offset % files.align or r.length % files.align):
            raise ClutorIOError(path, r.offset, r.length, f"O_DIRECT needs offset and length multiples of {files.align}")


def check_buffers(buffers: Sequence[memoryview], align: int) -> list[memoryview]:
    out = []
    for i, b in enumerate(buffers):
        mv = memoryview(b).cast("B")
        if mv.readonly:
            raise ValueError(f"buffer {i} is read-only")
        if align > 1:
            # memoryview hides the address; numpy's interface exposes it without copying.
            addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data
            if addr % align:
                raise ValueError(f"buffer {i} at address {addr:#x} is not {align}-byte aligned (O_DIRECT)")
        out.append(mv)
    return out


class ThreadBackend:
    """Backend protocol over ``os.preadv`` in ``workers`` threads. Construct inside the running loop."""

    name = "threads"

    def __init__(
        self,
        files: Sequence[str | os.PathLike],
        buffers: Sequence[memoryview],
        *,
        direct: bool,
        workers: int = 4,
    ):
        self._loop = asyncio.get_running_loop()
        self._files = FileTable(files, direct=direct)
        try:
            self._buffers = check_buffers(buffers, self._files.align)
        except BaseException:
            self._files.close()
            raise
        self.paths = self._files.paths
        self.direct = self._files.direct
        self.file_direct = self._files.file_direct
        self.align = self._files.align
        self.fallback_reason = self._files.fallback_reason
        self.workers = max(1, workers)
        # Two reads per worker handed over keeps every thread busy across the loop round trip that
        # hands it the next one; the rest wait on the loop side where drop() can still take them.
        self._max_handed = 2 * self.workers
        self._pending: deque[ReadHandle] = deque()
        self._handed = 0
        self._closed = False
        self._drained: asyncio.Future[None] | None = None
        self._jobs: queue.SimpleQueue[ReadHandle | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"clutor-io-{i}", daemon=True) for i in range(self.workers)
        ]
        for t in self._threads:
            t.start()

    # -- protocol -----------------------------------------------------------------------------
    def submit(self, requests: Sequence[ReadRequest]) -> list[ReadHandle]:
        if self._closed:
            raise ClosedError("ThreadBackend: submit() after aclose()")
        check_requests(self._files, self._buffers, requests)
        handles = [ReadHandle(r, self._loop) for r in requests]
        self._pending.extend(handles)
        self._pump()
        return handles

    def inflight(self) -> int:
        return self._handed + sum(1 for h in self._pending if h.state is ReadState.QUEUED)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._drained = self._loop.create_future()
            while self._pending:
                h = self._pending.popleft()
                if h.state is ReadState.QUEUED:
                    h.state = ReadState.DROPPED
                    if not h.done.done():
                        h.done.set_exception(ClosedError("ThreadBackend closed before this read was started"))
                        h.done.exception()  # nobody may be waiting; do not log "never retrieved"
            self._maybe_finish()
        await asyncio.shield(self._drained)

    # -- loop side ----------------------------------------------------------------------------
    def _pump(self) -> None:
        while self._pending and self._handed < self._max_handed:
            h = self._pending.popleft()
            if h.state is not ReadState.QUEUED:
                continue  # dropped
            if h.done.cancelled():  # the future was cancelled directly: treat as a drop
                h.state = ReadState.DROPPED
                continue
            h.state = ReadState.INFLIGHT
            self._handed += 1
            self._jobs.put(h)

    def _complete(self, h: ReadHandle, nbytes: int, err: ClutorIOError | None) -> None:
        self._handed -= 1
        h.state = ReadState.DONE
        if not h.done.done():
            if err is None:
                h.done.set_result(nbytes)
            else:
                h.done.set_exception(err)
        if self._closed:
            self._maybe_finish()
        else:
            self._pump()

    def _maybe_finish(self) -> None:
        if self._handed or self._drained is None or self._drained.done():
            return
        for _ in self._threads:
            self._jobs.put(None)
        self._files.close()
        self._drained.set_result(None)

    # -- worker side --------------------------------------------------------------------------
    def _work(self) -> None:
        while (h := self._jobs.get()) is not None:
            nbytes, err = 0, None
            try:
                nbytes = self._read(h.request)
            except ClutorIOError as e:
                err = e
            except Exception as e:  # never let a worker die with a read unresolved
                err = ClutorIOError(self.paths[h.request.file], h.request.offset, h.request.length, repr(e))
            try:
                self._loop.call_soon_threadsafe(self._complete, h, nbytes, err)
            except RuntimeError:
                return  # the loop is closed; nobody is left to tell

    def _read(self, r: ReadRequest) -> int:
        fd = self._files.fds[r.file]
        buf = self._buffers[r.buf]
        got = 0
        shorts = 0
        while got < r.length:
            try:
                n = os.preadv(fd, [buf[got:r.length]], r.offset + got)
            except InterruptedError:
                continue
            except OSError as e:
                raise ClutorIOError(self.paths[r.file], r.offset, r.length, f"{e.strerror} (errno {e.errno})") from e
            if n == 0:
                return got  # end of file inside the request
            got += n
            if got < r.length:
                # Short but not empty: end of file, or an interrupted transfer worth retrying.
                if r.offset + got >= os.fstat(fd).st_size:
                    return got
                shorts += 1
                if shorts > _MAX_SHORT_RETRIES:
                    raise ClutorIOError(
                        self.paths[r.file], r.offset, r.length,
                        f"short read: {got} of {r.length} bytes after {shorts} attempts, not at end of file",
                    )
        return got

    def __repr__(self) -> str:
        return f"ThreadBackend(files={len(self.paths)}, direct={self.direct}, workers={self.workers})"
