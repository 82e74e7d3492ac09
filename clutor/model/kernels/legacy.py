"""32-element block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4.

Layouts (bytes per block of 32): Q8_0 d:f16, q:i8[32], value d*q (34); Q4_0 d, qs[16] with element
j in the low nibble of qs[j] and j+16 in the high nibble, value d*(q-8) (18); Q4_1 d, m, qs, value
d*q+m (20); Q5_0 d, qh:u32 (bit j = fifth bit of element j), qs, value d*(q-16) (22); Q5_1 d, m,
qh, qs, value d*q+m (24); IQ4_NL d, qs, value d*IQ4NL_VALUES[q] (18); MXFP4 e:u8 (E8M0 exponent),
qs[16] (nibbles as Q4_0), value 2^(e-128) * MXFP4_VALUES[q] (17: the E2M1 levels doubled, the scale halved,
as ggml stores them).

The int8 path rounds activations per 32 elements (like llama.cpp's Q8_0 / Q8_1 activations): the
block dot is d*dx*dot(q, xq), plus -bias*d*dx*sum(xq) for the offset types and m*dx*sum(xq) for
the types with a min.
"""
from __future__ import annotations

from . import _ir as R
from ._ir import Format, IEnv, ir

__all__ = ["IQ4NL_VALUES", "MXFP4_VALUES", "FORMATS"]


# llama.cpp's kvalues_iq4nl: the 16 signed levels an IQ4_NL nibble selects.
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


# ggml's kvalues_mxfp4: the E2M1 levels (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) times 2.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _e8m0_half(b, p):
    """E8M0 exponent byte e at p -> float 2^(e - 128) (ggml's E8M0 to fp32, halved): the bits are
    (e - 1) << 23, or for e < 2 the subnormal 0x00200000 << e."""
    e = b.zext(R.load(b, p, R.i8), R.i32)
    k = lambda v: ir.Constant(R.i32, v)  # noqa: E731
    bits = b.select(b.icmp_unsigned("<", e, k(2)), b.shl(k(0x00200000), e), b.shl(b.sub(e, k(1)), k(23)))
    return b.bitcast(bits, R.f32)


def _legacy(name: str, nbytes: int, quants, bias: int = 0, has_min: bool = False, signed: bool = False,
            scale=None) -> Format:
    """quants(b, wp, off) -> <32 x i8> raw quants (unsigned unless `signed`); d is the first f16
    (or scale(b, p)); m (has_min) the second; value = d*(q - bias) or d*q + m."""
    scale = scale or R.half

    def fvals(b, wp, off):
        d = scale(b, R.at(b, wp, off))
        q = quants(b, wp, off)
        if bias:  # the reference subtracts in int8, then converts
            v = b.fmul(R.splat(b, d, R.V32f), R.to_f32(b, b.sub(q, R.vconst(R.V32i8, bias)), True))
        else:
            v = b.fmul(R.to_f32(b, q, signed), R.splat(b, d, R.V32f))
        if has_min:
            v = b.fadd(v, R.splat(b, R.half(b, R.at(b, wp, off, 2)), R.V32f))
        return [v]

    def iprep(b, wp, off):
        d = scale(b, R.at(b, wp, off))
        m = R.half(b, R.at(b, wp, off, 2)) if has_min else None
        q = quants(b, wp, off)
        if signed:  # move the weight's sign onto x later: |w| is what the instruction multiplies
            aw = b.call(R.fn(b, "llvm.abs.v32i8", R.V32i8, [R.V32i8, R.i1]), [q, ir.Constant(R.i1, 0)])
            neg = b.icmp_signed("<", q, ir.Constant(R.V32i8, None))
            return d, m, aw, neg
        return d, m, q, None

    def itok(b, state, env: IEnv):
        d, m, q, neg = state
        xv = R.load(b, b.gep(env.xq, [env.xe]), R.V32i8)
        if neg is not None:
            xv = b.select(neg, b.neg(xv), xv)
        dx = R.xscale(b, env, 32)
        scale = b.fmul(d, dx)
        ivec = R.dot_u8s8(b, q, xv)
        corr = None
        if has_min:
            corr = b.fmul(b.fmul(m, dx), b.sitofp(R.xsum(b, env, 32), R.f32))
        elif bias:
            corr = b.fmul(b.fmul(scale, ir.Constant(R.f32, float(-bias))), b.sitofp(R.xsum(b, env, 32), R.f32))
        return [(ivec, scale)], corr

    return Format(name, 32, nbytes, 8, fvals, iprep, itok)


def _q8_0(b, wp, off):
    return R.load(b, R.at(b, wp, off, 2), R.V32i8)


def _q4_0(b, wp, off):
    return R.nibbles16(b, R.at(b, wp, off, 2))


def _q4_1(b, wp, off):
    return R.nibbles16(b, R.at(b, wp, off, 4))


def _q5_0(b, wp, off):
    return b.or_(R.nibbles16(b, R.at(b, wp, off, 6)), R.bits32(b, R.at(b, wp, off, 2), 16))


def _q5_1(b, wp, off):
    return b.or_(R.nibbles16(b, R.at(b, wp, off, 8)), R.bits32(b, R.at(b, wp, off, 4), 16))


def _iq4_nl(b, wp, off):
    return R.lookup16(b, IQ4NL_VALUES, R.nibbles16(b, R.at(b, wp, off, 2)))


def _mxfp4(b, wp, off):
    return R.lookup16(b, MXFP4_VALUES, R.nibbles16(b, R.at(b, wp, off, 1)))


FORMATS = {
    "Q8_0": _legacy("Q8_0", 34, _q8_0, signed=True),
    "Q4_0": _legacy("Q4_0", 18, _q4_0, bias=8),
    "Q4_1": _legacy("Q4_1", 20, _q4_1, has_min=True),
    "Q5_0": _legacy("Q5_0", 22, _q5_0, bias=16),
    "Q5_1": _legacy("Q5_1", 24, _q5_1, has_min=True),
    "IQ4_NL": _legacy("IQ4_NL", 18, _iq4_nl, signed=True),
    "MXFP4": _legacy("MXFP4", 17, _mxfp4, signed=True, scale=_e8m0_half),
}
