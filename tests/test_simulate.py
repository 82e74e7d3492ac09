"""Trace format, synthetic traces, the policy simulator and its CLI, byte-size parsing."""
from __future__ import annotations

import json

import pytest

from clutor.cli import simulate as cli
from clutor.errors import ModelFileError
from clutor.io.policies import POLICIES
from clutor.io.simulate import compare_policies, simulate, slots_for_budget
from clutor.io.trace import (
    Trace,
    TraceHeader,
    TraceRecord,
    TraceWriter,
    read_trace,
    synthetic_trace,
    write_trace,
)
from clutor.units import format_bytes, parse_bytes


def records(*rows) -> tuple[TraceRecord, ...]:
    """rows: (token, layer, [experts])"""
    return tuple(TraceRecord(t, l, tuple(es)) for t, l, es in rows)


# -- units ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, n",
    [("3GiB", 3 << 30), ("256MiB", 256 << 20), ("1e9", 10**9), ("4096", 4096), ("1.5GB", 1_500_000_000),
     (" 2 gib ", 2 << 30), ("0", 0), ("64k", 64_000), ("0.5KiB", 512)],
)
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "x", "-1", "1.5", "3GiBs", "inf", "nan", "1e400"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(6 << 20) == "6.00 MiB"
    assert format_bytes(3 << 30) == "3.00 GiB"
    assert format_bytes(150 << 20) == "150 MiB"
    assert parse_bytes(format_bytes(3 << 30).replace(" ", "")) == 3 << 30


# -- trace files ---------------------------------------------------------------------------------
def test_trace_version_1_still_reads_and_version_2_keeps_predictions(tmp_path):
    v1 = tmp_path / "v1.jsonl"
    v1.write_text('{"clutor_trace": 1, "n_layers": 2, "n_experts": 8, "top_k": 2}\n'
                  '{"token": 0, "layer": 0, "experts": [1, 2]}\n')
    tr = read_trace(v1)
    assert tr.header == TraceHeader(2, 8, 2) and tr.records == (TraceRecord(0, 0, (1, 2)),)
    recs = (TraceRecord(0, 0, (1, 2), None, (3, 4)), TraceRecord(0, 1, (3, 5)))
    path = tmp_path / "v2.jsonl"
    write_trace(path, recs, TraceHeader(2, 8, 2))
    assert json.loads(path.read_text().splitlines()[0])["clutor_trace"] == 2
    assert read_trace(path).records == recs


def test_trace_roundtrip(tmp_path):
    header = TraceHeader(2, 8, 2, expert_bytes=1000)
    recs = (
        TraceRecord(0, 0, (1, 2), (0.75, 0.25)),
        TraceRecord(0, 1, (3, 4)),
        TraceRecord(1, 0, (1, 5), (0.5, 0.5)),
    )
    path = tmp_path / "t.jsonl"
    write_trace(path, recs, header)
    tr = read_trace(path)
    assert tr.header == header and tr.records == recs and tr.n_tokens == 2
    assert tr.accesses() == [(0, 1), (0, 2), (1, 3), (1, 4), (0, 1), (0, 5)]
    # Without a header, streamed by the writer the model's recorder uses.
    path2 = tmp_path / "t2.jsonl"
    with TraceWriter(path2) as w:
        for r in recs:
            w.write(r.token, r.layer, list(r.experts), r.weights)
    assert read_trace(path2).records == recs and read_trace(path2).header is None


