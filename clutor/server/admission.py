"""Admission: at most ``max_live`` generations run at once, at most ``max_queue`` wait, the rest get 429.

First come, first served. A waiter that is cancelled (its client left) gives up its place, and if the
slot had already been handed to it, passes the slot on, so no slot is ever lost.
"""
from __future__ import annotations

import asyncio
import math
from collections import deque

__all__ = ["Admission", "QueueFull"]


class QueueFull(Exception):
    """The queue is at its limit; ``retry_after`` is a whole number of seconds to suggest."""

    def __init__(self, retry_after: int):
        super().__init__(f"queue full, retry after {retry_after} s")
        self.retry_after = retry_after


class Admission:
    def __init__(self, max_live: int, max_queue: int):
        if max_live < 1 or max_queue < 0:
            raise ValueError(f"max_live must be >= 1 and max_queue >= 0, got {max_live}, {max_queue}")
        self.max_live = max_live
        self.max_queue = max_queue
        self.live = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._mean_seconds = 5.0  # running mean of a request's duration, for Retry-After

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.live < self.max_live and not self._waiters:
            self.live += 1
            return
        if len(self._waiters) >= self.max_queue:
            raise QueueFull(self.retry_after())
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # release() hands the slot over by resolving it (live stays counted)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot arrived together with the cancellation: pass it on
            else:
                self._waiters.remove(fut)
            raise

    def release(self, seconds: float | None = None) -> None:
        if seconds is not None:
            self._mean_seconds += 0.2 * (seconds - self._mean_seconds)
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.live -= 1

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the queue ahead drained max_live at a time."""
        waves = (len(self._waiters) + 1) / self.max_live
        return max(1, min(60, math.ceil(waves * self._mean_seconds)))
