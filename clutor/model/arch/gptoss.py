"""gpt-oss (`gpt-oss`, llama.cpp's OPENAI_MOE): gpt-oss-20b / 120b.

- Attention: head size = `attention.key_length` (the width n_head x head need not equal n_embd; RoPE on
  `rope.dimension_count` dims, by default all of them, as llama.cpp reads both); q/k/v
  biases (optional) and an output bias; one learned "sink" logit per head that joins the softmax
  denominator; sliding-window layers (`attention.sliding_window`) alternating with full ones (pattern
  `attention.sliding_window_pattern`, default 2: even layers slide); NEOX RoPE, with YaRN the cos/sin
  multiplied by 1 + 0.1 ln(factor).
- Router: logits + `ffn_gate_inp.bias`, top-k over the logits, softmax over the k chosen.
- Experts: biases on gate, up and down, which belong to the expert: the expert store reads them with
  its weights (six slabs per expert, clutor.io.layout); the clamped SwiGLU g = min(gate, 7),
  u = clamp(up, -7, 7), out = g sigmoid(1.702 g) (u + 1).
- The norm before the MoE block is `post_attention_norm`; `output` is never tied.
"""
from __future__ import annotations

import numpy as np

from ...errors import ModelFileError, UnsupportedError
from ..layers import Rope, Yarn, gate, rmsnorm
from ..state import FullKV, WindowKV
from .common import Arch, T, read_common, read_float, read_int

ALPHA, LIMIT = 1.702, 7.0


class GptOss(Arch):
    name = "gpt-oss"
    ffn_norm_name = "post_attention_norm"
    rope_scaling = ("yarn",)

    def __init__(self, path, cfg, *, window: int, swa: tuple[bool, ...], yarn: Yarn | None, w_scale: float):
        super().__init__(path, cfg)
        self.window, self.swa, self.yarn, self.w_scale = window, swa, yarn, w_scale

    @classmethod
    def read(cls, f) -> "GptOss":
        a = f.arch
        # head sizes from key_length / value_length (default n_embd / n_head), rope.dimension_count
        # defaulting to the key's head size: llama.cpp's load_hparams for every architecture
        cfg = read_common(f, ff_key="expert_feed_forward_length")
        window = read_int(f, "attention.sliding_window", 1, 1 << 24)
        base_swa = f.get(f"{a}.rope.freq_base_swa", cfg.rope_base)
        if base_swa != cfg.rope_base:
            raise UnsupportedError(f.path, f"{a}.rope.freq_base_swa", f"the same as rope.freq_base {cfg.rope_base:g} "
                                   "(a separate base for sliding-window layers is not supported)", repr(base_swa))
        pat = f.get(f"{a}.attention.sliding_window_pattern", 2)
        if isinstance(pat, list):
            if len(pat) != cfg.n_layers or not all(isinstance(p, bool) for p in pat):
                raise ModelFileError(f.path, f"{a}.attention.sliding_window_pattern", f"{cfg.n_layers} booleans", pat)
            swa = tuple(pat)
        elif isinstance(pat, int) and not isinstance(pat, bool) and pat >= 0:
            swa = tuple(pat == 0 or l % pat < pat - 1 for l in range(cfg.n_layers))
        else:
            raise ModelFileError(f.path, f"{a}.attention.sliding_window_pattern", "a layer period or booleans", pat)
        yarn = None
        if f.get(f"{a}.rope.scaling.type", "none") == "yarn":
            factor = read_float(f, "rope.scaling.factor")
            if factor > 1.0:
                yarn = Yarn(factor, read_int(f, "rope.scaling.original_context_length", 1, 1 << 24, default=cfg.n_ctx_train),
                            read_float(f, "rope.scaling.yarn_beta_fast", 32.0), read_float(f, "rope.scaling.yarn_beta_slow", 1.0))
        return cls(f.path, cfg, window=window, swa=swa, yarn=yarn,
                   w_scale=read_float(f, "expert_weights_scale", 0.0, positive=False))

    def global_tensors(self):
        want = super().global_tensors()
        if self.cfg.tied_output:
            raise ModelFileError(self.path, "tensor output.weight", "present (gpt-oss never ties it)", "absent")
        return want

    def attention_tensors(self, l):
        b, H = f"blk.{l}.", self.cfg.n_head
        return super().attention_tensors(l) | {"bo": T(b + "attn_output.bias", (self.cfg.n_embd,), "vector"),
                                               "sinks": T(b + "attn_sinks.weight", (H,), "vector")}

    def ffn_tensors(self, l):
        cfg, b = self.cfg, f"blk.{l}."
        E, F, D = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
        return super().ffn_tensors(l) | {
            "router_b": T(b + "ffn_gate_inp.bias", (E,), "vector"),
            # streamed with each expert (checked here, read by the expert store)
            "gate_b": T(b + "ffn_gate_exps.bias", (E, F), "expert", part="gate bias"),
            "up_b": T(b + "ffn_up_exps.bias", (E, F), "expert", part="up bias"),
            "down_b": T(b + "ffn_down_exps.bias", (E, D), "expert", part="down bias")}

    def make_rope(self, n_ctx):
        # YaRN's magnitude correction, which gpt-oss keeps (deepseek2 cancels it)
        m = 1.0 + 0.1 * np.log(self.yarn.factor) if self.yarn is not None else 1.0
        return Rope(self.cfg.n_rot, self.cfg.rope_base, n_ctx, style="neox", yarn=self.yarn, mscale=m)

    def layer_states(self):
        cfg = self.cfg
        return [WindowKV(cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v, self.window) if self.swa[l]
                else FullKV(cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v) for l in range(cfg.n_layers)]

    def attention(self, lw, l, x, step, rope):
        cfg = self.cfg
        q, k, v = self.qkv(lw, rmsnorm(x, lw.attn_norm, cfg.eps))
        o = step.attend(l, step.rope(rope, q), step.rope(rope, k), v, 1.0 / np.sqrt(cfg.head_dim),
                        window=self.window if self.swa[l] else 0, sinks=lw.sinks)
        return lw.wo(o) + lw.bo

    def layer_kind(self, l):
        return "window" if self.swa[l] else "attention"

    def route(self, lw, h):
        return gate(h, lw.router, self.cfg.n_expert_used, func="softmax_weight", logit_bias=lw.router_b,
                    scale=self.w_scale)

    def expert_act(self, gu, F):
        g = np.minimum(gu[:, :F], LIMIT)
        u = np.clip(gu[:, F:], -LIMIT, LIMIT)
        with np.errstate(over="ignore"):
            return g / (1.0 + np.exp(-ALPHA * g)) * (u + 1.0)

    def gating(self):
        return "top-k of logits + bias, softmax over the chosen"

    def describe(self):
        n = sum(self.swa)
        return super().describe() | {
            "attention": "GQA with sinks", "sliding_window": f"{self.window} on {n} of {self.cfg.n_layers} layers" if n else None,
            "rope": super().describe()["rope"] + (f", YaRN x{self.yarn.factor:g} from {self.yarn.n_ctx_orig}" if self.yarn else "")}
