"""Which expert lives in which arena slot: states, pins, staging, eviction. No buffers, no I/O.

The same code runs inside the ExpertStore and inside the offline simulator, so simulated hit rates
are the store's hit rates.

Slot life cycle::

    FREE --acquire--> LOADING --complete--> READY --evict--> FREE
                         |                    ^
                         +--fail--> FREE (or FAILED while pinned, FREE at the last unpin)

LOADING means a read is queued or in flight: the buffer belongs to the backend (the kernel) until
the read's own completion, so a LOADING slot is never evicted, whatever happens to the tasks that
wanted it. A pinned slot (pins > 0: someone holds views into it) is never evicted either.
A staged slot holds a prefetch not yet used: the policy cannot evict it until its first demand access
turns it into a normal entry, or the prefetcher gives it up (``unstage``), or it is discarded.
When no slot can be had, ``acquire`` returns None and the caller reads into a spare buffer (bypass).
"""
from __future__ import annotations

import enum
from typing import Iterable, NamedTuple

from .policies import Key, Policy

__all__ = ["SlotState", "Grant", "ExpertCache"]


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"  # read queued or in flight; owned by the backend
    READY = "ready"
    FAILED = "failed"    # read failed or was dropped; detached from its key, FREE at the last unpin


class Grant(NamedTuple):
    slot: int
    state: SlotState  # state BEFORE the call: READY = hit, LOADING = a read is already on its way,
                      # FREE = newly assigned, the caller must read it then complete() or fail()
    prefetched: bool  # first demand use of an entry a prefetch brought in (READY: staging hit; LOADING: late)


