"""Llama 4 Scout / Maverick (`llama4`), as llama.cpp's src/models/llama4.cpp computes it.

- Layers: i is MoE iff (i + 1) % `interleave_moe_layer_step` == 0 (Scout: every layer, Maverick:
  every 2nd), else a dense SwiGLU FFN of `feed_forward_length`. A MoE layer: top-k of the raw router
  logits, each chosen expert reads its input times sigmoid(logit) (the weight goes before the FFN,
  not after it), plus one shared SwiGLU expert of `expert_feed_forward_length`, ungated.
- Attention: without `attention.sliding_window` = 0, 3 of every 4 layers (or the pattern
  `attention.sliding_window_pattern` gives) are chunked: a query sees only the keys of its own chunk
  of 8192 positions (hard-coded in llama.cpp), so those layers keep at most a chunk of KV. Layers with
  (i + 1) % 4 == 0 have no RoPE and scale q by log(floor((pos + 1) / 8192) + 1) * 0.1 + 1 (temperature
  tuning); the others RoPE adjacent pairs over the whole head, frequencies divided by `rope_freqs`
  (llama3 scaling, one tensor for all layers), then an unweighted RMS norm of each q and k head
  (not in 128-expert files: llama.cpp keys it on Maverick's expert count).
  With `attention.sliding_window` = 0 (MobileLLM-style files) every layer is full attention with RoPE.
- Tied output allowed (llama.cpp falls back to token_embd).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...errors import ModelFileError, UnsupportedError
from ..config import MAX_DIM
from ..layers import rmsnorm, router_logits, sigmoid
from ..state import FullKV, WindowKV
from .common import Arch, T, read_common, read_int, read_layer_int

CHUNK = 8192  # llama.cpp's n_swa for llama4, and its temperature tuning's floor scale
TEMP_SCALE = 0.1


class Llama4(Arch):
    name = "llama4"
    rope_style = "norm"
    weight_before_ffn = True  # the runner scales each expert's input by its weight (llama.cpp's llama4 path)

    def __init__(self, path, cfg, *, chunked: tuple[bool, ...], rope_layers: tuple[bool, ...], kq_norm: bool,
                 moe_step: int, scaled_rope: bool):
        super().__init__(path, cfg)
        self.scaled_rope = scaled_rope  # the file has rope_freqs
        self.chunked, self.rope_layers, self.kq_norm, self.moe_step = chunked, rope_layers, kq_norm, moe_step
        self.chunk, self.temp_floor = CHUNK, CHUNK
        self._factors: np.ndarray | None = None  # rope_freqs [n_rot / 2], set by prepare

    @classmethod
    def read(cls, f) -> "Llama4":
        a = f.arch
        n = read_int(f, "block_count", 1, 4096)
        step = read_int(f, "interleave_moe_layer_step", 0, n)  # required by llama.cpp
        moe = tuple(l for l in range(n) if step and (l + 1) % step == 0)
        if not moe:
            raise UnsupportedError(f.path, f"{a}.interleave_moe_layer_step", "a step with MoE layers", step)
        n_ff_exp = read_layer_int(f, "expert_feed_forward_length", 1, MAX_DIM)
        dense = len(moe) < n
        cfg = read_common(f, ff_key="expert_feed_forward_length", n_ff_shexp=n_ff_exp,
                          n_ff=read_layer_int(f, "feed_forward_length", 1, MAX_DIM) if dense else 0)
        cfg = replace(cfg, moe_layers=moe)
        if cfg.head_dim_v != cfg.head_dim or cfg.n_rot != cfg.head_dim:
            raise ModelFileError(f.path, f"{a}.rope.dimension_count", f"the head size {cfg.head_dim} (llama.cpp asserts "
                                 "RoPE over the whole head and value heads as wide as key heads)",
                                 f"{cfg.n_rot} (value heads {cfg.head_dim_v})")
        swa = f.get(f"{a}.attention.sliding_window", None)
        if swa == 0:  # every layer full attention, RoPE everywhere
            chunked, rope = (False,) * n, (True,) * n
        else:
            pat = f.get(f"{a}.attention.sliding_window_pattern", 4)
            if isinstance(pat, list):
                if len(pat) != n or not all(isinstance(p, bool) for p in pat):
                    raise ModelFileError(f.path, f"{a}.attention.sliding_window_pattern", f"{n} booleans", repr(pat)[:80])
                chunked = tuple(pat)
            elif isinstance(pat, int) and not isinstance(pat, bool) and pat >= 0:
                chunked = tuple(pat == 0 or l % pat < pat - 1 for l in range(n))
            else:
                raise ModelFileError(f.path, f"{a}.attention.sliding_window_pattern", "a layer period or booleans", repr(pat))
            rope = tuple((l + 1) % 4 != 0 for l in range(n))
        for key in ("rope.freq_base_swa", "attention.scale"):
            if f"{a}.{key}" in f.metadata:  # llama.cpp reads them; no Llama 4 file has them
                raise UnsupportedError(f.path, f"{a}.{key}", "absent (not supported)", repr(f.get(f"{a}.{key}")))
        return cls(f.path, cfg, chunked=chunked, rope_layers=rope, kq_norm=cfg.n_expert != 128, moe_step=step,
                   scaled_rope="rope_freqs.weight" in f.tensors)

    # -- tensors ------------------------------------------------------------------------------------
    def layer_tensors(self, l):
        want = super().layer_tensors(l)
        if l == 0:  # one tensor for every layer (llama.cpp's rope_freqs, duplicated per layer)
            want["rope_freqs"] = T("rope_freqs.weight", (self.cfg.n_rot // 2,), "vector", False)
        return want

    def prepare(self, lw):
        if lw.rope_freqs is not None:
            self._factors = lw.rope_freqs

    # -- compute ------------------------------------------------------------------------------------
    def make_rope(self, n_ctx):
        from ..layers import Rope

        return Rope(self.cfg.n_rot, self.cfg.rope_base, n_ctx, style=self.rope_style, factors=self._factors)

    def layer_states(self):
        cfg = self.cfg
        return [WindowKV(cfg.n_head_kv, cfg.head_dim, cfg.head_dim, self.chunk) if c
                else FullKV(cfg.n_head_kv, cfg.head_dim, cfg.head_dim) for c in self.chunked]

    def layer_kind(self, l):
        return "chunked" if self.chunked[l] else "attention"

    def attention(self, lw, l, x, step, rope):
        cfg = self.cfg
        q, k, v = self.qkv(lw, rmsnorm(x, lw.attn_norm, cfg.eps))  # [R, H, hd], [R, Hkv, hd], [R, Hkv, hd]
        if self.rope_layers[l]:
            q, k = step.rope(rope, q), step.rope(rope, k)
            if self.kq_norm:  # unweighted, per head
                q, k = rmsnorm(q, np.float32(1), cfg.eps), rmsnorm(k, np.float32(1), cfg.eps)
        else:  # temperature tuning, per row's position
            pos = step.plan.pos.astype(np.float64)
            t = np.log(np.floor((pos + 1.0) / self.temp_floor) + 1.0) * TEMP_SCALE + 1.0  # [R]
            q = q * t.astype(np.float32)[:, None, None]
        o = step.attend(l, q, k, v, 1.0 / np.sqrt(cfg.head_dim), chunk=self.chunk if self.chunked[l] else 0)
        return lw.wo(o)

    def route(self, lw, h):
        logits = router_logits(h, lw.router)  # [R, E]
        sel = np.argsort(-logits, axis=-1, kind="stable")[:, : self.cfg.n_expert_used]  # [R, K]
        return sel, sigmoid(np.take_along_axis(logits, sel, axis=-1)).astype(np.float32)

    # -- clutor info --------------------------------------------------------------------------------
    def gating(self):
        return "top-k of the logits, sigmoid(logit) x the expert's input"

    def describe(self):
        n_chunked = sum(self.chunked)
        return super().describe() | {
            "dense_interleaved": self.cfg.moe_layers != tuple(range(self.cfg.n_layers - len(self.cfg.moe_layers), self.cfg.n_layers)),
            "attention": f"GQA, chunks of {self.chunk} in {n_chunked} of {self.cfg.n_layers} layers, "
                         f"no RoPE in {self.rope_layers.count(False)}" + (", q/k norm" if self.kq_norm else ""),
            "rope": f"norm, {self.cfg.n_rot} of {self.cfg.head_dim} dims"
                    + (", frequencies / rope_freqs" if self.scaled_rope else ""),
        }
