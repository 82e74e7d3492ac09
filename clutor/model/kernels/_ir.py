"""LLVM IR building blocks for the kernels, and the generator of per-type row functions.

Why the hot loops are written as LLVM IR (through numba ``@intrinsic`` + llvmlite) instead of plain
numba: measured on this project's machine, numba's own code for these loops stayed scalar
(0.9-3 GB/s): it promotes every integer product to int64, every slice of the weight bytes costs a
reference-count call, and LLVM's vectoriser gives up on the byte-to-float loops (it cannot prove
the weight bytes and the output do not overlap). Written as explicit vector IR — load 32 quants,
unpack nibbles with vector and/shift, convert, fused multiply-add — the same row runs 5-10x faster,
and on x86 the int8 path uses the instructions llama.cpp relies on (``vpmaddubsw``/``vpmaddwd``,
AVX512-VNNI ``vpdpbusd``). numba keeps what it is good at: the thread-parallel loop over rows.

A weight type is described by a ``Format`` (block size, how to unpack a block to float vectors, how
to dot a block with int8 activations). Three generators turn a {type id: Format} table into numba
intrinsics whose first argument is the runtime type id (one switch per call, one tight loop per type):

- ``deq_intrinsic``: dequantise a row into float32, bit-identical to gguf-py's reference (same float
  operations);
- ``tile_intrinsic``: several rows times several float activation rows (the default path);
- ``idot_intrinsic``: a row times int8 activations (activations.py); x86 with AVX2 only
  (``HAVE_INT8_SIMD``).

Everything here is portable LLVM IR except the int8 dot instructions, the 16-entry byte table
lookup (IQ4_NL) and the scale spreading (``spread_i16``: vpshufb as inline assembly), which have
portable fallbacks or are only emitted when ``HAVE_INT8_SIMD`` (as are iquants.py's vpsignb and pdep).
No bounds checks: callers derive every offset from validated shapes (the list: __init__.py, above
``_check``). A newcomer's guide to this file: README.md in this package.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Callable

from llvmlite import binding as _llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "HAVE_INT8_SIMD", "HAVE_VNNI", "HAVE_F16C", "PREFETCH_BYTES", "BACKEND",
    "Format", "deq_intrinsic", "idot_intrinsic", "tile_intrinsic", "TILE_ROWS", "TILE_TOKENS", "load_f16",
]

_IS_X86 = platform.machine().lower() in ("x86_64", "amd64")
_features = _llvm.get_host_cpu_features() if _IS_X86 else {}
# the kernels emit a few instructions as inline assembly (spread_i16): numba's JIT needs the parser
_llvm.initialize_native_asmparser()
# CLUTOR_KERNELS_ISA=avx2|portable generates the code a lesser CPU would get (to test fallbacks).
ISA_OVERRIDE = os.environ.get("CLUTOR_KERNELS_ISA", "")
HAVE_F16C: bool = bool(_features.get("f16c", False))
X86_WITHOUT_F16C: bool = _IS_X86 and not HAVE_F16C
HAVE_INT8_SIMD: bool = bool(_features.get("avx2", False)) and HAVE_F16C and ISA_OVERRIDE != "portable"
HAVE_VNNI: bool = (HAVE_INT8_SIMD and bool(_features.get("avx512vnni", False))
                   and bool(_features.get("avx512vl", False)) and ISA_OVERRIDE != "avx2")
BACKEND: str = "x86-avx512vnni" if HAVE_VNNI else "x86-avx2" if HAVE_INT8_SIMD else "portable"

# Software prefetch distance for the weight stream. One core reading one contiguous slab left the
# int8 Q8_0 kernel at ~8 GB/s from DRAM with the hardware prefetcher alone; asking for lines a few
# KiB ahead raised it to ~11 GB/s per core (see tools/bench_kernels.py).
PREFETCH_BYTES = 4096

i1, i8, i16, i32, i64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
f32 = ir.FloatType()
V16i8 = ir.VectorType(i8, 16)
V32i8 = ir.VectorType(i8, 32)
V16i16 = ir.VectorType(i16, 16)
V32i16 = ir.VectorType(i16, 32)
V8i32 = ir.VectorType(i32, 8)
V32i32 = ir.VectorType(i32, 32)
V8f = ir.VectorType(f32, 8)
V32f = ir.VectorType(f32, 32)


# ---------------------------------------------------------------------------------------------
# Small IR helpers

def declare(bld: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return cgutils.get_or_insert_function(bld.module, ir.FunctionType(ret, args), name)


def data_ptr(context, bld: ir.IRBuilder, aty, aval, elt: ir.Type = i8) -> ir.Value:
    """Pointer (to `elt`) at the first element of a numba array, or an integer address (the
    batched drivers get each weight's address, checked and kept alive by the Python caller)."""
    if isinstance(aty, types.Integer):
        return bld.inttoptr(aval, elt.as_pointer())
    ptr = cgutils.create_struct_proxy(aty)(context, bld, value=aval).data
    return bld.bitcast(ptr, elt.as_pointer())


def c64(v: int) -> ir.Constant:
    return ir.Constant(i64, v)


def vconst(ty: ir.VectorType, v) -> ir.Constant:
    return ir.Constant(ty, [v] * ty.count if not isinstance(v, (list, tuple)) else list(v))


def at(bld: ir.IRBuilder, base: ir.Value, off: ir.Value, k: int = 0) -> ir.Value:
    """base + off + k (in base's element units)."""
    return bld.gep(base, [off if k == 0 else bld.add(off, c64(k))])


def load(bld: ir.IRBuilder, p: ir.Value, ty: ir.Type, align: int = 1) -> ir.Value:
    return bld.load(bld.bitcast(p, ty.as_pointer()), align=align)


def store(bld: ir.IRBuilder, v: ir.Value, p: ir.Value, align: int = 4) -> None:
    bld.store(v, bld.bitcast(p, v.type.as_pointer()), align=align)


def half(bld: ir.IRBuilder, p: ir.Value) -> ir.Value:
    """IEEE half at byte address p -> float."""
    if HAVE_F16C or not _IS_X86:
        return bld.fpext(load(bld, p, ir.HalfType()), f32)
    return _half_soft(bld, p)


def _half_soft(bld: ir.IRBuilder, p: ir.Value) -> ir.Value:
    """Bit-level half -> float for x86 CPUs without F16C (LLVM would emit a libcall numba lacks)."""
    h = bld.zext(load(bld, p, i16), i32)
    k = lambda v: ir.Constant(i32, v)  # noqa: E731
    sign = bld.shl(bld.and_(h, k(0x8000)), k(16))
    exp = bld.and_(bld.lshr(h, k(10)), k(0x1F))
    man = bld.and_(h, k(0x3FF))
    normal = bld.or_(bld.shl(bld.add(exp, k(112)), k(23)), bld.shl(man, k(13)))
    infnan = bld.or_(k(0x7F800000), bld.shl(man, k(13)))
    sub = bld.bitcast(bld.fmul(bld.uitofp(man, f32), ir.Constant(f32, 2.0 ** -24)), i32)  # exact
    mag = bld.select(bld.icmp_unsigned("==", exp, k(0)), sub,
                   bld.select(bld.icmp_unsigned("==", exp, k(31)), infnan, normal))
    return bld.bitcast(bld.or_(mag, sign), f32)


def splat(bld: ir.IRBuilder, v: ir.Value, vty: ir.VectorType) -> ir.Value:
    one = bld.insert_element(ir.Constant(vty, ir.Undefined), v, ir.Constant(i32, 0))
    return bld.shuffle_vector(one, ir.Constant(vty, ir.Undefined), vconst(ir.VectorType(i32, vty.count), 0))


def band(bld: ir.IRBuilder, v: ir.Value, m: int) -> ir.Value:
    return bld.and_(v, vconst(v.type, m))


def lshr(bld: ir.IRBuilder, v: ir.Value, n: int) -> ir.Value:
    return v if n == 0 else bld.lshr(v, vconst(v.type, n))


def shl(bld: ir.IRBuilder, v: ir.Value, n: int) -> ir.Value:
    return v if n == 0 else bld.shl(v, vconst(v.type, n))


def concat(bld: ir.IRBuilder, lo: ir.Value, hi: ir.Value) -> ir.Value:
    n = lo.type.count
    return bld.shuffle_vector(lo, hi, vconst(ir.VectorType(i32, 2 * n), list(range(2 * n))))


def spread_i16(bld: ir.IRBuilder, v: ir.Value, picks: list[list[int]]) -> list[ir.Value]:
    """<16 x i16> v -> for each pick (16 lane indices of v, each 128-bit half drawing on one half of v)
    the <16 x i16> of those lanes. On x86 with AVX2 it is one ``vpshufb`` per pick from a register
    holding that half of v in both 128-bit lanes (as ggml spreads its K-quant scales). Written as inline
    assembly: LLVM otherwise moves the widening of v past the shuffles and emits per pick a byte
    shuffle, an unpack and a widening (3 instructions in the hot loop, measured slower)."""
    if not HAVE_INT8_SIMD:
        return [bld.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), vconst(ir.VectorType(i32, 16), p))
                for p in picks]
    halves = {}
    out = []
    asm_ty = ir.FunctionType(V32i8, [V32i8, V32i8])
    for pick in picks:
        mask, srcs = [], []
        for lane in range(2):
            part = pick[8 * lane: 8 * lane + 8]
            src = part[0] // 8
            assert all(i // 8 == src for i in part), pick
            srcs.append(src)
            for i in part:
                mask += [2 * (i % 8), 2 * (i % 8) + 1]
        key = tuple(srcs)
        if key not in halves:
            lanes = [8 * srcs[0] + k for k in range(8)] + [8 * srcs[1] + k for k in range(8)]
            halves[key] = bld.bitcast(bld.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                                         vconst(ir.VectorType(i32, 16), lanes)), V32i8)
        r = bld.asm(asm_ty, "vpshufb $2, $1, $0", "=x,x,x", [halves[key], vconst(V32i8, mask)], False)
        out.append(bld.bitcast(r, V16i16))
    return out


