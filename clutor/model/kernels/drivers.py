"""The parallel numba entry points: one per operation, the weight type chosen per task.

One compiled, cached function per operation serves every type: the weight type `qt` is a runtime
argument. The per-type code is LLVM IR generated from the block descriptions in legacy.py /
kquants.py / floats.py (see _ir.py for why). Rows are independent, so threads split tasks of
ROWS_PER_TASK rows (prange).

- float activations (the default): tiles of TILE_ROWS rows x 8/4/2/1 tokens; the tile intrinsics
  switch on the type once per call, each case one tight loop. matmul_jobs_f32 runs several
  products (a layer's experts, or q/k/v) in one launch.
- int8 activations: per-type branches written out (a per-row helper that branches measured 15-20%
  slower); tokens go four at a time through the "4" row functions, then one at a time.

Shapes: w uint8 [n_rows * rb] (rb bytes per row) or its address, x f32 [T, K], out f32 [T, N].
"""
from __future__ import annotations

from numba import njit, prange

from . import _ir as R
from . import floats, kquants, legacy
from .activations import quantize_activations
from .floats import deq_bf16, deq_f16
from .kquants import deq_q4_k, deq_q5_k, deq_q6_k
from .legacy import deq_iq4_nl, deq_q4_0, deq_q4_1, deq_q5_0, deq_q5_1, deq_q8_0

__all__ = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K",
           "ROWS_PER_TASK", "dequantize_rows", "matmul_f32", "matmul_jobs_f32", "matmul_q8"]

# GGML type ids (gguf.GGMLQuantizationType), as plain ints so numba sees constants.
F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K, IQ4_NL, BF16 = 12, 13, 14, 20, 30

ROWS_PER_TASK = 16

_par = dict(parallel=True, nogil=True, fastmath=True, cache=True, boundscheck=False, error_model="numpy")
_one = dict(nogil=True, fastmath=True, cache=True, boundscheck=False, error_model="numpy")


@njit(**_one)
def _put4(out, t, r, v):
    out[t, r] = v[0]
    out[t + 1, r] = v[1]
    out[t + 2, r] = v[2]
    out[t + 3, r] = v[3]


