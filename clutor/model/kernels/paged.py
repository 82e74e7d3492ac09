"""Rotary attention straight over the KV pages, in two compiled passes (clutor.model.step).

The numpy way of one attention layer (rotate q and k, concatenate k | v, scatter them into the pages,
gather the sequence's pages back into [H, n, width] floats, attend) costs tens of numpy calls per layer
and a full copy of every key and value read; on a small model that is most of a token. Here:

    rope_write(...)   each row's k rotated and written with v into its page slot (f32, f16 rounded to
                      nearest even, or q8_0 as llama.cpp quantises a row), and its q rotated
    attend_pages(...) each (row, head) over its own sequence's pages, read in place (f16 and q8_0
                      widened as they are read), causal up to the row's position

    data   [n_pages, L, Hkv, PAGE, W]   the pool group's storage (W = dk + dv): float32, or the bits
                                        of float16 (uint16), or int8 with scales [.., W / 32] (f16 bits);
                                        C-contiguous
    tab    int64 [S, max pages]          each segment's page table (a step's first pages)
    seg    int64 [R]                     each row's segment;  pos int64 [R]: its position
    cos, sin float32 [R, n_rot / 2]      the rows' rotary angles

The first pass is plain IEEE arithmetic (numpy's rotation bits, exactly). The second sums with
reassociation like rowwise.attend: each (row, head) alone in a fixed order, so a row's result is
the same bits whatever else is in the step and however many threads run.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

__all__ = ["F32", "F16", "Q8_0", "rope_write", "attend_pages", "half_to_float", "float_to_half"]

F32, F16, Q8_0 = 0, 1, 2  # the pool's kv_type, as the kernels take it
_Q8 = 32
_FLAGS = {"reassoc", "contract"}  # as rowwise: -inf is a real value (the running max's start)


@intrinsic
def _as_u32(typingctx, x):
    """float32 -> its bits (uint32)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _as_f32(typingctx, x):
    """uint32 bits -> the float32 they are."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@njit(inline="always")
def _h2f(h):
    """float16 bits (uint16) -> float32, exactly (subnormals, infinities, NaNs); branch-free, so that
    the loops reading it vectorise: the half's exponent and mantissa placed as a float32's and scaled
    by 2^112 (exact, subnormals included), all-ones exponent where the half's was."""
    b = np.uint32(h)
    f = _as_f32((b & np.uint32(0x7FFF)) << np.uint32(13)) * np.float32(5.192296858534828e33)  # 2^112
    u = _as_u32(f)
    u = u | (np.uint32(0x7F800000) if f >= np.float32(65536.0) else np.uint32(0))
    return _as_f32(u | ((b & np.uint32(0x8000)) << np.uint32(16)))


@njit(inline="always")
def _f2h(x):
    """float32 -> float16 bits, rounded to nearest even (numpy's astype(float16))."""
    f = _as_u32(np.float32(x))
    sign = f & np.uint32(0x80000000)
    f = f ^ sign
    if f >= np.uint32(0x47800000):  # >= 65536, infinity, NaN
        o = np.uint32(0x7E00) if f > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif f < np.uint32(0x38800000):  # below the smallest normal half: a float addition rounds it
        o = _as_u32(_as_f32(f) + np.float32(0.5)) - np.uint32(0x3F000000)
    else:
        odd = (f >> np.uint32(13)) & np.uint32(1)
        f = f + np.uint32(((15 - 127) << 23) & 0xFFFFFFFF) + np.uint32(0xFFF) + odd
        o = f >> np.uint32(13)
    return np.uint16(o | (sign >> np.uint32(16)))




@njit(nogil=True, cache=True)
def _float_to_half(x, out):
    for i in range(x.shape[0]):
        out[i] = _f2h(x[i])


def half_to_float(bits: np.ndarray) -> np.ndarray:
    """uint16 [n] float16 bits -> float32 [n], as the kernels widen them (tests compare numpy's)."""
    out = np.empty(bits.shape[0], np.float32)
    _half_to_float(np.ascontiguousarray(bits, np.uint16), out)
    return out


def float_to_half(x: np.ndarray) -> np.ndarray:
    """float32 [n] -> uint16 [n] float16 bits, as the kernels round them."""
    out = np.empty(x.shape[0], np.uint16)
    _float_to_half(np.ascontiguousarray(x, np.float32), out)
    return out


@njit(inline="always")
def _rotate(x, cos, sin, half, neox, out):
    """x [d] rotated by cos, sin [half] into out [d]: pairs (i, i + half) (neox) or (2i, 2i + 1)."""
    for i in range(half):
        if neox:
            a, b = x[i], x[i + half]
            out[i] = a * cos[i] - b * sin[i]
            out[i + half] = b * cos[i] + a * sin[i]
        else:
            a, b = x[2 * i], x[2 * i + 1]
            out[2 * i] = a * cos[i] - b * sin[i]
            out[2 * i + 1] = b * cos[i] + a * sin[i]
    for i in range(2 * half, x.shape[0]):
        out[i] = x[i]


