"""The server's admission: at most max_live running, max_queue waiting, first come first served, no slot lost."""
from __future__ import annotations

import asyncio

import pytest

from clutor.server.admission import Admission, QueueFull
from conftest import run


def test_fifo_queue_and_limit():
    async def main():
        a = Admission(max_live=2, max_queue=2)
        await a.acquire()
        await a.acquire()
        order = []

        async def waiter(i):
            await a.acquire()
            order.append(i)

        tasks = [asyncio.ensure_future(waiter(i)) for i in range(2)]
        await asyncio.sleep(0)
        assert a.queued == 2 and a.live == 2
        with pytest.raises(QueueFull) as e:
            await a.acquire()
        assert 1 <= e.value.retry_after <= 60
        a.release()
        a.release()
        await asyncio.gather(*tasks)
        assert order == [0, 1] and a.live == 2 and a.queued == 0
        a.release()
        a.release()
        assert a.live == 0

    run(main())


def test_cancelled_waiters_lose_no_slot():
    async def main():
        a = Admission(max_live=1, max_queue=5)
        await a.acquire()
        t1 = asyncio.ensure_future(a.acquire())
        t2 = asyncio.ensure_future(a.acquire())
        await asyncio.sleep(0)
        t1.cancel()  # left while queued: gone from the queue
        await asyncio.sleep(0)
        assert a.queued == 1
        a.release()  # handed to t2 ...
        t2.cancel()  # ... which is cancelled in the same step: it must pass the slot on
        with pytest.raises(asyncio.CancelledError):
            await t2
        assert a.live == 0 and a.queued == 0
        await asyncio.wait_for(a.acquire(), 1)
        assert a.live == 1

    run(main())


def test_queue_zero_refuses_at_once():
    async def main():
        a = Admission(max_live=1, max_queue=0)
        await a.acquire()
        with pytest.raises(QueueFull):
            await a.acquire()

    run(main())
