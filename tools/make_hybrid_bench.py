#!/usr/bin/env python3
"""A random-weight GGUF with a real MoE model's shapes, for benchmarks.

    python tools/make_hybrid_bench.py OUT.gguf [--model qwen3.6-35b-a3b] [--layers 4] [--quantize Q4_K_M] [--seed 0]

A full-size file of these models does not fit this machine several times over, so this writes the first
``--layers`` layers at their real shapes (the model's layer pattern kept), with the real vocabulary,
embedding and output. The metadata keys and tensor table are those llama.cpp's converter writes for the
architecture (as in the converter-made fixture named below, whose tokenizer keys are reused, its
vocabulary padded with [PAD] tokens to the real size as the converter pads one). The F16 file is written
directly (an HF checkpoint of this size would need more memory than the machine has), then, with
--quantize, converted by llama.cpp's own quantiser (llama-cpp-python's llama_model_quantize) and the F16
file deleted.

Models (--model):

qwen3.6-35b-a3b (qwen35moe, fixture tests/fixtures/tiny-qwen35moe-F16.gguf): n_embd 2048, 40 layers
(3 Gated DeltaNet : 1 gated attention, layer i is attention iff (i + 1) % 4 == 0), attention 16 q / 2 kv
heads of 256 with RoPE on 64 dims, DeltaNet 16 k / 32 v heads of 128 and conv 4, 256 experts of 512
(top 8) plus a 512-wide shared expert, vocabulary 248320.

gemma-4-26b-a4b (gemma4, fixture tests/fixtures/tiny-gemma4-F16.gguf; HF config google/gemma-4-26B-A4B):
n_embd 2816, 30 layers (5 sliding-window : 1 global, layer i is global iff (i + 1) % 6 == 0), window
1024; window layers 16 q / 8 kv heads of 256, RoPE base 1e4 on all 256 dims; global layers 16 q / 2 kv
heads of 512 with V = K (no attn_v), RoPE base 1e6 on a quarter of each head (rope_freqs); a 2112-wide
shared GELU MLP and 128 GELU experts of 704 (fused gate+up, top 8) in every layer; vocabulary 262144,
the output tied to the embedding, logits soft-capped at 30.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFReader, GGUFValueType as VT

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clutor.cli.demo_model import TensorPlan, float_chunks, kv, tensor_rng, write_gguf  # noqa: E402

LLAMA_FTYPES = {"F16": 1, "Q8_0": 7, "Q4_K_M": 15, "Q6_K": 18}
U32, F32, BOOL, ARR, STR, I32 = VT.UINT32, VT.FLOAT32, VT.BOOL, VT.ARRAY, VT.STRING, VT.INT32


def _w(name, shape, std):
    return TensorPlan(name, shape, QT.F16, "normal", std)


def _v(name, shape, std=0.0, init="normal"):
    return TensorPlan(name, shape, QT.F32, init, std)


class _Template:
    """The tokenizer keys of a converter-made fixture, to reuse at the real vocabulary size."""

    def __init__(self, path: Path):
        self.r = GGUFReader(str(path))

    def __call__(self, name):
        f = self.r.fields[name]
        if f.types[0] == VT.ARRAY:
            if f.types[1] == VT.STRING:
                return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            return [f.parts[i][0].item() for i in f.data]
        if f.types[0] == VT.STRING:
            return bytes(f.parts[-1]).decode("utf-8")
        return f.parts[f.data[0]][0].item()

    def padded(self, vocab: int) -> tuple[list[str], list[int]]:
        tokens, types = self("tokenizer.ggml.tokens"), self("tokenizer.ggml.token_type")
        tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
        types += [5] * (vocab - len(types))  # UNUSED, as the converter marks padding
        return tokens, types


@dataclass(frozen=True)
class Preset:
    arch: str
    plans: Callable[[int], list[TensorPlan]]
    metadata: Callable[[int], list]
    special: Callable[[TensorPlan, np.random.Generator], np.ndarray | None]  # a tensor not drawn at random


# -- Qwen3.6-35B-A3B (qwen35moe) ---------------------------------------------------------------------
QWEN_TEMPLATE = ROOT / "tests" / "fixtures" / "tiny-qwen35moe-F16.gguf"
Q_D, Q_VOCAB = 2048, 248320
Q_H, Q_HKV, Q_HD, Q_ROT = 16, 2, 256, 64
Q_NK, Q_NV, Q_HEAD, Q_CONV = 16, 32, 128, 4
Q_E, Q_K, Q_F, Q_FS = 256, 8, 512, 512


def qwen_plans(n_layers: int) -> list[TensorPlan]:
    D, w, v = Q_D, _w, _v
    out = [w("token_embd.weight", (Q_VOCAB, D), 1.0), v("output_norm.weight", (D,), init="norm"),
           w("output.weight", (Q_VOCAB, D), 3.0 / np.sqrt(D))]
    kd, vd = Q_NK * Q_HEAD, Q_NV * Q_HEAD
    for l in range(n_layers):
        b = f"blk.{l}."
        out.append(v(b + "attn_norm.weight", (D,), init="norm"))
        if (l + 1) % 4:
            out += [v(b + "ssm_a", (Q_NV,)), v(b + "ssm_conv1d.weight", (2 * kd + vd, Q_CONV), 0.5),
                    v(b + "ssm_dt.bias", (Q_NV,), 0.5), w(b + "ssm_alpha.weight", (Q_NV, D), 1 / np.sqrt(D)),
                    w(b + "ssm_beta.weight", (Q_NV, D), 1 / np.sqrt(D)), w(b + "attn_qkv.weight", (2 * kd + vd, D), 1 / np.sqrt(D)),
                    w(b + "attn_gate.weight", (vd, D), 1 / np.sqrt(D)), v(b + "ssm_norm.weight", (Q_HEAD,), init="norm"),
                    w(b + "ssm_out.weight", (D, vd), 1 / np.sqrt(vd))]
        else:
            out += [v(b + "attn_k_norm.weight", (Q_HD,), init="norm"), w(b + "attn_k.weight", (Q_HKV * Q_HD, D), 1 / np.sqrt(D)),
                    w(b + "attn_output.weight", (D, Q_H * Q_HD), 1 / np.sqrt(Q_H * Q_HD)),
                    v(b + "attn_q_norm.weight", (Q_HD,), init="norm"), w(b + "attn_q.weight", (2 * Q_H * Q_HD, D), 1 / np.sqrt(D)),
                    w(b + "attn_v.weight", (Q_HKV * Q_HD, D), 1 / np.sqrt(D))]
        out += [w(b + "ffn_down_exps.weight", (Q_E, D, Q_F), 1 / np.sqrt(Q_F)), w(b + "ffn_gate_exps.weight", (Q_E, Q_F, D), 1 / np.sqrt(D)),
                w(b + "ffn_up_exps.weight", (Q_E, Q_F, D), 1 / np.sqrt(D)), v(b + "ffn_gate_inp.weight", (Q_E, D), 2 / np.sqrt(D)),
                w(b + "ffn_down_shexp.weight", (D, Q_FS), 1 / np.sqrt(Q_FS)), w(b + "ffn_gate_shexp.weight", (Q_FS, D), 1 / np.sqrt(D)),
                w(b + "ffn_up_shexp.weight", (Q_FS, D), 1 / np.sqrt(D)), v(b + "ffn_gate_inp_shexp.weight", (1, D), 1 / np.sqrt(D)),
                v(b + "post_attention_norm.weight", (D,), init="norm")]
    return out


def qwen_special(plan: TensorPlan, rng: np.random.Generator):
    if plan.name.endswith("ssm_a"):  # -exp(A_log): a decay of exp(-(0.05..1) softplus(.)) per token
        return -(rng.random(plan.shape[0], dtype=np.float32) * 0.95 + 0.05)
    return None


def qwen_metadata(n_layers: int) -> list:
    """The converter's keys (as in the converter-made fixture) with Qwen3.6-35B-A3B's values."""
    a = "qwen35moe"
    out = [kv("general.type", STR, "model"), kv("general.name", STR, "Qwen3.6-35B-A3B shapes (random weights)"),
           kv(f"{a}.block_count", U32, n_layers), kv(f"{a}.context_length", U32, 262144),
           kv(f"{a}.embedding_length", U32, Q_D), kv(f"{a}.attention.head_count", U32, Q_H),
           kv(f"{a}.attention.head_count_kv", U32, Q_HKV), kv(f"{a}.rope.dimension_sections", ARR, [11, 11, 10, 0], I32),
           kv(f"{a}.rope.freq_base", F32, 10000000.0), kv(f"{a}.attention.layer_norm_rms_epsilon", F32, 1e-6),
           kv(f"{a}.expert_count", U32, Q_E), kv(f"{a}.expert_used_count", U32, Q_K),
           kv(f"{a}.attention.key_length", U32, Q_HD), kv(f"{a}.attention.value_length", U32, Q_HD),
           kv("general.file_type", U32, 1), kv(f"{a}.expert_feed_forward_length", U32, Q_F),
           kv(f"{a}.expert_shared_feed_forward_length", U32, Q_FS), kv(f"{a}.ssm.conv_kernel", U32, Q_CONV),
           kv(f"{a}.ssm.state_size", U32, Q_HEAD), kv(f"{a}.ssm.group_count", U32, Q_NK),
           kv(f"{a}.ssm.time_step_rank", U32, Q_NV), kv(f"{a}.ssm.inner_size", U32, Q_NV * Q_HEAD),
           kv(f"{a}.attention.recurrent_layers", ARR, [(l + 1) % 4 != 0 for l in range(n_layers)], BOOL),
           kv(f"{a}.full_attention_interval", U32, 4), kv(f"{a}.rope.dimension_count", U32, Q_ROT),
           kv("general.quantization_version", U32, 2)]
    field = _Template(QWEN_TEMPLATE)
    tokens, types = field.padded(Q_VOCAB)
    out += [kv("tokenizer.ggml.model", STR, field("tokenizer.ggml.model")), kv("tokenizer.ggml.pre", STR, "qwen35"),
            kv("tokenizer.ggml.tokens", ARR, tokens, STR), kv("tokenizer.ggml.token_type", ARR, types, I32),
            kv("tokenizer.ggml.merges", ARR, field("tokenizer.ggml.merges"), STR)]
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"):
        out.append(kv(key, U32, field(key)))
    out += [kv("tokenizer.ggml.add_bos_token", BOOL, False),
            kv("tokenizer.chat_template", STR, field("tokenizer.chat_template"))]
    return out


# -- Gemma-4-26B-A4B (gemma4) ------------------------------------------------------------------------
GEMMA_TEMPLATE = ROOT / "tests" / "fixtures" / "tiny-gemma4-F16.gguf"
G_D, G_VOCAB, G_WINDOW = 2816, 262144, 1024
G_H, G_KV_SWA, G_HD_SWA, G_KV, G_HD, G_ROT_FRAC = 16, 8, 256, 2, 512, 0.25
G_E, G_K, G_F, G_FF = 128, 8, 704, 2112


def gemma_global(l: int) -> bool:
    return (l + 1) % 6 == 0


def gemma_plans(n_layers: int) -> list[TensorPlan]:
    D, w, v = G_D, _w, _v
    # the head is the embedding (tied): 0.05 per weight gives logits of a few units before the soft cap
    out = [v("rope_freqs.weight", (G_HD // 2,)), w("token_embd.weight", (G_VOCAB, D), 0.05)]
    for l in range(n_layers):
        b, hd = f"blk.{l}.", G_HD if gemma_global(l) else G_HD_SWA
        n_kv = G_KV if gemma_global(l) else G_KV_SWA
        out += [w(b + "ffn_down_exps.weight", (G_E, D, G_F), 1 / np.sqrt(G_F)),
                w(b + "ffn_gate_up_exps.weight", (G_E, 2 * G_F, D), 1 / np.sqrt(D)),
                v(b + "attn_norm.weight", (D,), init="norm"), v(b + "layer_output_scale.weight", (1,)),
                w(b + "ffn_down.weight", (D, G_FF), 1 / np.sqrt(G_FF)), w(b + "ffn_gate.weight", (G_FF, D), 1 / np.sqrt(D)),
                w(b + "ffn_up.weight", (G_FF, D), 1 / np.sqrt(D))]
        out += [v(b + n, (D,), init="norm") for n in ("post_attention_norm.weight", "post_ffw_norm.weight",
                                                       "post_ffw_norm_1.weight", "post_ffw_norm_2.weight",
                                                       "ffn_norm.weight", "pre_ffw_norm_2.weight")]
        out += [v(b + "ffn_down_exps.scale", (G_E,), init="norm"), v(b + "ffn_gate_inp.weight", (G_E, D), 2 / np.sqrt(D)),
                v(b + "ffn_gate_inp.scale", (D,), init="norm"), v(b + "attn_k_norm.weight", (hd,), init="norm"),
                w(b + "attn_k.weight", (n_kv * hd, D), 1 / np.sqrt(D)),
                w(b + "attn_output.weight", (D, G_H * hd), 1 / np.sqrt(G_H * hd)),
                v(b + "attn_q_norm.weight", (hd,), init="norm"), w(b + "attn_q.weight", (G_H * hd, D), 1 / np.sqrt(D))]
        if not gemma_global(l):  # the global layers' V is their K projection (attention_k_eq_v)
            out.append(w(b + "attn_v.weight", (n_kv * hd, D), 1 / np.sqrt(D)))
    out.append(v("output_norm.weight", (D,), init="norm"))
    return out


def gemma_special(plan: TensorPlan, rng: np.random.Generator):
    if plan.name == "rope_freqs.weight":  # proportional RoPE: a quarter of each pair rotates, 1e30 stops the rest
        f = np.full(plan.shape, 1e30, dtype=np.float32)
        f[: int(plan.shape[0] * G_ROT_FRAC)] = 1.0
        return f
    if plan.name.endswith("layer_output_scale.weight"):
        return np.ones(plan.shape, dtype=np.float32)  # as the converter-made fixture has it
    return None


def gemma_metadata(n_layers: int) -> list:
    """The converter's keys (as in the converter-made fixture) with Gemma-4-26B-A4B's values."""
    a = "gemma4"
    glob = [gemma_global(l) for l in range(n_layers)]
    out = [kv("general.type", STR, "model"), kv("general.name", STR, "Gemma-4-26B-A4B shapes (random weights)"),
           kv(f"{a}.block_count", U32, n_layers), kv(f"{a}.context_length", U32, 262144),
           kv(f"{a}.embedding_length", U32, G_D), kv(f"{a}.feed_forward_length", U32, G_FF),
           kv(f"{a}.attention.head_count", U32, G_H),
           kv(f"{a}.attention.head_count_kv", ARR, [G_KV if g else G_KV_SWA for g in glob], I32),
           kv(f"{a}.rope.freq_base", F32, 1000000.0), kv(f"{a}.rope.freq_base_swa", F32, 10000.0),
           kv(f"{a}.attention.layer_norm_rms_epsilon", F32, 1e-6),
           kv(f"{a}.expert_count", U32, G_E), kv(f"{a}.expert_used_count", U32, G_K),
           kv(f"{a}.attention.key_length", U32, G_HD), kv(f"{a}.attention.value_length", U32, G_HD),
           kv("general.file_type", U32, 1), kv(f"{a}.final_logit_softcapping", F32, 30.0),
           kv(f"{a}.attention.sliding_window", U32, G_WINDOW), kv(f"{a}.attention.shared_kv_layers", U32, 0),
           kv(f"{a}.embedding_length_per_layer_input", U32, 0),
           kv(f"{a}.attention.sliding_window_pattern", ARR, [not g for g in glob], BOOL),
           kv(f"{a}.attention.key_length_swa", U32, G_HD_SWA), kv(f"{a}.attention.value_length_swa", U32, G_HD_SWA),
           kv(f"{a}.expert_feed_forward_length", U32, G_F), kv(f"{a}.rope.dimension_count", U32, G_HD),
           kv(f"{a}.rope.dimension_count_swa", U32, G_HD_SWA), kv("general.quantization_version", U32, 2)]
    field = _Template(GEMMA_TEMPLATE)
    tokens, types = field.padded(G_VOCAB)
    scores = field("tokenizer.ggml.scores")
    scores += [0.0] * (G_VOCAB - len(scores))
    out += [kv("tokenizer.ggml.model", STR, field("tokenizer.ggml.model")),
            kv("tokenizer.ggml.tokens", ARR, tokens, STR), kv("tokenizer.ggml.scores", ARR, scores, F32),
            kv("tokenizer.ggml.token_type", ARR, types, I32),
            kv("tokenizer.ggml.merges", ARR, field("tokenizer.ggml.merges"), STR)]
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.padding_token_id"):
        out.append(kv(key, U32, field(key)))
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix"):
        out.append(kv(key, BOOL, bool(field(key))))
    return out


PRESETS = {"qwen3.6-35b-a3b": Preset("qwen35moe", qwen_plans, qwen_metadata, qwen_special),
           "gemma-4-26b-a4b": Preset("gemma4", gemma_plans, gemma_metadata, gemma_special)}


def chunks(seed: int, special):
    def gen(plan: TensorPlan):
        rng = tensor_rng(seed, plan.name)
        fixed = special(plan, rng)
        if fixed is not None:
            yield fixed
            return
        for c in float_chunks(plan, rng):
            yield c.astype(np.float16) if plan.qtype == QT.F16 else c
    return gen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", choices=sorted(PRESETS), default="qwen3.6-35b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--quantize", choices=sorted(LLAMA_FTYPES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    preset = PRESETS[args.model]
    t0 = time.monotonic()
    f16 = args.out.with_suffix(".f16.gguf") if args.quantize and args.quantize != "F16" else args.out
    write_gguf(f16, preset.arch, preset.metadata(args.layers), preset.plans(args.layers),
               chunks(args.seed, preset.special))
    if f16 != args.out:
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = LLAMA_FTYPES[args.quantize]
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(args.out).encode(), ctypes.byref(params))
        f16.unlink()
        if rc:
            raise SystemExit(f"llama_model_quantize failed with code {rc}")
    print(f"{args.out}: {args.out.stat().st_size} bytes in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
