"""The bound arithmetic of every benchmark row (clutor/bench/bounds.py) on a hand-made trace: Belady's
minimal bytes in the decode window, counted from the cache state the whole run left, and the compute,
disk and own-bytes bounds."""
from __future__ import annotations

import math

import numpy as np
import pytest

from clutor.bench.bounds import bounds, expert_read_bytes, prefill_bounds, prefill_distinct_bytes, replay_window
from clutor.io.arena import widen
from clutor.io.layout import ExpertLayout, ExpertTensor
from clutor.io.trace import Trace, TraceHeader, TraceRecord


def _trace(rows) -> Trace:
    """rows: (position, [experts]) at one layer of three experts, top-1."""
    return Trace(tuple(TraceRecord(p, 0, tuple(es)) for p, es in rows), TraceHeader(1, 3, 1, 4096))


# Positions 0-1 are the prompt, 2-5 the decode window; experts 0, 1, 2 cost 100, 200, 300 bytes.
TRACE = _trace([(0, [0]), (1, [1]), (2, [2]), (3, [0]), (4, [1]), (5, [0])])
COST = np.array([[100, 200, 300]])


def test_belady_in_the_window_by_hand():
    # Two slots over 0 1 | 2 0 1 0. The minimum: 0, 1 miss (prompt); 2 misses and is read past the cache
    # (never needed again, while 0 and 1 are); 0, 1, 0 hit. Window: 4 accesses, one miss: 300 bytes over
    # 4 tokens. LRU: 2 evicts 0, 0 evicts 1, 1 evicts 2, 0 hits: 3 misses, 600 bytes.
    w = replay_window(TRACE, 2, COST, first_position=2, policy="lru")
    assert (w.tokens, w.accesses, w.belady_misses, w.belady_bytes) == (4, 4, 1, 300)
    assert w.belady_bytes_per_token == 75 and w.belady_hit_rate == 0.75
    assert (w.policy_hits, w.policy_bytes, w.policy_hit_rate) == (1, 600, 0.25)
    # counting everything instead: the prompt's two compulsory misses come in
    whole = replay_window(TRACE, 2, COST, first_position=0)
    assert (whole.tokens, whole.belady_misses, whole.belady_bytes, whole.policy) == (6, 3, 600, None)
    # a cache that holds every expert misses only the first use of each
    assert replay_window(TRACE, 3, COST, first_position=2).belady_bytes == 300


def test_bounds_take_the_tighter_of_compute_and_disk():
    # 1000 B/s of disk over 125 B/token is 8 tok/s; compute 20: the disk binds, and 8 tok/s is all of it.
    # The row's own 150 B/token allow 6.67 tok/s at that bandwidth, so 8 tok/s is 1.2 of its own bound (a
    # row can read faster than fio did in the same run: deeper queues); the arithmetic says so, not hides it.
    b = bounds(8.0, 20.0, 1000.0, 125.0, 150.0)
    assert b.disk == 8.0 and b.bound == 8.0 and b.of_bound == 1.0 and b.limited_by == "disk"
    assert b.disk_own == pytest.approx(1000 / 150) and b.own_bound == pytest.approx(1000 / 150)
    assert b.of_own_bound == pytest.approx(8 / (1000 / 150))
    # compute-bound row: Belady reads nothing (the cache holds every expert)
    c = bounds(9.0, 12.0, 1000.0, 0.0, 10.0)
    assert c.disk == math.inf and c.bound == 12.0 and c.of_bound == 0.75 and c.limited_by == "compute"
    assert c.own_bound == 12.0 and c.to_json()["disk"] == "inf"
    # without a disk measurement there is no bound, never a made-up one
    n = bounds(9.0, 12.0, None, 100.0, 100.0)
    assert n.bound is None and n.of_bound is None and n.limited_by is None


def test_expert_read_bytes_are_the_stores_aligned_reads(tmp_path):
    # slabs of 5000, 5024 and 7008 bytes at 32-byte but not block-aligned offsets
    path = str(tmp_path / "m.bin")
    layout = ExpertLayout(2, ((ExpertTensor(path, 224, 5000), ExpertTensor(path, 20256, 5024),
                               ExpertTensor(path, 40320, 7008)),))
    got = expert_read_bytes(layout)
    assert got.shape == (1, 2)
    for e in range(2):
        want = sum(widen(s.offset, s.nbytes, 4096)[1] for s in layout.slabs(0, e))
        assert got[0, e] == want and want % 4096 == 0 and want >= 5000 + 5024 + 7008


def test_step_unions_are_what_a_batched_step_asks_the_store():
    from clutor.bench.bounds import step_unions

    rows = [(5, 0, [1, 2]), (6, 0, [2, 3]), (5, 1, [4, 0]), (6, 1, [4, 5]), (7, 0, [1, 0])]
    t = Trace(tuple(TraceRecord(p, l, tuple(es), None, (9,) if l == 0 else None) for p, l, es in rows),
              TraceHeader(2, 10, 2))
    got = [(r.token, r.layer, r.experts, r.next) for r in step_unions(t).records]
    assert got == [(5, 0, (1, 2, 3), (9,)), (5, 1, (4, 0, 5), None), (7, 0, (1, 0), (9,))]
    one_layer = _trace([(0, [0]), (1, [1])])
    assert step_unions(one_layer) is one_layer


def test_a_prompts_distinct_experts_are_its_own_not_the_warm_ups():
    """Two MoE layers, top-2: a warm-up prompt (positions 0-1) routes to expert 2, the measured
    prompt (positions 0-2) to experts 0 and 1 of layer 0 and 1 of layer 1, then a decode token (position
    3) to expert 2: only the measured prompt's pairs count, each once."""
    cost = np.array([[100, 200, 300], [1000, 2000, 3000]])
    rows = [(0, 0, [2, 0]), (1, 0, [2, 0]), (0, 1, [2, 0]), (1, 1, [2, 0]),  # the warm-up
            (0, 0, [0, 1]), (1, 0, [1, 0]), (2, 0, [0, 1]), (0, 1, [1, 1]), (1, 1, [1, 1]), (2, 1, [1, 1]),
            (3, 0, [2, 0]), (3, 1, [2, 0])]  # a decode step after the prompt
    t = Trace(tuple(TraceRecord(p, l, tuple(es)) for p, l, es in rows), TraceHeader(2, 3, 2, 4096))
    assert prefill_distinct_bytes(t, cost, 3) == 100 + 200 + 2000


def test_a_prefills_bound_is_the_slower_of_compute_and_one_read_of_its_experts():
    b = prefill_bounds(10.0, 6.0, 1e9, 2 * 10**9, 3 * 10**9)  # disk: 2 GB at 1 GB/s = 2 s < 6 s in RAM
    assert (b["bound"], b["limited_by"], b["of_bound"], b["read_over_distinct"]) == (6.0, "compute", 0.6, 1.5)
    b = prefill_bounds(10.0, 6.0, 1e8, 2 * 10**9, None)  # 20 s from disk
    assert (b["bound"], b["limited_by"], b["of_bound"], b["read_over_distinct"]) == (20.0, "disk", 2.0, None)
    assert prefill_bounds(10.0, None, None, None, None)["bound"] is None
