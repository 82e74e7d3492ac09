"""Llama with routed experts (Mixtral 8x7B / 8x22B): `general.architecture = llama` and
`expert_count` > 0. RoPE over whole heads in the NORM order (adjacent pairs); softmax over all
experts, top-k, weights renormalised; no shared expert; the expert hidden size is
`feed_forward_length`. q/k/v and output biases are read when present, as llama.cpp does.

A llama file without experts is a dense model, which Clutor does not run. The older Mixtral layout
with one tensor per expert (blk.N.ffn_gate.E.weight) is refused: llama.cpp no longer loads it either
(ffn_up_exps / ffn_down_exps are required)."""
from __future__ import annotations

from ...errors import ModelFileError, UnsupportedError
from ..layers import gate
from .common import Arch, T, read_common


class Llama(Arch):
    name = "llama"
    rope_style = "norm"

    @classmethod
    def read(cls, f) -> "Llama":
        n_expert = f.get(f"{f.arch}.expert_count", 0)
        if not n_expert:
            raise UnsupportedError(f.path, f"{f.arch}.expert_count", "a mixture of experts (> 0): a dense llama model "
                                   "has no experts to stream", repr(n_expert))
        if "blk.0.ffn_gate.0.weight" in f.tensors and "blk.0.ffn_up_exps.weight" not in f.tensors:
            raise UnsupportedError(f.path, "tensor blk.0.ffn_up_exps.weight", "experts merged into one tensor per layer "
                                   "(this file has one tensor per expert, the old Mixtral layout llama.cpp no longer "
                                   "loads: convert it again with llama.cpp's convert_hf_to_gguf.py)", "absent")
        for name in ("rope_freqs.weight", "blk.0.rope_freqs.weight", "rope_factors_long.weight"):
            if name in f.tensors:
                raise UnsupportedError(f.path, f"tensor {name}", "no RoPE frequency factors (Llama 3 scaling is not "
                                       "supported)", "present")
        cfg = read_common(f, ff_key="feed_forward_length")
        if cfg.n_rot != cfg.head_dim or cfg.head_dim != cfg.head_dim_v:
            raise ModelFileError(f.path, f"{f.arch}.rope.dimension_count", f"the head size {cfg.head_dim} (as llama.cpp "
                                 "requires)", cfg.n_rot)
        return cls(f.path, cfg)

    def attention_tensors(self, l):
        return super().attention_tensors(l) | {"bo": T(f"blk.{l}.attn_output.bias", (self.cfg.n_embd,), "vector", False)}

    def attention(self, lw, l, x, step, rope):
        out = super().attention(lw, l, x, step, rope)
        return out + lw.bo if lw.bo is not None else out

    def route(self, lw, h):
        return gate(h, lw.router, self.cfg.n_expert_used, norm=True)

    def gating(self):
        return "softmax, top-k, renormalised"
