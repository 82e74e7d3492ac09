"""Random-weight GGUF models of every architecture Clutor runs: the test fixtures and benchmark-sized
files (``tools/make_model.py``), built on the demo model's generator (``clutor/cli/demo_model.py``:
tokenizer, random blocks, ``GGUFWriter``).

The weights are random but deterministic from a seed; the scaling, the tokenizer and the chunked
writing are the demo model's (see its docstring). Q8_0, Q4_K and MXFP4 tensors are written as random
*blocks* (random scales and random quants) instead of quantising floats, which is what makes the
big presets fast to produce; their dequantised values are close to N(0, sigma). Other types go
through gguf-py's quantisers (slow: small models only).

Layout of the file, as llama.cpp expects it (see shared/notes/gguf-moe.md):
    GGUF header | metadata key/values | tensor infos | pad to 32 | tensor data, each padded to 32
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from clutor.cli.demo_model import (
    CHUNK, KV, LOGIT_STD, OLMOE_TEMPLATE, ROUTER_STD, WRITERS, TensorPlan, block_gain, file_size, file_type,
    fingerprint, float_chunks, header_bytes, kv, seeded_chunks, tokenizer_metadata, write_gguf,
)
from clutor.errors import UnsupportedError

__all__ = [
    "ARCHS",
    "ModelSpec",
    "PRESETS",
    "TensorPlan",
    "expected_size",
    "model_fingerprint",
    "plan_tensors",
    "write_model",
]


ARCHS = ("olmoe", "qwen2moe", "qwen3moe", "llama", "glm4moe", "deepseek2", "gpt-oss")

# With a tied output matrix the embedding has the output's small scale, and the logit of the input
# token itself is about LOGIT_STD**2 / rms(x) (its embedding is part of x). Scaling up what each
# layer adds to the residual stream keeps that self-logit near one standard deviation instead of
# letting greedy decoding repeat its input. Layers see RMS-normalised inputs, so nothing else changes.
TIED_RESIDUAL_GAIN = 4.0

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a synthetic model. ``qtype`` is the default type of every weight matrix;
    ``expert_qtype`` (if set) overrides it for the routed-expert tensors (``ffn_*_exps``)."""

    name: str
    arch: str  # one of ARCHS
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    vocab_size: int
    n_ctx: int = 512
    n_ff_shexp: int = 0  # qwen2moe shared expert
    rope_base: float = 10000.0
    eps: float = 1e-5
    tied_output: bool = False  # no `output` tensor: llama.cpp reuses token_embd
    qtype: str = "F16"
    expert_qtype: str | None = None
    # glm4moe / deepseek2 (the defaults leave the other architectures' files unchanged)
    n_dense_lead: int = 0       # leading layers with a dense FFN of width n_ff
    n_ff: int = 0
    n_expert_shared: int = 0    # shared experts, each of width n_ff_exp
    n_rot: int = 0              # RoPE dims per head (0: all of head_dim)
    qk_norm: bool = False       # glm4moe's optional per-head q/k norm
    qkv_bias: bool = False      # glm4moe's q/k/v biases
    n_nextn: int = 0            # MTP layers appended after the n_layer ones (written, never computed)
    gating: int = 0             # expert_gating_func (1 softmax, 2 sigmoid); 0 = key absent
    norm_w: bool = False        # expert_weights_norm
    w_scale: float = 0.0        # expert_weights_scale (0 = key absent)
    probs_bias: bool = False    # exp_probs_b.bias per MoE layer
    n_group: int = 0            # expert_group_count / expert_group_used_count (0 = absent)
    n_group_used: int = 0
    q_lora_rank: int = 0        # deepseek2 MLA: 0 = attn_q directly
    kv_lora_rank: int = 0
    v_head_dim: int = 0
    mla_split: bool = True      # attn_k_b / attn_v_b (True) or the older attn_kv_b
    yarn_factor: float = 0.0    # rope.scaling.* (YaRN) when > 0
    yarn_orig_ctx: int = 0
    yarn_log_mul: float = 0.0   # rope.scaling.yarn_log_multiplier (0.1 * mscale_all_dim)
    sliding_window: int = 0     # gpt-oss: attention.sliding_window (even layers slide)
    fused_gate_up: bool = False  # experts' gate and up in one ffn_gate_up_exps tensor [E, 2F, D]
    # A K-quant matrix whose rows are not a multiple of 256 is written as Q8_0 instead of refused, as
    # llama.cpp's quantiser falls back for such rows (it picks Q5_0/Q8_0; Q8_0 here, the fast writer).
    k_fallback: bool = False

    @property
    def n_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_kv(self) -> int:
        return self.n_head_kv * self.head_dim


