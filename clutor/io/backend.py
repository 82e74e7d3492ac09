"""The one seam between the expert store and the kernel: submit reads, await completions.

A backend owns a table of open files and a table of registered buffers (page-aligned memoryviews
into the arena, registered once at start-up because io_uring's Iovec pins a buffer forever).
A read names both by index and lands at the start of its buffer.

Ownership rule (the reason this protocol exists): once a read has been handed to the kernel the
buffer belongs to the kernel until that read's own completion arrives. Cancelling the awaiting task
does NOT end the read; ``ReadHandle.done`` (an asyncio Future the backend resolves itself, which
callers may only await through ``asyncio.shield`` or ``ReadHandle.wait``) tells when the buffer is
free again. Reads not yet handed to the kernel can be dropped with ``ReadHandle.drop()``.

Completion hook: a caller may set ``ReadHandle.notify`` to a function of the handle; the backend calls it
on the loop thread right after it resolves ``done`` (ok, error, or dropped at close; never for the
caller's own ``drop()``), in the same callback that took the completion. A done-callback on the future
would cost the loop one more callback per read, and a store reads three or six per expert.
"""
from __future__ import annotations

import asyncio
import enum
import errno
import os
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from clutor.errors import ClosedError, ClutorIOError

__all__ = ["ReadRequest", "ReadState", "ReadHandle", "Backend", "FileTable", "DEFAULT_ALIGN", "QueueBackend",
           "check_requests", "check_buffers"]


@dataclass(frozen=True, slots=True)
class ReadRequest:
    file: int    # index into the backend's file table
    offset: int  # byte offset in the file; a multiple of the file's alignment when opened O_DIRECT
    length: int  # bytes to read into buffer[buf][:length]; aligned likewise when direct
    buf: int     # index into the backend's registered buffers


class ReadState(enum.Enum):
    QUEUED = "queued"      # waiting in the backend; drop() still possible
    INFLIGHT = "inflight"  # the kernel (or a worker thread) owns the buffer
    DONE = "done"          # completed (ok or error); buffer free
    DROPPED = "dropped"    # removed before submission; buffer never touched


