"""ExpertStore: routed experts streamed from disk into a byte-bounded cache.

Composes an Arena (one page-aligned mapping of ``n_slots`` expert slots + one spare buffer), a
read Backend (io_uring or a thread pool), and an ExpertCache with a replacement policy::

    store = await ExpertStore.open(layout, budget=3 << 30, policy="lrfu")
    with await store.get(layer, expert_ids) as batch:   # views into the arena, pinned
        ...compute with batch[i].gate / .up / .down...
    store.prefetch(layer + 1, predicted_ids)             # never blocks

    with store.take(layer, expert_ids) as groups:        # from another thread (the model's compute thread):
        for views in groups:                             # the cached experts at once, then the reads as they
            ...                                          # arrive; blocks between groups, never the loop

Threads: the backend belongs to the event loop (submissions and completions happen there); everything
else may be called from any thread, under one lock (``_mu``). A take() pins its cached experts on its
own thread with no turn of the loop, hands its misses to the loop to submit, and is woken (a condition
on the same lock) as their completions are taken.

Memory: ``slot_bytes`` is the largest expert with each of its 3 slabs widened to block alignment,
and ``(n_slots + n_spare) * slot_bytes <= budget`` always; nothing else grows with the model.

Ordering: the misses of one get() go to the backend as ONE batch (one read per slab: 3 per expert, 6 with biases), ahead of any
prefetch read the backend has not started (those are withdrawn and re-queued behind). Prefetches
use only an idle disk: none is handed to the backend while a demand read is in flight (a read the
device has started cannot be withdrawn, and it shares the bandwidth with the demand beside it), and
at most ``PREFETCH_DEPTH`` prefetched experts at a time, so a demand read never shares the disk with
more than that.

Prefetch lifetime (the rule): a layer's prefetch lasts until the next ``get()`` of that layer, the
next ``prefetch()`` of that layer, or ``cancel_prefetch(layer)``. Then each expert it brought that was
not demanded is given up: dropped if its read was not yet handed to the backend, otherwise left as
an ordinary cache entry (its bytes are valid; the policy decides) instead of a protected staged one.
A prefetched expert that leaves the cache without serving a demand counts as wasted.

Ownership: a slot whose read is in flight belongs to the backend until that read's completion,
whatever happens to the task that wanted it; completions are handled by callbacks, not by the
awaiting task, so a cancelled get() leaves a normal READY entry behind.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

import numpy as np

from .._util import AwaitableContext, exiting
from ..errors import BudgetError, ClosedError, ClutorError, ClutorIOError, ExpertReadError
from ..units import format_bytes
from .arena import Arena, round_up, widen
from .backend import DEFAULT_ALIGN, Backend, ReadHandle, ReadRequest, ReadState
from .cache import ExpertCache, Grant, SlotState
from .layout import PARTS, ExpertLayout
from .policies import Policy, make_policy
from .views import ExpertBatch, ExpertView

__all__ = ["ExpertStore", "StoreStats", "Taken", "BackendFactory", "PREFETCH_DEPTH", "split_slots"]

# Opens a backend over (files, buffers); the default calls open_backend with the store's io/direct.
BackendFactory = Callable[[Sequence[str], Sequence[memoryview]], Backend]

PREFETCH_DEPTH = 4  # prefetched experts handed to the backend at once (3 or 6 reads each)
# Spare buffers for bypass reads, carved out of the budget. One: a step's get() holds one layer's
# chunk of experts pinned (the runner's _max_batch: half the buffers, or top-k if that is more) and a
# get may steal the slots prefetch staged, so a miss nearly always finds an evictable slot; the spare is
# for the get() that does not (a budget of about top-k experts, concurrent gets of the store's own API).
# Every buffer beyond it caches: at 25% of wide.gguf's experts, 31 slots instead of 28 (4 spares).
_SPARES = 1


@dataclass(frozen=True)
class StoreStats:
    accesses: int        # experts asked for by get() (a duplicate within one call counts once)
    hits: int            # ... found READY: no wait
    staging_hits: int    # ... of which the first use of a completed prefetch
    misses: int          # ... that waited for a read: their own, another caller's, or a late prefetch
    bypass_reads: int    # ... of which read into a spare buffer because every slot was pinned or loading
    prefetch_issued: int  # experts queued for prefetch
    prefetch_late: int   # prefetched experts demanded before their read had finished (counted in misses)
    prefetch_wasted: int  # prefetched experts dropped or evicted without serving any demand
    prefetch_skipped: int  # prefetch requests refused: no slot could be staged
    evictions: int       # entries the policy evicted to make room (staged prefetches given up count as wasted)
    bytes_demand: int    # bytes read for get() (aligned reads, as transferred)
    bytes_prefetch: int  # bytes read for prefetch()
    read_seconds: float  # sum over reads of submit-to-completion time
    wait_seconds: float  # time get() callers spent awaiting reads
    backend: str         # "uring" | "threads" | a wrapper's name
    mode: str            # "direct" (O_DIRECT) | "buffered" (page cache)
    n_slots: int
    slot_bytes: int
    arena_bytes: int     # slots + spares; never more than the budget

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def split_slots(n_total: int, spare_slots: int | None = None) -> tuple[int, int]:
    """How the store divides ``n_total`` expert-sized buffers: (cache slots, spare buffers for bypass).

    Spares default to one (_SPARES), and never the last buffer."""
    if n_total <= 1:
        return max(n_total, 0), 0
    n_spare = min(_SPARES if spare_slots is None else max(0, spare_slots), n_total - 1)
    return n_total - n_spare, n_spare


class _Counters:
    __slots__ = (
        "accesses", "hits", "staging_hits", "misses", "bypass_reads", "prefetch_issued", "prefetch_late",
        "prefetch_skipped", "bytes_demand", "bytes_prefetch", "read_seconds", "wait_seconds",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


@dataclass(frozen=True, slots=True)
class _Part:
    """One slab's read: aligned bounds in its file, and where the wanted bytes sit in the buffer."""

    file: int      # index into layout.files
    offset: int    # aligned read offset
    length: int    # aligned read length
    skip: int      # the slab starts this many bytes into the buffer
    nbytes: int    # slab length
    slab_offset: int


