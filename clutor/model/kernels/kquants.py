"""256-element K-quant super-blocks: Q4_K, Q5_K, Q6_K.

Layouts (bytes per super-block of 256):
- Q4_K (144): d f16, dmin f16, scales[12] (eight 6-bit scales, eight 6-bit mins, packed), qs[128].
  Sub-block j (32 elements) = (d*sc_j)*q - (dmin*m_j). The 32 bytes of chunk c hold sub-block 2c
  in their low nibbles and 2c+1 in their high nibbles.
- Q5_K (176): Q4_K plus qh[32] at byte 16 (bit j of qh[l] = fifth bit of element l of sub-block j);
  qs at byte 48.
- Q6_K (210): ql[128], qh[64], scales int8[16] (one per 16 elements), d f16 at byte 208; value
  (d*sc)*(q - 32) with 6-bit q. Half h (128 elements) uses ql[64h:+64] and qh[32h:+32]: its
  32-element chunks i = 0..3 take low(ql[l]), low(ql[l+32]), high(ql[l]), high(ql[l+32]) with bits
  2i..2i+1 of qh[l] on top.

The int8 path rounds activations with one scale per 256 (llama.cpp's Q8_K). The per-sub-block
integer scales multiply the int16 pair sums inside ``vpmaddwd``, so a whole super-block stays in
integer vectors: Q4_K/Q5_K give d*dx*sum_j sc_j dot_j - dmin*dx*sum_j m_j sum(x_j); Q6_K gives
d*dx*(sum_i sc_i dot_i - 32 sum_i sc_i sum(x_i)). The sums of x come per 16 elements (xs16).
"""
from __future__ import annotations

from . import _ir as R
from ._ir import Format, IEnv, ir

__all__ = ["FORMATS"]


def _scales_mins(b, wp, off):
    """The 12 packed bytes at off+4 -> <16 x i16> [sc_0..sc_7, m_0..m_7], done on 32-bit words.

    Bytes 0-3 hold sc_0..3 (low 6 bits) and the top 2 bits of sc_4..7; bytes 4-7 the same for the
    mins; bytes 8-11 the low 4 bits of sc_4..7 (low nibble) and m_4..7 (high nibble)."""
    k = lambda v: ir.Constant(R.i32, v)  # noqa: E731
    w0, w1, w2 = (R.load(b, R.at(b, wp, off, 4 + 4 * i), R.i32) for i in range(3))
    top = lambda w: b.shl(b.and_(b.lshr(w, k(6)), k(0x03030303)), k(4))  # noqa: E731
    sc_lo = b.and_(w0, k(0x3F3F3F3F))
    m_lo = b.and_(w1, k(0x3F3F3F3F))
    sc_hi = b.or_(b.and_(w2, k(0x0F0F0F0F)), top(w0))
    m_hi = b.or_(b.and_(b.lshr(w2, k(4)), k(0x0F0F0F0F)), top(w1))
    v = ir.Constant(ir.VectorType(R.i32, 4), ir.Undefined)
    for i, word in enumerate((sc_lo, sc_hi, m_lo, m_hi)):
        v = b.insert_element(v, word, ir.Constant(R.i32, i))
    return b.zext(b.bitcast(v, R.V16i8), R.V16i16)


def _lane(b, v, lanes):
    """shufflevector picking `lanes` of v."""
    return b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), R.vconst(ir.VectorType(R.i32, len(lanes)), lanes))


def _k4_quants(b, wp, off, five: bool):
    """The 8 sub-blocks of a Q4_K (five=False) or Q5_K super-block as <32 x u8>."""
    qs_at = 48 if five else 16
    qh = R.load(b, R.at(b, wp, off, 16), R.V32i8) if five else None
    out = []
    for c in range(4):
        v = R.load(b, R.at(b, wp, off, qs_at + 32 * c), R.V32i8)
        for half in range(2):
            j = 2 * c + half
            q = R.band(b, v, 0x0F) if half == 0 else R.lshr(b, v, 4)
            if five:
                q = b.or_(q, R.shl(b, R.band(b, R.lshr(b, qh, j), 1), 4))
            out.append(q)
    return out


