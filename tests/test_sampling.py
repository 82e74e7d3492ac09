"""Sampler: greedy, the top-k / top-p / min-p / temperature chain, repetition penalty, seeding."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from clutor.errors import ClutorError
from clutor.model.sampling import Sampler, SamplingParams, token_logprobs


def _params(**kw) -> SamplingParams:
    """Every stage off unless asked for, so each test looks at one stage."""
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=0)
    base.update(kw)
    return SamplingParams(**base)


def _support(params: SamplingParams, logits: np.ndarray, n: int = 3000, history=()) -> dict[int, int]:
    s = Sampler(params)
    counts: dict[int, int] = {}
    for _ in range(n):
        t = s.sample(logits, history)
        counts[t] = counts.get(t, 0) + 1
    return counts


def _logits_from_probs(p) -> np.ndarray:
    return np.log(np.asarray(p, dtype=np.float64)).astype(np.float32)


def test_defaults_match_llama_cpp():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n, p.seed) == (
        0.8, 40, 0.95, 0.05, 1.0, 64, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]


def test_greedy_picks_argmax_lowest_id_on_ties():
    rng = np.random.default_rng(3)
    s = Sampler(SamplingParams(temperature=0.0))
    for _ in range(20):
        logits = rng.normal(size=1000).astype(np.float32)
        assert s.sample(logits, []) == int(np.argmax(logits))
    tie = np.array([0.0, 3.0, 1.0, 3.0, 3.0], dtype=np.float32)
    assert s.sample(tie, []) == 1


def test_top_k_1_is_greedy_at_any_temperature():
    rng = np.random.default_rng(4)
    for temperature in (0.1, 1.0, 5.0, 100.0):
        s = Sampler(_params(temperature=temperature, top_k=1, seed=11))
        for _ in range(20):
            logits = rng.normal(size=500).astype(np.float32)
            assert s.sample(logits, []) == int(np.argmax(logits))


def test_top_k_support():
    logits = np.array([0.5, 0.4, 0.3, 0.2, 0.1, 0.0], dtype=np.float32)
    assert set(_support(_params(top_k=3), logits)) == {0, 1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = _logits_from_probs([0.15, 0.5, 0.05, 0.3])  # sorted: 1 (.5), 3 (.3), 0 (.15), 2 (.05)
    assert set(_support(_params(top_p=0.7), logits)) == {1, 3}
    assert set(_support(_params(top_p=0.9), logits)) == {0, 1, 3}
    assert set(_support(_params(top_p=0.4), logits)) == {1}
    assert set(_support(_params(top_p=1.0), logits)) == {0, 1, 2, 3}


def test_min_p_threshold_is_relative_to_the_top_token():
    logits = _logits_from_probs([0.02, 0.4, 0.2, 0.08, 0.3])
    # keep prob >= min_p * 0.4
    assert set(_support(_params(min_p=0.1), logits)) == {1, 2, 3, 4}
    assert set(_support(_params(min_p=0.6), logits)) == {1, 4}
    assert set(_support(_params(min_p=1.0), logits)) == {1}


def test_min_p_is_applied_before_temperature():
    # A high temperature flattens the distribution, but min_p already cut the tail on raw logits.
    logits = _logits_from_probs([0.5, 0.45, 0.04, 0.01])
    assert set(_support(_params(min_p=0.1, temperature=50.0), logits)) == {0, 1}  # 0.1 * 0.5 > 0.04


def test_temperature_shapes_the_draw():
    logits = np.array([1.0, 0.0, -1.0], dtype=np.float32)
    for temperature in (0.5, 2.0):
        n = 6000
        counts = _support(_params(temperature=temperature, seed=5), logits, n=n)
        want = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
        got = np.array([counts.get(i, 0) / n for i in range(3)])
        assert np.abs(got - want).max() < 0.03, (temperature, got, want)


def test_repetition_penalty_changes_the_choice():
    s = Sampler(_params(temperature=0.0, repeat_penalty=1.5))
    pos = np.array([2.0, 1.9, -1.0], dtype=np.float32)
    assert s.sample(pos, []) == 0
    assert s.sample(pos, [0]) == 1  # 2.0 / 1.5 < 1.9
    neg = np.array([-1.0, -1.2], dtype=np.float32)
    assert s.sample(neg, [0]) == 1  # -1.0 * 1.5 < -1.2
    assert s.sample(pos, [0, 0, 0]) == 1  # once per distinct token: 2.0 / 1.5, not / 1.5**3
    before = pos.copy()
    s.sample(pos, [0])
    assert np.array_equal(pos, before)  # the caller's logits are not modified


def test_repetition_penalty_window():
    pos = np.array([2.0, 1.9], dtype=np.float32)
    windowed = Sampler(_params(temperature=0.0, repeat_penalty=1.5, repeat_last_n=2))
    assert windowed.sample(pos, [0, 1, 1]) == 0  # token 0 is outside the last 2
    assert windowed.sample(pos, [0, 5, 0]) == 1
    off = Sampler(_params(temperature=0.0, repeat_penalty=1.5, repeat_last_n=0))
    assert off.sample(pos, [0]) == 0
    everything = Sampler(_params(temperature=0.0, repeat_penalty=1.5, repeat_last_n=-1))
    assert everything.sample(pos, [0] + [5] * 1000) == 1


def test_penalty_comes_before_top_k():
    # after the penalty token 1 leads, so top_k=1 must pick it even though 0 had the top raw logit
    s = Sampler(_params(top_k=1, repeat_penalty=2.0, seed=1))
    assert s.sample(np.array([2.0, 1.5, 0.0], dtype=np.float32), [0]) == 1


def test_seed_determinism():
    logits = np.zeros(1000, dtype=np.float32)
    def run(seed):
        s = Sampler(_params(seed=seed))
        return [s.sample(logits, []) for _ in range(50)]
    assert run(123) == run(123)
    assert run(123) != run(124)
    # default params too (top-k / top-p / min-p active)
    rng = np.random.default_rng(0)
    big = rng.normal(size=5000).astype(np.float32)
    a, b = Sampler(SamplingParams(seed=9)), Sampler(SamplingParams(seed=9))
    assert [a.sample(big, []) for _ in range(30)] == [b.sample(big, []) for _ in range(30)]


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repeat_penalty", 0.0),
        ("repeat_last_n", -2),
        ("seed", -1),
        ("seed", "x"),
        ("frequency_penalty", float("nan")),
        ("presence_penalty", "x"),
    ],
)
def test_invalid_params(field, value):
    with pytest.raises(ClutorError, match=field):
        SamplingParams(**{field: value})


def test_bad_logits_shape():
    with pytest.raises(ClutorError, match="logits"):
        Sampler().sample(np.zeros((2, 3), dtype=np.float32), [])


def test_frequency_and_presence_penalties_follow_llama_cpp():
    # llama.cpp's penalties sampler: logit -= count * frequency + (count > 0) * presence, after the
    # repeat penalty, over the last repeat_last_n tokens
    s = Sampler(_params(frequency_penalty=0.5, presence_penalty=0.25, repeat_penalty=2.0, repeat_last_n=4))
    logits = np.array([3.0, -1.0, 2.0, 0.5], dtype=np.float32)
    out = s._penalise(logits, [9, 0, 0, 1, 0])  # window: 0, 0, 1, 0 (9 is outside it and out of range)
    assert out.tolist() == pytest.approx([3.0 / 2 - 3 * 0.5 - 0.25, -1.0 * 2 - 0.5 - 0.25, 2.0, 0.5])
    assert logits.tolist() == [3.0, -1.0, 2.0, 0.5]  # the caller's array is left alone
    greedy = Sampler(_params(temperature=0.0, presence_penalty=1.0))
    assert greedy.sample(np.array([2.0, 1.5], dtype=np.float32), [0]) == 1
    assert Sampler(_params(temperature=0.0, frequency_penalty=-1.0)).sample(
        np.array([1.0, 1.5], dtype=np.float32), [0]) == 0  # negative values encourage repeats


def test_token_logprobs_are_the_log_softmax():
    rng = np.random.default_rng(11)
    logits = rng.standard_normal(300).astype(np.float32) * 4
    logits[[5, 17]] = logits.max() + 1  # a tie at the top: the lower id first
    x = logits.astype(np.float64)
    ref = x - np.log(np.exp(x).sum())
    lp, top = token_logprobs(logits, 42, 5)
    assert lp == pytest.approx(ref[42], abs=1e-9)
    assert [i for i, _ in top] == np.lexsort((np.arange(300), -ref))[:5].tolist() and top[0][0] == 5
    assert [v for _, v in top] == pytest.approx(np.sort(ref)[::-1][:5], abs=1e-9)
    assert token_logprobs(logits, 3, 0) == (pytest.approx(ref[3], abs=1e-9), [])
    assert len(token_logprobs(logits[:3], 0, 10)[1]) == 3  # n past the vocabulary: all of it


@pytest.mark.parametrize("temperature", [1e-300, 1e-308, 5e-324])
def test_a_temperature_near_zero_is_greedy_not_nan(temperature):
    # vals / 1e-320 overflowed to inf, and softmax's inf - inf gave NaN probabilities
    logits = np.array([0.5, 3.0, -1.0, 2.9, 3.0 - 1e-6], dtype=np.float32)
    s = Sampler(_params(temperature=temperature, seed=3))
    with np.errstate(invalid="raise", over="raise"):
        picks = {s.sample(logits, []) for _ in range(50)}
    assert picks == {1}
    tied = np.array([1.0, 7.0, 7.0, -2.0], dtype=np.float32)
    with np.errstate(invalid="raise", over="raise"):
        picks = {s.sample(tied, []) for _ in range(200)}
    assert picks == {1, 2}  # the tied top tokens only, each drawn
