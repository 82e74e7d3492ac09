"""256-element super-blocks: the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_XS.

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

- Q2_K (84), Q3_K (110), IQ4_XS (136): at their definitions below.

The int8 path takes ggml's Q8_K activations (one scale per 256, sums per 16: activations.py). The per-sub-block
integer scales multiply the int16 pair sums inside ``vpmaddwd``, so a whole super-block stays in
integer vectors: Q4_K/Q5_K give d*dx*sum_j sc_j dot_j - dmin*dx*sum_j m_j sum(x_j); Q6_K gives
d*dx*(sum_i sc_i dot_i - 32 sum_i sc_i sum(x_i)). The sums of x come per 16 elements (xs16).
Each type's integers and float steps are those of ggml's x86 dot product (its lanes, its order of the
scale products, its separate sums), so results equal llama.cpp's bit for bit (tests/test_ggml_dots.py).
"""
from __future__ import annotations

from ..weight_types import QT, TYPES
from . import _ir
from ._ir import Format, IEnv, ir

__all__ = ["FORMATS"]



def _group_dots(bld, env: IEnv, qs, lanes):
    """sum over the eight 32-element groups of a superblock of (unsigned quants q_g . x_g), each
    group's pair sums weighted by its int16 scale lanes: <8 x i32>. Every q < 64 and |x| <= 127, so
    vpmaddubsw's int16 pair sums never saturate."""
    acc = ir.Constant(_ir.V8i32, None)
    for g, q in enumerate(qs):
        xv = _ir.load(bld, bld.gep(env.xq, [bld.add(env.xe, _ir.c64(32 * g))]), _ir.V32i8)
        acc = bld.add(acc, _ir.madd(bld, _ir.maddubs(bld, q, xv), lanes[g]))
    return acc


def _x_sums16(bld, env: IEnv):
    """The superblock's sixteen 16-element sums of int8 activations: <16 x i16>."""
    return _ir.load(bld, bld.gep(env.xs16, [_ir.xgroup(bld, env, 16)]), _ir.V16i16, 2)

def _scales_mins(bld, wptr, off):
    """The 12 packed bytes at off+4 -> <16 x i16> [sc_0..sc_7, m_0..m_7], done on 32-bit words.

    Bytes 0-3 hold sc_0..3 (low 6 bits) and the top 2 bits of sc_4..7; bytes 4-7 the same for the
    mins; bytes 8-11 the low 4 bits of sc_4..7 (low nibble) and m_4..7 (high nibble)."""
    k = lambda v: ir.Constant(_ir.i32, v)  # noqa: E731
    w0, w1, w2 = (_ir.load(bld, _ir.at(bld, wptr, off, 4 + 4 * i), _ir.i32) for i in range(3))
    top = lambda w: bld.shl(bld.and_(bld.lshr(w, k(6)), k(0x03030303)), k(4))  # noqa: E731
    sc_lo = bld.and_(w0, k(0x3F3F3F3F))
    m_lo = bld.and_(w1, k(0x3F3F3F3F))
    sc_hi = bld.or_(bld.and_(w2, k(0x0F0F0F0F)), top(w0))
    m_hi = bld.or_(bld.and_(bld.lshr(w2, k(4)), k(0x0F0F0F0F)), top(w1))
    v = ir.Constant(ir.VectorType(_ir.i32, 4), ir.Undefined)
    for i, word in enumerate((sc_lo, sc_hi, m_lo, m_hi)):
        v = bld.insert_element(v, word, ir.Constant(_ir.i32, i))
    return bld.zext(bld.bitcast(v, _ir.V16i8), _ir.V16i16)


def _lane(bld, v, lanes):
    """shufflevector picking `lanes` of v."""
    return bld.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), _ir.vconst(ir.VectorType(_ir.i32, len(lanes)), lanes))


def _k4_quants(bld, wptr, off, five: bool):
    """The 8 sub-blocks of a Q4_K (five=False) or Q5_K super-block as <32 x u8>."""
    qs_at = 48 if five else 16
    qh = _ir.load(bld, _ir.at(bld, wptr, off, 16), _ir.V32i8) if five else None
    out = []
    for c in range(4):
        v = _ir.load(bld, _ir.at(bld, wptr, off, qs_at + 32 * c), _ir.V32i8)
        for half in range(2):
            j = 2 * c + half
            q = _ir.band(bld, v, 0x0F) if half == 0 else _ir.lshr(bld, v, 4)
            if five:
                q = bld.or_(q, _ir.shl(bld, _ir.band(bld, _ir.lshr(bld, qh, j), 1), 4))
            out.append(q)
    return out


