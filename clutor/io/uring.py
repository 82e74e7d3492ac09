"""io_uring read backends driven by the asyncio (or uvloop) event loop: what every driver of the ring
shares (``RingBackend``), and the driver over PyPI ``liburing`` (``UringBackend``; the one over raw
system calls is clutor.io.uring_sys).

What the wrapper forces on us (see shared notes/io-uring.md):

* Buffers go in as ``Iovec([memoryview])`` + ``io_uring_prep_readv``. An Iovec takes a buffer export it
  never releases, so every Iovec pins its memoryview for the life of the process. We build one per
  ``(buffer, start, length)`` actually used and cache it: reads of a given buffer come in a few lengths
  (one per slab size, or the block size of a benchmark), so the cache stays small; it is bounded by
  the number of aligned lengths a buffer can hold. ``start`` is non-zero only to finish a short read.
* Completions: a registered non-blocking eventfd watched with ``loop.add_reader``; on wake-up we take
  CQEs one at a time with ``io_uring_peek_cqe`` (reading ``cqe[i]`` for i > 0 is wrong here), copy
  ``user_data`` and ``res`` at once and mark the entry seen. Never ``io_uring_wait_cqe`` in a thread:
  it holds the GIL while it blocks.
* The CQ size cannot be chosen, so reads owned by the kernel are capped at the SQ size (``entries``);
  more wait in our queue, in order. Request ids are the indices of those ``entries`` slots, reused.
* A prep call that raises after ``io_uring_get_sqe`` leaves a half-made SQE that the next submit
  sends anyway, shifting every later completion. Everything is checked at ``submit()``, and the
  Iovec is fetched before the SQE is taken.
* Submissions are batched: ``submit()`` only queues and schedules one ``_flush`` per loop turn, which
  preps every SQE it can and calls ``io_uring_submit`` once.

Short reads: with O_DIRECT a read only comes back short at end of file. A short read is reported as
end-of-file (the byte count read) when ``offset + bytes`` reaches the file's size; otherwise the
remainder is resubmitted into the rest of the buffer (for an O_DIRECT file only when the bytes read
keep it aligned, else it fails) and after a few tries it fails with ClutorIOError.
"""
from __future__ import annotations

import errno
import os
from collections import deque
from typing import Any, Sequence

from clutor.errors import ClutorError, ClutorIOError
from clutor.io.backend import MAX_SHORT_RETRIES, QueueBackend, ReadHandle, ReadRequest, ReadState

__all__ = ["RingBackend", "UringBackend", "UringUnavailable"]

# Refusals that mean "no io_uring here" (kernel without it, sysctl io_uring_disabled, seccomp).
_UNAVAILABLE = (errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EOPNOTSUPP)

_SUBMIT_BATCH = 16  # reads handed to the kernel per loop turn (see _flush)


class UringUnavailable(ClutorError):
    """io_uring cannot be used on this machine; ``open_backend(io="auto")`` falls back to threads."""


# The liburing wheels on PyPI are built by Zig for a CPU with AVX-512: on one without it (AMD Zen 2/3,
# most Intel desktops) creating a ring dies with SIGILL, which no Python code can catch. So before the
# first use in a process the wrapper is exercised in a child process; if the child dies, io_uring is
# unavailable here and io="auto" reads with the thread pool instead (the report says why).
_PROBE = ("import liburing as L; r = L.Ring(); L.io_uring_queue_init(8, r); "
          "L.io_uring_queue_exit(r)")
_probe_result: str | None = None  # "" = the wrapper works here; else why not (one probe per process)


def _probe_liburing() -> str:
    global _probe_result
    if _probe_result is None:
        import signal
        import subprocess
        import sys

        try:
            p = subprocess.run([sys.executable, "-c", _PROBE], stdin=subprocess.DEVNULL, capture_output=True,
                               timeout=30, env={**os.environ, "PYTHONFAULTHANDLER": ""})
        except (OSError, subprocess.SubprocessError) as err:
            _probe_result = f"io_uring unavailable: probing liburing failed ({err})"
        else:
            if p.returncode == -signal.SIGILL:
                _probe_result = ("io_uring unavailable: the installed liburing wheel uses CPU instructions this "
                                 "CPU lacks (it was built for AVX-512) and dies with SIGILL")
            elif p.returncode < 0:
                _probe_result = f"io_uring unavailable: liburing killed its probe with signal {-p.returncode}"
            else:
                _probe_result = ""  # an OSError (ENOSYS, EPERM, ...) is met again, and classified, in __init__
    return _probe_result


def _import_liburing() -> Any:
    try:
        import liburing
    except ImportError as err:  # no wheel for this platform / Python
        raise UringUnavailable(f"io_uring unavailable: cannot import liburing ({err})") from err
    why = _probe_liburing()
    if why:
        raise UringUnavailable(why)
    return liburing


