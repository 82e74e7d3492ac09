"""Products checked once, for the few-row steps of decoding (a layer's q/k/v side by side, its wo).

matmul_jobs checks every job's weight, builds its job rows and groups them by activation block on
each call: ~50 us of Python per call on this project's 2-core EPYC VM, three times what the int8
kernel itself takes for a one-token product of a 256-wide layer. A decode step makes the same
products every token, so here that work is done once per weight set and per row count:

    p = Prepared([w.raw, ...], [w.qtype, ...], [w.shape[0], ...], n_cols, settings)
    out = p(x)    # x float32 [T, n_cols] -> [T, sum of rows] (weights side by side), or None

None means "not this path": activations not in the q8 mode, a type without an int8 kernel (or
weights of different activation blocks), or a product big enough for matmul_jobs to split it over
the threads. Then the caller goes through quants.apply_all as before. Where it answers, the bits
are matmul_jobs' own: the same jobs, in the same order, through the same one-thread driver
(matmul_jobs runs that driver for every product under _PARALLEL_MIN_BYTES).
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..kernel_settings import KernelSettings
from ..profile import kernel_done
from . import _BYTE_COST, _PARALLEL_MIN_BYTES, _Q8_BLOCK, _act_buffers, _apply_threads, _check, mode
from . import drivers as _drv

__all__ = ["Prepared"]

_MOST_ROW_COUNTS = 8  # job arrays kept per Prepared (a decode step's row count is the number of streams)


class Prepared:
    """Products of weights sharing their input x [T, n_cols], side by side in one [T, sum of rows]."""

    def __init__(self, raws: Sequence[np.ndarray], qtypes: Sequence[int], n_rows: Sequence[int], n_cols: int,
                 settings: KernelSettings):
        self._raws = list(raws)  # held: the job rows carry their addresses
        self.n_cols = int(n_cols)
        self.width = int(sum(n_rows))
        self.cols = [0] + np.cumsum([int(n) for n in n_rows]).tolist()  # each weight's first column, then width
        blocks = {_Q8_BLOCK.get(int(q)) for q in qtypes}
        block = blocks.pop() if len(blocks) == 1 else None
        int8 = mode(settings) == "q8" and _drv.matmul_jobs_q8_serial is not None
        self._block = block if int8 and block and self.n_cols % block == 0 and self.n_cols % 32 == 0 else None
        if self._block is None:  # not an int8 product in this mode: callers go the general way
            return
        rb = [_check(w, int(q), int(n), self.n_cols) for w, q, n in zip(raws, qtypes, n_rows)]
        # job rows (address, type, row bytes, rows, t0, n_tok, col) with t0 = 0 and n_tok set per call
        self._rows = np.array([(_drv.address(w), int(q), b, int(n), 0, 0, int(c))
                               for w, q, b, n, c in zip(raws, qtypes, rb, n_rows, self.cols)], np.int64)  # [n_jobs, 7]
        self._bytes = float(sum(w.size * _BYTE_COST[int(q)] for w, q in zip(raws, qtypes)))
        self._jobs: dict[int, np.ndarray] = {}  # row count T -> the jobs of a T-row call

    def __call__(self, x: np.ndarray) -> np.ndarray | None:
        """x float32 [T, n_cols] (C-contiguous) -> float32 [T, width], or None (see the module docstring)."""
        T = x.shape[0]
        if (self._block is None or T == 0 or T * self._bytes >= _PARALLEL_MIN_BYTES or x.dtype != np.float32
                or x.ndim != 2 or x.shape[1] != self.n_cols
                or not (x.flags.c_contiguous and x.flags.aligned and x.flags.writeable)):
            return None
        jobs = self._jobs.get(T)
        if jobs is None:
            if len(self._jobs) >= _MOST_ROW_COUNTS:
                self._jobs.clear()
            jobs = self._jobs[T] = self._rows.copy()
            jobs[:, 5] = T
        t0 = time.perf_counter()
        xq, xd, xs1, xs16 = _act_buffers(T, self.n_cols, self._block)
        out = np.empty((T, self.width), np.float32)  # [T, sum of rows]
        _apply_threads(1)  # as matmul_jobs leaves it after a one-thread product (threads_for reads it)
        _drv.matmul_jobs_q8_serial(jobs, self.n_cols, x, self._block, xq, xd, xs1, xs16, out)
        kernel_done(t0)
        return out
