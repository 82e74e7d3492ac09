"""256-element i-quant super-blocks: IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M.

An i-quant stores, per 8 (or 4) elements, an index into a fixed grid of points (the grids and the
sign rule are llama.cpp's, taken from gguf-py's tables), a sign per element, and a small integer scale
per 32 or 16 elements under one f16 super-block scale d. Layouts (bytes per super-block of 256;
"group" g = elements 32g .. 32g+31, "sub-group" l = its elements 8l .. 8l+7):

- IQ2_XXS (66): d, then per group 8 bytes: four grid indices (iq2xxs_grid, 8 values each), then a
  u32 with four 7-bit sign fields (bits 7l..7l+6) and the 4-bit scale s in bits 28..31.
  value = d*(0.5+s)*0.25 * grid * sign.
- IQ2_XS (74): d, qs u16[32] (9-bit index into iq2xs_grid | 7-bit sign field << 9, one per
  sub-group), scales[8] at 66 (low nibble: the group's first 16 elements, high nibble: the rest).
  value = d*(0.5+s)*0.25 * grid * sign.
- IQ2_S (82): d, qs[32] (index low bytes), signs[32] (bit j of byte 4g+l: element 8l+j of group g),
  qh[8] at 66 (2 index high bits per sub-group), scales[8] at 74 as IQ2_XS; grid iq2s_grid (10-bit).
- IQ3_XXS (98): d, qs[64] (one iq3xxs_grid index per 4 elements), then per group a u32 at 66+4g: four
  7-bit sign fields and the scale in bits 28..31. value = d*(0.5+s)*0.5 * grid * sign.
- IQ3_S (110): d, qs[64], qh[8] at 66 (bit k of qh[g]: ninth bit of the group's k-th index), signs[32]
  at 74 (bit j of the u32 at 74+4g: element j of group g), scales[4] at 106 (nibbles, one per group).
  value = d*(1+2s) * grid * sign; grid iq3s_grid (9-bit).
- IQ1_S (50): d, qs[32] (index low bytes), qh u16[8] at 34: bits 3l..3l+2 the index's high bits of
  sub-group l, bits 12..14 the group's scale s, bit 15 the sign of its delta.
  value = d*(2s+1) * (grid + delta), grid in {-1, 0, 1} (iq1s_grid, 11-bit), delta = +-1/8.
- IQ1_M (56): qs[32], qh[16] at 32 (one nibble per sub-group: 3 index high bits, the delta's sign in
  bit 3), scales[8] at 48 as four u16: 3-bit scales per 16 elements (bits 3h..3h+2 of u16 h//4 for
  16-element group h), and d's 16 bits in their top nibbles (u16 k: bits 4k..4k+3 of d).
  value = d*(2s+1) * (grid + delta) per 16 elements, delta per sub-group.
The 7-bit sign fields (IQ2_XXS, IQ2_XS, IQ3_XXS) give 8 signs: the 7 bits and an eighth that makes
the count of minus signs even (llama.cpp's ksigns_iq2xs).

Every type is, per 16-element half h of a group, an integer scale ls_h (2s+1) times integer weights w
(grid * sign, or 8*grid +- 1 for the IQ1 types), times one float per super-block: value = d * F * ls_h
* w with F = 1/8 (IQ2_*, IQ1_*), 1/4 (IQ3_XXS) or 1 (IQ3_S). So a super-block's dot with Q8_K-style
int8 activations (one scale dx per 256, activations.py) is, as in llama.cpp's vec_dot, exact in
integers: d * F * dx * sum_h ls_h * (w_h . x_h). Per group: vpmaddubsw on |w| and x carrying w's sign
(vpsignb; w is never 0), vpmaddwd with the two scales, summed in int32 over the block.

The kernels walk a super-block group by group in a runtime loop (_ir.Format.groups): a group's
unpacking (table lookups, sign expansion) is long, and emitting it once per group rather than eight
times per block keeps the compile time of the drivers near that of the other types. A group is
unpacked once per call and shared by every token of it.

Dequantisation (fvals) repeats gguf-py's float operations (the scale of each 16 computed as it does,
times the signed grid value), so it is bit-identical to gguf.quants.dequantize.
"""
from __future__ import annotations

