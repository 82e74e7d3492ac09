"""The one seam between the expert store and the kernel: submit reads, await completions.

A backend owns a table of open files and a table of registered buffers (page-aligned memoryviews
into the arena, registered once at start-up because io_uring's Iovec pins a buffer forever).
A read names both by index and lands at the start of its buffer.

Ownership rule (the reason this protocol exists): once a read has been handed to the kernel the
buffer belongs to the kernel until that read's own completion arrives. Cancelling the awaiting task
does NOT end the read; ``ReadHandle.done`` (an asyncio Future the backend resolves itself, which
callers may only await through ``asyncio.shield`` or ``ReadHandle.wait``) tells when the buffer is
free again. Reads not yet handed to the kernel can be dropped with ``ReadHandle.drop()``.
"""
from __future__ import annotations

import asyncio
import enum
import errno
import os
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from clutor.errors import ClutorIOError

__all__ = ["ReadRequest", "ReadState", "ReadHandle", "Backend", "FileTable", "DEFAULT_ALIGN"]


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

    __slots__ = ("request", "state", "done", "__weakref__")

    def __init__(self, request: ReadRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.state = ReadState.QUEUED
        self.done: asyncio.Future[int] = loop.create_future()

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
