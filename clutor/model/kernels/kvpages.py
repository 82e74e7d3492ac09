"""A sequence's float16 KV pages of one layer widened to float32, in one pass (clutor.model.step).

numpy's way (a fancy-indexed copy of the pages, a transposing copy, then ``astype``) costs three passes
and numpy's scalar half conversion: ~230 us per layer for 140 positions of 8 heads x 64 floats on Zen 3,
most of a small model's attention. Here each half is widened through a 65536-entry table (exactly
numpy's conversion: every half, subnormals, infinities and NaNs included; tests/test_kv.py checks all
of them) straight into the [H, n, width] layout attention reads.

    pages  uint16  [n_pages, L, H, PAGE, W]   the pool's float16 data, viewed as its bits
    table  float32 [65536]                    half bits -> float
    out    float32 [H, n, W]                  caller-owned
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["HALF_TO_FLOAT", "gather_f16"]

HALF_TO_FLOAT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)  # [65536]


@njit(nogil=True, cache=True, boundscheck=False)
def _gather(data, li, pages, n, table, out):
    H, P, W = data.shape[2], data.shape[3], data.shape[4]
    for h in range(H):
        t = 0
        for pi in range(pages.shape[0]):
            p = pages[pi]
            k = min(P, n - t)
            for o in range(k):
                for w in range(W):
                    out[h, t + o, w] = table[data[p, li, h, o, w]]
            t += k


def gather_f16(data: np.ndarray, li: int, pages: np.ndarray, n: int) -> np.ndarray:
    """The first n positions of ``pages`` [n_pages] (int64) of layer li of the float16 pool ``data``
    -> float32 [H, n, W]."""
    _, _, H, _, W = data.shape
    out = np.empty((H, n, W), np.float32)
    _gather(data.view(np.uint16), li, pages, n, HALF_TO_FLOAT, out)
    return out
