"""F16 weights times activations rounded to half, summed in the order llama.cpp's x86 CPU backend
(AVX2 + F16C) sums them: the q8 mode's F16 products.

Rounding x to half (ggml's vec_dot_type for F16) makes a product's inputs llama.cpp's exactly, but
a float32 result that differs from llama.cpp's by one ulp then rounds to the other half in the next
product's input whenever it sits near a half's midpoint, and such a flip (~5e-4 of the value) grows
layer by layer: on a six-layer Gemma 4 F16 fixture, one ulp at position 0 became 4.5e-3 of a logit.
Summed as ggml sums, the result is llama.cpp's to the bit and nothing flips. Two orders:

- "mul_mat" (a dense weight: llamafile's tinyBLAS, which llama.cpp runs for an F16 MUL_MAT of two
  tokens or more whose rows are a multiple of 8 long and whose row count is a multiple of 4): one
  8-lane FMA accumulator per output over the row's 8-element chunks in order, then lanes summed as
  (s0 + s2) + (s1 + s3), s_i = v_{i+4} + v_i. Otherwise (one token: a decode step) ggml's vec_dot,
  as below.
- "mul_mat_id" (experts: ggml_vec_dot_f16): four 8-lane accumulators, chunk c of each 32 into
  accumulator c; (a0 + a2) + (a1 + a3) lane by lane, then lanes (t0 + t1) + (t2 + t3),
  t_i = v_i + v_{i+4}; the elements past the last multiple of 32 added one by one in float64.

    matmul(x, w16, out, order)        x f32 [T, K] (half values), w16 uint16 [N, K] -> out f32 [T, N]
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = ["matmul", "ORDERS"]

ORDERS = ("mul_mat", "mul_mat_id")
# the float32 value of every half's bits (exact; 256 KiB)
_HALF = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(parallel=True, nogil=True, cache=True, boundscheck=False, fastmath={"contract"})
def _dots(x, w, half, n_acc, out):
    # contract (a * b + c fused, as _mm256_fmadd_ps) and nothing else: every sum in the order written
    T, K = x.shape
    N = w.shape[0]
    n_chunks = K // 8 if n_acc == 1 else (K // 32) * 4
    for r in prange(N):
        lanes = np.empty(32, np.float32)
        v = np.empty(8, np.float32)
        for t in range(T):
            for i in range(32):
                lanes[i] = np.float32(0.0)
            for c in range(n_chunks):
                base = (c % n_acc) * 8
                k0 = c * 8
                for i in range(8):
                    lanes[base + i] = x[t, k0 + i] * half[w[r, k0 + i]] + lanes[base + i]
            if n_acc == 1:
                s0 = lanes[4] + lanes[0]
                s1 = lanes[5] + lanes[1]
                s2 = lanes[6] + lanes[2]
                s3 = lanes[7] + lanes[3]
                out[t, r] = (s0 + s2) + (s1 + s3)
            else:
                for i in range(8):
                    v[i] = (lanes[i] + lanes[16 + i]) + (lanes[8 + i] + lanes[24 + i])
                t0 = v[0] + v[4]
                t1 = v[1] + v[5]
                t2 = v[2] + v[6]
                t3 = v[3] + v[7]
                acc = np.float64((t0 + t1) + (t2 + t3))
                for k in range(n_chunks * 8, K):
                    acc += np.float64(x[t, k] * half[w[r, k]])
                out[t, r] = np.float32(acc)


def matmul(x: np.ndarray, w16: np.ndarray, out: np.ndarray, order: str = "mul_mat") -> np.ndarray:
    """out [T, N] = x [T, K] @ W.T for W the halves w16 [N, K] (uint16 bits), summed in `order`'s
    order (module docstring); x must already hold half values (ggml rounds it first). Returns out."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    T, K = x.shape
    n_acc = 1 if order == "mul_mat" and T >= 2 and K % 8 == 0 and w16.shape[0] % 4 == 0 else 4
    _dots(x, w16, _HALF, n_acc, out)
    return out


def warmup() -> None:
    """Load (or compile) the kernel as the runner calls it for F16 weights summed in llama.cpp's order
    (an architecture with Arch.ggml_f16_sums): the file's read-only weights and writable ones, into an
    output of its own or a column range of one (q, k, v side by side)."""
    x = np.zeros((2, 64), np.float32)  # two rows, or a column range of the output would count as contiguous
    w = np.zeros((4, 64), np.uint16)
    ro = w.copy()
    ro.flags.writeable = False
    matmul(x, w, np.empty((2, 4), np.float32))
    matmul(x, ro, np.empty((2, 4), np.float32))
    matmul(x, ro, np.empty((2, 8), np.float32)[:, :4])
