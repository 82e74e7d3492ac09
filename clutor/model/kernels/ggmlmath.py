"""Float arithmetic in the order llama.cpp's x86 CPU backend (AVX2 + FMA) runs it, bit for bit: Gemma 4's
attention, router softmax and RoPE angles in the q8 mode. Its F16 products round their inputs to
half, so a one-ulp difference anywhere flips a half in the next product and grows layer by layer
(rowwise.attend and numpy sum and exponentiate otherwise).

Attention without flash attention, over an F32 KV cache.
Per (row t, head h), keys at absolute positions k0 + j (llama.cpp's cell index: lanes and chunks
below are counted from position 0):
- scores: ggml_vec_dot_f32 (q is a permuted view, so no tinyBLAS): four 8-lane FMA accumulators,
  chunk c of each 32 elements into accumulator c % 4, reduced (a0 + a2) + (a1 + a3), then
  t_i = v_i + v_{i+4}, (t0 + t1) + (t2 + t3); elements past the last 32 added in float64. Times scale.
- softmax (ggml_vec_soft_max_f32): e = ggml_v_expf(s - max) for the visible keys (0 for the
  others), each 8-position chunk summed as (u0 + u2) + (u1 + u3), u_i = e_{i+4} + e_i, the chunks
  added in float64; p = e * float32(1 / sum).
- values: two rows or more of the sequence in the step (llamafile's tinyBLAS): one 8-lane FMA
  accumulator per output over the positions, lane = position % 8, summed as the softmax's chunks;
  one row (a decode step): ggml_vec_dot_f32's order over the positions, as the scores.

RoPE's angles as ggml's CPU RoPE computes them: the position times base^(-2/n_rot) i times over in
float32, divided by the pair's frequency factor, then libm's cosf / sinf (numba's float32 math.cos
and math.sin call them; numpy's float32 cos is another approximation, an ulp apart about one time
in ten).

    attend(q, K, V, p0, k0, scale, window)     q [T, H, dk] at p0.., K [Hkv, N, dk], V [Hkv, N, dv]
                                               at k0.. -> float32 [T, H * dv]
    rope_cos_sin(pos, theta_scale, factors)    pos [R] -> cos, sin float32 [R, n_rot/2]
    softmax(x)                                 x [T, n] -> float32 [T, n], ggml_soft_max's rows
    gelu_table()                               float32 [65536]: ggml's GELU of every half, as a half

softmax: each row's ggml_vec_soft_max_f32 as the attention's (8-element chunks through
ggml_v_expf, the rest through libm's expf, all summed in float64), then times float32(1 / sum).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

__all__ = ["attend", "expf", "gelu_table", "rope_cos_sin", "softmax"]

_F = np.float32
# ggml_v_expf's constants (vec.h)
_R = _F(float.fromhex("0x1.8p23"))
_LOG2E = _F(float.fromhex("0x1.715476p+0"))
_LN2_HI = _F(float.fromhex("0x1.62e4p-1"))
_LN2_LO = _F(float.fromhex("0x1.7f7d1cp-20"))
_C5 = _F(float.fromhex("0x1.0e4020p-7"))
_C4 = _F(float.fromhex("0x1.573e2ep-5"))
_C3 = _F(float.fromhex("0x1.555e66p-3"))
_C2 = _F(float.fromhex("0x1.fffdb6p-2"))
_C1 = _F(float.fromhex("0x1.ffffecp-1"))
_ONE = _F(1.0)
_S1_NEG = _F(2.0 ** -125)  # s1 for n <= 0: bits 0x82000000 + 0x7f000000
_S1_POS = _F(2.0 ** 127)   # s1 for n > 0: bits 0x7f000000

# contract only (a * b + c fused, as _mm256_fmadd_ps; x - a * b as _mm256_fnmadd_ps): every sum as written
_FLAGS = {"contract"}


@njit(nogil=True, cache=True)
def _fma(a, b, c):
    """float32 a * b + c rounded once (the product is exact in float64; rounding the float64 sum
    to float32 differs from a true FMA only on a double-rounding tie, ~2^-29 of the time)."""
    return _F(np.float64(a) * np.float64(b) + np.float64(c))


@njit(nogil=True, cache=True)
def _expf(x):
    """ggml_v_expf of one float32 lane (x <= 0 in a softmax; -inf gives 0). No fast-math at all:
    which product an FMA takes is written out, as in vec.h."""
    if x != x:
        return x
    if x == -np.inf:
        return _F(0.0)
    z = _fma(x, _LOG2E, _R)
    n = z - _R
    b = _fma(-n, _LN2_LO, _fma(-n, _LN2_HI, x))
    u = b * b
    j = _fma(_fma(_fma(_C5, b, _C4), u, _fma(_C3, b, _C2)), u, _C1 * b)
    if abs(n) <= _F(126.0):
        k = _F(2.0 ** int(n))  # the exponent bits (z << 23) + 1.0's: exactly 2^n here
        return _fma(j, k, k)
    if abs(n) > _F(192.0):
        s1 = _S1_NEG if n <= 0 else _S1_POS
        return s1 * s1
    if n <= 0:
        s1, s2 = _S1_NEG, _F(2.0 ** (int(n) + 125))
    else:
        s1, s2 = _S1_POS, _F(2.0 ** (int(n) - 127))
    return _fma(s2, j, s2) * s1


@njit(nogil=True, cache=True, fastmath=_FLAGS, inline="always")
def _hsum8(v):
    """tinyBLAS's hsum of an __m256 (and the softmax's chunk sum)."""
    s0 = v[4] + v[0]
    s1 = v[5] + v[1]
    s2 = v[6] + v[2]
    s3 = v[7] + v[3]
    return (s0 + s2) + (s1 + s3)


@njit(nogil=True, cache=True, fastmath=_FLAGS, inline="always")
def _reduce4(a):
    """GGML_F32_VEC_REDUCE of four 8-lane accumulators a [32] (accumulator i at 8 i)."""
    t0 = ((a[0] + a[16]) + (a[8] + a[24])) + ((a[4] + a[20]) + (a[12] + a[28]))
    t1 = ((a[1] + a[17]) + (a[9] + a[25])) + ((a[5] + a[21]) + (a[13] + a[29]))
    t2 = ((a[2] + a[18]) + (a[10] + a[26])) + ((a[6] + a[22]) + (a[14] + a[30]))
    t3 = ((a[3] + a[19]) + (a[11] + a[27])) + ((a[7] + a[23]) + (a[15] + a[31]))
    return (t0 + t1) + (t2 + t3)


@njit(parallel=True, nogil=True, cache=True, boundscheck=False, fastmath=_FLAGS)
def _attend(q, K, V, p0, k0, scale, window, scores, out):
    T, H, dk = q.shape
    Hkv, dv = K.shape[0], V.shape[2]
    G = H // Hkv
    tiny = T >= 2
    n32 = dk - dk % 32
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
        acc = np.empty(32, np.float32)
        m = _F(-np.inf)  # float32: a float64 max would make s - m exact
        for j in range(lo, hi):
            for a in range(32):
                acc[a] = _F(0.0)
            for d0 in range(0, n32, 32):
                for a in range(32):
                    acc[a] = q[t, h, d0 + a] * K[hk, j, d0 + a] + acc[a]
            sf = np.float64(_reduce4(acc))
            for d in range(n32, dk):
                sf += np.float64(q[t, h, d] * K[hk, j, d])
            v = _F(sf) * scale
            s[j] = v
            if v > m:
                m = v
        lanes = np.empty(8, np.float32)
        tot = 0.0
        for c in range((k0 + lo) // 8, (k0 + hi - 1) // 8 + 1):
            for l in range(8):
                j = c * 8 + l - k0
                if lo <= j < hi:
                    e = _expf(_F(s[j] - m))
                    s[j] = e
                    lanes[l] = e
                else:
                    lanes[l] = _F(0.0)
            tot += np.float64(_hsum8(lanes))
        inv = _F(1.0 / tot)
        for j in range(lo, hi):
            s[j] = s[j] * inv
        base = h * dv
        # vacc [lanes, dv]: each key's update runs along dv (contiguous, vectorised); every output's
        # accumulators still take the keys one by one in their lane, so the sums are unchanged
        if tiny:
            vacc = np.zeros((8, dv), np.float32)
            for j in range(lo, hi):
                l = (k0 + j) % 8
                p = s[j]
                for d in range(dv):
                    vacc[l, d] = V[hk, j, d] * p + vacc[l, d]
            for d in range(dv):
                out[t, base + d] = _hsum8(vacc[:, d])
        else:
            vacc = np.zeros((32, dv), np.float32)
            for j in range(lo, hi):
                a = (((k0 + j) // 8) % 4) * 8 + (k0 + j) % 8
                p = s[j]
                for d in range(dv):
                    vacc[a, d] = V[hk, j, d] * p + vacc[a, d]
            for d in range(dv):
                out[t, base + d] = _reduce4(vacc[:, d])


def attend(q: np.ndarray, K: np.ndarray, V: np.ndarray, p0: int, k0: int, scale: float, *, window: int = 0,
           sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal GQA attention as llama.cpp's CPU backend sums it (module docstring): q [T, H, dk] at
    positions p0 .. p0 + T - 1 over keys K [Hkv, N, dk] and values V [Hkv, N, dv] at positions
    k0 .. k0 + N - 1 -> float32 [T, H * dv]; window > 0: a query at i sees keys j with i - j < window.
    The signature of rowwise.attend (sinks are not supported: no architecture on this path has them)."""
    if sinks is not None:
        raise ValueError("ggmlattn.attend: attention sinks are not supported")
    from .rowwise import threads_for

    T, H, dk = q.shape
    n = K.shape[1]
    q = np.ascontiguousarray(q, dtype=np.float32)
    # K and V arrive as views of one [Hkv, N, dk + dv] gather: a strided array keeps the compiled
    # loops from vectorising (3-4x slower); the copy costs a small part of that
    K, V = np.ascontiguousarray(K, dtype=np.float32), np.ascontiguousarray(V, dtype=np.float32)
    out = np.empty((T, H * V.shape[2]), np.float32)
    scores = np.empty((H * T, n), np.float32)
    threads_for(T * H * n * (dk + V.shape[2]))
    _attend(q, K, V, int(p0), int(k0), np.float32(scale), int(window), scores, out)
    return out