def _two_sums(bld, a, b):
    """<8 x i32> a, b -> [sum(a), sum(b), 0, 0, 0, 0, 0, 0] (<8 x i32>): both horizontal sums in one tree,
    two vphaddd and one add of the halves, where two reductions take seven instructions each (integer
    sums: any order gives the same bits)."""
    ph = _ir.declare(bld, "llvm.x86.avx2.phadd.d", _ir.V8i32, [_ir.V8i32, _ir.V8i32])
    v1 = bld.call(ph, [a, b])    # [a01, a23, b01, b23 | a45, a67, b45, b67]
    v2 = bld.call(ph, [v1, v1])  # [a0-3, b0-3, a0-3, b0-3 | a4-7, b4-7, a4-7, b4-7]
    v4 = ir.VectorType(_ir.i32, 4)
    half = lambda lanes: bld.shuffle_vector(v2, ir.Constant(_ir.V8i32, ir.Undefined), _ir.vconst(v4, lanes))  # noqa: E731
    s = bld.add(half([0, 1, 2, 3]), half([4, 5, 6, 7]))  # [A, B, A, B]
    return bld.shuffle_vector(s, ir.Constant(v4, None), _ir.vconst(_ir.V8i32, [0, 1, 4, 4, 4, 4, 4, 4]))


