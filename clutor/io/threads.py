"""Thread-pool read backend: ``os.preadv`` into the registered buffers from a few worker threads.

The portable fallback when io_uring is missing (no liburing wheel, kernel or seccomp refusal).
``os.preadv`` releases the GIL while the kernel copies, so a handful of threads keep a disk busy.

All state changes of a ReadHandle happen on the event loop thread: the loop decides which queued read
goes to a worker (QUEUED -> INFLIGHT), so ``drop()`` and hand-over never race; workers only read and
post the outcome back with ``call_soon_threadsafe``.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Sequence

from clutor.errors import ClutorIOError
from clutor.io.backend import MAX_SHORT_RETRIES, QueueBackend, ReadHandle, ReadRequest, ReadState

__all__ = ["ThreadBackend"]


class ThreadBackend(QueueBackend):
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
        self._open_tables(files, buffers, direct)
        self.workers = max(1, workers)
        # Two reads per worker handed over keeps every thread busy across the loop round trip that
        # hands it the next one; the rest wait on the loop side where drop() can still take them.
        self._max_handed = 2 * self.workers
        self._handed = 0
        self._jobs: queue.SimpleQueue[ReadHandle | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"clutor-io-{i}", daemon=True) for i in range(self.workers)
        ]
        for t in self._threads:
            t.start()

    # -- protocol -----------------------------------------------------------------------------
    def submit(self, requests: Sequence[ReadRequest]) -> list[ReadHandle]:
        handles = self._queue(requests)
        self._pump()
        return handles

    def inflight(self) -> int:
        return self._handed + sum(1 for h in self._pending if h.state is ReadState.QUEUED)

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
        self._resolve(h, nbytes, err)
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
                if shorts > MAX_SHORT_RETRIES:
                    raise ClutorIOError(
                        self.paths[r.file], r.offset, r.length,
                        f"short read: {got} of {r.length} bytes after {shorts} attempts, not at end of file",
                    )
        return got

    def __repr__(self) -> str:
        return f"ThreadBackend(files={len(self.paths)}, direct={self.direct}, workers={self.workers})"
