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
import atexit
import os
import queue
import threading
from typing import Callable, TypeVar

__all__ = ["compute"]

R = TypeVar("R")

_NICE = 5  # the compute thread's niceness above the caller's
_lock = threading.Lock()
_jobs: "queue.SimpleQueue[_Job | None] | None" = None


class _Job:
    """One compute() call: fn(*args) for the compute thread, the caller's future, and (on the loop
    only) whether fn has returned and who waits for that after a cancellation."""

    __slots__ = ("loop", "fut", "fn", "args", "ended", "over")

    def __init__(self, loop: asyncio.AbstractEventLoop, fn, args):
        self.loop, self.fn, self.args = loop, fn, args
        self.fut = loop.create_future()
        self.ended = False
        self.over: asyncio.Future | None = None


def _queue() -> "queue.SimpleQueue[_Job | None]":
    global _jobs
    with _lock:
        if _jobs is None:
            jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
            t = threading.Thread(target=_serve, args=(jobs,), name="clutor-compute", daemon=True)
            t.start()
            atexit.register(_stop, jobs, t)  # at exit: the job running ends first, the rest are dropped
            _jobs = jobs
        return _jobs


def _stop(jobs: "queue.SimpleQueue[_Job | None]", t: threading.Thread) -> None:
    jobs.put(None)
    t.join()


def _serve(jobs: "queue.SimpleQueue[_Job | None]") -> None:
    """The compute thread: each job in the order sent, its outcome handed to its loop with one
    call_soon_threadsafe, the caller woken by the next callback (run_in_executor's concurrent future,
    wrapped in an asyncio one and shielded, cost the loop five callbacks a call and twice the time)."""
    _yield_to_the_loop()
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            result, err = job.fn(*job.args), None
        except BaseException as e:  # noqa: BLE001 - the caller's to handle, on its loop
            result, err = None, e
        try:
            job.loop.call_soon_threadsafe(_deliver, job, result, err)
        except RuntimeError:  # the caller's loop is closed: nobody is left to tell
            pass
        del job, result, err  # hold nothing of a finished job while waiting for the next


def _deliver(job: _Job, result, err: BaseException | None) -> None:
    """On the caller's loop: fn has returned (or raised)."""
    job.ended = True
    fut = job.fut
    if not fut.done():  # else the caller was cancelled: the outcome is dropped, as it asked
        if err is None:
            fut.set_result(result)
        else:
            fut.set_exception(err)
    if job.over is not None and not job.over.done():
        job.over.set_result(None)


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
    has returned. The cancellation is re-raised once it has (fn's result or error is dropped).
    on_cancel() (on the loop) is called first, for an fn that runs until told to stop (a lone
    sequence's decode loop)."""
    job = _Job(asyncio.get_running_loop(), fn, args)
    _queue().put(job)
    try:
        return await job.fut
    except asyncio.CancelledError:
        if job.ended:
            raise  # fn had returned already: nothing to wait for
        if on_cancel is not None:
            on_cancel()
        while not job.ended:
            if job.over is None or job.over.done():
                job.over = job.loop.create_future()
            try:
                await job.over
            except asyncio.CancelledError:
                continue
        raise
