"""The numeric building blocks the architectures share (numpy, float32).

Dimension letters: T = tokens in this step, D = n_embd, H = query heads, Hkv = kv heads,
G = H // Hkv, hd = head dim, N = positions in the KV cache so far, E = experts, K = top-k, F = expert hidden.
"""
from __future__ import annotations

import time

import numpy as np

from .kernels.norms import rmsnorm_rows
from .kernels.rowwise import rowdot
from .kernels.topk import softmax_topk
from .profile import kernel_done

__all__ = ["rmsnorm", "silu", "sigmoid", "softmax", "Yarn", "Rope", "attention", "route", "gate"]


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., n] * w [n] / rms(x) along the last axis, as ggml computes it: the float32 squares summed in
    float64, their mean rounded back to x's type (so that the result is llama.cpp's to the bit; kernels.norms)."""
    if x.dtype == np.float32 and w.dtype == np.float32 and w.shape == x.shape[-1:] and x.ndim >= 1:
        x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
        return rmsnorm_rows(x2, w, eps).reshape(x.shape)
    ms = (np.sum(np.square(x), axis=-1, keepdims=True, dtype=np.float64) / x.shape[-1]).astype(x.dtype)
    return x * (1.0 / np.sqrt(ms + eps)) * w


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) -> inf for very negative x gives the right limit, -0
        return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


class Yarn:
    """YaRN's frequency blend as ggml computes it: dims rotating faster than beta_fast turns over the
    original context keep their frequency, those slower than beta_slow turns are divided by factor,
    with a linear ramp between."""

    def __init__(self, factor: float, n_ctx_orig: int, beta_fast: float = 32.0, beta_slow: float = 1.0):
        self.factor, self.n_ctx_orig, self.beta_fast, self.beta_slow = factor, n_ctx_orig, beta_fast, beta_slow

    def frequencies(self, inv: np.ndarray, n_rot: int, base: float) -> np.ndarray:
        def corr_dim(beta: float) -> float:
            return n_rot * np.log(self.n_ctx_orig / (beta * 2 * np.pi)) / (2 * np.log(base))

        lo = max(0.0, np.floor(corr_dim(self.beta_fast)))
        hi = min(n_rot - 1.0, np.ceil(corr_dim(self.beta_slow)))
        i = np.arange(len(inv), dtype=np.float64)
        keep = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)  # 1: extrapolate (original frequency)
        return inv / self.factor * (1.0 - keep) + inv * keep


class Rope:
    """Rotary embedding of the first n_rot dims of each head, by pos * base^(-2i/n_rot).

    style "neox" rotates the pairs (x[i], x[i + n_rot/2]) (olmoe, qwen, glm4moe); "norm" the
    adjacent pairs (x[2i], x[2i+1]) (llama, deepseek2). Dims past n_rot pass through, and so do the
    pairs ``still`` marks (qwen35moe's interleaved M-RoPE gives text a zero position in some of them).
    ``factors`` divide the pairs' frequencies (llama.cpp's rope_freqs; Gemma 4's global layers).
    ``ggml_theta``: RoPE as ggml's CPU RoPE computes it, in float32: pair i's angle is the
    position times base^(-2/n_rot) i times over, each product rounded, then divided by its factor
    (rather than the exact angle rounded once), libm's cosf / sinf of it (kernels.ggmlmath), and each
    rotated value x0 cos - x1 sin as one FMA of x0 cos with x1 sin rounded (as GCC contracts ggml's
    rotate_pairs). The exact angle differs by ~1e-7 x position radians, enough to move a
    float16-weight model's logits by ~0.01 at a hundred positions; an ulp in cos or in the rotation
    flips halves in the next F16 product.

    The angles are computed for the positions of each call, not tabled for the whole context: a
    table of n_ctx x n_rot/2 would let the context length (or a file's key_length) decide an
    allocation of gigabytes at open, while a step's own positions cost T x n_rot/2 numbers.
    """

    def __init__(self, n_rot: int, base: float, n_ctx: int, style: str = "neox", yarn: "Yarn | None" = None,
                 mscale: float = 1.0, still: np.ndarray | None = None, factors: np.ndarray | None = None,
                 ggml_theta: bool = False):
        self.half = n_rot // 2
        self.n_ctx = n_ctx
        self.style = style
        self.mscale = np.float32(mscale)  # magnitude applied to cos and sin (YaRN's, where an arch keeps it)
        inv = base ** (-np.arange(self.half, dtype=np.float64) * 2.0 / n_rot)  # [n_rot/2]
        self.inv = yarn.frequencies(inv, n_rot, base) if yarn is not None else inv
        self._ggml = None  # (theta_scale, factors) float32, for ggml_theta
        if ggml_theta:
            if yarn is not None or still is not None:
                raise ValueError("ggml_theta is for plain RoPE (with factors) only")
            ff = np.ones(self.half, np.float32) if factors is None else np.asarray(factors, np.float32)
            self._ggml = (np.float32(base) ** np.float32(-2.0 / n_rot), ff)
        if factors is not None:  # rope_freqs [n_rot/2]: each pair's frequency divided (1e30: a pair that stays put)
            self.inv = self.inv / np.asarray(factors, np.float64)
        if still is not None:  # pairs [n_rot/2] that do not turn (their position is 0: M-RoPE's unused sections)
            self.inv = np.where(still, 0.0, self.inv)
        self._memo: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # (p0, T) -> (cos, sin)
        self._memo_floats = 0

    def angles(self, p0: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin float32 [T, n_rot/2] (read-only) for positions p0..p0+T-1.

        A step asks for the same positions twice per layer (q and k) in every layer: the last few
        answers are kept, bounded in entries and in floats (a prefill chunk's are the big ones)."""
        if not 0 <= p0 <= p0 + T <= self.n_ctx:
            raise ValueError(f"RoPE positions {p0}..{p0 + T - 1} outside the context of {self.n_ctx}")
        hit = self._memo.get((p0, T))
        if hit is not None:
            return hit
        cos, sin = self._cos_sin(np.arange(p0, p0 + T))
        if self.mscale != 1:
            cos, sin = cos * self.mscale, sin * self.mscale
        cos.flags.writeable = sin.flags.writeable = False
        if len(self._memo) >= 64 or self._memo_floats + cos.size > 1 << 19:  # at most 4 MiB of cos + sin
            self._memo.clear()
            self._memo_floats = 0
        if cos.size <= 1 << 19:
            self._memo[(p0, T)] = (cos, sin)
            self._memo_floats += cos.size
        return cos, sin

    def angles_at(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin float32 [R, n_rot/2] for arbitrary positions pos [R] (a batched step's rows);
        the same values angles() gives for those positions."""
        if len(pos) and not (0 <= int(pos.min()) and int(pos.max()) < self.n_ctx):
            raise ValueError(f"RoPE positions {int(pos.min())}..{int(pos.max())} outside the context of {self.n_ctx}")
        cos, sin = self._cos_sin(pos)
        if self.mscale != 1:
            cos, sin = cos * self.mscale, sin * self.mscale
        return cos, sin

    def _cos_sin(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin float32 [R, n_rot/2] of positions pos [R] (magnitude not applied)."""
        if self._ggml is None:
            ang = pos.astype(np.float64)[:, None] * self.inv[None, :]  # [R, n_rot/2]
            return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        from .kernels.ggmlmath import rope_cos_sin  # late: numba is slow to import

        return rope_cos_sin(pos, *self._ggml)

    def __call__(self, x: np.ndarray, p0: int) -> np.ndarray:
        """x [T, heads, hd] at positions p0..p0+T-1 -> rotated copy."""
        return self.rotate(x, *self.angles(p0, x.shape[0]))

    def rotate(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x [T, heads, hd] rotated by the angles of its rows (cos, sin [T, n_rot/2]) -> a copy."""
        half = self.half
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, half]
        out = np.empty_like(x)
        if self._ggml is not None and self.style == "neox":  # one FMA each, as ggml's rotate_pairs compiles
            x1, x2 = x[..., :half].astype(np.float64), x[..., half : 2 * half].astype(np.float64)
            out[..., :half] = x1 * cos - (x2 * sin).astype(np.float32)
            out[..., half : 2 * half] = x1 * sin + (x2 * cos).astype(np.float32)
        elif self.style == "neox":
            x1, x2 = x[..., :half], x[..., half : 2 * half]
            out[..., :half] = x1 * cos - x2 * sin
            out[..., half : 2 * half] = x2 * cos + x1 * sin
        else:
            x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
            out[..., 0 : 2 * half : 2] = x1 * cos - x2 * sin
            out[..., 1 : 2 * half : 2] = x2 * cos + x1 * sin
        out[..., 2 * half :] = x[..., 2 * half :]
        return out


def attention(q: np.ndarray, K: np.ndarray, V: np.ndarray, p0: int, k0: int, scale: float, *, window: int = 0,
              sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal GQA attention of q [T, H, hd] at positions p0 .. p0 + T - 1 over keys K [Hkv, N, hd] and
    values V [Hkv, N, hdv] at positions k0 .. k0 + N - 1 (N = p0 + T - k0: through the last query)
    -> [T, H * hdv].

    window > 0: a query at position i sees keys j with i - j < window only (sliding window).
    sinks [H]: one learned logit per head that joins each softmax's denominator (gpt-oss)."""
    if window or sinks is not None:
        return _attention_masked(q, K, V, p0, k0, scale, window, sinks)
    T, H, hd = q.shape
    Hkv, n = K.shape[0], K.shape[1]
    G = H // Hkv
    qg = q.reshape(T, Hkv, G, hd).transpose(1, 2, 0, 3).reshape(Hkv, G * T, hd)  # head i -> kv head i // G
    s = (qg @ K.transpose(0, 2, 1)) * np.float32(scale)  # [Hkv, G*T, N]
    if T > 1:  # a query at position p0 + t sees keys k0 .. p0 + t: -inf added past that
        future = (k0 + np.arange(n))[None, :] > (p0 + np.arange(T))[:, None]  # [T, N]
        s = s.reshape(Hkv, G, T, n)
        s += np.where(future, np.float32(-np.inf), np.float32(0.0))  # [T, N] broadcast, in place
        s = s.reshape(Hkv, G * T, n)
    p = softmax(s)
    o = p @ V  # [Hkv, G*T, hdv]
    return o.reshape(Hkv, G, T, -1).transpose(2, 0, 1, 3).reshape(T, -1)


def _attention_masked(q, K, V, p0, k0, scale, window, sinks):
    T, H, hd = q.shape
    Hkv, n = K.shape[0], K.shape[1]
    G = H // Hkv
    qg = q.reshape(T, Hkv, G, hd).transpose(1, 2, 0, 3)  # [Hkv, G, T, hd]
    s = (qg @ K[:, None].transpose(0, 1, 3, 2)) * np.float32(scale)  # [Hkv, G, T, N]
    qpos = (p0 + np.arange(T))[:, None]
    kpos = (k0 + np.arange(n))[None, :]
    masked = kpos > qpos
    if window:
        masked |= qpos - kpos >= window
    s[:, :, masked] = -np.inf
    m = s.max(axis=-1, keepdims=True)  # [Hkv, G, T, 1]
    if sinks is not None:
        sk = sinks.reshape(Hkv, G, 1, 1).astype(np.float32)
        m = np.maximum(m, sk)
    e = np.exp(s - m)
    den = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(sk - m)  # the sink takes probability mass and adds no value
    o = (e / den) @ V[:, None]  # [Hkv, G, T, hdv]
    return o.transpose(2, 0, 1, 3).reshape(T, -1)


def router_logits(h: np.ndarray, router: np.ndarray) -> np.ndarray:
    """h [T, D] @ router [E, D].T -> [T, E] (float32, each row alone: a row's logits, and so its
    experts, do not depend on the rows beside it; timed as a kernel by a running profile)."""
    t0 = time.perf_counter()
    logits = rowdot(h, router)
    kernel_done(t0)
    return logits


def route(h: np.ndarray, router: np.ndarray, k: int, renorm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router: h [T, D], router [E, D] -> (experts [T, K] int64, weights [T, K] float32).

    Softmax over ALL experts, then the k largest probabilities (ties -> lower expert id)."""
    logits = router_logits(h, router)  # [T, E]
    fast = softmax_topk(logits, k, renorm)  # the bits of the lines below in three calls (kernels.topk)
    if fast is not None:
        return fast
    probs = softmax(logits)  # [T, E]
    sel = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # [T, K]
    w = np.take_along_axis(probs, sel, axis=-1)  # [T, K]
    if renorm:
        w = w / np.sum(w, axis=-1, keepdims=True)
    return sel, w.astype(np.float32)


def gate(h: np.ndarray, router: np.ndarray, k: int, *, func: str = "softmax", bias: np.ndarray | None = None,
         norm: bool = False, scale: float = 0.0, groups: tuple[int, int] | None = None,
         logit_bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The router as llama.cpp computes it: h [T, D], router [E, D] -> (experts [T, K], weights [T, K]).

    func: "softmax" | "sigmoid" | "softmax_weight" (softmax over the k chosen logits) turns the logits
    (+ logit_bias) into probabilities; ``bias`` [E] (exp_probs_b) shifts which experts are chosen but
    not their weights; ``groups`` (n_group, n_group_used): only experts of the n_group_used groups
    with the best sum of their top-2 biased scores compete; ``norm`` divides the weights by their sum
    (clamped to F16's smallest normal); ``scale`` multiplies them unless 0 or 1. Ties -> lower id."""
    if func == "softmax" and bias is None and groups is None and logit_bias is None and scale in (0.0, 1.0):
        return route(h, router, k, norm)  # softmax probabilities sum to >= 1/E: the clamp never acts
    logits = router_logits(h, router)  # [T, E]
    if logit_bias is not None:
        logits = logits + logit_bias
    if func == "softmax":
        probs = softmax(logits)
    elif func == "sigmoid":
        probs = sigmoid(logits)
    elif func == "softmax_weight":
        probs = logits
    else:
        raise ValueError(f"unknown gating function {func!r}")
    select = probs if bias is None else probs + bias  # [T, E]
    if groups is not None and groups[0] > 1:
        n_group, n_used = groups
        T, E = select.shape
        g = select.reshape(T, n_group, E // n_group)  # [T, G, E/G]
        score = np.sort(g, axis=-1)[..., -2:].sum(-1)  # [T, G]: the sum of each group's top 2
        keep = np.argsort(-score, axis=-1, kind="stable")[:, :n_used]  # [T, n_used]
        mask = np.full((T, n_group), True)
        np.put_along_axis(mask, keep, False, axis=-1)
        select = np.where(np.repeat(mask, E // n_group, axis=-1), -np.inf, select)
    sel = np.argsort(-select, axis=-1, kind="stable")[:, :k]  # [T, K]
    w = np.take_along_axis(probs, sel, axis=-1)  # [T, K]
    if func == "softmax_weight":
        w = softmax(w)
    if norm:
        w = w / np.maximum(np.sum(w, axis=-1, keepdims=True), 6.103515625e-5)
    if scale not in (0.0, 1.0):
        w = w * scale
    return sel, w.astype(np.float32)
