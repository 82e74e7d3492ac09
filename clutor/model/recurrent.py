"""Recurrent layers: their per-sequence state and the recurrences themselves (numpy, float32).

Two kinds of layer keep a fixed-size state per sequence instead of a KV cache that grows:

- Gated DeltaNet (Qwen3.5 / Qwen3.6, Qwen3-Next): a causal depthwise convolution over the q|k|v
  channels, whose state is the last K-1 inputs, then per head the gated delta rule on a matrix
  S [dk, dv]:  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q.
- Mamba-2 (Nemotron-H): the same convolution over x|B|C, then per head the selective scan on
  h [hd, N]:  h <- exp(dt A) h + dt x B^T;  y = h C + D x.

A step either decodes one token per sequence (``*_step``, batched over the sequences of the step:
their states are stacked, the arithmetic is per element and per row, so a sequence's result does not
depend on who it was batched with) or prefills a segment of one sequence (``*_chunked``: the
recurrence in chunks of ``CHUNK`` tokens, within which it is a few matrix products instead of a
loop over tokens, and across which the state is carried).

``RecurrentState`` holds one sequence's states, layer by layer, with the position they are at and
checkpoints (copies taken at chosen positions) so that a prefix can be reused after the sequence
went on past it: a recurrent state cannot be cut back like a KV cache.

Letters: T = tokens of a segment, B = sequences, H = heads (value heads for DeltaNet), dk/dv = key
and value head sizes, C = conv channels, K = conv kernel, N = SSM state size, hd = Mamba head size.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

__all__ = ["LayerShape", "RecurrentState", "conv_step", "l2norm", "delta_rule_step", "delta_rule_chunked",
           "ssd_step", "ssd_chunked", "softplus", "stacked", "CHUNK"]

CHUNK = 64  # tokens per chunk of a chunked prefill (llama.cpp's chunk size for the delta rule)


@dataclass(frozen=True)
class LayerShape:
    """What one recurrent layer keeps per sequence: conv [C, K-1] and ssm ``ssm`` (float32)."""

    conv_channels: int
    conv_kernel: int
    ssm: tuple[int, ...]  # [H, dk, dv] (DeltaNet) or [H, hd, N] (Mamba-2)

    @property
    def nbytes(self) -> int:
        return 4 * (self.conv_channels * (self.conv_kernel - 1) + int(np.prod(self.ssm)))


class RecurrentState:
    """One sequence's recurrent states, one (conv, ssm) pair per recurrent layer, at position ``n``.

    ``save()`` copies the states as a checkpoint of the current position; ``restore(p)`` goes back
    to a checkpoint (or stays, when p is the current position). At most ``max_checkpoints`` are
    kept, the oldest dropped first."""

    def __init__(self, shapes: dict[int, LayerShape], max_checkpoints: int = 4):
        self.shapes = shapes
        self.conv = {l: np.zeros((s.conv_channels, s.conv_kernel - 1), np.float32) for l, s in shapes.items()}
        self.ssm = {l: np.zeros(s.ssm, np.float32) for l, s in shapes.items()}
        self.n = 0
        self.max_checkpoints = max_checkpoints
        self._checkpoints: OrderedDict[int, tuple[dict, dict]] = OrderedDict()

    @property
    def state_bytes(self) -> int:
        """Bytes of one copy of the states (what a sequence holds besides its KV cache)."""
        return sum(s.nbytes for s in self.shapes.values())

    @property
    def nbytes(self) -> int:
        """The states plus their checkpoints."""
        return self.state_bytes * (1 + len(self._checkpoints))

    @property
    def checkpoints(self) -> list[int]:
        return sorted(self._checkpoints)

    def save(self) -> None:
        if self.n == 0 or self.max_checkpoints <= 0:
            return
        self._checkpoints.pop(self.n, None)
        self._checkpoints[self.n] = ({l: a.copy() for l, a in self.conv.items()},
                                     {l: a.copy() for l, a in self.ssm.items()})
        while len(self._checkpoints) > self.max_checkpoints:
            self._checkpoints.popitem(last=False)

    def reusable(self, n: int) -> int:
        """The largest position <= n this state can be put back to (0: none but the start)."""
        if n >= self.n:
            return self.n
        return max((p for p in self._checkpoints if p <= n), default=0)

    def restore(self, n: int) -> None:
        """Put the states back to position n, which reusable(n) returned."""
        if n == self.n:
            return
        if n == 0:
            for a in (*self.conv.values(), *self.ssm.values()):
                a.fill(0.0)
        else:
            conv, ssm = self._checkpoints[n]
            for l in self.conv:
                self.conv[l][...] = conv[l]
                self.ssm[l][...] = ssm[l]
        self.n = n
        for p in [p for p in self._checkpoints if p > n]:  # the states they came from are gone
            del self._checkpoints[p]


# ---- shared pieces --------------------------------------------------------------------------------
def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(np.float32(0.0), x)


def l2norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) along the last axis (llama.cpp's L2 norm of the DeltaNet q and k)."""
    return x / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) + np.float32(eps))


