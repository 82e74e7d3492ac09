"""Qwen3-Next / Qwen3-Coder-Next (`qwen3next`): Gated DeltaNet layers with gated full attention
every `full_attention_interval`-th layer, routed experts plus a sigmoid-gated shared expert in every
layer. Qwen3.5 / Qwen3.6 (`qwen35moe`, the subclass in .qwen35moe) differ in three details only.

- Which layers are recurrent: `attention.recurrent_layers` (booleans) or else layer i is Gated
  DeltaNet iff (i + 1) % full_attention_interval != 0 (default 4). `nextn_predict_layers` MTP
  layers at the end of `block_count` are not part of the forward pass: not read, not computed.
- Full-attention layers: `attn_q` rows per head are [q | gate]; per-head RMS q/k norms; RoPE
  (NEOX) on the first `rope.dimension_count` dims of each head; the attention output times
  sigmoid(gate) goes through `attn_output`. Their KV caches are the model's only ones.
- Gated DeltaNet layers (`ssm.*` keys: conv_kernel K, state_size = the head size of q, k and v,
  group_count = k heads, time_step_rank = v heads, inner_size = v heads x head size): `attn_qkv`
  gives q | k | v, `attn_gate` z; a causal depthwise conv (`ssm_conv1d`, no bias) then silu over
  the q|k|v channels; q and k L2-normalised per head, q scaled by 1/sqrt(head size);
  beta = sigmoid(b), g = `ssm_a` * softplus(a + `ssm_dt.bias`) with b, a from the fused `ssm_ba`
  ([b | a] per k-head group); the gated delta rule (clutor.model.recurrent) per v head, v head h
  using k head h // (v heads / k heads); out = rms_norm(o) * `ssm_norm` * silu(z), then `ssm_out`.
- FFN: `post_attention_norm`, softmax top-k always renormalised, a shared expert scaled by
  sigmoid(`ffn_gate_inp_shexp` . h).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...errors import ClutorError, ModelFileError, UnsupportedError
from ..config import MAX_DIM
from ..layers import Rope, gate, rmsnorm, sigmoid, silu
from ..state import FullKV, Recurrent
from ..quants import apply_all
from ..recurrent import (LayerShape, RecurrentState, conv_step, delta_rule_chunked, delta_rule_step, l2norm,
                         softplus, stacked)
from .common import Arch, T, read_common, read_int, refuse_tensor
from .qwen2moe import Qwen2MoE


def read_per_layer_int(f, key: str, n: int, lo: int, hi: int) -> int:
    """A key llama.cpp reads as "a number or an array": one value for every layer."""
    full = f"{f.arch}.{key}"
    v = f.get(full)
    if isinstance(v, list):
        if len(v) < n or len(set(v[:n])) != 1:
            raise UnsupportedError(f.path, full, "one value for all layers", repr(v[:8]))
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ModelFileError(f.path, full, f"an integer in [{lo}, {hi}]", repr(v))
    return v


class Qwen3Next(Qwen2MoE):
    name = "qwen3next"
    ffn_norm_name = "post_attention_norm"
    attention_kind = "gated GQA + Gated DeltaNet"
    grouped_v_heads = True  # v head h uses k head h // (Hv / Hk); qwen35moe tiles them: h % Hk

    def __init__(self, path, cfg, *, recurrent: tuple[bool, ...], n_nextn: int, conv_kernel: int, head: int,
                 n_k: int, n_v: int):
        super().__init__(path, cfg)
        self.recurrent, self.n_nextn = recurrent, n_nextn
        self.conv_kernel, self.head, self.n_k, self.n_v = conv_kernel, head, n_k, n_v
        ratio = n_v // n_k
        self.k_of_v = (np.arange(n_v) // ratio if self.grouped_v_heads else np.arange(n_v) % n_k)  # [Hv]

    @classmethod
    def read(cls, f) -> "Qwen3Next":
        a = f.arch
        n_all = read_int(f, "block_count", 1, 4096)
        n_nextn = read_int(f, "nextn_predict_layers", 0, n_all - 1, default=0)
        n_layers = n_all - n_nextn
        K = read_int(f, "ssm.conv_kernel", 2, 64)
        head = read_int(f, "ssm.state_size", 1, 4096)
        n_k = read_int(f, "ssm.group_count", 1, 4096)
        n_v = read_int(f, "ssm.time_step_rank", 1, 4096)
        inner = read_int(f, "ssm.inner_size", 1, MAX_DIM)
        if n_v % n_k:
            raise ModelFileError(f.path, f"{a}.ssm.time_step_rank", f"a multiple of ssm.group_count {n_k}", n_v)
        if inner != n_v * head:
            raise ModelFileError(f.path, f"{a}.ssm.inner_size", f"time_step_rank x state_size = {n_v * head}", inner)
        pattern = f.get(f"{a}.attention.recurrent_layers", None)
        if pattern is not None:
            if not isinstance(pattern, list) or len(pattern) < n_layers or not all(isinstance(p, bool) for p in pattern):
                raise ModelFileError(f.path, f"{a}.attention.recurrent_layers", f"{n_all} booleans", repr(pattern)[:80])
            recurrent = tuple(pattern[:n_layers])
        else:
            every = read_int(f, "full_attention_interval", 1, 4096, default=4)
            recurrent = tuple((l + 1) % every != 0 for l in range(n_layers))
        n_ff_exp = read_per_layer_int(f, "expert_feed_forward_length", n_layers, 1, MAX_DIM)
        cfg = read_common(f, ff_key="expert_feed_forward_length", n_layers=n_layers,
                          n_ff_shexp=read_int(f, "expert_shared_feed_forward_length", 1, MAX_DIM, default=n_ff_exp))
        if cfg.n_ff_exp != n_ff_exp:
            raise ModelFileError(f.path, f"{a}.expert_feed_forward_length", "one value for all layers", cfg.n_ff_exp)
        if cfg.head_dim != cfg.head_dim_v:
            raise ModelFileError(f.path, f"{a}.attention.value_length", f"key_length {cfg.head_dim}", cfg.head_dim_v)
        attn = tuple(l for l in range(n_layers) if not recurrent[l])
        C = 2 * n_k * head + n_v * head
        shape = LayerShape(C, K, (n_v, head, head))
        cfg = replace(cfg, kv_layers=attn, recurrent_bytes=shape.nbytes * (n_layers - len(attn)))
        return cls(f.path, cfg, recurrent=recurrent, n_nextn=n_nextn, conv_kernel=K, head=head, n_k=n_k, n_v=n_v)

    # -- tensors ----------------------------------------------------------------------------------
    def attention_tensors(self, l):
        cfg, b = self.cfg, f"blk.{l}."
        D, H, hd = cfg.n_embd, cfg.n_head, cfg.head_dim
        want = {"attn_norm": T(b + "attn_norm.weight", (D,), "vector")}
        if not self.recurrent[l]:
            kd = cfg.n_head_kv * hd
            return want | {
                "wq": T(b + "attn_q.weight", (2 * H * hd, D)),  # per head: q rows, then its gate rows
                "wk": T(b + "attn_k.weight", (kd, D)), "wv": T(b + "attn_v.weight", (kd, D)),
                "wo": T(b + "attn_output.weight", (D, H * hd)),
                "q_norm": T(b + "attn_q_norm.weight", (hd,), "vector"),
                "k_norm": T(b + "attn_k_norm.weight", (hd,), "vector")}
        kd, vd = self.n_k * self.head, self.n_v * self.head
        return want | {
            "wqkv": T(b + "attn_qkv.weight", (2 * kd + vd, D)), "wz": T(b + "attn_gate.weight", (vd, D)),
            "conv": T(b + "ssm_conv1d.weight", (2 * kd + vd, self.conv_kernel), "vector"),
            "dt_b": T(b + "ssm_dt.bias", (self.n_v,), "vector"), "ssm_a": T(b + "ssm_a", (self.n_v,), "vector"),
            "ssm_norm": T(b + "ssm_norm.weight", (self.head,), "vector"),
            "ssm_out": T(b + "ssm_out.weight", (D, vd))} | self.beta_alpha_tensors(l)

    def beta_alpha_tensors(self, l):
        return {"wba": T(f"blk.{l}.ssm_ba.weight", (2 * self.n_v, self.cfg.n_embd))}

    def check_file(self, f):
        for l in range(self.cfg.n_layers):
            if self.recurrent[l]:
                refuse_tensor(f, f"blk.{l}.ssm_in.weight", "attn_qkv + attn_gate (this is the older fused ssm_in "
                              "layout: convert the model again with llama.cpp's convert_hf_to_gguf.py)")
            else:
                refuse_tensor(f, f"blk.{l}.attn_qkv.weight", "separate attn_q, attn_k, attn_v in full-attention layers")

    # -- compute ----------------------------------------------------------------------------------
    def layer_kind(self, l):
        return "linear attention" if self.recurrent[l] else "attention"

    def layer_states(self):
        """Gated DeltaNet layers their conv + delta-rule states, the full-attention layers keys and values."""
        cfg = self.cfg
        C = 2 * self.n_k * self.head + self.n_v * self.head
        shape = LayerShape(C, self.conv_kernel, (self.n_v, self.head, self.head))
        kv = FullKV(cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v)
        return [Recurrent(shape) if r else kv for r in self.recurrent]

    def attention(self, lw, l, x, step, rope):
        if self.recurrent[l]:
            return self.linear_attention(lw, l, x, step)
        cfg, R = self.cfg, x.shape[0]
        H, hd = cfg.n_head, cfg.head_dim
        q2, k, v = apply_all((lw.wq, lw.wk, lw.wv), rmsnorm(x, lw.attn_norm, cfg.eps))
        q2 = q2.reshape(R, H, 2 * hd)
        q = rmsnorm(q2[..., :hd], lw.q_norm, cfg.eps)  # [R, H, hd]
        k = rmsnorm(k.reshape(R, cfg.n_head_kv, hd), lw.k_norm, cfg.eps)
        v = v.reshape(R, cfg.n_head_kv, hd)
        o = step.attend(l, step.rope(rope, q), step.rope(rope, k), v, 1.0 / np.sqrt(hd))  # [R, H*hd]
        return lw.wo(o * sigmoid(q2[..., hd:].reshape(R, H * hd)))

    def beta_alpha(self, lw, h):
        """b, a [R, Hv] (before sigmoid / softplus) from the fused ssm_ba: per k head, its group's
        b values then its group's a values."""
        R, r = h.shape[0], self.n_v // self.n_k
        ba = lw.wba(h).reshape(R, self.n_k, 2, r)
        return ba[:, :, 0].reshape(R, self.n_v), ba[:, :, 1].reshape(R, self.n_v)

    def linear_attention(self, lw, l, x, step):
        """One Gated DeltaNet layer over every row of the step; each sequence's conv and delta-rule
        states advance by its own rows."""
        cfg, R = self.cfg, x.shape[0]
        Hk, Hv, hd = self.n_k, self.n_v, self.head
        h = rmsnorm(x, lw.attn_norm, cfg.eps)
        qkv, z = apply_all((lw.wqkv, lw.wz), h)  # [R, C], [R, Hv*hd]
        b, a = self.beta_alpha(lw, h)
        beta = sigmoid(b)  # [R, Hv]
        g = (softplus(a + lw.dt_b) * lw.ssm_a).astype(np.float32)  # [R, Hv] log decay (ssm_a < 0)
        y = np.empty_like(qkv)
        for s in step.segments:
            if s.seq.rs.n != s.p0:
                raise ClutorError(f"recurrent state at position {s.seq.rs.n}, step at {s.p0}")
            rows = slice(s.r0, s.r0 + len(s.ids))
            y[rows] = conv_step(qkv[rows], s.seq.rs.conv[l], lw.conv)
        y = silu(y)
        kd = Hk * hd
        q = l2norm(y[:, :kd].reshape(R, Hk, hd), cfg.eps) * np.float32(1.0 / np.sqrt(hd))
        k = l2norm(y[:, kd : 2 * kd].reshape(R, Hk, hd), cfg.eps)
        q, k = q[:, self.k_of_v], k[:, self.k_of_v]  # [R, Hv, hd]
        v = y[:, 2 * kd :].reshape(R, Hv, hd)
        o = self.delta_rule(l, q, k, v, g, beta, step)  # [R, Hv, hd]
        o = rmsnorm(o, lw.ssm_norm, cfg.eps) * silu(z.reshape(R, Hv, hd))
        return lw.ssm_out(o.reshape(R, Hv * hd))

    @staticmethod
    def delta_rule(l, q, k, v, g, beta, step):
        """The recurrence of layer l for every segment: the one-token segments (decoding sequences)
        together in one batched step, longer ones (prompt chunks) each in chunks."""
        o = np.empty_like(v)
        one = [s for s in step.segments if len(s.ids) == 1]
        if one:
            r = np.array([s.r0 for s in one])
            o[r] = stacked([s.seq.rs.ssm[l] for s in one],  # [B, Hv, hd, hd]
                           lambda S: delta_rule_step(q[r], k[r], v[r], g[r], beta[r], S))
        for s in step.segments:
            if len(s.ids) > 1:
                rows = slice(s.r0, s.r0 + len(s.ids))
                o[rows] = delta_rule_chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], s.seq.rs.ssm[l])
        return o

    def route(self, lw, h):
        return gate(h, lw.router, self.cfg.n_expert_used, norm=True)

    # -- info -------------------------------------------------------------------------------------
    def gating(self):
        return "softmax, top-k, renormalised; shared expert gated by sigmoid"

    def describe(self):
        cfg = self.cfg
        n_lin = sum(self.recurrent)
        return super().describe() | {
            "attention": (f"{cfg.n_layers - n_lin} gated GQA + {n_lin} Gated DeltaNet layers "
                          f"({self.n_k} k / {self.n_v} v heads of {self.head}, conv {self.conv_kernel}, "
                          f"v heads {'grouped' if self.grouped_v_heads else 'tiled'} over k heads)"),
            "mtp_layers_skipped": self.n_nextn}
