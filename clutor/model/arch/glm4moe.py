"""GLM-4.5 / 4.6 / Air (`glm4moe`).

- The first `leading_dense_block_count` layers have a dense SwiGLU FFN (`feed_forward_length`), the
  others routed experts (`expert_feed_forward_length`) plus `expert_shared_count` ungated shared experts.
- Router: sigmoid of the logits; the per-expert bias `exp_probs_b` decides which experts are chosen,
  not their weights; `expert_weights_norm` renormalises, `expert_weights_scale` scales.
- Attention: q/k/v biases, optional per-head q/k RMSNorm, partial NEOX RoPE over the first
  `rope.dimension_count` dims of each head. The norm before the FFN is `post_attention_norm`.
- `block_count` includes the `nextn_predict_layers` multi-token-prediction layers at the end: they
  are not part of the forward pass and are neither read nor computed.
"""
from __future__ import annotations

from ...errors import UnsupportedError
from ..config import MAX_DIM
from ..layers import gate, rmsnorm
from .common import mtp_layer_tensors, Arch, T, read_bool, read_common, read_float, read_int, read_layer_int

GATING = {1: "softmax", 2: "sigmoid"}


class GLM4MoE(Arch):
    name = "glm4moe"
    ffn_norm_name = "post_attention_norm"

    def __init__(self, path, cfg, *, n_nextn: int, func: str, norm_w: bool, w_scale: float):
        super().__init__(path, cfg)
        self.n_nextn, self.func, self.norm_w, self.w_scale = n_nextn, func, norm_w, w_scale

    @classmethod
    def read(cls, f) -> "GLM4MoE":
        if f"{f.arch}.rope.dimension_sections" in f.metadata:
            raise UnsupportedError(f.path, f"{f.arch}.rope.dimension_sections", "absent (M-RoPE is not supported)", "present")
        n_all = read_int(f, "block_count", 2, 4096)
        n_nextn = read_int(f, "nextn_predict_layers", 0, n_all - 1, default=0)
        n_layers = n_all - n_nextn
        n_dense = read_int(f, "leading_dense_block_count", 0, n_layers - 1, default=0)
        n_ff_exp = read_int(f, "expert_feed_forward_length", 1, MAX_DIM)
        n_shared = read_int(f, "expert_shared_count", 0, 64)
        func = read_int(f, "expert_gating_func", 0, 4, default=2) or 2  # absent / none -> sigmoid
        if func not in GATING:
            raise UnsupportedError(f.path, f"{f.arch}.expert_gating_func", "1 (softmax) or 2 (sigmoid)", func)
        groups = read_int(f, "expert_group_count", 0, 4096, default=0)
        if groups > 1:
            raise UnsupportedError(f.path, f"{f.arch}.expert_group_count", "0 or 1 (no grouped routing)", groups)
        cfg = read_common(f, ff_key="expert_feed_forward_length", n_layers=n_layers, n_dense_lead=n_dense,
                          n_ff_shexp=n_ff_exp * n_shared,
                          n_ff=read_layer_int(f, "feed_forward_length", 1, MAX_DIM) if n_dense else 0)
        return cls(f.path, cfg, n_nextn=n_nextn, func=GATING[func],
                   norm_w=read_bool(f, "expert_weights_norm", False),
                   w_scale=read_float(f, "expert_weights_scale", 0.0, positive=False))

    def attention_tensors(self, l):
        b, hd = f"blk.{l}.", self.cfg.head_dim
        return super().attention_tensors(l) | {"q_norm": T(b + "attn_q_norm.weight", (hd,), "vector", False),
                                               "k_norm": T(b + "attn_k_norm.weight", (hd,), "vector", False)}

    def unread_tensors(self):
        n = self.cfg.n_layers
        return [t for l in range(n, n + self.n_nextn) for t in mtp_layer_tensors(self, l)]

    def ffn_tensors(self, l):
        want = super().ffn_tensors(l)
        if l in self.cfg.moe_layers:
            want["probs_b"] = T(f"blk.{l}.exp_probs_b.bias", (self.cfg.n_expert,), "vector")
        return want

    def qkv(self, lw, h):
        q, k, v = super().qkv(lw, h)
        if lw.q_norm is not None:  # per head, before RoPE
            q = rmsnorm(q, lw.q_norm, self.cfg.eps)
        if lw.k_norm is not None:
            k = rmsnorm(k, lw.k_norm, self.cfg.eps)
        return q, k, v

    def route(self, lw, h):
        return gate(h, lw.router, self.cfg.n_expert_used, func=self.func, bias=lw.probs_b, norm=self.norm_w,
                    scale=self.w_scale)

    def gating(self):
        return (f"{self.func} + selection bias, top-k" + (", renormalised" if self.norm_w else "")
                + (f", scaled x{self.w_scale:g}" if self.w_scale not in (0.0, 1.0) else ""))

    def describe(self):
        return super().describe() | {"mtp_layers_skipped": self.n_nextn}
