"""DeepSeek-V2 / V2-Lite / V2.5 / V3 / R1, Kimi-K2 (`deepseek2`): multi-head latent attention (MLA).

Attention: each token is compressed to one latent c = norm(W_kva h)[:C] (C = kv_lora_rank) plus one
RoPE key k_pe [r] shared by all heads (r = rope.dimension_count). Head i's key is (W_kb,i c, k_pe)
and its value W_vb,i c; since q_nope . W_kb,i c = (W_kb,i^T q_nope) . c, the query is "absorbed"
into latent space and attention runs over the cache of (c, k_pe) alone: the KV cache holds C + r
floats per position and layer (LatentKV), whatever the head count. q comes from h directly
(`attn_q`, q_lora_rank = 0) or through a normalised low-rank bottleneck (`attn_q_a`, `attn_q_b`).
RoPE is NORM-ordered over the last r dims of each q head and over k_pe; with YaRN the scores are
scaled by m^2 / sqrt(nope + r), m = 1 + 0.1 mscale_all_dim ln(factor), and cos/sin are not scaled.

The per-head up-projections come split (`attn_k_b` {nope, C, H}, `attn_v_b` {C, v, H}, with the
`key_length_mla` / `value_length_mla` keys) or, in older files, as one `attn_kv_b`
{C, H (nope + v)}, which is split at load into the same two.

FFN: `leading_dense_block_count` dense layers, then routed experts + `expert_shared_count` ungated
shared experts. Router: `expert_gating_func` softmax (default) or sigmoid, the optional selection bias
`exp_probs_b`, grouped top-k (`expert_group_count` / `expert_group_used_count`: only experts of the
groups with the best top-2 sums compete), `expert_weights_norm`, `expert_weights_scale`.
MTP (nextn) layers at the end of the file are not computed.
"""
from __future__ import annotations

import numpy as np

from ...errors import ModelFileError, UnsupportedError
from ..config import MAX_DIM
from ..layers import Rope, Yarn, gate, rmsnorm
from ..state import LatentKV
from ..quants import apply_all, dequantize, ggml_activations, matmul_heads
from .common import mtp_layer_tensors, _MISSING, Arch, T, read_bool, read_common, read_float, read_int, read_layer_int

GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}



def routing_groups(f, a: str, func: int) -> tuple[int, int] | None:
    """Checks the gating function and reads group-limited routing: (groups, groups used), or None when the
    experts are not grouped. Shared by the MLA architectures that route as DeepSeek-V3 does."""
    if func not in GATING:
        raise UnsupportedError(f.path, f"{a}.expert_gating_func", "1 (softmax), 2 (sigmoid) or 3 (softmax over "
                               "the chosen)", func)
    n_group = read_int(f, "expert_group_count", 0, 4096, default=0)
    if n_group <= 1:
        return None
    n_expert = read_int(f, "expert_count", 1, 4096)
    if n_expert % n_group:
        raise ModelFileError(f.path, f"{a}.expert_group_count", f"a divisor of expert_count {n_expert}", n_group)
    return (n_group, read_int(f, "expert_group_used_count", 1, n_group))

