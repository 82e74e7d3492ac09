"""The parallel numba entry points: one per operation, the weight type chosen at run time.

One compiled, cached function per operation serves every type: the weight type `qt` is a runtime
argument that the LLVM intrinsics switch on once per call (_ir.py; the per-type code is generated
from the block descriptions in legacy.py / kquants.py / floats.py). Rows are independent, so
threads split tasks of ROWS_PER_TASK rows (prange).

- float activations (the default): tiles of 2 rows x 8/4/2/1 tokens. matmul_jobs_f32 runs one or
  several products (a layer's experts, q/k/v) in one launch.
- int8 activations: one row x four tokens (then two, one); matmul_jobs_q8 runs one or several
  products in one launch, rounding x to int8 first.

Shapes: w uint8 [n_rows * rb] (rb bytes per row) or its address, x f32 [T, K], out f32 [T, N].
A launch's products come as one int64 array jobs [n_jobs, 7], a row per product: (weight address, type,
bytes per row, rows, first token t0, tokens, first output column); building it is the one Python cost
of a launch (a list of tuples into an array: ~1 us, where seven columns cost ~4).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..weight_types import TYPES
from . import _ir
from . import floats, iquants, kquants, legacy
from .activations import quantize_activations

__all__ = ["FORMATS", "ROWS_PER_TASK", "address", "dequantize_rows", "dequantize_rows_serial", "matmul_jobs_f32", "matmul_jobs_q8",
           "matmul_jobs_q8_serial"]

# GGML type id -> block description, for every type weight_types.TYPES gives a kernel module.
_FAMILIES = {"floats": floats.FORMATS, "legacy": legacy.FORMATS, "kquants": kquants.FORMATS,
             "iquants": iquants.FORMATS}
FORMATS = {int(q): _FAMILIES[t.kernel][t.name] for q, t in TYPES.items() if t.kernel in _FAMILIES}

ROWS_PER_TASK = 16

_par = dict(parallel=True, nogil=True, fastmath=True, cache=True, boundscheck=False, error_model="numpy")
_one = dict(nogil=True, fastmath=True, cache=True, boundscheck=False, error_model="numpy")

_deq = _ir.deq_intrinsic(FORMATS)
assert _ir.TILE_TOKENS == (8, 4, 2, 1) and _ir.TILE_ROWS == 2
_tile8, _tile4, _tile2, _tile1 = (_ir.tile_intrinsic(FORMATS, n) for n in _ir.TILE_TOKENS)


@njit(**_one)
def address(a):
    """An array's data address (what a job row holds): ~0.5 us, where numpy's a.ctypes.data takes ~2.5."""
    return a.ctypes.data


@njit(**_par)
def dequantize_rows(w, qtype, row_bytes, r0, r1, n_cols, out):
    """Rows r0..r1 of the weight -> out f32 [r1 - r0, n_cols] (C-contiguous)."""
    flat = out.reshape(-1)  # [(r1 - r0) * n_cols]
    n_tasks = (r1 - r0 + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        first = r0 + task * ROWS_PER_TASK
        for r in range(first, min(r1, first + ROWS_PER_TASK)):
            _deq(qtype, w, r * row_bytes, n_cols, flat, (r - r0) * n_cols)


@njit(**_one)
def dequantize_rows_serial(w, qtype, row_bytes, r0, r1, n_cols, out):
    """dequantize_rows on the calling thread alone (the same bits): an embedding lookup's few rows
    are not worth a parallel region's entry, which costs more than the rows after the output head's
    two-thread launch."""
    flat = out.reshape(-1)  # [(r1 - r0) * n_cols]
    for r in range(r0, r1):
        _deq(qtype, w, r * row_bytes, n_cols, flat, (r - r0) * n_cols)


@njit(**_one)
def _tile_rows(w, qtype, row_bytes, r0, r1, n_cols, x, t0, n_tok, out, col0):
    """out[t0 + t, col0 + r] = W[r] . x[t0 + t] for r in r0..r1, t < n_tok (float activations).

    w is the weight's address; x [*, n_cols] and out [*, *] C-contiguous float32. Two rows at a
    time; tokens go eight, four, two, then one at a time, each tile unpacking its rows' blocks once."""
    ost = out.shape[1]  # out's row stride (elements)
    for r in range(r0, r1, 2):
        rows_here = min(2, r1 - r)
        base = r * row_bytes
        t = 0
        while t + 8 <= n_tok:
            _tile8(qtype, w, base, row_bytes, rows_here, n_cols, x, (t0 + t) * n_cols, n_cols,
                   out, (t0 + t) * ost + col0 + r, ost)
            t += 8
        if t + 4 <= n_tok:
            _tile4(qtype, w, base, row_bytes, rows_here, n_cols, x, (t0 + t) * n_cols, n_cols,
                   out, (t0 + t) * ost + col0 + r, ost)
            t += 4
        if t + 2 <= n_tok:
            _tile2(qtype, w, base, row_bytes, rows_here, n_cols, x, (t0 + t) * n_cols, n_cols,
                   out, (t0 + t) * ost + col0 + r, ost)
            t += 2
        if t < n_tok:
            _tile1(qtype, w, base, row_bytes, rows_here, n_cols, x, (t0 + t) * n_cols, n_cols,
                   out, (t0 + t) * ost + col0 + r, ost)


