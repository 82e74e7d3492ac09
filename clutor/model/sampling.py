"""Pick the next token from logits: llama.cpp's default sampler chain, in numpy.

Order (llama.cpp ``common_sampler`` default): repetition penalty -> top-k -> top-p -> min-p ->
temperature -> draw. Every stage keeps at least one token. ``temperature == 0`` is greedy: the
penalised argmax, ties going to the lowest id. Draws come from ``numpy.random.Generator(seed)``, so
a fixed seed repeats a run exactly (not llama.cpp's draws: its RNG is std::mt19937).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ClutorError

__all__ = ["SamplingParams", "Sampler", "token_logprobs"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options; a stage is off at its neutral value (top_k=0, top_p=1, min_p=0, penalty=1).

    The one place their defaults are written (llama.cpp's): generate(), the CLI and the server's
    request defaults take theirs from here. Internal: the public calls take these as keyword options."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # tokens of history the penalties look at; 0 = none, -1 = all
    seed: int | None = None
    frequency_penalty: float = 0.0  # OpenAI's: logit -= count in the window x this (0 = off)
    presence_penalty: float = 0.0   # OpenAI's: logit -= this once a token is in the window (0 = off)

    def __post_init__(self) -> None:
        def bad(field: str, expected: str) -> ClutorError:
            return ClutorError(f"SamplingParams.{field}: expected {expected}, got {getattr(self, field)!r}")

        def real(field: str) -> float:
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(field, "a finite number")
            return float(v)

        def integer(field: str) -> int:
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise bad(field, "an integer")
            return int(v)

        if real("temperature") < 0:
            raise bad("temperature", ">= 0 (0 = greedy)")
        if integer("top_k") < 0:
            raise bad("top_k", ">= 0 (0 = off)")
        if not 0 < real("top_p") <= 1:
            raise bad("top_p", "in (0, 1] (1 = off)")
        if not 0 <= real("min_p") <= 1:
            raise bad("min_p", "in [0, 1] (0 = off)")
        if real("repeat_penalty") <= 0:
            raise bad("repeat_penalty", "> 0 (1 = off)")
        if integer("repeat_last_n") < -1:
            raise bad("repeat_last_n", ">= -1 (0 = off, -1 = whole history)")
        real("frequency_penalty"), real("presence_penalty")
        if self.seed is not None and integer("seed") < 0:
            raise bad("seed", "None or an integer >= 0")


class Sampler:
    """Stateful only in its random generator: same params + seed + inputs -> same tokens."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params if params is not None else SamplingParams()
        self._rng = np.random.default_rng(self.params.seed)

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """Next token id from ``logits`` [n_vocab] given the ids so far (``history``, oldest first)."""
        p = self.params
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise ClutorError(f"Sampler.sample: logits: expected a non-empty 1-D array, got shape {logits.shape}")
        logits = self._penalise(logits, history)  # [V] float32, a copy if penalised

        if p.temperature == 0:
            return int(np.argmax(logits))  # argmax returns the first (lowest) id on ties

        # Candidates sorted by logit (descending), ties by id, so every run sees the same order.
        # (top_k=0 sorts the whole vocabulary: tens of ms at 150k tokens.)
        k = p.top_k if 0 < p.top_k < logits.size else logits.size
        if k < logits.size:
            ids = np.sort(np.argpartition(-logits, k - 1)[:k])  # [k] the k largest, by id
        else:
            ids = np.arange(logits.size)
        vals = logits[ids].astype(np.float64)  # [k]
        order = np.argsort(-vals, kind="stable")  # stable: equal logits stay in id order
        ids, vals = ids[order], vals[order]

        if p.top_p < 1.0 and ids.size > 1:
            probs = _softmax(vals)
            # keep the shortest prefix whose mass reaches top_p (the token crossing it included)
            n = int(np.searchsorted(np.cumsum(probs), p.top_p, side="left")) + 1
            ids, vals = ids[:n], vals[:n]

        if p.min_p > 0.0 and ids.size > 1:
            # prob >= min_p * max_prob  <=>  logit >= max_logit + log(min_p); vals[0] is the max
            n = int(np.count_nonzero(vals >= vals[0] + math.log(p.min_p)))
            ids, vals = ids[: max(n, 1)], vals[: max(n, 1)]

        # shifted by the top logit (vals[0]) before dividing: at a temperature near 0 (1e-320 is a valid
        # float) vals / T overflows to inf and inf - inf is NaN; shifted, the top token gets exp(0) = 1
        # and the rest exp(-inf) = 0, which is greedy, as the limit T -> 0 should be
        with np.errstate(over="ignore"):  # (-x / 1e-320 = -inf is the intended result)
            probs = _softmax((vals - vals[0]) / p.temperature)  # [n]
        cdf = np.cumsum(probs)
        j = int(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"))
        return int(ids[min(j, ids.size - 1)])

    def _penalise(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        p = self.params
        off = p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
        if off or p.repeat_last_n == 0 or len(history) == 0:
            return logits
        recent = history if p.repeat_last_n < 0 else history[-p.repeat_last_n :]
        seen, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
        ok = (seen >= 0) & (seen < logits.size)
        seen, counts = seen[ok], counts[ok]
        out = logits.astype(np.float32, copy=True)
        v = out[seen]
        # llama.cpp's penalties sampler: divide a positive logit, multiply a negative one, once per
        # distinct token; then subtract count x frequency + presence
        v = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        out[seen] = v - counts * np.float32(p.frequency_penalty) - np.float32(p.presence_penalty)
        return out


def token_logprobs(logits: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under the log-softmax of the raw ``logits`` [V] (before any
    penalty or truncation, as OpenAI and llama.cpp's server report it), and the ``n`` most likely
    (id, logprob) pairs, most likely first, ties to the lower id."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)  # [V]
    m = x.max()
    lp = x - (m + math.log(np.exp(x - m).sum()))  # [V] log-softmax
    top: list[tuple[int, float]] = []
    if n > 0:
        n = min(n, lp.size)
        ids = np.argpartition(-lp, n - 1)[:n] if n < lp.size else np.arange(lp.size)  # [n] unordered
        ids = ids[np.lexsort((ids, -lp[ids]))]  # by logprob descending, then id
        top = [(int(i), float(lp[i])) for i in ids]
    return float(lp[token]), top


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
