"""Where the numbers are crunched: one compute thread per process, off the event loop.

The model's coroutines run on the caller's event loop and do only what a loop is for: submit expert
reads, take their completions, hand results on. Every numerical step (norms, attention, router,
expert products, sampling) is a plain function sent here with ``await compute(fn, *args)``; the loop
stays free while it runs (numpy and the numba kernels release the GIL).

One thread for the whole process, not one per model: the kernels already spread one product over
every core, and numba's "workqueue" threading layer aborts if two threads launch parallel kernels at
once. Work from several models or sequences therefore queues here in the order it was sent.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Callable, TypeVar

from .._util import watch_exit

__all__ = ["compute"]

R = TypeVar("R")

_NICE = 5  # the compute thread's niceness above the caller's
_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="clutor-compute",
                                                              initializer=_yield_to_the_loop)
            # A streamed step waits on this thread for the event loop to take its reads: when the
            # interpreter exits with its loop stopped mid-generation, that wait must end (the exit joins
            # this thread), so the store's waits watch for the exit.
            watch_exit()
        return _executor


def _yield_to_the_loop() -> None:
    """Lower this thread's scheduling priority a little (and that of the kernel worker threads it
    starts, which inherit it): when every core is busy computing, a waking event-loop thread then
    runs at once instead of queueing behind the compute, so the loop answers in milliseconds."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + _NICE))
    except (AttributeError, OSError):  # not Linux, or not permitted: only responsiveness suffers
        pass


async def compute(fn: Callable[..., R], *args, on_cancel: Callable[[], None] | None = None) -> R:
    """Run fn(*args) on the compute thread and return its result.

    Cancelling the caller does not abandon the work half-done: fn may be reading pinned expert
    slots or writing a KV cache, so the caller's cleanup (which releases those) must wait until fn
    has returned. The cancellation is re-raised once it has. on_cancel() (on the loop) is called
    first, for an fn that runs until told to stop (a lone sequence's decode loop)."""
    fut = asyncio.get_running_loop().run_in_executor(_pool(), fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue
            except BaseException:
                break
        if fut.done() and not fut.cancelled():
            fut.exception()  # retrieved: an error after cancellation is not logged as unhandled
        raise
