"""ExpertStore against every real backend: exact bytes, accounting, concurrency, cancellation, faults, close.

A probe wrapper around the backend records which buffers are owned by reads in flight (a second
read into a busy buffer is a violation), the order of submitted reads, and can hold completions back
behind a gate to make "read in flight" last as long as a test needs. Every test fails if the event
loop logged an exception.
"""
from __future__ import annotations

import asyncio
import os
import random

import numpy as np
import pytest

from conftest import resident_bytes, run_on_loop

from clutor.errors import BudgetError, ClosedError, ClutorIOError
from clutor.io.backend import ReadHandle
from faults import FaultyBackend, WrappedHandle
from clutor.io.layout import ExpertLayout, ExpertTensor
from clutor.io.open_backend import open_backend
from clutor.io.store import PREFETCH_DEPTH, ExpertStore, StoreStats
from clutor.model.source import ExpertSource

N_LAYERS, N_EXPERTS = 4, 8
SLAB = (5000, 5024, 7008)  # gate, up, down: none a multiple of the block size
IOS = ("threads", "uring")


# -- event loop with a recording exception handler: conftest.run_on_loop
run = run_on_loop


# -- a split model's expert tensors over two files, slabs at 32-byte but not block-aligned offsets --
class Model:
    def __init__(self, directory: str):
        rng = np.random.default_rng(99)
        paths = [os.path.join(directory, "m-00001.bin"), os.path.join(directory, "m-00002.bin")]
        sizes = {p: 0 for p in paths}
        layers = []
        for layer in range(N_LAYERS):
            path = paths[layer % 2]
            tensors = []
            for p, slab in enumerate(SLAB):
                offset = sizes[path] + 32 * (7 + 3 * layer + p)  # headers/padding between tensors
                tensors.append(ExpertTensor(path, offset, slab))
                sizes[path] = offset + slab * N_EXPERTS
            layers.append(tuple(tensors))
        self.data = {}
        for path in paths:  # each file ends exactly where its last slab ends: not block aligned
            self.data[path] = rng.integers(0, 256, size=sizes[path], dtype=np.uint8)
            self.data[path].tofile(path)
        self.layout = ExpertLayout(N_EXPERTS, tuple(layers))

    def expect(self, layer: int, expert: int) -> list[np.ndarray]:
        return [self.data[s.path][s.offset:s.offset + s.nbytes] for s in self.layout.slabs(layer, expert)]

    def matches(self, view) -> bool:
        return all(np.array_equal(a, b) for a, b in zip((view.gate, view.up, view.down), self.expect(view.layer, view.expert)))


