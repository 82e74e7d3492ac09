"""Ling 2.0 / Ring 2.0 (`bailingmoe2`), as llama.cpp's src/models/bailingmoe2.cpp computes it.

- Attention: one fused `attn_qkv` (rows q | k | v, q as wide as n_embd: llama.cpp shapes it so), no
  biases, a weighted RMS norm of each q and k head, then NEOX RoPE on the first `rope.dimension_count`
  dims of each head (half of it in Ling 2.0), GQA, `attn_output`.
- FFN: the first `leading_dense_block_count` layers a dense SwiGLU of `feed_forward_length`; the
  others routed SwiGLU experts of `expert_feed_forward_length` plus one ungated shared SwiGLU of
  (`expert_shared_feed_forward_length`, or the expert size where that is 0) x `expert_shared_count`
  (llama.cpp's rule; the released files have one shared expert, so both readings agree).
- Router: `expert_gating_func` (required; sigmoid in Ling 2.0) turns the logits into probabilities;
  the optional selection bias `exp_probs_b` decides which experts are chosen, not their weights; with
  `expert_group_count` > 1 only the experts of the `expert_group_used_count` groups with the best sum
  of their top-2 biased scores compete; `expert_weights_norm` renormalises, `expert_weights_scale`
  scales (2.5 in Ling-mini-2.0).
- `output` is its own matrix (llama.cpp requires it).
- `block_count` includes the `nextn_predict_layers` multi-token-prediction layers at the end: a file
  carrying them loads, and they are neither read nor computed.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...errors import ModelFileError, UnsupportedError
from ..config import MAX_DIM
from ..layers import gate, rmsnorm
from .common import Arch, T, read_bool, read_common, read_float, read_int, read_layer_int

GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


class BailingMoE2(Arch):
    name = "bailingmoe2"

    def __init__(self, path, cfg, *, n_nextn: int, func: str, norm_w: bool, w_scale: float,
                 groups: tuple[int, int] | None):
        super().__init__(path, cfg)
        self.n_nextn, self.func, self.norm_w, self.w_scale, self.groups = n_nextn, func, norm_w, w_scale, groups
        self.has_bias = False  # set by read: the file has exp_probs_b

    @classmethod
    def read(cls, f) -> "BailingMoE2":
        a = f.arch
        n_all = read_int(f, "block_count", 1, 4096)
        n_nextn = read_int(f, "nextn_predict_layers", 0, n_all - 1, default=0)
        n_layers = n_all - n_nextn
        lead = read_int(f, "leading_dense_block_count", 0, n_layers - 1, default=0)
        n_ff_exp = read_layer_int(f, "expert_feed_forward_length", 1, MAX_DIM)
        n_shared = read_int(f, "expert_shared_count", 1, 64)  # required; llama.cpp always builds the shared expert
        n_ff_sh = read_int(f, "expert_shared_feed_forward_length", 0, MAX_DIM, default=0) or n_ff_exp
        func = read_int(f, "expert_gating_func", 0, 16)  # required by llama.cpp
        if func not in GATING:
            raise UnsupportedError(f.path, f"{a}.expert_gating_func", "1 (softmax), 2 (sigmoid) or 3 (softmax over "
                                   "the chosen)", func)
        cfg = read_common(f, ff_key="expert_feed_forward_length", n_layers=n_layers, n_dense_lead=lead,
                          n_ff_shexp=n_ff_sh * n_shared,
                          n_ff=read_layer_int(f, "feed_forward_length", 1, MAX_DIM) if lead else 0)
        if cfg.head_dim_v != cfg.head_dim:
            raise ModelFileError(f.path, f"{a}.attention.value_length", f"attention.key_length ({cfg.head_dim})",
                                 cfg.head_dim_v)
        if cfg.n_head * cfg.head_dim != cfg.n_embd:  # attn_qkv's q rows are n_embd in llama.cpp's shapes
            raise ModelFileError(f.path, f"{a}.attention.key_length", f"embedding_length / head_count = "
                                 f"{cfg.n_embd // cfg.n_head} (the fused attn_qkv's q part is n_embd wide)", cfg.head_dim)
        groups = None
        n_group = read_int(f, "expert_group_count", 0, cfg.n_expert - 1, default=0)
        if n_group > 1:
            if cfg.n_expert % n_group:
                raise ModelFileError(f.path, f"{a}.expert_group_count", f"a divisor of expert_count {cfg.n_expert}", n_group)
            groups = (n_group, read_int(f, "expert_group_used_count", 1, n_group - 1))
        arch = cls(f.path, cfg, n_nextn=n_nextn, func=GATING[func], norm_w=read_bool(f, "expert_weights_norm", False),
                   w_scale=read_float(f, "expert_weights_scale", 0.0, positive=False), groups=groups)
        arch.has_bias = f"blk.{lead}.exp_probs_b.bias" in f.tensors
        return arch

    # -- tensors ------------------------------------------------------------------------------------
    def global_tensors(self):
        if self.cfg.tied_output:
            raise ModelFileError(self.path, "tensor output.weight", "present (bailingmoe2 never ties it)", "absent")
        return super().global_tensors()

    def attention_tensors(self, l):
        cfg, b = self.cfg, f"blk.{l}."
        D, hd = cfg.n_embd, cfg.head_dim
        qkv = (cfg.n_head + 2 * cfg.n_head_kv) * hd
        return {"attn_norm": T(b + "attn_norm.weight", (D,), "vector"),
                "wqkv": T(b + "attn_qkv.weight", (qkv, D)),
                "q_norm": T(b + "attn_q_norm.weight", (hd,), "vector"),
                "k_norm": T(b + "attn_k_norm.weight", (hd,), "vector"),
                "wo": T(b + "attn_output.weight", (D, cfg.n_head * hd))}

    def ffn_tensors(self, l):
        want = super().ffn_tensors(l)
        if l in self.cfg.moe_layers:
            want["probs_b"] = T(f"blk.{l}.exp_probs_b.bias", (self.cfg.n_expert,), "vector", False)
        return want

    def unread_tensors(self):
        """The MTP layers as llama.cpp's converter writes them: a MoE layer's tensors, the projection of
        [embedding | hidden] and its norms, the layer's own output norm."""
        n, D = self.cfg.n_layers, self.cfg.n_embd
        saved = self.cfg
        self.cfg = replace(saved, moe_layers=saved.moe_layers + tuple(range(n, n + self.n_nextn)))
        try:
            out = []
            for l in range(n, n + self.n_nextn):
                b = f"blk.{l}."
                out += list(self.layer_tensors(l).values())
                out += [T(b + "nextn.eh_proj.weight", (D, 2 * D)), T(b + "nextn.enorm.weight", (D,), "vector"),
                        T(b + "nextn.hnorm.weight", (D,), "vector"), T(b + "layer_output_norm.weight", (D,), "vector")]
            return out
        finally:
            self.cfg = saved

    # -- compute ------------------------------------------------------------------------------------
    def qkv(self, lw, h):
        cfg, R = self.cfg, h.shape[0]
        H, Hkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qkv = lw.wqkv(h)  # [R, (H + 2 Hkv) hd]
        q = qkv[:, : H * hd].reshape(R, H, hd)
        k = qkv[:, H * hd : (H + Hkv) * hd].reshape(R, Hkv, hd)
        v = np.ascontiguousarray(qkv[:, (H + Hkv) * hd :]).reshape(R, Hkv, hd)
        return rmsnorm(q, lw.q_norm, cfg.eps), rmsnorm(k, lw.k_norm, cfg.eps), v  # norms per head, before RoPE

    def route(self, lw, h):
        return gate(h, lw.router, self.cfg.n_expert_used, func=self.func, bias=lw.probs_b, norm=self.norm_w,
                    scale=self.w_scale, groups=self.groups)

    # -- clutor info --------------------------------------------------------------------------------
    def gating(self):
        parts = [self.func.replace("_", "-") + (" + selection bias" if self.has_bias else "")]
        if self.groups:
            parts.append(f"top {self.groups[1]} of {self.groups[0]} groups")
        parts.append("top-k")
        if self.norm_w:
            parts.append("renormalised")
        if self.w_scale not in (0.0, 1.0):
            parts.append(f"scaled x{self.w_scale:g}")
        return ", ".join(parts)

    def describe(self):
        return super().describe() | {"mtp_layers_skipped": self.n_nextn}
