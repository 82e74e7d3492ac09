"""Cache policies over long runs: a million rounds with resident entries left idle all along.

A server runs for days. An expert loaded by one prompt may then sit resident, unused, for a million
of its layer's rounds before an eviction has to rank it; counts grow without bound; decayed values
sink through the subnormal floats to zero. Every policy must keep ranking (no exception, no NaN, the
idle entries first) and keep its state out of the subnormals (slow on x86, and a sign of a value
about to become 0 and be divided by). LRFU's q = value * 2^(-idle / half_life) used to reach 0.0
after ~1075 idle rounds, and 1/q failed every later eviction with ZeroDivisionError.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from clutor.io.policies import LRFU, POLICIES, Forecast, make_policy

HOT = [(0, 0), (1, 0)]                      # used at every round of their layer
IDLE = [(0, 1), (0, 2), (1, 1), (1, 2)]     # used once, at the start, then left resident
CHECKS = (100, 1_000, 1_100, 2_000, 10_000, 100_000, 1_000_000)  # rounds at which an eviction is ranked


class _FastForecast(Forecast):
    """Forecast with every half-life 512x shorter: its decays (popularity, transitions, the hints'
    record) go as far in 2,000 rounds as the default's do in a million."""

    HALF_LIVES = tuple(h / 512 for h in Forecast.HALF_LIVES)


def _subnormals(values) -> int:
    a = np.asarray(values)
    a = a if a.dtype.kind == "f" else a.astype(np.float64)
    tiny = np.finfo(a.dtype).tiny
    return int(np.count_nonzero((a != 0) & (np.abs(a) < tiny)))


def _state_arrays(p) -> dict[str, object]:
    """The floats a policy keeps, by name (the ones that decay or grow with time)."""
    if isinstance(p, Forecast):
        return {n: getattr(p, n) for n in ("_pop", "_rounds", "_T", "_N", "_hints", "_g", "_w", "_sq")}
    if isinstance(p, LRFU):
        return {"_value": list(p._value.values())}
    return {}


def _check_ranking(p, rounds: int) -> None:
    order = list(p.victims())
    assert sorted(order) == sorted(set(order)) and set(order) == set(HOT + IDLE), (p.name, rounds, order)
    # the idle entries go before both hot ones, whatever the policy
    assert set(order[: len(IDLE)]) == set(IDLE), (p.name, rounds, order)
    if isinstance(p, LRFU):
        waits = [p._log2_wait(k) for k in HOT + IDLE]
        assert all(not math.isnan(w) for w in waits), waits
    for name, a in _state_arrays(p).items():
        assert _subnormals(a) == 0, f"{p.name}: {name} holds subnormal floats after {rounds} rounds"
        assert np.all(np.isfinite(np.asarray(a, dtype=float))), f"{p.name}: {name} is not finite after {rounds} rounds"


def _run(p, n_rounds: int, checks) -> None:
    """Decode-like rounds over two layers: the next layer's router hint, then this layer's hot expert."""
    for k in HOT + IDLE:  # a prefill: every key loaded and used once
        p.on_insert(k)
        p.on_access(k)
    checks = sorted(c for c in checks if c <= n_rounds)
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        done = 0
        for c in checks:
            for _ in range(c - done):
                p.on_hint(1, [(1, 0)])
                p.on_access((0, 0))
                p.on_hint(0, [(0, 0)])
                p.on_access((1, 0))
            done = c
            _check_ranking(p, c)


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"forecast"}))
def test_a_million_rounds_with_idle_entries(name):
    _run(make_policy(name, 8), 1_000_000, CHECKS)


def test_forecast_a_million_rounds_of_decay_with_idle_entries():
    # At the default half-lives a million of Forecast's rounds take minutes; its state evolves only
    # through its decays, so the same run at 512x shorter half-lives covers as much decay in 2,000.
    _run(_FastForecast(half_life=512.0 / 512), 2_000, CHECKS)


def test_forecast_at_default_half_lives_past_the_first_subnormals():
    # popularity at a half-life of 4 rounds passes 2^-1022 after 4088 idle rounds
    _run(make_policy("forecast", 8), 4_200, (100, 1_100, 4_200))


def test_lrfu_issue_reproduction():
    # Two keys of one layer; one used 1100 rounds in a row: the other must be the victim, not an error.
    p = POLICIES["lrfu"]()
    for k in [(0, 0), (0, 1)]:
        p.on_insert(k)
        p.on_access(k)
    for _ in range(1100):
        p.on_access((0, 1))
    assert next(iter(p.victims())) == (0, 0)
    assert p.expected_wait((0, 0)) > p.expected_wait((0, 1))
    assert p.expected_wait((0, 0)) == math.inf  # past any float: ranked through its log, still first


@pytest.mark.parametrize("half_life", [1e-3, 1.0, 1e6, 1e18])
def test_lrfu_extreme_half_lives_still_rank(half_life):
    p = LRFU(half_life=half_life)
    _run(p, 2_000, CHECKS)


@pytest.mark.parametrize("half_life", [0.0, -1.0, math.inf, math.nan])
def test_lrfu_rejects_a_half_life_that_is_not_a_positive_number(half_life):
    with pytest.raises(ValueError, match="half_life"):
        LRFU(half_life=half_life)


def test_lfu_huge_counts_stay_ordered():
    # Halving every access: the log-count reaches a million; a key used at 10^6 still outranks one used once
    p = POLICIES["lfu"](halve_every=1)
    _run(p, 100_000, (100, 100_000))
