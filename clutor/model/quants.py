"""Dequantisation and the one matmul entry point for every weight type (the types: weight_types.py).

A weight is kept as the raw bytes found in the file (or in an expert-cache slot). ``matmul`` runs a
fast kernel from clutor.model.kernels when one exists for the type, and otherwise dequantises with
gguf-py's reference code and uses BLAS. Nothing converts the whole model up front.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .kernel_settings import DEFAULT, KernelSettings
from .profile import kernel_done
from .weight_types import QT, SUPPORTED, row_bytes, type_name, weight_type

__all__ = ["QT", "SUPPORTED", "type_name", "row_bytes", "dequantize", "dequantize_rows", "matmul", "matmul_jobs", "Weight",
           "apply_all", "matmul_heads", "ggml_activations"]


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """raw uint8 bytes -> float32 array of `shape` (numpy order, blocks along the last axis), with the
    type's dequantiser (weight_types.TYPES: gguf-py's reference, or a view for F32)."""
    rows = raw.reshape(-1, row_bytes(qtype, shape[-1]))  # [R, row_bytes]
    return weight_type(qtype).dequantize(rows).reshape(shape)


def dequantize_rows(raw: np.ndarray, qtype: int, n_cols: int, rows: np.ndarray) -> np.ndarray:
    """Only the chosen rows of a 2-D weight (embedding lookups): float32 [len(rows), n_cols]."""
    rb = row_bytes(qtype, n_cols)
    picked = raw.reshape(-1, rb)[np.asarray(rows, dtype=np.int64)]  # [R, rb]
    return dequantize(picked.reshape(-1), qtype, (len(rows), n_cols))


def matmul(raw: np.ndarray, qtype: int, n_rows: int, n_cols: int, x: np.ndarray,
           settings: KernelSettings = DEFAULT) -> np.ndarray:
    """x @ W.T for W stored as raw bytes (numpy shape (n_rows, n_cols)); x float32 [T, n_cols] -> [T, n_rows]."""
    from . import kernels  # late: kernels import numba, which is slow to import

    t0 = time.perf_counter()
    x = _rounded_as_llama(np.ascontiguousarray(x, dtype=np.float32), (qtype,), settings)
    if kernels.has_kernel(qtype):
        y = kernels.matmul(raw, qtype, n_rows, n_cols, x, settings=settings)
    else:
        y = x @ dequantize(raw, qtype, (n_rows, n_cols)).T
    kernel_done(t0)
    return y


def matmul_jobs(jobs, n_cols: int, x: np.ndarray, out: np.ndarray, settings: KernelSettings = DEFAULT,
                order: str = "mul_mat") -> np.ndarray:
    """Several products sharing x [S, n_cols] and out [S, M] (see kernels.matmul_jobs and its Job;
    order: "mul_mat_id" for experts): one kernel launch when every type has a kernel, else one
    product at a time."""
    from . import kernels

    types = {j.qtype for j in jobs}
    if all(kernels.has_kernel(q) for q in types) and (QT.F16 not in types or len(types) == 1):
        x = _rounded_as_llama(x, types, settings)
        t0 = time.perf_counter()
        kernels.matmul_jobs(jobs, n_cols, x, out, settings, order)
        kernel_done(t0)
        return out
    for j in jobs:
        rows = slice(j.t0, j.t0 + j.n_tok)
        out[rows, j.col : j.col + j.n_rows] = matmul(j.w, j.qtype, j.n_rows, n_cols, x[rows], settings)
    return out


def _rounded_as_llama(x: np.ndarray, qtypes, settings: KernelSettings) -> np.ndarray:
    """x as llama.cpp multiplies it by F16 weights: rounded to F16 first (ggml's dot-product type for
    F16 rows), in the q8 mode, whose point is llama.cpp's arithmetic (f32 keeps x exact)."""
    if QT.F16 not in qtypes or settings.activations == "f32":
        return x
    from . import kernels

    return x.astype(np.float16).astype(np.float32) if kernels.mode(settings) == "q8" else x


