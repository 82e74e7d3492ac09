"""RMS norm as ggml computes it (clutor.model.kernels.norms): its float32 squares summed in double,
the mean rounded to float32, then x * (1 / sqrt(mean + eps)) * w in float32."""
from __future__ import annotations

import math

import numpy as np

from clutor.model.layers import rmsnorm


def test_rmsnorm_is_ggmls_and_the_same_bits_in_any_batch():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 2048)) * rng.uniform(0.01, 100, (7, 1))).astype(np.float32)
    w = rng.standard_normal(2048).astype(np.float32)
    eps = 1e-6
    got = rmsnorm(x, w, eps)
    for r in range(len(x)):
        mean = np.float32(math.fsum((x[r] * x[r]).astype(np.float64)) / x.shape[1])  # the exact sum, rounded
        scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
        assert np.array_equal(got[r], (x[r] * scale) * w)
        assert np.array_equal(rmsnorm(x[r : r + 1], w, eps)[0], got[r])  # alone as in the batch
    heads = rmsnorm(x.reshape(7, 16, 128), w[:128], eps)  # per head: any leading axes, any strides
    assert np.array_equal(heads, rmsnorm(x.reshape(-1, 128), w[:128], eps).reshape(7, 16, 128))
    assert np.array_equal(rmsnorm(x[:, ::2], w[:1024], eps), rmsnorm(np.ascontiguousarray(x[:, ::2]), w[:1024], eps))

