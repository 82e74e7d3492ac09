"""llama.cpp's own matrix product (ggml's CPU MUL_MAT), driven through ctypes, for kernel benchmarks.

    mm = GGMLMulMat()                                   # ggml from llama-cpp-python's wheel
    secs = mm.time(raw_copies, qtype, n_rows, n_cols, x, n_threads=2, passes=5)

What test-backend-ops' perf mode times (a graph of MUL_MAT nodes computed by the CPU backend), on the
same weight bytes as Clutor's benchmark: one ggml context holds every copy of the weight (copies
cycled so that weights come from DRAM, not the caches, as in a decode) and one graph has a MUL_MAT
node per copy, all sharing the activations x [T, K]. Each node rounds x to the weight type's
activation blocks (Q8_0 / Q8_K) and runs ggml's vec_dot per row and token, as in llama.cpp; the
graph is computed with ggml's OpenMP thread pool at n_threads. Reported: the best pass's seconds per
product. The work buffer is allocated once (ggml_graph_plan), so passes allocate nothing.

Needs llama-cpp-python (its bundled libggml); not used by the tests.
"""
from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np

__all__ = ["GGMLMulMat"]

GGML_TYPE_F32 = 0


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                ("threadpool", ctypes.c_void_p), ("abort_callback", ctypes.c_void_p),
                ("abort_callback_data", ctypes.c_void_p), ("use_ref", ctypes.c_bool)]


def _lib_dir() -> Path:
    import llama_cpp

    return Path(llama_cpp.__file__).resolve().parent / "lib"