@dataclass(eq=False)
class Weight:
    """A resident 2-D weight: raw bytes + type; float32 copy made once for the types BLAS must use."""

    name: str
    raw: np.ndarray  # uint8 [n_rows * row_bytes]
    qtype: int
    shape: tuple[int, int]  # (n_rows, n_cols) numpy order
    kernels: KernelSettings = DEFAULT  # the owning model's (Model.open sets it)
    _f32: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # F32 is used in place; F16/BF16 have no integer kernel, and numpy's half matmul is slow,
        # so the (small, dense-only) float copy is made once here rather than per token.
        if self.qtype == QT.F32:
            self._f32 = self.raw.view(np.float32).reshape(self.shape)
        elif self.qtype in (QT.F16, QT.BF16):
            from . import kernels

            if not kernels.has_kernel(self.qtype):
                self._f32 = dequantize(self.raw, self.qtype, self.shape)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Apply as a linear layer: x float32 [T, n_cols] -> [T, n_rows]."""
        if self._f32 is not None:
            t0 = time.perf_counter()
            y = _rounded_as_llama(np.ascontiguousarray(x, dtype=np.float32), (self.qtype,), self.kernels) @ self._f32.T
            kernel_done(t0)
            return y
        return matmul(self.raw, self.qtype, self.shape[0], self.shape[1], x, self.kernels)

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """float32 [len(idx), n_cols]: embedding lookup without dequantising the whole table."""
        if self._f32 is not None:
            return self._f32[idx]
        from . import kernels

        if self.qtype != QT.F32 and kernels.has_kernel(self.qtype):
            # The compiled dequantiser (bit-identical to gguf-py's, which costs ~0.2 ms of Python per
            # call), on this thread alone: a decode step's one row is not worth waking the workers.
            rb = row_bytes(self.qtype, self.shape[1])
            picked = self.raw.reshape(-1, rb)[np.asarray(idx, dtype=np.int64)]  # [R, rb]
            return kernels.dequantize(picked.reshape(-1), self.qtype, len(picked), self.shape[1],
                                      settings=_one_thread(self.kernels))
        return dequantize_rows(self.raw, self.qtype, self.shape[1], idx)


def _one_thread(settings: KernelSettings) -> KernelSettings:
    one = _ONE_THREAD.get(settings)
    if one is None:
        one = _ONE_THREAD[settings] = dataclasses.replace(settings, threads=1)
    return one


_ONE_THREAD: dict[KernelSettings, KernelSettings] = {}


def apply_all(weights: Sequence[Weight], x: np.ndarray) -> list[np.ndarray]:
    """[w(x) for w in weights] for weights sharing the input (q/k/v), in one kernel launch where
    the types allow; the results are column blocks of one [T, sum of rows] array."""
    from .kernels import Job

    x = np.ascontiguousarray(x, dtype=np.float32)
    if any(w._f32 is not None for w in weights) or len({w.shape[1] for w in weights}) != 1:
        return [w(x) for w in weights]
    cols = np.cumsum([0] + [w.shape[0] for w in weights]).tolist()
    out = np.empty((len(x), cols[-1]), np.float32)  # [T, sum N]
    matmul_jobs([Job(w.raw, w.qtype, w.shape[0], 0, len(x), c) for w, c in zip(weights, cols)], weights[0].shape[1],
                x, out, weights[0].kernels)
    return [out[:, a:b] for a, b in zip(cols[:-1], cols[1:])]


def matmul_heads(w: Weight, x: np.ndarray) -> np.ndarray:
    """x [R, H, K] times each head's own matrix: w holds H matrices of N rows of K (a "heads" tensor
    [H, N, K] as one Weight of H * N rows) -> [R, H, N], every head one job of one kernel launch.
    What llama.cpp's batched mul_mat of a 3-D weight computes (each head's activations rounded as
    the type's own products round them)."""
    from .kernels import Job

    R, H, K = x.shape
    N = w.shape[0] // H
    xs = np.ascontiguousarray(x.transpose(1, 0, 2), dtype=np.float32).reshape(H * R, K)  # [H*R, K]
    out = np.empty((H * R, N), np.float32)  # [H*R, N]
    per_head = N * row_bytes(w.qtype, K)
    matmul_jobs([Job(w.raw[h * per_head : (h + 1) * per_head], w.qtype, N, h * R, R) for h in range(H)], K, xs, out,
                w.kernels)
    return out.reshape(H, R, N).transpose(1, 0, 2)


def ggml_activations(x: np.ndarray, qtype: int, settings: KernelSettings = DEFAULT) -> np.ndarray:
    """x as a product with a `qtype` weight rounds it in this activation mode (kernels.ggml_activations)."""
    from . import kernels

    return kernels.ggml_activations(x, qtype, settings)
