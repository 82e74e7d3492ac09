"""Every weight type the model accepts goes through quants.matmul / Weight and equals gguf-py's
reference dequantisation followed by a float64 product (fast kernels or the fallback alike)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants as ref

from clutor.model.kernel_settings import KernelSettings
from clutor.model.quants import QT, SUPPORTED, Weight, dequantize_rows, matmul, row_bytes, type_name


def random_weight(qtype: int, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid raw bytes of a (n_rows, n_cols) weight: quantised floats where gguf-py can quantise,
    else random bytes with every f16 scale field made finite."""
    w = rng.standard_normal((n_rows, n_cols)).astype(np.float32) * 0.5
    if qtype == QT.F32:
        return w.view(np.uint8).reshape(-1)
    if qtype == QT.F16:
        return w.astype(np.float16).view(np.uint8).reshape(-1)
    try:
        return np.ascontiguousarray(ref.quantize(w, QT(qtype))).view(np.uint8).reshape(-1)
    except (NotImplementedError, ref.QuantError):
        pass
    block, nbytes = GGML_QUANT_SIZES[QT(qtype)]
    raw = rng.integers(0, 256, size=(n_rows * n_cols // block, nbytes), dtype=np.uint8)
    # K-quants and IQ4_XS keep their f16 super-block scale(s) at known places: overwrite with small
    # finite values so no NaN/Inf appears.
    half = np.array([0.01], dtype=np.float16).view(np.uint8)
    scale_at = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.IQ4_XS: (0,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2),
                QT.Q6_K: (208,), QT.IQ4_NL: (0,), QT.IQ1_M: ()}
    for off in scale_at.get(QT(qtype), (0,)):
        raw[:, off], raw[:, off + 1] = half[0], half[1]
    if qtype == QT.IQ1_M:  # its f16 scale: the top nibbles of the four u16 scale words at byte 48
        d = int(half.view(np.uint16)[0])
        sc = raw[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[:, 48:56] = sc.view(np.uint8)
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED), ids=lambda q: type_name(q))
@pytest.mark.parametrize("T", [1, 5])
def test_matmul_equals_reference(qtype, T):
    rng = np.random.default_rng(int(qtype) * 10 + T)
    n_rows, n_cols = 7, 512
    raw = random_weight(qtype, n_rows, n_cols, rng)
    assert raw.nbytes == n_rows * row_bytes(qtype, n_cols)
    if qtype == QT.BF16:
        w_ref = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(n_rows, n_cols)
    else:
        w_ref = ref.dequantize(raw.reshape(n_rows, -1), QT(qtype)).astype(np.float64)
    assert np.isfinite(w_ref).all()
    x = rng.standard_normal((T, n_cols)).astype(np.float32)
    want = x.astype(np.float64) @ np.asarray(w_ref, np.float64).T  # [T, n_rows]
    f32 = KernelSettings("f32")  # exact up to float rounding (the int8 path's bound: tests/test_kernels.py)
    got = matmul(raw, qtype, n_rows, n_cols, x, f32)
    tol = 1e-4 * np.abs(x).max() * np.abs(w_ref).sum(axis=1).max() + 1e-6
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    # the resident-weight path (embedding lookups and dense layers) agrees too
    W = Weight("w", raw, qtype, (n_rows, n_cols), kernels=f32)
    np.testing.assert_allclose(W(x), want, rtol=0, atol=tol)
    np.testing.assert_allclose(W.rows(np.array([3, 0])), np.asarray(w_ref, np.float32)[[3, 0]], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dequantize_rows(raw, qtype, n_cols, np.array([6])), np.asarray(w_ref, np.float32)[[6]],
                               rtol=1e-6, atol=1e-6)


def test_matmul_jobs_with_types_without_kernels(monkeypatch):
    """quants.matmul_jobs: a layer mixing a type with a kernel and one without (Q2_K and IQ4_XS made
    so here) takes the one-product-at-a-time path and gives each job's own matmul."""
    from clutor.model import kernels
    from clutor.model.kernels import Job
    from clutor.model.quants import matmul_jobs

    has = kernels.has_kernel
    monkeypatch.setattr(kernels, "has_kernel", lambda q: int(q) not in (int(QT.Q2_K), int(QT.IQ4_XS)) and has(q))

    rng = np.random.default_rng(7)
    n_cols = 256
    specs = [(QT.Q2_K, 5, 0, 3, 0), (QT.Q8_0, 9, 3, 4, 5), (QT.IQ4_XS, 4, 0, 7, 14)]
    jobs = [Job(random_weight(q, n, n_cols, rng), int(q), n, t0, nt, col) for q, n, t0, nt, col in specs]
    x = rng.standard_normal((7, n_cols)).astype(np.float32)
    out = np.full((7, 18), np.nan, np.float32)
    assert matmul_jobs(jobs, n_cols, x, out) is out
    for j in jobs:
        np.testing.assert_array_equal(out[j.t0 : j.t0 + j.n_tok, j.col : j.col + j.n_rows],
                                      matmul(j.w, j.qtype, j.n_rows, n_cols, x[j.t0 : j.t0 + j.n_tok]))


@pytest.mark.parametrize("qtype", SUPPORTED, ids=type_name)
def test_embedding_rows_equal_gguf_pys_rows(qtype):
    """Weight.rows (an embedding lookup: the compiled dequantiser where the type has a kernel) gives
    exactly gguf-py's dequantisation of those rows, in the order asked, repeats included."""
    rng = np.random.default_rng(int(qtype))
    n_rows, n_cols = 9, 256
    raw = random_weight(qtype, n_rows, n_cols, rng)
    w = Weight("tok_embd", raw, qtype, (n_rows, n_cols))
    idx = np.array([4, 0, 8, 4], np.int64)
    want = ref.dequantize(raw.reshape(n_rows, -1), QT(qtype)).astype(np.float32)[idx]
    got = w.rows(idx)
    assert got.dtype == np.float32 and got.shape == (4, n_cols)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
