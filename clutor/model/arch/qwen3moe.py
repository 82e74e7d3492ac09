"""Qwen3-MoE: QK-norm per head (weights of size head_dim) after the head split, before RoPE;
head_dim may differ from n_embd / n_head; softmax top-k router weights ARE renormalised; `output`
may be absent (tied to token_embd)."""
from __future__ import annotations

from ..layers import gate, rmsnorm
from .common import Arch, T, read_common


class Qwen3MoE(Arch):
    name = "qwen3moe"

    @classmethod
    def read(cls, f) -> "Qwen3MoE":
        return cls(f.path, read_common(f, ff_key="expert_feed_forward_length", ff_from_dense=True))

    def attention_tensors(self, l):
        b, hd = f"blk.{l}.", self.cfg.head_dim
        return super().attention_tensors(l) | {"q_norm": T(b + "attn_q_norm.weight", (hd,), "vector"),
                                               "k_norm": T(b + "attn_k_norm.weight", (hd,), "vector")}

    def qkv(self, lw, h):
        q, k, v = super().qkv(lw, h)
        return rmsnorm(q, lw.q_norm, self.cfg.eps), rmsnorm(k, lw.k_norm, self.cfg.eps), v  # per head

    def route(self, lw, h):
        return gate(h, lw.router, self.cfg.n_expert_used, norm=True)

    def gating(self):
        return "softmax, top-k, renormalised"