@pytest.mark.parametrize(
    "lines, where",
    [
        (['{"token": 0, "layer": 0, "experts": [1, 2]}', "not json"], "line 2"),
        (['{"clutor_trace": 1, "n_layers": 2, "n_experts": 8, "top_k": 2}', '{"token": 0, "layer": 2, "experts": [1, 2]}'], "line 2: layer"),
        (['{"clutor_trace": 1, "n_layers": 2, "n_experts": 8, "top_k": 2}', '{"token": 0, "layer": 0, "experts": [1, 8]}'], "line 2: experts"),
        (['{"clutor_trace": 1, "n_layers": 2, "n_experts": 8, "top_k": 2}', '{"token": 0, "layer": 0, "experts": [1]}'], "line 2: experts"),
        (['{"token": 0, "layer": 0, "experts": [1, 2], "weights": [1.0]}'], "line 1: weights"),
        (['{"token": -1, "layer": 0, "experts": [1]}'], "line 1: token"),
        (['{"token": 0, "layer": 0, "experts": []}'], "line 1: experts"),
        (['{"token": 0, "layer": 0, "experts": [1]}', '{"clutor_trace": 1, "n_layers": 1, "n_experts": 2, "top_k": 1}'], "line 2"),
        (['{"clutor_trace": 3, "n_layers": 1, "n_experts": 2, "top_k": 1}'], "line 1: clutor_trace"),
        (['{"clutor_trace": 2, "n_layers": 2, "n_experts": 8, "top_k": 2}', '{"token": 0, "layer": 0, "experts": [1, 2], "next": [8]}'], "line 2: next"),
        (['{"clutor_trace": 2, "n_layers": 2, "n_experts": 8, "top_k": 2}', '{"token": 0, "layer": 1, "experts": [1, 2], "next": [3]}'], "line 2: next"),
        (['{"token": 0, "layer": 0, "experts": [1, 2], "next": 3}'], "line 1: next"),
        (['[1, 2]'], "line 1"),
        ([""], "records"),
    ],
)
def test_trace_validation_names_file_and_line(tmp_path, lines, where):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ModelFileError) as e:
        read_trace(path)
    assert str(path) in str(e.value) and where in str(e.value)


def test_synthetic_trace_shape_and_determinism():
    tr = synthetic_trace(30, 4, 16, 4, skew=1.0, reuse=0.5, seed=3)
    assert len(tr) == 30 * 4 and tr.header == TraceHeader(4, 16, 4)
    for r in tr.records:
        assert len(set(r.experts)) == 4 and all(0 <= e < 16 for e in r.experts)
        assert abs(sum(r.weights) - 1.0) < 1e-9 and list(r.weights) == sorted(r.weights, reverse=True)
    assert synthetic_trace(30, 4, 16, 4, skew=1.0, reuse=0.5, seed=3).records == tr.records
    assert synthetic_trace(30, 4, 16, 4, skew=1.0, reuse=0.5, seed=4).records != tr.records


def _overlap(tr: Trace) -> float:
    prev, same, total = {}, 0, 0
    for r in tr.records:
        if r.layer in prev:
            same += len(set(r.experts) & prev[r.layer])
            total += len(r.experts)
        prev[r.layer] = set(r.experts)
    return same / total


def test_synthetic_trace_reuse_and_skew_do_what_they_say():
    # reuse=1 keeps every expert; reuse=0 with uniform popularity overlaps ~ k/E by chance alone.
    assert _overlap(synthetic_trace(20, 2, 32, 4, skew=0.0, reuse=1.0, seed=1)) == 1.0
    chance = _overlap(synthetic_trace(400, 2, 32, 4, skew=0.0, reuse=0.0, seed=1))
    assert 0.07 < chance < 0.19  # 4/32 = 0.125
    half = _overlap(synthetic_trace(400, 2, 32, 4, skew=0.0, reuse=0.5, seed=1))
    assert 0.48 < half < 0.62   # 0.5 kept + chance refills
    # Skew concentrates use: the most used expert of a layer is used far more often than with skew 0.
    def top_share(tr):
        counts = {}
        for r in tr.records:
            if r.layer == 0:
                for e in r.experts:
                    counts[e] = counts.get(e, 0) + 1
        return max(counts.values()) / sum(counts.values())
    assert top_share(synthetic_trace(300, 1, 32, 4, skew=1.5, reuse=0.0, seed=2)) > 2 * top_share(
        synthetic_trace(300, 1, 32, 4, skew=0.0, reuse=0.0, seed=2)
    )
    with pytest.raises(ValueError):
        synthetic_trace(1, 1, 4, 5)


# -- the simulator ---------------------------------------------------------------------------------
HAND = records(
    (0, 0, [0, 1]),
    (0, 1, [0, 1]),
    (1, 0, [0, 1]),
    (1, 1, [0, 1]),
    (2, 0, [0, 1]),
)


