"""Small helpers with no better home."""
from __future__ import annotations

import threading
from typing import Any, Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")


class AwaitableContext(Generic[T]):
    """``await f(...)`` or ``async with f(...) as x`` for a coroutine that opens something with aclose().

    The asyncpg-pool idiom: one call supports both forms, and the context form always closes."""

    __slots__ = ("_factory", "_obj")

    def __init__(self, factory: Callable[[], Awaitable[T]]):
        self._factory = factory
        self._obj: Any = None

    def __await__(self):
        return self._factory().__await__()

    async def __aenter__(self) -> T:
        self._obj = await self._factory()
        return self._obj

    async def __aexit__(self, *exc) -> None:
        obj, self._obj = self._obj, None
        if obj is not None:
            await obj.aclose()


_EXITING = threading.Event()
_EXIT_WATCHED: list = []


def watch_exit() -> None:
    """From now on, exiting() tells when the interpreter begins to exit. Call it after creating a thread
    pool that exit joins (concurrent.futures registers its join as it is imported): threading's exit
    hooks run newest first, so this flag is set before that join, which atexit's hooks are not."""
    if not _EXIT_WATCHED:
        _EXIT_WATCHED.append(True)
        try:
            threading._register_atexit(_EXITING.set)  # (3.9+; a private hook, hence the guard)
        except (AttributeError, RuntimeError):  # not there, or already exiting
            pass


def exiting() -> bool:
    """The interpreter has begun to exit (see watch_exit): a thread waiting for an event loop that is no
    longer run should give up, or the exit would wait for it forever."""
    return _EXITING.is_set()


_LIBC: list = []


def libc():
    """The C library through ctypes (its calls drop the GIL; errno kept for ctypes.get_errno), loaded once."""
    if not _LIBC:
        import ctypes

        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def open_regular(path: str, what: str) -> int:
    """A read-only fd of ``path`` (blocking, close-on-exec), or ModelFileError naming the file when it
    is missing, unreadable or not a regular file. O_NONBLOCK for the open itself: opening a FIFO for
    reading would otherwise wait for a writer before the regular-file check could refuse it."""
    import os
    import stat

    from .errors import ModelFileError

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ModelFileError(path, "file", f"an existing {what}", "missing") from None
    except OSError as e:
        raise ModelFileError(path, "file", f"a readable {what}", e.strerror or str(e)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ModelFileError(path, "file", f"a regular file ({what})",
                             "a directory" if stat.S_ISDIR(mode) else "not a regular file")
    os.set_blocking(fd, True)
    return fd


def sleeping_kernel_workers() -> None:
    """Called by Model.open and by the clutor command before any kernel runs (never on import): the
    thread pools of numba and OpenBLAS sleep between calls instead of spinning. Spinning workers keep
    the cores busy while the other pool, the event loop and other processes wait for them:
    - numba's OpenMP workers (OMP_WAIT_POLICY=PASSIVE): on a busy machine a product took many times
      longer. Takes effect before the process's first OpenMP launch.
    - OpenBLAS's threads spin for 2^28 cycles (~0.1 s) after each multi-threaded call; a prefill's
      attention products (numpy BLAS) then took a core from the expert kernels that followed, which
      ran at one core's speed (OPENBLAS_THREAD_TIMEOUT=4, OpenBLAS's minimum: 16 cycles). OpenBLAS
      reads it when it loads, i.e. at numpy's first import: the clutor command sets it first, an
      application that embeds Clutor sets it itself (README, "Python API").
    A value the application set wins. When numpy was imported before the variable was set (an
    application calling Model.open), one WARNING record of the ``clutor`` logger says so."""
    import os
    import sys

    global _blas_warned
    if "OPENBLAS_THREAD_TIMEOUT" not in os.environ and "numpy" in sys.modules and not _blas_warned:
        _blas_warned = True
        if _numpy_blas_is_openblas():
            import logging

            logging.getLogger("clutor").warning(
                "OPENBLAS_THREAD_TIMEOUT is unset and numpy is already loaded: OpenBLAS's threads will spin "
                "~0.1 s after each product and slow the kernels that follow (a prefill's experts up to 2x); "
                "set OPENBLAS_THREAD_TIMEOUT=4 in the environment before numpy is imported")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


_blas_warned = False


def _numpy_blas_is_openblas() -> bool:
    try:
        import numpy as np

        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return "openblas" in str(blas.get("name", "")).lower()
    except Exception:  # an older numpy without mode="dicts", or another layout: assume the common wheel
        return True


def cgroup_room() -> int | None:
    """Bytes this process's memory cgroup may still take (its limit less its usage; v1 or v2), or None
    where it has no limit or none can be read: /proc/meminfo's MemAvailable speaks of the host, which
    a container's or a benchmark's cap never lets the process have."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1
            files = (f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes", f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes")
        elif controllers == "":  # v2's unified hierarchy
            files = (f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current")
        else:
            continue
        try:
            with open(files[0]) as f:
                limit = f.read().strip()
            with open(files[1]) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            continue
        return max(0, int(limit) - usage)
    return None


def proc_bytes(path: str, key: str) -> int | None:
    """A ``KEY:  N kB`` field of a /proc file (``/proc/meminfo``, ``/proc/self/status``) in bytes, or
    None where the file or the field cannot be read (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
