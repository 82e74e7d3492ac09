"""compute(): one thread for the whole process, each call's outcome handed back to its loop with one
wake-up; a cancelled caller still waits for its fn to return."""
from __future__ import annotations

import asyncio
import threading

import pytest

from conftest import run_on_loop

from clutor.model.compute import compute

run = run_on_loop


def test_results_errors_order_and_one_thread():
    """Every call runs on the same thread (clutor-compute, not the loop's), in the order sent; a result
    comes back as it was returned, an error as it was raised."""
    async def main():
        seen: list[tuple[int, int]] = []

        def job(i):
            seen.append((i, threading.get_ident()))
            return i * i

        def bad():
            raise KeyError("from the compute thread")

        out = await asyncio.gather(*(compute(job, i) for i in range(20)))
        with pytest.raises(KeyError, match="from the compute thread"):
            await compute(bad)
        name = await compute(lambda: threading.current_thread().name)
        return out, seen, name, threading.get_ident()

    out, seen, name, loop_thread = run(main)
    assert out == [i * i for i in range(20)]
    assert [i for i, _ in seen] == list(range(20))
    assert len({t for _, t in seen}) == 1 and seen[0][1] != loop_thread
    assert name == "clutor-compute"


def test_a_trip_costs_the_loop_one_threadsafe_wake_up_and_one_callback_more():
    """Per compute() call the compute thread wakes the loop once (call_soon_threadsafe) and the loop runs
    one more callback (the caller's wake-up): two in all. (run_in_executor's concurrent future, wrapped
    and shielded, took five: one threadsafe and four more.)"""
    async def main():
        loop = asyncio.get_running_loop()
        counts = {"threadsafe": 0, "soon": 0}
        threadsafe, soon = loop.call_soon_threadsafe, loop.call_soon

        def counting_threadsafe(cb, *args, **kw):
            counts["threadsafe"] += 1
            return threadsafe(cb, *args, **kw)

        def counting_soon(cb, *args, **kw):
            counts["soon"] += 1
            return soon(cb, *args, **kw)

        await compute(int)  # the thread started
        loop.call_soon_threadsafe, loop.call_soon = counting_threadsafe, counting_soon
        try:
            for _ in range(50):
                await compute(int)
        finally:
            loop.call_soon_threadsafe, loop.call_soon = threadsafe, soon
        return counts

    counts = run(main)
    assert counts["threadsafe"] == 50, counts
    assert counts["threadsafe"] + counts["soon"] <= 2 * 50, counts


def test_a_cancelled_caller_waits_for_fn_to_return_even_when_cancelled_again():
    """The caller cancelled (twice) while fn runs: on_cancel is called once, at the first cancellation;
    the CancelledError reaches the caller only after fn has returned; fn's result is dropped, and the
    next call runs normally."""
    async def main():
        started, release = threading.Event(), threading.Event()
        state = {"returned": False, "cancels": 0, "seen_after": None}

        def slow():
            started.set()
            release.wait(10)
            state["returned"] = True
            return "dropped"

        async def caller():
            try:
                return await compute(slow, on_cancel=lambda: state.__setitem__("cancels", state["cancels"] + 1))
            except asyncio.CancelledError:
                state["seen_after"] = state["returned"]
                raise

        task = asyncio.ensure_future(caller())
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        for _ in range(5):
            await asyncio.sleep(0.002)
        assert not task.done() and state["cancels"] == 1
        task.cancel()
        for _ in range(5):
            await asyncio.sleep(0.002)
        assert not task.done() and state["cancels"] == 1
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return state, await compute(lambda: "next")

    state, nxt = run(main)
    assert state == {"returned": True, "cancels": 1, "seen_after": True}
    assert nxt == "next"


def test_a_loop_gone_before_fn_returns_leaves_the_thread_serving():
    """A call whose loop has closed by the time fn returns: nothing is delivered, nothing raises on the
    compute thread, and a call from another loop is served after it."""
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(10)
        return 1

    loop = asyncio.new_event_loop()
    task = loop.create_task(compute(slow))
    loop.run_until_complete(asyncio.to_thread(started.wait, 10))
    task.cancel()  # not awaited: the loop goes away with fn still running
    loop.close()
    release.set()
    assert run(lambda: compute(lambda: 2)) == 2
