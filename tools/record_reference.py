#!/usr/bin/env python3
"""Record llama.cpp's outputs on the tiny fixtures, as the reference the forward pass is tested against.

    python tools/record_reference.py [FIXTURE.gguf ...] [--out tests/golden]

For each fixture (default: every tests/fixtures/*.gguf) this writes tests/golden/<stem>.npz with
  prompt_text          0-d str array: the first of PROMPT_TEXTS that passes the noise screen
  greedy_prompt_ids    [Tp] int32    llama.cpp's tokenization of prompt_text (no BOS, no special parsing)
  mixed_ids            [Tm] int32    40 ids of every kind (byte tokens, merges, specials, unused ids)
  prompt_ids           [T]  int32    greedy_prompt_ids followed by mixed_ids, evaluated as one sequence
  logits               [T, V] f32    llama.cpp's logits at every position of prompt_ids
  greedy_ids           [24] int32    llama.cpp's greedy continuation of greedy_prompt_ids (its own
                                     sampler: top_k 1, temperature 0, no repeat penalty, EOS ignored)
  greedy_logits        [24, V] f32   the logits each greedy token was chosen from
  router_margin        [T] f32       per position, min over layers of the gap between the k-th and
  greedy_router_margin [24] f32      (k+1)-th router logit, from the float64 reference below
  tok_texts            [N] str       strings tokenized with the fixture's own vocab by llama.cpp
  tok_ids, tok_offsets               their ids, flat; text i is tok_ids[tok_offsets[i]:tok_offsets[i+1]]
  noise_spread         [S] f32       the noise screen's result, per seed (empty: nothing to perturb)
  llama_cpp_version    0-d str       llama-cpp-python version

llama.cpp runs with 2 threads, n_ctx 512, and an F32 KV cache (its default F16 cache adds rounding
that has nothing to do with the model file).

Near-ties in the router are the one thing that makes two correct implementations disagree by a
whole expert's output: if the k-th and (k+1)-th router logits are closer than the rounding error,
either expert may win. So this tool also runs its own float64 forward pass (written from
shared/notes/gguf-moe.md, independent of clutor) to (1) pick the mixed ids one by one so that no
position has a router gap under MIN_MARGIN, (2) record the gaps, and (3) check llama.cpp's logits
against it. The per-fixture summary printed at the end gives the median top-1/top-2 logit gap, the
smallest router gap, and max |llama.cpp - reference|.

Rounding is the other: where a sparse choice (glm-dsa's indexer keeps 8 keys of many) or an 8-bit
activation rounding sits near its boundary, a last-bit difference in one attention sum can move a
whole key's value and every logit after it. So each prompt is also screened on llama.cpp itself:
NoisyLlama (tools/llama_tensors.py) multiplies every attention layer's weighted sum by
1 + 1.2e-7 N(0, 1), N_SCREEN times; if llama.cpp's logits then move by more than SCREEN_SHARE of the
largest logit (half the quantised test bar) or any greedy token changes, the prompt cannot separate a
right implementation from a wrong one and the next of PROMPT_TEXTS is tried. The summary's last
column is the largest such move.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llama_tensors import NoisyLlama  # tools/, beside this file

ROOT = Path(__file__).resolve().parents[1]

# The fixed prompt texts, tried in order: a fixture takes the first one that passes the noise screen
# (screen() below; tests/fixtures/README.md lists the goldens that took another than the first).
PROMPT_TEXTS = (
    "The miller watched the river in 1961.\nx = 3.14 * r ** 2  # café 東京",
    "In the morning the baker opened her shop at 6:30.\ntotal = 2.5 * n  # naïve 東京",
    "Once upon a time, in a village by the sea, there lived an old fisherman (born 1901).",
    "def area(r):\n    return 3.14159 * r ** 2  # café\n",
)

TOK_TEXTS = [
    "Hello world",
    " Hello world",
    "  two leading spaces and trailing   ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "don't it's we'll they're I'm you've he'd",
    "DON'T IT'S WE'LL",
    "digits 0 12 345 6789 1234567890 3.14159 -42 1e-5",
    "for (int i = 0; i < n; i++) { sum += a[i]; }",
    "x = {'a': [1, 2, 3], \"b\": None}  # comment",
    "Français: « où est la gare ? » Deutsch: Straße, Größe",
    "Русский текст и ελληνικά",
    "日本語のテキストと中文",
    "emoji 🙂🎉👩‍🔬 and symbols ∑ √2 ≈ 1.414 ½",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>",
    "!!! ??? ... --- ***",
    "a",
    "",
]

N_MIXED = 40
N_GREEDY = 24
# Router gaps below this are treated as ties (llama.cpp's router logits differ from float64 ones by
# about 1e-3 on F16 files and a few 1e-2 on quantised files, where it rounds activations to 8 bits
# before every quantised dot product). The same holds for the final top-1/top-2 logit gap.
MIN_MARGIN = {"F16": 0.05, "F32": 0.05}
MIN_MARGIN_QUANT = 0.2
MIN_LOGIT_GAP = {"F16": 0.05, "F32": 0.05}
MIN_LOGIT_GAP_QUANT = 0.4
GGML_TYPE_F32 = 0
# The noise screen: llama.cpp itself, with last-bit noise in its attention (llama_tensors.NoisyLlama),
# must stay within half the quantised logits bar (mean |diff| <= 0.5% of the largest logit) in every
# one of N_SCREEN runs and keep its greedy tokens, or the prompt is too ill-conditioned to test against.
N_SCREEN = 16
SCREEN_SHARE = 0.0025


# ----------------------------------------------------------------------------------------------
# An independent float64 reference forward pass (olmoe / qwen2moe / qwen3moe), one token at a time.


@dataclass(frozen=True)
class _Hparams:
    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_used: int
    eps: float
    rope_base: float
    n_rot: int = 0              # RoPE dims per head (glm4moe: a part; deepseek2: the rope part)
    n_dense: int = 0            # leading dense layers
    gating: str = "softmax"
    norm_w: bool = False
    w_scale: float = 0.0
    n_group: int = 0
    n_group_used: int = 0
    kv_lora: int = 0            # deepseek2
    v_head: int = 0
    yarn: tuple | None = None   # (factor, original context)
    kq_scale: float = 0.0
    window: int = 0             # gpt-oss: sliding window of the even layers
    recurrent: tuple = ()       # qwen35moe / qwen3next: which layers are Gated DeltaNet
    ssm: tuple = ()             # (conv kernel, head size, k heads, v heads)
    still: tuple = ()           # qwen35moe: rotary pairs that text leaves at position 0 (M-RoPE's 4th section)
    kinds: tuple = ()           # nemotron_h_moe: per layer "ssm", "attention" or "moe"
    mamba: tuple = ()           # (conv kernel, d_inner, d_state, groups, heads)
    kq_norm: bool = False       # llama4: unweighted RMS norm of q and k after RoPE
    gemma: dict | None = None   # gemma4: per-layer window flags, KV heads, head sizes; RoPEs; soft-cap
    dsa: tuple = ()             # glm-dsa: (indexer heads, key length, top-k, per-layer "own indexer" flags)


def _arch_hparams(arch: str, kv, n_embd: int, n_head: int) -> dict:
    """What the newer architectures add to _Hparams, read from the file's keys (shared/notes/archs.md)."""
    if arch == "llama":
        return {"norm_w": True}
    if arch == "glm4moe":
        return {"n_rot": kv(f"{arch}.rope.dimension_count", 0), "n_dense": kv(f"{arch}.leading_dense_block_count", 0),
                "gating": {1: "softmax", 2: "sigmoid"}[kv(f"{arch}.expert_gating_func", 2) or 2],
                "norm_w": bool(kv(f"{arch}.expert_weights_norm", False)), "w_scale": kv(f"{arch}.expert_weights_scale", 0.0)}
    if arch in ("deepseek2", "glm-dsa"):
        mla = kv(f"{arch}.attention.key_length_mla") is not None
        hk = kv(f"{arch}.attention.key_length_mla" if mla else f"{arch}.attention.key_length")
        yarn, m = None, 1.0
        if kv(f"{arch}.rope.scaling.type") == "yarn":
            factor = kv(f"{arch}.rope.scaling.factor")
            yarn = (factor, kv(f"{arch}.rope.scaling.original_context_length"))
            m = 1 + kv(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0) * np.log(factor)
        return {"head_dim": hk, "n_head_kv": n_head, "n_rot": kv(f"{arch}.rope.dimension_count"),
                "n_dense": kv(f"{arch}.leading_dense_block_count", 0),
                # glm-dsa: an absent gating function is sigmoid
                "gating": {1: "softmax", 2: "sigmoid"}[kv(f"{arch}.expert_gating_func", 0) or (2 if arch == "glm-dsa" else 1)],
                "norm_w": bool(kv(f"{arch}.expert_weights_norm", False)), "w_scale": kv(f"{arch}.expert_weights_scale", 0.0),
                "n_group": kv(f"{arch}.expert_group_count", 0), "n_group_used": kv(f"{arch}.expert_group_used_count", 0),
                "kv_lora": kv(f"{arch}.attention.kv_lora_rank"),
                # glm-dsa's indexer: (heads, key length, top-k, which layers run their own)
                "dsa": (kv(f"{arch}.attention.indexer.head_count"), kv(f"{arch}.attention.indexer.key_length"),
                        kv(f"{arch}.attention.indexer.top_k"), tuple(kv(f"{arch}.attention.indexer.types", [])))
                if arch == "glm-dsa" else (),
                "v_head": kv(f"{arch}.attention.value_length_mla" if mla else f"{arch}.attention.value_length"),
                "yarn": yarn, "kq_scale": m * m / np.sqrt(hk)}
    if arch == "gpt-oss":
        f = kv(f"{arch}.rope.scaling.factor") if kv(f"{arch}.rope.scaling.type") == "yarn" else None
        n_rot = kv(f"{arch}.rope.dimension_count")
        return {"head_dim": n_rot, "n_rot": n_rot, "gating": "softmax_chosen", "window": kv(f"{arch}.attention.sliding_window"),
                "yarn": (f, kv(f"{arch}.rope.scaling.original_context_length")) if f else None}
    if arch in ("qwen35moe", "qwen3next"):
        n_layer = kv(f"{arch}.block_count") - kv(f"{arch}.nextn_predict_layers", 0)
        rec = kv(f"{arch}.attention.recurrent_layers")
        every = kv(f"{arch}.full_attention_interval", 4)
        recurrent = tuple(rec[:n_layer]) if rec is not None else tuple((l + 1) % every != 0 for l in range(n_layer))
        n_rot = kv(f"{arch}.rope.dimension_count")
        still = ()
        if arch == "qwen35moe":  # interleaved M-RoPE (ggml's imrope sectors); text gives the 4th section position 0
            sec = kv(f"{arch}.rope.dimension_sections")
            still = tuple(not ((i % sum(sec)) < 3 * sec[(i % sum(sec)) % 3]) for i in range(n_rot // 2))
        return {"n_layer": n_layer, "n_rot": n_rot, "recurrent": recurrent, "still": still, "norm_w": True,
                "ssm": (kv(f"{arch}.ssm.conv_kernel"), kv(f"{arch}.ssm.state_size"), kv(f"{arch}.ssm.group_count"),
                        kv(f"{arch}.ssm.time_step_rank"))}
    if arch == "llama4":  # chunked RoPE layers and NoPE layers (every 4th), MoE every interleave_moe_layer_step-th
        step = kv(f"{arch}.interleave_moe_layer_step")
        return {"n_rot": kv(f"{arch}.rope.dimension_count", n_embd // n_head), "gating": "llama4",
                "kinds": tuple("moe" if step and (l + 1) % step == 0 else "dense" for l in range(kv(f"{arch}.block_count"))),
                "kq_norm": kv(f"{arch}.expert_count") != 128}
    if arch == "minimax-m2":  # whole-vector q/k norms, partial NEOX RoPE, biased selection, always renormalised
        return {"n_rot": kv(f"{arch}.rope.dimension_count"), "norm_w": True,
                "gating": {1: "softmax", 2: "sigmoid"}[kv(f"{arch}.expert_gating_func")]}
    if arch == "ernie4_5-moe":  # NORM RoPE over the whole head, softmax + selection bias, always renormalised
        return {"n_dense": kv(f"{arch}.leading_dense_block_count", 0), "norm_w": True,
                "n_group": kv(f"{arch}.expert_group_count", 0), "n_group_used": kv(f"{arch}.expert_group_used_count", 0)}
    if arch == "bailingmoe2":  # fused qkv, per-head q/k norms, partial NEOX RoPE, grouped biased routing; MTP layers skipped
        return {"n_layer": kv(f"{arch}.block_count") - kv(f"{arch}.nextn_predict_layers", 0),
                "n_rot": kv(f"{arch}.rope.dimension_count"), "n_dense": kv(f"{arch}.leading_dense_block_count", 0),
                "gating": {1: "softmax", 2: "sigmoid"}[kv(f"{arch}.expert_gating_func")],
                "norm_w": bool(kv(f"{arch}.expert_weights_norm", False)), "w_scale": kv(f"{arch}.expert_weights_scale", 0.0),
                "n_group": kv(f"{arch}.expert_group_count", 0), "n_group_used": kv(f"{arch}.expert_group_used_count", 0)}
    if arch == "nemotron_h_moe":
        hkv, ff = kv(f"{arch}.attention.head_count_kv"), kv(f"{arch}.feed_forward_length")
        kinds = tuple("ssm" if h == 0 and f == 0 else "attention" if f == 0 else "moe" for h, f in zip(hkv, ff))
        return {"kinds": kinds, "n_head_kv": max(hkv), "gating": "sigmoid", "eps": kv(f"{arch}.attention.layer_norm_epsilon"),
                "norm_w": bool(kv(f"{arch}.expert_weights_norm", False)), "w_scale": kv(f"{arch}.expert_weights_scale", 0.0),
                "mamba": (kv(f"{arch}.ssm.conv_kernel"), kv(f"{arch}.ssm.inner_size"), kv(f"{arch}.ssm.state_size"),
                          kv(f"{arch}.ssm.group_count"), kv(f"{arch}.ssm.time_step_rank"))}
    if arch == "gemma4":
        swa = kv(f"{arch}.attention.sliding_window_pattern")
        hkv = kv(f"{arch}.attention.head_count_kv")
        hkv = hkv if isinstance(hkv, list) else [hkv] * len(swa)
        hd, hd_swa = kv(f"{arch}.attention.key_length"), kv(f"{arch}.attention.key_length_swa")
        return {"norm_w": True, "gemma": {
            "swa": swa, "hkv": hkv, "hd": [hd_swa if s else hd for s in swa], "window": kv(f"{arch}.attention.sliding_window"),
            "rot": [kv(f"{arch}.rope.dimension_count_swa") if s else kv(f"{arch}.rope.dimension_count") for s in swa],
            "base": [kv(f"{arch}.rope.freq_base_swa") if s else kv(f"{arch}.rope.freq_base") for s in swa],
            "softcap": kv(f"{arch}.final_logit_softcapping", 0.0) or 0.0}}
    return {}


class Reference:
    """Dequantised float64 weights and a KV cache; ``step`` appends one token, ``undo`` removes it."""

    def __init__(self, path: Path):
        from gguf import GGUFReader
        from gguf.quants import dequantize

        r = GGUFReader(path)

        def kv(key: str, default=None):
            f = r.fields.get(key)
            if f is None:
                return default
            if f.types[0].name == "STRING":
                return bytes(f.parts[-1]).decode()
            if f.types[0].name == "ARRAY":
                return [f.parts[i][0].item() for i in f.data]
            return f.parts[f.data[0]][0].item()

        arch = kv("general.architecture")
        n_embd, n_head = kv(f"{arch}.embedding_length"), kv(f"{arch}.attention.head_count")
        self.hp = _Hparams(**(dict(
            arch=arch,
            n_layer=kv(f"{arch}.block_count"),
            n_head=n_head,
            n_head_kv=kv(f"{arch}.attention.head_count_kv", n_head),
            head_dim=kv(f"{arch}.attention.key_length", n_embd // n_head),
            n_used=kv(f"{arch}.expert_used_count"),
            eps=kv(f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_base=kv(f"{arch}.rope.freq_base", 10000.0),
        ) | _arch_hparams(arch, kv, n_embd, n_head)))
        if self.hp.arch in ("glm4moe", "deepseek2", "glm-dsa"):  # MTP layers are not part of the forward pass
            self.hp = dataclasses.replace(self.hp, n_layer=self.hp.n_layer - kv(f"{arch}.nextn_predict_layers", 0))
        self.w = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in r.tensors}
        self.w = {k: v.reshape(v.shape[1:]) if v.ndim == 2 and v.shape[0] == 1 else v for k, v in self.w.items()}
        self.w.setdefault("output.weight", self.w["token_embd.weight"])  # tied
        self.k: list[list[np.ndarray]] = [[] for _ in range(self.hp.n_layer)]  # [L][t] -> [Hkv, hd]
        self.v: list[list[np.ndarray]] = [[] for _ in range(self.hp.n_layer)]
        self.states: list[dict] = [{}]  # Gated DeltaNet layers: after each token, {layer: (conv, S)}
        self.ik: list[list[np.ndarray]] = [[] for _ in range(self.hp.n_layer)]  # glm-dsa: indexer keys [L][t] -> [Di]
        self.dsa_margin = np.inf  # glm-dsa: this token's smallest indexer selection margin
        self.full_attention = False  # glm-dsa: attend every key (the check that the selection matters)

    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.hp.eps) * w

    def _rope(self, x: np.ndarray, pos: int) -> np.ndarray:  # x [H, hd], NEOX pairs (i, i + hd/2)
        if self.hp.arch in ("llama", "deepseek2", "glm-dsa", "ernie4_5-moe"):
            return self._rope_norm(x, pos)
        n = self.hp.n_rot or x.shape[-1]  # glm4moe rotates the first n_rot dims only
        half = n // 2
        freq = self.hp.rope_base ** (-2.0 * np.arange(half) / n)
        if self.hp.still:
            freq = np.where(self.hp.still, 0.0, freq)
        mag = 1.0
        if self.hp.yarn:  # gpt-oss: YaRN frequencies, and cos/sin scaled by 1 + 0.1 ln(factor)
            freq = self._yarn(freq, n)
            mag = 1 + 0.1 * np.log(self.hp.yarn[0])
        theta = pos * freq
        c, s = np.cos(theta) * mag, np.sin(theta) * mag
        a, b = x[:, :half], x[:, half:n]
        return np.concatenate([a * c - b * s, a * s + b * c, x[:, n:]], axis=-1)

    def _rope_norm(self, x: np.ndarray, pos: int) -> np.ndarray:  # x [H, n], adjacent pairs (2i, 2i + 1)
        n = x.shape[-1]
        freq = self.hp.rope_base ** (-2.0 * np.arange(n // 2) / n)
        if self.hp.yarn:
            freq = self._yarn(freq, n)
        theta = pos * freq
        c, s = np.cos(theta), np.sin(theta)
        a, b = x[:, 0::2], x[:, 1::2]
        out = np.empty_like(x)
        out[:, 0::2], out[:, 1::2] = a * c - b * s, a * s + b * c
        return out

    def _yarn(self, freq: np.ndarray, n: int) -> np.ndarray:
        """YaRN: slow dims interpolated by the factor, fast ones kept, a linear ramp between."""
        factor, orig = self.hp.yarn
        dim = lambda beta: n * np.log(orig / (beta * 2 * np.pi)) / (2 * np.log(self.hp.rope_base))  # noqa: E731
        lo, hi = max(0.0, np.floor(dim(32.0))), min(n - 1.0, np.ceil(dim(1.0)))
        ramp = 1 - np.clip((np.arange(n // 2) - lo) / max(0.001, hi - lo), 0, 1)
        return freq / factor * (1 - ramp) + freq * ramp

    def _attention(self, il: int, h: np.ndarray, pos: int) -> np.ndarray:
        """Self-attention output (before attn_output) for the normed input h [D]; appends to the cache."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        if hp.arch in ("deepseek2", "glm-dsa"):  # MLA written out as plain multi-head attention over expanded keys
            q = (w[b + "attn_q_b.weight"] @ self._rms(w[b + "attn_q_a.weight"] @ h, w[b + "attn_q_a_norm.weight"])
                 if b + "attn_q_a.weight" in w else w[b + "attn_q.weight"] @ h).reshape(hp.n_head, hp.head_dim)
            kva = w[b + "attn_kv_a_mqa.weight"] @ h
            c = self._rms(kva[: hp.kv_lora], w[b + "attn_kv_a_norm.weight"])
            k_pe = self._rope(kva[None, hp.kv_lora :], pos)[0]
            nope = hp.head_dim - hp.n_rot
            if b + "attn_k_b.weight" in w:
                k_nope = np.einsum("hcn,c->hn", w[b + "attn_k_b.weight"], c)
                v = np.einsum("hvc,c->hv", w[b + "attn_v_b.weight"], c)
            else:
                kv = (w[b + "attn_kv_b.weight"] @ c).reshape(hp.n_head, nope + hp.v_head)
                k_nope, v = kv[:, :nope], kv[:, nope:]
            q = np.concatenate([q[:, :nope], self._rope(q[:, nope:], pos)], axis=-1)
            self.k[il].append(np.concatenate([k_nope, np.repeat(k_pe[None], hp.n_head, 0)], axis=-1))
            self.v[il].append(v)
            K, V = np.stack(self.k[il]), np.stack(self.v[il])  # [T, H, hk], [T, H, hv]
            s = np.einsum("hd,thd->ht", q, K) * hp.kq_scale
            if hp.dsa:
                s[:, ~self._dsa_keys(il, h, pos)] = -np.inf
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            return np.einsum("ht,thd->hd", p, V).reshape(-1)
        if b + "attn_qkv.weight" in w:  # bailingmoe2: rows q | k | v
            qkv = w[b + "attn_qkv.weight"] @ h
            qd, kd = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
            q, k, v = qkv[:qd], qkv[qd : qd + kd], qkv[qd + kd :]
        else:
            q, k, v = w[b + "attn_q.weight"] @ h, w[b + "attn_k.weight"] @ h, w[b + "attn_v.weight"] @ h
        if b + "attn_q.bias" in w:
            q, k, v = q + w[b + "attn_q.bias"], k + w[b + "attn_k.bias"], v + w[b + "attn_v.bias"]
        if hp.arch in ("olmoe", "minimax-m2"):  # QK-norm over the whole vectors
            q, k = self._rms(q, w[b + "attn_q_norm.weight"]), self._rms(k, w[b + "attn_k_norm.weight"])
        q = q.reshape(hp.n_head, hp.head_dim)
        k = k.reshape(hp.n_head_kv, hp.head_dim)
        v = v.reshape(hp.n_head_kv, -1)
        if hp.arch in ("qwen3moe", "glm4moe", "bailingmoe2") and b + "attn_q_norm.weight" in w:  # QK-norm per head
            q, k = self._rms(q, w[b + "attn_q_norm.weight"]), self._rms(k, w[b + "attn_k_norm.weight"])
        q, k = self._rope(q, pos), self._rope(k, pos)
        self.k[il].append(k)
        self.v[il].append(v)
        K, V = np.stack(self.k[il]), np.stack(self.v[il])  # [T, Hkv, hd]
        group = hp.n_head // hp.n_head_kv
        K, V = np.repeat(K, group, axis=1), np.repeat(V, group, axis=1)  # [T, H, hd]
        s = np.einsum("hd,thd->ht", q, K) / np.sqrt(hp.head_dim)  # [H, T]
        if hp.window and il % 2 == 0:  # gpt-oss: even layers see the last `window` positions only
            s[:, : max(0, len(K) - hp.window)] = -np.inf
        sink = w.get(b + "attn_sinks.weight")
        m = s.max(axis=-1, keepdims=True) if sink is None else np.maximum(s.max(axis=-1, keepdims=True), sink[:, None])
        p = np.exp(s - m)
        den = p.sum(axis=-1, keepdims=True) + (0.0 if sink is None else np.exp(sink[:, None] - m))
        out = np.einsum("ht,thd->hd", p / den, V).reshape(-1)
        return out

    def _dsa_keys(self, il: int, h: np.ndarray, pos: int) -> np.ndarray:
        """glm-dsa: which of the keys 0 .. pos the query at pos attends (bool [pos + 1]), from layer il's
        lightning indexer (a shared layer: the last full layer's choice for this token), as llama.cpp's
        graph computes it (src/models/glm-dsa.cpp): q = W_iqb rmsnorm(W_qa h), k = LayerNorm(W_ik h) (eps 0),
        both NORM-RoPE'd on their first n_rot dims (the Hadamard rotation llama.cpp adds leaves every dot
        product as it is), score_j = sum_h relu(q_h . k_j) (W_iproj h)_h / sqrt(Di Hi), the top-k scores
        (ties: GCC's std::partial_sort, as ggml_top_k). Also lowers self.dsa_margin to how near the k-th
        choice is to the next one (relative to the row's largest |score|)."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        n_head, Di, top_k, types = hp.dsa
        if types and not types[il]:
            self.ik[il].append(None)
            return self._dsa_sel
        qr = self._rms(w[b + "attn_q_a.weight"] @ h, w[b + "attn_q_a_norm.weight"])
        q = (w[b + "indexer.attn_q_b.weight"] @ qr).reshape(n_head, Di)
        k = w[b + "indexer.attn_k.weight"] @ h
        k = (k - k.mean()) / np.sqrt(np.mean((k - k.mean()) ** 2))
        k = k * w.get(b + "indexer.k_norm.weight", 1.0) + w.get(b + "indexer.k_norm.bias", 0.0)
        r = hp.n_rot
        q = np.concatenate([self._rope(q[:, :r], pos), q[:, r:]], axis=-1)
        k = np.concatenate([self._rope(k[None, :r], pos)[0], k[r:]])
        self.ik[il].append(k)
        wts = (w[b + "indexer.proj.weight"] @ h) / np.sqrt(Di * n_head)
        qk = q @ np.stack(self.ik[il]).T  # [Hi, pos + 1]
        score = (np.maximum(qk, 0.0) * wts[:, None]).sum(0)
        sel = np.ones(pos + 1, bool)
        if pos + 1 > top_k and not self.full_attention:
            chosen = _partial_sort_first(score, top_k)
            sel[:] = False
            sel[chosen] = True
            kth, nxt = score[sel].min(), score[~sel].max()
            scale = max(np.abs(score).max(), 1e-30)
            if kth == nxt == 0.0:  # a tie at exactly 0 (every head's dot <= 0): how far from a positive score
                zero = (score == 0.0) & np.all(qk <= 0, axis=0)
                gap = np.min(-qk[:, zero] * np.abs(wts)[:, None]) if zero.any() else 0.0
            else:
                gap = kth - nxt
            self.dsa_margin = min(self.dsa_margin, 40.0 * gap / scale)
        self._dsa_sel = sel
        return sel

    def _gated_delta_net(self, il: int, h: np.ndarray, state: dict) -> np.ndarray:
        """One token through Gated DeltaNet layer il (shared/notes/archs.md), one step of the plain
        recurrence S <- e^g S; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(dk)."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        K, hd, nk, nv = hp.ssm
        qkv, z = w[b + "attn_qkv.weight"] @ h, w[b + "attn_gate.weight"] @ h
        if hp.arch == "qwen35moe":
            beta, a = w[b + "ssm_beta.weight"] @ h, w[b + "ssm_alpha.weight"] @ h
        else:  # fused: per k head, its group's b then its group's a
            ba = (w[b + "ssm_ba.weight"] @ h).reshape(nk, 2, nv // nk)
            beta, a = ba[:, 0].reshape(-1), ba[:, 1].reshape(-1)
        beta = 1 / (1 + np.exp(-beta))
        g = w[b + "ssm_a"] * np.logaddexp(0, a + w[b + "ssm_dt.bias"])
        conv, S = state.get(il, (np.zeros((len(qkv), K - 1)), np.zeros((nv, hd, hd))))
        window = np.concatenate([conv, qkv[:, None]], axis=1)  # [C, K]
        y = np.sum(window * w[b + "ssm_conv1d.weight"], axis=1)
        y = y / (1 + np.exp(-y))
        q, k, v = y[: nk * hd].reshape(nk, hd), y[nk * hd : 2 * nk * hd].reshape(nk, hd), y[2 * nk * hd :].reshape(nv, hd)
        q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + hp.eps)
        k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + hp.eps)
        kmap = np.arange(nv) % nk if hp.arch == "qwen35moe" else np.arange(nv) // (nv // nk)
        q, k = q[kmap], k[kmap]
        S = S * np.exp(g)[:, None, None]
        d = (v - np.einsum("hkv,hk->hv", S, k)) * beta[:, None]
        S = S + k[:, :, None] * d[:, None, :]
        o = np.einsum("hkv,hk->hv", S, q) / np.sqrt(hd)
        state[il] = (window[:, 1:], S)
        o = self._rms(o, w[b + "ssm_norm.weight"]) * (z.reshape(nv, hd) / (1 + np.exp(-z.reshape(nv, hd))))
        return w[b + "ssm_out.weight"] @ o.reshape(-1)

    def _mamba2(self, il: int, h: np.ndarray, state: dict) -> np.ndarray:
        """One token through a Mamba-2 layer: conv window + bias + silu over xBC, then the plain scan
        h <- exp(dt A) h + dt x B^T, y = h C + D x, y * silu(z), RMS norm per group, out."""
        w, b = self.w, f"blk.{il}."
        K, di, N, G, H = self.hp.mamba
        hd = di // H
        zxbcdt = w[b + "ssm_in.weight"] @ h
        z, xbc, dt = zxbcdt[:di], zxbcdt[di : 2 * di + 2 * G * N], zxbcdt[2 * di + 2 * G * N :]
        conv, S = state.get(il, (np.zeros((len(xbc), K - 1)), np.zeros((H, hd, N))))
        window = np.concatenate([conv, xbc[:, None]], axis=1)
        y = np.sum(window * w[b + "ssm_conv1d.weight"], axis=1) + w[b + "ssm_conv1d.bias"]
        y = y / (1 + np.exp(-y))
        x, B, C = y[:di].reshape(H, hd), y[di : di + G * N].reshape(G, N), y[di + G * N :].reshape(G, N)
        g = np.arange(H) // (H // G)
        dt = np.logaddexp(0, dt + w[b + "ssm_dt.bias"])
        A = w[b + "ssm_a"].reshape(H)
        S = S * np.exp(dt * A)[:, None, None] + (dt[:, None] * x)[:, :, None] * B[g][:, None, :]
        state[il] = (window[:, 1:], S)
        out = np.einsum("hdn,hn->hd", S, C[g]) + x * w[b + "ssm_d"].reshape(H, 1)
        out = out * (z.reshape(H, hd) / (1 + np.exp(-z.reshape(H, hd))))
        out = self._rms(out.reshape(G, di // G), w[b + "ssm_norm.weight"]).reshape(-1)
        return w[b + "ssm_out.weight"] @ out

    def _nope_attention(self, il: int, h: np.ndarray) -> np.ndarray:
        """Nemotron-H's attention: GQA with no positional encoding."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        hd = hp.head_dim
        q = (w[b + "attn_q.weight"] @ h).reshape(hp.n_head, hd)
        self.k[il].append((w[b + "attn_k.weight"] @ h).reshape(hp.n_head_kv, hd))
        self.v[il].append((w[b + "attn_v.weight"] @ h).reshape(hp.n_head_kv, hd))
        K = np.repeat(np.stack(self.k[il]), hp.n_head // hp.n_head_kv, axis=1)
        V = np.repeat(np.stack(self.v[il]), hp.n_head // hp.n_head_kv, axis=1)
        s = np.einsum("hd,thd->ht", q, K) / np.sqrt(hd)
        p = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), V).reshape(-1)
        return w[b + "attn_output.weight"] @ o + w.get(b + "attn_output.bias", 0.0)

    def _nemotron_layer(self, il: int, x: np.ndarray, state: dict) -> tuple[np.ndarray, float]:
        """x + the layer's one mixer (Mamba-2, attention or MoE) of rms_norm(x)."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        h = self._rms(x, w[b + "attn_norm.weight"])
        kind = hp.kinds[il]
        if kind != "attention":
            self.k[il].append(None)
            self.v[il].append(None)
        if kind == "ssm":
            return x + self._mamba2(il, h, state), np.inf
        if kind == "attention":
            return x + self._nope_attention(il, h), np.inf
        sel, gate, m = self._route(b, h)
        relu2 = lambda a: np.maximum(a, 0) ** 2  # noqa: E731
        y = sum(g * (w[b + "ffn_down_exps.weight"][e] @ relu2(w[b + "ffn_up_exps.weight"][e] @ h)) for e, g in zip(sel, gate))
        y = y + w[b + "ffn_down_shexp.weight"] @ relu2(w[b + "ffn_up_shexp.weight"] @ h)
        return x + y, m

    # Llama 4's hard-coded attention chunk and temperature tuning (llama.cpp's load_arch_hparams);
    # attributes so that a test can shrink them to reach a chunk's edge within a short prompt
    chunk = 8192
    temp_floor = 8192

    def _llama4_layer(self, il: int, x: np.ndarray, pos: int) -> tuple[np.ndarray, float]:
        """x + attention + FFN of Llama 4's layer il: RoPE (adjacent pairs, frequencies divided by
        rope_freqs) and the unweighted q/k RMS norm after it in 3 of 4 layers, which attend within
        their chunk of ``chunk`` positions; every 4th layer has no RoPE, attends to every position and
        scales q by log(floor((pos + 1) / temp_floor) + 1) * 0.1 + 1. A MoE layer: top-k of the raw
        router logits, each chosen expert reads its input times sigmoid(logit), plus a shared expert."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        hd = hp.head_dim
        h = self._rms(x, w[b + "attn_norm.weight"])
        q = (w[b + "attn_q.weight"] @ h).reshape(hp.n_head, hd)
        k = (w[b + "attn_k.weight"] @ h).reshape(hp.n_head_kv, hd)
        v = (w[b + "attn_v.weight"] @ h).reshape(hp.n_head_kv, hd)
        rope = (il + 1) % 4 != 0
        if rope:
            ff = w.get("rope_freqs.weight", np.ones(hd // 2))
            freq = hp.rope_base ** (-2.0 * np.arange(hd // 2) / hd) / ff
            c, s_ = np.cos(pos * freq), np.sin(pos * freq)

            def rot(t):
                out = np.empty_like(t)
                out[:, 0::2] = t[:, 0::2] * c - t[:, 1::2] * s_
                out[:, 1::2] = t[:, 0::2] * s_ + t[:, 1::2] * c
                return out
            q, k = rot(q), rot(k)
            if hp.kq_norm:
                q = q / np.sqrt(np.mean(q * q, -1, keepdims=True) + hp.eps)
                k = k / np.sqrt(np.mean(k * k, -1, keepdims=True) + hp.eps)
        else:
            q = q * (np.log(np.floor((pos + 1.0) / self.temp_floor) + 1.0) * 0.1 + 1.0)
        self.k[il].append(k)
        self.v[il].append(v)
        K = np.repeat(np.stack(self.k[il]), hp.n_head // hp.n_head_kv, axis=1)
        V = np.repeat(np.stack(self.v[il]), hp.n_head // hp.n_head_kv, axis=1)
        sc = np.einsum("hd,thd->ht", q, K) / np.sqrt(hd)
        if il % 4 < 3:  # chunked: keys of the query's own chunk only
            sc[:, : (pos // self.chunk) * self.chunk] = -np.inf
        p = np.exp(sc - sc.max(-1, keepdims=True))
        o = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), V).reshape(-1)
        x = x + w[b + "attn_output.weight"] @ o
        h2 = self._rms(x, w[b + "ffn_norm.weight"])
        swiglu = lambda g, u, d, t: w[d] @ ((w[g] @ t) / (1 + np.exp(-(w[g] @ t))) * (w[u] @ t))  # noqa: E731
        if hp.kinds[il] == "dense":
            return x + swiglu(b + "ffn_gate.weight", b + "ffn_up.weight", b + "ffn_down.weight", h2), np.inf
        r = w[b + "ffn_gate_inp.weight"] @ h2
        order = np.argsort(-r)
        margin = r[order[hp.n_used - 1]] - r[order[hp.n_used]]
        y = swiglu(b + "ffn_gate_shexp.weight", b + "ffn_up_shexp.weight", b + "ffn_down_shexp.weight", h2)
        for e in order[: hp.n_used]:
            t = h2 / (1 + np.exp(-r[e]))
            a = w[b + "ffn_gate_exps.weight"][e] @ t
            y = y + w[b + "ffn_down_exps.weight"][e] @ (a / (1 + np.exp(-a)) * (w[b + "ffn_up_exps.weight"][e] @ t))
        return x + y, float(margin)

    def _gated_attention(self, il: int, h: np.ndarray, pos: int) -> np.ndarray:
        """Full attention of qwen35moe / qwen3next: attn_q rows per head [q | gate], per-head q/k norms,
        partial NEOX RoPE, the output times sigmoid(gate)."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        hd = hp.head_dim
        qg = (w[b + "attn_q.weight"] @ h).reshape(hp.n_head, 2 * hd)
        q, gate = self._rms(qg[:, :hd], w[b + "attn_q_norm.weight"]), qg[:, hd:]
        k = self._rms((w[b + "attn_k.weight"] @ h).reshape(hp.n_head_kv, hd), w[b + "attn_k_norm.weight"])
        v = (w[b + "attn_v.weight"] @ h).reshape(hp.n_head_kv, hd)
        q, k = self._rope(q, pos), self._rope(k, pos)
        self.k[il].append(k)
        self.v[il].append(v)
        K = np.repeat(np.stack(self.k[il]), hp.n_head // hp.n_head_kv, axis=1)
        V = np.repeat(np.stack(self.v[il]), hp.n_head // hp.n_head_kv, axis=1)
        s = np.einsum("hd,thd->ht", q, K) / np.sqrt(hd)
        p = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), V)
        return w[b + "attn_output.weight"] @ (o * (1 / (1 + np.exp(-gate)))).reshape(-1)

    def _gemma4_layer(self, il: int, x: np.ndarray, pos: int) -> tuple[np.ndarray, float]:
        """One token through Gemma 4 layer il (shared/notes/archs.md): QK-normed attention (V = K where
        attn_v is absent, V normed without weight), scale 1, window layers masked; a shared GELU MLP
        and routed GELU experts, each post-normed, summed, post-normed."""
        hp, w, b, g = self.hp, self.w, f"blk.{il}.", self.hp.gemma
        H, Hkv, hd = hp.n_head, g["hkv"][il], g["hd"][il]
        h = self._rms(x, w[b + "attn_norm.weight"])
        q = self._rms((w[b + "attn_q.weight"] @ h).reshape(H, hd), w[b + "attn_q_norm.weight"])
        kp = (w[b + "attn_k.weight"] @ h).reshape(Hkv, hd)
        vp = (w[b + "attn_v.weight"] @ h).reshape(Hkv, hd) if b + "attn_v.weight" in w else kp
        k, v = self._rms(kp, w[b + "attn_k_norm.weight"]), self._rms(vp, 1.0)
        n = g["rot"][il]
        freq = g["base"][il] ** (-2.0 * np.arange(n // 2) / n)
        if not g["swa"][il]:
            freq = freq / w["rope_freqs.weight"]
        def rope(t):
            c, s = np.cos(pos * freq), np.sin(pos * freq)
            a, bb = t[:, : n // 2], t[:, n // 2 : n]
            return np.concatenate([a * c - bb * s, a * s + bb * c, t[:, n:]], axis=-1)
        q, k = rope(q), rope(k)
        self.k[il].append(k)
        self.v[il].append(v)
        K, V = np.stack(self.k[il]), np.stack(self.v[il])  # [T, Hkv, hd]
        K, V = np.repeat(K, H // Hkv, axis=1), np.repeat(V, H // Hkv, axis=1)
        s = np.einsum("hd,thd->ht", q, K)  # scale 1
        if g["swa"][il]:
            s[:, : max(0, len(K) - g["window"])] = -np.inf
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        o = np.einsum("ht,thd->hd", p / p.sum(axis=-1, keepdims=True), V).reshape(-1)
        x = x + self._rms(w[b + "attn_output.weight"] @ o, w[b + "post_attention_norm.weight"])
        gelu = lambda t: 0.5 * t * (1 + np.tanh(np.sqrt(2 / np.pi) * (t + 0.044715 * t ** 3)))  # noqa: E731
        m = self._rms(x, w[b + "ffn_norm.weight"])
        y = w[b + "ffn_down.weight"] @ (gelu(w[b + "ffn_gate.weight"] @ m) * (w[b + "ffn_up.weight"] @ m))
        margin = np.inf
        if b + "ffn_gate_inp.weight" in w:
            r = self._rms(x, 1.0) / np.sqrt(len(x)) * w[b + "ffn_gate_inp.scale"]
            sel, gate, margin = self._route(b, r)
            h2 = self._rms(x, w[b + "pre_ffw_norm_2.weight"])
            gu = w[b + "ffn_gate_up_exps.weight"]
            F = gu.shape[1] // 2
            ye = np.zeros_like(x)
            for e, gw in zip(sel, gate):
                a = gu[e] @ h2
                ye += gw * w.get(b + "ffn_down_exps.scale", np.ones(gu.shape[0]))[e] * (
                    w[b + "ffn_down_exps.weight"][e] @ (gelu(a[:F]) * a[F:]))
            y = self._rms(y, w[b + "post_ffw_norm_1.weight"]) + self._rms(ye, w[b + "post_ffw_norm_2.weight"])
        x = x + self._rms(y, w[b + "post_ffw_norm.weight"])
        if b + "layer_output_scale.weight" in w:
            x = x * w[b + "layer_output_scale.weight"]
        return x, margin

    def _route(self, b: str, h2: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """(experts, weights, margin): margin = how far (in router-logit units) the k-th choice is from
        the next, so that a rounding error of that size could flip it."""
        hp, w = self.hp, self.w
        r = w[b + "ffn_gate_inp.weight"] @ h2  # [E]
        if hp.gating == "softmax_chosen":  # gpt-oss: top-k of logits + bias, softmax over the chosen
            r = r + w[b + "ffn_gate_inp.bias"]
            order = np.argsort(-r)
            sel = order[: hp.n_used]
            g = np.exp(r[sel] - r[sel].max())
            return sel, g / g.sum(), r[order[hp.n_used - 1]] - r[order[hp.n_used]]
        if hp.gating == "softmax" and b + "exp_probs_b.bias" not in w and hp.n_group <= 1:
            order = np.argsort(-r)
            margin = r[order[hp.n_used - 1]] - r[order[hp.n_used]]
            prob = np.exp(r - r.max())
            prob /= prob.sum()
            sel = order[: hp.n_used]
            gate = prob[sel]
            if hp.arch in ("qwen3moe", "llama") or hp.norm_w:
                gate = gate / gate.sum()
            if hp.w_scale not in (0.0, 1.0):
                gate = gate * hp.w_scale
            return sel, gate, margin
        if hp.gating == "sigmoid":
            prob = 1 / (1 + np.exp(-r))
            slope = 0.25  # d sigmoid / d logit <= 1/4: a logit error e moves a probability by <= e/4
        else:
            prob = np.exp(r - r.max())
            prob /= prob.sum()
            slope = 0.5
        score = prob + w.get(b + "exp_probs_b.bias", 0.0)
        margins = []
        if hp.n_group > 1:
            g = score.reshape(hp.n_group, -1)
            gs = np.sort(g, axis=-1)[:, -2:].sum(-1)
            go = np.argsort(-gs)
            margins.append((gs[go[hp.n_group_used - 1]] - gs[go[hp.n_group_used]]) / (2 * slope))
            keep = np.zeros(hp.n_group, bool)
            keep[go[: hp.n_group_used]] = True
            score = np.where(np.repeat(keep, g.shape[1]), score, -np.inf)
        order = np.argsort(-score)
        a, b2 = order[hp.n_used - 1], order[hp.n_used]
        if hp.gating == "softmax":  # a logit error e moves softmax's p by at most ~2 e p: small ones move little
            slope = min(slope, 2.0 * (prob[a] + prob[b2]))
        margins.append((score[a] - score[b2]) / slope)
        sel = order[: hp.n_used]
        gate = prob[sel]
        if hp.norm_w:
            gate = gate / gate.sum()
        if hp.w_scale not in (0.0, 1.0):
            gate = gate * hp.w_scale
        return sel, gate, float(min(margins))

    def step(self, token: int) -> tuple[np.ndarray, float]:
        """Logits [V] after ``token`` and the smallest k-th/(k+1)-th router gap over the layers."""
        hp, w = self.hp, self.w
        pos = len(self.k[0])
        x = w["token_embd.weight"][token].copy()  # [D]
        if hp.gemma:
            x = x * np.sqrt(len(x))
        margin = np.inf
        self.dsa_margin = np.inf
        state = {l: (c.copy(), s.copy()) for l, (c, s) in self.states[-1].items()}
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            if hp.arch == "llama4":
                x, m = self._llama4_layer(il, x, pos)
                margin = min(margin, m)
                continue
            if hp.gemma:
                x, m = self._gemma4_layer(il, x, pos)
                margin = min(margin, m)
                continue
            if hp.kinds:
                x, m = self._nemotron_layer(il, x, state)
                margin = min(margin, m)
                continue
            h = self._rms(x, w[b + "attn_norm.weight"])
            if hp.recurrent:
                if hp.recurrent[il]:
                    self.k[il].append(None)
                    self.v[il].append(None)
                    x = x + self._gated_delta_net(il, h, state)
                else:
                    x = x + self._gated_attention(il, h, pos)
            else:
                x = x + w[b + "attn_output.weight"] @ self._attention(il, h, pos)
            if b + "attn_output.bias" in w:
                x = x + w[b + "attn_output.bias"]
            h2 = self._rms(x, w[b + ("post_attention_norm.weight" if hp.arch in ("glm4moe", "gpt-oss", "qwen35moe", "qwen3next")
                                      else "ffn_norm.weight")])
            if il < hp.n_dense:
                a = w[b + "ffn_gate.weight"] @ h2
                x = x + w[b + "ffn_down.weight"] @ (a / (1 + np.exp(-a)) * (w[b + "ffn_up.weight"] @ h2))
                continue
            sel, gate, m = self._route(b, h2)
            margin = min(margin, m)
            y = np.zeros_like(x)
            if b + "ffn_gate_up_exps.weight" in w:  # fused: each expert's gate rows, then its up rows
                F = w[b + "ffn_gate_up_exps.weight"].shape[1] // 2
                w[b + "ffn_gate_exps.weight"] = w[b + "ffn_gate_up_exps.weight"][:, :F]
                w[b + "ffn_up_exps.weight"] = w[b + "ffn_gate_up_exps.weight"][:, F:]
            for e, g in zip(sel, gate):
                a = w[b + "ffn_gate_exps.weight"][e] @ h2
                u = w[b + "ffn_up_exps.weight"][e] @ h2
                if hp.arch == "gpt-oss":  # per-expert biases, clamped SwiGLU
                    a, u = np.minimum(a + w[b + "ffn_gate_exps.bias"][e], 7.0), np.clip(u + w[b + "ffn_up_exps.bias"][e], -7, 7)
                    act = a / (1 + np.exp(-1.702 * a)) * (u + 1)
                    y += g * (w[b + "ffn_down_exps.weight"][e] @ act + w[b + "ffn_down_exps.bias"][e])
                    continue
                y += g * (w[b + "ffn_down_exps.weight"][e] @ (a / (1 + np.exp(-a)) * u))
            if b + "ffn_gate_shexp.weight" in w:
                a = w[b + "ffn_gate_shexp.weight"] @ h2
                u = w[b + "ffn_up_shexp.weight"] @ h2
                shared = w[b + "ffn_down_shexp.weight"] @ (a / (1 + np.exp(-a)) * u)
                if hp.arch in ("qwen2moe", "qwen35moe", "qwen3next"):  # gated by sigmoid(w . h)
                    shared = shared / (1 + np.exp(-(w[b + "ffn_gate_inp_shexp.weight"] @ h2)))
                y += shared
            x = x + y
        self.states.append(state)
        margin = min(margin, self.dsa_margin)
        logits = w["output.weight"] @ self._rms(x, w["output_norm.weight"])
        if hp.gemma and hp.gemma["softcap"]:
            c = hp.gemma["softcap"]
            logits = c * np.tanh(logits / c)
        return logits, float(margin)

    def undo(self) -> None:
        for il in range(self.hp.n_layer):
            self.k[il].pop()
            self.v[il].pop()
            if self.ik[il]:
                self.ik[il].pop()
        self.states.pop()

    def reset(self) -> None:
        for il in range(self.hp.n_layer):
            self.k[il].clear()
            self.v[il].clear()
            self.ik[il].clear()
        self.states = [{}]

    def run(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Logits [T, V] and router margins [T] of ``ids`` from an empty cache."""
        self.reset()
        out = [self.step(t) for t in ids]
        return np.stack([o[0] for o in out]), np.array([o[1] for o in out])


def _partial_sort_first(score: np.ndarray, k: int) -> list[int]:
    """The indices std::partial_sort(idx, idx + k, idx + n, score greater) leaves in idx[:k], as GCC's
    libstdc++ computes it (std::__heap_select: a heap of the first k indices, then every later index
    whose score is strictly greater than the heap's top replaces it); written from libstdc++'s
    bits/stl_heap.h, independently of clutor/model/kernels/dsa.py."""
    idx = list(range(len(score)))
    less = lambda a, b: score[a] > score[b]  # noqa: E731  (the comparator ggml_top_k passes)

    def adjust(first_hole: int, n: int, value: int) -> None:
        hole = top = first_hole
        child = hole
        while child < (n - 1) // 2:
            child = 2 * (child + 1)
            if less(idx[child], idx[child - 1]):
                child -= 1
            idx[hole] = idx[child]
            hole = child
        if n % 2 == 0 and child == (n - 2) // 2:
            child = 2 * (child + 1)
            idx[hole] = idx[child - 1]
            hole = child - 1
        parent = (hole - 1) // 2
        while hole > top and less(idx[parent], value):
            idx[hole] = idx[parent]
            hole = parent
            parent = (hole - 1) // 2
        idx[hole] = value

    if k > 1:
        for parent in range((k - 2) // 2, -1, -1):
            adjust(parent, k, idx[parent])
    for i in range(k, len(score)):
        if less(idx[i], idx[0]):
            value, idx[i] = idx[i], idx[0]
            adjust(0, k, value)
    return idx[:k]


def pick_mixed_ids(
    ref: Reference, prefix: list[int], n_vocab: int, min_margin: float, min_gap: float, n: int = N_MIXED
) -> list[int]:
    """``n`` ids of every kind, appended after ``prefix``, each chosen so that neither the router
    nor the final argmax is near a tie at its position. Candidates: byte tokens, the last ids
    (specials, unused), then a fixed pseudo-random spread; a candidate that makes a near-tie is skipped."""
    rng = np.random.default_rng(1234)
    wanted = [0, 1, 10, 32, 65, 97, 200, 255, 256, 257, n_vocab - 1, n_vocab - 2, n_vocab - 3, n_vocab - 4]
    candidates = wanted + rng.integers(0, n_vocab, size=50 * n).tolist()
    ref.run(prefix)
    picked: list[int] = []
    for tok in candidates:
        logits, margin = ref.step(int(tok))
        top2 = np.sort(logits)[-2:]
        if margin >= min_margin and top2[1] - top2[0] >= min_gap:
            picked.append(int(tok))
            if len(picked) == n:
                return picked
        else:
            ref.undo()
    raise SystemExit(f"could not find {n} ids without near-ties (router {min_margin}, logits {min_gap})")


# ----------------------------------------------------------------------------------------------


def _rows(llm, n: int) -> np.ndarray:
    return np.array(llm.scores[:n], dtype=np.float32, copy=True)  # [n, V]


def _qtype_of(path: Path) -> str:
    return path.stem.rsplit("-", 1)[-1]


def record(path: Path, out_dir: Path) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=512, n_batch=512, n_threads=2, logits_all=True, seed=0,
        type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=False,
    )
    n_vocab = llm.n_vocab()
    ref = Reference(path)
    min_margin = MIN_MARGIN.get(_qtype_of(path), MIN_MARGIN_QUANT)
    min_gap = MIN_LOGIT_GAP.get(_qtype_of(path), MIN_LOGIT_GAP_QUANT)

    noisy = NoisyLlama(path)
    for prompt_text in PROMPT_TEXTS:
        text_ids = llm.tokenize(prompt_text.encode("utf-8"), add_bos=False, special=False)
        mixed = pick_mixed_ids(ref, text_ids, n_vocab, min_margin, min_gap)
        prompt = text_ids + mixed
        spread, flips = screen(noisy, prompt, text_ids)
        if spread.max(initial=0.0) <= SCREEN_SHARE and flips == 0:
            break
        print(f"{path.name}: prompt {prompt_text!r} is ill-conditioned: with last-bit noise in attention llama.cpp's "
              f"mean |diff| reaches {spread.max():.2%} of the largest logit (limit {SCREEN_SHARE:.2%}) and "
              f"{flips}/{N_SCREEN} greedy runs change; trying the next text", file=sys.stderr)
    else:
        raise SystemExit(f"{path}: every prompt text is ill-conditioned (see above)")
    noisy.close()

    llm.reset()
    llm.eval(prompt)
    logits = _rows(llm, len(prompt))  # [T, V]

    # Greedy continuation through llama.cpp's own sampler; every yielded token but the last is
    # evaluated, so the scores then hold the logits each one was picked from.
    greedy: list[int] = []
    gen = llm.generate(text_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)
    for tok in gen:
        greedy.append(int(tok))
        if len(greedy) == N_GREEDY:
            break
    gen.close()
    greedy_logits = _rows(llm, len(text_ids) + N_GREEDY - 1)[len(text_ids) - 1 :]  # [N_GREEDY, V]
    chain = greedy_logits.argmax(-1).tolist()
    if chain != greedy:
        raise SystemExit(f"{path}: llama.cpp's greedy tokens {greedy} differ from the argmax of its logits {chain}")

    tok_ids: list[int] = []
    offsets = [0]
    for text in TOK_TEXTS:
        tok_ids += llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        offsets.append(len(tok_ids))
    llm.close()

    ref_logits, margins = ref.run(prompt)
    ref_greedy, greedy_margins = ref.run(text_ids + greedy[:-1])
    ref_greedy, greedy_margins = ref_greedy[len(text_ids) - 1 :], greedy_margins[len(text_ids) - 1 :]

    all_rows = np.concatenate([logits, greedy_logits])
    top2 = np.sort(all_rows, axis=-1)[:, -2:]
    out = out_dir / f"{path.stem}.npz"
    np.savez_compressed(
        out,
        prompt_text=np.array(prompt_text),
        greedy_prompt_ids=np.array(text_ids, dtype=np.int32),
        mixed_ids=np.array(mixed, dtype=np.int32),
        prompt_ids=np.array(prompt, dtype=np.int32),
        logits=logits,
        greedy_ids=np.array(greedy, dtype=np.int32),
        greedy_logits=greedy_logits,
        router_margin=margins.astype(np.float32),
        greedy_router_margin=greedy_margins.astype(np.float32),
        tok_texts=np.array(TOK_TEXTS),
        tok_ids=np.array(tok_ids, dtype=np.int32),
        tok_offsets=np.array(offsets, dtype=np.int64),
        noise_spread=spread.astype(np.float32),
        llama_cpp_version=np.array(llama_cpp.__version__),
    )
    return {
        "file": out,
        "T": len(prompt),
        "Tp": len(text_ids),
        "V": n_vocab,
        "median_gap": float(np.median(top2[:, 1] - top2[:, 0])),
        "min_router_margin": float(min(margins.min(), greedy_margins.min())),
        "max_diff": float(max(np.abs(logits - ref_logits).max(), np.abs(greedy_logits - ref_greedy).max())),
        "argmax_agree": float(np.mean(np.concatenate([logits.argmax(-1) == ref_logits.argmax(-1),
                                                      greedy_logits.argmax(-1) == ref_greedy.argmax(-1)]))),
        "greedy": greedy,
        "noise_spread": float(spread.max()) if spread.size else None,
    }


def screen(noisy: NoisyLlama, prompt: list[int], greedy_prompt: list[int]) -> tuple[np.ndarray, int]:
    """How far llama.cpp's own results move under last-bit noise in its attention, N_SCREEN seeds:
    (per seed, mean |logits - noiseless| over prompt / the largest noiseless logit [N_SCREEN], or an
    empty array where the graph has no attention output to perturb; how many greedy runs differ)."""
    base = noisy.logits(prompt)
    greedy = noisy.greedy(greedy_prompt, N_GREEDY)
    before = noisy.noised
    scale = float(np.abs(base).max())
    spread = np.array([np.abs(noisy.logits(prompt, seed) - base).mean() / scale for seed in range(N_SCREEN)])
    flips = sum(noisy.greedy(greedy_prompt, N_GREEDY, seed) != greedy for seed in range(N_SCREEN))
    if noisy.noised == before:
        return np.zeros(0), 0
    return spread, flips


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fixtures", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    args = ap.parse_args(argv)
    fixtures = args.fixtures or sorted((ROOT / "tests" / "fixtures").glob("*.gguf"))
    if not fixtures:
        print("no fixtures found", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{'fixture':26s} {'T':>4s} {'Tp':>3s}  top1-top2 median  min router gap  max|llama-ref|  argmax agree"
          "  noise spread")
    for path in fixtures:
        r = record(path, args.out)
        noise = "n/a" if r["noise_spread"] is None else f"{r['noise_spread']:.3%}"
        print(f"{path.name:26s} {r['T']:4d} {r['Tp']:3d}  {r['median_gap']:16.3f}  {r['min_router_margin']:14.3f}"
              f"  {r['max_diff']:14.4f}  {r['argmax_agree']:12.1%}  {noise:>12s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
