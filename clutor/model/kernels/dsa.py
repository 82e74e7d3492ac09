"""DeepSeek's sparse attention (DSA, GLM-5 / DeepSeek-V3.2): the lightning indexer's key selection and
attention over the selected keys only.

    sel = index_topk(q, keys, w, p0, top_k)         # bool [T, N]: the keys each query keeps
    out = attend_selected(q, K, V, p0, scale, sel)  # causal attention over those keys -> [T, H * dv]

The indexer scores key j for the query at position p = p0 + t as sum_h relu(q[t, h] . keys[j]) w[t, h]
(heads in order, the weights pre-scaled) over the causal keys j <= p, and keeps the top_k best. Which
keys win a tie is decided as llama.cpp's CPU decides it: its ggml_top_k runs std::partial_sort over the
indices 0 .. N-1 with "score greater", and GCC's libstdc++ implements that as a heap of the first top_k
indices that a later index enters only with a strictly greater score than the heap's least (evicting
the least the heap's sift order finds). _heap_select is that algorithm, step for step, so ties (keys
with equal scores, e.g. every head's dot product <= 0, a score of exactly 0) fall the same way.
A query with at most top_k causal keys keeps them all.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .rowwise import threads_for

__all__ = ["index_topk", "attend_selected", "heap_select"]

_FLAGS = {"contract"}


@njit(nogil=True, cache=True, boundscheck=False)
def _adjust_heap(idx, s, hole, n, value):
    # libstdc++'s std::__adjust_heap with comp(a, b) = s[a] > s[b] (then std::__push_heap)
    top = hole
    child = hole
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if s[idx[child]] > s[idx[child - 1]]:
            child -= 1
        idx[hole] = idx[child]
        hole = child
    if (n & 1) == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        idx[hole] = idx[child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and s[idx[parent]] > s[value]:
        idx[hole] = idx[parent]
        hole = parent
        parent = (hole - 1) // 2
    idx[hole] = value


@njit(nogil=True, cache=True, boundscheck=False)
def _heap_select(s, n, k, idx):
    # std::partial_sort(first, first + k, first + n)'s choice of the k (libstdc++'s std::__heap_select):
    # make_heap over the first k indices, then each later index that beats the heap's top replaces it
    for j in range(k):
        idx[j] = j
    if k >= 2:
        parent = (k - 2) // 2
        while True:
            _adjust_heap(idx, s, parent, k, idx[parent])
            if parent == 0:
                break
            parent -= 1
    for j in range(k, n):
        if s[j] > s[idx[0]]:
            _adjust_heap(idx, s, 0, k, j)  # std::__pop_heap(first, middle, j): j's index enters at the top


@njit(parallel=True, nogil=True, cache=True, boundscheck=False, fastmath=_FLAGS)
def _index_topk(q, keys, w, p0, top_k, scores, sel):
    T, H, D = q.shape
    for t in prange(T):
        n = p0 + t + 1  # causal keys 0 .. p
        if n <= top_k:
            for j in range(n):
                sel[t, j] = True
            continue
        s = scores[t]
        for j in range(n):
            score = np.float32(0.0)
            for h in range(H):
                acc = np.float32(0.0)
                for d in range(D):
                    acc += q[t, h, d] * keys[j, d]
                if acc > 0:
                    score += acc * w[t, h]
            s[j] = score
        idx = np.empty(top_k, np.int64)
        _heap_select(s, n, top_k, idx)
        for i in range(top_k):
            sel[t, idx[i]] = True


def index_topk(q: np.ndarray, keys: np.ndarray, w: np.ndarray, p0: int, top_k: int) -> np.ndarray:
    """The keys each query keeps: q [T, Hi, Di] the indexer's queries at positions p0 .. p0 + T - 1,
    keys [N, Di] its keys at positions 0 .. N - 1 (N = p0 + T), w [T, Hi] the per-head weights (already
    scaled) -> bool [T, N]. All float32."""
    T = q.shape[0]
    n = keys.shape[0]
    q = np.ascontiguousarray(q, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    sel = np.zeros((T, n), np.bool_)
    scores = np.empty((T, n), np.float32)
    threads_for(T * n * q.shape[1] * q.shape[2])
    _index_topk(q, keys, w, int(p0), int(top_k), scores, sel)
    return sel


def heap_select(scores: np.ndarray, k: int) -> np.ndarray:
    """The indices std::partial_sort(.., .. + k, .., greater) leaves first in GCC's libstdc++, as a
    sorted int64 array (k <= len(scores)); the test's window onto _heap_select."""
    s = np.ascontiguousarray(scores, dtype=np.float32)
    idx = np.empty(k, np.int64)
    _heap_select(s, len(s), k, idx)
    return np.sort(idx)


@njit(parallel=True, nogil=True, cache=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _attend_selected(q, K, V, p0, scale, sel, scores, out):
    T, H, dk = q.shape
    dv = V.shape[2]
    for i in prange(H * T):
        h = i // T
        t = i - h * T
        hi = p0 + t + 1
        s = scores[i]
        m = -np.inf
        for j in range(hi):
            if not sel[t, j]:
                continue
            acc = np.float32(0.0)
            for d in range(dk):
                acc += q[t, h, d] * K[0, j, d]
            v = acc * scale
            s[j] = v
            if v > m:
                m = v
        den = np.float32(0.0)
        for j in range(hi):
            if sel[t, j]:
                e = np.exp(s[j] - m)
                s[j] = e
                den += e
        base = h * dv
        for d in range(dv):
            out[t, base + d] = 0.0
        for j in range(hi):
            if sel[t, j]:
                e = s[j]
                for d in range(dv):
                    out[t, base + d] += e * V[0, j, d]
        inv = np.float32(1.0) / den
        for d in range(dv):
            out[t, base + d] *= inv


def attend_selected(q: np.ndarray, K: np.ndarray, V: np.ndarray, p0: int, scale: float, sel: np.ndarray) -> np.ndarray:
    """Attention of q [T, H, dk] at positions p0 .. over one shared key head K [1, N, >= dk] (its first
    dk columns) and V [1, N, dv], each query over the keys sel [T, N] marks (a subset of its causal
    ones) -> float32 [T, H * dv]."""
    T, H, _ = q.shape
    n = K.shape[1]
    q = np.ascontiguousarray(q, dtype=np.float32)
    out = np.empty((T, H * V.shape[2]), np.float32)
    scores = np.empty((H * T, n), np.float32)
    threads_for(T * H * n * (q.shape[2] + V.shape[2]))
    _attend_selected(q, K, V, int(p0), np.float32(scale), sel, scores, out)
    return out


def warmup() -> None:
    """Load (or compile) this module's kernels as sparse attention calls them (GLM-5, DeepSeek-V3.2): at
    open, not inside the first prompt. Keys of two positions, one kept: the selection's heap runs."""
    q = np.zeros((2, 1, 8), np.float32)  # [T, H, dk]
    sel = index_topk(q, np.zeros((2, 8), np.float32), np.ones((2, 1), np.float32), 0, 1)
    full = np.zeros((1, 2, 16), np.float32)  # [1, N, latent | rope]: the pool's rows, values a column range
    attend_selected(q, full, full[..., :8], 0, 1.0, sel)