PRESETS: dict[str, ModelSpec] = {
    "tiny-olmoe": ModelSpec(
        name="tiny-olmoe", arch="olmoe", n_layer=2, n_embd=256, n_head=4, n_head_kv=4, head_dim=64,
        n_expert=8, n_expert_used=2, n_ff_exp=256, vocab_size=512, n_ctx=512, eps=1e-5,
    ),
    "tiny-qwen2moe": ModelSpec(
        name="tiny-qwen2moe", arch="qwen2moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
        n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=512, vocab_size=512, n_ctx=512,
        rope_base=1e6, eps=1e-6,
    ),
    "tiny-qwen3moe": ModelSpec(
        name="tiny-qwen3moe", arch="qwen3moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=128,
        n_expert=8, n_expert_used=2, n_ff_exp=256, vocab_size=512, n_ctx=512, rope_base=1e6, eps=1e-6,
        tied_output=True,
    ),
    # Small fixtures of the other architectures (n_embd 128 keeps each file near 1 MB; llama.cpp's
    # quantiser falls back to Q5_0 / Q8_0 where a row is shorter than a K-quant block).
    "tiny-mixtral": ModelSpec(
        name="tiny-mixtral", arch="llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
        n_expert=4, n_expert_used=2, n_ff_exp=128, vocab_size=512, n_ctx=512, rope_base=1e6, eps=1e-5,
    ),
    "tiny-glm4moe": ModelSpec(
        name="tiny-glm4moe", arch="glm4moe", n_layer=3, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
        n_expert=8, n_expert_used=2, n_ff_exp=64, vocab_size=512, n_ctx=512, rope_base=1e6, eps=1e-5,
        n_dense_lead=1, n_ff=192, n_expert_shared=1, n_rot=16, qk_norm=True, qkv_bias=True, n_nextn=1,
        gating=2, norm_w=True, w_scale=1.5, probs_bias=True,
    ),
    "tiny-deepseek2": ModelSpec(
        name="tiny-deepseek2", arch="deepseek2", n_layer=3, n_embd=128, n_head=4, n_head_kv=1, head_dim=48,
        n_expert=8, n_expert_used=2, n_ff_exp=64, vocab_size=512, n_ctx=512, rope_base=1e4, eps=1e-6,
        n_dense_lead=1, n_ff=192, n_expert_shared=2, n_rot=16, gating=2, norm_w=True, w_scale=2.5,
        probs_bias=True, n_group=4, n_group_used=2, q_lora_rank=64, kv_lora_rank=64, v_head_dim=32,
        yarn_factor=4.0, yarn_orig_ctx=128, yarn_log_mul=0.0707,
    ),
    # DeepSeek-V2-Lite's form: no q compression, the older attn_kv_b, softmax gating, no groups; and
    # the experts' gate and up fused in one tensor per layer (ffn_gate_up_exps).
    "tiny-deepseek2-lite": ModelSpec(
        name="tiny-deepseek2-lite", arch="deepseek2", n_layer=2, n_embd=128, n_head=4, n_head_kv=4, head_dim=48,
        n_expert=8, n_expert_used=2, n_ff_exp=64, vocab_size=512, n_ctx=512, rope_base=1e4, eps=1e-6,
        n_dense_lead=1, n_ff=192, n_expert_shared=2, n_rot=16, gating=1, w_scale=1.0, q_lora_rank=0,
        kv_lora_rank=64, v_head_dim=32, mla_split=False, fused_gate_up=True,
    ),
    # DeepSeek-V3's form at rows K-quants take (n_embd 512, nope 128 as in V3, so llama.cpp's Q4_K_M
    # mix really has Q4_K / Q6_K matrices and Q5_0 attn_k_b / attn_v_b): for numerics checks (~30 MB F16).
    "small-deepseek3": ModelSpec(
        name="small-deepseek3", arch="deepseek2", n_layer=4, n_embd=512, n_head=4, n_head_kv=1, head_dim=192,
        n_expert=16, n_expert_used=4, n_ff_exp=256, vocab_size=2048, n_ctx=512, rope_base=1e4, eps=1e-6,
        n_dense_lead=1, n_ff=768, n_expert_shared=1, n_rot=64, gating=2, norm_w=True, w_scale=2.5,
        probs_bias=True, n_group=4, n_group_used=2, q_lora_rank=256, kv_lora_rank=256, v_head_dim=128,
        yarn_factor=4.0, yarn_orig_ctx=128, yarn_log_mul=0.0707,
    ),
    # gpt-oss: sinks, q/k/v/o biases, router and per-expert biases, sliding window on even layers,
    # attention wider than n_embd (8 heads x 32), YaRN.
    "tiny-gptoss": ModelSpec(
        name="tiny-gptoss", arch="gpt-oss", n_layer=2, n_embd=128, n_head=8, n_head_kv=2, head_dim=32,
        n_expert=4, n_expert_used=2, n_ff_exp=128, vocab_size=512, n_ctx=512, rope_base=1.5e5, eps=1e-5,
        n_rot=32, qkv_bias=True, sliding_window=8, yarn_factor=4.0, yarn_orig_ctx=64,
    ),
    # gpt-oss-20b's shapes (the benchmark of issue 11): experts MXFP4, the dense rest Q8_0 (~12 GB).
    "gpt-oss-20b-mxfp4": ModelSpec(
        name="gpt-oss-20b-mxfp4", arch="gpt-oss", n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64,
        n_expert=32, n_expert_used=4, n_ff_exp=2880, vocab_size=201088, n_ctx=131072, rope_base=1.5e5, eps=1e-5,
        n_rot=64, qkv_bias=True, sliding_window=128, yarn_factor=32.0, yarn_orig_ctx=4096, qtype="Q8_0",
        expert_qtype="MXFP4",
    ),
    # OLMoE-1B-7B's real shapes, every matrix Q8_0 (7.4 GB).
    "olmoe-1b-7b-q8": ModelSpec(
        name="olmoe-1b-7b-q8", arch="olmoe", n_layer=16, n_embd=2048, n_head=16, n_head_kv=16, head_dim=128,
        n_expert=64, n_expert_used=8, n_ff_exp=1024, vocab_size=50304, n_ctx=4096, eps=1e-5, qtype="Q8_0",
    ),
    # DeepSeek-V2-Lite's real shapes (MLA without q compression, the older attn_kv_b, 64 experts top-6 +
    # 2 shared, a dense first layer, YaRN): Q4_K_M-like, experts Q4_K (the 1408-wide down rows Q8_0, see
    # k_fallback), the dense rest Q8_0 (~10 GB).
    "deepseek-v2-lite-q4k": ModelSpec(
        name="deepseek-v2-lite-q4k", arch="deepseek2", n_layer=27, n_embd=2048, n_head=16, n_head_kv=16,
        head_dim=192, n_expert=64, n_expert_used=6, n_ff_exp=1408, vocab_size=102400, n_ctx=163840,
        rope_base=1e4, eps=1e-6, n_dense_lead=1, n_ff=10944, n_expert_shared=2, n_rot=64, gating=1, w_scale=1.0,
        q_lora_rank=0, kv_lora_rank=512, v_head_dim=128, mla_split=False, yarn_factor=40.0, yarn_orig_ctx=4096,
        yarn_log_mul=0.0707, qtype="Q8_0", expert_qtype="Q4_K", k_fallback=True,
    ),
    # Qwen3-30B-A3B's real shapes: experts Q4_K, the dense rest Q8_0.
    "qwen3-30b-a3b-q4k": ModelSpec(
        name="qwen3-30b-a3b-q4k", arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4,
        head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768, vocab_size=151936, n_ctx=4096,
        rope_base=1e6, eps=1e-6, qtype="Q8_0", expert_qtype="Q4_K",
    ),
}



