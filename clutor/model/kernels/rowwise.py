"""Float products whose every output row is computed alone: the same row gives the same bits whatever
else is in the step (clutor.model.step's attention, the routers' logits).

BLAS does not promise that: numpy hands a one-row product to sgemv and a several-row one to sgemm,
whose sums run in different orders, so a row's router logits or attention scores moved by ~1e-7
with the rows batched beside it. Mostly harmless, but a router choosing its top-k between two
experts within 1e-7 of each other then picks differently, and the step's result moves by ~1e-2: a
request's sampled tokens depended on which other requests shared its steps. Here each output
element is one loop in a fixed order (vectorised the same way whatever the row count: the sums'
order depends only on their length), and each (row, head) is computed by one thread, so the thread
count does not change a bit either.

    attend(q, K, V, p0, k0, scale, window, sinks, out)    causal attention, rows t of q at p0 + t
    rowdot(x, w, out)                                     out[t, e] = x[t] . w[e], summed as llama.cpp
                                                          sums a product of several rows (bit for bit)
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import _apply_threads

__all__ = ["attend", "rowdot", "threads_for"]

_FLAGS = {"reassoc", "contract"}  # no nnan / ninf: -inf is a real value here (the running max's start)
_SMALL = 1 << 17  # multiply-adds below which one thread is done before a second one wakes (~10 us)


@njit(parallel=True, nogil=True, cache=True, boundscheck=False, fastmath=_FLAGS)
def _attend(q, K, V, p0, k0, scale, window, sinks, use_sinks, scores, out):
    T, H, dk = q.shape
    Hkv, dv = K.shape[0], V.shape[2]
    G = H // Hkv
    for i in prange(H * T):
        h = i // T
        t = i - h * T
        hk = h // G
        qp = p0 + t
        hi = qp - k0 + 1  # keys k0 .. qp (causal)
        lo = 0
        if window > 0:
            lo = max(0, qp - window + 1 - k0)
        s = scores[i]
        m = -np.inf
        for j in range(lo, hi):
            acc = np.float32(0.0)
            for d in range(dk):
                acc += q[t, h, d] * K[hk, j, d]
            v = acc * scale
            s[j] = v
            if v > m:
                m = v
        if use_sinks and sinks[h] > m:
            m = sinks[h]
        den = np.float32(0.0)
        for j in range(lo, hi):
            e = np.exp(s[j] - m)
            s[j] = e
            den += e
        if use_sinks:
            den += np.exp(sinks[h] - m)  # the sink takes probability mass and adds no value
        base = h * dv
        for d in range(dv):
            out[t, base + d] = 0.0
        for j in range(lo, hi):
            e = s[j]
            for d in range(dv):
                out[t, base + d] += e * V[hk, j, d]
        inv = np.float32(1.0) / den
        for d in range(dv):
            out[t, base + d] *= inv


@njit(inline="always", fastmath={"contract"})
def _rowdot_one(x, w, t, e):
    # llama.cpp's F32 product of two rows or more (tinyBLAS on AVX2): one 8-lane FMA accumulator over
    # the 8-element chunks in order, lanes summed as (s0 + s2) + (s1 + s3), s_i = v_{i+4} + v_i; only
    # contraction allowed, so every sum runs as written. D not a multiple of 8: one sum in order.
    D = x.shape[1]
    if D % 8 == 0:
        v0 = v1 = v2 = v3 = v4 = v5 = v6 = v7 = np.float32(0.0)
        for k in range(0, D, 8):
            v0 = x[t, k] * w[e, k] + v0
            v1 = x[t, k + 1] * w[e, k + 1] + v1
            v2 = x[t, k + 2] * w[e, k + 2] + v2
            v3 = x[t, k + 3] * w[e, k + 3] + v3
            v4 = x[t, k + 4] * w[e, k + 4] + v4
            v5 = x[t, k + 5] * w[e, k + 5] + v5
            v6 = x[t, k + 6] * w[e, k + 6] + v6
            v7 = x[t, k + 7] * w[e, k + 7] + v7
        return ((v4 + v0) + (v6 + v2)) + ((v5 + v1) + (v7 + v3))
    acc = np.float32(0.0)
    for d in range(D):
        acc = x[t, d] * w[e, d] + acc
    return acc


@njit(parallel=True, nogil=True, cache=True, boundscheck=False, fastmath={"contract"})
def _rowdot(x, w, out):
    T, E = x.shape[0], w.shape[0]
    for i in prange(T * E):
        t = i // E
        e = i - t * E
        out[t, e] = _rowdot_one(x, w, t, e)


@njit(nogil=True, cache=True, boundscheck=False, fastmath={"contract"})
def _rowdot_serial(x, w, out):
    # _rowdot on the calling thread: a decode step's router (one row, 32 x 256) is done in a few
    # microseconds, less than entering a parallel region costs, even a one-thread one
    T, E = x.shape[0], w.shape[0]
    for t in range(T):
        for e in range(E):
            out[t, e] = _rowdot_one(x, w, t, e)


_NO_SINKS = np.zeros(1, np.float32)


def threads_for(work: int) -> None:
    """One thread for small work (multiply-adds); otherwise the count the caller's last product set (the model's)."""
    if work < _SMALL:
        _apply_threads(1)


def attend(q: np.ndarray, K: np.ndarray, V: np.ndarray, p0: int, k0: int, scale: float, *, window: int = 0,
           sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal GQA attention of q [T, H, dk] at positions p0 .. p0 + T - 1 over keys K [Hkv, N, dk] and
    values V [Hkv, N, dv] at positions k0 .. k0 + N - 1 (N = p0 + T - k0) -> float32 [T, H * dv].
    window > 0: a query at i sees keys j with i - j < window; sinks [H]: a logit per head joining
    each softmax's denominator (gpt-oss). All float32."""
    T, H, dk = q.shape
    n = K.shape[1]
    if q.dtype != np.float32:
        q = q.astype(np.float32)
    out = np.empty((T, H * V.shape[2]), np.float32)
    scores = np.empty((H * T, n), np.float32)
    threads_for(T * H * n * (dk + V.shape[2]))
    _attend(q, K, V, int(p0), int(k0), np.float32(scale), int(window),
            _NO_SINKS if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32), sinks is not None,
            scores, out)
    return out


def rowdot(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, D] @ w [E, D].T -> float32 [T, E], each element alone (see the module docstring)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    if x.shape[0] * w.shape[0] * x.shape[1] < _SMALL:
        _rowdot_serial(x, w, out)
    else:
        _rowdot(x, w, out)
    return out