class ReadHandle:
    """One submitted read. ``done`` resolves to the byte count read, or to a ClutorIOError."""

    __slots__ = ("request", "state", "done", "notify", "__weakref__")

    def __init__(self, request: ReadRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.state = ReadState.QUEUED
        self.done: asyncio.Future[int] = loop.create_future()
        self.notify: Callable[["ReadHandle"], None] | None = None  # see the module doc

    def settled(self) -> None:
        """``done`` has just been resolved by the backend (or a wrapper): tell ``notify``. An error it
        raises goes to the loop's exception handler, never into the backend's completion path."""
        notify = self.notify
        if notify is not None:
            try:
                notify(self)
            except Exception as err:  # noqa: BLE001 - the backend must go on taking completions
                asyncio.get_running_loop().call_exception_handler(
                    {"message": "ReadHandle.notify raised", "exception": err, "handle": self})

    def drop(self) -> bool:
        """Withdraw a read the kernel has not seen yet. Returns False (and does nothing) otherwise."""
        if self.state is not ReadState.QUEUED:
            return False
        self.state = ReadState.DROPPED
        if not self.done.done():
            self.done.cancel()
        return True

    async def wait(self) -> int:
        """Await completion; cancelling the caller never cancels the read itself."""
        return await asyncio.shield(self.done)


@runtime_checkable
class Backend(Protocol):
    name: str      # "uring" | "threads" | wrapper names
    direct: bool   # True when files are open with O_DIRECT
    align: int     # required alignment of offset, length and buffer address when direct (else 1)

    def submit(self, requests: Sequence[ReadRequest]) -> list[ReadHandle]:
        """Queue reads in the given order (demand before prefetch is the caller's job). Never blocks."""
        ...

    def inflight(self) -> int:
        """Reads queued or owned by the kernel."""
        ...

    async def aclose(self) -> None:
        """Stop accepting reads, wait until every read handed to the kernel has completed, release resources."""
        ...


# 4096 is a multiple of every logical block size in common use (512, 4096) and of the page size, so
# it satisfies O_DIRECT's offset, length and address rules without asking the device; larger is
# taken only when sysfs reports a larger logical block.
DEFAULT_ALIGN = 4096

# A read cut short away from end of file is resubmitted for its remainder this many times, then fails.
MAX_SHORT_RETRIES = 3


def _logical_block_size(fd: int) -> int:
    """The device's logical block size from sysfs (partitions read their parent's queue), or 0."""
    dev = os.fstat(fd).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for path in (f"{base}/queue/logical_block_size", f"{base}/../queue/logical_block_size"):
        try:
            with open(path) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            continue
    return 0


class FileTable:
    """The backend's files, opened read-only; O_DIRECT per file when asked and the filesystem allows.

    ``direct`` is True only when every file is O_DIRECT; ``file_direct`` says which are;
    ``fallback_reason`` says why some are not; ``align`` is what O_DIRECT files need (1 if none).
    """

    def __init__(self, paths: Sequence[str | os.PathLike], *, direct: bool):
        self.paths = tuple(os.fspath(p) for p in paths)
        self.fds: list[int] = []
        file_direct: list[bool] = []
        reasons: list[str] = []
        try:
            for path in self.paths:
                fd, is_direct, reason = self._open(path, direct)
                self.fds.append(fd)
                file_direct.append(is_direct)
                if reason:
                    reasons.append(reason)
        except BaseException:
            self.close()
            raise
        self.file_direct = tuple(file_direct)
        self.direct = direct and all(file_direct)
        self.fallback_reason = "; ".join(reasons) or None
        block = max((_logical_block_size(fd) for fd, d in zip(self.fds, file_direct) if d), default=0)
        self.align = max(DEFAULT_ALIGN, block) if any(file_direct) else 1

    @staticmethod
    def _open(path: str, direct: bool) -> tuple[int, bool, str | None]:
        flags = os.O_RDONLY | os.O_CLOEXEC
        if direct:
            try:
                return os.open(path, flags | os.O_DIRECT), True, None
            except OSError as err:
                if err.errno != errno.EINVAL:  # EINVAL = this filesystem refuses O_DIRECT
                    raise ClutorIOError(path, 0, 0, f"cannot open: {err.strerror}") from err
                reason = f"{path}: O_DIRECT refused by the filesystem ({err.strerror}); reading through the page cache"
        else:
            reason = None
        try:
            return os.open(path, flags), False, reason
        except OSError as err:
            raise ClutorIOError(path, 0, 0, f"cannot open: {err.strerror}") from err

    def size(self, i: int) -> int:
        return os.fstat(self.fds[i]).st_size

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


def check_requests(files: FileTable, buffers: Sequence[memoryview], requests: Sequence[ReadRequest]) -> None:
    """Reject a malformed batch before any of it is queued."""
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


class QueueBackend:
    """What the io_uring and thread-pool backends share: the file and buffer tables, the queue of reads
    not yet handed over (where ``drop()`` still works), resolving a read, and closing. A subclass
    hands queued reads on in ``submit`` and releases its resources in ``_maybe_finish`` once
    ``_drained`` is set and nothing it handed over is left."""

    name: str

    def _open_tables(self, files: Sequence[str | os.PathLike], buffers: Sequence[memoryview], direct: bool) -> None:
        """Open the files and check the buffers (closing the files again if a buffer is refused)."""
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
        self._pending: deque[ReadHandle] = deque()  # not yet handed over; drop() works
        self._closed = False
        self._drained: asyncio.Future[None] | None = None

    def _queue(self, requests: Sequence[ReadRequest]) -> list[ReadHandle]:
        """Check a batch and queue it: the first half of ``submit``."""
        if self._closed:
            raise ClosedError(f"{type(self).__name__}: submit() after aclose()")
        check_requests(self._files, self._buffers, requests)
        handles = [ReadHandle(r, self._loop) for r in requests]
        self._pending.extend(handles)
        return handles

    @staticmethod
    def _resolve(h: ReadHandle, nbytes: int, err: ClutorIOError | None) -> None:
        h.state = ReadState.DONE
        if not h.done.done():
            if err is None:
                h.done.set_result(nbytes)
            else:
                h.done.set_exception(err)
            h.settled()

    async def aclose(self) -> None:
        """Drop what is still queued, then wait for every read already handed over (the kernel or a
        worker owns its buffer until it completes)."""
        if not self._closed:
            self._closed = True
            self._drained = self._loop.create_future()
            while self._pending:
                h = self._pending.popleft()
                if h.state is ReadState.QUEUED:
                    h.state = ReadState.DROPPED
                    if not h.done.done():
                        h.done.set_exception(ClosedError(f"{type(self).__name__} closed before this read was started"))
                        h.done.exception()  # nobody may be waiting; do not log "never retrieved"
                        h.settled()
            self._maybe_finish()
        await asyncio.shield(self._drained)

    def _maybe_finish(self) -> None:
        raise NotImplementedError