class GGMLMulMat:
    def __init__(self, lib_dir: Path | None = None):
        d = Path(lib_dir) if lib_dir else _lib_dir()
        mode = ctypes.RTLD_GLOBAL
        self._base = ctypes.CDLL(str(d / "libggml-base.so"), mode=mode)
        self._cpu = ctypes.CDLL(str(d / "libggml-cpu.so"), mode=mode)
        b, c = self._base, self._cpu
        b.ggml_init.restype = ctypes.c_void_p
        b.ggml_init.argtypes = [_InitParams]
        b.ggml_free.argtypes = [ctypes.c_void_p]
        b.ggml_new_tensor_2d.restype = ctypes.c_void_p
        b.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        b.ggml_get_data.restype = ctypes.c_void_p
        b.ggml_get_data.argtypes = [ctypes.c_void_p]
        b.ggml_nbytes.restype = ctypes.c_size_t
        b.ggml_nbytes.argtypes = [ctypes.c_void_p]
        b.ggml_mul_mat.restype = ctypes.c_void_p
        b.ggml_mul_mat.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        b.ggml_new_graph_custom.restype = ctypes.c_void_p
        b.ggml_new_graph_custom.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_bool]
        b.ggml_build_forward_expand.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        b.ggml_tensor_overhead.restype = ctypes.c_size_t
        b.ggml_graph_overhead_custom.restype = ctypes.c_size_t
        b.ggml_graph_overhead_custom.argtypes = [ctypes.c_size_t, ctypes.c_bool]
        c.ggml_cpu_init.argtypes = []
        c.ggml_graph_plan.restype = _CPlan
        c.ggml_graph_plan.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        c.ggml_graph_compute.restype = ctypes.c_int
        c.ggml_graph_compute.argtypes = [ctypes.c_void_p, ctypes.POINTER(_CPlan)]
        c.ggml_cpu_init()

    def time(self, copies: list[np.ndarray], qtype: int, n_rows: int, n_cols: int, x: np.ndarray,
             n_threads: int, passes: int = 5) -> float:
        """Seconds per product x @ W.T, W any of `copies` (uint8 [n_rows * row_bytes] each, the file's
        bytes), x float32 [T, n_cols]: the best of `passes` passes over all copies."""
        return min(self.pass_times(copies, qtype, n_rows, n_cols, x, n_threads, passes))

    def pass_times(self, copies: list[np.ndarray], qtype: int, n_rows: int, n_cols: int, x: np.ndarray,
                   n_threads: int, passes: int = 5) -> list[float]:
        """time()'s passes, each one's seconds per product (for medians)."""
        b, c = self._base, self._cpu
        n_tok = x.shape[0]
        n_nodes = len(copies)
        mem = (sum(w.nbytes for w in copies) + x.nbytes + n_nodes * n_rows * n_tok * 4
               + (3 * n_nodes + 8) * b.ggml_tensor_overhead() + b.ggml_graph_overhead_custom(n_nodes + 8, False) + (1 << 20))
        ctx = b.ggml_init(_InitParams(mem, None, False))
        if not ctx:
            raise MemoryError(f"ggml_init({mem} bytes) failed")
        try:
            xt = b.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_cols, n_tok)  # ggml: ne0 = K (contiguous), ne1 = T
            ctypes.memmove(b.ggml_get_data(xt), np.ascontiguousarray(x, np.float32).ctypes.data, x.nbytes)
            gf = b.ggml_new_graph_custom(ctx, n_nodes + 8, False)
            for w in copies:
                wt = b.ggml_new_tensor_2d(ctx, int(qtype), n_cols, n_rows)
                if b.ggml_nbytes(wt) != w.nbytes:
                    raise ValueError(f"ggml sizes a ({n_rows}, {n_cols}) type {qtype} weight at "
                                     f"{b.ggml_nbytes(wt)} bytes, got {w.nbytes}")
                ctypes.memmove(b.ggml_get_data(wt), w.ctypes.data, w.nbytes)
                b.ggml_build_forward_expand(gf, b.ggml_mul_mat(ctx, wt, xt))
            plan = c.ggml_graph_plan(gf, n_threads, None)
            work = np.empty(max(plan.work_size, 1), np.uint8)
            plan.work_data = work.ctypes.data
            c.ggml_graph_compute(gf, ctypes.byref(plan))  # warm: thread pool up, pages touched
            secs = []
            for _ in range(passes):
                t0 = time.perf_counter()
                rc = c.ggml_graph_compute(gf, ctypes.byref(plan))
                secs.append((time.perf_counter() - t0) / n_nodes)
                if rc != 0:
                    raise RuntimeError(f"ggml_graph_compute failed with status {rc}")
            return secs
        finally:
            b.ggml_free(ctx)

    def product(self, w: np.ndarray, qtype: int, n_rows: int, n_cols: int, x: np.ndarray, n_threads: int = 1) -> np.ndarray:
        """x @ W.T as ggml computes it: float32 [T, n_rows] (to check the harness against Clutor)."""
        b, c = self._base, self._cpu
        n_tok = x.shape[0]
        mem = w.nbytes + x.nbytes + n_rows * n_tok * 4 + 8 * b.ggml_tensor_overhead() + b.ggml_graph_overhead_custom(8, False) + (1 << 20)
        ctx = b.ggml_init(_InitParams(mem, None, False))
        try:
            xt = b.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_cols, n_tok)
            ctypes.memmove(b.ggml_get_data(xt), np.ascontiguousarray(x, np.float32).ctypes.data, x.nbytes)
            wt = b.ggml_new_tensor_2d(ctx, int(qtype), n_cols, n_rows)
            ctypes.memmove(b.ggml_get_data(wt), w.ctypes.data, w.nbytes)
            y = b.ggml_mul_mat(ctx, wt, xt)
            gf = b.ggml_new_graph_custom(ctx, 8, False)
            b.ggml_build_forward_expand(gf, y)
            plan = c.ggml_graph_plan(gf, n_threads, None)
            work = np.empty(max(plan.work_size, 1), np.uint8)
            plan.work_data = work.ctypes.data
            c.ggml_graph_compute(gf, ctypes.byref(plan))
            out = np.empty((n_tok, n_rows), np.float32)
            ctypes.memmove(out.ctypes.data, b.ggml_get_data(y), out.nbytes)
            return out
        finally:
            b.ggml_free(ctx)
