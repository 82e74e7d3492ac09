"""Rotary attention straight over the KV pages, in two compiled passes (clutor.model.step).

The numpy way of one attention layer (rotate q and k, concatenate k | v, scatter them into the pages,
gather the sequence's pages back into [H, n, width] floats, attend) costs tens of numpy calls per layer
and a full copy of every key and value read; on a small model that is most of a token. Here:

    rope_write(...)   each row's k rotated and written with v into its page slot (f32, f16 rounded to
                      nearest even, or q8_0 as llama.cpp quantises a row), and its q rotated
    attend_pages(...) each (head, tile of up to TILE rows of one sequence) over the sequence's pages,
                      read in place (f16 and q8_0 widened once per tile as they are read), causal
                      up to each row's position

    data   [n_pages, L, Hkv, PAGE, W]   the pool group's storage (W = dk + dv): float32, or the bits
                                        of float16 (uint16), or int8 with scales [.., W / 32] (f16 bits);
                                        C-contiguous
    tab    int64 [S, max pages]          each segment's page table (a step's first pages)
    seg    int64 [R]                     each row's segment;  pos int64 [R]: its position
    cos, sin float32 [R, n_rot / 2]      the rows' rotary angles

The first pass is plain IEEE arithmetic (numpy's rotation bits, exactly). The second sums with
reassociation like rowwise.attend: each (row, head) in a fixed order of its own, so a row's result is
the same bits whatever else is in the step and however many threads run.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .vec import PAGE_KEYS, PV_COLS, pv2, qk4

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


# e^x as ggml_v_expf (vec.h) computes it on its normal range: n = round(x log2 e), b = x - n ln 2 (in two
# parts), a degree-5 polynomial, times 2^n
_LOG2E = np.float32(float.fromhex("0x1.715476p+0"))
_LN2_HI = np.float32(float.fromhex("0x1.62e4p-1"))
_LN2_LO = np.float32(float.fromhex("0x1.7f7d1cp-20"))
_C5 = np.float32(float.fromhex("0x1.0e4020p-7"))
_C4 = np.float32(float.fromhex("0x1.573e2ep-5"))
_C3 = np.float32(float.fromhex("0x1.555e66p-3"))
_C2 = np.float32(float.fromhex("0x1.fffdb6p-2"))
_C1 = np.float32(float.fromhex("0x1.ffffecp-1"))
_EXP_MIN = np.float32(-87.33)  # below it 2^n is not a normal float32: e^x < 1.2e-38 is taken as 0


@njit(nogil=True, cache=True, fastmath={"contract"})
def _exp0(x):
    """e^x for a softmax's x <= 0, without branches (a loop of it vectorises) and without
    reassociation (which would fold the two parts of ln 2 into one); ~1 ulp from libm's expf."""
    n = np.rint(x * _LOG2E)
    b = (x - n * _LN2_HI) - n * _LN2_LO
    u = b * b
    j = ((_C5 * b + _C4) * u + (_C3 * b + _C2)) * u + _C1 * b
    k = _as_f32(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))  # 2^n
    e = j * k + k
    return e if x >= _EXP_MIN else np.float32(0.0)


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
def _keys_t(qv, kt, k, dk, scale, s, at):
    """s[at + o] = scale * qv . key o for the k keys of one page, transposed (kt [dk, PAGE] float32):
    every score a sum over d in order, the k of them side by side (vector lanes, not a reduction)."""
    for o in range(k):
        s[at + o] = np.float32(0.0)
    for d in range(dk):
        qd = qv[d]
        for o in range(k):
            s[at + o] += qd * kt[d, o]
    for o in range(k):
        s[at + o] *= scale


@njit(inline="always")
def _transpose_keys(blk, k, dk, kt):
    """kt[d, o] = blk[o, d] for the page's k filled rows (blk [PAGE, W] float32)."""
    for o in range(k):
        for d in range(dk):
            kt[d, o] = blk[o, d]