class ExpertCache:
    """n_slots slots of one size; key -> slot; a policy chooses victims among evictable entries."""

    def __init__(self, n_slots: int, policy: Policy, *, max_staging: int | None = None):
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        self.n_slots = n_slots
        self.policy = policy
        self.max_staging = n_slots if max_staging is None else max(0, min(max_staging, n_slots))
        self._key: list[Key | None] = [None] * n_slots
        self._state: list[SlotState] = [SlotState.FREE] * n_slots
        self._pins: list[int] = [0] * n_slots
        self._staged: list[bool] = [False] * n_slots
        self._unused: list[bool] = [False] * n_slots  # brought in by a prefetch, no demand use yet
        self._index: dict[Key, int] = {}
        self._free: list[int] = list(range(n_slots - 1, -1, -1))  # stack; slot 0 handed out first
        self.n_staged = 0
        self.evictions = 0
        self.prefetch_wasted = 0  # prefetched entries removed without serving any demand access

    # -- queries ---------------------------------------------------------------------------------
    def slot_of(self, key: Key) -> int | None:
        return self._index.get(key)

    def __contains__(self, key: Key) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def key(self, slot: int) -> Key | None:
        return self._key[slot]

    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    def pins(self, slot: int) -> int:
        return self._pins[slot]

    def staged(self, slot: int) -> bool:
        return self._staged[slot]

    def resident(self, key: Key) -> bool:
        """The key's bytes are in a slot now (READY), usable without waiting."""
        slot = self._index.get(key)
        return slot is not None and self._state[slot] is SlotState.READY

    # -- transitions -----------------------------------------------------------------------------
    def acquire(self, key: Key, for_prefetch: bool = False) -> Grant | None:
        """Demand: pin the key's slot, assigning one if needed. Prefetch: stage a slot, never pin.

        Returns None when no slot can be had (demand: every slot pinned, loading or staged -> bypass;
        prefetch: the same, or the staging limit is reached). A prefetch of a key already present
        changes nothing and returns its current grant.
        """
        slot = self._index.get(key)
        if slot is not None:
            state = self._state[slot]
            if for_prefetch:
                return Grant(slot, state, False)
            prefetched = self._unused[slot]
            self._pins[slot] += 1
            if self._staged[slot]:
                self._staged[slot] = False
                self.n_staged -= 1
            self._unused[slot] = False
            self.policy.on_access(key)
            return Grant(slot, state, prefetched)

        if for_prefetch and self.n_staged >= self.max_staging:
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._key[slot] = key
        self._state[slot] = SlotState.LOADING
        self._index[key] = slot
        self.policy.on_insert(key)
        if for_prefetch:
            self._staged[slot] = True
            self._unused[slot] = True
            self.n_staged += 1
        else:
            self._pins[slot] = 1
            self.policy.on_access(key)
        return Grant(slot, SlotState.FREE, False)

    def complete(self, slot: int) -> None:
        """The slot's read finished with the right bytes."""
        if self._state[slot] is not SlotState.LOADING:
            raise RuntimeError(f"complete(slot {slot}) in state {self._state[slot].name}")
        self._state[slot] = SlotState.READY

    def fail(self, slot: int) -> None:
        """The slot's read failed (or was dropped before submission): forget the key.

        The slot is FREE at once if nobody holds it, else FAILED until the last unpin.
        """
        if self._state[slot] is not SlotState.LOADING:
            raise RuntimeError(f"fail(slot {slot}) in state {self._state[slot].name}")
        self._detach(slot)

    def unpin(self, slot: int) -> None:
        if self._pins[slot] <= 0:
            raise RuntimeError(f"unpin(slot {slot}) with no pins")
        self._pins[slot] -= 1
        if self._pins[slot] == 0 and self._state[slot] is SlotState.FAILED:
            self._release(slot)

    def unstage(self, slot: int) -> None:
        """The prefetcher no longer wants this staged entry: it becomes a normal, evictable entry.

        Its data (once loaded) is kept: the policy decides, as for any entry. If it leaves the cache
        without a demand access it counts as wasted.
        """
        if self._staged[slot]:
            self._staged[slot] = False
            self.n_staged -= 1

    def discard(self, slot: int) -> None:
        """Drop a READY, unpinned entry now (e.g. a prefetch known to be useless)."""
        if self._state[slot] is not SlotState.READY or self._pins[slot]:
            raise RuntimeError(f"discard(slot {slot}) in state {self._state[slot].name} with {self._pins[slot]} pins")
        self._detach(slot)

    def hint(self, layer, keys: list[Key]) -> None:
        """Keys of ``layer`` predicted for its next request (any of them may be absent): passed to the
        policy, which may use them to order victims. Changes no slot."""
        self.policy.on_hint(layer, keys)

    # -- internals -------------------------------------------------------------------------------
    def victim_key(self) -> Key | None:
        """The key a miss would evict now, or None when a slot is free (or nothing may be evicted). Looks,
        changes nothing."""
        if self._free:
            return None
        candidates = self.policy.victims()
        try:
            found = self._first_evictable(candidates)
        finally:
            candidates.close()
        return None if found is None else found[0]

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        candidates = self.policy.victims()
        try:
            found = self._first_evictable(candidates)
            if found is None:
                return None
            self.evictions += 1
            self._detach(found[1])
            return self._free.pop()
        finally:
            candidates.close()  # lets a lazy policy restore what it handed out before anything else changes

    def _first_evictable(self, candidates: Iterable[Key]) -> tuple[Key, int] | None:
        """The first of the policy's candidates whose slot may be evicted (ready, unpinned, not staged)."""
        index, state, pins, staged = self._index, self._state, self._pins, self._staged
        for key in candidates:
            slot = index[key]
            if state[slot] is SlotState.READY and not pins[slot] and not staged[slot]:
                return key, slot
        return None

    def _detach(self, slot: int) -> None:
        key = self._key[slot]
        del self._index[key]
        self.policy.on_remove(key)
        if self._unused[slot]:
            self.prefetch_wasted += 1
            self._unused[slot] = False
        if self._staged[slot]:
            self._staged[slot] = False
            self.n_staged -= 1
        self._key[slot] = None
        if self._pins[slot]:
            self._state[slot] = SlotState.FAILED
        else:
            self._release(slot)

    def _release(self, slot: int) -> None:
        self._state[slot] = SlotState.FREE
        self._key[slot] = None
        self._free.append(slot)

    def check(self) -> None:
        """Assert every invariant; for tests. Raises AssertionError naming the broken one."""
        n = self.n_slots
        assert len(self._key) == len(self._state) == len(self._pins) == len(self._staged) == n
        assert len(set(self._free)) == len(self._free), "free list has duplicates"
        free = set(self._free)
        for slot in range(n):
            st, key, pins = self._state[slot], self._key[slot], self._pins[slot]
            assert pins >= 0, f"slot {slot}: negative pins"
            assert (slot in free) == (st is SlotState.FREE), f"slot {slot}: free list disagrees with {st.name}"
            if st is SlotState.FREE:
                assert key is None and pins == 0 and not self._staged[slot] and not self._unused[slot], f"slot {slot}: dirty FREE"
            elif st is SlotState.FAILED:
                assert key is None and pins > 0 and not self._staged[slot], f"slot {slot}: FAILED must be detached and pinned"
            else:
                assert key is not None and self._index.get(key) == slot, f"slot {slot}: index disagrees for {key!r}"
            if self._staged[slot]:
                assert pins == 0 and self._unused[slot], f"slot {slot}: staged entries are unpinned and unused"
        assert len(self._index) == sum(1 for k in self._key if k is not None), "index size"
        assert self.n_staged == sum(self._staged) <= self.max_staging, "staged count"
        assert len(self.policy) == len(self._index), "policy tracks other keys than the cache"
        for key in self._index:
            assert key in self.policy, f"policy lost {key!r}"
