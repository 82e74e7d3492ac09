"""ExpertCache and its policies: pinning, staging, bypass, eviction order, invariants under random use."""
from __future__ import annotations

import random

import numpy as np
import pytest

from clutor.io.cache import ExpertCache, SlotState
from clutor.io.policies import LFU, LRFU, LRU, LRU2, POLICIES, Belady, auto_half_life, make_policy

ALL = sorted(POLICIES)


def k(e: int, layer: int = 0) -> tuple[int, int]:
    return (layer, e)


def load(cache: ExpertCache, key, *, keep_pinned: bool = False) -> int:
    """Demand-load ``key`` as the store does: acquire, complete, unpin."""
    g = cache.acquire(key)
    assert g is not None and g.state is SlotState.FREE
    cache.complete(g.slot)
    if not keep_pinned:
        cache.unpin(g.slot)
    cache.check()
    return g.slot


def victims(policy, n: int | None = None) -> list:
    it = policy.victims()
    out = [key for _, key in zip(range(n if n is not None else len(policy)), it)]
    it.close()
    return out


# -- pinning, loading, bypass --------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_pinned_never_evicted(name):
    cache = ExpertCache(3, make_policy(name, 3))
    a = load(cache, k(0), keep_pinned=True)  # oldest, least used: the natural victim, but pinned
    load(cache, k(1))
    load(cache, k(2))
    for e in range(3, 20):
        g = cache.acquire(k(e))
        assert g is not None and g.slot != a
        cache.complete(g.slot)
        cache.unpin(g.slot)
        cache.check()
        assert k(0) in cache and cache.state(a) is SlotState.READY
    assert cache.evictions == 17


@pytest.mark.parametrize("name", ALL)
def test_loading_never_evicted_and_bypass_when_all_held(name):
    cache = ExpertCache(2, make_policy(name, 2))
    g0 = cache.acquire(k(0))
    cache.unpin(g0.slot)  # unpinned but its read is in flight: still untouchable
    g1 = cache.acquire(k(1))  # pinned and loading
    assert cache.acquire(k(2)) is None  # every slot held -> caller bypasses
    cache.check()
    cache.complete(g1.slot)
    assert cache.acquire(k(2)) is None  # k(1) still pinned, k(0) still loading
    cache.complete(g0.slot)
    g2 = cache.acquire(k(2))
    assert g2 is not None and g2.slot == g0.slot and k(0) not in cache
    cache.check()


def test_hit_pins_and_reports_state():
    cache = ExpertCache(2, LRU())
    s = load(cache, k(0))
    g = cache.acquire(k(0))
    assert (g.slot, g.state, g.prefetched) == (s, SlotState.READY, False)
    g2 = cache.acquire(k(0))
    assert cache.pins(s) == 2
    cache.unpin(g.slot)
    cache.unpin(g2.slot)
    with pytest.raises(RuntimeError):
        cache.unpin(s)
    cache.check()


def test_failed_read_detaches_and_frees_at_last_unpin():
    cache = ExpertCache(2, LRU())
    g = cache.acquire(k(0))
    g_again = cache.acquire(k(0))  # a second waiter on the same read
    assert g_again.state is SlotState.LOADING
    cache.fail(g.slot)
    assert k(0) not in cache and cache.state(g.slot) is SlotState.FAILED
    cache.check()
    # The slot cannot be handed out while its waiters still hold it.
    other = cache.acquire(k(1))
    assert other.slot != g.slot
    cache.unpin(g.slot)
    assert cache.state(g.slot) is SlotState.FAILED
    cache.unpin(g_again.slot)
    assert cache.state(g.slot) is SlotState.FREE
    cache.check()
    retry = cache.acquire(k(0))
    assert retry.state is SlotState.FREE  # the key reloads from scratch