def _k4_format(name: str, five: bool) -> Format:
    def fvals(bld, wptr, off):
        d = _ir.half(bld, _ir.at(bld, wptr, off))
        dmin = _ir.half(bld, _ir.at(bld, wptr, off, 2))
        scm = bld.uitofp(_scales_mins(bld, wptr, off), ir.VectorType(_ir.f32, 16))  # [16] sc then m
        pair = bld.insert_element(_ir.splat(bld, d, ir.VectorType(_ir.f32, 2)), dmin, ir.Constant(_ir.i32, 1))
        dd = bld.fmul(_lane(bld, pair, [0] * 8 + [1] * 8), scm)  # [d*sc_0.., dmin*m_0..] as the reference
        vals = []
        for j, q in enumerate(_k4_quants(bld, wptr, off, five)):
            a = _lane(bld, dd, [j] * 32)      # d * sc_j
            m = _lane(bld, dd, [8 + j] * 32)  # dmin * m_j
            vals.append(bld.fsub(bld.fmul(a, _ir.to_f32(bld, q, False)), m))
        return vals

    def iprep(bld, wptr, off):
        d = _ir.half(bld, _ir.at(bld, wptr, off))
        dmin = _ir.half(bld, _ir.at(bld, wptr, off, 2))
        scm = _scales_mins(bld, wptr, off)  # [16] i16
        scales = _ir.spread_i16(bld, scm, [[j] * 16 for j in range(8)])
        mins = _lane(bld, scm, [8 + j // 2 for j in range(16)])  # m_j twice: pairs of 16-sums
        msub = _lane(bld, scm, list(range(8, 16)))  # m_0..m_7
        return d, dmin, scales, mins, msub, _k4_quants(bld, wptr, off, five)

    def itok(bld, state, env: IEnv):
        d, dmin, scales, mins, msub, qs = state
        acc = _group_dots(bld, env, qs, scales)  # q <= 31
        # mins: sum_j m_j * (xs16[2j] + xs16[2j+1]) in one vpmaddwd
        mvec = _ir.madd(bld, _x_sums16(bld, env), mins)
        dx = _ir.xscale(bld, env, 256)
        if five:
            # ggml's Q5_K dot (x86): acc += (dx * d) * float(lanes), summs += (-dx * dmin) * float(sum of mins)
            return [(acc, bld.fmul(dx, d))], bld.fmul(bld.fmul(bld.fneg(dx), dmin), bld.sitofp(_ir.hsum_i(bld, mvec), _ir.f32))
        # Q4_K: ggml repacks it on x86 (8 rows interleaved) and its one-token product (gemv: decode and
        # every expert) sums each super-block's integers whole: acc += float(sum) * (d * dx), accm +=
        # float(sum of mins) * (dmin * dx), the result acc - accm. Lane 0 of the side accumulator carries
        # acc, lane 1 -accm, the rest zeros (exact), so the result rounds as ggml's.
        totals = _two_sums(bld, acc, mvec)
        sc = bld.insert_element(bld.insert_element(ir.Constant(_ir.V8f, None), bld.fmul(d, dx), ir.Constant(_ir.i32, 0)),
                                bld.fneg(bld.fmul(dmin, dx)), ir.Constant(_ir.i32, 1))
        return [(totals, sc, "side")], None

    return Format(name, *_geometry(name), 1, fvals, iprep, itok)


def _q6_quants(bld, wptr, off):
    """The 8 chunks of 32 of a Q6_K super-block as <32 x u8> in 0..63 (offset not removed)."""
    out = []
    for h in range(2):
        ql0 = _ir.load(bld, _ir.at(bld, wptr, off, 64 * h), _ir.V32i8)
        ql1 = _ir.load(bld, _ir.at(bld, wptr, off, 64 * h + 32), _ir.V32i8)
        qh = _ir.load(bld, _ir.at(bld, wptr, off, 128 + 32 * h), _ir.V32i8)
        lows = (_ir.band(bld, ql0, 0x0F), _ir.band(bld, ql1, 0x0F), _ir.lshr(bld, ql0, 4), _ir.lshr(bld, ql1, 4))
        for i, low in enumerate(lows):
            out.append(bld.or_(low, _ir.shl(bld, _ir.band(bld, _ir.lshr(bld, qh, 2 * i), 3), 4)))
    return out


def _q6_fvals(bld, wptr, off):
    d = _ir.half(bld, _ir.at(bld, wptr, off, 208))
    scales = bld.sitofp(_ir.load(bld, _ir.at(bld, wptr, off, 192), _ir.V16i8), ir.VectorType(_ir.f32, 16))  # [16]
    ds = bld.fmul(_ir.splat(bld, d, ir.VectorType(_ir.f32, 16)), scales)  # d*sc per 16 elements
    vals = []
    for i, q in enumerate(_q6_quants(bld, wptr, off)):
        a = bld.shuffle_vector(ds, ir.Constant(ds.type, ir.Undefined),
                             _ir.vconst(ir.VectorType(_ir.i32, 32), [2 * i] * 16 + [2 * i + 1] * 16))
        qc = _ir.to_f32(bld, bld.sub(q, _ir.vconst(_ir.V32i8, 32)), True)
        vals.append(bld.fmul(a, qc))
    return vals


def _q6_iprep(bld, wptr, off):
    scales = bld.sext(_ir.load(bld, _ir.at(bld, wptr, off, 192), _ir.V16i8), _ir.V16i16)  # [16]
    # lanes 0..7 of a chunk's pair sums cover 16-element group 2i, lanes 8..15 group 2i+1
    lanes = _pair_lanes(bld, scales)
    return _ir.half(bld, _ir.at(bld, wptr, off, 208)), scales, lanes, _q6_quants(bld, wptr, off)


def _q6_itok(bld, state, env: IEnv):
    d, scales, lanes, qs = state
    acc = _group_dots(bld, env, qs, lanes)  # q <= 63
    # the -32 offset: 32 * sum_i sc_i * sum(x over group i)
    acc = bld.sub(acc, _ir.shl(bld, _ir.madd(bld, scales, _x_sums16(bld, env)), 5))
    return [(acc, bld.fmul(d, _ir.xscale(bld, env, 256)))], None  # ggml: d(weight) * dx, times the sum


def _group_dots_signed(bld, env: IEnv, qs, lanes):
    """_group_dots for signed quants (|q| <= 32; table values of IQ4_XS up to 127): each group's
    sign moved onto x, so vpmaddubsw's int16 pair sums are q . x exactly as ggml's (which subtracts
    or sign-moves the same way)."""
    acc = ir.Constant(_ir.V8i32, None)
    for g, q in enumerate(qs):
        xv = _ir.load(bld, bld.gep(env.xq, [bld.add(env.xe, _ir.c64(32 * g))]), _ir.V32i8)
        acc = bld.add(acc, _ir.madd(bld, _signed_pairs(bld, q, xv), lanes[g]))
    return acc


def _signed_pairs(bld, q, xv):
    """<32 x i8> signed q, x -> <16 x i16> pair sums of q * x (|q| * (x with q's sign))."""
    sign = _ir.declare(bld, "llvm.x86.avx2.psign.b", _ir.V32i8, [_ir.V32i8, _ir.V32i8])
    return _ir.maddubs(bld, bld.call(sign, [q, q]), bld.call(sign, [xv, q]))


def _two_bits(bld, wptr, off):
    """The 2-bit fields of a Q2_K / Q3_K super-block's qs[64] at off: <32 x u8> per 32-element group
    g = 4c + j (c the 32-byte chunk, j the bit pair: (qs[32c + l] >> 2j) & 3)."""
    out = []
    for c in range(2):
        v = _ir.load(bld, _ir.at(bld, wptr, off, 32 * c), _ir.V32i8)
        out.extend(_ir.band(bld, _ir.lshr(bld, v, 2 * j), 3) for j in range(4))
    return out


def _pair_lanes(bld, scales16):
    """<16 x i16> per-16 scales -> per 32-element group g the vpmaddwd lanes [s_2g] * 8 + [s_2g+1] * 8."""
    return _ir.spread_i16(bld, scales16, [[2 * g] * 8 + [2 * g + 1] * 8 for g in range(8)])


def _per16(bld, vals16, g):
    """<16 x float> per-16 values -> the <32 x float> of group g's elements."""
    return _lane(bld, vals16, [2 * g] * 16 + [2 * g + 1] * 16)


# -- Q2_K (84 bytes): scales[16] (low nibble: scale, high nibble: min, per 16 elements), qs[64] (2 bits),
#    d f16 at 80, dmin f16 at 82; value (d * sc) * q - (dmin * m).

def _q2_fvals(bld, wptr, off):
    d = _ir.half(bld, _ir.at(bld, wptr, off, 80))
    dmin = _ir.half(bld, _ir.at(bld, wptr, off, 82))
    sm = _ir.load(bld, _ir.at(bld, wptr, off), _ir.V16i8)
    f16 = ir.VectorType(_ir.f32, 16)
    dl = bld.fmul(_ir.splat(bld, d, f16), bld.uitofp(_ir.band(bld, sm, 0x0F), f16))   # d * sc per 16
    ml = bld.fmul(_ir.splat(bld, dmin, f16), bld.uitofp(_ir.lshr(bld, sm, 4), f16))  # dmin * m per 16
    return [bld.fsub(bld.fmul(_per16(bld, dl, g), _ir.to_f32(bld, q, False)), _per16(bld, ml, g))
            for g, q in enumerate(_two_bits(bld, wptr, bld.add(off, _ir.c64(16))))]


def _q2_iprep(bld, wptr, off):
    sm = _ir.load(bld, _ir.at(bld, wptr, off), _ir.V16i8)
    scales = bld.zext(_ir.band(bld, sm, 0x0F), _ir.V16i16)
    mins = bld.zext(_ir.lshr(bld, sm, 4), _ir.V16i16)
    return (_ir.half(bld, _ir.at(bld, wptr, off, 80)), _ir.half(bld, _ir.at(bld, wptr, off, 82)), mins,
            _pair_lanes(bld, scales), _two_bits(bld, wptr, bld.add(off, _ir.c64(16))))


def _q2_itok(bld, state, env: IEnv):
    """ggml's Q2_K dot (x86): acc += (-dx * dmin) * float(mins . bsums), then acc += (dx * d) * float(dot)."""
    d, dmin, mins, lanes, qs = state
    dx = _ir.xscale(bld, env, 256)
    mvec = _ir.madd(bld, mins, _x_sums16(bld, env))
    acc = _group_dots(bld, env, qs, lanes)  # q <= 3
    return [(mvec, bld.fmul(bld.fneg(dx), dmin)), (acc, bld.fmul(dx, d))], None


# -- Q3_K (110 bytes): hmask[32] (bit g of hmask[l]: element l of group g has its high bit), qs[64]
#    (2 bits, as Q2_K), scales[12] (sixteen 6-bit scales, biased by 32), d f16 at 108;
#    value (d * (sc - 32)) * (q2 - (high bit ? 0 : 4)).

def _q3_scales(bld, wptr, off):
    """The 12 bytes at off + 96 -> <16 x i8> signed scales s_0..s_15 (sc - 32), on 32-bit words:
    s_0..7 low nibbles of bytes 0..7, s_8..15 their high nibbles; the top 2 bits of s_(4k+i) are bits
    2k..2k+1 of byte 8 + i."""
    k = lambda v: ir.Constant(_ir.i32, v)  # noqa: E731
    w0, w1, w2 = (_ir.load(bld, _ir.at(bld, wptr, off, 96 + 4 * i), _ir.i32) for i in range(3))
    hi = lambda sh: bld.shl(bld.and_(bld.lshr(w2, k(sh)), k(0x03030303)), k(4))  # noqa: E731
    words = (bld.or_(bld.and_(w0, k(0x0F0F0F0F)), hi(0)), bld.or_(bld.and_(w1, k(0x0F0F0F0F)), hi(2)),
             bld.or_(bld.and_(bld.lshr(w0, k(4)), k(0x0F0F0F0F)), hi(4)),
             bld.or_(bld.and_(bld.lshr(w1, k(4)), k(0x0F0F0F0F)), hi(6)))
    v = ir.Constant(ir.VectorType(_ir.i32, 4), ir.Undefined)
    for i, word in enumerate(words):
        v = bld.insert_element(v, word, ir.Constant(_ir.i32, i))
    return bld.sub(bld.bitcast(v, _ir.V16i8), _ir.vconst(_ir.V16i8, 32))


def _q3_quants(bld, wptr, off):
    """The 8 groups of 32 as signed <32 x i8> in -4..3."""
    hm = _ir.load(bld, _ir.at(bld, wptr, off), _ir.V32i8)
    out = []
    for g, low in enumerate(_two_bits(bld, wptr, bld.add(off, _ir.c64(32)))):
        unset = bld.icmp_unsigned("==", _ir.band(bld, hm, 1 << g), ir.Constant(_ir.V32i8, None))
        out.append(bld.sub(low, bld.select(unset, _ir.vconst(_ir.V32i8, 4), ir.Constant(_ir.V32i8, None))))
    return out


def _q3_fvals(bld, wptr, off):
    d = _ir.half(bld, _ir.at(bld, wptr, off, 108))
    f16 = ir.VectorType(_ir.f32, 16)
    dl = bld.fmul(_ir.splat(bld, d, f16), bld.sitofp(_q3_scales(bld, wptr, off), f16))  # d * (sc - 32) per 16
    return [bld.fmul(_per16(bld, dl, g), _ir.to_f32(bld, q, True)) for g, q in enumerate(_q3_quants(bld, wptr, off))]


def _q3_unsigned(bld, wptr, off):
    """The 8 groups of 32 as <32 x u8> q + 4 in 0..7: the 2 low bits, the hmask bit as 4."""
    hm = _ir.load(bld, _ir.at(bld, wptr, off), _ir.V32i8)
    out = []
    for g, low in enumerate(_two_bits(bld, wptr, bld.add(off, _ir.c64(32)))):
        high = _ir.band(bld, _ir.lshr(bld, hm, g - 2) if g >= 2 else _ir.shl(bld, hm, 2 - g), 4)
        out.append(bld.or_(low, high))
    return out


def _q3_iprep(bld, wptr, off):
    lanes = _pair_lanes(bld, bld.sext(_q3_scales(bld, wptr, off), _ir.V16i16))
    return _ir.half(bld, _ir.at(bld, wptr, off, 108)), lanes, _q3_unsigned(bld, wptr, off)


def _q3_itok(bld, state, env: IEnv):
    """ggml's Q3_K dot (x86): per group the int16 pair sums of q . x times the scales in vpmaddwd, summed
    in int32; acc += (dx * d) * float(lanes). The pair sums are taken as (q + 4) . x - 4 . x, two
    vpmaddubsw of unsigned bytes (ggml's are q_low . x - (4 where the high bit is clear) . x): the same
    int16 in every lane, so the same lanes."""
    d, lanes, qs = state
    four = _ir.vconst(_ir.V32i8, 4)
    acc = ir.Constant(_ir.V8i32, None)
    for g, q in enumerate(qs):  # q + 4 <= 7: no pair sum saturates
        xv = _ir.load(bld, bld.gep(env.xq, [bld.add(env.xe, _ir.c64(32 * g))]), _ir.V32i8)
        pairs = bld.sub(_ir.maddubs(bld, q, xv), _ir.maddubs(bld, four, xv))
        acc = bld.add(acc, _ir.madd(bld, pairs, lanes[g]))
    return [(acc, bld.fmul(_ir.xscale(bld, env, 256), d))], None


# -- IQ4_XS (136 bytes): d f16, scales_h u16 at 2, scales_l[4] at 4, qs[128] at 8 (IQ4_NL's nibble layout,
#    16 bytes per 32-element group g); group scale ls_g = (4 bits of scales_l, 2 of scales_h) - 32;
#    value (d * ls_g) * IQ4NL_VALUES[q].

def _iq4xs_scales(bld, wptr, off):
    """The 8 group scales ls_g - 32 as <8 x i16> (low 4 bits: nibble g % 2 of scales_l[g / 2]; high 2:
    bits 2g..2g+1 of scales_h)."""
    k16 = lambda v: _ir.vconst(ir.VectorType(_ir.i16, 8), v)  # noqa: E731
    lo = bld.zext(_ir.load(bld, _ir.at(bld, wptr, off, 4), ir.VectorType(_ir.i8, 4)), ir.VectorType(_ir.i16, 4))
    lo8 = bld.shuffle_vector(lo, ir.Constant(lo.type, ir.Undefined), _ir.vconst(ir.VectorType(_ir.i32, 8), [g // 2 for g in range(8)]))
    lo8 = bld.and_(bld.lshr(lo8, k16([4 * (g % 2) for g in range(8)])), k16(0x0F))
    sh = _ir.splat(bld, _ir.load(bld, _ir.at(bld, wptr, off, 2), _ir.i16), ir.VectorType(_ir.i16, 8))
    hi8 = bld.and_(bld.lshr(sh, k16([2 * g for g in range(8)])), k16(3))
    return bld.sub(bld.or_(lo8, bld.shl(hi8, k16(4))), k16(32))


def _iq4xs_quants(bld, wptr, off):
    from .legacy import IQ4NL_VALUES

    return [_ir.lookup16(bld, IQ4NL_VALUES, _ir.nibbles16(bld, _ir.at(bld, wptr, off, 8 + 16 * g))) for g in range(8)]


def _iq4xs_fvals(bld, wptr, off):
    d = _ir.half(bld, _ir.at(bld, wptr, off))
    f8 = ir.VectorType(_ir.f32, 8)
    dl = bld.fmul(_ir.splat(bld, d, f8), bld.sitofp(_iq4xs_scales(bld, wptr, off), f8))  # d * ls per group
    return [bld.fmul(_lane(bld, dl, [g] * 32), _ir.to_f32(bld, q, True)) for g, q in enumerate(_iq4xs_quants(bld, wptr, off))]


def _iq4xs_iprep(bld, wptr, off):
    ls = _iq4xs_scales(bld, wptr, off)
    lanes = _ir.spread_i16(bld, _lane(bld, ls, list(range(8)) * 2), [[g] * 16 for g in range(8)])
    return _ir.half(bld, _ir.at(bld, wptr, off)), lanes, _iq4xs_quants(bld, wptr, off)


def _iq4xs_itok(bld, state, env: IEnv):
    """ggml's IQ4_XS dot (x86): per group the signed table values . x times ls_g in vpmaddwd, summed in
    integers over the super-block; acc += (d * dx) * float(lanes)."""
    d, lanes, qs = state
    acc = _group_dots_signed(bld, env, qs, lanes)
    return [(acc, bld.fmul(d, _ir.xscale(bld, env, 256)))], None


def _geometry(name: str) -> tuple[int, int]:
    """(256, bytes per super-block) from gguf-py's GGML_QUANT_SIZES."""
    t = TYPES[QT[name]]
    return t.block, t.block_bytes


FORMATS = {
    "Q4_K": _k4_format("Q4_K", five=False),
    "Q5_K": _k4_format("Q5_K", five=True),
    "Q6_K": Format("Q6_K", *_geometry("Q6_K"), 1, _q6_fvals, _q6_iprep, _q6_itok),
    "Q2_K": Format("Q2_K", *_geometry("Q2_K"), 1, _q2_fvals, _q2_iprep, _q2_itok),
    "Q3_K": Format("Q3_K", *_geometry("Q3_K"), 1, _q3_fvals, _q3_iprep, _q3_itok),
    "IQ4_XS": Format("IQ4_XS", *_geometry("IQ4_XS"), 1, _iq4xs_fvals, _iq4xs_iprep, _iq4xs_itok),
}
