"""F16 and BF16 weights as rows of 32-element "blocks" of 64 bytes (no scale, no int8 path).

F32 weights never come here: the dispatcher hands them straight to BLAS.
"""
from __future__ import annotations

from . import _ir as R
from ._ir import Format, ir

__all__ = ["FORMATS"]


def _f16(b, wp, off):
    return [b.fpext(R.load(b, R.at(b, wp, off), ir.VectorType(ir.HalfType(), 32)), R.V32f)]


def _bf16(b, wp, off):
    bits = b.zext(R.load(b, R.at(b, wp, off), R.V32i16), R.V32i32)
    return [b.bitcast(R.shl(b, bits, 16), R.V32f)]


FORMATS = {
    "F16": Format("F16", 32, 64, 8, _f16),
    "BF16": Format("BF16", 32, 64, 8, _bf16),
}
