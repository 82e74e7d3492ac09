"""Qwen1.5-MoE / Qwen2-MoE: biases on q, k, v; a shared expert gated by sigmoid(w . h) added to the
routed mixture; softmax top-k router weights NOT renormalised."""
from __future__ import annotations

import numpy as np

from ..layers import silu
from .common import Arch, T, read_common, read_int
from ..config import MAX_DIM


class Qwen2MoE(Arch):
    name = "qwen2moe"

    @classmethod
    def read(cls, f) -> "Qwen2MoE":
        # llama.cpp's defaults: experts feed_forward_length / expert_used_count, the shared expert
        # feed_forward_length
        shexp = f.get(f"{f.arch}.expert_shared_feed_forward_length", None)
        n_ff_shexp = read_int(f, "expert_shared_feed_forward_length" if shexp is not None else "feed_forward_length", 1, MAX_DIM)
        return cls(f.path, read_common(f, ff_key="expert_feed_forward_length", n_ff_shexp=n_ff_shexp, ff_from_dense=True))

    def ffn_tensors(self, l):
        return super().ffn_tensors(l) | {"sh_gate_inp": T(f"blk.{l}.ffn_gate_inp_shexp.weight", (self.cfg.n_embd,), "vector")}

    def ffn_extra(self, lw, h):
        g = 1.0 / (1.0 + np.exp(-(h @ lw.sh_gate_inp)))  # [R]
        s = lw.sh_down(silu(lw.sh_gate(h)) * lw.sh_up(h))  # [R, D]
        return g[:, None].astype(np.float32) * s

    def gating(self):
        return "softmax, top-k; shared expert gated by sigmoid"
