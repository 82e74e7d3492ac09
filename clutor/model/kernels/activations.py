"""Round activations to int8 blocks for the integer kernels, exactly as ggml's CPU backend does.

llama.cpp multiplies each weight type with activations of its ``vec_dot_type`` (ggml-cpu.c), made by
that type's ``from_float`` on x86 (ggml-cpu/arch/x86/quants.c, ggml-quants.c). Two block kinds:

- ``Q8_0`` (32 elements; the activation type of Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4 weights) and ``Q8_1``
  (of Q4_1, Q5_1: the same quants plus a sum): amax = max|x|, d = amax / 127 (float32), stored as an
  IEEE half; q = round-half-even(x * (127 / amax)) (0 when amax is 0); Q8_1's s = half(d * sum(q))
  (the unrounded d).
- ``Q8_K`` (256 elements; the activation type of every K-quant and i-quant): max = the first element
  of largest magnitude, iscale = -127 / max, q = min(127, round-half-even(iscale * x)), d = 1 / iscale
  (float32: so d is negative when that element is positive, and d * q ~= x either way), bsums = sums of
  q per 16 elements.

The outputs (the interface the int8 kernels and their Formats read; caller-owned, no allocation):
    xq  int8    [T, K]          the quants (both kinds)
    xd  float32 [T, K / block]  the scale: Q8_0/Q8_1's half widened to float, or Q8_K's d
    xs1 float32 [T, K / 32]     block 32 only: Q8_1's s (half(d * sum q), widened)
    xs16 int16  [T, K / 16]     block 256 only: Q8_K's bsums
F16 and BF16 weights take activations rounded to their own type (as_half, as_bf16); F32 weights take
them as they are.

Bit for bit what llama.cpp's quantize_row_q8_0 / _q8_1 / _q8_K write (tests/test_activations.py checks
against bytes recorded from llama.cpp by tools/record_quants.py).

Compiled without fast-math: d = amax / 127 must stay a division (fast-math would turn it into a
multiplication by 1/127, which rounds differently), and the products must not be contracted.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["quantize_activations", "round_half", "as_half", "as_bf16", "dequantised", "Q8_0_BLOCK", "Q8_K_BLOCK"]

Q8_0_BLOCK = 32   # Q8_0 / Q8_1 activations
Q8_K_BLOCK = 256  # Q8_K activations

_opts = dict(nogil=True, fastmath=False, cache=True, boundscheck=False, error_model="numpy")


@njit(**_opts)
def round_half(v):
    """float32 v -> the nearest IEEE half (ties to even, as F16C's vcvtps2ph with imm 0), as float32.

    In float64, where every step is exact: v scaled by a power of two so that the half's last bit is
    the units digit, rounded half-even (rint), scaled back."""
    a = abs(np.float64(v))
    if a == 0.0 or a != a:
        return np.float32(v)
    if a >= 65520.0:  # rounds past the largest half, 65504
        return np.float32(math.copysign(np.inf, v))
    m, e = math.frexp(a)  # a = m * 2**e, 0.5 <= m < 1
    shift = 24 if e < -13 else 11 - e  # subnormal halves are multiples of 2**-24
    r = math.ldexp(np.rint(math.ldexp(a, shift)), -shift)
    return np.float32(math.copysign(r, v))


@njit(**_opts)
def _q8_0_rows(x, xq, xd, xs1):
    n_tok, k = x.shape
    for t in range(n_tok):
        xr = x[t]
        qr = xq[t]
        for b in range(k // 32):
            e0 = 32 * b
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(xr[e0 + j]))
            d = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            s = 0
            for j in range(32):
                q = int(np.rint(xr[e0 + j] * inv))
                qr[e0 + j] = q
                s += q
            xd[t, b] = round_half(d)
            xs1[t, b] = round_half(d * np.float32(s))


@njit(**_opts)
def _q8_k_rows(x, xq, xd, xs16):
    n_tok, k = x.shape
    for t in range(n_tok):
        xr = x[t]
        qr = xq[t]
        for b in range(k // 256):
            e0 = 256 * b
            amax = np.float32(0.0)
            mx = np.float32(0.0)
            for j in range(256):
                ax = abs(xr[e0 + j])
                if ax > amax:
                    amax = ax
                    mx = xr[e0 + j]
            if amax == 0:
                xd[t, b] = 0.0
                for j in range(256):
                    qr[e0 + j] = 0
                for g in range(16):
                    xs16[t, 16 * b + g] = 0
                continue
            iscale = np.float32(-127.0) / mx
            for g in range(16):
                s = 0
                for j in range(16):
                    q = min(127, int(np.rint(iscale * xr[e0 + 16 * g + j])))
                    qr[e0 + 16 * g + j] = q
                    s += q
                xs16[t, 16 * b + g] = s
            xd[t, b] = np.float32(1.0) / iscale


@njit(**_opts)
def quantize_activations(x, block, xq, xd, xs1, xs16):
    """x f32 [T, K] -> ggml's Q8_0/Q8_1 (block 32) or Q8_K (block 256) activation blocks: xq, xd and
    xs1 (block 32) or xs16 (block 256), shaped as the module docstring says."""
    if block == 32:
        _q8_0_rows(x, xq, xd, xs1)
    else:
        _q8_k_rows(x, xq, xd, xs16)


def as_half(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """x f32 -> out f32: each element rounded to the nearest IEEE half (ties to even), as ggml
    converts the activations of an F16 weight (ggml_cpu_fp32_to_fp16; past 65504: inf)."""
    with np.errstate(over="ignore"):
        out[...] = x.astype(np.float16)
    return out


def as_bf16(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """x f32 -> out f32: each element rounded to bfloat16 as ggml converts the activations of a BF16
    weight (ggml_compute_fp32_to_bf16: ties to even; a NaN stays a NaN)."""
    u = x.view(np.uint32)
    r = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) & np.uint32(0xFFFF0000)).astype(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        r[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(64)) << np.uint32(16)
    out.view(np.uint32)[...] = r
    return out


def dequantised(xq: np.ndarray, xd: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The activation blocks back as floats, d * q: xq int8 [T, K], xd [T, K / block] -> out f32 [T, K].
    What the int8 kernels multiply with, for the paths that multiply in float (BLAS)."""
    T, K = xq.shape
    nb = xd.shape[1]
    np.multiply(xq.reshape(T, nb, K // nb), xd[:, :, None], out=out.reshape(T, nb, K // nb))
    return out
