"""Gemma 4, MoE form (`gemma4`): Gemma-4-26B-A4B.

- Layers: sliding-window (`attention.sliding_window`) or global, from the boolean array
  `attention.sliding_window_pattern` (5:1 in the 26B). Each kind has its own head size
  (`key_length_swa` / `key_length`), RoPE (`rope.dimension_count_swa` / `rope.dimension_count`,
  `rope.freq_base_swa` / `rope.freq_base`) and KV-head count (`attention.head_count_kv`, per layer).
- Attention: q and k RMS-normed per head with weights, v RMS-normed without one; a layer without
  `attn_v` (global layers: attention_k_eq_v) uses the K projection as V (normed, not rotated); NEOX
  RoPE, the global layers' through `rope_freqs` (a factor of 1e30 leaves a pair unrotated: 25%
  "proportional" RoPE); attention scale 1 (the q norm takes its place); the output RMS-normed
  (`post_attention_norm`) before the residual add.
- FFN, every layer: a shared GELU MLP (ffn_gate/up/down) on `ffn_norm`(x), normed by `post_ffw_norm_1`;
  routed GELU experts (fused `ffn_gate_up_exps` = [gate | up]) on `pre_ffw_norm_2`(x), their weighted
  sum normed by `post_ffw_norm_2`; the router reads rms_norm(x) / sqrt(n_embd) * `ffn_gate_inp.scale`,
  softmax, top-k renormalised, each expert's weight times `ffn_down_exps.scale`; the two summed,
  normed by `post_ffw_norm`, added to the residual; the layer's output times `layer_output_scale`.
- Embeddings times sqrt(n_embd); the head tied to them; logits soft-capped by
  `final_logit_softcapping` (c tanh(z / c)).
Not supported (refused by name): per-layer input embeddings and KV sharing across layers (the
dense E2B/E4B forms), a fused attn_qkv.
"""
from __future__ import annotations

import math

import numpy as np

from ...errors import ModelFileError, UnsupportedError
from ..config import MAX_DIM, MAX_HEAD_DIM
from ..kernels.f16dots import warmup as f16_warmup
from ..kernels.ggmlmath import attend as ggml_attend, gelu_table, softmax as ggml_softmax, warmup as ggml_warmup
from ..layers import Rope, gate, rmsnorm, router_logits
from ..state import FullKV, WindowKV
from .common import Arch, T, read_common, read_float, read_int, refuse_tensor

_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


def gelu(x: np.ndarray, ggml: bool = True) -> np.ndarray:
    """GELU, tanh form. ggml: as ggml's CPU backend computes it, bit for bit: its GELU table
    (kernels.ggmlmath.gelu_table) at x rounded to float16; 0 at or below -10, x itself at or above
    10 (the rounding moves a GELU by up to ~5e-4 of its value). Otherwise float32 throughout."""
    if not ggml:
        return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(_GELU_C * x * (np.float32(1.0) + np.float32(0.044715) * x * x)))
    with np.errstate(over="ignore"):  # beyond a half's range: the where() below takes x or 0
        y = gelu_table()[x.astype(np.float16).view(np.uint16)]
    return np.where(x <= -10.0, np.float32(0.0), np.where(x >= 10.0, x, y))


class _Ropes:
    """The two RoPEs of a Gemma 4 model: sliding-window layers' and global layers'."""

    def __init__(self, swa: Rope, full: Rope):
        self.swa, self.full = swa, full


