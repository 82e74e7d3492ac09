"""32-element block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4.

Layouts (bytes per block of 32): Q8_0 d:f16, q:i8[32], value d*q (34); Q4_0 d, qs[16] with element
j in the low nibble of qs[j] and j+16 in the high nibble, value d*(q-8) (18); Q4_1 d, m, qs, value
d*q+m (20); Q5_0 d, qh:u32 (bit j = fifth bit of element j), qs, value d*(q-16) (22); Q5_1 d, m,
qh, qs, value d*q+m (24); IQ4_NL d, qs, value d*IQ4NL_VALUES[q] (18); MXFP4 e:u8 (E8M0 exponent),
qs[16] (nibbles as Q4_0), value 2^(e-128) * MXFP4_VALUES[q] (17: the E2M1 levels doubled, the scale halved,
as ggml stores them).

The int8 path multiplies with ggml's 32-element activation blocks (activations.py: Q8_0, and Q8_1 for
the types with a min) the way ggml's x86 dot products do: per block, float(integer dot) times
(d * dx), the integer dot taken over the signed values (q - 8 for Q4_0, q - 16 for Q5_0, the table
values for IQ4_NL / MXFP4); Q4_1 / Q5_1 dot their unsigned q and add m * s (Q8_1's s = half(dx *
sum(xq))), summed block by block.
"""
from __future__ import annotations

from ..weight_types import QT, TYPES
from . import _ir
from ._ir import Format, IEnv, ir

__all__ = ["IQ4NL_VALUES", "MXFP4_VALUES", "FORMATS"]


# llama.cpp's kvalues_iq4nl: the 16 signed levels an IQ4_NL nibble selects.
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


# ggml's kvalues_mxfp4: the E2M1 levels (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) times 2.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _e8m0_half(bld, p):
    """E8M0 exponent byte e at p -> float 2^(e - 128) (ggml's E8M0 to fp32, halved): the bits are
    (e - 1) << 23, or for e < 2 the subnormal 0x00200000 << e."""
    e = bld.zext(_ir.load(bld, p, _ir.i8), _ir.i32)
    k = lambda v: ir.Constant(_ir.i32, v)  # noqa: E731
    bits = bld.select(bld.icmp_unsigned("<", e, k(2)), bld.shl(k(0x00200000), e), bld.shl(bld.sub(e, k(1)), k(23)))
    return bld.bitcast(bits, _ir.f32)


def _legacy(name: str, quants, bias: int = 0, has_min: bool = False, signed: bool = False,
            scale=None) -> Format:
    """quants(bld, wptr, off) -> <32 x i8> raw quants (unsigned unless `signed`); d is the first f16
    (or scale(bld, p)); m (has_min) the second; value = d*(q - bias) or d*q + m."""
    scale = scale or _ir.half

    def fvals(bld, wptr, off):
        d = scale(bld, _ir.at(bld, wptr, off))
        q = quants(bld, wptr, off)
        if bias:  # the reference subtracts in int8, then converts
            v = bld.fmul(_ir.splat(bld, d, _ir.V32f), _ir.to_f32(bld, bld.sub(q, _ir.vconst(_ir.V32i8, bias)), True))
        else:
            v = bld.fmul(_ir.to_f32(bld, q, signed), _ir.splat(bld, d, _ir.V32f))
        if has_min:
            v = bld.fadd(v, _ir.splat(bld, _ir.half(bld, _ir.at(bld, wptr, off, 2)), _ir.V32f))
        return [v]

    def iprep(bld, wptr, off):
        d = scale(bld, _ir.at(bld, wptr, off))
        m = _ir.half(bld, _ir.at(bld, wptr, off, 2)) if has_min else None
        q = quants(bld, wptr, off)
        if bias:  # the signed values, as ggml's dot products take them: q - 8 in -8..7, q - 16 in -16..15
            q = bld.sub(q, _ir.vconst(_ir.V32i8, bias))
        if signed or bias:  # move the weight's sign onto x later: |w| is what the instruction multiplies
            aw = bld.call(_ir.declare(bld, "llvm.abs.v32i8", _ir.V32i8, [_ir.V32i8, _ir.i1]), [q, ir.Constant(_ir.i1, 0)])
            neg = bld.icmp_signed("<", q, ir.Constant(_ir.V32i8, None))
            return d, m, aw, neg
        return d, m, q, None

    def itok(bld, state, env: IEnv):
        d, m, q, neg = state
        xv = _ir.load(bld, bld.gep(env.xq, [env.xe]), _ir.V32i8)
        if neg is not None:
            xv = bld.select(neg, bld.neg(xv), xv)
        ivec = _ir.dot_u8s8(bld, q, xv)
        scale = bld.fmul(d, _ir.xscale(bld, env, 32))  # ggml: d(weight) * d(activation), then * the dot
        corr = bld.fmul(m, _ir.xsum1(bld, env)) if has_min else None
        return [(ivec, scale)], corr

    geometry = TYPES[QT[name]]  # 32 elements, bytes from gguf-py's GGML_QUANT_SIZES
    return Format(name, geometry.block, geometry.block_bytes, 8, fvals, iprep, itok)


def _q8_0(bld, wptr, off):
    return _ir.load(bld, _ir.at(bld, wptr, off, 2), _ir.V32i8)


def _q4_0(bld, wptr, off):
    return _ir.nibbles16(bld, _ir.at(bld, wptr, off, 2))


def _q4_1(bld, wptr, off):
    return _ir.nibbles16(bld, _ir.at(bld, wptr, off, 4))


def _q5_0(bld, wptr, off):
    return bld.or_(_ir.nibbles16(bld, _ir.at(bld, wptr, off, 6)), _ir.bits32(bld, _ir.at(bld, wptr, off, 2), 16))


def _q5_1(bld, wptr, off):
    return bld.or_(_ir.nibbles16(bld, _ir.at(bld, wptr, off, 8)), _ir.bits32(bld, _ir.at(bld, wptr, off, 4), 16))


def _iq4_nl(bld, wptr, off):
    return _ir.lookup16(bld, IQ4NL_VALUES, _ir.nibbles16(bld, _ir.at(bld, wptr, off, 2)))


def _mxfp4(bld, wptr, off):
    return _ir.lookup16(bld, MXFP4_VALUES, _ir.nibbles16(bld, _ir.at(bld, wptr, off, 1)))


FORMATS = {
    "Q8_0": _legacy("Q8_0", _q8_0, signed=True),
    "Q4_0": _legacy("Q4_0", _q4_0, bias=8),
    "Q4_1": _legacy("Q4_1", _q4_1, has_min=True),
    "Q5_0": _legacy("Q5_0", _q5_0, bias=16),
    "Q5_1": _legacy("Q5_1", _q5_1, has_min=True),
    "IQ4_NL": _legacy("IQ4_NL", _iq4_nl, signed=True),
    "MXFP4": _legacy("MXFP4", _mxfp4, signed=True, scale=_e8m0_half),
}
