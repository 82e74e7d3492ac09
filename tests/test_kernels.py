"""clutor.model.kernels against gguf-py's reference dequantisation.

Every path (row kernels, float tiles, BLAS) must equal x' @ dequantize(W).T up to float32 rounding,
where x' is x as ggml multiplies it with that weight type: in f32 mode x itself; in q8 mode ggml's
activation blocks (d * q of Q8_0 / Q8_1 / Q8_K, tests/test_activations.py checks them against
llama.cpp's bytes) for the quantised types, x rounded to half / bfloat16 for F16 / BF16.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zlib
from pathlib import Path
from functools import lru_cache

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf import quants

from clutor.errors import ClutorError
from clutor.model import kernels
from clutor.model.kernels import activations as act
from clutor.model.kernel_settings import KernelSettings as KS

TYPES_32 = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4")
TYPES_256 = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS")
TYPES_IQ = ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")  # 256 elements, kernels/iquants.py
TYPES_FLOAT = ("F16", "BF16", "F32")
TOKENS = (1, 2, 3, 5, 6, 7, 16, 33)  # q8 remainders: two, two + one, one, the overlapped four
ROWS = (1, 3, 17, 255)
F32_RTOL = 1e-5  # of ||W_r|| * ||x_t||: float32 rounding of a 2048-long dot is far below this
Q8_BLOCK = {**{t: 32 for t in TYPES_32}, **{t: 256 for t in TYPES_256 + TYPES_IQ}}
_FORCED_BACKEND = {"avx2": "x86-avx2", "portable": "portable"}  # CLUTOR_KERNELS_ISA -> kernels.info().backend


def _cases():
    for name in TYPES_32 + TYPES_256 + TYPES_IQ + TYPES_FLOAT:
        cols = (256, 512, 2048) + ((544,) if name in TYPES_32 + ("F16", "BF16") else ())  # 544: 17 blocks, a tail
        for n_cols in cols:
            yield name, n_cols


@lru_cache(maxsize=None)
def weight(name: str, n_rows: int, n_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (raw bytes uint8 [n_rows * row_bytes], reference float32 [n_rows, n_cols])."""
    qt = QT[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{n_rows}/{n_cols}".encode()))
    if name == "F32":
        wf = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        return wf.view(np.uint8).reshape(-1), wf
    if name == "F16":
        raw = rng.standard_normal((n_rows, n_cols)).astype(np.float16).view(np.uint8).reshape(-1)
    elif name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"):
        wf = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        raw = quants.quantize(wf, qt).reshape(-1)
    else:
        # no quantiser in gguf-py: random bytes are valid blocks once the f16 scales are finite
        block, nbytes = GGML_QUANT_SIZES[qt]
        blocks = rng.integers(0, 256, size=(n_rows * n_cols // block, nbytes), dtype=np.uint8)
        if name == "MXFP4":  # E8M0 exponents: values 2^(e-128) * up to 12, kept near 1e-2
            blocks[:, 0] = rng.integers(118, 124, size=len(blocks))
        f16_at = {"IQ4_NL": (0,), "MXFP4": (), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82),
                  "Q3_K": (108,), "IQ4_XS": (0,),
                  "IQ1_M": (), **{t: (0,) for t in TYPES_IQ if t != "IQ1_M"}}[name]
        for at in f16_at:
            d = rng.uniform(1e-3, 5e-2, size=len(blocks)).astype(np.float16)
            blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
        if name == "IQ1_M":  # its f16 scale is spread over the top nibbles of the four u16 scale words
            d = rng.uniform(1e-3, 5e-2, size=len(blocks)).astype(np.float16).view(np.uint16)
            sc = blocks[:, 48:56].copy().view(np.uint16)  # [B, 4]
            for k in range(4):
                sc[:, k] = (sc[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
            blocks[:, 48:56] = sc.view(np.uint8)
        raw = blocks.reshape(-1)
    ref = quants.dequantize(raw.reshape(n_rows, -1), qt).astype(np.float32).reshape(n_rows, n_cols)
    return raw, ref


def activations(n_tok: int, n_cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    x[:, rng.integers(0, n_cols, size=3)] *= 20.0  # a few outlier channels, as real activations have
    return x


def as_ggml_sees_it(x: np.ndarray, name: str) -> np.ndarray:
    """x f32 [T, K] -> float64: the activations ggml's CPU backend multiplies a `name` weight with."""
    if name in Q8_BLOCK:
        block = Q8_BLOCK[name]
        T, K = x.shape
        xq, xd = np.empty((T, K), np.int8), np.empty((T, K // block), np.float32)
        act.quantize_activations(x, block, xq, xd, np.empty((T, K // 32), np.float32), np.empty((T, K // 16), np.int16))
        return (xq.reshape(T, -1, block) * xd[:, :, None].astype(np.float64)).reshape(T, K)
    if name == "F16":
        return x.astype(np.float16).astype(np.float64)
    if name == "BF16":
        return act.as_bf16(x, np.empty_like(x)).astype(np.float64)
    return x.astype(np.float64)


def q8_1_min_terms(raw: np.ndarray, x: np.ndarray, n_rows: int) -> np.ndarray:
    """Q4_1 / Q5_1 weights: ggml adds each block's min m times Q8_1's s = half(d * sum q), where
    x' @ W counts it as m * d_half * sum q; -> the difference, float64 [T, N]."""
    T, K = x.shape
    xq, xd = np.empty((T, K), np.int8), np.empty((T, K // 32), np.float32)
    xs1 = np.empty((T, K // 32), np.float32)
    act.quantize_activations(x, 32, xq, xd, xs1, np.empty((T, K // 16), np.int16))
    gap = xs1.astype(np.float64) - xd.astype(np.float64) * xq.reshape(T, -1, 32).sum(axis=2)  # [T, nb]
    mins = raw.reshape(n_rows, K // 32, -1)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)  # [N, nb]
    return gap @ mins.T


@pytest.mark.parametrize("name,n_cols", list(_cases()))
def test_matmul_matches_reference(name: str, n_cols: int) -> None:
    qt = int(QT[name])
    assert kernels.has_kernel(qt)
    for n_rows in ROWS:
        raw, ref = weight(name, n_rows, n_cols)
        wnorm = np.linalg.norm(ref.astype(np.float64), axis=1)  # [N]
        for n_tok in TOKENS:
            x = activations(n_tok, n_cols, seed=n_rows * 100 + n_tok)
            exact = x.astype(np.float64) @ ref.T.astype(np.float64)  # [T, N]
            scale = np.linalg.norm(x.astype(np.float64), axis=1)[:, None] * wnorm[None, :]  # [T, N]
            # row kernels (BLAS threshold out of reach), then the dequantise + BLAS path
            for blas_from in (10**9, 1):
                for mode in ("f32", "q8"):
                    ks = KS(mode, blas_min_tokens=blas_from)
                    out = np.full((n_tok, n_rows), np.nan, np.float32)
                    got = kernels.matmul(raw, qt, n_rows, n_cols, x, out=out, settings=ks)
                    assert got is out
                    ggml = kernels.mode(ks) == "q8"
                    want = as_ggml_sees_it(x, name) @ ref.T.astype(np.float64) if ggml else exact
                    if ggml and name in ("Q4_1", "Q5_1"):
                        want = want + q8_1_min_terms(raw, x, n_rows)
                    err = np.abs(got.astype(np.float64) - want)
                    where = f"{name} N={n_rows} K={n_cols} T={n_tok} mode={mode} blas_from={blas_from}"
                    assert (err <= F32_RTOL * scale).all(), f"{where}: rel err {(err / scale).max():.2e}"
                    if ggml and name != "F32":  # and it really is the rounded path, not an exact one
                        assert np.abs(got - exact).max() > 0, where


@pytest.mark.parametrize("name", TYPES_32 + TYPES_256 + TYPES_IQ + ("F16", "BF16"))
def test_dequantize_is_bit_identical(name: str) -> None:
    raw, ref = weight(name, 17, 512)
    out = np.empty((17, 512), np.float32)
    got = kernels.dequantize(raw, int(QT[name]), 17, 512, out=out)
    assert got is out
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("name", TYPES_32 + TYPES_256 + TYPES_IQ + ("F16", "BF16"))
def test_token_tiles_equal_single_tokens(name: str) -> None:
    """Tokens share tiles (8/4/2 in f32 mode, 4 in q8 mode); each must get what it gets alone, up to
    the order of float additions. In f32 mode tiles of 2 or more tokens sum in one order, so a
    token's result is bit-identical whichever multi-token tile it landed in."""
    raw, _ = weight(name, 17, 512)
    rng = np.random.default_rng(5)
    x = activations(15, 512, seed=5) * rng.uniform(0.1, 10.0, size=(15, 1)).astype(np.float32)  # scales differ
    for mode in ("f32", "q8"):
        ks = KS(mode)
        together = kernels.matmul(raw, int(QT[name]), 17, 512, x, settings=ks)  # tiles 8 + 4 + 2 + 1
        alone = np.stack([kernels.matmul(raw, int(QT[name]), 17, 512, x[t : t + 1], settings=ks)[0] for t in range(15)])
        # equal up to the order of a few float additions (Q4_0 / Q5_0 offset terms)
        np.testing.assert_allclose(together, alone, rtol=0, atol=1e-6 * np.abs(alone).max(), err_msg=f"{name} {mode}")
        if mode == "f32":
            pairs = np.concatenate([kernels.matmul(raw, int(QT[name]), 17, 512, x[t : t + 2], settings=ks)
                                    for t in range(0, 14, 2)])
            np.testing.assert_array_equal(together[:14], pairs, err_msg=name)
        elif kernels.mode(ks) == "q8" and name in Q8_BLOCK:
            # four-token calls: 0-3, 4-7, 8-11, then 11-14 again over the remainder of three (token 11
            # is computed twice and must store the same bits); each equals its four tokens alone
            for t in (0, 4, 8, 11):
                four = kernels.matmul(raw, int(QT[name]), 17, 512, x[t : t + 4], settings=ks)
                np.testing.assert_array_equal(together[t : t + 4], four, err_msg=f"{name} tokens {t}-{t + 3}")


@pytest.mark.parametrize("name", TYPES_32 + TYPES_256 + TYPES_IQ)
def test_one_token_rows_have_the_same_bits_in_any_group(name: str) -> None:
    """q8 mode, one token: the 32-element types compute rows four at a time (each its own chain), the
    rest of a task's rows one at a time. A row's result must not depend on which of those it took:
    every window of rows starting at each offset gives each row the bits it gets alone."""
    ks = KS("q8")
    if kernels.mode(ks) != "q8":
        pytest.skip("no int8 kernels on this machine")
    raw, _ = weight(name, 17, 512)
    rb = raw.size // 17
    x = activations(1, 512, seed=11)
    alone = np.concatenate([kernels.matmul(raw[r * rb : (r + 1) * rb], int(QT[name]), 1, 512, x, settings=ks)[0]
                            for r in range(17)])
    for r0 in range(4):  # rows r0.. land at every place of a group of four, and in the remainder
        part = kernels.matmul(raw[r0 * rb :], int(QT[name]), 17 - r0, 512, x, settings=ks)[0]
        np.testing.assert_array_equal(part, alone[r0:], err_msg=f"{name} rows from {r0}")


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_matmul_jobs_equal_each_product_alone(mode: str) -> None:
    """matmul_jobs: experts on their own rows of x, q/k/v side by side; mixed types, a job big
    enough for the BLAS path, an empty job. Each block of out equals matmul of that job alone."""
    ks = KS(mode, blas_min_tokens=12)
    specs = [("Q8_0", 33, 0, 5), ("Q4_K", 17, 5, 1), ("Q6_K", 64, 6, 13), ("F16", 3, 19, 2), ("Q5_0", 255, 21, 0),
             ("F32", 7, 21, 3)]
    n_cols = 512
    x = activations(24, n_cols, seed=9)  # [S, K]
    jobs, col = [], 0
    for name, n_rows, t0, n_tok in specs:
        raw, _ = weight(name, n_rows, n_cols)
        jobs.append(kernels.Job(raw, int(QT[name]), n_rows, t0, n_tok, col))
        col += n_rows
    out = np.full((24, col), np.nan, np.float32)
    assert kernels.matmul_jobs(jobs, n_cols, x, out, ks) is out
    for j in jobs:
        alone = kernels.matmul(j.w, j.qtype, j.n_rows, n_cols, x[j.t0 : j.t0 + j.n_tok], settings=ks)
        np.testing.assert_array_equal(out[j.t0 : j.t0 + j.n_tok, j.col : j.col + j.n_rows], alone)
    assert np.isnan(out[21:24, sum(s[1] for s in specs[:4]) : sum(s[1] for s in specs[:5])]).all()  # empty job: untouched
    with pytest.raises(ClutorError, match="outside"):
        kernels.matmul_jobs([kernels.Job(jobs[0].w, jobs[0].qtype, 33, 20, 5, 0)], n_cols, x, out)
    with pytest.raises(ClutorError, match="outside"):
        kernels.matmul_jobs([kernels.Job(jobs[0].w, jobs[0].qtype, 33, 0, 5, col - 10)], n_cols, x, out)
    with pytest.raises(ClutorError, match="bytes"):
        kernels.matmul_jobs([kernels.Job(jobs[0].w[:-1], jobs[0].qtype, 33, 0, 5, 0)], n_cols, x, out)


@pytest.mark.skipif(kernels.drivers.matmul_jobs_q8 is None or kernels._max_numba_threads() < 2,
                    reason="no int8 path on this CPU, or one thread only")
def test_one_thread_q8_launch_runs_serially_with_the_parallel_bits(monkeypatch) -> None:
    """A one-thread int8 launch runs the serial driver (no parallel region: its entry costs a
    one-token product ~2.5 us); what it computes has the bits of the parallel launch on two threads."""
    monkeypatch.setattr(kernels, "_PARALLEL_MIN_BYTES", 0)  # a two-thread setting splits even this small product
    raw, _ = weight("Q4_K", 256, 1024)  # 144 KiB
    x = activations(3, 1024, seed=4)
    two = kernels.matmul(raw, int(QT.Q4_K), 256, 1024, x, settings=KS("q8", threads=2))
    drv = kernels.drivers

    def refuse(*a):
        raise AssertionError("the parallel driver ran for a one-thread launch")

    monkeypatch.setattr(drv, "matmul_jobs_q8", refuse)
    one = kernels.matmul(raw, int(QT.Q4_K), 256, 1024, x, settings=KS("q8", threads=1))
    np.testing.assert_array_equal(one, two)
    with pytest.raises(AssertionError, match="parallel driver"):
        kernels.matmul(raw, int(QT.Q4_K), 256, 1024, x, settings=KS("q8", threads=2))


@pytest.mark.skipif(kernels.drivers.matmul_jobs_q8 is None or kernels._max_numba_threads() < 2,
                    reason="no int8 path on this CPU, or one thread only")
def test_slow_unpacking_types_split_smaller_products_over_the_threads(monkeypatch) -> None:
    """The parallel split counts a product's work, not only its bytes: an IQ1_S product of 1.5 MiB (~1.2 ms
    on one thread) runs on both threads, a Q8_0 product of the same bytes (~0.2 ms) on the calling one."""
    drv = kernels.drivers
    ran = []
    monkeypatch.setattr(drv, "matmul_jobs_q8", lambda *a: ran.append("parallel"))
    monkeypatch.setattr(drv, "matmul_jobs_q8_serial", lambda *a: ran.append("serial"))
    ks = KS("q8", threads=2)
    for name in ("IQ1_S", "Q8_0"):
        block, nbytes = GGML_QUANT_SIZES[QT[name]]
        n_cols = 2048
        n_rows = (3 << 19) // (n_cols // block * nbytes)
        raw = np.zeros(n_rows * n_cols // block * nbytes, np.uint8)
        kernels.matmul(raw, int(QT[name]), n_rows, n_cols, activations(1, n_cols, seed=1), settings=ks)
    assert ran == ["parallel", "serial"]


def test_read_only_and_offset_views() -> None:
    raw, ref = weight("Q4_K", 17, 512)
    arena = np.zeros(raw.size + 4096 + 7, np.uint8)  # a slot inside a bigger buffer, odd offset
    view = arena[7 : 7 + raw.size]
    view[:] = raw
    view.flags.writeable = False
    x = activations(2, 512, seed=1)
    x.flags.writeable = False
    for mode in ("f32", "q8"):
        a = kernels.matmul(view, int(QT.Q4_K), 17, 512, x, settings=KS(mode))
        b = kernels.matmul(raw, int(QT.Q4_K), 17, 512, x, settings=KS(mode))
        np.testing.assert_array_equal(a, b)


def test_one_dimensional_x() -> None:
    raw, ref = weight("Q8_0", 17, 256)
    x = activations(1, 256, seed=2)
    y = kernels.matmul(raw, int(QT.Q8_0), 17, 256, x[0], settings=KS("f32"))
    assert y.shape == (17,)
    np.testing.assert_allclose(y, (x @ ref.T)[0], rtol=1e-4, atol=1e-4)


def test_thread_count_does_not_change_results(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_PARALLEL_MIN_BYTES", 0)  # split this small product over the threads too
    raw, _ = weight("Q6_K", 255, 2048)
    x = activations(3, 2048, seed=3)
    for mode in ("f32", "q8"):
        one = kernels.matmul(raw, int(QT.Q6_K), 255, 2048, x, settings=KS(mode, threads=1))
        two = kernels.matmul(raw, int(QT.Q6_K), 255, 2048, x, settings=KS(mode, threads=2))
        np.testing.assert_array_equal(one, two)


def test_concurrent_callers() -> None:
    """Kernels release the GIL; calls from several threads at once must not interfere."""
    raw, ref = weight("Q8_0", 255, 2048)
    xs = [activations(1, 2048, seed=10 + i) for i in range(4)]
    expect = [kernels.matmul(raw, int(QT.Q8_0), 255, 2048, x) for x in xs]
    results: dict[int, list[np.ndarray]] = {i: [] for i in range(4)}

    def work(i: int) -> None:
        out = np.empty((1, 255), np.float32)
        for _ in range(20):
            results[i].append(kernels.matmul(raw, int(QT.Q8_0), 255, 2048, xs[i], out=out).copy())

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for i in range(4):
        assert len(results[i]) == 20
        for r in results[i]:
            np.testing.assert_array_equal(r, expect[i])


def test_unsupported_and_bad_arguments() -> None:
    for qt in (QT.TQ1_0, QT.TQ2_0, 99):  # ternary types: no kernel (Clutor does not read them)
        assert not kernels.has_kernel(int(qt))
    raw, _ = weight("Q8_0", 3, 256)
    x = activations(1, 256, seed=4)
    with pytest.raises(ClutorError, match="TQ2_0"):
        kernels.matmul(raw, int(QT.TQ2_0), 3, 256, x)
    with pytest.raises(ClutorError, match="bytes"):
        kernels.matmul(raw[:-1], int(QT.Q8_0), 3, 256, x)
    with pytest.raises(ClutorError, match="multiple of 32"):
        kernels.matmul(raw, int(QT.Q8_0), 3, 250, x[:, :250].copy())
    with pytest.raises(ClutorError, match="x must be"):
        kernels.matmul(raw, int(QT.Q8_0), 3, 256, x.astype(np.float64))
    with pytest.raises(ClutorError, match="out must be"):
        kernels.matmul(raw, int(QT.Q8_0), 3, 256, x, out=np.empty((1, 4), np.float32))
    with pytest.raises(ClutorError, match="out must be"):  # dequantize writes n_rows x n_cols floats
        kernels.dequantize(raw, int(QT.Q8_0), 3, 256, out=np.empty((3, 128), np.float32))
    unaligned = np.frombuffer(bytearray(x.nbytes + 1), np.uint8)[1:].view(np.float32).reshape(x.shape)
    with pytest.raises(ClutorError, match="aligned"):  # the tiles' vector loads assume 4-byte alignment
        kernels.matmul(raw, int(QT.Q8_0), 3, 256, unaligned)
    with pytest.raises(ClutorError, match="aligned"):
        kernels.matmul_jobs([kernels.Job(raw, int(QT.Q8_0), 3, 0, 1)], 256, unaligned, np.empty((1, 3), np.float32))
    with pytest.raises(ClutorError, match="activations.*q8"):
        KS("int4")
    with pytest.raises(ClutorError, match="threads"):
        KS(threads=0)


_FIRST_PROMPT = r"""
import asyncio, json, sys
import clutor
from clutor.model import kernels

async def main(runs):
    out = []
    for path, opts in runs:
        async with clutor.Model.open(path, **opts) as model:
            before = kernels.loaded()
            ids = [1 + i % 50 for i in range(40)]  # a prompt past the BLAS threshold, then decode steps
            async for _ in model.generate(ids, max_tokens=3, ignore_eos=True, temperature=0):
                pass
            out.append([path, opts, sorted(kernels.loaded() - before)])
    print(json.dumps(out))

asyncio.run(main(json.loads(sys.argv[1])))
"""


def test_open_loads_every_kernel_the_first_prompt_calls() -> None:
    """Model.open loads (or compiles) every compiled kernel a first prompt and its decode steps call, for
    each architecture's fixture, experts in memory and streamed: else they load inside the first
    generation, holding the GIL (the caller's event loop stalled up to 0.3 s; on a new machine they
    compiled there, 17 s). One process for all of them, the architectures with kernels of their own
    (Arch.warmup) last, so that no architecture's open loads what an earlier one's generation needs."""
    from conftest import FIXTURES

    own = ("gemma4", "glm-dsa")
    files = sorted(FIXTURES.glob("tiny-*-Q4_K_M.gguf"), key=lambda p: (any(f"tiny-{a}-" in p.name for a in own), p.name))
    runs = [[str(FIXTURES / "tiny-olmoe-Q8_0.gguf"), {"expert_cache": "50%", "io": "threads"}]]
    runs += [[str(p), {"io": "memory"}] for p in files]
    runs += [[str(FIXTURES / f"tiny-{a}-F16.gguf"), {"io": "memory"}] for a in ("olmoe", "gemma4")]
    assert len(files) >= 15, files
    env = {**os.environ, "OPENBLAS_THREAD_TIMEOUT": "4"}
    p = subprocess.run([sys.executable, "-c", _FIRST_PROMPT, json.dumps(runs)], capture_output=True, text=True,
                       timeout=1200, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    late = [(Path(path).name, opts, new) for path, opts, new in json.loads(p.stdout.strip().splitlines()[-1]) if new]
    assert not late, f"first loaded by the first prompt, not by Model.open: {late}"


_EVERY_OPEN = r"""
import asyncio, json, sys
import clutor
from clutor.model import kernels

async def main(paths):
    kernels.warmup(every_architecture=True)  # what `clutor warmup` runs
    before, out = kernels.loaded(), []
    for path in paths:
        async with clutor.Model.open(path, io="memory"):
            out.append([path, sorted(kernels.loaded() - before)])
    print(json.dumps(out))

asyncio.run(main(sys.argv[1:]))
"""


def test_clutor_warmup_prepares_what_every_architecture_opens_with() -> None:
    """`clutor warmup` (kernels.warmup with every_architecture) compiles ahead of time every kernel an
    open of any fixture architecture then loads, its Arch.warmup's included: a first run after it
    compiles nothing."""
    from conftest import FIXTURES

    files = [str(p) for p in sorted(FIXTURES.glob("tiny-*-Q4_K_M.gguf"))] + [str(FIXTURES / "tiny-gemma4-F16.gguf")]
    p = subprocess.run([sys.executable, "-c", _EVERY_OPEN, *files], capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "OPENBLAS_THREAD_TIMEOUT": "4"})
    assert p.returncode == 0, p.stderr[-3000:]
    late = [(Path(path).name, new) for path, new in json.loads(p.stdout.strip().splitlines()[-1]) if new]
    assert not late, f"loaded by Model.open after `clutor warmup`: {late}"


def test_warmup_and_info() -> None:
    kernels.warmup()
    info = kernels.info()
    forced = os.environ.get("CLUTOR_KERNELS_ISA")  # set by test_kernels_under_lesser_isas
    if forced:
        assert info.backend == _FORCED_BACKEND[forced], (forced, info.backend)
    assert info.threads == KS().n_threads >= 1 and kernels.info(KS(threads=1)).threads == 1
    assert info.activation_mode == kernels.mode() and kernels.info(KS("f32")).activation_mode == "f32"
    assert kernels.info(KS("q8")).activation_mode == ("q8" if kernels._ir.HAVE_INT8_SIMD else "f32")
    assert {"Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"} <= set(info.types)


def test_importing_clutor_leaves_the_process_environment_alone(tmp_path) -> None:
    """A library embedded in another process must not change it on import: no environment
    variable set, and no file written or removed (the kernels' cache check runs at the first
    launch; numba itself only creates its empty cache directory when the kernels are declared)."""
    import json
    import subprocess
    import sys

    code = ("import os, json; before = dict(os.environ); import clutor, clutor.model.kernels, clutor.model.model; "
            "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT")}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {}
    assert [p for p in (tmp_path / "numba").rglob("*") if not p.is_dir()] == [], "files written on import"


def test_the_command_sets_the_thread_pools_to_sleep_before_numpy_loads() -> None:
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT when it loads (numpy's first import): the clutor command
    sets it in main(), which works only if importing the command's module has not loaded numpy."""
    import subprocess
    import sys

    code = ("import sys, os; import clutor.cli; loaded = 'numpy' in sys.modules; "
            "clutor.cli.sleeping_kernel_workers(); print(loaded, os.environ['OPENBLAS_THREAD_TIMEOUT'])")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False", "4"], p.stdout


@pytest.mark.parametrize("op, name, asm, want", [
    ("tile1", "Q4_K", False, "qt.Q4_K"),      # that type's case of the switch, labelled by _ir._switch
    ("deq", "MXFP4", False, "qt.MXFP4"),
    ("idot4", "Q8_0", True, "vpdpbusd|vpmaddubsw"),  # the int8 dot instructions
])
def test_dump_prints_one_kernel_for_one_type(op, name, asm, want, capsys) -> None:
    """python -m clutor.model.kernels.dump: a newcomer's view of the code one kernel generates."""
    import re

    from clutor.model.kernels import dump

    if op.startswith("idot") and not kernels._ir.HAVE_INT8_SIMD:
        pytest.skip("no int8 kernels on this backend")
    assert dump.main([op, "--type", name] + (["--asm"] if asm else [])) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"; {op} for {name}, backend {kernels._ir.BACKEND}") and re.search(want, out), out[:500]
    assert ("define " in out) != asm and out.count("define ") <= 1  # one function ...
    assert set(re.findall(r"\bqt\.([A-Z0-9_]+)", out)) <= {name}  # ... holding one type's code
    with pytest.raises(SystemExit):
        dump.main(["tile1", "--type", "TQ2_0"])  # no kernel: a usage error naming the kernel types
    assert "TQ2_0 has no kernel" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("isa", sorted(_FORCED_BACKEND))
def test_kernels_under_lesser_isas(isa: str, tmp_path) -> None:
    """A test run only checks the code generated for its own CPU: run this file's kernel tests again,
    in a subprocess, with the code an AVX2-only CPU (no VNNI) or a CPU without the x86 int8 path gets.
    The subprocess caches its kernels under tmp_path, so the normal cache is left alone (the cache
    guard keys on the backend and would otherwise recompile it)."""
    ir = kernels._ir
    if isa == "avx2" and not (ir._features.get("avx2") and ir.HAVE_F16C):
        pytest.skip("this CPU cannot run AVX2 code")
    if ir.BACKEND == _FORCED_BACKEND[isa]:
        pytest.skip(f"{isa} is this CPU's own backend: the normal run covers it")
    env = {**os.environ, "CLUTOR_KERNELS_ISA": isa, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    # the kernels themselves: not the process-level tests, the dump command or this test again
    skip = "lesser_isas or importing_clutor or dump or concurrent_callers"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rA", "-p", "no:cacheprovider", __file__,
                        "-k", f"not ({skip})"], capture_output=True, text=True, env=env, timeout=540,
                       cwd=Path(__file__).resolve().parent.parent)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    passed = [line for line in p.stdout.splitlines() if line.startswith("PASSED ")]
    assert any(line.endswith("::test_warmup_and_info") for line in passed), p.stdout[-3000:]  # checks the backend
    assert sum("::test_matmul_matches_reference[" in line for line in passed) == len(list(_cases()))
