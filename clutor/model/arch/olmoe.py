"""OLMoE: QK-norm over the whole q and k vectors (before the head split and RoPE); no biases;
softmax top-k router weights NOT renormalised; the per-expert hidden size is in
`feed_forward_length` (newer converters also write `expert_feed_forward_length`, which wins)."""
from __future__ import annotations

from ..layers import rmsnorm
from .common import Arch, T, read_common


class OLMoE(Arch):
    name = "olmoe"

    @classmethod
    def read(cls, f) -> "OLMoE":
        key = "expert_feed_forward_length" if f"{f.arch}.expert_feed_forward_length" in f.metadata else "feed_forward_length"
        return cls(f.path, read_common(f, ff_key=key))

    def attention_tensors(self, l):
        cfg, b = self.cfg, f"blk.{l}."
        return super().attention_tensors(l) | {
            "q_norm": T(b + "attn_q_norm.weight", (cfg.n_head * cfg.head_dim,), "vector"),
            "k_norm": T(b + "attn_k_norm.weight", (cfg.n_head_kv * cfg.head_dim,), "vector")}

    def qkv_rows(self, lw, h):
        cfg = self.cfg
        q, k, v = super().qkv_rows(lw, h)  # [R, H*hd], [R, Hkv*hd], [R, Hkv*hdv]
        # over the whole vectors, before the head split
        return rmsnorm(q, lw.q_norm, cfg.eps), rmsnorm(k, lw.k_norm, cfg.eps), v