class Gemma4(Arch):
    name = "gemma4"
    attention_kind = "GQA, QK-norm"
    ggml_f16_sums = True  # every product rounds its input to half: one ulp grows layer by layer

    def __init__(self, path, cfg, *, swa, window, n_kv, hd_swa, n_rot_swa, base_swa, n_ff, softcap):
        super().__init__(path, cfg)
        self.swa = swa            # per layer: a sliding-window layer
        self.window = window
        self.n_kv = n_kv          # per layer: KV heads
        self.hd_swa, self.n_rot_swa, self.base_swa = hd_swa, n_rot_swa, base_swa
        self.n_ff = n_ff          # the shared MLP's hidden size
        self.softcap = softcap
        self.freq_factors = None  # rope_freqs [hd/2] of the global layers (set by prepare_global)

    @classmethod
    def read(cls, f) -> "Gemma4":
        a = f.arch
        n_layers = read_int(f, "block_count", 1, 1024)
        pat = f.get(f"{a}.attention.sliding_window_pattern")
        if not isinstance(pat, list) or len(pat) != n_layers or not all(isinstance(p, bool) for p in pat):
            raise ModelFileError(f.path, f"{a}.attention.sliding_window_pattern", f"{n_layers} booleans", pat)
        swa = tuple(pat)
        for key, why in (("attention.shared_kv_layers", "KV sharing across layers (Gemma 4 E2B/E4B)"),
                         ("embedding_length_per_layer_input", "per-layer input embeddings (Gemma 4 E2B/E4B)")):
            v = f.get(f"{a}.{key}", 0)
            if v != 0:
                raise UnsupportedError(f.path, f"{a}.{key}", f"0 ({why} is not supported)", repr(v))
        n_head = read_int(f, "attention.head_count", 1, 4096)
        kv = f.get(f"{a}.attention.head_count_kv", n_head)
        n_kv = tuple(kv) if isinstance(kv, list) else (kv,) * n_layers
        if len(n_kv) != n_layers or not all(isinstance(k, int) and 0 < k <= n_head and n_head % k == 0 for k in n_kv):
            raise ModelFileError(f.path, f"{a}.attention.head_count_kv",
                                 f"{n_layers} divisors of head_count {n_head} (or one)", kv)
        hd = read_int(f, "attention.key_length", 2, MAX_HEAD_DIM)
        hd_swa = read_int(f, "attention.key_length_swa", 2, MAX_HEAD_DIM)
        for key, want in (("attention.value_length", hd), ("attention.value_length_swa", hd_swa)):
            read_int(f, key, want, want, default=want)  # llama.cpp requires v heads the size of k heads
        n_rot_swa = read_int(f, "rope.dimension_count_swa", 2, hd_swa, default=hd_swa)
        n_ff = f.get(f"{a}.feed_forward_length")
        if isinstance(n_ff, list):  # an array only where KV-shared layers double their MLP (refused above)
            if len(set(n_ff)) != 1:
                raise UnsupportedError(f.path, f"{a}.feed_forward_length", "one size for every layer", n_ff)
            n_ff = n_ff[0]
        if isinstance(n_ff, bool) or not isinstance(n_ff, int) or not 1 <= n_ff <= MAX_DIM:
            raise ModelFileError(f.path, f"{a}.feed_forward_length", f"an integer in [1, {MAX_DIM}]", repr(n_ff))
        # Every layer has KV (the window layers' pages behind their window are given back:
        # layer_states); kv_floats: the per-layer mean of what a position holds
        per_layer = [2 * n_kv[l] * (hd_swa if swa[l] else hd) for l in range(n_layers)]
        cfg = read_common(f, ff_key="expert_feed_forward_length", n_layers=n_layers, head_dim=hd, head_dim_v=hd,
                          n_head_kv=max(n_kv), kv_floats=-(-sum(per_layer) // n_layers))
        moe = tuple(l for l in range(n_layers) if f"blk.{l}.ffn_gate_inp.weight" in f.tensors)
        if not moe:
            raise ModelFileError(f.path, "tensor blk.0.ffn_gate_inp.weight", "present (a MoE Gemma 4)", "absent")
        from dataclasses import replace
        cfg = replace(cfg, moe_layers=moe, n_ff_shexp=n_ff)
        return cls(f.path, cfg, swa=swa, window=read_int(f, "attention.sliding_window", 1, 1 << 24), n_kv=n_kv,
                   hd_swa=hd_swa, n_rot_swa=n_rot_swa,
                   base_swa=read_float(f, "rope.freq_base_swa", default=cfg.rope_base),
                   n_ff=n_ff, softcap=read_float(f, "final_logit_softcapping", 0.0, positive=False))

    def head_dim_of(self, l: int) -> int:
        return self.hd_swa if self.swa[l] else self.cfg.head_dim

    # -- tensors -------------------------------------------------------------------------------------
    def global_tensors(self):
        want = super().global_tensors()
        if not all(self.swa):
            want["rope_freqs"] = T("rope_freqs.weight", (self.cfg.head_dim // 2,), "vector")
        return want

    def attention_tensors(self, l):
        cfg, b = self.cfg, f"blk.{l}."
        D, H, Hkv, hd = cfg.n_embd, cfg.n_head, self.n_kv[l], self.head_dim_of(l)
        return {
            "attn_norm": T(b + "attn_norm.weight", (D,), "vector"),
            "wq": T(b + "attn_q.weight", (H * hd, D)),
            "wk": T(b + "attn_k.weight", (Hkv * hd, D)),
            "wv": T(b + "attn_v.weight", (Hkv * hd, D), required=False),  # absent: V is the K projection
            "wo": T(b + "attn_output.weight", (D, H * hd)),
            "q_norm": T(b + "attn_q_norm.weight", (hd,), "vector"),
            "k_norm": T(b + "attn_k_norm.weight", (hd,), "vector"),
            "attn_post_norm": T(b + "post_attention_norm.weight", (D,), "vector"),
            "out_scale": T(b + "layer_output_scale.weight", (1,), "vector", False),
        }

    def ffn_tensors(self, l):
        cfg, b = self.cfg, f"blk.{l}."
        D, E, F, Fs = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp, self.n_ff
        want = {
            "ffn_norm": T(b + "ffn_norm.weight", (D,), "vector"),
            "sh_gate": T(b + "ffn_gate.weight", (Fs, D)),
            "sh_up": T(b + "ffn_up.weight", (Fs, D)),
            "sh_down": T(b + "ffn_down.weight", (D, Fs)),
            "ffn_post_norm": T(b + "post_ffw_norm.weight", (D,), "vector"),
        }
        if l not in cfg.moe_layers:
            return want
        want |= {
            "router": T(b + "ffn_gate_inp.weight", (E, D), "vector"),
            "router_scale": T(b + "ffn_gate_inp.scale", (D,), "vector"),
            "pre_norm_2": T(b + "pre_ffw_norm_2.weight", (D,), "vector"),
            "post_norm_1": T(b + "post_ffw_norm_1.weight", (D,), "vector"),
            "post_norm_2": T(b + "post_ffw_norm_2.weight", (D,), "vector"),
            "down_scale": T(b + "ffn_down_exps.scale", (E,), "vector", False),
        }
        if self.fused_gate_up:
            want["gate_up_exps"] = T(b + "ffn_gate_up_exps.weight", (E, 2 * F, D), "expert", part="gate+up")
        else:
            want |= {"gate_exps": T(b + "ffn_gate_exps.weight", (E, F, D), "expert", part="gate"),
                     "up_exps": T(b + "ffn_up_exps.weight", (E, F, D), "expert", part="up")}
        want["down_exps"] = T(b + "ffn_down_exps.weight", (E, D, F), "expert", part="down")
        return want

    def check_file(self, f):
        for l in range(self.cfg.n_layers):
            refuse_tensor(f, f"blk.{l}.attn_qkv.weight", "a fused attn_qkv (Gemma 4 is read with attn_q/k/v)")

    def prepare_global(self, glob: dict) -> None:
        self.freq_factors = glob.get("rope_freqs")

    # -- compute ---------------------------------------------------------------------------------------
    def warmup(self):
        ggml_warmup()
        f16_warmup()  # F16 files: ggml_f16_sums

    def make_rope(self, n_ctx):
        cfg = self.cfg
        full = Rope(cfg.n_rot, cfg.rope_base, n_ctx, style="neox", factors=self.freq_factors, ggml_theta=True)
        return _Ropes(Rope(self.n_rot_swa, self.base_swa, n_ctx, style="neox", ggml_theta=True), full)

    def layer_states(self):
        L = range(self.cfg.n_layers)
        return [WindowKV(self.n_kv[l], self.hd_swa, self.hd_swa, self.window) if self.swa[l]
                else FullKV(self.n_kv[l], self.cfg.head_dim, self.cfg.head_dim) for l in L]

    def layer_kind(self, l):
        return "window" if self.swa[l] else "attention"

    def embed(self, x):
        return x * np.float32(math.sqrt(self.cfg.n_embd))

    def attention(self, lw, l, x, step, rope):
        cfg, R = self.cfg, x.shape[0]
        H, Hkv, hd, eps = cfg.n_head, self.n_kv[l], self.head_dim_of(l), cfg.eps
        h = rmsnorm(x, lw.attn_norm, eps)  # [R, D]
        q = rmsnorm(lw.wq(h).reshape(R, H, hd), lw.q_norm, eps)  # [R, H, hd]
        kp = lw.wk(h).reshape(R, Hkv, hd)
        vp = kp if lw.wv is None else lw.wv(h).reshape(R, Hkv, hd)
        k = rmsnorm(kp, lw.k_norm, eps)  # [R, Hkv, hd]
        v = rmsnorm(vp, np.float32(1.0), eps)  # [R, Hkv, hd], no weight, not rotated
        rope_l = rope.swa if self.swa[l] else rope.full
        o = step.attend(l, step.rope(rope_l, q), step.rope(rope_l, k), v, 1.0, window=self.window if self.swa[l] else 0,
                        kernel=ggml_attend if self.ggml_numerics else None)  # [R, H * hd]
        return rmsnorm(lw.wo(o), lw.attn_post_norm, eps)

    def ffn_input(self, lw, x):
        return rmsnorm(x, lw.pre_norm_2, self.cfg.eps) if lw.pre_norm_2 is not None else x

    def router_input(self, lw, x, h):
        D = self.cfg.n_embd
        return rmsnorm(x, np.float32(1.0 / math.sqrt(D)), self.cfg.eps) * lw.router_scale

    def route(self, lw, h):
        if not self.ggml_numerics:
            return gate(h, lw.router, self.cfg.n_expert_used, norm=True)
        # llama.cpp's order: its softmax (ggml_v_expf, float64 sums), top-k, the weights divided by
        # their float64 sum (clamped to F16's smallest normal)
        probs = ggml_softmax(router_logits(h, lw.router))  # [R, E]
        sel = np.argsort(-probs, axis=-1, kind="stable")[:, : self.cfg.n_expert_used]  # [R, K]
        w = np.take_along_axis(probs, sel, axis=-1)  # [R, K]
        tot = np.maximum(np.sum(w, axis=-1, keepdims=True, dtype=np.float64).astype(np.float32), np.float32(6.103515625e-5))
        return sel, w / tot

    def expert_scale(self, lw):
        return lw.down_scale  # (down · s) · w, as llama.cpp multiplies: not down · (w · s)

    def expert_act(self, gu, F):
        return gelu(gu[:, :F], self.ggml_numerics) * gu[:, F:]

    def ffn_out(self, lw, x, h, routed):
        """x + post_ffw_norm(post_norm_1(shared MLP) + post_norm_2(routed experts)), times the layer's scale."""
        eps = self.cfg.eps
        m = rmsnorm(x, lw.ffn_norm, eps)
        y = lw.sh_down(gelu(lw.sh_gate(m), self.ggml_numerics) * lw.sh_up(m))
        if lw.router is not None:
            y = rmsnorm(y, lw.post_norm_1, eps) + rmsnorm(routed, lw.post_norm_2, eps)
        out = x + rmsnorm(y, lw.ffn_post_norm, eps)
        return out if lw.out_scale is None else out * lw.out_scale

    def final_logits(self, logits):
        if not self.softcap:
            return logits
        c = np.float32(self.softcap)
        return np.tanh(logits / c) * c

    def gating(self):
        return "softmax, top-k renormalised, per-expert scale"

    def describe(self):
        n = sum(self.swa)
        cfg = self.cfg
        return super().describe() | {
            "sliding_window": f"{self.window} on {n} of {cfg.n_layers} layers" if n else None,
            "rope": f"neox, {self.n_rot_swa} of {self.hd_swa} dims (window layers), {cfg.n_rot} of {cfg.head_dim} "
                    "with frequency factors (global layers)",
            "shared_expert": self.n_ff}