@njit(parallel=True, nogil=True, cache=True, boundscheck=False, fastmath=_FLAGS)
def _attend_pages(qr, tab, seg, pos, li, kind, d32, d16, d8, sc, dk, dv, scale, starts, out):
    """Each (head, tile) is one task: a tile is a run of rows of one segment (starts [T + 1]: its first
    rows). A page of the tile's keys is widened once for all its rows, then each row's scores against
    it: a long prompt's rows share every page they read, where one row at a time widened each page
    once per row and head (the quadratic part of a long prefill). Each row's arithmetic is the same
    sequence whatever its tile: its scores key by key, the max, the exponentials and their sum in key
    order, the values' weighted sum in key order."""
    H = qr.shape[1]
    Hkv = max(d32.shape[2], d16.shape[2], d8.shape[2])
    P = max(d32.shape[3], d16.shape[3], d8.shape[3])
    W = dk + dv
    G = H // Hkv
    T = starts.shape[0] - 1
    # the register-blocked loops (vec.py) where pages are one vector of keys and values come in whole
    # blocks of columns; otherwise the same sums a key and a column at a time
    vec = P == PAGE_KEYS and dv % PV_COLS == 0 and qr.flags.c_contiguous
    for i in prange(H * T):
        h = i // T
        t = i - h * T
        r0, r1 = starts[t], starts[t + 1]
        hk = h // G
        sg = seg[r0]
        n = 0  # keys of the tile: up to its last row's position
        for r in range(r0, r1):
            n = max(n, pos[r] + 1)
        n16 = (n + P - 1) // P * P
        s = np.empty((r1 - r0, n16), np.float32)  # [tile rows, keys] scores, then weights (whole pages)
        wide = np.empty((P, W), np.float32)  # one page of f16 / q8_0 rows widened
        kt = np.empty((dk, P), np.float32)  # its keys transposed
        acc = np.zeros((r1 - r0, dv), np.float32)
        den = np.zeros(r1 - r0, np.float32)
        # scores, a page at a time
        for pi in range((n + P - 1) // P):
            p = tab[sg, pi]
            k = min(P, n - pi * P)
            if kind == 0:
                _transpose_keys(d32[p, li, hk], k, dk, kt)
            else:
                _widen_cols(kind, d16, d8, sc, p, li, hk, k, 0, dk, wide)
                _transpose_keys(wide, k, dk, kt)
            if vec:  # four rows at a time, every key of the page (past a row's own: never read)
                for r in range(r0, r1, 4):
                    ra, rb, rc, rd = r, min(r + 1, r1 - 1), min(r + 2, r1 - 1), min(r + 3, r1 - 1)
                    qk4(qr, ((ra * H + h) * dk, (rb * H + h) * dk, (rc * H + h) * dk, (rd * H + h) * dk), kt, s,
                        ((ra - r0) * n16 + pi * P, (rb - r0) * n16 + pi * P, (rc - r0) * n16 + pi * P,
                         (rd - r0) * n16 + pi * P), scale, dk)
                continue
            for r in range(r0, r1):
                kr = min(k, pos[r] + 1 - pi * P)  # this row's keys in the page (causal)
                if kr > 0:
                    _keys_t(qr[r, h], kt, kr, dk, scale, s[r - r0], pi * P)
        for r in range(r0, r1):
            sr = s[r - r0]
            nr = pos[r] + 1
            m = -np.inf
            for j in range(nr):
                if sr[j] > m:
                    m = sr[j]
            d_ = np.float32(0.0)
            for j in range(nr):
                e = _exp0(sr[j] - m)
                sr[j] = e
                d_ += e
            den[r - r0] = d_
        # values, a page at a time
        for pi in range((n + P - 1) // P):
            p = tab[sg, pi]
            k = min(P, n - pi * P)
            if kind == 0:
                blk = d32[p, li, hk]
            else:
                _widen_cols(kind, d16, d8, sc, p, li, hk, k, dk, W, wide)
                blk = wide
            if vec:  # two rows at a time where they take the same keys of the page
                r = r0
                while r < r1:
                    kr = min(k, pos[r] + 1 - pi * P)
                    r2 = r + 1 if r + 1 < r1 and min(k, pos[r + 1] + 1 - pi * P) == kr else r
                    if kr > 0:
                        for c0 in range(0, dv, PV_COLS):
                            pv2(s, ((r - r0) * n16 + pi * P, (r2 - r0) * n16 + pi * P), kr, blk, dk + c0, acc,
                                ((r - r0) * dv + c0, (r2 - r0) * dv + c0), W)
                    r = r2 + 1
                continue
            for r in range(r0, r1):
                kr = min(k, pos[r] + 1 - pi * P)
                sr = s[r - r0]
                ar = acc[r - r0]
                for o in range(kr):
                    e = sr[pi * P + o]
                    for d in range(dv):
                        ar[d] += e * blk[o, dk + d]
        base = h * dv
        for r in range(r0, r1):
            inv = np.float32(1.0) / den[r - r0]
            for d in range(dv):
                out[r, base + d] = acc[r - r0, d] * inv


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


def attend_pages(qr, tab, seg, pos, li: int, store: tuple, dk: int, dv: int, scale: float,
                 starts: np.ndarray | None = None) -> np.ndarray:
    """Causal attention of each row's rotated q (qr [R, H, dk]) over its segment's keys and values
    0 .. pos[r] in the pages tab[seg[r]] of layer li -> float32 [R, H * dv]."""
    R, H = qr.shape[0], qr.shape[1]
    out = np.empty((R, H * dv), np.float32)
    starts = tiles(seg) if starts is None else starts
    _attend_pages(qr, tab, seg, pos, li, *store, dk, dv, np.float32(scale), starts, out)
    return out


TILE = 32  # rows of one segment that share each page they read (attend_pages)


def tiles(seg: np.ndarray) -> np.ndarray:
    """int64 [T + 1]: the first rows of the runs of rows of one segment, cut to TILE rows at most."""
    R = len(seg)
    cut = np.flatnonzero(np.diff(seg)) + 1 if R > 1 else np.zeros(0, np.int64)  # where the segment changes
    starts = []
    for a, b in zip(np.concatenate([[0], cut]).tolist(), np.concatenate([cut, [R]]).tolist()):
        starts.extend(range(a, b, TILE))
    starts.append(R)
    return np.asarray(starts, np.int64)