@dataclass(frozen=True)
class _Geometry:
    align: int
    region: tuple[int, ...]  # bytes reserved in a slot for each part: gate, up, down[, biases] (multiples of align)
    start: tuple[int, ...]   # where each region starts inside the slot
    slot_bytes: int


def _max_skip(offset: int, step: int, n: int, align: int) -> int:
    """Largest (offset + e * step) % align over experts e < n: how far into its first aligned block
    an expert's slab may start (step: bytes from one expert's slab to the next). The skips repeat
    with period align / gcd(step, align), so this looks at no more than that many experts (none at
    all once n covers a whole period), never at all n."""
    g = math.gcd(step % align, align) or align
    period = align // g
    if n >= period:
        return offset % g + align - g  # every value congruent to offset mod g below align occurs
    e = np.arange(n, dtype=np.int64)  # [n], n < period <= align
    return int(((offset % align + e * (step % align)) % align).max())


def _geometry(layout: ExpertLayout, align: int) -> _Geometry:
    region = [0] * layout.n_parts
    seen: set[tuple[int, int, int, int]] = set()  # (part, offset % align, step % align, slab) measured
    for tensors in layout.layers:
        for p, t in enumerate(tensors):
            if t.slab_bytes <= 0:
                raise ClutorError(f"{t.path}: expert slab of {t.slab_bytes} bytes at offset {t.offset}")
            key = (p, t.offset % align, t.step % align, t.slab_bytes)
            if key in seen:
                continue
            seen.add(key)
            skip = _max_skip(t.offset, t.step, layout.n_experts, align)
            region[p] = max(region[p], round_up(skip + t.slab_bytes, align))
    start = tuple(sum(region[:p]) for p in range(len(region)))
    return _Geometry(align, tuple(region), start, sum(region))


def slot_bytes(layout: ExpertLayout, align: int = DEFAULT_ALIGN) -> int:
    """Arena bytes one expert slot takes for this layout: what a budget is divided by."""
    return _geometry(layout, align).slot_bytes


class _Load:
    """One expert being read into a slot (or a spare): one read per part. Nothing in it belongs to a
    thread: whoever waits for it registers a waiter, told (under the store's lock) when it is over."""

    __slots__ = ("key", "slot", "spare", "prefetch", "handles", "remaining", "error", "over", "dropped", "released",
                 "waiters")

    def __init__(self, key, slot: int | None, spare: int | None, prefetch: bool):
        self.key = key
        self.slot = slot
        self.spare = spare
        self.prefetch = prefetch       # still a prefetch (not promoted by a demand)
        self.handles: list[ReadHandle] | None = None  # None until handed to the backend
        self.remaining = 0             # reads submitted and not yet completed
        self.error: BaseException | None = None
        self.over = False              # every read completed (ok or not), or the load was dropped unread
        self.dropped = False           # ... dropped: a queued prefetch withdrawn, never read
        self.released = False          # (spare loads) the batch that owns the spare let go of it
        self.waiters: list[Callable[["_Load"], None]] = []  # told once when it is over


class _Arrivals:
    """The loads one get waits for, collected as each ends (``_finish`` tells it, under the store's
    lock), so the getter wakes once per group of loads that ended together, whatever their number.
    Made and read under the store's lock."""

    __slots__ = ("keys", "arrived", "left", "pending", "wake")

    def __init__(self, loads: list[_Load], wake: Callable[[], None]):
        self.keys = {load.key for load in loads}  # what the get waits for
        self.arrived: list[_Load] = []
        self.left = len(loads)       # loads not yet taken
        self.pending: list[_Load] = []  # the loads it waits for that were not over when it was made
        self.wake = wake
        for load in loads:
            if load.over:
                self.arrived.append(load)
            else:
                load.waiters.append(self._arrive)
                self.pending.append(load)

    def _arrive(self, load: _Load) -> None:
        self.arrived.append(load)
        self.wake()

    def take(self) -> set[tuple[int, int]]:
        """The keys of the loads arrived since the last take; raises the first one's failure."""
        group, self.arrived = self.arrived, []
        self.left -= len(group)
        for load in group:
            if load.dropped:
                raise ClosedError(f"the read of layer {load.key[0]} expert {load.key[1]} was withdrawn")
            if load.error is not None:
                raise load.error
        return {load.key for load in group}

    def detach(self) -> None:
        for load in self.pending:
            if not load.over and self._arrive in load.waiters:
                load.waiters.remove(self._arrive)


class _LoopWaker:
    """Wakes a get() or get_ready() awaiting on the event loop; called by whichever thread ends its load."""

    __slots__ = ("future", "_loop", "_thread")

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: int):
        self.future: asyncio.Future[None] | None = None  # set by the getter before each wait
        self._loop, self._thread = loop, thread

    def __call__(self) -> None:
        fut = self.future
        if fut is None or fut.done():
            return
        if threading.get_ident() == self._thread:
            fut.set_result(None)
        else:
            self._loop.call_soon_threadsafe(_set_pending, fut)


