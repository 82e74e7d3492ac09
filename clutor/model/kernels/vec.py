"""Register-blocked inner loops of the paged attention (clutor.model.kernels.paged), in LLVM IR.

Numba compiles a loop whose accumulators live in arrays with a load and a store per multiply-add,
since it cannot prove the arrays apart; these keep them in vector registers for a whole page:

    qk4(q, qo, kt, s, so, scale, dk)      4 rows' scores against one page's 16 keys (kt [dk, 16]):
                                          s[so_j + o] = scale * sum_d q[qo_j + d] * kt[d, o], the sum
                                          in d order, one fused multiply-add per term
    pv2(s, so, kr, blk, bo, acc, ao)      2 rows' weighted values over one page's first kr keys, 64
                                          columns: acc[ao_j + c] += sum_o s[so_j + o] * blk[o, bo + c],
                                          in o order, one fused multiply-add per term

Offsets are flat element indices into each array's data (C-contiguous). A row asked for twice
(a tile's last block short of rows repeats one) computes the same bits twice: each row's arithmetic
is the same sequence whatever row it is blocked with, so a row's result never depends on its tile.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["qk4", "pv2", "PAGE_KEYS", "PV_COLS"]

PAGE_KEYS = 16   # keys per page (clutor.model.kv.PAGE): one 16-lane vector of scores
PV_COLS = 64     # value columns per pv2 call: four 16-lane accumulators per row

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_V16 = ir.VectorType(_F32, 16)


def _ptr(context, builder, ty, arr):
    return context.make_array(ty)(context, builder, arr).data


def _at(builder, base, index):
    """A <16 x float>* at base[index] (base: float*)."""
    return builder.bitcast(builder.gep(base, [index]), _V16.as_pointer())


def _fma(builder):
    """llvm.fma on <16 x float> (llvmlite's declare_intrinsic names only scalar types)."""
    name = "llvm.fma.v16f32"
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(_V16, [_V16, _V16, _V16]), name=name)
    return fn


def _splat(builder, x):
    v = builder.insert_element(ir.Constant(_V16, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(_V16, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))


def _loop(builder, n, inits, body):
    """for i in range(n): carried = body(i, carried), carried starting at inits; returns the final values."""
    pre = builder.block
    loop = builder.append_basic_block("vloop")
    done = builder.append_basic_block("vdone")
    zero = ir.Constant(_I64, 0)
    builder.cbranch(builder.icmp_signed(">", n, zero), loop, done)
    builder.position_at_end(loop)
    i = builder.phi(_I64)
    carried = [builder.phi(v.type) for v in inits]
    i.add_incoming(zero, pre)
    for c, v in zip(carried, inits):
        c.add_incoming(v, pre)
    new = body(i, carried)
    nxt = builder.add(i, ir.Constant(_I64, 1))
    end = builder.block
    i.add_incoming(nxt, end)
    for c, v in zip(carried, new):
        c.add_incoming(v, end)
    builder.cbranch(builder.icmp_signed("<", nxt, n), loop, done)
    builder.position_at_end(done)
    out = []
    for v, w in zip(inits, new):
        p = builder.phi(v.type)
        p.add_incoming(v, pre)
        p.add_incoming(w, end)
        out.append(p)
    return out


@intrinsic
def qk4(typingctx, q, qo, kt, s, so, scale, dk):
    """See the module docstring. q, kt, s: float32 C arrays; qo, so: 4-tuples of int64; dk: int64."""
    def codegen(context, builder, sig, args):
        qa, qo_, kta, sa, so_, sc, n = args
        qp = _ptr(context, builder, sig.args[0], qa)
        kp = _ptr(context, builder, sig.args[2], kta)
        sp = _ptr(context, builder, sig.args[3], sa)
        fma = _fma(builder)
        qoff = [builder.extract_value(qo_, j) for j in range(4)]

        def body(d, accs):
            kv = builder.load(_at(builder, kp, builder.mul(d, ir.Constant(_I64, PAGE_KEYS))), align=4)
            out = []
            for j in range(4):
                x = builder.load(builder.gep(qp, [builder.add(qoff[j], d)]))
                out.append(builder.call(fma, [_splat(builder, x), kv, accs[j]]))
            return out

        accs = _loop(builder, n, [ir.Constant(_V16, None)] * 4, body)
        vs = _splat(builder, sc)
        for j in range(4):
            builder.store(builder.fmul(accs[j], vs), _at(builder, sp, builder.extract_value(so_, j)), align=4)
        return context.get_dummy_value()

    tup = types.UniTuple(types.int64, 4)
    return types.void(q, tup, kt, s, tup, types.float32, types.int64), codegen


@intrinsic
def pv2(typingctx, s, so, kr, blk, bo, acc, ao, w):
    """See the module docstring. s, blk, acc: float32 C arrays; so, ao: 2-tuples of int64; kr: keys;
    bo: the first column's flat offset in blk's first row; w: blk's row length."""
    def codegen(context, builder, sig, args):
        sa, so_, n, ba, bo_, aa, ao_, width = args
        sp = _ptr(context, builder, sig.args[0], sa)
        bp = _ptr(context, builder, sig.args[3], ba)
        ap = _ptr(context, builder, sig.args[5], aa)
        fma = _fma(builder)
        soff = [builder.extract_value(so_, j) for j in range(2)]
        aoff = [builder.extract_value(ao_, j) for j in range(2)]
        cols = [ir.Constant(_I64, 16 * c) for c in range(PV_COLS // 16)]
        inits = [builder.load(_at(builder, ap, builder.add(aoff[j], c)), align=4) for j in range(2) for c in cols]

        def body(o, accs):
            row = builder.add(bo_, builder.mul(o, width))
            vs = [builder.load(_at(builder, bp, builder.add(row, c)), align=4) for c in cols]
            out = []
            for j in range(2):
                e = _splat(builder, builder.load(builder.gep(sp, [builder.add(soff[j], o)])))
                out += [builder.call(fma, [e, v, accs[j * len(cols) + k]]) for k, v in enumerate(vs)]
            return out

        accs = _loop(builder, n, inits, body)
        for j in range(2):
            for k, c in enumerate(cols):
                builder.store(accs[j * len(cols) + k], _at(builder, ap, builder.add(aoff[j], c)), align=4)
        return context.get_dummy_value()

    tup = types.UniTuple(types.int64, 2)
    return types.void(s, tup, types.int64, blk, types.int64, acc, tup, types.int64), codegen
