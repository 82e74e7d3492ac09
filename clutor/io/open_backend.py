"""Choose and open a read backend: io_uring when the machine allows it, else the thread pool.

io_uring comes through the PyPI liburing wheel where it runs, else through our own driver over the raw
system calls (clutor.io.uring_sys: x86_64, where the wheel's AVX-512 code dies with SIGILL on most CPUs);
both are named "uring", and ``.driver`` says which ("liburing" | "syscalls").

What really happened is on the result: ``.name`` ("uring" | "threads"), ``.direct`` (every file
O_DIRECT), ``.file_direct`` (per file), ``.align`` and ``.fallback_reason`` (why a file is read
through the page cache, or why io_uring was passed over under io="auto"; None when nothing fell back).

Alignment: 4096, or the device's logical block size from sysfs when that is larger (Python 3.11's
``os`` has no statx, so STATX_DIOALIGN is not asked). 4096 is a multiple of every common logical
block size and of the page size, hence always valid for O_DIRECT here.
"""
from __future__ import annotations

import os
from typing import Sequence

from clutor.errors import ClutorError
from clutor.io.backend import DEFAULT_ALIGN, Backend
from clutor.io.threads import ThreadBackend
from clutor.io.uring import UringBackend, UringUnavailable
from clutor.io.uring_sys import SyscallUringBackend

__all__ = ["open_backend", "IO_CHOICES", "DEFAULT_ALIGN"]

IO_CHOICES = ("auto", "uring", "threads")


def open_backend(
    files: Sequence[str | os.PathLike],
    buffers: Sequence[memoryview],
    *,
    io: str = "auto",
    direct: bool | None = True,
    entries: int = 256,
    workers: int = 4,
) -> Backend:
    """Open ``files`` for reads into ``buffers``. Call from inside the running event loop.

    ``direct=True`` (or None) asks for O_DIRECT and falls back per file to buffered reads where the
    filesystem refuses it; ``direct=False`` reads through the page cache (``io="auto"`` then takes the thread
    pool: page-cache hits are copies, which io_uring would run on the event loop). ``io="uring"`` fails with
    ClutorError (naming the reason) where io_uring is unavailable; ``io="auto"`` falls back to threads.
    """
    if io not in IO_CHOICES:
        raise ClutorError(f"io: expected one of {', '.join(IO_CHOICES)}, got {io!r}")
    want_direct = direct is not False
    uring_reason: str | None = None
    if io == "auto" and not want_direct:
        # Buffered reads mostly hit the page cache, and io_uring completes those inline: the copy runs in
        # the submitting thread, the event loop's. The pool copies on its workers instead (`clutor
        # bench-io --mode buffered`, AMD EPYC here: 4.9-6.6 GB/s at 10-38 ms of loop CPU per GiB, vs
        # io_uring 2.8-5.4 GB/s at 170-260 ms/GiB).
        backend = ThreadBackend(files, buffers, direct=False, workers=workers)
        return backend
    if io in ("auto", "uring"):
        try:
            return UringBackend(files, buffers, direct=want_direct, entries=entries)
        except UringUnavailable as err:
            uring_reason = str(err)
        try:
            return SyscallUringBackend(files, buffers, direct=want_direct, entries=entries)
        except UringUnavailable as err:
            uring_reason = f"{uring_reason}; {err}"
        if io == "uring":
            raise ClutorError(f"io='uring' requested but {uring_reason}")
    backend = ThreadBackend(files, buffers, direct=want_direct, workers=workers)
    if uring_reason is not None:
        reasons = [r for r in (uring_reason, backend.fallback_reason) if r]
        backend.fallback_reason = "; ".join(reasons)
    return backend