def _set_pending(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Taken:
    """The groups of one ExpertStore.take(): an iterator of lists of views (first the cached experts,
    then each group of reads that completed together) that blocks this thread until the next group is
    in. The views stay valid until ``close()``, which releases them (``with`` closes too)."""

    __slots__ = ("_store", "_layer", "_views", "_arrivals", "_release", "_first", "_open")

    def __init__(self, store: "ExpertStore", layer: int, views: dict[int, ExpertView], arrivals: "_Arrivals",
                 release: Callable[[], None]):
        self._store, self._layer, self._views = store, layer, views
        self._arrivals, self._release = arrivals, release
        self._first = True
        self._open = True

    def __iter__(self) -> "Taken":
        return self

    def __next__(self) -> list[ExpertView]:
        store, arrivals = self._store, self._arrivals
        if self._first:
            self._first = False
            with store._mu:
                ready = store._cached(self._layer, self._views, arrivals)
            if ready:
                return ready
        if not arrivals.left:
            raise StopIteration
        with store._mu:
            if not arrivals.arrived:
                t0 = time.perf_counter()
                try:
                    while not arrivals.arrived:
                        store._wait_locked()
                finally:
                    store._c.wait_seconds += time.perf_counter() - t0
            keys = arrivals.take()
        return store._in_order(self._layer, self._views, keys)

    def close(self) -> None:
        store = self._store
        with store._mu:
            if not self._open:
                return
            self._open = False
            self._arrivals.detach()
            self._release()
            store._takers -= 1
            store._check_drained()

    def __enter__(self) -> "Taken":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class _Placed:
    """What one get() holds and reads (see ExpertStore._place)."""

    slots: list[int] = field(default_factory=list)        # pinned slots to unpin at release
    spares: list[_Load] = field(default_factory=list)     # spare loads to give back at release
    where: dict[tuple[int, int], int] = field(default_factory=dict)  # key -> arena buffer holding it
    wait: list[_Load] = field(default_factory=list)       # reads to wait for
    submit: list[_Load] = field(default_factory=list)     # reads to submit now


class ExpertStore:
    """The disk-streaming ExpertSource. Build with ``await ExpertStore.open(...)``."""

    @classmethod
    def open(
        cls,
        layout: ExpertLayout,
        budget: int,
        *,
        policy: str | Policy = "lru",
        io: str = "auto",
        direct: bool = True,
        prefetch_slots: int | None = None,
        spare_slots: int | None = None,
        backend: BackendFactory | None = None,
    ) -> AwaitableContext["ExpertStore"]:
        """Open a store over ``layout`` holding at most ``budget`` bytes of experts.

        ``policy``: a name from clutor.io.policies.POLICIES or a Policy instance. ``io``/``direct``
        are passed to open_backend; ``backend`` replaces it by a factory ``(files, buffers) -> Backend``
        (tests wrap a real backend this way). ``prefetch_slots``: most slots prefetches may hold at
        once (default a quarter of the slots; 0 turns prefetch off). ``spare_slots``: buffers for
        bypass reads, taken from the budget (default 1).
        Raises BudgetError when the budget does not hold one expert.
        """
        return AwaitableContext(lambda: cls._open(layout, budget, policy, io, direct, prefetch_slots, spare_slots, backend))

    @classmethod
    async def _open(cls, layout, budget, policy, io, direct, prefetch_slots, spare_slots, backend) -> "ExpertStore":
        if backend is None:
            from .open_backend import open_backend  # imported late: it pulls in liburing when present

            def backend(files, buffers):
                return open_backend(files, buffers, io=io, direct=direct)

        files = layout.files
        align = DEFAULT_ALIGN
        for _ in range(2):
            geo = _geometry(layout, align)
            n_total = budget // geo.slot_bytes
            if n_total < 1:
                raise BudgetError(
                    f"expert cache budget of {budget} bytes ({format_bytes(budget)}) holds no expert: "
                    f"the largest expert needs a slot of {geo.slot_bytes} bytes ({format_bytes(geo.slot_bytes)}); "
                    f"the minimum budget is {geo.slot_bytes} bytes"
                )
            n_slots, n_spare = split_slots(n_total, spare_slots)
            arena = Arena(n_slots, geo.slot_bytes, n_spare=n_spare, align=align)
            try:
                buffers = [
                    arena.region(i, geo.start[p], geo.region[p]) for i in range(arena.n_buffers)
                    for p in range(len(geo.region))
                ]
                be = backend(files, buffers)
            except BaseException:
                arena.close()
                raise
            if be.align <= align and align % be.align == 0:
                break
            # A device with blocks larger than we assumed: lay the slots out again for its alignment.
            await be.aclose()
            arena.close()
            align = be.align
        else:
            raise ClutorError(f"{files[0]}: backend alignment {be.align} not met after re-layout")
        populating = asyncio.get_running_loop().run_in_executor(None, arena.populate)
        try:
            await asyncio.shield(populating)
        except BaseException:
            # cancelled (or failed): never unmap the arena while the thread may still be touching it
            while not populating.done():
                try:
                    await asyncio.shield(populating)
                except BaseException:
                    continue
            await be.aclose()
            arena.close()
            raise
        return cls(layout, budget, geo, arena, be, policy, prefetch_slots)

    def __init__(self, layout, budget, geo: _Geometry, arena: Arena, backend: Backend, policy, prefetch_slots):
        # Use ExpertStore.open(); this wires already-opened parts together.
        self.layout = layout
        self.budget = budget
        self.backend = backend
        self._geo = geo
        self._arena = arena
        self._loop = asyncio.get_running_loop()
        self.n_slots = arena.n_slots
        self.n_spare = arena.n_spare
        self.slot_bytes = geo.slot_bytes
        self._n_parts = len(geo.region)
        staging = self.n_slots // 4 if prefetch_slots is None else prefetch_slots
        self.cache = ExpertCache(self.n_slots, make_policy(policy, self.n_slots), max_staging=staging)
        self._paths = layout.files  # (computed from every layer's tensors: looked up once)
        self._files = {path: i for i, path in enumerate(self._paths)}
        self._parts: dict[tuple[int, int], tuple[_Part, _Part, _Part]] = {}
        self._loads: dict[int, _Load] = {}            # slot -> load while the slot is LOADING
        self._pf: dict[int, dict[tuple[int, int], _Load]] = {}  # layer -> its prefetches not yet demanded
        self._pq: deque[_Load] = deque()               # prefetches not yet handed to the backend
        self._pf_submitted: set[_Load] = set()          # prefetches handed to the backend, not finished
        self._spares = list(range(self.n_spare - 1, -1, -1))
        self._outstanding = 0                          # loads with reads submitted and not finished
        self._drained: asyncio.Future[None] | None = None
        self._freed = asyncio.Event()                  # something was released: a waiting get() may retry
        self._c = _Counters()
        self._views: dict[int, ExpertView] = {}  # arena buffer -> the view last made of it (see _view)
        self._closed = False
        # take() runs on another thread (the compute thread) beside the loop's completions: one lock
        # over all of the store's state, and one condition for whatever waits on another thread
        self._mu = threading.RLock()
        self._cv = threading.Condition(self._mu)
        self._loop_thread = threading.get_ident()
        self._posted: set[_Load] = set()  # demand loads handed to the loop to submit, not yet submitted
        self._pump_posted = False
        self._takers = 0  # take() iterations open (their views may be in use on another thread)
        self._freed_waiting = 0  # get()s on the loop waiting for a slot to come free

    # -- ExpertSource ----------------------------------------------------------------------------
    async def get(self, layer: int, experts: Sequence[int]) -> ExpertBatch:
        """The experts' bytes as views into the arena, pinned until ``batch.release()``."""
        views, arrivals, release = await self._begin(layer, experts, self._loop_waker())
        try:
            while arrivals.left:
                await self._next_arrivals(arrivals)
        except BaseException:
            with self._mu:
                arrivals.detach()
                release()
            raise
        return ExpertBatch([views[int(e)] for e in experts], release)

    async def get_ready(self, layer: int, experts: Sequence[int]) -> AsyncIterator[list[ExpertView]]:
        """Like get() (reserved and submitted as one batch), but yields the distinct experts in groups
        as their bytes arrive: first every cached one, then the reads that completed together, so the
        caller computes (one kernel launch per group) while the rest is read. Views stay valid until
        the iteration ends or the generator is closed; then all are released."""
        views, arrivals, release = await self._begin(layer, experts, self._loop_waker())
        try:
            ready = self._cached(layer, views, arrivals)
            if ready:
                yield ready
            while arrivals.left:
                yield self._in_order(layer, views, await self._next_arrivals(arrivals))
        finally:
            with self._mu:
                arrivals.detach()
                release()

    def take(self, layer: int, experts: Sequence[int]) -> "Taken":
        """get_ready() for a thread other than the event loop's (the compute thread's layer loop): the
        same groups, from an iterator that blocks between them. A cached expert is pinned and handed
        out here with no turn of the event loop; the misses' reads go to the loop to be submitted (the
        backend is the loop's) and their completions wake this thread. ``close()`` (or ``with``)
        releases the views."""
        if threading.get_ident() == self._loop_thread:
            raise ClutorError("ExpertStore.take() blocks: call it from a thread other than the event loop's")
        with self._mu:
            self._check_open()
            keys = self._keys(layer, experts)
            self._check_fits(keys)
            while (got := self._try_begin(layer, experts, keys, self._cv.notify_all)) is None:
                self._wait_locked()  # every slot and spare held by other callers: until a release
            self._takers += 1
        return Taken(self, layer, *got)

    def _wait_locked(self) -> None:
        """Block this (non-loop) thread, the lock held, until a load ends or a get releases; checked
        twice a second for a closed store, and for an event loop that will never run again (closed, or
        the interpreter exiting with the loop stopped: its exit waits for this thread)."""
        if self._cv.wait(0.5):
            return
        if self._loop.is_closed() or exiting():
            raise ClosedError("the event loop that owns the expert store has closed"
                              if self._loop.is_closed() else "the interpreter is exiting with its event loop stopped")
        self._check_open()

    @staticmethod
    def _cached(layer: int, views: dict[int, ExpertView], arrivals: _Arrivals) -> list[ExpertView]:
        """The views not waiting for a read: the first group a get yields."""
        return [view for e, view in views.items() if (layer, e) not in arrivals.keys]

    @staticmethod
    def _in_order(layer: int, views: dict[int, ExpertView], keys: set[tuple[int, int]]) -> list[ExpertView]:
        # in request order, so a group's order does not depend on completion order
        return [views[e] for e in views if (layer, e) in keys]

    async def _next_arrivals(self, arrivals: _Arrivals) -> set[tuple[int, int]]:
        """The keys of the loads ended since the last call (on the loop), waiting for one if none has."""
        with self._mu:
            if arrivals.arrived:
                return arrivals.take()
            wake = arrivals.wake.future = self._loop.create_future()
        t0 = time.perf_counter()
        try:
            await wake
        finally:
            with self._mu:  # (a take on another thread adds to it too)
                self._c.wait_seconds += time.perf_counter() - t0
        with self._mu:
            return arrivals.take()

    def _loop_waker(self) -> "_LoopWaker":
        return _LoopWaker(self._loop, self._loop_thread)

    async def _begin(self, layer: int, experts: Sequence[int], wake: Callable[[], None]):
        """(On the loop) reserve slots for the experts (hits pinned, misses placed) and submit the misses
        as one batch, waiting while other callers hold every slot and spare. Returns ({expert: view},
        the _Arrivals of the loads to wait for, release callback)."""
        with self._mu:
            self._check_open()
            keys = self._keys(layer, experts)
            self._check_fits(keys)
        while True:
            with self._mu:
                self._check_open()
                self._freed.clear()
                got = self._try_begin(layer, experts, keys, wake)
                if got is not None:
                    return got
                self._freed_waiting += 1
            try:
                await self._freed.wait()
            finally:
                with self._mu:
                    self._freed_waiting -= 1

    def _check_fits(self, keys: list[tuple[int, int]]) -> None:
        if len(keys) > self.n_slots + self.n_spare:
            raise BudgetError(
                f"get() of {len(keys)} distinct experts cannot fit: the store has {self.n_slots} slots "
                f"and {self.n_spare} spare buffers of {self.slot_bytes} bytes (budget {format_bytes(self.budget)})"
            )

    def _try_begin(self, layer: int, experts: Sequence[int], keys: list[tuple[int, int]], wake: Callable[[], None]):
        """Under the lock: _begin's work, or None when every slot and spare is held by other callers."""
        grants = self._reserve(keys)
        if grants is None:
            return None
        placed = self._place(layer, keys, grants)
        self._end_prefetch(layer)
        release = self._releaser(placed.slots, placed.spares)
        if placed.submit:
            self._submit_demand(placed.submit)
        # Views now, while the arena is surely open; the caller sees them only once the reads are in.
        views = {int(e): self._view(layer, int(e), placed.where[(layer, int(e))]) for e in experts}
        return views, _Arrivals(placed.wait, wake), release

    def _place(self, layer: int, keys: list[tuple[int, int]], grants: list[Grant | None]) -> _Placed:
        """Where each granted key's bytes are or will be, which reads to submit and which to wait for;
        counts hits and misses, and takes over (as demand) the layer's prefetches of these keys."""
        c = self._c
        c.accesses += len(keys)
        placed = _Placed()
        layer_pf = self._pf.get(layer)
        for key, grant in zip(keys, grants):
            if layer_pf is not None:
                layer_pf.pop(key, None)  # demanded: no longer the prefetcher's
            if grant is None:
                load = _Load(key, None, self._spares.pop(), False)
                placed.spares.append(load)
                placed.submit.append(load)
                placed.wait.append(load)
                c.misses += 1
                c.bypass_reads += 1
                placed.where[key] = self.n_slots + load.spare
                continue
            placed.slots.append(grant.slot)
            placed.where[key] = grant.slot
            if grant.state is SlotState.READY:
                c.hits += 1
                c.staging_hits += grant.prefetched
                continue
            c.misses += 1
            if grant.state is SlotState.FREE:
                load = _Load(key, grant.slot, None, False)
                self._loads[grant.slot] = load
                placed.submit.append(load)
            else:  # LOADING: a read is already on its way (a prefetch's, or another caller's)
                load = self._loads[grant.slot]
                c.prefetch_late += grant.prefetched
                if load.prefetch:  # demanded now: never withdrawn again, no longer counts as prefetch
                    load.prefetch = False
                    self._pf_submitted.discard(load)
                    if load.handles is None:  # still in our queue: it goes now, with the demand
                        self._pq.remove(load)
                        placed.submit.append(load)
            placed.wait.append(load)
        return placed

    def _releaser(self, slots: list[int], spares: list[_Load]) -> Callable[[], None]:
        """The release callback of one get(): unpin its slots, give back its spares; safe to call twice."""
        released = False

        def release() -> None:
            nonlocal released
            with self._mu:
                if released:
                    return
                released = True
                for slot in slots:
                    self.cache.unpin(slot)
                for load in spares:
                    load.released = True
                    if load.over:  # else _finish gives the spare back when its read completes
                        self._spares.append(load.spare)
                self._signal_freed()

        return release

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Start reading experts expected soon into staged slots. Never blocks; see the module doc for
        how long a prefetch lasts. Experts already present, or with no slot to stage into, are skipped.
        Callable from any thread: the reads are handed to the backend on the event loop."""
        with self._mu:
            self._prefetch(layer, experts)

    def _prefetch(self, layer: int, experts: Sequence[int]) -> None:
        self._check_open()
        keys = self._keys(layer, experts)
        old = self._pf.get(layer, {})
        wanted = set(keys)
        for key in [k for k in old if k not in wanted]:
            self._give_up(old.pop(key))
        cache = self.cache
        for key in keys:
            if key in cache:
                continue
            grant = cache.acquire(key, for_prefetch=True)
            if grant is None:
                self._c.prefetch_skipped += 1
                continue
            load = _Load(key, grant.slot, None, True)
            self._loads[grant.slot] = load
            self._pq.append(load)
            old[key] = load
            self._c.prefetch_issued += 1
        if old:
            self._pf[layer] = old
        self._pump()

    immediate = False  # experts may have to be read first: the model awaits get_ready()

    def views_now(self, layer: int, experts: Sequence[int]):
        raise ClutorError("the expert store reads experts from disk: await get() or get_ready() instead")

    @property
    def wants_hints(self) -> bool:
        """Whether hint() can change anything (the policy uses predictions); else callers may skip them."""
        return self.cache.policy.uses_hints

    def hint(self, layer: int, experts: Sequence[int]) -> None:
        """Tell the cache policy which experts ``layer``'s next get() is expected to ask for (the model
        calls this during decode with layer+1's router applied to the current hidden state, before the
        current layer's get()). No read, no slot: only the victim order may change. Valid until
        that layer's next get() or hint()."""
        with self._mu:
            self._check_open()
            self.cache.hint(int(layer), self._keys(layer, experts))

    def cancel_prefetch(self, layer: int | None = None) -> None:
        """Give up the prefetch of ``layer`` (of every layer when None), as described in the module doc."""
        with self._mu:
            for l in list(self._pf) if layer is None else [layer]:
                self._end_prefetch(l)

    async def aclose(self) -> None:
        """Wait for every read in flight, then release the backend and the arena. Idempotent."""
        with self._mu:
            if self._closed:
                return
            self._closed = True
            self._signal_freed()  # wake waiting get()s and takes so they see the store is closed
            for layer in list(self._pf):
                self._end_prefetch(layer)
            while self._pq:  # prefetches of layers already ended but never submitted
                self._drop_queued(self._pq[0])
            if self._busy():
                self._drained = self._loop.create_future()
        if self._drained is not None:
            # reads in flight (their buffers are the kernel's), or a take() on another thread whose
            # views are still being read: the arena is unmapped only after both
            await asyncio.shield(self._drained)
        await self.backend.aclose()
        self._views.clear()  # they reference the arena's mapping
        self._arena.close()

    async def __aenter__(self) -> "ExpertStore":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # -- queries ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """The most distinct experts one get() may hold pinned: every slot and spare buffer."""
        return self.n_slots + self.n_spare

    def resident(self, layer: int, expert: int) -> bool:
        """The expert's bytes are in the cache now (a get() would not wait)."""
        with self._mu:
            return self.cache.resident((layer, int(expert)))

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> StoreStats:
        with self._mu:
            return self._stats()

    def _stats(self) -> StoreStats:
        c = self._c
        return StoreStats(
            accesses=c.accesses,
            hits=c.hits,
            staging_hits=c.staging_hits,
            misses=c.misses,
            bypass_reads=c.bypass_reads,
            prefetch_issued=c.prefetch_issued,
            prefetch_late=c.prefetch_late,
            prefetch_wasted=self.cache.prefetch_wasted,
            prefetch_skipped=c.prefetch_skipped,
            evictions=self.cache.evictions,
            bytes_demand=c.bytes_demand,
            bytes_prefetch=c.bytes_prefetch,
            read_seconds=c.read_seconds,
            wait_seconds=c.wait_seconds,
            backend=self.backend.name,
            mode="direct" if self.backend.direct else "buffered",
            n_slots=self.n_slots,
            slot_bytes=self.slot_bytes,
            arena_bytes=self._arena.nbytes,
        )

    def check(self) -> None:
        """Assert the store's bookkeeping is consistent; for tests. Raises AssertionError."""
        with self._mu:
            self._check()

    def _check(self) -> None:
        cache = self.cache
        cache.check()
        for slot in range(self.n_slots):
            loading = cache.state(slot) is SlotState.LOADING
            assert loading == (slot in self._loads), f"slot {slot}: {cache.state(slot).name} but load record {slot in self._loads}"
        for slot, load in self._loads.items():
            assert cache.slot_of(load.key) == slot, f"load of {load.key} in slot {slot} not where the cache says"
            assert (load.handles is None) == (load in self._pq or load in self._posted), f"{load.key}: queued state disagrees"
        for loads in self._pf.values():
            for key, load in loads.items():
                assert load.prefetch, f"{key}: demanded load still listed as a prefetch"
        assert len(self._spares) == len(set(self._spares)) <= self.n_spare, "spare list"
        assert self._outstanding >= 0 and len(self._pf_submitted) <= max(PREFETCH_DEPTH, 0), "counters"

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.cache)} resident"
        return (
            f"ExpertStore({self.n_slots} slots x {format_bytes(self.slot_bytes)}, backend={self.backend.name}, "
            f"policy={self.cache.policy.name}, {state})"
        )

    # -- internals: reservation --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("ExpertStore used after aclose()")

    def _keys(self, layer: int, experts: Sequence[int]) -> list[tuple[int, int]]:
        layer = int(layer)
        if not 0 <= layer < self.layout.n_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.layout.n_layers})")
        keys = list(dict.fromkeys((layer, int(e)) for e in experts))
        for _, e in keys:
            if not 0 <= e < self.layout.n_experts:
                raise IndexError(f"expert {e} out of range [0, {self.layout.n_experts}) at layer {layer}")
        return keys

    def _reserve(self, keys: list[tuple[int, int]]) -> list[Grant | None] | None:
        """Pin present keys, assign slots to the rest (spares when none): all of them or nothing."""
        cache = self.cache
        grants: dict[tuple[int, int], Grant | None] = {}
        # Pin what is present first, so assigning slots to the misses cannot evict one of them.
        for key in keys:
            if key in cache:
                grants[key] = cache.acquire(key)
        n_bypass = 0
        for key in keys:
            if key in grants:
                continue
            grant = cache.acquire(key)
            if grant is None and self._steal_staged():
                grant = cache.acquire(key)
            grants[key] = grant
            n_bypass += grant is None
        if n_bypass > len(self._spares):
            for grant in grants.values():  # roll back; nothing was submitted yet
                if grant is None:
                    continue
                cache.unpin(grant.slot)
                if grant.state is SlotState.FREE:
                    cache.fail(grant.slot)  # assigned a moment ago, never read: free again
            return None
        return [grants[k] for k in keys]

    def _steal_staged(self) -> bool:
        """Demand outranks prefetch: free one staged slot (one not started, or one already READY)."""
        for layer, loads in self._pf.items():
            for key, load in loads.items():
                slot = load.slot
                if self.cache.slot_of(key) != slot or not self.cache.staged(slot):
                    continue
                if load.handles is None:
                    del loads[key]
                    self._drop_queued(load)
                    return True
                if self.cache.state(slot) is SlotState.READY and not self.cache.pins(slot):
                    del loads[key]
                    self.cache.discard(slot)
                    return True
        return False

    # -- internals: prefetch lifetime -------------------------------------------------------------
    def _end_prefetch(self, layer: int) -> None:
        for load in self._pf.pop(layer, {}).values():
            self._give_up(load)

    def _give_up(self, load: _Load) -> None:
        """The prefetcher no longer wants this expert: drop an unsubmitted read, else unprotect the slot."""
        if load.handles is None and load.slot in self._loads and self._loads[load.slot] is load:
            self._drop_queued(load)
        elif self.cache.slot_of(load.key) == load.slot:
            self.cache.unstage(load.slot)

    def _drop_queued(self, load: _Load) -> None:
        self._pq.remove(load)
        del self._loads[load.slot]
        self.cache.fail(load.slot)  # never submitted: the slot is free again; counted as wasted
        load.over = load.dropped = True
        self._tell(load)

    @staticmethod
    def _tell(load: _Load) -> None:
        waiters, load.waiters = load.waiters, []
        for arrived in waiters:
            arrived(load)

    # -- internals: threads ------------------------------------------------------------------------
    def _on_loop(self, fn: Callable, *args) -> None:
        """fn(*args) on the event loop's thread: now if this is it, else as soon as the loop turns
        (not at all once the loop is closed: nothing there would run it)."""
        if threading.get_ident() == self._loop_thread:
            fn(*args)
        elif not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # closed meanwhile
                pass

    def _signal_freed(self) -> None:
        """A slot or spare came free (or the store closed): wake the gets waiting for one. Lock held.
        (The loop is told only when a get waits there: a take's release costs it no turn.)"""
        self._cv.notify_all()
        if self._freed_waiting:
            self._on_loop(self._freed.set)

    def _busy(self) -> bool:
        """Reads in flight or about to be submitted, or views in use by a take() on another thread."""
        return bool(self._outstanding or self._posted or self._takers)

    def _check_drained(self) -> None:
        """Once closed: when nothing is busy any more, let aclose() unmap the arena. Lock held."""
        drained = self._drained
        if self._closed and drained is not None and not self._busy():
            self._on_loop(_set_pending, drained)

    # -- internals: reads --------------------------------------------------------------------------
    def _parts_of(self, key: tuple[int, int]) -> tuple[_Part, ...]:
        parts = self._parts.get(key)
        if parts is None:
            align = self._geo.align
            out = []
            for slab in self.layout.slabs(*key):
                off, length, skip = widen(slab.offset, slab.nbytes, align)
                out.append(_Part(self._files[slab.path], off, length, skip, slab.nbytes, slab.offset))
            parts = self._parts[key] = tuple(out)
        return parts

    def _buffer_of(self, load: _Load) -> int:
        return load.slot if load.slot is not None else self.n_slots + load.spare

    def _submit_demand(self, loads: list[_Load]) -> None:
        """A get's misses to the backend, now on the loop; from another thread (take), through the loop
        (the backend is the loop's), no prefetch going to the backend meanwhile."""
        if threading.get_ident() == self._loop_thread:
            self._submit(loads, demand=True)
            return
        self._posted.update(loads)
        self._on_loop(self._submit_posted, loads)

    def _submit_posted(self, loads: list[_Load]) -> None:
        with self._mu:
            self._posted.difference_update(loads)
            if not self._closed:
                self._submit(loads, demand=True)
                return
            for load in loads:  # closed before the loop got to them: never read
                self._fail_unread(load, "the expert store closed before the read was submitted")
            self._check_drained()

    def _fail_unread(self, load: _Load, why: str) -> None:
        """A load that will never be read: failed with an ExpertReadError naming its first slab."""
        part = self._parts_of(load.key)[0]
        load.handles = []
        self._outstanding += 1
        load.error = ExpertReadError(self._paths[part.file], part.offset, part.length, why, *load.key)
        self._finish(load)

    def _submit(self, loads: list[_Load], demand: bool) -> None:
        """Hand the reads of ``loads`` to the backend in one batch (demand first: see _yank). On the loop."""
        if demand:
            self._yank_prefetches()
        requests = []
        nbytes = 0
        for load in loads:
            buf = self._n_parts * self._buffer_of(load)
            for p, part in enumerate(self._parts_of(load.key)):
                requests.append(ReadRequest(part.file, part.offset, part.length, buf + p))
                nbytes += part.length
        try:
            handles = self.backend.submit(requests)
        except Exception as err:
            why = err.reason if isinstance(err, ClutorIOError) else str(err) if isinstance(err, ClutorError) else repr(err)
            for load in loads:
                self._fail_unread(load, f"submit failed: {why}")
            if demand:
                self._pump()
            return
        if demand:
            self._c.bytes_demand += nbytes
        else:
            self._c.bytes_prefetch += nbytes
        t0 = time.perf_counter()
        for i, load in enumerate(loads):
            n = self._n_parts
            hs = handles[n * i:n * i + n]
            load.handles = hs
            load.remaining = n
            self._outstanding += 1
            if load.prefetch:
                self._pf_submitted.add(load)
            for p, h in enumerate(hs):
                h.notify = lambda h, load=load, p=p: self._on_read(load, p, h, t0)
        if demand:
            self._pump()

    def _yank_prefetches(self) -> None:
        """Withdraw prefetch reads the backend has not started, to requeue them behind a demand batch."""
        back = []
        for load in list(self._pf_submitted):
            hs = load.handles
            if hs and all(h.state is ReadState.QUEUED for h in hs) and all(h.drop() for h in hs):
                self._pf_submitted.discard(load)
                load.handles = None
                load.remaining = 0
                self._outstanding -= 1
                back.append(load)
        if back:
            # Re-queued first among prefetches, in their original order.
            self._pq.extendleft(reversed(back))

    def _pump(self) -> None:
        """Hand queued prefetches to the backend, at most PREFETCH_DEPTH experts at a time, and only
        while no demand read is in flight (the loads outstanding beyond the prefetches: those include
        prefetches a get() took over, which are demand now, and the demand reads a take() has handed to the
        loop). Called on another thread, it asks the loop to pump."""
        room = PREFETCH_DEPTH - len(self._pf_submitted)
        if (room <= 0 or not self._pq or self._closed or self._posted
                or self._outstanding > len(self._pf_submitted)):
            return
        if threading.get_ident() != self._loop_thread:
            if not self._pump_posted:
                self._pump_posted = True
                self._on_loop(self._pump_on_loop)
            return
        batch = [self._pq.popleft() for _ in range(min(room, len(self._pq)))]
        self._submit(batch, demand=False)

    def _pump_on_loop(self) -> None:
        with self._mu:
            self._pump_posted = False
            self._pump()

    def _on_read(self, load: _Load, p: int, h: ReadHandle, t0: float) -> None:
        """One of the load's reads is over (called by the backend, on the loop, as it takes the completion)."""
        with self._mu:
            self._read_over(load, p, h, t0)

    def _read_over(self, load: _Load, p: int, h: ReadHandle, t0: float) -> None:
        if load.handles is None or p >= len(load.handles) or load.handles[p] is not h:
            return  # withdrawn and re-queued: a newer read will fill this buffer
        fut = h.done
        self._c.read_seconds += time.perf_counter() - t0
        part = self._parts_of(load.key)[p]
        if not fut.cancelled() and fut.exception() is None and fut.result() >= part.skip + part.nbytes:
            load.remaining -= 1  # the common case, without building the error's words
            if load.remaining == 0:
                self._finish(load)
            return
        path = self._paths[part.file]
        what = f"layer {load.key[0]} expert {load.key[1]} {PARTS[p]} slab"
        # Every failure names the expert (ExpertReadError), so the model fails only the requests routed to it.
        if fut.cancelled():
            err: BaseException | None = ExpertReadError(path, part.offset, part.length, f"read dropped ({what})",
                                                        *load.key)
        else:
            err = fut.exception()
            if err is None:
                got = fut.result()
                if got < part.skip + part.nbytes:
                    err = ExpertReadError(
                        path, part.slab_offset, part.nbytes,
                        f"short read: {got} of {part.length} bytes at offset {part.offset}; file ends before the {what}",
                        *load.key)
            elif isinstance(err, ClutorIOError):
                err = ExpertReadError(err.path, err.offset, err.length, f"{err.reason} ({what})", *load.key)
            else:
                err = ExpertReadError(path, part.offset, part.length, f"{err!r} ({what})", *load.key)
        if err is not None and load.error is None:
            load.error = err
        load.remaining -= 1
        if load.remaining == 0:
            self._finish(load)

    def _finish(self, load: _Load) -> None:
        """All reads of ``load`` are over: publish the slot (or free it) and wake whoever waits."""
        self._outstanding -= 1
        self._pf_submitted.discard(load)
        if load.slot is not None:
            if self._loads.get(load.slot) is load:
                del self._loads[load.slot]
            if load.error is None:
                self.cache.complete(load.slot)
            else:
                self.cache.fail(load.slot)
                layer_pf = self._pf.get(load.key[0])
                if layer_pf is not None and layer_pf.get(load.key) is load:
                    del layer_pf[load.key]
        elif load.released:
            self._spares.append(load.spare)
        load.over = True
        self._tell(load)
        self._signal_freed()
        if self._closed:
            self._check_drained()
        else:
            self._pump()

    def _view(self, layer: int, expert: int, buffer: int) -> ExpertView:
        """The view of an expert in an arena buffer: made once per (buffer, expert) while the buffer
        keeps holding it (the arena's layout is fixed: the same bytes, the same slices)."""
        made = self._views.get(buffer)
        if made is not None and made.layer == layer and made.expert == expert:
            return made
        made = self._views[buffer] = self._make_view(layer, expert, buffer)
        return made

    def _make_view(self, layer: int, expert: int, buffer: int) -> ExpertView:
        arena, geo = self._arena, self._geo
        return ExpertView.of(layer, expert, [arena.region_array(buffer, geo.start[p] + part.skip, part.nbytes)
                                             for p, part in enumerate(self._parts_of((layer, expert)))],
                             self.layout.gated)