def _direct_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("store"))
    probe = os.path.join(d, "probe")
    with open(probe, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        d = f"/var/tmp/clutor-store-test-{os.getpid()}"
        os.makedirs(d, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    return Model(_direct_dir(tmp_path_factory))


@pytest.fixture(params=IOS)
def io(request) -> str:
    if request.param == "uring":
        async def probe():
            try:
                b = open_backend([__file__], [], io="uring", direct=False)
            except Exception as e:  # noqa: BLE001 - any refusal means "skip on this machine"
                return str(e)
            await b.aclose()
            return None
        why = run(probe)
        if why:
            pytest.skip(f"io_uring unavailable here: {why}")
    return request.param


# -- probe backend wrapper -----------------------------------------------------------------------
class ProbeHandle(WrappedHandle):
    __slots__ = ("probe",)

    def __init__(self, inner: ReadHandle, probe: "Probe", loop):
        super().__init__(inner, loop)
        self.probe = probe

    def drop(self) -> bool:
        if not super().drop():
            return False
        self.probe.busy.discard(self.request.buf)  # never handed to the kernel: the buffer was never touched
        self.probe._open.discard(self)
        return True


class Probe:
    """Backend wrapper: ownership check, submit log, optional gate holding completions back."""

    def __init__(self, inner, gate: asyncio.Event | None = None):
        self.inner = inner
        self.name = inner.name
        self.direct = inner.direct
        self.align = inner.align
        self.paths = tuple(getattr(inner, "paths", ()))
        self.gate = gate
        self.busy: set[int] = set()
        self.violations: list[int] = []
        self.log: list = []  # requests in submit order
        self._loop = asyncio.get_running_loop()
        self._open: set[ProbeHandle] = set()
        self._tasks: set[asyncio.Task] = set()

    def submit(self, requests):
        for r in requests:
            if r.buf in self.busy:
                self.violations.append(r.buf)
        handles = self.inner.submit(requests)  # may raise: then nothing was queued
        out = []
        for h in handles:
            self.busy.add(h.request.buf)
            self.log.append(h.request)
            o = ProbeHandle(h, self, self._loop)
            self._open.add(o)
            h.done.add_done_callback(lambda f, o=o: self._inner_done(o, f))
            out.append(o)
        return out

    def _inner_done(self, o: ProbeHandle, f: asyncio.Future) -> None:
        if self.gate is not None and not self.gate.is_set() and not f.cancelled():
            t = self._loop.create_task(self._later(o, f))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        else:
            self._resolve(o, f)

    async def _later(self, o, f) -> None:
        await self.gate.wait()
        self._resolve(o, f)

    def _resolve(self, o: ProbeHandle, f: asyncio.Future) -> None:
        if o.done.done():
            return  # dropped: already accounted for
        self.busy.discard(o.request.buf)  # the buffer is free from the moment the caller hears of it
        self._open.discard(o)
        if f.cancelled():
            o.done.cancel()
            return
        elif f.exception() is not None:
            o.done.set_exception(f.exception())
        else:
            o.done.set_result(f.result())
        o.settled()

    def inflight(self) -> int:
        return len(self._open)

    async def aclose(self) -> None:
        await self.inner.aclose()
        while self._open:
            await asyncio.sleep(0.001)


def probe_factory(io: str, made: list, gate: asyncio.Event | None = None, fail=None):
    def factory(files, buffers):
        inner = open_backend(files, buffers, io=io, direct=True)
        b = Probe(inner, gate)
        made.append(b)
        return FaultyBackend(b, fail=fail) if fail is not None else b
    return factory


def slots_budget(store_slot_bytes: int, n: int) -> int:
    return store_slot_bytes * n


async def slot_bytes(model: Model) -> int:
    async with ExpertStore.open(model.layout, 1 << 30, io="threads") as s:
        return s.slot_bytes


async def settle(store: ExpertStore, probe: Probe | None = None) -> None:
    """Wait until no read is in flight anywhere."""
    for _ in range(5000):
        if store._outstanding == 0 and (probe is None or probe.inflight() == 0):
            return
        await asyncio.sleep(0.001)
    raise AssertionError("reads never drained")


def assert_consistent(store: ExpertStore, model: Model) -> None:
    """Nothing pinned, bookkeeping consistent, and every READY slot holds exactly its expert's bytes."""
    store.check()
    cache = store.cache
    for slot in range(store.n_slots):
        assert cache.pins(slot) == 0, f"slot {slot} still pinned"
        key = cache.key(slot)
        if key is not None and cache.resident(key):
            view = store._view(key[0], key[1], slot)
            assert model.matches(view), f"slot {slot} holds corrupt bytes for {key}"
    assert len(store._spares) == store.n_spare, "a spare buffer leaked"


def assert_stats_add_up(st: StoreStats) -> None:
    assert st.hits + st.misses == st.accesses
    assert st.staging_hits <= st.hits and st.bypass_reads <= st.misses and st.prefetch_late <= st.misses
    assert st.arena_bytes == (st.arena_bytes // st.slot_bytes) * st.slot_bytes


# -- tests -----------------------------------------------------------------------------------------
def test_exact_bytes_hits_misses_and_budget(model, io):
    async def main():
        sb = await slot_bytes(model)
        budget = sb * 20 + 123
        async with ExpertStore.open(model.layout, budget, io=io) as store:
            assert isinstance(store, ExpertSource)
            assert store.slot_bytes % 4096 == 0 and store.slot_bytes >= sum(SLAB)
            for layer in range(N_LAYERS):
                with await store.get(layer, [0, 7, 3, 3]) as batch:  # a duplicate is served twice
                    assert [v.expert for v in batch] == [0, 7, 3, 3]
                    for v in batch:
                        assert v.layer == layer and model.matches(v)
                        assert v.gate.dtype == np.uint8 and v.gate.shape == (SLAB[0],)
            st = store.stats()
            assert (st.accesses, st.hits, st.misses) == (12, 0, 12)
            assert st.bytes_demand >= 12 * sum(SLAB)
            assert store.resident(0, 7) and not store.resident(0, 1)
            batch = await store.get(2, [3, 1])
            assert model.matches(batch[0]) and model.matches(batch[1])
            batch.release()
            batch.release()  # idempotent
            st = store.stats()
            assert (st.accesses, st.hits, st.misses) == (14, 1, 13)
            assert st.backend == io and st.mode == "direct"
            assert st.arena_bytes <= budget and st.n_slots + store.n_spare == budget // st.slot_bytes
            assert_stats_add_up(st)
            assert_consistent(store, model)
    run(main)


def test_open_makes_the_cache_resident(model):
    """The slots' pages are faulted in by open(), off the loop: a cold slot's first O_DIRECT read then
    has no page to fault in inside its submit, on the event loop (clutor.io.arena.Arena.populate)."""
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("needs Linux's /proc/self/smaps")

    async def main():
        sb = await slot_bytes(model)
        async with ExpertStore.open(model.layout, 4 * sb, io="threads") as store:
            arena = store._arena
            assert resident_bytes(arena.slot(0).ctypes.data) >= arena.nbytes
    run(main)


def test_an_open_cancelled_while_populating_unmaps_only_after(model, io, monkeypatch):
    """Cancelling open() while its thread faults the arena in waits for that thread before the arena is
    closed (unmapping under it would crash the process), then the cancellation goes on."""
    import threading
    import time

    from clutor.io import arena as arena_mod

    events: list[str] = []
    started = threading.Event()
    populate, close = arena_mod.Arena.populate, arena_mod.Arena.close

    def slow_populate(self):
        started.set()
        time.sleep(0.3)  # the open is cancelled meanwhile
        populate(self)
        events.append("populated")

    def logged_close(self):
        events.append("closed")
        close(self)

    async def main():
        sb = await slot_bytes(model)
        monkeypatch.setattr(arena_mod.Arena, "populate", slow_populate)
        monkeypatch.setattr(arena_mod.Arena, "close", logged_close)
        task = asyncio.ensure_future(ExpertStore.open(model.layout, 4 * sb, io=io))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert events == ["populated", "closed"], events
    run(main)


def test_budget_errors(model):
    async def main():
        sb = await slot_bytes(model)
        with pytest.raises(BudgetError) as e:
            await ExpertStore.open(model.layout, sb - 1, io="threads")
        assert str(sb) in str(e.value)  # states the minimum
        store = await ExpertStore.open(model.layout, 3 * sb, io="threads")
        assert (store.n_slots, store.n_spare) == (2, 1)
        with pytest.raises(BudgetError):
            await store.get(0, [0, 1, 2, 3])  # 4 distinct experts, 3 buffers in all
        with pytest.raises(IndexError):
            await store.get(N_LAYERS, [0])
        with pytest.raises(IndexError):
            store.prefetch(0, [N_EXPERTS])
        await store.aclose()
    run(main)


def test_bypass_when_all_pinned_and_waiting_when_spares_are_gone(model, io):
    async def main():
        sb = await slot_bytes(model)
        made: list[Probe] = []
        async with ExpertStore.open(model.layout, 5 * sb, backend=probe_factory(io, made)) as store:
            assert (store.n_slots, store.n_spare) == (4, 1)
            held = await store.get(0, [0, 1, 2, 3])  # every slot pinned
            extra = await store.get(1, [5])          # goes to the spare
            assert model.matches(extra[0]) and store.stats().bypass_reads == 1
            assert not store.resident(1, 5)
            # Slots pinned and the spare in use: the next get must wait for a release.
            waiter = asyncio.ensure_future(store.get(2, [6]))
            for _ in range(20):
                await asyncio.sleep(0.002)
            assert not waiter.done()
            extra.release()
            third = await asyncio.wait_for(waiter, 10)
            assert model.matches(third[0]) and store.stats().bypass_reads == 2
            third.release()
            for v in held:  # the bypassed reads never disturbed the pinned slots
                assert model.matches(v)
            held.release()
            again = await store.get(1, [5])  # now it gets a slot
            again.release()
            st = store.stats()
            assert st.bypass_reads == 2 and st.arena_bytes <= 5 * sb
            assert_stats_add_up(st)
            await settle(store, made[0])
            assert_consistent(store, model)
            assert not made[0].violations
    run(main)


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_concurrent_overlapping_gets(model, io, loop_kind):
    async def main():
        sb = await slot_bytes(model)
        made: list[Probe] = []
        async with ExpertStore.open(model.layout, 12 * sb, policy="lrfu", backend=probe_factory(io, made)) as store:
            errors = []

            async def worker(seed: int):
                rng = random.Random(seed)
                for _ in range(15):
                    layer = rng.randrange(N_LAYERS)
                    experts = rng.sample(range(N_EXPERTS), 3)
                    with await store.get(layer, experts) as batch:
                        await asyncio.sleep(rng.random() * 0.002)
                        for v in batch:
                            if not model.matches(v):
                                errors.append((layer, v.expert))

            await asyncio.gather(*(worker(i) for i in range(24)))
            assert not errors
            st = store.stats()
            assert st.accesses == 24 * 15 * 3 and st.evictions > 0 and st.hits > 0
            assert_stats_add_up(st)
            await settle(store, made[0])
            assert_consistent(store, model)
            assert not made[0].violations
    run(main, loop_kind)


def test_takes_from_other_threads_beside_gets_on_the_loop(model, io):
    """take() from two threads other than the loop's (as the compute thread calls it), each computing on
    its views a while, beside get()s and prefetches on the loop: exact bytes, every expert asked for handed
    out once, no buffer read into while in use, the bookkeeping consistent at the end; take() on the loop's
    own thread is refused (it blocks)."""
    import threading
    import time

    from clutor.errors import ClutorError

    async def main():
        sb = await slot_bytes(model)
        made: list[Probe] = []
        async with ExpertStore.open(model.layout, 12 * sb, policy="lrfu", backend=probe_factory(io, made)) as store:
            with pytest.raises(ClutorError, match="thread other than the event loop"):
                store.take(0, [1])
            errors: list = []
            threads: set[int] = set()

            def taker(seed: int) -> None:
                threads.add(threading.get_ident())
                rng = random.Random(seed)
                for _ in range(60):
                    layer = rng.randrange(N_LAYERS)
                    experts = rng.sample(range(N_EXPERTS), 3)
                    if rng.random() < 0.3:
                        store.prefetch(rng.randrange(N_LAYERS), rng.sample(range(N_EXPERTS), 2))
                    got: list[int] = []
                    with store.take(layer, experts) as groups:
                        for group in groups:
                            time.sleep(rng.random() * 0.001)
                            got += [v.expert for v in group]
                            errors.extend((layer, v.expert) for v in group if not model.matches(v))
                    if sorted(got) != sorted(experts):
                        errors.append(("handed out", layer, experts, got))

            async def getter(seed: int) -> None:
                rng = random.Random(100 + seed)
                for _ in range(20):
                    layer = rng.randrange(N_LAYERS)
                    with await store.get(layer, rng.sample(range(N_EXPERTS), 3)) as batch:
                        await asyncio.sleep(rng.random() * 0.002)
                        errors.extend((layer, v.expert) for v in batch if not model.matches(v))

            await asyncio.gather(asyncio.to_thread(taker, 1), asyncio.to_thread(taker, 2),
                                 *(getter(i) for i in range(6)))
            assert not errors, errors[:5]
            assert len(threads) == 2 and threading.get_ident() not in threads
            st = store.stats()
            assert st.accesses == 2 * 60 * 3 + 6 * 20 * 3 and st.hits > 0 and st.evictions > 0
            assert_stats_add_up(st)
            await settle(store, made[0])
            assert_consistent(store, model)
            assert not made[0].violations
    run(main)


def test_cancellation_at_random_moments(model, io):
    async def main():
        sb = await slot_bytes(model)
        made: list[Probe] = []
        rng = random.Random(2024)
        async with ExpertStore.open(model.layout, 7 * sb, backend=probe_factory(io, made)) as store:
            probe = made[0]
            cancelled = completed = kept = 0
            for round_ in range(1000):
                layer = rng.randrange(N_LAYERS)
                experts = rng.sample(range(N_EXPERTS), rng.randint(1, 4))
                if rng.random() < 0.3:
                    store.prefetch(rng.randrange(N_LAYERS), rng.sample(range(N_EXPERTS), 2))
                task = asyncio.ensure_future(store.get(layer, experts))
                for _ in range(rng.randrange(6)):
                    await asyncio.sleep(0)
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.random() * 0.001)
                cancel = rng.random() < 0.75
                if cancel:
                    task.cancel()
                else:
                    kept += 1
                try:
                    batch = await task
                except asyncio.CancelledError:
                    cancelled += 1
                else:
                    completed += 1
                    assert all(model.matches(v) for v in batch)
                    batch.release()
                store.check()
                if round_ % 100 == 99:
                    await settle(store, probe)
                    assert_consistent(store, model)
            await settle(store, probe)
            assert_consistent(store, model)
            assert not probe.violations, f"buffers reused while a read was in flight: {probe.violations[:5]}"
            assert cancelled > 100 and completed >= kept > 150, (cancelled, completed, kept)
            assert_stats_add_up(store.stats())
    run(main)


def test_read_errors_fail_callers_and_store_stays_usable(model, io):
    async def main():
        sb = await slot_bytes(model)
        made: list[Probe] = []
        bad = model.layout.slabs(1, 4)[1]  # the up slab of layer 1 expert 4
        state = {"mode": "error"}

        def fail(req):
            aligned = bad.offset - bad.offset % 4096
            if state["mode"] and req.offset == aligned and made[0].paths[req.file] == bad.path:
                return "injected EIO" if state["mode"] == "error" else "short"
            return None

        async with ExpertStore.open(model.layout, 8 * sb, backend=probe_factory(io, made, fail=fail)) as store:
            # Two callers wait on the same failing read; both get the error; the get's other experts are fine.
            results = await asyncio.gather(store.get(1, [4, 2]), store.get(1, [4]), return_exceptions=True)
            for r in results:
                assert isinstance(r, ClutorIOError), r
                assert r.path == bad.path and "injected EIO" in str(r) and "layer 1 expert 4 up" in str(r)
            assert not store.resident(1, 4)
            await settle(store, made[0])
            assert_consistent(store, model)
            assert store.resident(1, 2)  # the other read of the failed get completed normally
            state["mode"] = "short"
            with pytest.raises(ClutorIOError) as e:
                await store.get(1, [4])
            assert "short read" in str(e.value) and e.value.offset == bad.offset and e.value.length == bad.nbytes
            state["mode"] = None
            with await store.get(1, [4, 2]) as batch:
                assert all(model.matches(v) for v in batch)
            await settle(store, made[0])
            assert_consistent(store, model)
            assert_stats_add_up(store.stats())
    run(main)


def test_aclose_waits_for_reads_in_flight(model, io):
    async def main():
        sb = await slot_bytes(model)
        made: list[Probe] = []
        gate = asyncio.Event()
        store = await ExpertStore.open(model.layout, 10 * sb, prefetch_slots=6, backend=probe_factory(io, made, gate))
        probe = made[0]
        getter = asyncio.ensure_future(store.get(0, [1, 2]))
        cancelled_getter = asyncio.ensure_future(store.get(3, [5]))
        store.prefetch(2, [0, 1, 2, 3, 4, 5])
        for _ in range(200):
            await asyncio.sleep(0.001)
            if len(probe.log) >= 9 and probe.inflight() == len(probe.log):
                break
        cancelled_getter.cancel()
        closer = asyncio.ensure_future(store.aclose())
        for _ in range(20):
            await asyncio.sleep(0.002)
        assert not closer.done(), "aclose returned with reads in flight"
        assert probe.inflight() > 0
        with pytest.raises(ClosedError):
            await store.get(0, [1])
        with pytest.raises(ClosedError):
            store.prefetch(0, [1])
        gate.set()
        await asyncio.wait_for(closer, 10)
        assert probe.inflight() == 0 and not probe.violations
        batch = await getter  # its reads completed before the arena went away
        assert [v.expert for v in batch] == [1, 2]
        batch.release()  # releasing after close is harmless
        with pytest.raises(asyncio.CancelledError):
            await cancelled_getter
        await store.aclose()  # idempotent
        st = store.stats()
        assert st.prefetch_issued == 6 and st.prefetch_wasted >= 6 - PREFETCH_DEPTH
    run(main)


def test_prefetch_staging_hits_late_and_wasted(model, io):
    async def main():
        sb = await slot_bytes(model)
        made: list[Probe] = []
        gate = asyncio.Event()
        gate.set()
        store = await ExpertStore.open(model.layout, 16 * sb, prefetch_slots=10, backend=probe_factory(io, made, gate))
        try:
            probe = made[0]
            # Completed prefetch, then demand: staging hits.
            store.prefetch(1, [1, 2])
            await settle(store, probe)
            assert store.resident(1, 1) and store.resident(1, 2)
            with await store.get(1, [1, 2, 3]) as batch:
                assert all(model.matches(v) for v in batch)
            st = store.stats()
            assert (st.hits, st.staging_hits, st.misses, st.prefetch_issued) == (2, 2, 1, 2)
            assert st.bytes_prefetch >= 2 * sum(SLAB)
            # Prefetch still in flight when demanded: late (a miss), the bytes are still right.
            gate.clear()
            store.prefetch(2, [4])
            await asyncio.sleep(0.01)
            late = asyncio.ensure_future(store.get(2, [4]))
            await asyncio.sleep(0.01)
            assert not late.done()
            gate.set()
            with await late as batch:
                assert model.matches(batch[0])
            st = store.stats()
            assert st.prefetch_late == 1 and st.staging_hits == 2
            # Demand goes first: with the prefetch queue full, a get's reads are submitted before the
            # prefetches still waiting in the store.
            gate.clear()
            store.prefetch(3, list(range(8)))
            n_before = len(probe.log)
            assert n_before > 0
            assert n_before == 3 * (2 + 1 + 1 + PREFETCH_DEPTH)  # the other 4 prefetches wait in the store
            task = asyncio.ensure_future(store.get(0, [6]))
            await asyncio.sleep(0.01)
            wanted = {(s.path, s.offset - s.offset % 4096) for s in model.layout.slabs(0, 6)}
            newer = [(probe.paths[r.file], r.offset) for r in probe.log[n_before:]]
            assert set(newer[:3]) == wanted, "a prefetch read was submitted before the demand batch"
            # Superseded before submission: a new prefetch of layer 3 drops the queued reads it no longer wants.
            store.prefetch(3, [0])
            store.check()
            gate.set()
            (await task).release()
            await settle(store, probe)
            st = store.stats()
            assert st.prefetch_issued == 2 + 1 + 8
            assert st.prefetch_wasted >= 8 - 1 - PREFETCH_DEPTH  # the queued ones were dropped
            # A get of layer 3 ends its prefetch; what it did not use stays as an ordinary entry.
            with await store.get(3, [0]) as batch:
                assert model.matches(batch[0])
            assert not any(store.cache.staged(s) for s in range(store.n_slots))
            await settle(store, probe)
            assert_consistent(store, model)
            assert_stats_add_up(store.stats())
            assert not probe.violations
        finally:
            gate.set()  # a failed assertion must not leave reads held back: aclose would wait forever
            await store.aclose()
    run(main)


def test_prefetch_waits_while_a_demand_read_is_in_flight(model, io):
    """A prefetch never shares the disk with a demand read it could delay: queued while one is in
    flight, handed to the backend when the last demand read completes (PREFETCH_DEPTH at a time)."""
    async def main():
        sb = await slot_bytes(model)
        made: list[Probe] = []
        gate = asyncio.Event()
        store = await ExpertStore.open(model.layout, 16 * sb, prefetch_slots=8, backend=probe_factory(io, made, gate))
        try:
            probe = made[0]
            batches = store.get_ready(0, [1, 2])
            first = asyncio.ensure_future(batches.__anext__())  # reserves, submits, then awaits the reads
            await asyncio.sleep(0.01)
            assert len(probe.log) == 2 * 3 and not first.done()
            store.prefetch(1, [3, 4, 5, 6, 7])
            await asyncio.sleep(0.01)
            assert len(probe.log) == 2 * 3, "a prefetch read went to the backend beside a demand read"
            assert store.stats().prefetch_issued == 5 and store.stats().bytes_prefetch == 0
            gate.set()
            got = [await first]
            async for views in batches:
                got.append(views)
            assert sorted(v.expert for g in got for v in g) == [1, 2]
            await asyncio.sleep(0.01)
            # Demand over: the queue goes, demand's reads first in the log, then the prefetches in order.
            await settle(store, probe)
            prefetched = [(probe.paths[r.file], r.offset) for r in probe.log[2 * 3:]]
            expect = [(s.path, s.offset - s.offset % 4096) for e in (3, 4, 5, 6, 7) for s in model.layout.slabs(1, e)]
            assert prefetched == expect
            # A get that hits everything submits nothing and lets a new prefetch go at once.
            gate.clear()
            with await store.get(1, [3]) as batch:
                assert model.matches(batch[0])
            n = len(probe.log)
            store.prefetch(2, [0])
            assert len(probe.log) == n + 3
            gate.set()
            await settle(store, probe)
            assert_consistent(store, model)
            assert_stats_add_up(store.stats())
            assert not probe.violations
        finally:
            gate.set()
            await store.aclose()
    run(main)


def test_prefetch_gives_way_to_demand_when_slots_run_out(model, io):
    async def main():
        sb = await slot_bytes(model)
        made: list[Probe] = []
        gate = asyncio.Event()
        store = await ExpertStore.open(model.layout, 7 * sb, prefetch_slots=6, backend=probe_factory(io, made, gate))
        try:
            assert (store.n_slots, store.n_spare) == (6, 1)
            store.prefetch(2, [0, 1, 2, 3, 4, 5])  # every slot staged: 4 reads submitted, 2 still queued
            # Demand outranks prefetch: the 2 queued prefetches give up their slots, the third miss
            # (every other slot has a prefetch read in flight) goes to the spare.
            task = asyncio.ensure_future(store.get(0, [5, 6, 7]))
            await asyncio.sleep(0.01)
            st = store.stats()
            assert st.bypass_reads == 1 and st.prefetch_wasted == 2
            gate.set()
            with await task as batch:
                assert all(model.matches(v) for v in batch)
            await settle(store, made[0])
            # Ordinary entries are evicted first ((0, 5) and (0, 6)); then a completed but unused
            # prefetch gives way too, rather than the get bypassing.
            with await store.get(1, [0, 1, 2]) as batch:
                assert all(model.matches(v) for v in batch)
            st = store.stats()
            assert st.bypass_reads == 1 and st.evictions >= 2 and st.prefetch_wasted == 2 + 1
            await settle(store, made[0])
            assert_consistent(store, model)
            assert not made[0].violations
        finally:
            gate.set()
            await store.aclose()
    run(main)


def test_open_as_context_manager_and_closed_errors(model):
    async def main():
        async with ExpertStore.open(model.layout, 1 << 20, io="threads", direct=False) as store:
            assert store.stats().mode == "buffered"
            with await store.get(0, [0]) as b:
                assert model.matches(b[0])
        assert store.closed
        with pytest.raises(ClosedError):
            await store.get(0, [0])
    run(main)


def test_hint_reaches_the_policy_reads_nothing_and_is_checked(model):
    from clutor.io.policies import Forecast

    async def main():
        sb = await slot_bytes(model)
        policy = Forecast()
        async with ExpertStore.open(model.layout, 12 * sb, policy=policy, io="threads", direct=False) as store:
            with await store.get(0, [0, 1]):
                pass
            before = store.stats()
            store.hint(1, [2, 5])
            assert policy._hinted[1].nonzero()[0].tolist() == [2, 5]  # the policy has it
            after = store.stats()
            assert (after.accesses, after.bytes_demand, after.bytes_prefetch) == (
                before.accesses, before.bytes_demand, before.bytes_prefetch)  # no read, no access
            assert not store.resident(1, 2)
            with pytest.raises(IndexError):
                store.hint(N_LAYERS, [0])
            with pytest.raises(IndexError):
                store.hint(0, [N_EXPERTS])
            store.check()
        with pytest.raises(ClosedError):
            store.hint(0, [0])
    run(main)


def test_get_ready_yields_cached_first_exact_bytes_and_releases(model, io):
    async def main():
        sb = await slot_bytes(model)
        made: list[Probe] = []
        bad = model.layout.slabs(2, 6)[2]

        def fail(req):
            aligned = bad.offset - bad.offset % 4096
            return "injected EIO" if req.offset == aligned and made[0].paths[req.file] == bad.path else None

        async with ExpertStore.open(model.layout, 12 * sb, backend=probe_factory(io, made, fail=fail)) as store:
            with await store.get(1, [5]):
                pass
            groups = [[v.expert for v in g] async for g in _checked(store.get_ready(1, [3, 5, 3, 0]), model)]
            assert groups[0] == [5]  # the cached one first, alone: the others are still being read
            got = [e for g in groups for e in g]
            assert sorted(got) == [0, 3, 5]  # each distinct expert once
            assert all(g == [e for e in (3, 0) if e in g] for g in groups[1:])  # request order within a group
            st = store.stats()
            assert (st.accesses, st.hits, st.misses) == (4, 1, 3)
            # all cached: one group, in request order
            groups = [[v.expert for v in g] async for g in _checked(store.get_ready(1, [0, 5, 3]), model)]
            assert groups == [[0, 5, 3]]
            # leaving early releases every pin, reads in flight included
            each = store.get_ready(1, [1, 2])
            first = await each.__anext__()
            assert first and all(model.matches(v) for v in first)
            await each.aclose()
            # a failing read ends the iteration with its error; the store stays usable
            with pytest.raises(ClutorIOError):
                async for g in store.get_ready(2, [6, 1]):
                    assert all(model.matches(v) for v in g)
            await settle(store, made[0])
            assert_consistent(store, model)
            with await store.get(2, [1]) as batch:
                assert model.matches(batch[0])
            assert_stats_add_up(store.stats())
    run(main)


async def _checked(groups, model):
    async for group in groups:
        assert group and all(model.matches(view) for view in group)
        yield group


def test_loop_callbacks_and_cpu_per_expert_read(model, io):
    """What the event loop's thread runs for each expert read (tests/loop_cpu.py): its three reads'
    completions are taken in the backend's own callback (ReadHandle.notify, not a done-callback per
    read) and a get_ready iteration wakes once per group it yields (no shield or asyncio.wait per
    expert). Counted, not timed: at most 2 callbacks per expert with io_uring (the eventfd wake-up
    takes every completion; then the iteration's wake-up), 6 with threads (each read's hand-back from
    its worker is a callback of its own; measured 4.5-4.9); before, 7.5-11. The CPU bound is loose (a few times
    what this costs here) and only catches a cost that grows with something it should not."""
    from loop_cpu import LoopCPU

    async def main():
        sb = await slot_bytes(model)
        async with ExpertStore.open(model.layout, 6 * sb, io=io, policy="lrfu") as store:
            rng = np.random.default_rng(0)
            picks = [(i % N_LAYERS, rng.choice(N_EXPERTS, 2, replace=False).tolist()) for i in range(240)]

            async def gets(part):
                for layer, experts in part:
                    async for group in store.get_ready(layer, experts):
                        assert all(model.matches(v) for v in group)

            await gets(picks[:40])  # warm: the cache full, evicting on every miss from here
            before = store.stats()
            with LoopCPU() as meter:
                await gets(picks[40:])
            st = store.stats()
            await settle(store)
            assert_consistent(store, model)
        loads = st.misses - before.misses
        return loads, len(meter.seconds), sum(meter.seconds)

    loads, callbacks, cpu = run(main)
    figures = f"{io}: {loads} expert reads, {callbacks} loop callbacks, {1e6 * cpu / max(loads, 1):.0f} us of loop CPU each"
    assert loads >= 200, figures  # mostly misses: 6 slots for 32 experts
    assert callbacks <= (2 if io == "uring" else 6) * loads, figures
    assert cpu <= 0.002 * loads, figures