@njit(**_one)
def _deq_rows(w, qt, rb, r0, r1, n_cols, flat):
    """Rows r0..r1 -> flat[(r - r0) * n_cols ...]."""
    if qt == Q8_0:
        for r in range(r0, r1):
            deq_q8_0(w, r * rb, n_cols // 32, flat, (r - r0) * n_cols)
    elif qt == Q4_K:
        for r in range(r0, r1):
            deq_q4_k(w, r * rb, n_cols // 256, flat, (r - r0) * n_cols)
    elif qt == Q6_K:
        for r in range(r0, r1):
            deq_q6_k(w, r * rb, n_cols // 256, flat, (r - r0) * n_cols)
    elif qt == Q5_K:
        for r in range(r0, r1):
            deq_q5_k(w, r * rb, n_cols // 256, flat, (r - r0) * n_cols)
    elif qt == Q4_0:
        for r in range(r0, r1):
            deq_q4_0(w, r * rb, n_cols // 32, flat, (r - r0) * n_cols)
    elif qt == Q5_0:
        for r in range(r0, r1):
            deq_q5_0(w, r * rb, n_cols // 32, flat, (r - r0) * n_cols)
    elif qt == Q5_1:
        for r in range(r0, r1):
            deq_q5_1(w, r * rb, n_cols // 32, flat, (r - r0) * n_cols)
    elif qt == Q4_1:
        for r in range(r0, r1):
            deq_q4_1(w, r * rb, n_cols // 32, flat, (r - r0) * n_cols)
    elif qt == IQ4_NL:
        for r in range(r0, r1):
            deq_iq4_nl(w, r * rb, n_cols // 32, flat, (r - r0) * n_cols)
    elif qt == F16:
        for r in range(r0, r1):
            deq_f16(w, r * rb, n_cols // 32, flat, (r - r0) * n_cols)
    elif qt == BF16:
        for r in range(r0, r1):
            deq_bf16(w, r * rb, n_cols // 32, flat, (r - r0) * n_cols)


# One tile intrinsic per token count; each switches on the weight type inside (see _ir.py).
_FORMATS = {F16: floats.FORMATS["F16"], BF16: floats.FORMATS["BF16"], Q8_0: legacy.FORMATS["Q8_0"],
            Q4_0: legacy.FORMATS["Q4_0"], Q4_1: legacy.FORMATS["Q4_1"], Q5_0: legacy.FORMATS["Q5_0"],
            Q5_1: legacy.FORMATS["Q5_1"], IQ4_NL: legacy.FORMATS["IQ4_NL"], Q4_K: kquants.FORMATS["Q4_K"],
            Q5_K: kquants.FORMATS["Q5_K"], Q6_K: kquants.FORMATS["Q6_K"]}
assert R.TILE_TOKENS == (8, 4, 2, 1) and R.TILE_ROWS == {8: 2, 4: 2, 2: 2, 1: 2}
_tile8, _tile4, _tile2, _tile1 = (R.tile_intrinsic(_FORMATS, n) for n in R.TILE_TOKENS)


@njit(**_one)
def _tile_rows(w, qt, rb, r0, r1, n_cols, x, t0, n_tok, out, oc0):
    """out[t0 + t, oc0 + r] = W[r] . x[t0 + t] for r in r0..r1, t < n_tok (float activations).

    w is the weight's address; x [*, n_cols] and out [*, *] C-contiguous float32. Two rows at a
    time; tokens go eight, four, two, then one at a time, each tile unpacking its rows' blocks once."""
    ost = out.shape[1]
    for r in range(r0, r1, 2):
        nr = min(2, r1 - r)
        t = 0
        while t + 8 <= n_tok:
            _tile8(qt, w, r * rb, rb, nr, n_cols, x, (t0 + t) * n_cols, n_cols, out, (t0 + t) * ost + oc0 + r, ost)
            t += 8
        if t + 4 <= n_tok:
            _tile4(qt, w, r * rb, rb, nr, n_cols, x, (t0 + t) * n_cols, n_cols, out, (t0 + t) * ost + oc0 + r, ost)
            t += 4
        if t + 2 <= n_tok:
            _tile2(qt, w, r * rb, rb, nr, n_cols, x, (t0 + t) * n_cols, n_cols, out, (t0 + t) * ost + oc0 + r, ost)
            t += 2
        if t < n_tok:
            _tile1(qt, w, r * rb, rb, nr, n_cols, x, (t0 + t) * n_cols, n_cols, out, (t0 + t) * ost + oc0 + r, ost)


@njit(**_par)
def dequantize_rows(w, qt, rb, r0, r1, n_cols, out):
    """Rows r0..r1 of the weight -> out f32 [r1 - r0, n_cols] (C-contiguous)."""
    flat = out.reshape(-1)  # [(r1 - r0) * n_cols]
    n_tasks = (r1 - r0 + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        a = r0 + task * ROWS_PER_TASK
        _deq_rows(w, qt, rb, a, min(r1, a + ROWS_PER_TASK), n_cols, flat[(a - r0) * n_cols :])


@njit(**_par)
def matmul_f32(w, qt, rb, n_rows, n_cols, x, out):
    """out[t, r] = sum_k W[r, k] * x[t, k], W (at address w) dequantised exactly on the fly."""
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        a = task * ROWS_PER_TASK
        _tile_rows(w, qt, rb, a, min(n_rows, a + ROWS_PER_TASK), n_cols, x, 0, x.shape[0], out, 0)


@njit(**_par)
def matmul_jobs_f32(ws, qts, rbs, nrs, n_cols, x, t0s, nts, out, oc0s):
    """Several products in one parallel launch (waking the worker threads once, not per product).

    Job j: out[t0s[j] : t0s[j] + nts[j], oc0s[j] : oc0s[j] + nrs[j]] = x[t0s[j] : t0s[j] + nts[j]] @ W_j.T
    with W_j at address ws[j] (type qts[j], rbs[j] bytes per row, nrs[j] rows of n_cols). Tasks are
    ordered chunk-major (chunk 0 of every job, then chunk 1, ...) so that the static split of the
    task range between threads gives each thread a share of every job, however uneven the jobs."""
    n_jobs = ws.shape[0]
    per_job = (nrs.max() + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_jobs * per_job):
        c = task // n_jobs
        j = task - c * n_jobs
        a = c * ROWS_PER_TASK
        if a < nrs[j]:
            _tile_rows(ws[j], qts[j], rbs[j], a, min(nrs[j], a + ROWS_PER_TASK), n_cols, x, t0s[j], nts[j],
                       out, oc0s[j])


if R.HAVE_INT8_SIMD:
    from .kquants import idot4_q4_k, idot4_q5_k, idot4_q6_k, idot_q4_k, idot_q5_k, idot_q6_k
    from .legacy import (idot4_iq4_nl, idot4_q4_0, idot4_q4_1, idot4_q5_0, idot4_q5_1, idot4_q8_0,
                         idot_iq4_nl, idot_q4_0, idot_q4_1, idot_q5_0, idot_q5_1, idot_q8_0)

    @njit(**_one)
    def _idot_rows(w, qt, rb, r0, r1, n_cols, xq, xd, xs32, xs16, out):
        """out[:, r0:r1] from int8 activations."""
        n_tok = xq.shape[0]
        if qt == Q8_0:
            for r in range(r0, r1):
                t = 0
                while t + 4 <= n_tok:
                    _put4(out, t, r, idot4_q8_0(w, r * rb, n_cols // 32, xq, xd, xs32, xs16, t * n_cols, n_cols))
                    t += 4
                while t < n_tok:
                    out[t, r] = idot_q8_0(w, r * rb, n_cols // 32, xq, xd, xs32, xs16, t * n_cols, n_cols)
                    t += 1
        elif qt == Q4_K:
            for r in range(r0, r1):
                t = 0
                while t + 4 <= n_tok:
                    _put4(out, t, r, idot4_q4_k(w, r * rb, n_cols // 256, xq, xd, xs32, xs16, t * n_cols, n_cols))
                    t += 4
                while t < n_tok:
                    out[t, r] = idot_q4_k(w, r * rb, n_cols // 256, xq, xd, xs32, xs16, t * n_cols, n_cols)
                    t += 1
        elif qt == Q6_K:
            for r in range(r0, r1):
                t = 0
                while t + 4 <= n_tok:
                    _put4(out, t, r, idot4_q6_k(w, r * rb, n_cols // 256, xq, xd, xs32, xs16, t * n_cols, n_cols))
                    t += 4
                while t < n_tok:
                    out[t, r] = idot_q6_k(w, r * rb, n_cols // 256, xq, xd, xs32, xs16, t * n_cols, n_cols)
                    t += 1
        elif qt == Q5_K:
            for r in range(r0, r1):
                t = 0
                while t + 4 <= n_tok:
                    _put4(out, t, r, idot4_q5_k(w, r * rb, n_cols // 256, xq, xd, xs32, xs16, t * n_cols, n_cols))
                    t += 4
                while t < n_tok:
                    out[t, r] = idot_q5_k(w, r * rb, n_cols // 256, xq, xd, xs32, xs16, t * n_cols, n_cols)
                    t += 1
        elif qt == Q4_0:
            for r in range(r0, r1):
                t = 0
                while t + 4 <= n_tok:
                    _put4(out, t, r, idot4_q4_0(w, r * rb, n_cols // 32, xq, xd, xs32, xs16, t * n_cols, n_cols))
                    t += 4
                while t < n_tok:
                    out[t, r] = idot_q4_0(w, r * rb, n_cols // 32, xq, xd, xs32, xs16, t * n_cols, n_cols)
                    t += 1
        elif qt == Q5_0:
            for r in range(r0, r1):
                t = 0
                while t + 4 <= n_tok:
                    _put4(out, t, r, idot4_q5_0(w, r * rb, n_cols // 32, xq, xd, xs32, xs16, t * n_cols, n_cols))
                    t += 4
                while t < n_tok:
                    out[t, r] = idot_q5_0(w, r * rb, n_cols // 32, xq, xd, xs32, xs16, t * n_cols, n_cols)
                    t += 1
        elif qt == Q5_1:
            for r in range(r0, r1):
                t = 0
                while t + 4 <= n_tok:
                    _put4(out, t, r, idot4_q5_1(w, r * rb, n_cols // 32, xq, xd, xs32, xs16, t * n_cols, n_cols))
                    t += 4
                while t < n_tok:
                    out[t, r] = idot_q5_1(w, r * rb, n_cols // 32, xq, xd, xs32, xs16, t * n_cols, n_cols)
                    t += 1
        elif qt == Q4_1:
            for r in range(r0, r1):
                t = 0
                while t + 4 <= n_tok:
                    _put4(out, t, r, idot4_q4_1(w, r * rb, n_cols // 32, xq, xd, xs32, xs16, t * n_cols, n_cols))
                    t += 4
                while t < n_tok:
                    out[t, r] = idot_q4_1(w, r * rb, n_cols // 32, xq, xd, xs32, xs16, t * n_cols, n_cols)
                    t += 1
        elif qt == IQ4_NL:
            for r in range(r0, r1):
                t = 0
                while t + 4 <= n_tok:
                    _put4(out, t, r, idot4_iq4_nl(w, r * rb, n_cols // 32, xq, xd, xs32, xs16, t * n_cols, n_cols))
                    t += 4
                while t < n_tok:
                    out[t, r] = idot_iq4_nl(w, r * rb, n_cols // 32, xq, xd, xs32, xs16, t * n_cols, n_cols)
                    t += 1

    @njit(**_par)
    def matmul_q8(w, qt, rb, n_rows, n_cols, x, block, xq, xd, xs32, xs16, out):
        """out[t, r] with x rounded to int8 first (activations.py: xq [T, K], xd, xs32, xs16 are
        caller-owned scratch), in the same call to save a dispatch."""
        quantize_activations(x, block, xq, xd, xs32, xs16)
        n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
        for task in prange(n_tasks):
            a = task * ROWS_PER_TASK
            _idot_rows(w, qt, rb, a, min(n_rows, a + ROWS_PER_TASK), n_cols, xq, xd, xs32, xs16, out)
else:
    matmul_q8 = None
