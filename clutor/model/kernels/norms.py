"""RMS norm as ggml computes it (ggml_compute_forward_rms_norm_f32, then the weight's multiply), one
compiled call where numpy's took five (~30 us on a small row, 17 per token on a 4-layer model):

    sum = sum of (float)(x * x) in double, in order;  mean = (float)(sum / n)
    y   = (x * (1.0f / sqrtf(mean + eps))) * w

    x [R, n] float32 (any strides), w [n] float32, out [R, n] float32

The sum runs in order in double precision (no reassociation), so a row's result is the same bits in
any batch, and it is ggml's (numpy's float32 pairwise sum differed from it in the last bits).
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["rmsnorm_rows"]


@njit(nogil=True, cache=True, boundscheck=False)
def _rmsnorm(x, w, eps, out):
    R, n = x.shape
    for r in range(R):
        s = 0.0
        for i in range(n):
            v = x[r, i]
            s += np.float64(v * v)
        mean = np.float32(s / n)
        scale = np.float32(1.0) / np.sqrt(mean + eps)
        for i in range(n):
            out[r, i] = (x[r, i] * scale) * w[i]


def rmsnorm_rows(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [R, n] float32, w [n] float32 -> float32 [R, n] (see the module docstring)."""
    out = np.empty(x.shape, np.float32)
    _rmsnorm(x, w, np.float32(eps), out)
    return out
