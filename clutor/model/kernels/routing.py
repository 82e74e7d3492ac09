"""Softmax top-k routing in one compiled call (clutor.model.layers.route), where numpy's way (max, exp,
sum, divide, a stable argsort of the whole row, take_along_axis, a cast) cost ~8 calls per MoE layer.

    logits [T, E] float32 -> experts int64 [T, k] (the k most probable, ties to the lower id, as a
    stable sort of -p), weights float32 [T, k] (their probabilities, divided by their sum when renorm)

Each row alone, its sums in order: a row's experts and weights are the same bits in any batch.
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["softmax_topk"]
@njit(nogil=True, cache=True, boundscheck=False)
def _softmax_topk(logits, k, renorm, sel, w):
    T, E = logits.shape
    p = np.empty(E, np.float32)
    for t in range(T):
        m = logits[t, 0]
        for e in range(1, E):
            if logits[t, e] > m:
                m = logits[t, e]
        s = np.float32(0.0)
        for e in range(E):
            v = np.exp(logits[t, e] - m)
            p[e] = v
            s += v
        for e in range(E):
            p[e] = p[e] / s
        for j in range(k):  # the k largest, ties to the lower id (a stable sort of -p)
            b = -1
            for e in range(E):
                if p[e] >= 0 and (b < 0 or p[e] > p[b]):
                    b = e
            sel[t, j] = b
            w[t, j] = p[b]
            p[b] = -1.0
        if renorm:
            s = np.float32(0.0)
            for j in range(k):
                s += w[t, j]
            for j in range(k):
                w[t, j] = w[t, j] / s


def softmax_topk(logits: np.ndarray, k: int, renorm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax of logits [T, E] float32 over all experts, its k largest (ties to the lower id), their
    weights divided by their sum when renorm -> (experts int64 [T, k], weights float32 [T, k])."""
    T = logits.shape[0]
    sel = np.empty((T, k), np.int64)
    w = np.empty((T, k), np.float32)
    _softmax_topk(logits, k, renorm, sel, w)
    return sel, w
