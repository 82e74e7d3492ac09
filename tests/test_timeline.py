"""tools/timeline.py's split of a decode token's time and its dependency bound, on hand-made events."""
import pytest

import timeline  # tools/timeline.py (conftest puts tools/ on the path)

MS = 1e-3


def _token():
    """One decode step of 20 ms: layer 0 all cached, layer 1 one miss of 6 ms beside 2 cached experts."""
    return [
        ("run", 0.0, 20 * MS, True),
        ("ls", 0.0, 2 * MS, 0),
        ("get", 2.5 * MS, 3 * MS, (0, [1, 2, 3], [])),
        ("eo", 3 * MS, 6 * MS, (0, [1, 2, 3])),          # 1 ms per expert
        ("ls", 6.5 * MS, 8 * MS, 1),
        ("get", 8.5 * MS, 9 * MS, (1, [4, 5, 6], [6])),
        ("sub", 9 * MS, 9 * MS, (True, [[1, 6]])),
        ("eo", 9.5 * MS, 11.5 * MS, (1, [4, 5])),
        ("done", 9 * MS, 15 * MS, ([1, 6], True)),       # demand: 6 ms
        ("done", 9 * MS, 18 * MS, ([2, 7], False)),      # a prefetch: not a wait
        ("fin", 15.5 * MS, 20 * MS, None),
    ]


def test_split_and_dependency_bound():
    events = [("run", -1.0, -0.9, True), ("run", -0.8, -0.7, True)] + _token()  # the first two are skipped
    s = timeline.analyse(events, expert_bytes=6 << 20, disk_bps=(6 << 20) / (4 * MS))
    m = s["mean"]
    assert s["tokens"] == 1 and s["per_expert_compute"] == pytest.approx(1 * MS)
    assert m["wall"] == pytest.approx(20 * MS)
    busy = 2 + 3 + 1.5 + 2 + 4.5  # ls, eo, ls, eo, fin
    assert m["compute"] == pytest.approx(busy * MS)
    # idle while the demand read was in flight: before the cached group started, and after it
    assert m["read_wait"] == pytest.approx((9.5 - 9 + 15 - 11.5) * MS)
    assert m["handoff"] == pytest.approx((20 - busy - 4) * MS)
    assert m["misses"] == 1
    # the wait is layer 1's (its get came last before both idle spans); layer 0 had neither misses nor wait
    assert s["by_layer"][1] == pytest.approx({"wait": (0.5 + 3.5) * MS, "misses": 1})
    assert s["by_layer"][0] == {"wait": 0.0, "misses": 0}
    # the miss reads 4 ms at the given bandwidth, its layer's 2 cached experts cover 2 of them
    assert m["dependency_bound"] == pytest.approx((busy + 2) * MS)


def test_no_bound_without_a_bandwidth():
    s = timeline.analyse([("run", 0, 0, True)] * 2 + _token(), expert_bytes=1, disk_bps=None)
    assert "dependency_bound" not in s["mean"] and s["mean"]["misses"] == 1


def test_disk_busy_and_what_the_idle_disk_waited_for():
    """The reads (demand 9-15 ms, prefetch 9-18 ms) keep the disk busy 9 ms of the 20; its idle 11 ms
    split by the compute thread's spans then: layer 0's attention 2, experts 3 (layer 0's group), layer 1's
    attention 1.5, the output 2 (18-20), nothing 2.5 (2-3, 6-6.5, 8-9)."""
    s = timeline.analyse([("run", 0, 0, True)] * 2 + _token(), expert_bytes=6 << 20, disk_bps=None)
    m = s["mean"]
    assert m["disk_busy"] == pytest.approx(9 * MS) and m["reads"] == 2
    assert s["busy_bytes_per_second"] == pytest.approx(2 * (6 << 20) / (9 * MS))
    idle = s["disk_idle_by"]
    assert set(idle) == {"attention L0", "experts", "attention L1", "output", "nothing"}
    for what, ms in {"attention L0": 2, "experts": 3, "attention L1": 1.5, "output": 2, "nothing": 2.5}.items():
        assert idle[what] == pytest.approx(ms * MS), (what, idle)
    assert sum(idle.values()) == pytest.approx(20 * MS - m["disk_busy"])


def test_a_group_inside_an_attention_trip_counts_once():
    """Layer 1's attention trip (4-10 ms) also runs layer 0's last group (4-6 ms); no read is in flight
    from 2 to 12 ms: the idle 10 ms are attention L1 6, experts 2 (the group at 2-4 ms), nothing 2."""
    events = [("run", 0, 0, True)] * 2 + [
        ("run", 0.0, 14 * MS, True),
        ("done", 0.0, 2 * MS, ([0, 1], True)),
        ("eo", 2 * MS, 4 * MS, (0, [2])),
        ("ls", 4 * MS, 10 * MS, 1),
        ("eo", 4 * MS, 6 * MS, (0, [1])),
        ("done", 12 * MS, 14 * MS, ([1, 3], True)),
    ]
    s = timeline.analyse(events, expert_bytes=1, disk_bps=None)
    idle = s["disk_idle_by"]
    assert set(idle) == {"attention L1", "experts", "nothing"}
    for what, ms in {"attention L1": 6, "experts": 2, "nothing": 2}.items():
        assert idle[what] == pytest.approx(ms * MS), (what, idle)
    assert s["mean"]["disk_busy"] == pytest.approx(4 * MS)


@pytest.mark.parametrize("io", ["memory", "threads"])
def test_a_generation_is_recorded(io):
    """A real generation's decode steps and its layers' expert groups are recorded, io=memory too (its
    steps are run_now's, not run's: none was recorded, and analyse ended in KeyError 'wall')."""
    import asyncio

    from conftest import fixture_path

    rec = timeline.Recorder()
    asyncio.run(timeline._generate(str(fixture_path("olmoe", "Q8_0")), "50%", None, io, 6, 8, rec))
    runs = [e for e in rec.events if e[0] == "run"]
    groups = [e for e in rec.events if e[0] == "eo"]
    assert sum(1 for e in runs if e[3]) >= 5 and any(not e[3] for e in runs)  # the decode steps and the prefill
    assert {e[3][0] for e in groups} == {0, 1}  # both of the fixture's MoE layers
    s = timeline.analyse(rec.events, expert_bytes=1 << 20, disk_bps=None)
    assert s["tokens"] >= 3 and s["mean"]["compute"] > 0 and s["per_expert_compute"] > 0
