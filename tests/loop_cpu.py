"""What the event loop's own thread spends on each callback, in CPU time (time.thread_time around
asyncio's Handle._run, through which every callback, task step and timer of a pure-asyncio loop runs).

Unlike the lateness of a ticker, this is not inflated by other processes taking the cores, nor by the
loop thread waiting for the GIL while the compute thread holds it: it is the work the code under test
puts on the loop, which is what an application embedding it feels as a blocked loop.

The heap the test process holds on entry is frozen (gc.freeze) until exit: a full garbage collection
walks every tracked object on whichever thread's allocation triggers it, and after a thousand tests
that walk takes 0.3-0.6 s of this machine's CPU (measured with gc.callbacks over the suite), charged
to one callback of the loop; the earlier tests' objects are not the code under test's work."""
from __future__ import annotations

import asyncio.events
import gc
import time

import numpy as np


class LoopCPU:
    """with LoopCPU() as m: ... then m.seconds (one entry per callback) and m.worst (what it ran)."""

    def __init__(self):
        self.seconds: list[float] = []
        self.worst = ""
        self._max = -1.0

    def __enter__(self) -> "LoopCPU":
        gc.collect()
        gc.freeze()
        self._orig = run = asyncio.events.Handle._run
        meter = self

        def timed(handle):
            t0 = time.thread_time()
            try:
                return run(handle)
            finally:
                dt = time.thread_time() - t0
                meter.seconds.append(dt)
                if dt > meter._max:
                    meter._max, meter.worst = dt, repr(handle)[:200]

        asyncio.events.Handle._run = timed
        return self

    def __exit__(self, *exc) -> None:
        asyncio.events.Handle._run = self._orig
        gc.unfreeze()

    def summary(self) -> str:
        a = np.array(self.seconds or [0.0])
        return (f"{len(self.seconds)} callbacks, loop-thread CPU per callback p99 {np.percentile(a, 99) * 1e3:.2f} ms, "
                f"max {a.max() * 1e3:.2f} ms ({self.worst}), total {a.sum() * 1e3:.0f} ms")