def test_lru_matches_hand_count():
    # 3 slots, LRU, a request's present experts pinned before its misses are placed (as the store does):
    # t0 L0: 00 01 miss miss           cache 00 01          (LRU order oldest first)
    # t0 L1: 10 miss, 11 miss evicts 00 -> 01 10 11
    # t1 L0: 01 hit -> 10 11 01; 00 miss evicts 10 -> 11 01 00
    # t1 L1: 11 hit -> 01 00 11; 10 miss evicts 01 -> 00 11 10
    # t2 L0: 00 hit -> 11 10 00; 01 miss evicts 11 -> 10 00 01
    r = simulate(HAND, 3, "lru")
    assert (r.accesses, r.hits, r.misses, r.evictions, r.bypass) == (10, 3, 7, 4, 0)


def test_belady_on_hand_traces():
    # HAND: every pair must be resident together and 3 slots hold only one pair and a half, so after
    # the 4 cold misses each request misses once whatever the policy: 3 hits at best.
    r = simulate(HAND, 3, "belady")
    assert (r.hits, r.misses) == (3, 7)
    for name in POLICIES:
        assert simulate(HAND, 3, name).hits <= r.hits
    # A loop over 3 experts with 2 slots: LRU always evicts the one needed next (0 hits); OPT keeps one
    # of them: 0 1 2(evict 1) 0(hit) 1(evict 0, never used again) 2(hit) -> 2 hits.
    loop = records(*[(t, 0, [t % 3]) for t in range(6)])
    assert simulate(loop, 2, "lru").hits == 0
    assert simulate(loop, 2, "belady").hits == 2
    for name in POLICIES:
        assert simulate(loop, 2, name).hits <= 2


@pytest.mark.parametrize(
    "n_tokens, n_layers, n_experts, top_k, skew, reuse, seed",
    [(60, 4, 16, 4, 1.0, 0.4, 0), (60, 6, 32, 4, 0.6, 0.5, 1), (40, 8, 24, 6, 1.3, 0.2, 2), (80, 3, 12, 2, 0.0, 0.0, 3)],
)
def test_belady_beats_every_policy(n_tokens, n_layers, n_experts, top_k, skew, reuse, seed):
    tr = synthetic_trace(n_tokens, n_layers, n_experts, top_k, skew=skew, reuse=reuse, seed=seed)
    for n_slots in (top_k, n_layers * top_k // 2, n_layers * top_k, n_layers * n_experts // 2):
        results = compare_policies(tr, max(1, n_slots))
        belady = results[-1]
        assert belady.policy == "belady"
        for r in results:
            assert r.hits + r.misses == r.accesses == len(tr.accesses())
            assert r.hits <= belady.hits, (r.policy, n_slots, r.hits, belady.hits)
            # Each miss fills a free slot or evicts; free slots only run out once.
            placed = r.misses - r.bypass
            assert r.evictions == max(0, placed - n_slots) if placed >= n_slots else r.evictions == 0


def test_bypass_when_request_exceeds_slots():
    tr = records((0, 0, [0, 1, 2]), (1, 0, [0, 1, 2]))
    r = simulate(tr, 2, "lru")
    assert r.bypass == 2 and r.hits == 2 and r.misses == 4  # 2 slots keep 2 of the 3 across tokens


def test_everything_fits_only_cold_misses():
    tr = synthetic_trace(50, 4, 8, 2, seed=5)
    distinct = len(set(tr.accesses()))
    for name in [*POLICIES, "belady"]:
        r = simulate(tr, 4 * 8, name)
        assert r.misses == distinct and r.evictions == 0


def test_slots_for_budget():
    # The store keeps 1 spare buffer for bypass reads (none when the budget holds one expert); the
    # simulator models the rest as cache slots.
    assert slots_for_budget(3 << 30, 6_684_672) == (3 << 30) // 6_684_672 - 1
    assert [slots_for_budget(n * 100, 100) for n in (0, 1, 2, 8, 16, 24, 100)] == [0, 1, 1, 7, 15, 23, 99]
    with pytest.raises(ValueError):
        slots_for_budget(100, 0)


# -- the CLI -------------------------------------------------------------------------------------
def test_cli_table_and_json(tmp_path, capsys):
    tr = synthetic_trace(20, 4, 16, 4, seed=1, expert_bytes=1000)
    path = tmp_path / "t.jsonl"
    write_trace(path, tr.records, tr.header)
    assert cli.main([str(path), "--budget", "32000"]) == 0
    out = capsys.readouterr().out
    assert "belady" in out and "lru" in out and " 31 " in out  # 32 buffers: 31 slots + 1 spare
    assert cli.main([str(path), "--budget", "16kB,32000", "--json", "--policies", "lru"]) == 0
    data = json.loads(capsys.readouterr().out)
    got = [(r["policy"], r["n_slots"], r["budget_bytes"]) for r in data["results"]]
    assert got == [("lru", 15, 16000), ("belady", 15, 16000), ("lru", 31, 32000), ("belady", 31, 32000)]
    direct = simulate(tr, 31, "lru")
    assert data["results"][2]["hits"] == direct.hits


def test_cli_synthetic_and_errors(tmp_path, capsys):
    args = ["--synthetic", "--tokens", "10", "--layers", "2", "--experts", "8", "--top-k", "2",
            "--budget-slots", "4", "--json"]
    assert cli.main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["policy"] for r in data["results"]} == {*POLICIES, "belady"}
    assert all(r["accesses"] == 40 for r in data["results"])
    assert cli.main(["--synthetic", "--budget", "1GiB"]) == 1  # no expert size known
    assert "expert" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"token": 0}\n')
    assert cli.main([str(bad), "--budget-slots", "4"]) == 1
    assert "line 1" in capsys.readouterr().err
    assert cli.main(["--synthetic", "--budget-slots", "4", "--policies", "nope"]) == 1