# ----------------------------------------------------------------------------------------------
# Tensor plan


def _qtype(where: str, name: str, field: str) -> GGMLQuantizationType:
    try:
        qt = GGMLQuantizationType[name.upper()]
    except KeyError:
        raise UnsupportedError(where, field, "a ggml type name such as F16, Q8_0, Q4_K", name) from None
    if qt not in _WRITERS and qt not in _FLOAT_QUANTISERS:
        raise UnsupportedError(where, field, "one of " + ", ".join(sorted(_SUPPORTED)), name)
    return qt


def spec_arch(spec: ModelSpec):
    """The clutor Arch a file of this spec is read as: its tensor table is what gets written."""
    from clutor.model.arch import read_arch
    from clutor.model.arch.common import TableView

    D, V, E, F = spec.n_embd, spec.vocab_size, spec.n_expert, spec.n_ff_exp
    shapes = {"token_embd.weight": (V, D)}
    if not spec.tied_output:
        shapes["output.weight"] = (V, D)
    first = f"blk.{spec.n_dense_lead}."
    if spec.fused_gate_up:
        shapes[first + "ffn_gate_up_exps.weight"] = (E, 2 * F, D)
    if spec.probs_bias:
        shapes[first + "exp_probs_b.bias"] = (E,)
    return read_arch(TableView(spec.arch, {k: v for k, v, *_ in _arch_keys(spec)}, shapes, f"<synth preset {spec.name}>"))


