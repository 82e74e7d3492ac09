"""ERNIE-4.5-21B-A3B / 300B-A47B (`ernie4_5-moe`), as llama.cpp's src/models/ernie4-5-moe.cpp computes it.

- Layers: the first `leading_dense_block_count` have a dense SwiGLU FFN of `feed_forward_length`; a
  layer i from there on runs its experts where (i + 1) % `interleave_moe_layer_step` == 0 (every layer
  in the released models). llama.cpp loads expert tensors, not dense ones, in every layer from the
  leading count on, so a step that leaves a dense layer there is refused (llama.cpp could not run it).
- Attention: GQA with optional q/k/v biases, adjacent-pair (NORM) RoPE over the whole head (llama.cpp
  asserts rope.dimension_count = head size); attn_output.bias, which llama.cpp loads but never adds, is
  not read either.
- Router: softmax over all experts; the optional selection bias `exp_probs_b` decides which experts
  are chosen, not their weights; the chosen weights are always renormalised (hard-coded), never
  scaled (llama.cpp does not read expert_weights_scale for this architecture). Grouped selection
  where `expert_group_count` > 1 (llama.cpp's generic rule; no released file has groups).
- Shared expert: one ungated SwiGLU of `expert_shared_feed_forward_length` when that key is > 0
  (expert_shared_count sizes nothing in llama.cpp).
- The output matrix may be tied to the embeddings (21B ties it).
The converter drops the checkpoint's MTP modules: a file has none.
"""
from __future__ import annotations

from dataclasses import replace

from ...errors import ModelFileError, UnsupportedError
from ..config import MAX_DIM
from ..layers import gate
from .common import Arch, T, read_common, read_int, read_layer_int, refuse_tensor


class Ernie45MoE(Arch):
    name = "ernie4_5-moe"
    rope_style = "norm"

    def __init__(self, path, cfg, *, groups: tuple[int, int] | None, moe_step: int):
        super().__init__(path, cfg)
        self.groups, self.moe_step = groups, moe_step
        self.has_bias = False  # set by read: the file has exp_probs_b

    @classmethod
    def read(cls, f) -> "Ernie45MoE":
        a = f.arch
        n = read_int(f, "block_count", 1, 4096)
        step = read_int(f, "interleave_moe_layer_step", 1, 4096)  # required; llama.cpp asserts > 0
        lead = read_int(f, "leading_dense_block_count", 0, n - 1, default=0)
        moe = tuple(l for l in range(lead, n) if (l + 1) % step == 0)
        if moe != tuple(range(lead, n)):
            raise UnsupportedError(f.path, f"{a}.interleave_moe_layer_step",
                                   f"1 (llama.cpp loads expert tensors in every layer from leading_dense_block_count "
                                   f"{lead} on, and cannot run a dense layer among them)", step)
        n_ff_shexp = read_int(f, "expert_shared_feed_forward_length", 0, MAX_DIM, default=0)
        cfg = read_common(f, ff_key="expert_feed_forward_length", n_dense_lead=lead, n_ff_shexp=n_ff_shexp,
                          n_ff=read_layer_int(f, "feed_forward_length", 1, MAX_DIM) if lead else 0)
        cfg = replace(cfg, moe_layers=moe)
        if cfg.head_dim_v != cfg.head_dim or cfg.n_rot != cfg.head_dim:
            raise ModelFileError(f.path, f"{a}.rope.dimension_count", f"the head size {cfg.head_dim} (llama.cpp asserts "
                                 "RoPE over the whole head and value heads as wide as key heads)",
                                 f"{cfg.n_rot} (value heads {cfg.head_dim_v})")
        groups = None
        n_group = read_int(f, "expert_group_count", 0, cfg.n_expert - 1, default=0)
        if n_group > 1:
            if cfg.n_expert % n_group:
                raise ModelFileError(f.path, f"{a}.expert_group_count", f"a divisor of expert_count {cfg.n_expert}", n_group)
            groups = (n_group, read_int(f, "expert_group_used_count", 1, n_group - 1))
        for l in range(n):  # llama.cpp would take a fused attn_qkv; the converter always writes q, k, v apart
            refuse_tensor(f, f"blk.{l}.attn_qkv.weight", "separate attn_q, attn_k, attn_v (as llama.cpp's converter "
                          "writes ERNIE 4.5)")
        arch = cls(f.path, cfg, groups=groups, moe_step=step)
        arch.has_bias = bool(moe) and f"blk.{moe[0]}.exp_probs_b.bias" in f.tensors
        return arch

    def ffn_tensors(self, l):
        want = super().ffn_tensors(l)
        if l in self.cfg.moe_layers:
            want["probs_b"] = T(f"blk.{l}.exp_probs_b.bias", (self.cfg.n_expert,), "vector", False)
        return want

    def route(self, lw, h):
        return gate(h, lw.router, self.cfg.n_expert_used, func="softmax", bias=lw.probs_b, norm=True,
                    groups=self.groups)

    def gating(self):
        return ("softmax" + (" + selection bias" if self.has_bias else "")
                + (f", top {self.groups[1]} of {self.groups[0]} groups" if self.groups else "") + ", top-k, renormalised")