def conv_step(x: np.ndarray, state: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """Causal depthwise convolution of one sequence's new inputs x [T, C] after the K-1 it saw last
    (state [C, K-1], oldest first, updated in place); w [C, K]. Returns [T, C] (before activation).

    Summed tap by tap from the oldest, as llama.cpp's ssm_conv does."""
    T, K = x.shape[0], w.shape[1]
    xx = np.concatenate([state.T, x], axis=0)  # [K-1+T, C]
    y = xx[0:T] * w[:, 0]
    for i in range(1, K):
        y += xx[i : i + T] * w[:, i]
    if bias is not None:
        y += bias
    state[...] = xx[T:].T
    return y


def stacked(states: list[np.ndarray], step) -> np.ndarray:
    """step(S) on the states of several sequences stacked as one [B, ...] array, updated in place,
    then copied back to each sequence; one sequence's state is updated where it is (a view)."""
    if len(states) == 1:
        return step(states[0][None])
    S = np.stack(states)
    out = step(S)
    for dst, src in zip(states, S):
        dst[...] = src
    return out


def _chunks(T: int) -> tuple[int, int]:
    """(chunk size, number of chunks) for a segment of T tokens."""
    c = min(CHUNK, T)
    return c, -(-T // c)


# ---- Gated DeltaNet -------------------------------------------------------------------------------
def delta_rule_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                    S: np.ndarray) -> np.ndarray:
    """One token for each of B sequences: q, k [B, H, dk] (q already scaled), v [B, H, dv], g, beta
    [B, H]; S [B, H, dk, dv] updated in place. Returns o [B, H, dv]."""
    S *= np.exp(g)[..., None, None]
    kv = np.matmul(k[..., None, :], S)[..., 0, :]  # [B, H, dv] = S^T k
    d = (v - kv) * beta[..., None]
    S += k[..., :, None] * d[..., None, :]
    return np.matmul(q[..., None, :], S)[..., 0, :]


def delta_rule_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                       S: np.ndarray) -> np.ndarray:
    """T tokens of one sequence: q, k [T, H, dk] (q already scaled), v [T, H, dv], g, beta [T, H];
    S [H, dk, dv] updated in place. Returns o [T, H, dv].

    Within a chunk of c tokens with cumulative log decay G (G_i = g_1 + ... + g_i), the state each
    token sees is the chunk's starting state decayed, plus the chunk's own earlier updates; the
    updates u_i = beta_i (v_i - S_{i-1}^T k_i) depend on each other through a unit lower-triangular
    system (I + L) U = beta V - diag(beta e^G) K S0, L_ij = beta_i e^{G_i - G_j} k_i . k_j (j < i),
    solved once per chunk for all heads; then o = e^G Q S0 + (Q K^T . decay, causal) U and
    S = e^{G_c} S0 + (K e^{G_c - G})^T U."""
    T, H, dk = q.shape
    dv = v.shape[-1]
    c, n = _chunks(T)
    pad = c * n - T

    def heads_first(a, fill=0.0):  # [T, H, ...] -> [H, n, c, ...], zero-padded (no-op tokens)
        if pad:
            a = np.concatenate([a, np.full((pad,) + a.shape[1:], fill, a.dtype)], axis=0)
        return np.ascontiguousarray(np.moveaxis(a.reshape((n, c) + a.shape[1:]), 2, 0))

    Q, Kh, V = heads_first(q), heads_first(k), heads_first(v)  # [H, n, c, d]
    Gc = np.cumsum(heads_first(g), axis=-1)  # [H, n, c]
    Bt = heads_first(beta)  # [H, n, c]
    causal = np.tril(np.ones((c, c), bool))
    decay = np.where(causal, np.exp(np.where(causal, Gc[..., :, None] - Gc[..., None, :], 0.0)), 0.0)  # [H, n, c, c]
    kk = np.matmul(Kh, np.swapaxes(Kh, -1, -2))  # [H, n, c, c]
    L = np.where(np.tril(np.ones((c, c), bool), -1), kk * decay * Bt[..., :, None], 0.0)
    A = L + np.eye(c, dtype=np.float32)
    eG = np.exp(Gc)  # [H, n, c]
    rhs = np.concatenate([V * Bt[..., None], Kh * (Bt * eG)[..., None]], axis=-1)  # [H, n, c, dv + dk]
    sol = np.linalg.solve(A, rhs).astype(np.float32)
    Uv, Wk = sol[..., :dv], sol[..., dv:]  # U = Uv - Wk S0 per chunk
    qk = np.matmul(Q, np.swapaxes(Kh, -1, -2)) * decay  # [H, n, c, c], causal incl. the diagonal
    Qd = Q * eG[..., None]
    tail = np.exp(Gc[..., -1:] - Gc)[..., None] * Kh  # [H, n, c, dk]
    last = np.exp(Gc[..., -1])  # [H, n]
    out = np.empty((H, n, c, dv), np.float32)
    for i in range(n):
        U = Uv[:, i] - np.matmul(Wk[:, i], S)  # [H, c, dv]
        out[:, i] = np.matmul(Qd[:, i], S) + np.matmul(qk[:, i], U)
        S *= last[:, i, None, None]
        S += np.matmul(np.swapaxes(tail[:, i], -1, -2), U)
    return np.moveaxis(out, 0, 2).reshape(n * c, H, dv)[:T]