# -- staging -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_staged_not_evicted_until_used(name):
    cache = ExpertCache(3, make_policy(name, 3))
    p = cache.acquire(k(9), for_prefetch=True)
    assert p.state is SlotState.FREE and cache.staged(p.slot) and cache.pins(p.slot) == 0
    cache.complete(p.slot)
    for e in range(10, 20):  # churn through the other two slots
        load(cache, k(e))
        assert k(9) in cache and cache.staged(p.slot)
    # Everything else pinned: the staged slot is still not handed out.
    a = cache.acquire(k(20))
    b = cache.acquire(k(21))
    assert cache.acquire(k(22)) is None
    for g in (a, b):
        cache.complete(g.slot)
        cache.unpin(g.slot)
    # First demand access: a staging hit, and from now on a normal entry.
    g = cache.acquire(k(9))
    assert g.state is SlotState.READY and g.prefetched and not cache.staged(g.slot)
    cache.unpin(g.slot)
    assert cache.acquire(k(9)).prefetched is False
    cache.unpin(g.slot)
    cache.check()
    assert cache.prefetch_wasted == 0


def test_in_flight_prefetch_demanded_is_late_and_unstaged():
    cache = ExpertCache(2, LRU())
    p = cache.acquire(k(1), for_prefetch=True)
    g = cache.acquire(k(1))
    assert g.slot == p.slot and g.state is SlotState.LOADING and g.prefetched
    assert not cache.staged(g.slot) and cache.pins(g.slot) == 1
    cache.complete(g.slot)
    cache.unpin(g.slot)
    cache.check()


def test_unstaged_prefetch_evicted_unused_counts_wasted():
    cache = ExpertCache(2, LRU())
    p = cache.acquire(k(5), for_prefetch=True)
    cache.complete(p.slot)
    cache.unstage(p.slot)
    cache.check()
    load(cache, k(0))
    load(cache, k(1))  # evicts k(5), the least recent, never used
    assert k(5) not in cache and cache.prefetch_wasted == 1 and cache.evictions == 1
    # A prefetch dropped before its read (fail while LOADING) is wasted too.
    q = cache.acquire(k(6), for_prefetch=True)
    cache.fail(q.slot)
    assert cache.prefetch_wasted == 2
    cache.check()


def test_staging_limit_and_prefetch_of_present_key():
    cache = ExpertCache(4, LRU(), max_staging=2)
    assert cache.acquire(k(0), for_prefetch=True) is not None
    assert cache.acquire(k(1), for_prefetch=True) is not None
    assert cache.acquire(k(2), for_prefetch=True) is None  # limit reached
    g = cache.acquire(k(0), for_prefetch=True)  # already there: reported, nothing changes
    assert g.state is SlotState.LOADING and cache.n_staged == 2 and cache.pins(g.slot) == 0
    cache.check()


def test_discard_ready_entry():
    cache = ExpertCache(2, LRU())
    s = load(cache, k(0))
    cache.discard(s)
    assert k(0) not in cache and cache.state(s) is SlotState.FREE
    cache.check()


# -- eviction order per policy, on hand-made sequences ---------------------------------------------
def test_lru_order():
    p = LRU()
    for e in (0, 1, 2):
        p.on_insert(k(e))
        p.on_access(k(e))
    p.on_access(k(0))
    assert victims(p) == [k(1), k(2), k(0)]
    assert p.victim([k(0), k(2)]) == k(2)


def test_lfu_order_and_ageing():
    p = LFU(halve_every=1000)
    for e, n in ((0, 3), (1, 1), (2, 2)):
        p.on_insert(k(e))
        for _ in range(n):
            p.on_access(k(e))
    assert victims(p) == [k(1), k(2), k(0)]
    # Counts survive eviction: k(0) comes back ranked by its history, above a new key.
    p.on_remove(k(0))
    p.on_insert(k(3))
    p.on_access(k(3))
    p.on_insert(k(0))
    assert victims(p)[-1] == k(0)