def _written(spec: ModelSpec, name: str) -> bool:
    """Whether an optional tensor of the table is in this spec's files."""
    if name.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias")):
        return spec.qkv_bias or spec.arch == "qwen2moe"
    if name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
        return spec.qk_norm
    if name.endswith("exp_probs_b.bias"):
        return spec.probs_bias
    return False


# Residual-stream outputs (scaled by TIED_RESIDUAL_GAIN in tied models) and vectors with their own spread.
_OUTPUTS = ("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")
_VECTOR_STD = {"attn_sinks.weight": 1.0, "ffn_gate_inp.bias": 0.5,
               # sigmoid probabilities are in (0, 1): a bias of this size reorders close experts only
               "exp_probs_b.bias": 0.05}


def plan_tensors(spec: ModelSpec, qtype: str | None = None) -> list[TensorPlan]:
    """Every tensor of ``spec`` (the architecture's own table, clutor.model.arch) with its type and
    initialisation: matrices N(0, 1/fan_in) in the spec's type (experts in expert_qtype), norms 1 +
    noise, biases N(0, 0.2), routers sharper; F32 for everything of one dimension and the routers."""
    where = f"<synth preset {spec.name}>"
    if spec.arch not in ARCHS:
        raise UnsupportedError(where, "arch", " | ".join(ARCHS), spec.arch)
    mat = _qtype(where, qtype or spec.qtype, "qtype")
    exp = mat if qtype is not None or spec.expert_qtype is None else _qtype(where, spec.expert_qtype, "expert_qtype")
    f32 = GGMLQuantizationType.F32
    D = spec.n_embd
    out_std = LOGIT_STD / np.sqrt(D)
    gain = TIED_RESIDUAL_GAIN if spec.tied_output else 1.0

    def plan(t) -> TensorPlan:
        name, shape = t.name, t.shape
        if name == "token_embd.weight":  # tied: the embedding doubles as the output matrix, at its scale
            return TensorPlan(name, shape, mat, "normal", out_std if spec.tied_output else 1.0, spec.tied_output)
        if name == "output.weight":
            return TensorPlan(name, shape, mat, "normal", out_std, True)
        if name.endswith("norm.weight"):
            return TensorPlan(name, shape, f32, "norm")
        if name.endswith("ffn_gate_inp.weight"):
            return TensorPlan(name, shape, f32, "normal", ROUTER_STD / np.sqrt(D))
        if len(shape) == 1 or name.endswith(".bias"):
            suffix = name.split(".", 2)[-1]
            std = _VECTOR_STD.get(suffix, 1 / np.sqrt(D) if suffix == "ffn_gate_inp_shexp.weight" else 0.2)
            return TensorPlan(name, shape, f32, "normal", std)
        fan_in = shape[1] if name.endswith("attn_k_b.weight") else shape[-1]  # [H, C, nope]: each head reads C
        std = (gain if name.endswith(_OUTPUTS) else 1.0) / np.sqrt(fan_in)
        return TensorPlan(name, shape, exp if t.kind == "expert" else mat, "normal", std)

    plans = [plan(t) for t in spec_arch(spec).file_tensors() if t.required or _written(spec, t.name)]
    for i, p in enumerate(plans):
        block = GGML_QUANT_SIZES[p.qtype][0]
        if p.shape[-1] % block and spec.k_fallback and block == 256:
            plans[i] = p = dataclasses.replace(p, qtype=GGMLQuantizationType.Q8_0)
            block = GGML_QUANT_SIZES[p.qtype][0]
        if p.shape[-1] % block:
            raise UnsupportedError(where, p.name, f"a row length that is a multiple of {block} for {p.qtype.name}", p.shape[-1])
    return plans