class RingBackend(QueueBackend):
    """What every io_uring backend shares, whatever drives the ring: request ids (indices of ``entries``
    slots, reused) so that reads owned by the kernel never exceed the SQ size (the CQ then never
    overflows), batched submission (``submit()`` queues; one ``_flush`` per loop turn preps what it can
    and submits once), completions from an eventfd watched by the loop, short reads finished or failed,
    and teardown only once the kernel owns nothing.

    A driver implements ``_prep(rid, fd, buf, start, length, offset) -> bool`` (one read into
    ``buffers[buf][start:start + length]``, False when the SQ is full), ``_enter()`` (hand what was
    prepped to the kernel), ``_reap() -> list[(rid, res)]`` (completions, negative res = -errno) and
    ``_close_ring()``; it sets ``self._efd`` (registered, non-blocking) and calls ``_start_ring`` once
    the ring exists."""

    name = "uring"

    def _init_slots(self, entries: int) -> None:
        self.entries = entries
        self._fds = self._files.fds
        # Per request id (index < entries): the handle, bytes already read, short-read retries.
        self._slot_handle: list[ReadHandle | None] = [None] * entries
        self._slot_got = [0] * entries
        self._slot_tries = [0] * entries
        self._free = list(range(entries - 1, -1, -1))
        self._retry: deque[int] = deque()  # request ids whose remainder must be resubmitted
        self._flush_scheduled = False
        self._ring_open = True

    def _start_ring(self) -> None:
        self._loop.add_reader(self._efd, self._on_event)

    # -- protocol -----------------------------------------------------------------------------
    def submit(self, requests: Sequence[ReadRequest]) -> list[ReadHandle]:
        handles = self._queue(requests)
        self._schedule_flush()
        return handles

    def inflight(self) -> int:
        owned = self.entries - len(self._free)
        return owned + sum(1 for h in self._pending if h.state is ReadState.QUEUED)

    # -- driver ---------------------------------------------------------------------------------
    def _prep(self, rid: int, fd: int, buf: int, start: int, length: int, offset: int) -> bool:
        raise NotImplementedError

    def _enter(self) -> None:
        raise NotImplementedError

    def _reap(self) -> list[tuple[int, int]]:
        raise NotImplementedError

    def _close_ring(self) -> None:
        raise NotImplementedError

    # -- submission ---------------------------------------------------------------------------
    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._ring_open:
            return
        fds = self._fds
        while self._retry:
            rid = self._retry[0]
            r = self._slot_handle[rid].request
            got = self._slot_got[rid]
            if not self._prep(rid, fds[r.file], r.buf, got, r.length - got, r.offset + got):
                break
            self._retry.popleft()
        pending, free, handles = self._pending, self._free, self._slot_handle
        QUEUED, INFLIGHT = ReadState.QUEUED, ReadState.INFLIGHT
        # A submit holds the event loop while the kernel takes each O_DIRECT read (pins its buffer,
        # builds its bios), so one layer of a batched step (over a hundred multi-MiB reads) in a single
        # submit holds the loop for all of them (README, "Batched engine"). So at most
        # _SUBMIT_BATCH reads go per loop turn; the rest follow after the loop's other callbacks.
        budget = _SUBMIT_BATCH - len(self._retry)
        while pending and free and budget > 0:
            h = pending[0]
            if h.state is not QUEUED or h.done.cancelled():
                pending.popleft()
                if h.state is QUEUED:  # its future was cancelled directly: same as drop()
                    h.state = ReadState.DROPPED
                continue
            r = h.request
            rid = free[-1]
            if not self._prep(rid, fds[r.file], r.buf, 0, r.length, r.offset):
                break
            pending.popleft()
            free.pop()
            handles[rid] = h
            self._slot_got[rid] = 0
            self._slot_tries[rid] = 0
            h.state = INFLIGHT
            budget -= 1
        if pending and free:  # the rest after other callbacks have run
            self._schedule_flush()
        self._enter()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    # -- completion ---------------------------------------------------------------------------
    def _on_event(self) -> None:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        if not self._ring_open:
            return
        done = self._reap()
        for rid, res in done:
            self._on_cqe(rid, res)
        if self._pending or self._retry:
            self._flush()
        if self._closed:
            self._maybe_finish()
        elif done:
            # Done-callbacks just scheduled by set_result run before this flush in the same loop
            # turn, so a read they submit in reply to a completion goes out without waiting a turn.
            self._schedule_flush()

    def _on_cqe(self, rid: int, res: int) -> None:
        h = self._slot_handle[rid]
        r = h.request
        if res < 0:
            reason = f"{os.strerror(-res)} (errno {-res})"
            self._finish(rid, 0, ClutorIOError(self.paths[r.file], r.offset, r.length, reason))
            return
        got = self._slot_got[rid] + res
        if got >= r.length or res == 0:  # complete, or nothing more: end of file
            self._finish(rid, got, None)
            return
        # Short read: end of file, or a transfer cut short that we finish ourselves.
        try:
            at_eof = r.offset + got >= self._files.size(r.file)
        except OSError as err:
            self._finish(rid, 0, ClutorIOError(self.paths[r.file], r.offset, r.length, f"fstat: {err.strerror}"))
            return
        if at_eof:
            self._finish(rid, got, None)
            return
        tries = self._slot_tries[rid] + 1
        misaligned = self.file_direct[r.file] and got % self.align
        if misaligned or tries > MAX_SHORT_RETRIES:
            why = "not block aligned" if misaligned else f"after {tries} attempts"
            reason = f"short read: {got} of {r.length} bytes, not at end of file ({why})"
            self._finish(rid, 0, ClutorIOError(self.paths[r.file], r.offset, r.length, reason))
            return
        self._slot_got[rid] = got
        self._slot_tries[rid] = tries
        self._retry.append(rid)

    def _finish(self, rid: int, nbytes: int, err: ClutorIOError | None) -> None:
        h = self._slot_handle[rid]
        self._slot_handle[rid] = None
        self._free.append(rid)
        self._resolve(h, nbytes, err)

    # -- teardown -----------------------------------------------------------------------------
    def _maybe_finish(self) -> None:
        if len(self._free) != self.entries or self._retry or self._drained is None or self._drained.done():
            return
        self._release()
        self._drained.set_result(None)

    def _release(self) -> None:
        """Free the ring, eventfd and files. Only once no read is owned by the kernel."""
        if getattr(self, "_efd", -1) >= 0:
            self._loop.remove_reader(self._efd)
        if getattr(self, "_ring_open", False):
            self._ring_open = False
            self._close_ring()
        if getattr(self, "_efd", -1) >= 0:
            efd, self._efd = self._efd, -1
            os.close(efd)
        self._files.close()