class DeepSeek2(Arch):
    name = "deepseek2"
    attention_kind = "MLA"
    rope_style = "norm"
    rope_scaling = ("yarn",)

    def __init__(self, path, cfg, *, q_lora: int, kv_lora: int, split: bool, n_nextn: int, func: str, norm_w: bool,
                 w_scale: float, groups: tuple[int, int] | None, yarn: Yarn | None, kq_scale: float):
        super().__init__(path, cfg)
        self.q_lora, self.kv_lora, self.split, self.n_nextn = q_lora, kv_lora, split, n_nextn
        self.func, self.norm_w, self.w_scale, self.groups = func, norm_w, w_scale, groups
        self.yarn, self.kq_scale = yarn, kq_scale
        self.nope = cfg.head_dim - cfg.n_rot

    @classmethod
    def read(cls, f) -> "DeepSeek2":
        a = f.arch
        n_all = read_int(f, "block_count", 1, 4096)
        n_nextn = read_int(f, "nextn_predict_layers", 0, n_all - 1, default=0)
        n_layers = n_all - n_nextn
        n_vocab = _n_vocab(f)
        # llama.cpp's "lite" variants (DeepSeek-V2-Lite, GigaChat3-10B-A1.8B, Kanana-2-30B-A3B) may omit q_lora_rank
        lite = n_layers in (26, 27) or (n_layers == 48 and n_vocab == 128256)
        q_lora = read_int(f, "attention.q_lora_rank", 0, MAX_DIM, default=0 if lite else _MISSING)
        kv_lora = read_int(f, "attention.kv_lora_rank", 1, MAX_DIM)
        split = f"{a}.attention.key_length_mla" in f.metadata and f"{a}.attention.value_length_mla" in f.metadata
        # llama.cpp's defaults for every architecture: key_length = n_embd / n_head, rope.dimension_count =
        # key_length. In either form of a converter's file that leaves no non-RoPE part of a head (the MQA
        # form's key_length is the latent's, kv_lora + rope): llama.cpp then stops at its assertion
        # n_embd_head_qk_nope >= 1, and Clutor refuses the file naming the missing key.
        n_head = read_layer_int(f, "attention.head_count", 1, 4096)
        k_len = read_int(f, "attention.key_length", 2, MAX_DIM, default=read_int(f, "embedding_length", 1, MAX_DIM) // n_head)
        n_rot = read_int(f, "rope.dimension_count", 2, MAX_DIM, default=k_len)
        if split:  # the MQA form: key_length / value_length describe the latent, the _mla keys the heads
            hk = read_int(f, "attention.key_length_mla", 2, MAX_DIM)
            hv = read_int(f, "attention.value_length_mla", 1, MAX_DIM)
        else:
            hk = k_len
            hv = read_int(f, "attention.value_length", 1, MAX_DIM)
        if n_rot >= hk:
            key = f"{a}.rope.dimension_count"
            what = "present" if key not in f.metadata else "an integer"
            got = (f"absent (llama.cpp's default, attention.key_length = {k_len}, fails its n_embd_head_qk_nope >= 1 check)"
                   if key not in f.metadata else n_rot)
            raise ModelFileError(f.path, key, f"{what} below the head's key size {hk} (RoPE part + non-RoPE part)", got)
        n_dense = read_int(f, "leading_dense_block_count", 0, n_layers - 1, default=0)
        n_ff_exp = read_int(f, "expert_feed_forward_length", 1, MAX_DIM)
        n_shared = read_int(f, "expert_shared_count", 0, 64)
        # absent / none -> softmax, but sigmoid in GLM-4.7-Lite's files (47 or 48 layers, 154880 tokens), as llama.cpp decides
        func = read_int(f, "expert_gating_func", 0, 4, default=0) or (2 if n_layers in (47, 48) and n_vocab == 154880 else 1)
        groups = routing_groups(f, a, func)
        cfg = read_common(f, ff_key="expert_feed_forward_length", n_layers=n_layers, n_dense_lead=n_dense,
                          n_ff_shexp=n_ff_exp * n_shared, n_ff=read_layer_int(f, "feed_forward_length", 1, MAX_DIM) if n_dense else 0,
                          head_dim=hk, head_dim_v=hv, n_head_kv=1, kv_floats=kv_lora + n_rot)
        yarn, mscale = None, 1.0
        if f.get(f"{a}.rope.scaling.type", "none") == "yarn":
            factor = read_float(f, "rope.scaling.factor")
            if factor > 1.0:
                yarn = Yarn(factor, read_int(f, "rope.scaling.original_context_length", 1, 1 << 24,
                                             default=cfg.n_ctx_train),
                            read_float(f, "rope.scaling.yarn_beta_fast", 32.0), read_float(f, "rope.scaling.yarn_beta_slow", 1.0))
                # the file stores 0.1 * mscale_all_dim
                mscale = 1.0 + read_float(f, "rope.scaling.yarn_log_multiplier", 0.0, positive=False) * np.log(factor)
        arch = cls(f.path, cfg, q_lora=q_lora, kv_lora=kv_lora, split=split, n_nextn=n_nextn, func=GATING[func],
                   norm_w=read_bool(f, "expert_weights_norm", False),
                   w_scale=read_float(f, "expert_weights_scale", 0.0, positive=False), groups=groups, yarn=yarn,
                   kq_scale=float(mscale * mscale / np.sqrt(hk)))
        arch.has_bias = f"blk.{n_dense}.exp_probs_b.bias" in f.tensors
        return arch

    # -- tensors ----------------------------------------------------------------------------------
    def attention_tensors(self, l):
        cfg, b = self.cfg, f"blk.{l}."
        D, H, hk, hv, C, r = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.head_dim_v, self.kv_lora, cfg.n_rot
        want = {"attn_norm": T(b + "attn_norm.weight", (D,), "vector"),
                "wkv_a": T(b + "attn_kv_a_mqa.weight", (C + r, D)),
                "kv_a_norm": T(b + "attn_kv_a_norm.weight", (C,), "vector"),
                "wo": T(b + "attn_output.weight", (D, H * hv))}
        if self.q_lora:
            want |= {"wq_a": T(b + "attn_q_a.weight", (self.q_lora, D)),
                     "q_a_norm": T(b + "attn_q_a_norm.weight", (self.q_lora,), "vector"),
                     "wq_b": T(b + "attn_q_b.weight", (H * hk, self.q_lora))}
        else:
            want["wq"] = T(b + "attn_q.weight", (H * hk, D))
        if self.split:  # products of their own, as llama.cpp computes them (quantised, per head)
            want |= {"wk_b": T(b + "attn_k_b.weight", (H, C, self.nope), "heads"),
                     "wv_b": T(b + "attn_v_b.weight", (H, hv, C), "heads")}
        else:
            want["wkv_b"] = T(b + "attn_kv_b.weight", (H * (self.nope + hv), C))
        return want

    def unread_tensors(self):
        n = self.cfg.n_layers
        return [t for l in range(n, n + self.n_nextn) for t in mtp_layer_tensors(self, l)]

    def ffn_tensors(self, l):
        want = super().ffn_tensors(l)
        if l in self.cfg.moe_layers:
            want["probs_b"] = T(f"blk.{l}.exp_probs_b.bias", (self.cfg.n_expert,), "vector", False)
        return want

    def prepare(self, lw) -> None:
        """The older attn_kv_b split into the per-head key and value up-projections, in float32 for
        the absorbed products; its type is kept (kv_b_type): llama.cpp multiplies the latents by it
        as a quantised product, so the cached latents are rounded as that product rounds them."""
        if lw.wkv_b is not None:
            cfg = self.cfg
            w = lw.wkv_b
            kv = dequantize(w.raw, w.qtype, w.shape).reshape(cfg.n_head, self.nope + cfg.head_dim_v, self.kv_lora)
            lw.wk_b = np.ascontiguousarray(kv[:, : self.nope].transpose(0, 2, 1))  # [H, C, nope]
            lw.wv_b = np.ascontiguousarray(kv[:, self.nope :])  # [H, v, C]
            lw.kv_b_type = w.qtype
            lw.wkv_b = None

    # -- compute ------------------------------------------------------------------------------------
    def make_rope(self, n_ctx):
        return Rope(self.cfg.n_rot, self.cfg.rope_base, n_ctx, style=self.rope_style, yarn=self.yarn)

    def layer_states(self):
        # per position and layer the latent and the shared rope key; the values are the latent
        return [LatentKV(self.kv_lora + self.cfg.n_rot, self.kv_lora)] * self.cfg.n_layers

    def attention(self, lw, l, x, step, rope):
        cfg, R = self.cfg, x.shape[0]
        H, C, nope = cfg.n_head, self.kv_lora, self.nope
        h = rmsnorm(x, lw.attn_norm, cfg.eps)  # [R, D]
        if self.q_lora:
            qa, kv = apply_all((lw.wq_a, lw.wkv_a), h)  # [R, Lq], [R, C + r]
            q = lw.wq_b(rmsnorm(qa, lw.q_a_norm, cfg.eps))  # [R, H*hk]
        else:
            q, kv = apply_all((lw.wq, lw.wkv_a), h)
        q = q.reshape(R, H, cfg.head_dim)
        c = rmsnorm(kv[:, :C], lw.kv_a_norm, cfg.eps)  # [R, C]
        if self.split:
            # q_nope absorbed into latent space: per head, W_kb [C, nope] @ q_nope [nope], a quantised product
            q_lat = matmul_heads(lw.wk_b, q[..., :nope])  # [R, H, C]
        else:
            # llama.cpp expands each latent through attn_kv_b (k = W_kb c, v = W_vb c, c rounded as that
            # product rounds its input): the same as caching c so rounded and absorbing W_kb into q in float
            c = ggml_activations(c, lw.kv_b_type, lw.wo.kernels)
            q_lat = np.einsum("hcn,rhn->rhc", lw.wk_b, q[..., :nope], optimize=True)  # [R, H, C]
        q_pe = step.rope(rope, np.ascontiguousarray(q[..., nope:]))  # [R, H, r]
        k_pe = step.rope(rope, kv[:, None, C:])  # [R, 1, r]
        # the cache holds (latent, rope key) per position; the values are the latent (v=None)
        o_lat = step.attend(l, np.concatenate([q_lat, q_pe], axis=-1), np.concatenate([c[:, None, :], k_pe], axis=-1),
                            None, self.kq_scale).reshape(R, H, C)  # [R, H, C]: attention-weighted latents
        if self.split:
            o = matmul_heads(lw.wv_b, o_lat)  # [R, H, v]
        else:
            o = np.einsum("hvc,rhc->rhv", lw.wv_b, o_lat, optimize=True).astype(np.float32)  # [R, H, v]
        return lw.wo(o.reshape(R, -1))

    def route(self, lw, h):
        return gate(h, lw.router, self.cfg.n_expert_used, func=self.func, bias=lw.probs_b, norm=self.norm_w,
                    scale=self.w_scale, groups=self.groups)

    # -- info -----------------------------------------------------------------------------------------
    def gating(self):
        parts = [self.func.replace("_", "-")]
        if self.groups:
            parts.append(f"top {self.groups[1]} of {self.groups[0]} groups")
        parts.append("top-k")
        if self.norm_w:
            parts.append("renormalised")
        if self.w_scale not in (0.0, 1.0):
            parts.append(f"scaled x{self.w_scale:g}")
        return ", ".join(parts) + (" (selection bias exp_probs_b)" if self.has_bias else "")

    def describe(self):
        d = super().describe()
        d["attention"] = (f"MLA: latent {self.kv_lora} + rope {self.cfg.n_rot} cached per token, "
                          f"q {'rank ' + str(self.q_lora) if self.q_lora else 'direct'}, "
                          f"{'attn_k_b/attn_v_b' if self.split else 'attn_kv_b'}")
        if self.yarn:
            d["rope"] += f", YaRN x{self.yarn.factor:g} from {self.yarn.n_ctx_orig}"
        return d | {"mtp_layers_skipped": self.n_nextn}


def _n_vocab(f) -> int:
    """The vocabulary size as llama.cpp's deepseek2 loader reads it to recognise a model: the
    vocab_size key, else the tokenizer's token list, else (a file without a tokenizer) the embedding rows."""
    v = f.get(f"{f.arch}.vocab_size", None)
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    toks = f.get("tokenizer.ggml.tokens", None)
    if toks is not None:
        return len(toks)
    tok = f.tensors.get("token_embd.weight")
    return int(tok.shape[0]) if tok is not None else 0