@njit(nogil=True, cache=True, boundscheck=False)
def _rope_write(q, k, v, cos, sin, neox, pages, offs, li, kind, d32, d16, d8, sc, qr):
    R, H, dk = q.shape
    Hkv, dv = k.shape[1], v.shape[2]
    half = cos.shape[1]
    row = np.empty(dk + dv, np.float32)
    for r in range(R):
        for h in range(H):
            _rotate(q[r, h], cos[r], sin[r], half, neox, qr[r, h])
        p, o = pages[r], offs[r]
        for h in range(Hkv):
            _rotate(k[r, h], cos[r], sin[r], half, neox, row[:dk])
            for d in range(dv):
                row[dk + d] = v[r, h, d]
            if kind == 0:
                for d in range(dk + dv):
                    d32[p, li, h, o, d] = row[d]
            elif kind == 1:
                for d in range(dk + dv):
                    d16[p, li, h, o, d] = _f2h(row[d])
            else:  # q8_0 as llama.cpp quantises a row: per 32 values d = max|x| / 127, q = round(x / d)
                for b0 in range(0, dk + dv, _Q8):
                    amax = np.float32(0.0)
                    for d in range(b0, b0 + _Q8):
                        a = abs(row[d])
                        if a > amax:
                            amax = a
                    dq = amax / np.float32(127.0)
                    inv = np.float32(1.0) / dq if dq > 0 else np.float32(0.0)
                    for d in range(b0, b0 + _Q8):
                        d8[p, li, h, o, d] = np.int8(np.rint(row[d] * inv))
                    sc[p, li, h, o, b0 // _Q8] = _f2h(dq)


@njit(inline="always")
def _keys(qv, blk, k, dk, scale, s, at):
    """s[at + o] = scale * qv . blk[o, :dk] for the k filled rows of one page (blk [PAGE, W] float32)."""
    for o in range(k):
        acc = np.float32(0.0)
        for d in range(dk):
            acc += qv[d] * blk[o, d]
        s[at + o] = acc * scale


@njit(parallel=True, nogil=True, cache=True, boundscheck=False, fastmath=_FLAGS)
def _attend_pages(qr, tab, seg, pos, li, kind, d32, d16, d8, sc, dk, dv, scale, scores, out):
    R, H = qr.shape[0], qr.shape[1]
    Hkv = max(d32.shape[2], d16.shape[2], d8.shape[2])
    P = max(d32.shape[3], d16.shape[3], d8.shape[3])
    W = dk + dv
    G = H // Hkv
    for i in prange(H * R):
        h = i // R
        r = i - h * R
        hk = h // G
        sg = seg[r]
        n = pos[r] + 1  # keys 0 .. pos (causal)
        qv = qr[r, h]
        s = scores[i]
        wide = np.empty((P, W), np.float32)  # one page of f16 / q8_0 rows widened
        acc = np.zeros(dv, np.float32)
        # scores, a page at a time
        for pi in range((n + P - 1) // P):
            p = tab[sg, pi]
            k = min(P, n - pi * P)
            if kind == 0:
                _keys(qv, d32[p, li, hk], k, dk, scale, s, pi * P)
            else:
                _widen_cols(kind, d16, d8, sc, p, li, hk, k, 0, dk, wide)
                _keys(qv, wide, k, dk, scale, s, pi * P)
        m = -np.inf
        for j in range(n):
            if s[j] > m:
                m = s[j]
        den = np.float32(0.0)
        for j in range(n):
            e = np.exp(s[j] - m)
            s[j] = e
            den += e
        # values, a page at a time
        for pi in range((n + P - 1) // P):
            p = tab[sg, pi]
            k = min(P, n - pi * P)
            if kind == 0:
                blk = d32[p, li, hk]
                for o in range(k):
                    e = s[pi * P + o]
                    for d in range(dv):
                        acc[d] += e * blk[o, dk + d]
            else:
                _widen_cols(kind, d16, d8, sc, p, li, hk, k, dk, W, wide)
                for o in range(k):
                    e = s[pi * P + o]
                    for d in range(dv):
                        acc[d] += e * wide[o, dk + d]
        inv = np.float32(1.0) / den
        base = h * dv
        for d in range(dv):
            out[r, base + d] = acc[d] * inv


@intrinsic
def _h2f_8(typingctx, src, at, dst, to):
    """Eight float16 (the bits in src, a C-contiguous uint16 array, from flat index at) widened into
    dst (a C-contiguous float32 array, from flat index to) in one conversion (F16C's vcvtph2ps where
    the CPU has it): exact, as _h2f."""
    def codegen(context, builder, sig, args):
        sa = context.make_array(sig.args[0])(context, builder, args[0])
        da = context.make_array(sig.args[2])(context, builder, args[2])
        sp = builder.gep(builder.bitcast(sa.data, ir.IntType(16).as_pointer()), [args[1]])
        v = builder.load(builder.bitcast(sp, ir.VectorType(ir.HalfType(), 8).as_pointer()), align=2)
        dp = builder.gep(builder.bitcast(da.data, ir.FloatType().as_pointer()), [args[3]])
        builder.store(builder.fpext(v, ir.VectorType(ir.FloatType(), 8)),
                      builder.bitcast(dp, ir.VectorType(ir.FloatType(), 8).as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(src, at, dst, to), codegen


@njit(nogil=True, cache=True)
def _half_to_float(bits, out):
    n8 = bits.shape[0] // 8 * 8
    for i in range(0, n8, 8):  # as the attention widens f16 pages: eight at a time, the rest one by one
        _h2f_8(bits, i, out, i)
    for i in range(n8, bits.shape[0]):
        out[i] = _h2f(bits[i])


@njit(inline="always")
def _widen_cols(kind, d16, d8, sc, p, li, hk, k, c0, c1, wide):
    """Columns c0 .. c1 of the k filled rows of one f16 or q8_0 page into wide [PAGE, W] as float32:
    f16 eight at a time (whole rows of the page are contiguous in d16 [n_pages, L, Hkv, PAGE, W]),
    q8_0 a 32-value block at a time (its scale widened once)."""
    W = wide.shape[1]
    if kind == 1:
        L, Hkv, P = d16.shape[1], d16.shape[2], d16.shape[3]
        base = ((p * L + li) * Hkv + hk) * P * W
        blk = d16[p, li, hk]
        for o in range(k):
            d = c0
            while d + 8 <= c1:
                _h2f_8(d16, base + o * W + d, wide, o * W + d)
                d += 8
            for e in range(d, c1):
                wide[o, e] = _h2f(blk[o, e])
    else:
        blk, bs = d8[p, li, hk], sc[p, li, hk]
        for o in range(k):
            b = c0
            while b < c1:  # the part of each 32-value block (aligned to the row) within c0 .. c1
                e = min((b // _Q8 + 1) * _Q8, c1)
                f = _h2f(bs[o, b // _Q8])
                for d in range(b, e):
                    wide[o, d] = np.float32(blk[o, d]) * f
                b = e


_NONE = {np.dtype(np.float32): np.zeros((1, 1, 1, 1, 1), np.float32),
         np.dtype(np.uint16): np.zeros((1, 1, 1, 1, 1), np.uint16),
         np.dtype(np.int8): np.zeros((1, 1, 1, 1, 1), np.int8)}


def storage(data: np.ndarray, scales: np.ndarray | None) -> tuple:
    """(kind, d32, d16, d8, sc): a pool group's arrays as the kernels take them (unused ones empty)."""
    if not data.flags.c_contiguous:  # (the pool's storage always is: the f16 widening reads rows by address)
        raise ValueError("the KV pages must be C-contiguous")
    if scales is not None:
        return Q8_0, _NONE[np.dtype(np.float32)], _NONE[np.dtype(np.uint16)], data, scales.view(np.uint16)
    if data.dtype == np.float16:
        return F16, _NONE[np.dtype(np.float32)], data.view(np.uint16), _NONE[np.dtype(np.int8)], _NONE[np.dtype(np.uint16)]
    return F32, data, _NONE[np.dtype(np.uint16)], _NONE[np.dtype(np.int8)], _NONE[np.dtype(np.uint16)]


def rope_write(q, k, v, cos, sin, neox: bool, pages, offs, li: int, store: tuple) -> np.ndarray:
    """Rotate q [R, H, dk] and k [R, Hkv, dk] by the rows' angles, write k | v [R, Hkv, dv] into each
    row's slot (pages [R], offs [R]) of layer li -> the rotated q, float32 [R, H, dk]."""
    qr = np.empty(q.shape, np.float32)
    _rope_write(q, k, v, cos, sin, neox, pages, offs, li, *store, qr)
    return qr


def attend_pages(qr, tab, seg, pos, li: int, store: tuple, dk: int, dv: int, scale: float) -> np.ndarray:
    """Causal attention of each row's rotated q (qr [R, H, dk]) over its segment's keys and values
    0 .. pos[r] in the pages tab[seg[r]] of layer li -> float32 [R, H * dv]."""
    R, H = qr.shape[0], qr.shape[1]
    out = np.empty((R, H * dv), np.float32)
    scores = np.empty((H * R, int(pos.max()) + 1), np.float32)
    _attend_pages(qr, tab, seg, pos, li, *store, dk, dv, np.float32(scale), scores, out)
    return out