import numpy as np
from gguf import quants as _gq

from ..weight_types import QT, TYPES
from . import _ir
from ._ir import Format, IEnv, ir

__all__ = ["FORMATS", "GRIDS", "KSIGNS", "EVEN_SIGNS"]

i8, i16, i32, i64, f32 = _ir.i8, _ir.i16, _ir.i32, _ir.i64, _ir.f32
V16i16 = _ir.V16i16
V16f = ir.VectorType(f32, 16)


def _grid(cls, signed: bool = False) -> bytes:
    """gguf-py's grid of a type (float32 (N, 8 or 4)) as the bytes ggml stores: N rows of u8 (i8)."""
    cls.init_grid()
    g = cls.grid.reshape(cls.grid_shape)
    return g.astype(np.int8 if signed else np.uint8).tobytes()


# llama.cpp's grids (ggml-common.h), from gguf-py: name -> (row bytes, table bytes)
GRIDS: dict[str, tuple[int, bytes]] = {
    "IQ2_XXS": (8, _grid(_gq.IQ2_XXS)),
    "IQ2_XS": (8, _grid(_gq.IQ2_XS)),
    "IQ2_S": (8, _grid(_gq.IQ2_S)),
    "IQ3_XXS": (4, _grid(_gq.IQ3_XXS)),
    "IQ3_S": (4, _grid(_gq.IQ3_S)),
    # the IQ1 grid in {-1, 0, 1}, stored times 8: the weights are 8*grid +- 1 (delta = +-1/8)
    "IQ1_S": (8, (np.frombuffer(_grid(_gq.IQ1_S, signed=True), np.int8) * 8).astype(np.int8).tobytes()),
}
KSIGNS = bytes(_gq.IQ2_XXS.ksigns)  # 7-bit sign field -> 8 signs (bit 7: even parity)
# the same as 8 bytes of +-1 per field (llama.cpp's keven_signs_q2xs)
EVEN_SIGNS = np.where((np.frombuffer(KSIGNS, np.uint8)[:, None] >> np.arange(8)) & 1, -1, 1).astype(np.int8).tobytes()


# ---------------------------------------------------------------------------------------------
# IR helpers

def _k(v: int, ty=i32) -> ir.Constant:
    return ir.Constant(ty, v)


def _table(bld: ir.IRBuilder, name: str, data: bytes) -> ir.Value:
    """i8* to a constant table in the module being compiled (one copy per module)."""
    mod = bld.module
    gname = f"clutor.iq.{name}"
    gv = mod.globals.get(gname)
    if gv is None:
        ty = ir.ArrayType(i8, len(data))
        gv = ir.GlobalVariable(mod, ty, gname)
        gv.initializer = ir.Constant(ty, bytearray(data))
        gv.global_constant = True
        gv.linkage = "internal"
        gv.align = 64
    return bld.bitcast(gv, i8.as_pointer())