def nibbles16(bld: ir.IRBuilder, p: ir.Value) -> ir.Value:
    """16 bytes at p -> <32 x u8>: low nibbles are elements 0..15, high nibbles 16..31."""
    v = load(bld, p, V16i8)
    return concat(bld, band(bld, v, 0x0F), lshr(bld, v, 4))


def bits32(bld: ir.IRBuilder, p: ir.Value, value: int) -> ir.Value:
    """4 bytes at p = 32 flags (element j's is bit j) -> <32 x i8>: `value` where set, else 0."""
    word = splat(bld, load(bld, p, i32), V8i32)
    sel = bld.shuffle_vector(bld.bitcast(word, V32i8), ir.Constant(V32i8, ir.Undefined),
                           vconst(ir.VectorType(i32, 32), [j // 8 for j in range(32)]))
    hit = bld.icmp_unsigned("!=", bld.and_(sel, vconst(V32i8, [1 << (j % 8) for j in range(32)])),
                          ir.Constant(V32i8, None))
    return bld.select(hit, vconst(V32i8, value), ir.Constant(V32i8, None))


def lookup16(bld: ir.IRBuilder, table: tuple[int, ...], idx: ir.Value) -> ir.Value:
    """<32 x i8> indices in 0..15 -> table values (signed bytes)."""
    tv = [v & 0xFF for v in table]
    if HAVE_INT8_SIMD:
        f = declare(bld, "llvm.x86.avx2.pshuf.b", V32i8, [V32i8, V32i8])
        return bld.call(f, [vconst(V32i8, tv * 2), idx])
    const = vconst(V16i8, tv)
    out = ir.Constant(V32i8, ir.Undefined)
    for j in range(32):
        e = bld.extract_element(idx, ir.Constant(i32, j))
        out = bld.insert_element(out, bld.extract_element(const, e), ir.Constant(i32, j))
    return out


def to_f32(bld: ir.IRBuilder, q: ir.Value, signed: bool) -> ir.Value:
    vty = ir.VectorType(f32, q.type.count)
    return bld.sitofp(q, vty) if signed else bld.uitofp(q, vty)


def fma(bld: ir.IRBuilder, a: ir.Value, c: ir.Value, acc: ir.Value) -> ir.Value:
    n = a.type.count
    f = declare(bld, f"llvm.fma.v{n}f32", a.type, [a.type, a.type, a.type])
    return bld.call(f, [a, c, acc])


def hsum_f(bld: ir.IRBuilder, v: ir.Value) -> ir.Value:
    n = v.type.count
    f = declare(bld, f"llvm.vector.reduce.fadd.v{n}f32", f32, [f32, v.type])
    return bld.call(f, [ir.Constant(f32, 0.0), v], fastmath=("reassoc", "nsz"))


def hsum_i(bld: ir.IRBuilder, v: ir.Value) -> ir.Value:
    f = declare(bld, f"llvm.vector.reduce.add.v{v.type.count}i32", i32, [v.type])
    return bld.call(f, [v])


def prefetch(bld: ir.IRBuilder, p: ir.Value) -> None:
    f = declare(bld, "llvm.prefetch.p0", ir.VoidType(), [i8.as_pointer(), i32, i32, i32])
    bld.call(f, [p, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


# -- x86 int8 dot products (only emitted when HAVE_INT8_SIMD) -----------------------------------

def maddubs(bld: ir.IRBuilder, u: ir.Value, s: ir.Value) -> ir.Value:
    """<32 x u8> * <32 x s8> -> <16 x i16> sums of adjacent pairs (saturating; callers keep every
    pair below 2**15: u <= 128 with |s| <= 127)."""
    return bld.call(declare(bld, "llvm.x86.avx2.pmadd.ub.sw", V16i16, [V32i8, V32i8]), [u, s])


def madd(bld: ir.IRBuilder, p: ir.Value, q: ir.Value) -> ir.Value:
    """<16 x i16> * <16 x i16> -> <8 x i32> sums of adjacent pairs."""
    return bld.call(declare(bld, "llvm.x86.avx2.pmadd.wd", V8i32, [V16i16, V16i16]), [p, q])


def dot_u8s8(bld: ir.IRBuilder, u: ir.Value, s: ir.Value) -> ir.Value:
    """<32 x u8> . <32 x s8> -> <8 x i32> (each lane the sum of 4 products)."""
    if HAVE_VNNI:
        f = declare(bld, "llvm.x86.avx512.vpdpbusd.256", V8i32, [V8i32, V8i32, V8i32])
        return bld.call(f, [ir.Constant(V8i32, None), bld.bitcast(u, V8i32), bld.bitcast(s, V8i32)])
    return madd(bld, maddubs(bld, u, s), vconst(V16i16, 1))


def dot_s8s8(bld: ir.IRBuilder, w: ir.Value, x: ir.Value) -> ir.Value:
    """signed . signed: move w's sign onto x so the unsigned-by-signed instruction applies."""
    aw = bld.call(declare(bld, "llvm.abs.v32i8", V32i8, [V32i8, i1]), [w, ir.Constant(i1, 0)])
    sx = bld.select(bld.icmp_signed("<", w, ir.Constant(V32i8, None)), bld.neg(x), x)
    return dot_u8s8(bld, aw, sx)


# ---------------------------------------------------------------------------------------------
# Portable scalar intrinsic

@intrinsic
def load_f16(typingctx, arr, off):
    """IEEE half at byte offset `off` of a uint8 array, as float32."""
    sig = types.float32(arr, off)

    def codegen(context, bld, signature, args):
        return half(bld, at(bld, data_ptr(context, bld, signature.args[0], args[0]), args[1]))

    return sig, codegen


# ---------------------------------------------------------------------------------------------
# Row functions from a block description

@dataclass(frozen=True)
class IEnv:
    """What an int8 block function needs: pointers and the element index of its first element."""
    wptr: ir.Value   # i8* weights
    xq: ir.Value   # i8* int8 activations
    xd: ir.Value   # f32* activation scales, one per `Format.elems` elements (activations.py)
    xs1: ir.Value  # f32* Q8_1's s per 32 elements: half(d * sum of xq) (32-element activations only)
    xs16: ir.Value  # i16* Q8_K's bsums: sums of xq per 16 (256-element activations only)
    xe: ir.Value   # i64 element index (into xq) of the block's first element


@dataclass(frozen=True)
class Format:
    """How one weight type's blocks turn into numbers.

    fvals(bld, wptr, off) -> list of <32 x float>: the block at byte `off`, exactly as the reference
        dequantises it, 32 elements per vector.
    iprep(bld, wptr, off) -> state: the block unpacked once (quant vectors, scales) for int8 dots ...
    itok(bld, state, env) -> ([(ivec <8 x i32>, scale f32 | <8 x float>[, "side"]), ...], corr f32 | None): ...
        with one token's activations: sum(hsum(ivec * scale)) + corr, where scale is the product of
        the weight's and the activation's scales computed as ggml's dot product computes it (its
        rounding is part of the result) and ivec an exact integer sum. Each part is accumulated as
        float(ivec) * scale + acc (one fused multiply-add per lane, as ggml's x86 code does), into a
        second accumulator for parts marked "side" (ggml's separate sum of Q4_K's mins); corr sums per
        block in block order (Q4_1/Q5_1's m * s). The horizontal sums happen once per row: that of the
        main accumulator, plus that of the side one, plus corr.
        None when the type has no int8 kernel.
    """
    name: str
    elems: int      # elements per block (32 or 256); int8 activations use one scale per block
    nbytes: int     # bytes per block
    unroll: int     # blocks per loop step (steps of 256 elements)
    fvals: Callable
    iprep: Callable | None = None
    itok: Callable | None = None
    # groups > 1: the block is walked in a runtime loop over `groups` sub-blocks of elems/groups (32)
    # elements, for types whose unpacking is long (table lookups: the i-quants). Emitting it once per
    # sub-block instead of once per block divides the generated code, and the compile time, by
    # `groups`. Then fvals(bld, wptr, off, g) and iprep(bld, wptr, off, g) take the sub-block index g
    # (an i64 value), itok returns the sub-block's integer dot alone (<8 x i32>), summed in integers
    # over the block, and iscale(bld, wptr, off) gives the block's weight scale that sum is multiplied
    # by (with the activation scale of the block).
    groups: int = 1
    iscale: Callable | None = None

    @property
    def group_elems(self) -> int:
        return self.elems // self.groups

    def values(self, bld: ir.IRBuilder, wptr: ir.Value, off: ir.Value, g: ir.Value | None) -> list[ir.Value]:
        """fvals of the block at off (g None), or of its sub-block g."""
        return self.fvals(bld, wptr, off) if g is None else self.fvals(bld, wptr, off, g)


def _each_group(bld: ir.IRBuilder, fmt: Format, emit: Callable[[ir.Value | None], None]) -> None:
    """emit(None) for a format walked block by block; else emit(g) inside a runtime loop over its
    sub-blocks (not unrolled: that is the point)."""
    if fmt.groups == 1:
        emit(None)
        return
    with cgutils.for_range(bld, c64(fmt.groups)) as loop:  # (unrolling it by two measured no faster)
        emit(loop.index)


def _group_elem(bld: ir.IRBuilder, fmt: Format, e0: ir.Value, g: ir.Value | None) -> ir.Value:
    """Element index of sub-block g of the block starting at element e0."""
    return e0 if g is None else bld.add(e0, bld.mul(g, c64(fmt.group_elems)))


def _blocks_loop(bld: ir.IRBuilder, fmt: Format, nblocks: ir.Value, body: Callable[[ir.Value, int], None],
                 wptr: ir.Value, bases: list[ir.Value], unroll: int | None = None) -> None:
    """body(block_index, k) for every block, k its place in the unrolled step (0 in the tail): steps
    of `unroll` (default fmt.unroll) blocks, each prefetching PREFETCH_BYTES ahead in every row stream
    starting at `bases`, then the tail."""
    step = fmt.unroll if unroll is None else unroll
    nsteps = bld.sdiv(nblocks, c64(step)) if step > 1 else nblocks
    with cgutils.for_range(bld, nsteps) as loop:
        first = bld.mul(loop.index, c64(step)) if step > 1 else loop.index
        for base in bases:
            start = bld.add(base, bld.mul(first, c64(fmt.nbytes)))
            for k in range(0, step * fmt.nbytes, 64):  # one prefetch per 64-byte cache line
                prefetch(bld, at(bld, wptr, start, PREFETCH_BYTES + k))
        for k in range(step):
            body(bld.add(first, c64(k)) if k else first, k)
    if step > 1:
        with cgutils.for_range(bld, nblocks, start=bld.mul(nsteps, c64(step))) as loop:
            body(loop.index, 0)


def _result(context, bld: ir.IRBuilder, values: list[ir.Value], rtype):
    return values[0] if len(values) == 1 else context.make_tuple(bld, rtype, values)


def _switch(bld: ir.IRBuilder, qv: ir.Value, formats: dict[int, Format], case: Callable[[Format], None]) -> None:
    """Emit case(fmt) for each weight type, selected by the runtime type id qv; an id that is not
    a key of `formats` does nothing (callers check types before any kernel runs). One switch per
    call, each case its own tight loop."""
    end = bld.append_basic_block("qt.end")
    switch = bld.switch(qv, end)
    for code, fmt in formats.items():
        block = bld.append_basic_block(f"qt.{fmt.name}")
        switch.add_case(ir.Constant(qv.type, code), block)
        bld.position_at_end(block)
        case(fmt)
        bld.branch(end)
    bld.position_at_end(end)


def deq_intrinsic(formats: dict[int, Format]):
    """-> intrinsic deq(qt, w, base, n_cols, buf, boff): dequantise the n_cols elements of type qt at
    byte base of w into buf (f32) from element boff, bit-identical to gguf-py's reference."""

    @intrinsic
    def deq(typingctx, qt, w, base, n_cols, buf, boff):
        sig = types.void(qt, w, base, n_cols, buf, boff)

        def codegen(context, bld, signature, args):
            qtype, w_arg, row_base, n_elems, buf_arg, buf_off = args
            wptr = data_ptr(context, bld, signature.args[1], w_arg)
            out_ptr = bld.gep(data_ptr(context, bld, signature.args[4], buf_arg, f32), [buf_off])

            def case(fmt: Format) -> None:
                def body(blk, _k):
                    off = bld.add(row_base, bld.mul(blk, c64(fmt.nbytes)))
                    e0 = bld.mul(blk, c64(fmt.elems))

                    def group(g):
                        ge = _group_elem(bld, fmt, e0, g)
                        for k, v in enumerate(fmt.values(bld, wptr, off, g)):
                            store(bld, v, at(bld, out_ptr, ge, 32 * k))

                    _each_group(bld, fmt, group)

                _blocks_loop(bld, fmt, bld.sdiv(n_elems, c64(fmt.elems)), body, wptr, [row_base])

            _switch(bld, qtype, formats, case)
            return context.get_dummy_value()

        return sig, codegen

    return deq


# Accumulator chains per token in the int8 row kernel, by tokens per call: one for every count, each
# token's blocks summed in order into one accumulator (as ggml's x86 dot products do). Alternating
# chains for one or two tokens hid some FMA latency (~25% of a one-token product), but then a token's
# float sum depended on how many tokens shared its call, i.e. on the other rows of a batched step: a
# router near a tie then chose other experts, and a sampled request's tokens changed with what it
# was batched with (tests/test_engine.py's concurrent generations, 1 run in 10).
IDOT_CHAINS: dict[int, int] = {}


def idot_intrinsic(formats: dict[int, Format], ntok: int, nrows: int = 1):
    """-> intrinsic idot(qt, w, base, n_cols, xq, xd, xs1, xs16, xe, xstride): the row of type qt at
    byte base of w times `ntok` int8 activation rows (activations.py) starting at element xe,
    xstride elements apart; a float32 (ntok == 1) or a UniTuple of ntok float32. Each block is
    unpacked once for all the tokens. Only formats with an int8 path (``iprep``); x86 AVX2 only.

    nrows > 1 (with ntok == 1): idot(qt, w, base, row_bytes, n_cols, xq, xd, xs1, xs16, xe, xstride)
    -> UniTuple of nrows float32: the rows at base, base + row_bytes, ... times one token. Each row
    keeps its own single accumulator chain, summed in block order exactly as the one-row call sums
    it (same bits); the rows' chains are independent, so their FMA latencies overlap."""
    assert nrows == 1 or ntok == 1, "several rows are for one token"
    lanes = max(ntok, nrows)  # (row, token) pairs computed: one chain each
    rtype = types.float32 if lanes == 1 else types.UniTuple(types.float32, lanes)

    # The row function is emitted once per module as a function of its own that is never inlined:
    # inlined into the drivers' row loop beside every other type's code (and the other token
    # counts'), LLVM hoisted their constants out of that loop and spilled them around this type's
    # block loop, which then reloaded its own constants every block (Q2_K: 29 stack accesses per
    # block, 1.4x slower than the same code alone). A call per row costs a few ns.
    fname = "clutor.idot%d%s.%s" % (ntok, "x%d" % nrows if nrows > 1 else "", "_".join(f"{q}" for q in sorted(formats)))
    ret_ty = f32 if lanes == 1 else ir.LiteralStructType([f32] * lanes)
    arg_tys = [i64, i8.as_pointer(), i64, i64, i8.as_pointer(), f32.as_pointer(), f32.as_pointer(),
               i16.as_pointer(), i64, i64]
    if nrows > 1:
        arg_tys.insert(3, i64)  # row_bytes

    def define(module: ir.Module) -> ir.Function:
        fn = module.globals.get(fname)
        if fn is not None:
            return fn
        fn = ir.Function(module, ir.FunctionType(ret_ty, arg_tys), fname)
        fn.linkage = "internal"
        fn.attributes.add("noinline")
        bld = ir.IRBuilder(fn.append_basic_block("entry"))
        if nrows > 1:
            qtype, wptr, row_base, row_bytes, n_elems, xq, xd, xs1, xs16, x_elem0, x_stride = fn.args
            row_bases = [row_base] + [bld.add(row_base, bld.mul(row_bytes, c64(r))) for r in range(1, nrows)]
        else:
            qtype, wptr, row_base, n_elems, xq, xd, xs1, xs16, x_elem0, x_stride = fn.args
            row_bases = [row_base]
        starts = [bld.add(x_elem0, bld.mul(x_stride, c64(t))) for t in range(ntok)]
        # lane i = (row i // ntok, token i % ntok); [lane][chain]: a few tokens leave the FMA latency
        # exposed, so consecutive blocks may alternate between independent accumulators (the tokens,
        # or the rows, are chains enough)
        n_chains = IDOT_CHAINS.get(ntok, 1) if nrows == 1 else 1
        accs = [[cgutils.alloca_once_value(bld, ir.Constant(V8f, None)) for _ in range(n_chains)]
                for _ in range(lanes)]
        corrs = [cgutils.alloca_once_value(bld, ir.Constant(f32, 0.0)) for _ in range(lanes)]
        sides = [cgutils.alloca_once_value(bld, ir.Constant(V8f, None)) for _ in range(lanes)]

        # grouped formats: per lane, the block's integer sum over its sub-blocks
        iaccs = [cgutils.alloca_once_value(bld, ir.Constant(V8i32, None)) for _ in range(lanes)]

        def case(fmt: Format) -> None:
            def grouped_body(blk, k):
                for iacc in iaccs:
                    bld.store(ir.Constant(V8i32, None), iacc)
                x_blocks = [bld.add(x_start, bld.mul(blk, c64(fmt.elems))) for x_start in starts]
                offs = [bld.add(base, bld.mul(blk, c64(fmt.nbytes))) for base in row_bases]

                def group(g):
                    for r, off in enumerate(offs):
                        state = fmt.iprep(bld, wptr, off, g)
                        for x_block, iacc in zip(x_blocks, iaccs[r * ntok : (r + 1) * ntok]):
                            env = IEnv(wptr, xq, xd, xs1, xs16, _group_elem(bld, fmt, x_block, g))
                            bld.store(bld.add(bld.load(iacc), fmt.itok(bld, state, env)), iacc)

                _each_group(bld, fmt, group)
                for r, off in enumerate(offs):
                    wscale = splat(bld, fmt.iscale(bld, wptr, off), V8f)
                    lane = slice(r * ntok, (r + 1) * ntok)
                    for x_block, iacc, chains in zip(x_blocks, iaccs[lane], accs[lane]):
                        env = IEnv(wptr, xq, xd, xs1, xs16, x_block)
                        acc = chains[k % n_chains]
                        scaled = bld.fmul(bld.sitofp(bld.load(iacc), V8f), splat(bld, xscale(bld, env, fmt.elems), V8f))
                        bld.store(fma(bld, scaled, wscale, bld.load(acc)), acc)

            # (blocks of one unrolled step alternate chains; a type unrolled once, as the K-quants,
            # sums its blocks in order into one accumulator, as ggml does)
            def body(blk, k):
                for r, base in enumerate(row_bases):
                    off = bld.add(base, bld.mul(blk, c64(fmt.nbytes)))
                    state = fmt.iprep(bld, wptr, off)
                    lane = slice(r * ntok, (r + 1) * ntok)
                    for x_start, chains, corr, side in zip(starts, accs[lane], corrs[lane], sides[lane]):
                        env = IEnv(wptr, xq, xd, xs1, xs16, bld.add(x_start, bld.mul(blk, c64(fmt.elems))))
                        parts, block_corr = fmt.itok(bld, state, env)
                        acc = chains[k % n_chains]
                        for ivec, scale, *where in parts:
                            to = side if where and where[0] == "side" else acc
                            sv = scale if isinstance(scale.type, ir.VectorType) else splat(bld, scale, V8f)
                            bld.store(fma(bld, bld.sitofp(ivec, V8f), sv, bld.load(to)), to)
                        if block_corr is not None:
                            bld.store(bld.fadd(bld.load(corr), block_corr), corr)

            # the token loop already multiplies the code per block; keep compile time sane
            nblocks = bld.sdiv(n_elems, c64(fmt.elems))
            _blocks_loop(bld, fmt, nblocks, grouped_body if fmt.groups > 1 else body, wptr, row_bases,
                         max(1, fmt.unroll // lanes))

        _switch(bld, qtype, {q: f for q, f in formats.items() if f.iprep is not None}, case)
        vals = []
        for chains, corr, side in zip(accs, corrs, sides):
            total = bld.load(chains[0])
            for acc in chains[1:]:
                total = bld.fadd(total, bld.load(acc))
            # (a side accumulator nobody used is zeros: adding it changes no bit)
            vals.append(bld.fadd(bld.fadd(hsum_f(bld, total), hsum_f(bld, bld.load(side))), bld.load(corr)))
        if lanes == 1:
            bld.ret(vals[0])
        else:
            agg = ir.Constant(ret_ty, ir.Undefined)
            for t, v in enumerate(vals):
                agg = bld.insert_value(agg, v, t)
            bld.ret(agg)
        return fn

    if nrows > 1:
        @intrinsic
        def idot_rows(typingctx, qt, w, base, row_bytes, n_cols, xq, xd, xs1, xs16, xe, xstride):
            sig = rtype(qt, w, base, row_bytes, n_cols, xq, xd, xs1, xs16, xe, xstride)

            def codegen(context, bld, signature, args):
                qtype, w_arg, row_base, rb, n_elems, xq_arg, xd_arg, xs1_arg, xs16_arg, x_elem0, x_stride = args
                arg_types = signature.args
                ptrs = [data_ptr(context, bld, arg_types[1], w_arg), data_ptr(context, bld, arg_types[5], xq_arg),
                        data_ptr(context, bld, arg_types[6], xd_arg, f32), data_ptr(context, bld, arg_types[7], xs1_arg, f32),
                        data_ptr(context, bld, arg_types[8], xs16_arg, i16)]
                res = bld.call(define(bld.module), [qtype, ptrs[0], row_base, rb, n_elems, *ptrs[1:], x_elem0, x_stride])
                return _result(context, bld, [bld.extract_value(res, t) for t in range(lanes)], rtype)

            return sig, codegen

        return idot_rows

    @intrinsic
    def idot(typingctx, qt, w, base, n_cols, xq, xd, xs1, xs16, xe, xstride):
        sig = rtype(qt, w, base, n_cols, xq, xd, xs1, xs16, xe, xstride)

        def codegen(context, bld, signature, args):
            qtype, w_arg, row_base, n_elems, xq_arg, xd_arg, xs1_arg, xs16_arg, x_elem0, x_stride = args
            arg_types = signature.args
            ptrs = [data_ptr(context, bld, arg_types[1], w_arg), data_ptr(context, bld, arg_types[4], xq_arg),
                    data_ptr(context, bld, arg_types[5], xd_arg, f32), data_ptr(context, bld, arg_types[6], xs1_arg, f32),
                    data_ptr(context, bld, arg_types[7], xs16_arg, i16)]
            res = bld.call(define(bld.module), [qtype, ptrs[0], row_base, n_elems, *ptrs[1:], x_elem0, x_stride])
            vals = [res] if ntok == 1 else [bld.extract_value(res, t) for t in range(ntok)]
            return _result(context, bld, vals, rtype)

        return sig, codegen

    return idot


# ---------------------------------------------------------------------------------------------
# Tiles: several rows x several tokens with float activations

# A tile unpacks each of its rows' blocks once and multiplies them with every token, one 8-float
# accumulator per (row, token) held in registers: 2 rows x 8 tokens = 16 accumulators fit the 32
# vector registers of AVX-512 (AVX2 has 16: LLVM spills a few, still faster than one row at a
# time). Measured on this project's 2-core machine for an expert's gate (1024 x 2048 Q8_0, 8 tokens):
# ~100 GFLOP/s vs ~60 for one row x four tokens. A single token is bound by the weight stream and
# by FMA latency instead: its tile takes 2 rows with a 32-float accumulator each (four independent
# FMA chains per row), which streamed 17.5 GB/s where one 8-float chain per row managed 13.7.
TILE_TOKENS = (8, 4, 2, 1)
TILE_ROWS = 2
ACC_VEC = V8f  # 16-float (zmm) accumulators: not measured reliably yet (shared machine)


def _pieces(bld: ir.IRBuilder, v: ir.Value, n: int) -> list[ir.Value]:
    """<32 x float> -> <n x float> pieces (free after LLVM splits the vector into registers)."""
    idx = ir.VectorType(i32, n)
    return [bld.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), vconst(idx, list(range(n * i, n * i + n))))
            for i in range(v.type.count // n)]


def tile_intrinsic(formats: dict[int, Format], ntok: int):
    """-> intrinsic tile(qt, w, base, rb, nrows, n_cols, x, xoff, xstride, out, ooff, ostride).

    For k < nrows (<= TILE_ROWS) and t < ntok: out[ooff + t*ostride + k] = row k . token t, where
    row k is n_cols elements of type `qt` (a key of `formats`) starting at byte base + k*rb of w
    (an array or an address) and token t is x[xoff + t*xstride :][:n_cols] (float32). Rows past
    nrows are computed from the last valid row and not stored. Tiles of 2, 4 and 8 tokens sum every
    (row, token) pair in the same order, so such a token's result does not depend on its tile; the
    single-token tile sums in another order (same float rounding bound). The type is switched on
    once per call; each case is its own tight loop."""

    n_rows = TILE_ROWS
    acc_ty = V32f if ntok == 1 else ACC_VEC

    @intrinsic
    def tile(typingctx, qt, w, base, rb, nrows, n_cols, x, xoff, xstride, out, ooff, ostride):
        sig = types.void(qt, w, base, rb, nrows, n_cols, x, xoff, xstride, out, ooff, ostride)

        def codegen(context, bld, signature, args):
            (qtype, w_arg, row_base, row_bytes, rows_here, n_elems, x_arg, x_off, x_stride,
             out_arg, out_off, out_stride) = args
            arg_types = signature.args
            wptr = data_ptr(context, bld, arg_types[1], w_arg)
            x_ptr = data_ptr(context, bld, arg_types[6], x_arg, f32)
            out_ptr = data_ptr(context, bld, arg_types[9], out_arg, f32)
            last = bld.sub(rows_here, c64(1))
            # row k's first byte; a row past rows_here re-reads the last valid row (never stored)
            row_bases = [row_base] + [
                bld.add(row_base, bld.mul(bld.select(bld.icmp_signed("<", c64(k), rows_here), c64(k), last), row_bytes))
                for k in range(1, n_rows)]
            token_ptrs = [bld.gep(x_ptr, [bld.add(x_off, bld.mul(x_stride, c64(t)))]) for t in range(ntok)]
            accs = [[cgutils.alloca_once_value(bld, ir.Constant(acc_ty, None)) for _ in range(ntok)]
                    for _ in range(n_rows)]  # [row][token]

            def case(fmt: Format) -> None:
                nblocks = bld.sdiv(n_elems, c64(fmt.elems))
                _tile_case(bld, fmt, ntok, wptr, row_bases, nblocks, token_ptrs, accs)
                for k in range(n_rows):
                    with bld.if_then(bld.icmp_signed("<", c64(k), rows_here)):
                        for t in range(ntok):
                            o = bld.add(out_off, bld.add(bld.mul(out_stride, c64(t)), c64(k)))
                            bld.store(hsum_f(bld, bld.load(accs[k][t])), bld.gep(out_ptr, [o]))

            _switch(bld, qtype, formats, case)
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _tile_case(bld: ir.IRBuilder, fmt: Format, ntok: int, wptr: ir.Value, row_bases: list[ir.Value],
               nblocks: ir.Value, token_ptrs: list[ir.Value], accs) -> None:
    """The block loop of one weight type: zero the accumulators, then for each block unpack every
    row's block once and multiply it with every token (accs[row][token]: pointers to acc vectors)."""
    acc_ty = accs[0][0].type.pointee
    for row in accs:
        for acc in row:
            bld.store(ir.Constant(acc_ty, None), acc)
    unroll = max(1, fmt.unroll // (ntok * len(row_bases)))  # blocks per step: long enough for prefetching
    split = acc_ty.count < 32

    def block(blk, _k):
        block_off = bld.mul(blk, c64(fmt.nbytes))

        def group(g):
            e0 = _group_elem(bld, fmt, bld.mul(blk, c64(fmt.elems)), g)
            # [row][piece]: the block's (sub-block's) values in accumulator-sized vectors
            rows = [[piece for v in fmt.values(bld, wptr, bld.add(base, block_off), g)
                     for piece in (_pieces(bld, v, acc_ty.count) if split else [v])]
                    for base in row_bases]
            for t, tok_ptr in enumerate(token_ptrs):
                x_vecs = [load(bld, at(bld, tok_ptr, e0, acc_ty.count * i), acc_ty, 4) for i in range(len(rows[0]))]
                for k, pieces in enumerate(rows):
                    total = bld.load(accs[k][t])
                    for piece, x_vec in zip(pieces, x_vecs):
                        total = fma(bld, piece, x_vec, total)
                    bld.store(total, accs[k][t])

        _each_group(bld, fmt, group)

    _blocks_loop(bld, fmt, nblocks, block, wptr, row_bases, unroll)


def xgroup(bld: ir.IRBuilder, env: IEnv, group: int) -> ir.Value:
    """Index of the `group`-element group (16, 32 or 256) that starts at env.xe. Element indices are
    never negative, so the division is unsigned: a shift, where the signed one cost ~4 instructions per
    block and token in the int8 loops. (Splitting it into the token's first group plus the block's,
    hoisting the first, measured 20% slower for Q8_0 at four tokens, for reasons not pinned down.)"""
    return bld.udiv(env.xe, c64(group))


def xscale(bld: ir.IRBuilder, env: IEnv, elems: int) -> ir.Value:
    """The activation scale of the block starting at env.xe (one scale per `elems`)."""
    return bld.load(bld.gep(env.xd, [xgroup(bld, env, elems)]))


def xsum1(bld: ir.IRBuilder, env: IEnv) -> ir.Value:
    """Q8_1's s of the 32-element activation block at env.xe: half(d * sum(xq)) as float."""
    return bld.load(bld.gep(env.xs1, [xgroup(bld, env, 32)]))


def xsum16(bld: ir.IRBuilder, env: IEnv, k: int = 0) -> ir.Value:
    """Q8_K's bsum of the k-th 16 elements from env.xe, as int32."""
    return bld.sext(bld.load(bld.gep(env.xs16, [bld.add(xgroup(bld, env, 16), c64(k))])), i32)