# ---- Mamba-2 --------------------------------------------------------------------------------------
def ssd_step(x: np.ndarray, dt: np.ndarray, A: np.ndarray, Bm: np.ndarray, Cm: np.ndarray,
             h: np.ndarray) -> np.ndarray:
    """One token for each of B sequences: x [B, H, hd], dt [B, H] (after softplus), A [H], Bm, Cm
    [B, H, N] (each head's group already picked); h [B, H, hd, N] updated in place. Returns y
    [B, H, hd] without the D skip."""
    h *= np.exp(dt * A)[..., None, None]
    h += (x * dt[..., None])[..., :, None] * Bm[..., None, :]
    return np.matmul(h, Cm[..., :, None])[..., 0]


def ssd_chunked(x: np.ndarray, dt: np.ndarray, A: np.ndarray, Bm: np.ndarray, Cm: np.ndarray,
                h: np.ndarray) -> np.ndarray:
    """T tokens of one sequence: x [T, H, hd], dt [T, H], A [H], Bm, Cm [T, H, N]; h [H, hd, N]
    updated in place. Returns y [T, H, hd] without the D skip.

    Within a chunk with cumulative log decay G (G_i = sum of dt A up to i):
    y_i = e^{G_i} h0 C_i + sum_{j<=i} e^{G_i - G_j} (C_i . B_j) dt_j x_j, and the chunk leaves
    h = e^{G_c} h0 + sum_j e^{G_c - G_j} dt_j x_j B_j^T."""
    T, H, hd = x.shape
    c, n = _chunks(T)
    pad = c * n - T

    def heads_first(a):
        if pad:
            a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)], axis=0)
        return np.ascontiguousarray(np.moveaxis(a.reshape((n, c) + a.shape[1:]), 2, 0))

    X, Dt, Bh, Ch = heads_first(x), heads_first(dt), heads_first(Bm), heads_first(Cm)  # [H, n, c, .]
    Gc = np.cumsum(Dt * A[:, None, None], axis=-1)  # [H, n, c]
    causal = np.tril(np.ones((c, c), bool))
    decay = np.where(causal, np.exp(np.where(causal, Gc[..., :, None] - Gc[..., None, :], 0.0)), 0.0)
    M = np.matmul(Ch, np.swapaxes(Bh, -1, -2)) * decay * Dt[..., None, :]  # [H, n, c, c]
    Xd = X * Dt[..., None]  # [H, n, c, hd]
    intra = np.matmul(M, X)  # [H, n, c, hd]
    eG = np.exp(Gc)[..., None]  # [H, n, c, 1]
    tail = np.exp(Gc[..., -1:] - Gc)[..., None] * Xd  # [H, n, c, hd]
    last = np.exp(Gc[..., -1])  # [H, n]
    out = np.empty((H, n, c, hd), np.float32)
    for i in range(n):
        out[:, i] = intra[:, i] + eG[:, i] * np.matmul(Ch[:, i], np.swapaxes(h, -1, -2))  # [H, c, hd]
        h *= last[:, i, None, None]
        h += np.matmul(np.swapaxes(tail[:, i], -1, -2), Bh[:, i])  # [H, hd, N]
    return np.moveaxis(out, 0, 2).reshape(n * c, H, hd)[:T]
