"""GLM-5 / GLM-5.1 / GLM-5.2 (`glm-dsa`): DeepSeek's MLA (deepseek2.py) with DeepSeek's sparse attention:
a "lightning indexer" per layer chooses the top_k earlier keys each query attends; MLA attends those only.

Attention of layer l, residual x [R, D], h = rmsnorm(x):
- MLA as DeepSeek-V3 (q through the normalised low-rank qr = rmsnorm(W_qa h), attn_k_b / attn_v_b
  per head, the latent cache of (c, k_pe) per position; NORM RoPE; scores scaled by 1 / sqrt(nope + r)).
- The indexer (a layer whose attention.indexer.types entry is true, "full"): Hi heads of Di.
  q_i = W_iqb qr [R, Hi, Di], k_i = LayerNorm(W_ik h) [R, Di] (weight and bias; eps 0, as llama.cpp
  reads no layer-norm epsilon for this architecture), both NORM-RoPE'd over their first r dims
  ([rope | nope], the same rotation as MLA's), then both rotated by the orthonormal Walsh-Hadamard
  matrix of size Di (llama.cpp rotates them so for quantised caches; a no-op for the scores up to
  rounding). Weights w = W_iproj h / sqrt(Di Hi) [R, Hi]. Key j's score for the query at p:
  sum_h relu(q_i[h] . k_i[j]) w[h] over the causal keys j <= p; the top_k scores win (ties as llama.cpp's
  CPU breaks them: kernels/dsa.py), and MLA attends only those (all of them while p < top_k).
- The indexer's keys are cached too: they ride in the layer's latent row, [c | k_pe | k_i], so they
  share its pages, KV type and prefix reuse (Di values per position and indexer layer).
- A "shared" layer (false in attention.indexer.types: GLM-5.2) has no indexer and no indexer keys: it
  attends the keys the previous full layer chose. Without that key, files of context_length < 2^20
  (GLM-5, 5.1) have an indexer in every layer, longer ones GLM-5.2's pattern, as llama.cpp decides.

FFN: as DeepSeek-V3: leading dense layers, then routed experts + shared expert; sigmoid gating (an
absent expert_gating_func means sigmoid here), the selection bias exp_probs_b, renormalised, scaled.
MTP (nextn) layers at the end of the file are not computed (a file carrying them loads).
"""
from __future__ import annotations

import numpy as np

from ...errors import ModelFileError, UnsupportedError
from ..config import MAX_DIM
from ..kernels.dsa import index_topk, warmup as dsa_warmup
from ..layers import rmsnorm
from ..quants import apply_all, matmul_heads
from ..state import LatentKV
from .common import _MISSING, T, read_bool, read_common, read_float, read_int, read_layer_int
from .deepseek2 import GATING, DeepSeek2, routing_groups

# llama.cpp's indexer pattern for files of context_length >= 2^20 without attention.indexer.types
# (GLM-5.2's config.json): full in layers 0, 1 and every 4th from 2, shared in between
GLM_5_2_INDEXER_TYPES = (True, True) + (True, False, False, False) * 19
LONG_CONTEXT = 1 << 20