def test_lfu_ageing_lets_new_favourite_win():
    # Without ageing, 8 old accesses beat 6 recent ones; with counts halved every 4 accesses they do not.
    for halve_every, expected_first in ((0, k(1)), (4, k(0))):
        p = LFU(halve_every=halve_every)
        p.on_insert(k(0))
        p.on_insert(k(1))
        for _ in range(8):
            p.on_access(k(0))
        for _ in range(6):
            p.on_access(k(1))
        assert victims(p, 1) == [expected_first], halve_every


def _lrfu_rounds(policy, rounds):
    """Feed whole rounds (one get() each) alternating over two layers."""
    for layer, experts in rounds:
        for e in experts:
            key = (layer, e)
            if key not in policy:
                policy.on_insert(key)
            policy.on_access(key)


def test_lrfu_frequency_vs_recency_by_half_life():
    # Expert 0 of layer 0: used at tokens 0-3. Expert 1: used only at token 5 (the last one).
    rounds = []
    for t in range(6):
        rounds.append((0, [0] if t < 4 else [2] if t == 4 else [1]))
        rounds.append((1, [0]))
    long_memory, short_memory = LRFU(half_life=100.0), LRFU(half_life=0.5)
    _lrfu_rounds(long_memory, rounds)
    _lrfu_rounds(short_memory, rounds)
    order_long = [v for v in victims(long_memory) if v[0] == 0]
    order_short = [v for v in victims(short_memory) if v[0] == 0]
    assert order_long.index((0, 1)) < order_long.index((0, 0))  # frequency wins: 4 uses > 1 use
    assert order_short.index((0, 0)) < order_short.index((0, 1))  # recency wins: old uses faded
    # Equal history except age: the older goes first whatever the half-life.
    assert order_long.index((0, 2)) < order_long.index((0, 1))
    assert order_short.index((0, 2)) < order_short.index((0, 1))


def test_lrfu_half_life_follows_the_cache_size_in_rounds():
    # A decode-like stream: 4 layers x 4 experts a round (period 16 accesses), drawn from 8 per layer.
    rng = np.random.default_rng(0)
    rounds = [(layer, rng.choice(8, 4, replace=False).tolist()) for _ in range(40) for layer in range(4)]
    for slots, want in ((15, 1.0), (31, 2.0 ** (31 / 16 - 1)), (63, 2.0 ** (63 / 16 - 1)), (200, 16.0)):
        p = make_policy("lrfu", slots)  # what the store and the simulator build
        _lrfu_rounds(p, rounds)
        assert p._period == pytest.approx(16.0)
        assert auto_half_life(slots / 16.0) == pytest.approx(want)
        assert 0.83 < p.half_life / want < 1.2, (slots, p.half_life, want)  # within the re-choice band
    assert LRFU().half_life == 1.0  # an explicit policy keeps its own
    _lrfu_rounds(fixed := LRFU(half_life=3.0), rounds)
    assert fixed.half_life == 3.0


def test_lrfu_a_new_half_life_reranks_every_resident_key():
    # Expert 0 of layer 0 used at rounds 0-5, expert 1 at round 7 only: with a half-life of one round
    # recency wins (0 goes first); a cache of ~8 rounds (h = 16) keeps the frequent one instead.
    p = LRFU(slots=32)
    _lrfu_rounds(p, [(0, [9]), (1, [9])])  # first rounds: the period is not known yet, h stays 1
    assert p.half_life == 1.0
    rounds = []
    for t in range(8):
        rounds.append((0, [0] if t < 6 else [2] if t == 6 else [1]))
        rounds.append((1, [0]))
    _lrfu_rounds(p, rounds)
    assert p._period == pytest.approx(2.0, abs=0.3) and p.half_life == 16.0
    order = [v for v in victims(p) if v[0] == 0]
    assert order.index((0, 1)) < order.index((0, 0))
    # the heaps were rebuilt: victims() agrees with every key's own score under the new half-life
    scores = sorted(p._current, key=lambda key: (-p._log2_wait(key), p._current[key]))
    assert list(victims(p)) == scores