def _k4_format(name: str, nbytes: int, five: bool) -> Format:
    def fvals(b, wp, off):
        d = R.half(b, R.at(b, wp, off))
        dmin = R.half(b, R.at(b, wp, off, 2))
        scm = b.uitofp(_scales_mins(b, wp, off), ir.VectorType(R.f32, 16))  # [16] sc then m
        pair = b.insert_element(R.splat(b, d, ir.VectorType(R.f32, 2)), dmin, ir.Constant(R.i32, 1))
        dd = b.fmul(_lane(b, pair, [0] * 8 + [1] * 8), scm)  # [d*sc_0.., dmin*m_0..] as the reference
        vals = []
        for j, q in enumerate(_k4_quants(b, wp, off, five)):
            a = _lane(b, dd, [j] * 32)      # d * sc_j
            m = _lane(b, dd, [8 + j] * 32)  # dmin * m_j
            vals.append(b.fsub(b.fmul(a, R.to_f32(b, q, False)), m))
        return vals

    def iprep(b, wp, off):
        d = R.half(b, R.at(b, wp, off))
        dmin = R.half(b, R.at(b, wp, off, 2))
        scm = _scales_mins(b, wp, off)  # [16] i16
        scales = [_lane(b, scm, [j] * 16) for j in range(8)]
        mins = _lane(b, scm, [8 + j // 2 for j in range(16)])  # m_j twice: pairs of 16-sums
        return d, dmin, scales, mins, _k4_quants(b, wp, off, five)

    def itok(b, state, env: IEnv):
        d, dmin, scales, mins, qs = state
        acc = ir.Constant(R.V8i32, None)
        for j, q in enumerate(qs):
            xv = R.load(b, b.gep(env.xq, [b.add(env.xe, R.c64(32 * j))]), R.V32i8)
            p = R.maddubs(b, q, xv)  # q <= 31, |x| <= 127: pairs fit in int16
            acc = b.add(acc, R.madd(b, p, scales[j]))
        # mins: sum_j m_j * (xs16[2j] + xs16[2j+1]) in one vpmaddwd
        xs = R.load(b, b.gep(env.xs16, [b.sdiv(env.xe, R.c64(16))]), R.V16i16, 2)
        mvec = R.madd(b, xs, mins)
        dx = R.xscale(b, env, 256)
        return [(acc, b.fmul(d, dx)), (mvec, b.fneg(b.fmul(dmin, dx)))], None

    return Format(name, 256, nbytes, 1, fvals, iprep, itok)


def _q6_quants(b, wp, off):
    """The 8 chunks of 32 of a Q6_K super-block as <32 x u8> in 0..63 (offset not removed)."""
    out = []
    for h in range(2):
        ql0 = R.load(b, R.at(b, wp, off, 64 * h), R.V32i8)
        ql1 = R.load(b, R.at(b, wp, off, 64 * h + 32), R.V32i8)
        qh = R.load(b, R.at(b, wp, off, 128 + 32 * h), R.V32i8)
        lows = (R.band(b, ql0, 0x0F), R.band(b, ql1, 0x0F), R.lshr(b, ql0, 4), R.lshr(b, ql1, 4))
        for i, low in enumerate(lows):
            out.append(b.or_(low, R.shl(b, R.band(b, R.lshr(b, qh, 2 * i), 3), 4)))
    return out


def _q6_fvals(b, wp, off):
    d = R.half(b, R.at(b, wp, off, 208))
    scales = b.sitofp(R.load(b, R.at(b, wp, off, 192), R.V16i8), ir.VectorType(R.f32, 16))  # [16]
    ds = b.fmul(R.splat(b, d, ir.VectorType(R.f32, 16)), scales)  # d*sc per 16 elements
    vals = []
    for i, q in enumerate(_q6_quants(b, wp, off)):
        a = b.shuffle_vector(ds, ir.Constant(ds.type, ir.Undefined),
                             R.vconst(ir.VectorType(R.i32, 32), [2 * i] * 16 + [2 * i + 1] * 16))
        qc = R.to_f32(b, b.sub(q, R.vconst(R.V32i8, 32)), True)
        vals.append(b.fmul(a, qc))
    return vals


def _q6_iprep(b, wp, off):
    scales = b.sext(R.load(b, R.at(b, wp, off, 192), R.V16i8), R.V16i16)  # [16]
    # lanes 0..7 of a chunk's pair sums cover 16-element group 2i, lanes 8..15 group 2i+1
    lanes = [b.shuffle_vector(scales, ir.Constant(R.V16i16, ir.Undefined),
                              R.vconst(ir.VectorType(R.i32, 16), [2 * i] * 8 + [2 * i + 1] * 8)) for i in range(8)]
    return R.half(b, R.at(b, wp, off, 208)), scales, lanes, _q6_quants(b, wp, off)


def _q6_itok(b, state, env: IEnv):
    d, scales, lanes, qs = state
    acc = ir.Constant(R.V8i32, None)
    for i, q in enumerate(qs):
        xv = R.load(b, b.gep(env.xq, [b.add(env.xe, R.c64(32 * i))]), R.V32i8)
        p = R.maddubs(b, q, xv)  # q <= 63, |x| <= 127: pairs fit in int16
        acc = b.add(acc, R.madd(b, p, lanes[i]))
    # the -32 offset: 32 * sum_i sc_i * sum(x over group i)
    xs = R.load(b, b.gep(env.xs16, [b.sdiv(env.xe, R.c64(16))]), R.V16i16, 2)
    acc = b.sub(acc, R.shl(b, R.madd(b, scales, xs), 5))
    return [(acc, b.fmul(d, R.xscale(b, env, 256)))], None


FORMATS = {
    "Q4_K": _k4_format("Q4_K", 144, five=False),
    "Q5_K": _k4_format("Q5_K", 176, five=True),
    "Q6_K": Format("Q6_K", 256, 210, 1, _q6_fvals, _q6_iprep, _q6_itok),
}