class GlmDsa(DeepSeek2):
    name = "glm-dsa"
    attention_kind = "MLA + DSA"
    rope_scaling = ()

    def __init__(self, path, cfg, *, idx_heads: int, idx_dim: int, top_k: int, full: tuple[bool, ...], **mla):
        super().__init__(path, cfg, **mla)
        self.idx_heads, self.idx_dim, self.top_k, self.full = idx_heads, idx_dim, top_k, full
        self.hadamard = hadamard(idx_dim)  # [Di, Di] float32, symmetric, H @ H = I
        self.w_scale_idx = np.float32(1.0) / np.sqrt(np.float32(idx_dim * idx_heads))

    @classmethod
    def read(cls, f) -> "GlmDsa":
        a = f.arch
        n_all = read_int(f, "block_count", 1, 4096)
        n_nextn = read_int(f, "nextn_predict_layers", 0, n_all - 1, default=0)
        n_layers = n_all - n_nextn
        q_lora = read_int(f, "attention.q_lora_rank", 1, MAX_DIM)
        kv_lora = read_int(f, "attention.kv_lora_rank", 1, MAX_DIM)
        for key in ("attention.key_length_mla", "attention.value_length_mla"):
            if f"{a}.{key}" not in f.metadata:  # llama.cpp: "GLM_DSA architecture requires MLA"
                raise ModelFileError(f.path, f"{a}.{key}", "present (glm-dsa files are MLA: attn_k_b / attn_v_b)", "absent")
        hk = read_int(f, "attention.key_length_mla", 2, MAX_DIM)
        hv = read_int(f, "attention.value_length_mla", 1, MAX_DIM)
        k_len = read_int(f, "attention.key_length", 2, MAX_DIM, default=hk)
        n_rot = read_int(f, "rope.dimension_count", 2, MAX_DIM, default=k_len)
        if n_rot >= hk:
            raise ModelFileError(f.path, f"{a}.rope.dimension_count", f"an integer below the head's key size {hk} "
                                 "(RoPE part + non-RoPE part)", n_rot)
        idx_heads = read_int(f, "attention.indexer.head_count", 1, 4096)
        idx_dim = read_int(f, "attention.indexer.key_length", 1, MAX_DIM)
        if idx_dim < 64 or idx_dim & (idx_dim - 1) or idx_dim < n_rot:
            # llama.cpp rotates the indexer's q and k by one Hadamard matrix of the head's size (a power of
            # two from 64) and RoPEs their first rope.dimension_count dims
            raise UnsupportedError(f.path, f"{a}.attention.indexer.key_length",
                                   f"a power of two >= 64 and >= rope.dimension_count {n_rot}", idx_dim)
        top_k = read_int(f, "attention.indexer.top_k", 1, 1 << 24)
        n_ctx = read_int(f, "context_length", 1, 1 << 30)
        key = f"{a}.attention.indexer.types"
        if key in f.metadata:
            types = f.metadata[key]
            if not isinstance(types, (list, tuple)) or len(types) < n_layers or not all(
                    isinstance(t, (bool, int)) and t in (0, 1) for t in types):
                raise ModelFileError(f.path, key, f"an array of {n_layers} booleans (one per layer: true = own "
                                     "indexer)", repr(types)[:80])
            full = tuple(bool(t) for t in types[:n_layers])
        elif n_ctx < LONG_CONTEXT:
            full = (True,) * n_layers
        else:
            full = (GLM_5_2_INDEXER_TYPES + (False,) * n_layers)[:n_layers]
        if not full[0]:
            raise ModelFileError(f.path, key, "true for layer 0 (a shared layer reuses an earlier full layer's "
                                 "selection)", "false")
        n_dense = read_int(f, "leading_dense_block_count", 0, n_layers - 1, default=0)
        n_ff_exp = read_int(f, "expert_feed_forward_length", 1, MAX_DIM)
        n_shared = read_int(f, "expert_shared_count", 0, 64)
        func = read_int(f, "expert_gating_func", 0, 4, default=0) or 2  # absent / none -> sigmoid, as llama.cpp
        groups = routing_groups(f, a, func)
        n_full = sum(full)
        cfg = read_common(f, ff_key="expert_feed_forward_length", n_layers=n_layers, n_dense_lead=n_dense,
                          n_ff_shexp=n_ff_exp * n_shared,
                          n_ff=read_layer_int(f, "feed_forward_length", 1, MAX_DIM) if n_dense else 0,
                          head_dim=hk, head_dim_v=hv, n_head_kv=1,
                          kv_floats=kv_lora + n_rot + -(-idx_dim * n_full // n_layers))
        arch = cls(f.path, cfg, q_lora=q_lora, kv_lora=kv_lora, split=True, n_nextn=n_nextn, func=GATING[func],
                   norm_w=read_bool(f, "expert_weights_norm", False),
                   w_scale=read_float(f, "expert_weights_scale", 0.0, positive=False), groups=groups, yarn=None,
                   kq_scale=float(1.0 / np.sqrt(hk)), idx_heads=idx_heads, idx_dim=idx_dim, top_k=top_k, full=full)
        arch.has_bias = f"blk.{n_dense}.exp_probs_b.bias" in f.tensors
        return arch

    # -- tensors ----------------------------------------------------------------------------------
    def attention_tensors(self, l):
        want = super().attention_tensors(l)  # MLA with attn_k_b / attn_v_b and q through attn_q_a / attn_q_b
        own = l >= self.cfg.n_layers or self.full[l]  # MTP layers: listed (optional), never read
        if own:
            b, D, Hi, Di = f"blk.{l}.indexer.", self.cfg.n_embd, self.idx_heads, self.idx_dim
            req = l < self.cfg.n_layers
            # llama.cpp marks them optional, then multiplies by the three matrices (a file without them
            # stops its graph): Clutor requires those; an absent k_norm weight or bias is skipped, as there
            want |= {"idx_q_b": T(b + "attn_q_b.weight", (Hi * Di, self.q_lora), "weight", req),
                     "idx_k": T(b + "attn_k.weight", (Di, D), "weight", req),
                     "idx_proj": T(b + "proj.weight", (Hi, D), "weight", req),
                     "idx_k_norm": T(b + "k_norm.weight", (Di,), "vector", False),
                     "idx_k_norm_b": T(b + "k_norm.bias", (Di,), "vector", False)}
        return want

    # -- compute ------------------------------------------------------------------------------------
    def warmup(self):
        dsa_warmup()

    def layer_states(self):
        # per position: the latent, the shared rope key, and (indexer layers) the indexer's key
        C, r = self.kv_lora, self.cfg.n_rot
        return [LatentKV(C + r + (self.idx_dim if full else 0), C) for full in self.full]

    def layer_kind(self, l):
        return "sparse attention" if self.full[l] else "sparse attention (shared top-k)"

    def attention(self, lw, l, x, step, rope):
        cfg, R = self.cfg, x.shape[0]
        H, C, nope, r = cfg.n_head, self.kv_lora, self.nope, cfg.n_rot
        h = rmsnorm(x, lw.attn_norm, cfg.eps)  # [R, D]
        qa, kv = apply_all((lw.wq_a, lw.wkv_a), h)  # [R, Lq], [R, C + r]
        qr = rmsnorm(qa, lw.q_a_norm, cfg.eps)  # [R, Lq]
        q = lw.wq_b(qr).reshape(R, H, cfg.head_dim)  # [R, H, nope + r]
        c = rmsnorm(kv[:, :C], lw.kv_a_norm, cfg.eps)  # [R, C]
        q_lat = matmul_heads(lw.wk_b, q[..., :nope])  # [R, H, C]: q_nope absorbed into latent space
        q_pe = step.rope(rope, np.ascontiguousarray(q[..., nope:]))  # [R, H, r]
        k_pe = step.rope(rope, kv[:, None, C:])  # [R, 1, r]
        row = [c[:, None, :], k_pe]
        if self.full[l]:
            iq, ik, iw = self._indexer(lw, h, qr, step, rope)
            row.append(ik[:, None, :])
            w0 = C + r

            def select(seg, K):
                keys = np.ascontiguousarray(K[0, :, w0:])  # [N, Di]: this sequence's indexer keys
                sel = step.carry[("dsa", id(seg))] = index_topk(iq[seg.rows], keys, iw[seg.rows], seg.p0, self.top_k)
                return sel
        else:
            def select(seg, K):
                return step.carry[("dsa", id(seg))]  # the previous full layer's choice
        o_lat = step.attend(l, np.concatenate([q_lat, q_pe], axis=-1), np.concatenate(row, axis=-1), None,
                            self.kq_scale, select=select).reshape(R, H, C)  # [R, H, C]
        o = matmul_heads(lw.wv_b, o_lat)  # [R, H, v]
        return lw.wo(o.reshape(R, -1))

    def _indexer(self, lw, h, qr, step, rope):
        """The indexer's queries [R, Hi, Di] and keys [R, Di] (RoPE'd, Hadamard-rotated) and its per-head
        weights [R, Hi] (scaled by 1 / sqrt(Di Hi))."""
        R, Hi, Di, r = h.shape[0], self.idx_heads, self.idx_dim, self.cfg.n_rot
        q = lw.idx_q_b(qr).reshape(R, Hi, Di)
        k, w = apply_all((lw.idx_k, lw.idx_proj), h)  # [R, Di], [R, Hi]
        k = layernorm(k, lw.idx_k_norm, lw.idx_k_norm_b)
        q = np.concatenate([step.rope(rope, np.ascontiguousarray(q[..., :r])), q[..., r:]], axis=-1)
        k = np.concatenate([step.rope(rope, np.ascontiguousarray(k[:, None, :r]))[:, 0], k[:, r:]], axis=-1)
        Hm = self.hadamard
        q = (q.reshape(R * Hi, Di) @ Hm).reshape(R, Hi, Di)
        k = k @ Hm
        return q.astype(np.float32), k.astype(np.float32), (w * self.w_scale_idx).astype(np.float32)

    # -- info -----------------------------------------------------------------------------------------
    def describe(self):
        d = super().describe()
        n_full = sum(self.full)
        n = self.cfg.n_layers
        per_pos = self.idx_dim * n_full
        d["attention"] = (f"MLA: latent {self.kv_lora} + rope {self.cfg.n_rot} cached per token, q rank {self.q_lora}; "
                          f"DSA indexer: {self.idx_heads} heads of {self.idx_dim}, each query attends its top "
                          f"{self.top_k} keys; indexer keys {self.idx_dim} values per position in {n_full} of {n} "
                          f"layers ({per_pos} per position in all; {_bytes(2 * per_pos)} as f16, in the KV cache)"
                          + (f"; {n - n_full} {'reuses' if n - n_full == 1 else 'reuse'} the previous selection"
                             if n_full < n else ""))
        d["indexer"] = {"heads": self.idx_heads, "key_length": self.idx_dim, "top_k": self.top_k,
                        "full_layers": n_full, "shared_layers": n - n_full,
                        "kv_values_per_position": self.idx_dim * n_full}
        return d


def _bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.2f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


def layernorm(x: np.ndarray, w: np.ndarray | None, b: np.ndarray | None) -> np.ndarray:
    """ggml_norm with eps 0 along the last axis (mean and variance in float64, the result float32),
    then the optional weight and bias."""
    x64 = x.astype(np.float64)
    d = x64 - x64.mean(axis=-1, keepdims=True)
    y = (d / np.sqrt(np.mean(d * d, axis=-1, keepdims=True))).astype(np.float32)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix [n, n] (Sylvester's order, entries +-1/sqrt(n)), float32."""
    m = np.full((1, 1), 1.0 / np.sqrt(np.float32(n)), np.float32)
    while m.shape[0] < n:
        m = np.block([[m, m], [m, -m]])
    return m.astype(np.float32)