def test_lrfu_prefetched_never_accessed_goes_first():
    p = LRFU()
    _lrfu_rounds(p, [(0, [0, 1]), (1, [0])])
    p.on_insert((1, 7))  # a prefetch: inserted, no access
    assert victims(p, 1) == [(1, 7)]


def test_lru2_order():
    p = LRU2()
    for e in (0, 1, 2):
        p.on_insert(k(e))
    for e in (0, 1, 1, 0, 2):  # a at t1,t4; b at t2,t3; c at t5
        p.on_access(k(e))
    # c was seen once: first to go; then a, whose second-last access (t1) is older than b's (t2).
    assert victims(p) == [k(2), k(0), k(1)]


def test_belady_order():
    future = [k(0), k(1), k(2), k(1), k(0), k(1)]
    p = Belady(future)
    for e in (0, 1, 2):
        p.on_insert(k(e))
        p.on_access(k(e))
    # next uses: k(0) at 4, k(1) at 3, k(2) never -> evict k(2), then k(0), then k(1)
    assert victims(p) == [k(2), k(0), k(1)]
    p.on_access(k(1))  # position 3; its next use is now 5, farther than k(0)'s 4
    assert (p.next_use(k(0)), p.next_use(k(1)), p.next_use(k(2))) == (4, 5, float("inf"))
    assert victims(p) == [k(2), k(1), k(0)]


def test_victims_generator_restores_skipped_entries():
    # The cache walks victims() past pinned keys and closes it; the skipped ones must still be there.
    for cls in (LFU, LRFU, LRU2):
        p = cls()
        for e in range(5):
            p.on_insert(k(e))
            p.on_access(k(e))
        before = victims(p)
        it = p.victims()
        first, second = next(it), next(it)
        p.on_remove(second)
        it.close()
        assert victims(p) == [v for v in before if v != second], cls.name
        assert first in p


# -- invariants under random use -------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_random_operations_keep_invariants(name):
    rng = random.Random(7)
    n_slots = 6
    cache = ExpertCache(n_slots, make_policy(name, n_slots), max_staging=3)
    held: list[int] = []       # one entry per pin we hold
    loading: set[int] = set()  # slots with a read in flight
    staged: dict = {}          # key -> slot of prefetches not yet demanded
    for step in range(3000):
        op = rng.random()
        key = (rng.randrange(3), rng.randrange(6))
        if op < 0.40:
            g = cache.acquire(key)
            if g is None:
                assert all(
                    cache.pins(s) or cache.state(s) is not SlotState.READY or cache.staged(s) for s in range(n_slots)
                ), "bypass although a slot was evictable"
            else:
                held.append(g.slot)
                staged.pop(key, None)
                if g.state is SlotState.FREE:
                    loading.add(g.slot)
        elif op < 0.55:
            g = cache.acquire(key, for_prefetch=True)
            if g is not None and g.state is SlotState.FREE:
                loading.add(g.slot)
                staged[key] = g.slot
        elif op < 0.75 and loading:
            slot = rng.choice(sorted(loading))
            loading.discard(slot)
            if rng.random() < 0.1:
                cache.fail(slot)
                staged = {kk: s for kk, s in staged.items() if s != slot}
            else:
                cache.complete(slot)
        elif op < 0.92 and held:
            cache.unpin(held.pop(rng.randrange(len(held))))
        elif staged:
            kk = rng.choice(sorted(staged))
            cache.unstage(staged.pop(kk))
        cache.check()
        # Never more keys than slots; never a pinned or loading slot without a key or FAILED state.
        assert len(cache) <= n_slots
        for s in loading:
            assert cache.state(s) is SlotState.LOADING
    assert cache.evictions > 0


def test_rejects_bad_sizes():
    with pytest.raises(ValueError):
        ExpertCache(0, LRU())
    with pytest.raises(ValueError):
        make_policy("nope", 4)
    assert make_policy("lfu", 100).halve_every == 100
