"""F16 and BF16 weights as rows of 32-element "blocks" of 64 bytes (no scale, no int8 path).

F32 weights never come here: the dispatcher hands them straight to BLAS.
"""
from __future__ import annotations

from . import _ir
from ._ir import Format, ir

__all__ = ["FORMATS"]


def _f16(bld, wptr, off):
    return [bld.fpext(_ir.load(bld, _ir.at(bld, wptr, off), ir.VectorType(ir.HalfType(), 32)), _ir.V32f)]


def _bf16(bld, wptr, off):
    bits = bld.zext(_ir.load(bld, _ir.at(bld, wptr, off), _ir.V32i16), _ir.V32i32)
    return [bld.bitcast(_ir.shl(bld, bits, 16), _ir.V32f)]


FORMATS = {
    "F16": Format("F16", 32, 64, 8, _f16),
    "BF16": Format("BF16", 32, 64, 8, _bf16),
}