class UringBackend(RingBackend):
    """Backend protocol over one io_uring through PyPI ``liburing``. Construct inside the running event loop."""

    driver = "liburing"

    def __init__(
        self,
        files: Sequence[str | os.PathLike],
        buffers: Sequence[memoryview],
        *,
        direct: bool,
        entries: int = 256,
    ):
        L = self._L = _import_liburing()
        if not 1 <= entries <= 32768:  # 32768 is the largest ring the kernel accepts
            raise ValueError(f"UringBackend: entries must be in [1, 32768], got {entries}")
        self._ring: Any = None
        self._efd = -1
        self._open_tables(files, buffers, direct)
        self._init_slots(entries)
        self._ring_open = False
        try:
            ring = L.Ring()
            try:
                L.io_uring_queue_init(entries, ring)
            except OSError as err:
                if err.errno in _UNAVAILABLE:
                    raise UringUnavailable(f"io_uring unavailable: io_uring_queue_init: {err.strerror}") from err
                raise ClutorError(f"io_uring_queue_init({entries}) failed: {err}") from err
            self._ring = ring
            self._ring_open = True
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            L.io_uring_register_eventfd(ring, self._efd)
            self._start_ring()
        except BaseException:
            self._release()
            raise
        self._cqe = L.Cqe()
        self._iovecs: dict[tuple[int, int, int], Any] = {}
        self._pinned: list[memoryview] = []  # the memoryviews our Iovecs export (kept for clarity)

    # -- driver ---------------------------------------------------------------------------------
    def _iovec(self, buf: int, start: int, length: int) -> Any:
        key = (buf, start, length)
        iov = self._iovecs.get(key)
        if iov is None:
            mv = self._buffers[buf]
            if start or length != len(mv):
                mv = mv[start:start + length]
            iov = self._L.Iovec([mv])
            self._pinned.append(mv)
            self._iovecs[key] = iov
        return iov

    def _prep(self, rid: int, fd: int, buf: int, start: int, length: int, offset: int) -> bool:
        iov = self._iovec(buf, start, length)  # before the SQE: a failure must not leave a half-made one
        sqe = self._L.io_uring_get_sqe(self._ring)
        if sqe is None:
            return False
        self._L.io_uring_prep_readv(sqe, fd, iov, offset)
        sqe.user_data = rid
        return True

    def _enter(self) -> None:
        L, ring = self._L, self._ring
        ready = L.io_uring_sq_ready(ring)
        if ready:
            try:
                sent = L.io_uring_submit(ring)
            except OSError:  # EAGAIN/EBUSY/EINTR
                sent = 0
            if (sent or 0) < ready:
                # The rest stay in the SQ ring and go with the next submit; make sure there is one.
                self._loop.call_later(0.001, self._schedule_flush)

    def _reap(self) -> list[tuple[int, int]]:
        ring, cqe, L = self._ring, self._cqe, self._L
        peek, seen = L.io_uring_peek_cqe, L.io_uring_cqe_seen
        out = []
        while True:
            try:
                peek(ring, cqe)
            except BlockingIOError:
                break
            c = cqe[0]
            rid = c.user_data
            try:
                res = c.res
            except OSError as err:  # negative res arrives as an exception
                res = -(err.errno or errno.EIO)
            seen(ring, c)
            out.append((rid, res))
        return out

    def _close_ring(self) -> None:
        ring, self._ring = self._ring, None
        self._L.io_uring_queue_exit(ring)

    def __repr__(self) -> str:
        return f"UringBackend(files={len(self.paths)}, direct={self.direct}, entries={self.entries})"