def _rows(bld, table: ir.Value, width: int, idxs: list[ir.Value]) -> ir.Value:
    """Grid rows at indices idxs (i32) of a table of `width`-byte rows, side by side: <32 x i8>."""
    ity = i64 if width == 8 else i32
    vty = ir.VectorType(ity, 32 // width)
    v = ir.Constant(vty, ir.Undefined)
    for j, idx in enumerate(idxs):
        p = bld.gep(table, [bld.mul(bld.zext(idx, i64), _ir.c64(width))])
        v = bld.insert_element(v, _ir.load(bld, p, ity, width), _k(j))
    return bld.bitcast(v, _ir.V32i8)


def _bits_mask(bld, word: ir.Value) -> ir.Value:
    """i32 word -> <32 x i1>: lane j set where bit j is."""
    sel = bld.shuffle_vector(bld.bitcast(_ir.splat(bld, word, _ir.V8i32), _ir.V32i8), ir.Constant(_ir.V32i8, ir.Undefined),
                             _ir.vconst(ir.VectorType(i32, 32), [j // 8 for j in range(32)]))
    bit = bld.and_(sel, _ir.vconst(_ir.V32i8, [1 << (j % 8) for j in range(32)]))
    return bld.icmp_unsigned("!=", bit, ir.Constant(_ir.V32i8, None))


def _bit_signs(bld, word: ir.Value) -> ir.Value:
    """i32 word -> <32 x i8>: -1 in lane j where bit j is set, else +1."""
    return _plus_minus(bld, _bits_mask(bld, word))


def _field_signs(bld, fields: list[ir.Value]) -> ir.Value:
    """Four 7-bit sign fields (i32 each, sub-groups 0..3) -> <32 x i8> of +-1, through the table of
    their 8 signs each (KSIGNS as +-1 bytes, as llama.cpp's x86 code keeps it)."""
    return _rows(bld, _table(bld, "SIGNS", EVEN_SIGNS), 8, fields)


def _lane(bld, v: ir.Value, lanes: list[int]) -> ir.Value:
    return bld.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), _ir.vconst(ir.VectorType(i32, len(lanes)), lanes))


def _pair(bld, a: ir.Value, b: ir.Value, vty: ir.VectorType) -> ir.Value:
    """[a] * n/2 + [b] * n/2 as a vector of type vty."""
    two = ir.VectorType(vty.element, 2)
    v = bld.insert_element(bld.insert_element(ir.Constant(two, ir.Undefined), a, _k(0)), b, _k(1))
    n = vty.count
    return _lane(bld, v, [0] * (n // 2) + [1] * (n // 2))


class _Group:
    """Byte addressing inside sub-block g (an i64 value) of the super-block at byte `off`."""

    def __init__(self, bld, wptr, off, g):
        self.bld, self.wptr, self.off, self.g = bld, wptr, off, g

    def addr(self, base: int, stride: int, k: int = 0) -> ir.Value:
        """Byte off + base + stride * g + k."""
        bld = self.bld
        return bld.add(self.off, bld.add(bld.mul(self.g, _ir.c64(stride)), _ir.c64(base + k)))

    def load(self, ty, base: int, stride: int, k: int = 0) -> ir.Value:
        """The value of type ty (i8, i16, i32) there, zero-extended to i32."""
        v = _ir.load(self.bld, _ir.at(self.bld, self.wptr, self.addr(base, stride, k)), ty)
        return v if ty is i32 else self.bld.zext(v, i32)

    def shift(self, per_odd: int) -> ir.Value:
        """per_odd * (g % 2) as i32: where a field shared by two groups sits for this one."""
        bld = self.bld
        return bld.mul(bld.trunc(bld.and_(self.g, _ir.c64(1)), i32), _k(per_odd))

    def half_g(self) -> "_Group":
        """The same block with index g // 2 (for fields shared by two groups)."""
        return _Group(self.bld, self.wptr, self.off, self.bld.lshr(self.g, _ir.c64(1)))


# ---------------------------------------------------------------------------------------------
# Per type: one group as (magnitudes, signs, s_lo, s_hi): the IQ2/IQ3 grid values (unsigned <32 x i8>)
# and their signs (<32 x i8> of +-1), or for IQ1 the signed weights 8*grid +- 1 and None; and the
# group's two raw scale fields (elements 0..15, 16..31; equal where the type has one scale per 32),
# as i32.

def _iq2_xxs(G: _Group):
    bld = G.bld
    aux = G.load(i32, 2 + 4, 8)
    idx = [G.load(i8, 2, 8, l) for l in range(4)]
    signs = _field_signs(bld, [bld.and_(bld.lshr(aux, _k(7 * l)), _k(127)) for l in range(4)])
    s = bld.lshr(aux, _k(28))
    return _rows(bld, _table(bld, "IQ2_XXS", GRIDS["IQ2_XXS"][1]), 8, idx), signs, s, s


def _iq2_xs(G: _Group):
    bld = G.bld
    qs = [G.load(i16, 2, 8, 2 * l) for l in range(4)]
    grid = _rows(bld, _table(bld, "IQ2_XS", GRIDS["IQ2_XS"][1]), 8, [bld.and_(q, _k(511)) for q in qs])
    sc = G.load(i8, 66, 1)
    return grid, _field_signs(bld, [bld.lshr(q, _k(9)) for q in qs]), bld.and_(sc, _k(15)), bld.lshr(sc, _k(4))


def _iq2_s(G: _Group):
    bld = G.bld
    qh = G.load(i8, 66, 1)
    idx = [bld.or_(G.load(i8, 2, 4, l), bld.and_(bld.shl(qh, _k(8 - 2 * l)), _k(0x300))) for l in range(4)]
    grid = _rows(bld, _table(bld, "IQ2_S", GRIDS["IQ2_S"][1]), 8, idx)
    sc = G.load(i8, 74, 1)
    return grid, _bit_signs(bld, G.load(i32, 34, 4)), bld.and_(sc, _k(15)), bld.lshr(sc, _k(4))


def _iq3_xxs(G: _Group):
    bld = G.bld
    aux = G.load(i32, 66, 4)
    idx = [G.load(i8, 2, 8, k) for k in range(8)]
    signs = _field_signs(bld, [bld.and_(bld.lshr(aux, _k(7 * l)), _k(127)) for l in range(4)])
    s = bld.lshr(aux, _k(28))
    return _rows(bld, _table(bld, "IQ3_XXS", GRIDS["IQ3_XXS"][1]), 4, idx), signs, s, s


def _iq3_s(G: _Group):
    bld = G.bld
    qh = G.load(i8, 66, 1)
    idx = [bld.or_(G.load(i8, 2, 8, k), bld.and_(bld.shl(qh, _k(8 - k)), _k(0x100))) for k in range(8)]
    grid = _rows(bld, _table(bld, "IQ3_S", GRIDS["IQ3_S"][1]), 4, idx)
    s = bld.and_(bld.lshr(G.half_g().load(i8, 106, 1), G.shift(4)), _k(15))
    return grid, _bit_signs(bld, G.load(i32, 74, 4)), s, s


def _iq1_weights(bld, idx: list[ir.Value], delta: ir.Value) -> ir.Value:
    """8*grid + delta for one group: grid rows at idx (4 sub-groups) plus delta (<32 x i8> of +-1)."""
    return bld.add(_rows(bld, _table(bld, "IQ1_S", GRIDS["IQ1_S"][1]), 8, idx), delta)


def _plus_minus(bld, neg: ir.Value) -> ir.Value:
    """<32 x i1> -> <32 x i8>: -1 where set, else +1."""
    return bld.or_(bld.sext(neg, _ir.V32i8), _ir.vconst(_ir.V32i8, 1))


def _iq1_s(G: _Group):
    bld = G.bld
    qh = G.load(i16, 34, 2)
    if _FAST_PDEP:  # the four 11-bit indices as u16 lanes of one i64, in two pdeps (as llama.cpp)
        packed = bld.or_(_pdep(bld, bld.zext(G.load(i32, 2, 4), i64), 0x00FF00FF00FF00FF),
                         _pdep(bld, bld.zext(qh, i64), 0x0700070007000700))
        idx = _u16_lanes(bld, packed)
    else:
        idx = [bld.or_(G.load(i8, 2, 4, l), bld.and_(_shl_r(bld, qh, 8 - 3 * l), _k(0x700))) for l in range(4)]
    neg = bld.icmp_unsigned("!=", bld.and_(qh, _k(0x8000)), _k(0))
    delta = _ir.splat(bld, bld.select(neg, _k(-1, i8), _k(1, i8)), _ir.V32i8)
    s = bld.and_(bld.lshr(qh, _k(12)), _k(7))
    return _iq1_weights(bld, idx, delta), None, s, s


def _iq1_m(G: _Group):
    bld = G.bld
    qh = G.load(i16, 32, 2)  # the group's two qh bytes: a nibble per sub-group
    if _FAST_PDEP:
        packed = bld.or_(_pdep(bld, bld.zext(G.load(i32, 0, 4), i64), 0x00FF00FF00FF00FF),
                         _pdep(bld, bld.zext(bld.and_(qh, _k(0x7777)), i64), 0x0F000F000F000F00))
        idx = _u16_lanes(bld, packed)
    else:
        idx = [bld.or_(G.load(i8, 0, 4, l), bld.and_(_shl_r(bld, qh, (8, 4, 0, -4)[l]), _k(0x700))) for l in range(4)]
    # bit 3 of each nibble: the sign of its sub-group's delta
    qh8 = bld.bitcast(_ir.splat(bld, bld.trunc(qh, i16), V16i16), _ir.V32i8)
    sel = _lane(bld, qh8, [0] * 16 + [1] * 16)
    neg = bld.icmp_unsigned("!=", bld.and_(sel, _ir.vconst(_ir.V32i8, ([0x08] * 8 + [0x80] * 8) * 2)), ir.Constant(_ir.V32i8, None))
    sc = bld.lshr(G.half_g().load(i16, 48, 2), G.shift(6))
    return _iq1_weights(bld, idx, _plus_minus(bld, neg)), None, bld.and_(sc, _k(7)), bld.and_(bld.lshr(sc, _k(3)), _k(7))


# BMI2's pdep, where it is one fast instruction (not on AMD before Zen 3, which microcode it)
_FAST_PDEP = (_ir.HAVE_INT8_SIMD and bool(_ir._features.get("bmi2", False))
              and _ir._llvm.get_host_cpu_name() not in ("znver1", "znver2", "bdver4", "bdver3", "bdver2", "bdver1"))


def _pdep(bld, v: ir.Value, mask: int) -> ir.Value:
    f = _ir.declare(bld, "llvm.x86.bmi.pdep.64", i64, [i64, i64])
    return bld.call(f, [v, ir.Constant(i64, mask)])


def _u16_lanes(bld, packed: ir.Value) -> list[ir.Value]:
    """i64 -> its four u16 lanes as i32."""
    return [bld.trunc(bld.and_(bld.lshr(packed, ir.Constant(i64, 16 * l)), ir.Constant(i64, 0xFFFF)), i32) for l in range(4)]


def _shl_r(bld, v: ir.Value, n: int) -> ir.Value:
    """v << n, or v >> -n for negative n."""
    return bld.shl(v, _k(n)) if n >= 0 else bld.lshr(v, _k(-n))


def _d_first(bld, wptr, off) -> ir.Value:
    """The f16 super-block scale at the block's first two bytes."""
    return _ir.half(bld, _ir.at(bld, wptr, off))


def _d_iq1_m(bld, wptr, off) -> ir.Value:
    """IQ1_M's f16 scale: nibble k is the top nibble of the u16 at 48 + 2k."""
    bits = None
    for k in range(4):
        sc = bld.zext(_ir.load(bld, _ir.at(bld, wptr, off, 48 + 2 * k), i16), i32)
        part = bld.shl(bld.lshr(sc, _k(12)), _k(4 * k))
        bits = part if bits is None else bld.or_(bits, part)
    bits = bld.trunc(bits, i16)
    if _ir.HAVE_F16C or not _ir._IS_X86:
        return bld.fpext(bld.bitcast(bits, ir.HalfType()), f32)
    slot = _ir.cgutils.alloca_once(bld, i16)  # x86 without F16C: _ir's bit-level conversion reads memory
    bld.store(bits, slot)
    return _ir._half_soft(bld, bld.bitcast(slot, i8.as_pointer()))


# ---------------------------------------------------------------------------------------------
# Formats

def _iquant(name: str, unpack, d_of=_d_first, half_scale: float | None = None, iq1: bool = False,
            factor: float = 0.125) -> Format:
    """unpack(_Group) -> (w, s_lo, s_hi). The float scale of 16 elements is d*(0.5+s)*half_scale where
    half_scale is given (IQ2_*, IQ3_XXS), else d*(2s+1); the value is that times w (IQ1: times w/8 =
    grid + delta). int8: d*factor*dx * sum_h (2s_h+1)(w_h . x_h)."""
    geometry = TYPES[QT[name]]

    def fvals(bld, wptr, off, g):
        mag, signs, sa, sb = unpack(_Group(bld, wptr, off, g))
        d = d_of(bld, wptr, off)
        dbs = []
        for s in (sa, sb):
            if half_scale is not None:  # gguf-py: d * (0.5 + s) * k
                db = bld.fmul(bld.fmul(d, bld.fadd(ir.Constant(f32, 0.5), bld.uitofp(s, f32))), ir.Constant(f32, half_scale))
            else:  # gguf-py: d * (2s + 1), the odd integer first
                db = bld.fmul(d, bld.uitofp(bld.add(bld.shl(s, _k(1)), _k(1)), f32))
            dbs.append(db)
        if signs is None:  # IQ1: signed already
            wf = _ir.to_f32(bld, mag, True)
        else:  # grid * sign, exact in float
            wf = bld.fmul(_ir.to_f32(bld, mag, False), _ir.to_f32(bld, signs, True))
        if iq1:  # grid + delta, exactly: (8*grid +- 1) / 8
            wf = bld.fmul(wf, _ir.vconst(_ir.V32f, 0.125))
        return [bld.fmul(_pair(bld, dbs[0], dbs[1], _ir.V32f), wf)]

    def iprep(bld, wptr, off, g):
        mag, signs, sa, sb = unpack(_Group(bld, wptr, off, g))
        ls = [bld.trunc(bld.add(bld.shl(s, _k(1)), _k(1)), i16) for s in (sa, sb)]
        if signs is None:  # IQ1: |w| and w's own signs (w is never 0)
            signs = mag
            mag = bld.call(_ir.declare(bld, "llvm.abs.v32i8", _ir.V32i8, [_ir.V32i8, _ir.i1]), [mag, ir.Constant(_ir.i1, 0)])
        return mag, signs, _pair(bld, ls[0], ls[1], V16i16)

    def itok(bld, state, env: IEnv):
        mag, signs, lane = state
        xv = _ir.load(bld, bld.gep(env.xq, [env.xe]), _ir.V32i8)
        sx = bld.call(_ir.declare(bld, "llvm.x86.avx2.psign.b", _ir.V32i8, [_ir.V32i8, _ir.V32i8]), [xv, signs])
        return _ir.madd(bld, _ir.maddubs(bld, mag, sx), lane)  # |w| <= 62, |x| <= 127: no int16 saturation

    def iscale(bld, wptr, off):
        return bld.fmul(d_of(bld, wptr, off), ir.Constant(f32, factor))

    return Format(name, geometry.block, geometry.block_bytes, 1, fvals, iprep, itok, groups=8, iscale=iscale)


FORMATS = {
    "IQ2_XXS": _iquant("IQ2_XXS", _iq2_xxs, half_scale=0.25),
    "IQ2_XS": _iquant("IQ2_XS", _iq2_xs, half_scale=0.25),
    "IQ2_S": _iquant("IQ2_S", _iq2_s, half_scale=0.25),
    "IQ3_XXS": _iquant("IQ3_XXS", _iq3_xxs, half_scale=0.5, factor=0.25),
    "IQ3_S": _iquant("IQ3_S", _iq3_s, factor=1.0),
    "IQ1_S": _iquant("IQ1_S", _iq1_s, iq1=True),
    "IQ1_M": _iquant("IQ1_M", _iq1_m, d_of=_d_iq1_m, iq1=True),
}