# the columns of a jobs array (the module docstring)
_ADDR, _QT, _RB, _ROWS, _T0, _NTOK, _COL = range(7)


@njit(**_one)
def _n_tasks(jobs):
    """Tasks of a jobs launch: ROWS_PER_TASK-row chunks of the longest job, for every job."""
    return jobs.shape[0] * ((jobs[:, _ROWS].max() + ROWS_PER_TASK - 1) // ROWS_PER_TASK)


@njit(**_one)
def _job_chunk(task, n_jobs):
    """Task -> (job, its first row). Tasks are ordered chunk-major (chunk 0 of every job, then chunk
    1, ...) so that the static split of the task range between threads gives each thread a share of
    every job, however uneven the jobs."""
    chunk = task // n_jobs
    return task - chunk * n_jobs, chunk * ROWS_PER_TASK


@njit(**_par)
def matmul_jobs_f32(jobs, n_cols, x, out):
    """One or several products in one parallel launch (waking the worker threads once).

    Job j: out[t0 : t0 + n_tok, col : col + rows] = x[t0 : t0 + n_tok] @ W_j.T with W_j at jobs[j]'s
    address (its type, bytes per row, rows of n_cols), its rows split into tasks as _job_chunk says."""
    n_jobs = jobs.shape[0]
    for task in prange(_n_tasks(jobs)):
        j, first = _job_chunk(task, n_jobs)
        n_rows = jobs[j, _ROWS]
        if first < n_rows:
            _tile_rows(jobs[j, _ADDR], jobs[j, _QT], jobs[j, _RB], first, min(n_rows, first + ROWS_PER_TASK), n_cols,
                       x, jobs[j, _T0], jobs[j, _NTOK], out, jobs[j, _COL])


if _ir.HAVE_INT8_SIMD:
    _idot4 = _ir.idot_intrinsic(FORMATS, 4)
    _idot2 = _ir.idot_intrinsic(FORMATS, 2)
    _idot1 = _ir.idot_intrinsic(FORMATS, 1)
    # One token, ROW_GROUP rows per call, each row its own accumulator chain (the one-row call's
    # bits): the 32-element types only (a Q8_0 row of 256 is 8 blocks, one dependent FMA each: alone,
    # a row waits on that chain; four rows' chains overlap). Types without it take _idot1 row by row.
    ROW_GROUP = 4
    _MULTIROW = {q: f for q, f in FORMATS.items() if f.iprep is not None and f.name in legacy.FORMATS}
    _idot1_rows = _ir.idot_intrinsic(_MULTIROW, 1, ROW_GROUP)
    _multirow = np.zeros(max(FORMATS) + 1, np.bool_)  # qtype -> has _idot1_rows
    _multirow[list(_MULTIROW)] = True

    @njit(**_one)
    def _store4(out, t, col, v):
        out[t, col] = v[0]
        out[t + 1, col] = v[1]
        out[t + 2, col] = v[2]
        out[t + 3, col] = v[3]

    @njit(**_one)
    def _idot_rows(w, qtype, row_bytes, r0, r1, n_cols, xq, xd, xs1, xs16, t0, n_tok, out, col0):
        """out[t0 + t, col0 + r] = W[r] . xq[t0 + t] for r in r0..r1, t < n_tok (int8 activations,
        quantised by the caller); w is the weight's address.

        Tokens four at a time. A remainder of three (in a job of 4 or more tokens) takes one more
        four-token call over the last four: those already done are stored again with the same bits (a
        token's sum does not depend on its place in the call), and the rows are in L1 by then, so it
        costs less than three one-token calls. A remainder of two takes a two-token call, of one a
        one-token call (tools/bench_kernels.py --tokens 5,6,7: each the fastest measured)."""
        end = t0 + n_tok
        if n_tok == 1 and _multirow[qtype]:
            r = r0
            while r + 4 <= r1:
                v4 = _idot1_rows(qtype, w, r * row_bytes, row_bytes, n_cols, xq, xd, xs1, xs16, t0 * n_cols, n_cols)
                out[t0, col0 + r] = v4[0]
                out[t0, col0 + r + 1] = v4[1]
                out[t0, col0 + r + 2] = v4[2]
                out[t0, col0 + r + 3] = v4[3]
                r += 4
            while r < r1:
                out[t0, col0 + r] = _idot1(qtype, w, r * row_bytes, n_cols, xq, xd, xs1, xs16, t0 * n_cols, n_cols)
                r += 1
            return
        for r in range(r0, r1):
            t = t0
            while t + 4 <= end:
                _store4(out, t, col0 + r, _idot4(qtype, w, r * row_bytes, n_cols, xq, xd, xs1, xs16, t * n_cols, n_cols))
                t += 4
            if end - t == 3 and n_tok >= 4:
                t = end - 4
                _store4(out, t, col0 + r, _idot4(qtype, w, r * row_bytes, n_cols, xq, xd, xs1, xs16, t * n_cols, n_cols))
                continue
            if t + 2 <= end:
                v2 = _idot2(qtype, w, r * row_bytes, n_cols, xq, xd, xs1, xs16, t * n_cols, n_cols)
                out[t, col0 + r] = v2[0]
                out[t + 1, col0 + r] = v2[1]
                t += 2
            if t < end:
                out[t, col0 + r] = _idot1(qtype, w, r * row_bytes, n_cols, xq, xd, xs1, xs16, t * n_cols, n_cols)

    @njit(**_one)
    def _q8_task(jobs, task, n_cols, xq, xd, xs1, xs16, out):
        j, first = _job_chunk(task, jobs.shape[0])
        n_rows = jobs[j, _ROWS]
        if first < n_rows:
            _idot_rows(jobs[j, _ADDR], jobs[j, _QT], jobs[j, _RB], first, min(n_rows, first + ROWS_PER_TASK), n_cols,
                       xq, xd, xs1, xs16, jobs[j, _T0], jobs[j, _NTOK], out, jobs[j, _COL])

    @njit(**_par)
    def matmul_jobs_q8(jobs, n_cols, x, block, xq, xd, xs1, xs16, out):
        """matmul_jobs_f32's contract with x rounded to ggml's int8 activation blocks of `block`
        elements first (activations.py: Q8_0/Q8_1 for 32, Q8_K for 256; xq [T, K], xd [T, K/block],
        xs1 [T, K/32], xs16 [T, K/16] are caller-owned scratch), in the same launch: every job's type
        must take activation blocks of that size."""
        quantize_activations(x, block, xq, xd, xs1, xs16)
        for task in prange(_n_tasks(jobs)):
            _q8_task(jobs, task, n_cols, xq, xd, xs1, xs16, out)

    @njit(**_one)
    def matmul_jobs_q8_serial(jobs, n_cols, x, block, xq, xd, xs1, xs16, out):
        """matmul_jobs_q8 on the calling thread alone, the same tasks in order (the same bits): a launch on
        one thread skips the parallel region's entry (~2.5 us of a one-token product's ~15)."""
        quantize_activations(x, block, xq, xd, xs1, xs16)
        for task in range(_n_tasks(jobs)):
            _q8_task(jobs, task, n_cols, xq, xd, xs1, xs16, out)
else:
    matmul_jobs_q8 = matmul_jobs_q8_serial = None
