"""The int8 path's activation blocks against ggml's own (tests/golden/ggml_activations.npz, recorded
from llama.cpp's CPU quantize_row_q8_0 / _q8_1 / _q8_K by tools/record_quants.py): bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import GOLDEN
from clutor.model.kernels.activations import quantize_activations, round_half


@pytest.fixture(scope="module")
def ggml():
    with np.load(GOLDEN / "ggml_activations.npz") as z:
        return {k: z[k] for k in z.files}


def _ours(x: np.ndarray, block: int):
    T, K = x.shape
    xq = np.empty((T, K), np.int8)
    xd = np.empty((T, K // block), np.float32)
    xs1 = np.empty((T, K // 32), np.float32)
    xs16 = np.empty((T, K // 16), np.int16)
    quantize_activations(x, block, xq, xd, xs1, xs16)
    return xq, xd, xs1, xs16


def _blocks(raw: np.ndarray, nbytes: int) -> np.ndarray:
    return raw.reshape(raw.shape[0], -1, nbytes)  # [T, blocks, bytes]


@pytest.mark.parametrize("kind", ["q8_0", "q8_1"])
def test_q8_0_and_q8_1_blocks_are_ggml_bit_for_bit(ggml, kind):
    x = ggml["x"]
    xq, xd, xs1, _ = _ours(x, 32)
    b = _blocks(ggml[kind], 34 if kind == "q8_0" else 36)
    qs_at = 2 if kind == "q8_0" else 4
    want_d = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [T, K/32]
    want_q = b[:, :, qs_at:].copy().view(np.int8).reshape(x.shape)
    np.testing.assert_array_equal(xq, want_q)
    np.testing.assert_array_equal(xd.view(np.uint32), want_d.view(np.uint32))
    assert np.isinf(xd).any() and (xd == 0).any()  # the recorded rows reach both ends of a half's range
    if kind == "q8_1":
        want_s = b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        np.testing.assert_array_equal(xs1.view(np.uint32), want_s.view(np.uint32))


def test_q8_k_blocks_are_ggml_bit_for_bit(ggml):
    x = ggml["x"]
    xq, xd, _, xs16 = _ours(x, 256)
    b = _blocks(ggml["q8_K"], 292)
    want_d = b[:, :, 0:4].copy().view(np.float32)[..., 0]
    want_q = b[:, :, 4:260].copy().view(np.int8).reshape(x.shape)
    want_bsums = b[:, :, 260:292].copy().view(np.int16).reshape(x.shape[0], -1)
    np.testing.assert_array_equal(xq, want_q)
    np.testing.assert_array_equal(xd.view(np.uint32), want_d.view(np.uint32))
    np.testing.assert_array_equal(xs16, want_bsums)
    assert (want_d < 0).any() and (want_d > 0).any()  # ggml's sign convention is reproduced, not just |d|


def test_round_half_is_ieee_round_to_nearest_even():
    rng = np.random.default_rng(1)
    v = np.concatenate([
        (rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 6, 20000)).astype(np.float32),
        # halfway between neighbouring halves, in the normal and the subnormal range, and at the top
        (np.arange(1, 2000, dtype=np.float32) * np.float32(2.0 ** -25)),
        np.float32([65504.0, 65519.99, 65520.0, 1e30, -65520.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 0.0, -0.0]),
        (np.float16(np.arange(0, 65504, 7.25)).astype(np.float32) + np.float32(0.015625)),
    ])
    got = np.array([round_half(np.float32(a)) for a in v], np.float32)
    with np.errstate(over="ignore"):  # past 65504: inf, as the hardware gives
        want = v.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
