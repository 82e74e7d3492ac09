#!/usr/bin/env python3
"""A random-weight qwen35moe GGUF with Qwen3.6-35B-A3B's shapes, for benchmarks.

    python tools/make_hybrid_bench.py OUT.gguf [--layers 4] [--quantize Q4_K_M] [--seed 0]

Qwen3.6-35B-A3B: n_embd 2048, 40 layers (3 Gated DeltaNet : 1 gated attention), attention 16 q / 2 kv
heads of 256 with RoPE on 64 dims, DeltaNet 16 k / 32 v heads of 128 and conv 4, 256 experts of 512
(top 8) plus a 512-wide shared expert, vocabulary 248320. A full-size file does not fit this machine
several times over, so this writes the first ``--layers`` layers (the pattern kept: layer i is
attention iff (i + 1) % 4 == 0) at their real shapes, with the real embedding and output.

The metadata keys and tensor table are those llama.cpp's converter writes for Qwen3.5/3.6 MoE (the
same as the converter-made fixture tests/fixtures/tiny-qwen35moe-F16.gguf, whose tokenizer keys are
reused, its vocabulary padded with [PAD] tokens to 248320 as the converter pads one). The F16 file is
written directly (an HF checkpoint of this size would need more memory than the machine has), then,
with --quantize, converted by llama.cpp's own quantiser (llama-cpp-python's llama_model_quantize) and
the F16 file deleted.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFReader, GGUFValueType as VT

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clutor.cli.demo_model import TensorPlan, float_chunks, kv, tensor_rng, write_gguf  # noqa: E402

TEMPLATE = ROOT / "tests" / "fixtures" / "tiny-qwen35moe-F16.gguf"
LLAMA_FTYPES = {"F16": 1, "Q8_0": 7, "Q4_K_M": 15, "Q6_K": 18}

D, VOCAB = 2048, 248320
H, HKV, HD, N_ROT = 16, 2, 256, 64
NK, NV, HEAD, CONV = 16, 32, 128, 4
E, K, F, FS = 256, 8, 512, 512


def plans(n_layers: int) -> list[TensorPlan]:
    f16, f32 = QT.F16, QT.F32

    def w(name, shape, std):
        return TensorPlan(name, shape, f16, "normal", std)

    def v(name, shape, std=0.0, init="normal"):
        return TensorPlan(name, shape, f32, init, std)

    out = [w("token_embd.weight", (VOCAB, D), 1.0), v("output_norm.weight", (D,), init="norm"),
           w("output.weight", (VOCAB, D), 3.0 / np.sqrt(D))]
    kd, vd = NK * HEAD, NV * HEAD
    for l in range(n_layers):
        b = f"blk.{l}."
        out.append(v(b + "attn_norm.weight", (D,), init="norm"))
        if (l + 1) % 4:
            out += [v(b + "ssm_a", (NV,)), v(b + "ssm_conv1d.weight", (2 * kd + vd, CONV), 0.5),
                    v(b + "ssm_dt.bias", (NV,), 0.5), w(b + "ssm_alpha.weight", (NV, D), 1 / np.sqrt(D)),
                    w(b + "ssm_beta.weight", (NV, D), 1 / np.sqrt(D)), w(b + "attn_qkv.weight", (2 * kd + vd, D), 1 / np.sqrt(D)),
                    w(b + "attn_gate.weight", (vd, D), 1 / np.sqrt(D)), v(b + "ssm_norm.weight", (HEAD,), init="norm"),
                    w(b + "ssm_out.weight", (D, vd), 1 / np.sqrt(vd))]
        else:
            out += [v(b + "attn_k_norm.weight", (HD,), init="norm"), w(b + "attn_k.weight", (HKV * HD, D), 1 / np.sqrt(D)),
                    w(b + "attn_output.weight", (D, H * HD), 1 / np.sqrt(H * HD)),
                    v(b + "attn_q_norm.weight", (HD,), init="norm"), w(b + "attn_q.weight", (2 * H * HD, D), 1 / np.sqrt(D)),
                    w(b + "attn_v.weight", (HKV * HD, D), 1 / np.sqrt(D))]
        out += [w(b + "ffn_down_exps.weight", (E, D, F), 1 / np.sqrt(F)), w(b + "ffn_gate_exps.weight", (E, F, D), 1 / np.sqrt(D)),
                w(b + "ffn_up_exps.weight", (E, F, D), 1 / np.sqrt(D)), v(b + "ffn_gate_inp.weight", (E, D), 2 / np.sqrt(D)),
                w(b + "ffn_down_shexp.weight", (D, FS), 1 / np.sqrt(FS)), w(b + "ffn_gate_shexp.weight", (FS, D), 1 / np.sqrt(D)),
                w(b + "ffn_up_shexp.weight", (FS, D), 1 / np.sqrt(D)), v(b + "ffn_gate_inp_shexp.weight", (1, D), 1 / np.sqrt(D)),
                v(b + "post_attention_norm.weight", (D,), init="norm")]
    return out


def chunks(seed: int):
    def gen(plan: TensorPlan):
        rng = tensor_rng(seed, plan.name)
        if plan.name.endswith("ssm_a"):  # -exp(A_log): a decay of exp(-(0.05..1) softplus(.)) per token
            yield -(rng.random(plan.shape[0], dtype=np.float32) * 0.95 + 0.05)
            return
        for c in float_chunks(plan, rng):
            yield c.astype(np.float16) if plan.qtype == QT.F16 else c
    return gen


def metadata(n_layers: int) -> list:
    """The converter's keys (as in the converter-made fixture) with Qwen3.6-35B-A3B's values."""
    a, U32, F32, BOOL, ARR, STR, I32 = "qwen35moe", VT.UINT32, VT.FLOAT32, VT.BOOL, VT.ARRAY, VT.STRING, VT.INT32
    out = [kv("general.type", STR, "model"), kv("general.name", STR, "Qwen3.6-35B-A3B shapes (random weights)"),
           kv(f"{a}.block_count", U32, n_layers), kv(f"{a}.context_length", U32, 262144),
           kv(f"{a}.embedding_length", U32, D), kv(f"{a}.attention.head_count", U32, H),
           kv(f"{a}.attention.head_count_kv", U32, HKV), kv(f"{a}.rope.dimension_sections", ARR, [11, 11, 10, 0], I32),
           kv(f"{a}.rope.freq_base", F32, 10000000.0), kv(f"{a}.attention.layer_norm_rms_epsilon", F32, 1e-6),
           kv(f"{a}.expert_count", U32, E), kv(f"{a}.expert_used_count", U32, K),
           kv(f"{a}.attention.key_length", U32, HD), kv(f"{a}.attention.value_length", U32, HD),
           kv("general.file_type", U32, 1), kv(f"{a}.expert_feed_forward_length", U32, F),
           kv(f"{a}.expert_shared_feed_forward_length", U32, FS), kv(f"{a}.ssm.conv_kernel", U32, CONV),
           kv(f"{a}.ssm.state_size", U32, HEAD), kv(f"{a}.ssm.group_count", U32, NK),
           kv(f"{a}.ssm.time_step_rank", U32, NV), kv(f"{a}.ssm.inner_size", U32, NV * HEAD),
           kv(f"{a}.attention.recurrent_layers", ARR, [(l + 1) % 4 != 0 for l in range(n_layers)], BOOL),
           kv(f"{a}.full_attention_interval", U32, 4), kv(f"{a}.rope.dimension_count", U32, N_ROT),
           kv("general.quantization_version", U32, 2)]
    r = GGUFReader(str(TEMPLATE))

    def field(name):
        f = r.fields[name]
        if f.types[0] == VT.ARRAY:
            if f.types[1] == VT.STRING:
                return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            return [f.parts[i][0].item() for i in f.data]
        if f.types[0] == VT.STRING:
            return bytes(f.parts[-1]).decode("utf-8")
        return f.parts[f.data[0]][0].item()

    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), VOCAB)]
    types += [5] * (VOCAB - len(types))  # UNUSED, as the converter marks padding
    out += [kv("tokenizer.ggml.model", STR, field("tokenizer.ggml.model")), kv("tokenizer.ggml.pre", STR, "qwen35"),
            kv("tokenizer.ggml.tokens", ARR, tokens, STR), kv("tokenizer.ggml.token_type", ARR, types, I32),
            kv("tokenizer.ggml.merges", ARR, field("tokenizer.ggml.merges"), STR)]
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"):
        out.append(kv(key, U32, field(key)))
    out += [kv("tokenizer.ggml.add_bos_token", BOOL, False),
            kv("tokenizer.chat_template", STR, field("tokenizer.chat_template"))]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--quantize", choices=sorted(LLAMA_FTYPES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    f16 = args.out.with_suffix(".f16.gguf") if args.quantize and args.quantize != "F16" else args.out
    write_gguf(f16, "qwen35moe", metadata(args.layers), plans(args.layers), chunks(args.seed))
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