def expf(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf element by element (float32; for the tests)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x).reshape(-1)
    _expf_all(x.reshape(-1), out)
    return out.reshape(x.shape)


@njit(nogil=True, cache=True)
def _expf_all(x, out):
    for i in range(x.size):
        out[i] = _expf(x[i])


@njit(nogil=True, cache=True)
def _cos_sin(pos, theta_scale, factors, cos, sin):
    for r in range(pos.shape[0]):
        theta = np.float32(pos[r])
        for i in range(factors.shape[0]):
            a = theta / factors[i]
            cos[r, i] = math.cos(a)
            sin[r, i] = math.sin(a)
            theta = theta * theta_scale


def rope_cos_sin(pos: np.ndarray, theta_scale: np.float32, factors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [R, n_rot/2] of positions pos [R] as ggml_rope_cache_init computes them
    (module docstring); factors float32 [n_rot/2] (ones where the file has none)."""
    R, n = len(pos), len(factors)
    cos, sin = np.empty((R, n), np.float32), np.empty((R, n), np.float32)
    _cos_sin(np.asarray(pos, np.int64), np.float32(theta_scale), np.ascontiguousarray(factors, np.float32), cos, sin)
    return cos, sin


@njit(nogil=True, cache=True)
def _softmax(x, out):
    T, n = x.shape
    lanes = np.empty(8, np.float32)
    for t in range(T):
        m = _F(-np.inf)  # float32: a float64 max would make s - m exact
        for i in range(n):
            if x[t, i] > m:
                m = x[t, i]
        tot = 0.0
        n8 = n - n % 8
        for c in range(0, n8, 8):
            for l in range(8):
                e = _expf(_F(x[t, c + l] - m))
                out[t, c + l] = e
                lanes[l] = e
            tot += np.float64(_hsum8(lanes))
        for i in range(n8, n):
            e = math.exp(_F(x[t, i] - m))  # float32: libm's expf
            out[t, i] = e
            tot += np.float64(e)
        inv = np.float32(1.0 / tot)
        for i in range(n):
            out[t, i] = out[t, i] * inv


def softmax(x: np.ndarray) -> np.ndarray:
    """Rows of x float32 [T, n] through ggml_soft_max (module docstring) -> float32 [T, n]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _softmax(x, out)
    return out


@njit(nogil=True, cache=True)
def _gelu_all(f, out):
    # ggml_gelu_f32: 0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x))), the innermost
    # 1.0f + (A*x)*x one FMA (as GCC contracts it), tanhf libm's (numba's float32 math.tanh)
    for i in range(f.shape[0]):
        x = f[i]
        inner = (_SQRT_2_OVER_PI * x) * _fma(_GELU_A * x, x, _ONE)
        out[i] = (_F(0.5) * x) * (_ONE + math.tanh(inner))


_SQRT_2_OVER_PI = _F(0.79788456080286535587989211986876)
_GELU_A = _F(0.044715)
_GELU_TABLE: list = []


def gelu_table() -> np.ndarray:
    """ggml_table_gelu_f16 as float32 [65536] (read-only): for every half's bits, ggml_gelu_f32 of
    its value rounded to half, as ggml's CPU backend builds it at init (GELU and GEGLU read it with
    the input rounded to half, outside [-10, 10] not at all)."""
    if not _GELU_TABLE:
        f = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
        out = np.empty_like(f)
        with np.errstate(all="ignore"):
            _gelu_all(f, out)
            t = out.astype(np.float16).astype(np.float32)
        t.flags.writeable = False
        _GELU_TABLE.append(t)
    return _GELU_TABLE[0]


def warmup() -> None:
    """Load (or compile) this module's kernels as an architecture using them calls them (Gemma 4):
    at open, not inside the first prompt."""
    q = np.zeros((2, 1, 8), np.float32)  # [T, H, dk]
    attend(q, np.zeros((1, 2, 8), np.float32), np.zeros((1, 2, 8), np.float32), 0, 0, 1.0)
    rope_cos_sin(np.arange(2), np.float32(1.0), np.ones(4, np.float32))
    softmax(np.zeros((1, 4), np.float32))
    gelu_table()
