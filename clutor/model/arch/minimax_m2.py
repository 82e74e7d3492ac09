"""MiniMax-M2 / M2.1 / M2.5 (`minimax-m2`), as llama.cpp's src/models/minimax-m2.cpp computes it.

- Attention: GQA with RMS q/k norms over the whole q and k vectors (weights of n_head x head_dim and
  n_head_kv x head_dim, before the head split), then NEOX RoPE on the first `rope.dimension_count`
  dims of each head (half of it in the real model: 64 of 128); q width n_head x head_dim need not be
  n_embd. Value heads must be as wide as key heads (llama.cpp asserts it).
- Every layer is MoE: SwiGLU experts, no shared expert, no dense layer. The router turns its logits
  into probabilities by `expert_gating_func` (the converter writes 2, sigmoid, from the checkpoint's
  scoring_func); the per-expert bias `exp_probs_b` decides which experts are chosen, not their
  weights, and the chosen weights are always renormalised (hard-coded in llama.cpp, no key), never
  scaled (llama.cpp does not read expert_weights_scale for this architecture).
- Expert tensors are sized by `feed_forward_length`, which llama.cpp uses for their shapes;
  `expert_feed_forward_length` must be present (llama.cpp requires it) but shapes nothing.
- `output` is always its own matrix (llama.cpp requires it: no tied head).
The converter writes no multi-token-prediction layers for it (the checkpoint's MTP modules are dropped).
"""
from __future__ import annotations

from ...errors import ModelFileError, UnsupportedError
from ..config import MAX_DIM
from ..layers import gate, rmsnorm
from .common import Arch, T, read_common, read_layer_int

GATING = {1: "softmax", 2: "sigmoid"}


class MiniMaxM2(Arch):
    name = "minimax-m2"

    def __init__(self, path, cfg, *, func: str):
        super().__init__(path, cfg)
        self.func = func

    @classmethod
    def read(cls, f) -> "MiniMaxM2":
        key = f"{f.arch}.expert_gating_func"
        func = f.get(key, None)
        if func is None:  # llama.cpp reads it as optional, then aborts building the MoE graph without it
            raise ModelFileError(f.path, key, "1 (softmax) or 2 (sigmoid)", "absent")
        if func not in GATING:
            raise UnsupportedError(f.path, key, "1 (softmax) or 2 (sigmoid)", repr(func))
        read_layer_int(f, "expert_feed_forward_length", 1, MAX_DIM)  # required by llama.cpp, shapes nothing
        cfg = read_common(f, ff_key="feed_forward_length")
        if cfg.head_dim_v != cfg.head_dim:
            raise ModelFileError(f.path, f"{f.arch}.attention.value_length",
                                 f"attention.key_length ({cfg.head_dim})", cfg.head_dim_v)
        return cls(f.path, cfg, func=GATING[func])

    def global_tensors(self):
        if self.cfg.tied_output:
            raise ModelFileError(self.path, "tensor output.weight", "present (minimax-m2 never ties it)", "absent")
        return super().global_tensors()

    def attention_tensors(self, l):
        cfg, b = self.cfg, f"blk.{l}."
        return super().attention_tensors(l) | {
            "q_norm": T(b + "attn_q_norm.weight", (cfg.n_head * cfg.head_dim,), "vector"),
            "k_norm": T(b + "attn_k_norm.weight", (cfg.n_head_kv * cfg.head_dim,), "vector")}

    def ffn_tensors(self, l):
        return super().ffn_tensors(l) | {"probs_b": T(f"blk.{l}.exp_probs_b.bias", (self.cfg.n_expert,), "vector")}

    def qkv(self, lw, h):
        cfg, R = self.cfg, h.shape[0]
        q, k, v = super().qkv(lw, h)  # [R, H, hd], [R, Hkv, hd], [R, Hkv, hd]
        q = rmsnorm(q.reshape(R, -1), lw.q_norm, cfg.eps).reshape(q.shape)  # over the whole vector
        k = rmsnorm(k.reshape(R, -1), lw.k_norm, cfg.eps).reshape(k.shape)
        return q, k, v

    def route(self, lw, h):
        return gate(h, lw.router, self.cfg.n_expert_used, func=self.func, bias=lw.probs_b, norm=True)

    def gating(self):
        return f"{self.func} + selection bias, top-k, renormalised"
