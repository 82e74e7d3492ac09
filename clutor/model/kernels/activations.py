"""Round activations to int8 blocks for the integer kernels (llama.cpp's Q8_0 / Q8_K idea).

Each block of `block` elements (32 for the 32-element weight types, 256 for K-quants) gets one
scale d = max|x| / 127 and q = rint(x / d) in [-127, 127], so x ~= d * q with |error| <= d / 2 per
element. Sums of q per 32 and per 16 elements are kept for the weight types whose values carry an
offset or a min (they turn sum_i (a*q_i + m) x_i into a*dot + m*sum).
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["quantize_activations"]


@njit(nogil=True, fastmath=True, cache=True, boundscheck=False, error_model="numpy")
def quantize_activations(x, block, xq, xd, xs32, xs16):
    """x f32 [T, K] -> xq int8 [T, K], xd f32 [T, K/block], xs32 int32 [T, K/32], xs16 int16 [T, K/16]."""
    n_tok, k = x.shape
    nb = k // block
    tmp = np.empty(block, np.float32)
    for t in range(n_tok):
        xr = x[t]
        qr = xq[t]
        for b in range(nb):
            seg = xr[b * block : (b + 1) * block]
            amax = np.float32(0.0)
            for j in range(block):
                amax = max(amax, abs(seg[j]))
            d = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            for j in range(block):
                tmp[j] = np.rint(seg[j] * inv)
            qs = qr[b * block : (b + 1) * block]
            for j in range(block):
                qs[j] = np.int8(tmp[j])
            xd[t, b] = d
        for g in range(k // 16):
            s = np.int32(0)
            for j in range(16):
                s += np.int32(qr[16 * g + j])
            xs16[t, g] = np.int16(s)
        for g in range(k // 32):
            xs32[t, g] = np.int32(xs16[t, 2 * g]) + np.int32(xs16[t, 2 * g + 1])
