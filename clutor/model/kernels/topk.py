"""The softmax router's top-k (layers.route) compiled, to numpy's bits.

    sel, w = softmax_topk(logits, k, renorm)     logits f32 [T, E] -> experts int64 [T, K], weights f32 [T, K]

What numpy computes for ``p = softmax(logits); sel = argsort(-p, stable)[:, :k]; w = p[sel]`` (and
``w / sum(w)`` when renorm), but in three calls instead of a dozen: numpy's array calls cost ~5 us
each, ~0.1 ms per layer and token for a 32-expert router whose arithmetic takes 1 us. The bits are
numpy's: the exponential is numpy's own (np.exp: its SIMD expf differs from libm's, which compiled
code would call, in ~40% of float32 inputs), and the sums run in numpy's pairwise order (_np_sum), so
a row's experts and weights are those the numpy code gives, ties to the lower expert id.
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["MAX_EXPERTS", "softmax_topk"]

# No fastmath: every sum and division runs as written (a reassociated sum or a reciprocal multiply
# would move the last bits away from numpy's).
_opts = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")

_PW_BLOCK = 128  # numpy's pairwise summation block (PW_BLOCKSIZE in loops_utils.h)


@njit(**_opts)
def _sum_block(a, lo, n):
    """sum(a[lo : lo + n]), n <= 128, in numpy's order (pairwise_sum's leaf): fewer than 8 in order,
    else eight interleaved partial sums combined as a tree, then the last n % 8 in order."""
    if n < 8:
        s = np.float32(-0.0)
        for i in range(lo, lo + n):
            s += a[i]
        return s
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - n % 8:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    s = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        s += a[lo + i]
        i += 1
    return s


@njit(**_opts)
def _first_half(n):
    """numpy's split of a pairwise sum longer than 128: the first part half, a multiple of 8 long."""
    n2 = n // 2
    return n2 - n2 % 8


# numpy splits a sum longer than _PW_BLOCK in two halves summed apart, recursively. Four levels by
# hand (numba's cache cannot hold a recursive function): after k splits a part is at most n / 2^k + 8
# long, so four reach the leaves of any sum up to MAX_EXPERTS.
MAX_EXPERTS = 1024


@njit(**_opts)
def _sum1(a, lo, n):
    if n <= _PW_BLOCK:
        return _sum_block(a, lo, n)
    n2 = _first_half(n)
    return _sum_block(a, lo, n2) + _sum_block(a, lo + n2, n - n2)


@njit(**_opts)
def _sum2(a, lo, n):
    if n <= _PW_BLOCK:
        return _sum_block(a, lo, n)
    n2 = _first_half(n)
    return _sum1(a, lo, n2) + _sum1(a, lo + n2, n - n2)


@njit(**_opts)
def _sum3(a, lo, n):
    if n <= _PW_BLOCK:
        return _sum_block(a, lo, n)
    n2 = _first_half(n)
    return _sum2(a, lo, n2) + _sum2(a, lo + n2, n - n2)


@njit(**_opts)
def _np_sum(a, lo, n):
    """sum(a[lo : lo + n]) in numpy's order for a contiguous float32 reduction (pairwise_sum), n <= MAX_EXPERTS."""
    if n <= _PW_BLOCK:
        return _sum_block(a, lo, n)
    n2 = _first_half(n)
    return _sum3(a, lo, n2) + _sum3(a, lo + n2, n - n2)


@njit(**_opts)
def _shift(logits):
    """logits [T, E] -> logits - each row's max (in place): softmax's argument."""
    T, E = logits.shape
    for t in range(T):
        m = logits[t, 0]
        for e in range(1, E):
            v = logits[t, e]
            if v > m or np.isnan(v):  # np.max propagates NaN
                m = v
        for e in range(E):
            logits[t, e] -= m


@njit(**_opts)
def _topk(ex, k, renorm, sel, w):
    """ex [T, E] = exp(shifted logits) -> in place the probabilities ex / row sum; sel [T, K] the k
    largest, descending, ties to the lower id (a stable argsort of -p); w [T, K] their probabilities
    (over their own sum when renorm)."""
    T, E = ex.shape
    taken = np.zeros(E, np.bool_)
    for t in range(T):
        row = ex[t]
        s = _np_sum(row, 0, E)
        for e in range(E):
            row[e] = row[e] / s
        taken[:] = False
        for j in range(k):  # selection: k passes over the E probabilities (k small)
            best = -1
            for e in range(E):
                if not taken[e] and (best < 0 or row[e] > row[best] or (np.isnan(row[best]) and not np.isnan(row[e]))):
                    best = e  # NaN ranks last, as in numpy's sort
            taken[best] = True
            sel[t, j] = best
            w[t, j] = row[best]
        if renorm:
            ws = _np_sum(w[t], 0, k)
            for j in range(k):
                w[t, j] = w[t, j] / ws


def softmax_topk(logits: np.ndarray, k: int, renorm: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """logits f32 [T, E] (overwritten) -> (experts int64 [T, K], weights f32 [T, K]); see the module
    docstring. None (logits untouched) beyond MAX_EXPERTS experts: the caller computes them itself."""
    if logits.shape[1] > MAX_EXPERTS or logits.dtype != np.float32 or not logits.flags.c_contiguous:
        return None
    _shift(logits)
    np.exp(logits, out=logits)  # numpy's expf, as layers.softmax takes it
    sel = np.empty((logits.shape[0], k), np.int64)
    w = np.empty((logits.shape[0], k), np.float32)
    _topk(logits, k, renorm, sel, w)
    return sel, w