def test_cli_parser_registers(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parser.parse_args(["simulate", "--synthetic", "--tokens", "5", "--layers", "2", "--experts", "4",
                              "--top-k", "2", "--budget-slots", "3"])
    assert cli.run(args) == 0
    assert "belady" in capsys.readouterr().out


# -- predictions (trace version 2) -------------------------------------------------------------------
def _hinted_trace(hint, last):
    # Two layers. Layer 0 asks for {0, 4} twice, then {0, 3}; layer 1 asks for 1, then 2, then `last`.
    # The hint for layer 1 comes with layer 0's third request, before it (as the model gives it).
    return (TraceRecord(0, 0, (0, 4)), TraceRecord(0, 1, (1,)), TraceRecord(1, 0, (0, 4)), TraceRecord(1, 1, (2,)),
            TraceRecord(2, 0, (0, 3), None, hint), TraceRecord(2, 1, last))


@pytest.mark.parametrize(
    "hint, last, hits",
    [
        # 4 slots hold (0,0) (0,4) (1,1) (1,2) after token 1; token 2's miss (0,3) must evict one, and
        # that choice decides token 2's layer 1. Hits before it: (0,0) (0,4) at token 1, (0,0) at token 2.
        (None, (2,), 4),   # no hint: Forecast keeps (1,2) (the more recent; it followed layer 0's {0, 4}) -> it hits
        (None, (1,), 3),   # ... so layer 1 asking for 1 misses
        ((1,), (1,), 4),   # hint right: it keeps (1,1) instead -> the hit no hint had
        ((1,), (2,), 3),   # hint wrong: it evicted (1,2) -> one miss more than without a hint
        ((2,), (2,), 4),   # hint agrees with what it kept anyway: no change
        ((2,), (1,), 3),   # hint wrong where no hint was also wrong: no change
    ],
)
def test_forecast_hint_right_and_wrong_hand_counted(hint, last, hits):
    r = simulate(_hinted_trace(hint, last), 4, "forecast")
    assert (r.accesses, r.hits, r.misses) == (9, hits, 9 - hits)
    assert r.hits <= simulate(_hinted_trace(hint, last), 4, "belady").hits == 4
    # A hint changes nothing for the policies that do not predict.
    for name in ("lru", "lfu", "lrfu", "lru2"):
        assert simulate(_hinted_trace(hint, last), 4, name).hits == simulate(_hinted_trace(None, last), 4, name).hits


def test_forecast_hint_changes_only_the_hinted_layer_order():
    from clutor.io.policies import Forecast

    p = Forecast()
    for key in [(0, 0), (1, 0), (1, 1), (0, 0), (1, 0), (1, 1)]:  # two identical rounds per layer
        if key not in p:
            p.on_insert(key)
        p.on_access(key)
    p.on_access((0, 0))  # layer 0's next round is in progress: layer 1 is next
    before = list(p.victims())
    p.on_hint(1, [(1, 1)])  # layer 1 will want expert 1 only
    after = list(p.victims())
    assert after.index((1, 0)) < after.index((1, 1))  # the expert the hint leaves out goes first
    assert sorted(before) == sorted(after) == [(0, 0), (1, 0), (1, 1)]


def test_forecast_learns_which_experts_follow():
    # Layer 0 cycles through three pairs, layer 1 always asks for expert 0; 5 slots hold layer 1's
    # expert and two pairs. Each token's pair is the one not used in the last two tokens, so keeping
    # the latest (LRU) or the most used (popularity is flat) misses layer 0 every time; only the
    # transition model ("after {0, 1} comes {2, 3}") keeps the pair needed next. (Two layers, not one:
    # a policy sees a layer's next round begin when another layer's request comes in between.)
    cycle = [(0, 1), (2, 3), (4, 5)]
    trace = records(*[row for t in range(300) for row in ((t, 0, list(cycle[t % 3])), (t, 1, [0]))])
    hits = {name: simulate(trace, 5, name).hits for name in ("lru", "lfu", "lrfu", "forecast", "belady")}
    assert hits["lru"] == hits["lfu"] == hits["lrfu"] == 299  # layer 1's hits only
    assert 0.9 * hits["belady"] <= hits["forecast"] <= hits["belady"], hits
    # Random routing: nothing to learn; Forecast must not fall behind LRFU there.
    tr = synthetic_trace(400, 4, 16, 2, skew=1.0, reuse=0.4, seed=5)
    assert simulate(tr, 16, "forecast").hits >= simulate(tr, 16, "lrfu").hits


def test_belady_keeps_its_place_in_the_future_across_a_bypass():
    """A request larger than the cache reads one expert past it (bypass). Belady must still count that
    access, or the expert looks needed at once ever after and is never evicted. Two slots over
    [0 1 2] [2] [0] [1] [0] [1]: 2 is bypassed, then read into a slot (evicting 1, used later than 0),
    then evicted for 1 (never used again): 5 misses. Without the bypass counted, 2 stays and 0 and 1
    thrash: 7."""
    recs = records((0, 0, [0, 1, 2]), (1, 0, [2]), (2, 0, [0]), (3, 0, [1]), (4, 0, [0]), (5, 0, [1]))
    r = simulate(recs, 2, "belady")
    assert (r.accesses, r.misses, r.bypass, r.hits) == (8, 5, 1, 3)
    assert r.misses <= simulate(recs, 2, "lru").misses
    # "opt" may also read a miss past the cache: the second 2 (never used again) evicts nothing, 4 misses
    o = simulate(recs, 2, "opt")
    assert (o.policy, o.misses, o.bypass, o.hits) == ("opt", 4, 2, 4)


def test_opt_never_loses_to_an_online_policy_on_batched_steps():
    """Steps of 16 streams ask a layer for most of its experts at once; inserting every miss (plain
    Belady) can then do worse than an online policy, the bypassing minimum never does."""
    base = synthetic_trace(64 * 16, 4, 32, 4, skew=1.0, reuse=0.4, seed=1)
    by: dict = {}
    for r in base.records:
        by.setdefault(r.token, {})[r.layer] = r
    steps = tuple(TraceRecord(s, l, tuple(dict.fromkeys(e for t in range(16 * s, 16 * s + 16) for e in by[t][l].experts)))
                  for s in range(64) for l in range(4))
    for n in (12, 28, 56):
        opt = simulate(steps, n, "opt").misses
        assert all(opt <= simulate(steps, n, p).misses for p in ("belady", "lru", "lfu", "lrfu", "lru2")), n
