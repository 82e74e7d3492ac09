"""The numeric building blocks shared by all three architectures (numpy, float32).

Dimension letters: T = tokens in this step, D = n_embd, H = query heads, Hkv = kv heads,
G = H // Hkv, hd = head dim, N = positions in the KV cache so far, E = experts, K = top-k, F = expert hidden.
"""
from __future__ import annotations

import numpy as np

from ..errors import BudgetError

__all__ = ["rmsnorm", "silu", "softmax", "Rope", "KVCache", "attention", "route"]


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., n] * w [n] / rms(x) along the last axis."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(ms + eps)) * w


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) -> inf for very negative x gives the right limit, -0
        return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


class Rope:
    """NEOX-ordered rotary embedding: pair (x[i], x[i + n_rot/2]) rotated by pos * base^(-2i/n_rot).

    The angles are computed for the positions of each call, not tabled for the whole context: a
    table of n_ctx x n_rot/2 would let the context length (or a file's key_length) decide an
    allocation of gigabytes at open, while a step's own positions cost T x n_rot/2 numbers.
    """

    def __init__(self, n_rot: int, base: float, n_ctx: int):
        self.half = n_rot // 2
        self.n_ctx = n_ctx
        self.inv = base ** (-np.arange(self.half, dtype=np.float64) * 2.0 / n_rot)  # [n_rot/2]

    def angles(self, p0: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin float32 [T, n_rot/2] for positions p0..p0+T-1."""
        if not 0 <= p0 <= p0 + T <= self.n_ctx:
            raise ValueError(f"RoPE positions {p0}..{p0 + T - 1} outside the context of {self.n_ctx}")
        ang = np.arange(p0, p0 + T, dtype=np.float64)[:, None] * self.inv[None, :]  # [T, n_rot/2]
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def __call__(self, x: np.ndarray, p0: int) -> np.ndarray:
        """x [T, heads, hd] at positions p0..p0+T-1 -> rotated copy."""
        T, half = x.shape[0], self.half
        cos, sin = self.angles(p0, T)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, half]
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        out = np.empty_like(x)
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half : 2 * half] = x2 * cos + x1 * sin
        out[..., 2 * half :] = x[..., 2 * half :]
        return out


def _lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """float32 zeros in an anonymous mapping (zero pages until written), without huge pages."""
    import mmap

    import math

    count = math.prod(shape)
    try:
        m = mmap.mmap(-1, max(count * 4, 1))
    except (OSError, OverflowError, MemoryError) as e:
        # Only address space is asked for here, but the kernel may still refuse it (overcommit
        # limits, RLIMIT_AS): say which size did not fit instead of a bare errno.
        raise BudgetError(f"KV cache of {count * 4} bytes {shape} cannot be mapped ({e}); "
                          "open the model with a smaller n_ctx") from None
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, dtype=np.float32, count=count).reshape(shape)


class KVCache:
    """Preallocated keys and values of one sequence: never reallocated or copied while decoding.

    float32 in anonymous mappings with huge pages refused: pages become resident only as positions
    are written, so a large n_ctx costs memory in proportion to the tokens actually held. (numpy's own
    allocator asks for transparent huge pages, and then writing one position of each (layer, head)
    row made every row's 2 MiB page resident: 250 MiB for the first token of a small model.)
    """

    def __init__(self, n_layers: int, n_head_kv: int, n_ctx: int, head_dim: int, head_dim_v: int):
        self.k = _lazy_zeros((n_layers, n_head_kv, n_ctx, head_dim))    # [L, Hkv, n_ctx, hd]
        self.v = _lazy_zeros((n_layers, n_head_kv, n_ctx, head_dim_v))  # [L, Hkv, n_ctx, hdv]
        self.n_ctx = n_ctx
        self.n = 0  # positions filled (advanced by the model after the last layer)
        self.high = 0  # positions ever written: the pages made resident (what the cache really holds)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, p0: int, k: np.ndarray, v: np.ndarray) -> None:
        """k [T, Hkv, hd], v [T, Hkv, hdv] at positions p0..p0+T-1."""
        T = k.shape[0]
        self.high = max(self.high, p0 + T)
        self.k[layer, :, p0 : p0 + T] = k.transpose(1, 0, 2)
        self.v[layer, :, p0 : p0 + T] = v.transpose(1, 0, 2)


def attention(q: np.ndarray, cache: KVCache, layer: int, p0: int, scale: float) -> np.ndarray:
    """Causal GQA attention of q [T, H, hd] (positions p0..) over the cache -> [T, H * hdv]."""
    T, H, hd = q.shape
    Hkv = cache.k.shape[1]
    G = H // Hkv
    n = p0 + T
    K = cache.k[layer, :, :n]  # [Hkv, N, hd]  (a view: no per-token copy of the cache)
    V = cache.v[layer, :, :n]  # [Hkv, N, hdv]
    qg = q.reshape(T, Hkv, G, hd).transpose(1, 2, 0, 3).reshape(Hkv, G * T, hd)  # head i -> kv head i // G
    s = (qg @ K.transpose(0, 2, 1)) * np.float32(scale)  # [Hkv, G*T, N]
    if T > 1:
        s = s.reshape(Hkv, G, T, n)
        future = np.arange(n)[None, :] > (p0 + np.arange(T))[:, None]  # [T, N]
        s[:, :, future] = -np.inf
        s = s.reshape(Hkv, G * T, n)
    p = softmax(s)
    o = p @ V  # [Hkv, G*T, hdv]
    return o.reshape(Hkv, G, T, -1).transpose(2, 0, 1, 3).reshape(T, -1)


def route(h: np.ndarray, router: np.ndarray, k: int, renorm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router: h [T, D], router [E, D] -> (experts [T, K] int64, weights [T, K] float32).

    Softmax over ALL experts, then the k largest probabilities (ties -> lower expert id)."""
    probs = softmax(h @ router.T)  # [T, E]
    sel = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # [T, K]
    w = np.take_along_axis(probs, sel, axis=-1)  # [T, K]
    if renorm:
        w = w / np.sum(w, axis=-1, keepdims=True)
    return sel, w.astype(np.float32)