# ----------------------------------------------------------------------------------------------
# Random blocks of the types the demo does not need (the demo model has F32 and Q8_0)

_M3 = np.uint64(0x7777777777777777)
_M1 = np.uint64(0x1111111111111111)
_S3 = np.uint64(3)
# std of the random 4-bit quants: two uniform 3-bit values plus one bit, variance 2 * 63 / 12 + 1 / 4
_Q4_STD = float(np.sqrt(2 * 63 / 12 + 0.25))
_Q4K_SC = np.arange(32, 64)  # sub-block scales are drawn from 32..63
_Q4K_SC_RMS = float(np.sqrt(np.mean(_Q4K_SC.astype(np.float64) ** 2)))


def _random_nibbles(rng: np.random.Generator, n_bytes: int) -> np.ndarray:
    """n_bytes bytes, each holding two near-Gaussian 4-bit values in 0..15, mean 7.5 (n_bytes % 8 == 0).

    Per 4-bit lane: a 3-bit value + another 3-bit value + the spare 4th bit of the first (max 15).
    """
    r = rng.bit_generator.random_raw(2 * (n_bytes // 8)).reshape(2, -1)  # [2, n_bytes/8] uint64
    q = (r[0] & _M3) + (r[1] & _M3) + ((r[0] >> _S3) & _M1)
    return q.view(np.uint8)


def _q4_k_chunks(plan: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Random Q4_K blocks of 256: [f16 d][f16 dmin][12 bytes of 6-bit scales/mins][128 bytes of nibbles].

    value = d * sc_j * q - dmin * m_j for sub-block j (32 values). With m_j = sc_j and
    dmin = 7.5 d this is d * sc_j * (q - 7.5): zero mean, std = d * rms(sc) * _Q4_STD.
    """
    n_blocks = int(np.prod(plan.shape)) // 256
    per = max(1, CHUNK // 256)
    base = plan.std / (_Q4_STD * _Q4K_SC_RMS) / np.exp(0.01)
    for b0 in range(0, n_blocks, per):
        nb = min(n_blocks, b0 + per) - b0
        out = np.empty((nb, 144), dtype=np.uint8)
        d = base * np.exp(0.1 * rng.standard_normal(nb)) * block_gain(plan, b0, nb, 256)
        out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
        out[:, 2:4] = (7.5 * d).astype(np.float16).view(np.uint8).reshape(nb, 2)
        sc = rng.integers(32, 64, size=(nb, 8), dtype=np.uint8)  # [nb, 8]
        out[:, 4:16] = _pack_k4_scales(sc, sc)
        out[:, 16:] = _random_nibbles(rng, nb * 128).reshape(nb, 128)
        yield out


def _pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack eight 6-bit scales and eight 6-bit mins per block into ggml's 12-byte Q4_K/Q5_K form."""
    packed = np.empty((sc.shape[0], 12), dtype=np.uint8)  # [nb, 12]
    # Sub-blocks 0..3 keep scale/min in the low 6 bits of bytes 0..3 / 4..7; sub-blocks 4..7 put
    # their low 4 bits in bytes 8..11 and their top 2 bits in the spare top bits of bytes 0..7.
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return packed


# std of ggml's MXFP4 levels (the E2M1 values doubled) when each of the 16 codes is equally likely
_MXFP4_STD = float(np.sqrt(np.mean(np.square([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]))))


def _mxfp4_chunks(plan: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Random MXFP4 blocks of 32: [E8M0 exponent e][16 bytes of 4-bit codes], value 2^(e-128) * level;
    the exponent is the power of two nearest the wanted spread, jittered by one step either way."""
    n_blocks = int(np.prod(plan.shape)) // 32
    per = CHUNK // 32
    e0 = 128 + np.log2(plan.std / _MXFP4_STD)
    for b0 in range(0, n_blocks, per):
        nb = min(n_blocks, b0 + per) - b0
        out = np.empty((nb, 17), dtype=np.uint8)
        e = e0 + np.log2(block_gain(plan, b0, nb, 32)) + rng.integers(-1, 2, size=nb) * 0.5
        out[:, 0] = np.clip(np.rint(e), 1, 254).astype(np.uint8)
        out[:, 1:] = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
        yield out


def _f16_chunks(plan: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    for x in float_chunks(plan, rng):
        yield x.astype(np.float16)


_WRITERS = {
    **WRITERS,
    GGMLQuantizationType.F16: _f16_chunks,
    GGMLQuantizationType.Q4_K: _q4_k_chunks,
    GGMLQuantizationType.MXFP4: _mxfp4_chunks,
}
# Other types gguf-py can quantise from floats (slow: for small models only).
_FLOAT_QUANTISERS = {
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
}
_SUPPORTED = {t.name for t in _WRITERS} | {t.name for t in _FLOAT_QUANTISERS}


def _quantised(rng_chunks: Callable[[TensorPlan], Iterator[np.ndarray]]) -> Callable[[TensorPlan], Iterator[np.ndarray]]:
    """Chunks of any supported type: random blocks where there is a writer, else quantised floats."""
    def chunks(plan: TensorPlan) -> Iterator[np.ndarray]:
        if plan.qtype in _WRITERS:
            yield from rng_chunks(plan)
            return
        from gguf.quants import quantize

        for x in rng_chunks(dataclasses.replace(plan, qtype=GGMLQuantizationType.F32)):
            yield quantize(x, plan.qtype)
    return chunks


# ----------------------------------------------------------------------------------------------
# Metadata and the file


def model_fingerprint(spec: ModelSpec, seed: int, qtype: str | None = None) -> str:
    """Hex digest identifying the bytes :func:`write_model` produces for these arguments."""
    return fingerprint({"spec": dataclasses.asdict(spec), "seed": seed, "qtype": qtype or spec.qtype})


def _metadata(spec: ModelSpec, seed: int, qtype: str | None, plans: list[TensorPlan]) -> list[KV]:
    U32, STR = GGUFValueType.UINT32, GGUFValueType.STRING
    fp = model_fingerprint(spec, seed, qtype)
    kvs = [
        kv("general.name", STR, f"clutor-synth {spec.name} seed {seed} ({fp[:12]})"),
        kv("general.file_type", U32, file_type(plans)),
        kv("general.quantization_version", U32, 2),
        kv("clutor.synth.fingerprint", STR, fp),
    ] + _arch_keys(spec)
    pre = "olmo" if spec.arch == "olmoe" else "qwen2"
    return kvs + tokenizer_metadata(spec.vocab_size, pre, OLMOE_TEMPLATE if spec.arch == "olmoe" else CHATML_TEMPLATE)


def _arch_keys(spec: ModelSpec) -> list[KV]:
    """The architecture's keys (``{arch}.*``), as llama.cpp's converter writes them for this spec."""
    U32, F32, STR, BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.BOOL
    a = spec.arch
    kvs = [
        kv(f"{a}.context_length", U32, spec.n_ctx),
        kv(f"{a}.embedding_length", U32, spec.n_embd),
        kv(f"{a}.block_count", U32, spec.n_layer + spec.n_nextn),
        kv(f"{a}.attention.head_count", U32, spec.n_head),
        kv(f"{a}.attention.head_count_kv", U32, spec.n_head_kv if a != "deepseek2" or not spec.mla_split else 1),
        kv(f"{a}.rope.freq_base", F32, spec.rope_base),
        kv(f"{a}.attention.layer_norm_rms_epsilon", F32, spec.eps),
        kv(f"{a}.expert_count", U32, spec.n_expert),
        kv(f"{a}.expert_used_count", U32, spec.n_expert_used),
    ]
    # Written only when they differ from the default n_embd / n_head, as converters do for
    # olmoe; Qwen3 files always carry them.
    if a == "deepseek2":
        kvs += _mla_metadata(spec)
    elif spec.arch == "qwen3moe" or spec.head_dim * spec.n_head != spec.n_embd or a in ("glm4moe", "gpt-oss"):
        kvs += [kv(f"{a}.attention.key_length", U32, spec.head_dim), kv(f"{a}.attention.value_length", U32, spec.head_dim)]
    if spec.n_rot and a != "deepseek2":
        kvs.append(kv(f"{a}.rope.dimension_count", U32, spec.n_rot))
    if a in ("glm4moe", "deepseek2"):
        kvs += [kv(f"{a}.leading_dense_block_count", U32, spec.n_dense_lead),
                kv(f"{a}.expert_shared_count", U32, spec.n_expert_shared)]
        if spec.n_ff:
            kvs.append(kv(f"{a}.feed_forward_length", U32, spec.n_ff))
    if spec.n_nextn:
        kvs.append(kv(f"{a}.nextn_predict_layers", U32, spec.n_nextn))
    if spec.gating:
        kvs.append(kv(f"{a}.expert_gating_func", U32, spec.gating))
    if a in ("glm4moe", "deepseek2"):
        kvs.append(kv(f"{a}.expert_weights_norm", BOOL, spec.norm_w))
    if spec.w_scale:
        kvs.append(kv(f"{a}.expert_weights_scale", F32, spec.w_scale))
    if spec.n_group:
        kvs += [kv(f"{a}.expert_group_count", U32, spec.n_group), kv(f"{a}.expert_group_used_count", U32, spec.n_group_used)]
    if spec.sliding_window:
        kvs.append(kv(f"{a}.attention.sliding_window", U32, spec.sliding_window))
    if spec.yarn_factor:
        kvs += [kv(f"{a}.rope.scaling.type", STR, "yarn"), kv(f"{a}.rope.scaling.factor", F32, spec.yarn_factor),
                kv(f"{a}.rope.scaling.original_context_length", U32, spec.yarn_orig_ctx)]
        if spec.yarn_log_mul:
            kvs.append(kv(f"{a}.rope.scaling.yarn_log_multiplier", F32, spec.yarn_log_mul))
    if a == "llama":  # the expert size is feed_forward_length
        kvs.append(kv(f"{a}.feed_forward_length", U32, spec.n_ff_exp))
    elif a == "olmoe":  # olmoe has no expert-specific key: feed_forward_length is the expert size
        kvs.append(kv(f"{a}.feed_forward_length", U32, spec.n_ff_exp))
    else:
        kvs.append(kv(f"{a}.expert_feed_forward_length", U32, spec.n_ff_exp))
    if a == "qwen2moe":
        kvs += [
            kv(f"{a}.feed_forward_length", U32, spec.n_ff_shexp),
            kv(f"{a}.expert_shared_feed_forward_length", U32, spec.n_ff_shexp),
        ]
    return kvs


def _mla_metadata(spec: ModelSpec) -> list[KV]:
    U32 = GGUFValueType.UINT32
    a, hk, hv, C = spec.arch, spec.head_dim, spec.v_head_dim, spec.kv_lora_rank
    kvs = [kv(f"{a}.attention.q_lora_rank", U32, spec.q_lora_rank), kv(f"{a}.attention.kv_lora_rank", U32, C),
           kv(f"{a}.rope.dimension_count", U32, spec.n_rot)]
    if spec.mla_split:  # the MQA form over the latent, and the per-head sizes under their _mla keys
        kvs += [kv(f"{a}.attention.key_length", U32, C + spec.n_rot), kv(f"{a}.attention.value_length", U32, C),
                kv(f"{a}.attention.key_length_mla", U32, hk), kv(f"{a}.attention.value_length_mla", U32, hv)]
    else:
        kvs += [kv(f"{a}.attention.key_length", U32, hk), kv(f"{a}.attention.value_length", U32, hv)]
    return kvs



def expected_size(spec: ModelSpec, seed: int = 0, qtype: str | None = None) -> int:
    """Size in bytes of the file :func:`write_model` writes for these arguments."""
    plans = plan_tensors(spec, qtype)
    return file_size(len(header_bytes(spec.arch, _metadata(spec, seed, qtype, plans), plans)), plans)


def write_model(
    path: str | os.PathLike,
    preset: ModelSpec | str,
    *,
    seed: int,
    qtype: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a random-weight GGUF for ``preset`` to ``path``; return the path.

    ``qtype`` (F32, F16, BF16, Q8_0, Q4_K, Q4_0, Q4_1, Q5_0, Q5_1) sets every weight matrix and
    overrides the preset's types; None keeps the preset's (``spec.qtype`` / ``spec.expert_qtype``).
    Norm weights, biases and ``ffn_gate_inp`` are always F32. ``progress(done, total)`` is called
    with byte counts after each chunk.
    """
    spec = PRESETS[preset] if isinstance(preset, str) else preset
    plans = plan_tensors(spec, qtype)
    chunks = _quantised(seeded_chunks(seed, _WRITERS))
    return write_gguf(path, spec.arch, _metadata(spec, seed, qtype, plans), plans, chunks, progress)
