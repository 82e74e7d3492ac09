"""Random-weight GGUF models that llama.cpp loads: test fixtures, the demo model, benchmark-sized files.

The weights are random but deterministic from a seed and scaled so the network is numerically sane
(activations O(1) through the layers, router logits spread enough that top-k choices are rarely
near-ties, final logits with a standard deviation near 3 so the greedy token is rarely a near-tie).
The tokenizer is a real byte-level BPE trained on the small corpus shipped in ``clutor/data``.

Files are written one tensor at a time, and each tensor in chunks of about a million values, so a
7 GB model needs far less than 1 GB of memory. Q8_0 and Q4_K tensors are written as random
*blocks* (random scales and random quants) instead of quantising floats, which is what makes the
big presets fast to produce; their dequantised values are close to N(0, sigma).

Layout of the file, as llama.cpp expects it (see shared/notes/gguf-moe.md):
    GGUF header | metadata key/values | tensor infos | pad to 32 | tensor data, each padded to 32
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.resources
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType

from clutor.errors import ClutorError, UnsupportedError

__all__ = [
    "GENERATOR_VERSION",
    "ModelSpec",
    "PRESETS",
    "TensorPlan",
    "ensure_demo_model",
    "model_fingerprint",
    "plan_tensors",
    "quiet_tokens",
    "train_tokenizer",
    "write_model",
]

# Bump when the bytes written for a given (spec, seed, qtype) change: it invalidates cached demo models.
GENERATOR_VERSION = 2

ALIGNMENT = 32
ARCHS = ("olmoe", "qwen2moe", "qwen3moe", "llama", "glm4moe", "deepseek2", "gpt-oss")

# Target standard deviation of the final logits (see module docstring).
LOGIT_STD = 3.0
# Target standard deviation of the router logits; with 8..128 experts this keeps the k-th and
# (k+1)-th scores apart by a few tenths at most positions.
ROUTER_STD = 2.0
# With a tied output matrix the embedding has the output's small scale, and the logit of the input
# token itself is about LOGIT_STD**2 / rms(x) (its embedding is part of x). Scaling up what each
# layer adds to the residual stream keeps that self-logit near one standard deviation instead of
# letting greedy decoding repeat its input. Layers see RMS-normalised inputs, so nothing else changes.
TIED_RESIDUAL_GAIN = 4.0
# Output rows of "quiet" tokens are scaled by this, so their logits stay near 0 and greedy decoding
# emits readable text: control tokens (specials, the <|unused_N|> padding that fills most of a 50k or
# 150k vocabulary) and tokens whose bytes are not valid UTF-8 on their own (stray bytes >= 0x80).
QUIET_ROW_GAIN = 0.1

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# OLMoE-Instruct's own (Tulu) style: role tags as plain text, eos closing each assistant turn.
OLMOE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
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
    # gpt-oss: sinks, q/k/v/o biases, router and per-expert biases, sliding window on even layers,
    # attention wider than n_embd (8 heads x 32), YaRN.
    "tiny-gptoss": ModelSpec(
        name="tiny-gptoss", arch="gpt-oss", n_layer=2, n_embd=128, n_head=8, n_head_kv=2, head_dim=32,
        n_expert=4, n_expert_used=2, n_ff_exp=128, vocab_size=512, n_ctx=512, rope_base=1.5e5, eps=1e-5,
        n_rot=32, qkv_bias=True, sliding_window=8, yarn_factor=4.0, yarn_orig_ctx=64,
    ),
    # OLMoE structure sized to about 1 GB, most of it in experts: what `clutor demo` runs.
    "demo": ModelSpec(
        name="demo", arch="olmoe", n_layer=16, n_embd=1024, n_head=8, n_head_kv=8, head_dim=128,
        n_expert=32, n_expert_used=4, n_ff_exp=512, vocab_size=4096, n_ctx=4096, eps=1e-5, qtype="Q8_0",
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
# Tokenizer


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (byte b is shown as this character in token text)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _corpus_text() -> str:
    return importlib.resources.files("clutor").joinpath("data/corpus.txt").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=8)
def _train_bpe(n_learned: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(learned token strings, merges) of a byte-level BPE with at most ``n_learned`` symbols
    (256 byte symbols included), trained on the shipped corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=n_learned,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # One document per paragraph: the counts are what matter, the order does not.
    tok.train_from_iterator(_corpus_text().split("\n\n"), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = tuple(m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"])
    vocab: dict[str, int] = model["vocab"]
    # Our own id order: the 256 byte symbols by byte value, then one token per merge in rank order.
    tokens = _byte_chars() + [m.replace(" ", "", 1) for m in merges]
    if set(tokens) != set(vocab) or len(tokens) != len(vocab):
        raise RuntimeError("BPE trainer produced a vocabulary that is not bytes + one token per merge")
    return tuple(tokens), merges


def train_tokenizer(vocab_size: int, seed: int = 0) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of exactly ``vocab_size`` tokens, in GGUF table form.

    Returns (tokens, token_types, merges): tokens as byte-level strings (``Ġthe``), token types
    1 (normal) or 3 (control), merges as ``"a b"`` strings in rank order. Layout: 256 byte
    symbols, learned merges, ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, then control
    tokens ``<|unused_N|>`` when the corpus cannot fill the requested size. BPE training has no
    randomness: ``seed`` is accepted for symmetry with :func:`write_model` and changes nothing.
    """
    del seed
    n_special = len(SPECIAL_TOKENS)
    if vocab_size < 256 + n_special:
        raise UnsupportedError("<synth>", "vocab_size", f"at least {256 + n_special}", vocab_size)
    learned, merges = _train_bpe(vocab_size - n_special)
    tokens = list(learned) + list(SPECIAL_TOKENS)
    types = [1] * len(learned) + [3] * n_special
    n_pad = vocab_size - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(n_pad)]
    types += [3] * n_pad
    return tokens, types, list(merges)


# ----------------------------------------------------------------------------------------------
# Tensor plan


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write. ``shape`` is numpy order (ne reversed); ``init`` says how to fill it:
    "normal" N(0, std), "norm" 1 + 0.1 N(0, 1) (RMSNorm weights). In an output matrix
    (``quiet`` set) the rows of quiet tokens get QUIET_ROW_GAIN times the spread."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    init: str
    std: float = 0.0
    quiet: bool = False

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        n = int(np.prod(self.shape))
        return n // block * size


def _mla_plans(spec: ModelSpec, b: str, w, norm, gain: float) -> list[TensorPlan]:
    """deepseek2's multi-head latent attention: q through an optional low-rank bottleneck, one
    compressed latent c_kv (kv_lora_rank) + one shared RoPE key (n_rot) per token, per-head
    up-projections of the latent to keys (attn_k_b) and values (attn_v_b), or both in attn_kv_b."""
    D, H, hk, hv = spec.n_embd, spec.n_head, spec.head_dim, spec.v_head_dim
    rope, C, Lq = spec.n_rot, spec.kv_lora_rank, spec.q_lora_rank
    nope = hk - rope
    plans = [norm(b + "attn_norm.weight", D)]
    if Lq:
        plans += [w(b + "attn_q_a.weight", (Lq, D), 1 / np.sqrt(D)), norm(b + "attn_q_a_norm.weight", Lq),
                  w(b + "attn_q_b.weight", (H * hk, Lq), 1 / np.sqrt(Lq))]
    else:
        plans.append(w(b + "attn_q.weight", (H * hk, D), 1 / np.sqrt(D)))
    plans += [w(b + "attn_kv_a_mqa.weight", (C + rope, D), 1 / np.sqrt(D)), norm(b + "attn_kv_a_norm.weight", C)]
    if spec.mla_split:
        plans += [w(b + "attn_k_b.weight", (H, C, nope), 1 / np.sqrt(C)), w(b + "attn_v_b.weight", (H, hv, C), 1 / np.sqrt(C))]
    else:
        plans.append(w(b + "attn_kv_b.weight", (H * (nope + hv), C), 1 / np.sqrt(C)))
    plans.append(w(b + "attn_output.weight", (D, H * hv), gain / np.sqrt(H * hv)))
    return plans


def _qtype(where: str, name: str, field: str) -> GGMLQuantizationType:
    try:
        qt = GGMLQuantizationType[name.upper()]
    except KeyError:
        raise UnsupportedError(where, field, "a ggml type name such as F16, Q8_0, Q4_K", name) from None
    if qt not in _WRITERS and qt not in _FLOAT_QUANTISERS:
        raise UnsupportedError(where, field, "one of " + ", ".join(sorted(_SUPPORTED)), name)
    return qt


def plan_tensors(spec: ModelSpec, qtype: str | None = None) -> list[TensorPlan]:
    """Every tensor of ``spec`` with its llama.cpp name, numpy shape, type and initialisation."""
    where = f"<synth preset {spec.name}>"
    if spec.arch not in ARCHS:
        raise UnsupportedError(where, "arch", " | ".join(ARCHS), spec.arch)
    mat = _qtype(where, qtype or spec.qtype, "qtype")
    exp = mat if qtype is not None or spec.expert_qtype is None else _qtype(where, spec.expert_qtype, "expert_qtype")
    f32 = GGMLQuantizationType.F32
    D, V, E, F = spec.n_embd, spec.vocab_size, spec.n_expert, spec.n_ff_exp
    Q, KV = spec.n_q, spec.n_kv

    def w(name: str, shape: tuple[int, ...], std: float, qt: GGMLQuantizationType = mat, quiet: bool = False) -> TensorPlan:
        return TensorPlan(name, shape, qt, "normal", std, quiet)

    def norm(name: str, size: int) -> TensorPlan:
        return TensorPlan(name, (size,), f32, "norm")

    out_std = LOGIT_STD / np.sqrt(D)
    gain = TIED_RESIDUAL_GAIN if spec.tied_output else 1.0
    # Tied: the embedding doubles as the output matrix, so it takes the output scale.
    if spec.tied_output:
        plans = [w("token_embd.weight", (V, D), out_std, quiet=True)]
    else:
        plans = [w("token_embd.weight", (V, D), 1.0)]
    for i in range(spec.n_layer + spec.n_nextn):
        b = f"blk.{i}."
        if spec.arch == "deepseek2":
            plans += _mla_plans(spec, b, w, norm, gain)
        else:
            plans += [
                norm(b + "attn_norm.weight", D),
                w(b + "attn_q.weight", (Q, D), 1 / np.sqrt(D)),
                w(b + "attn_k.weight", (KV, D), 1 / np.sqrt(D)),
                w(b + "attn_v.weight", (KV, D), 1 / np.sqrt(D)),
                w(b + "attn_output.weight", (D, Q), gain / np.sqrt(Q)),
            ]
        if spec.arch == "qwen2moe" or spec.qkv_bias:
            plans += [
                TensorPlan(b + "attn_q.bias", (Q,), f32, "normal", 0.2),
                TensorPlan(b + "attn_k.bias", (KV,), f32, "normal", 0.2),
                TensorPlan(b + "attn_v.bias", (KV,), f32, "normal", 0.2),
            ]
        if spec.arch == "olmoe":  # QK-norm over the whole q / k vectors
            plans += [norm(b + "attn_q_norm.weight", Q), norm(b + "attn_k_norm.weight", KV)]
        if spec.arch == "qwen3moe" or spec.qk_norm:  # QK-norm per head
            plans += [norm(b + "attn_q_norm.weight", spec.head_dim), norm(b + "attn_k_norm.weight", spec.head_dim)]
        if spec.arch == "gpt-oss":
            plans += [TensorPlan(b + "attn_output.bias", (D,), f32, "normal", 0.2),
                      TensorPlan(b + "attn_sinks.weight", (spec.n_head,), f32, "normal", 1.0)]
        post = spec.arch in ("glm4moe", "gpt-oss")
        plans.append(norm(b + ("post_attention_norm.weight" if post else "ffn_norm.weight"), D))
        if i < spec.n_dense_lead:
            Fd = spec.n_ff
            plans += [w(b + "ffn_gate.weight", (Fd, D), 1 / np.sqrt(D)), w(b + "ffn_up.weight", (Fd, D), 1 / np.sqrt(D)),
                      w(b + "ffn_down.weight", (D, Fd), gain / np.sqrt(Fd))]
            continue
        plans.append(w(b + "ffn_gate_inp.weight", (E, D), ROUTER_STD / np.sqrt(D), f32))
        if spec.fused_gate_up:
            plans.append(w(b + "ffn_gate_up_exps.weight", (E, 2 * F, D), 1 / np.sqrt(D), exp))
        else:
            plans += [w(b + "ffn_gate_exps.weight", (E, F, D), 1 / np.sqrt(D), exp),
                      w(b + "ffn_up_exps.weight", (E, F, D), 1 / np.sqrt(D), exp)]
        plans.append(w(b + "ffn_down_exps.weight", (E, D, F), gain / np.sqrt(F), exp))
        if spec.arch == "gpt-oss":
            plans += [TensorPlan(b + "ffn_gate_inp.bias", (E,), f32, "normal", 0.5),
                      TensorPlan(b + "ffn_gate_exps.bias", (E, F), f32, "normal", 0.2),
                      TensorPlan(b + "ffn_up_exps.bias", (E, F), f32, "normal", 0.2),
                      TensorPlan(b + "ffn_down_exps.bias", (E, D), f32, "normal", 0.2)]
        if spec.probs_bias:
            # sigmoid probabilities are in (0, 1): a bias of this size reorders close experts only
            plans.append(TensorPlan(b + "exp_probs_b.bias", (E,), f32, "normal", 0.05))
        if spec.arch == "qwen2moe":
            S = spec.n_ff_shexp
            plans += [
                TensorPlan(b + "ffn_gate_inp_shexp.weight", (D,), f32, "normal", 1 / np.sqrt(D)),
                w(b + "ffn_gate_shexp.weight", (S, D), 1 / np.sqrt(D)),
                w(b + "ffn_up_shexp.weight", (S, D), 1 / np.sqrt(D)),
                w(b + "ffn_down_shexp.weight", (D, S), gain / np.sqrt(S)),
            ]
        if spec.n_expert_shared:
            S = spec.n_ff_exp * spec.n_expert_shared
            plans += [w(b + "ffn_gate_shexp.weight", (S, D), 1 / np.sqrt(D)), w(b + "ffn_up_shexp.weight", (S, D), 1 / np.sqrt(D)),
                      w(b + "ffn_down_shexp.weight", (D, S), gain / np.sqrt(S))]
        if i >= spec.n_layer:  # an MTP (nextn) layer: its own projection and norms
            plans += [w(b + "nextn.eh_proj.weight", (D, 2 * D), 1 / np.sqrt(2 * D)), norm(b + "nextn.enorm.weight", D),
                      norm(b + "nextn.hnorm.weight", D), norm(b + "nextn.shared_head_norm.weight", D)]
    plans.append(norm("output_norm.weight", D))
    if not spec.tied_output:
        plans.append(w("output.weight", (V, D), out_std, quiet=True))
    for i, p in enumerate(plans):
        block = GGML_QUANT_SIZES[p.qtype][0]
        if p.shape[-1] % block and spec.k_fallback and block == 256:
            plans[i] = p = dataclasses.replace(p, qtype=GGMLQuantizationType.Q8_0)
            block = GGML_QUANT_SIZES[p.qtype][0]
        if p.shape[-1] % block:
            raise UnsupportedError(where, p.name, f"a row length that is a multiple of {block} for {p.qtype.name}", p.shape[-1])
    return plans


# ----------------------------------------------------------------------------------------------
# Random data, chunk by chunk. Each tensor has its own generator seeded from (seed, name), so a
# tensor's bytes do not depend on which tensors come before it.

_CHUNK = 1 << 20  # values per chunk: keeps temporaries to a few MB


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))


def _float_chunks(plan: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """float32 values of the tensor, whole rows per chunk."""
    row = plan.shape[-1]
    n_rows = int(np.prod(plan.shape)) // row
    rows_per = max(1, _CHUNK // row)
    for r0 in range(0, n_rows, rows_per):
        n = (min(n_rows, r0 + rows_per) - r0) * row
        x = rng.standard_normal(n, dtype=np.float32).reshape(-1, row)  # [rows, row]
        if plan.init == "norm":
            x = 1.0 + 0.1 * x
        else:
            x *= plan.std * _row_gain(plan, r0, x.shape[0])[:, None]
        yield x


@functools.lru_cache(maxsize=8)
def quiet_tokens(vocab_size: int) -> np.ndarray:
    """[vocab_size] bool: control tokens, tokens whose bytes are not valid UTF-8 by themselves, and
    tokens holding ASCII control characters other than newline and tab."""
    tokens, types, _ = train_tokenizer(vocab_size)
    to_byte = {c: b for b, c in enumerate(_byte_chars())}
    quiet = np.array([t == 3 for t in types])
    for i, tok in enumerate(tokens):
        if not quiet[i]:
            try:
                text = bytes(to_byte[c] for c in tok).decode("utf-8")
            except UnicodeDecodeError:
                quiet[i] = True
                continue
            quiet[i] = any((ord(ch) < 32 and ch not in "\n\t") or ord(ch) == 127 for ch in text)
    return quiet


def _row_gain(plan: TensorPlan, first_row: int, n_rows: int) -> np.ndarray:
    """[n_rows] spread factor of rows first_row.. (QUIET_ROW_GAIN for quiet tokens' rows, else 1)."""
    if not plan.quiet:
        return np.ones(n_rows, dtype=np.float32)
    quiet = quiet_tokens(plan.shape[0])[first_row : first_row + n_rows]
    return np.where(quiet, QUIET_ROW_GAIN, 1.0).astype(np.float32)


def _block_gain(plan: TensorPlan, first_block: int, n_blocks: int, block: int) -> np.ndarray:
    """[n_blocks] spread factor of blocks first_block.. (blocks never straddle rows)."""
    per_row = plan.shape[-1] // block
    rows = np.arange(first_block, first_block + n_blocks) // per_row
    return _row_gain(plan, int(rows[0]), int(rows[-1]) - int(rows[0]) + 1)[rows - rows[0]].astype(np.float64)


_M6 = np.uint64(0x3F3F3F3F3F3F3F3F)
_C2 = np.uint64(0x0202020202020202)
_X80 = np.uint64(0x8080808080808080)
_M3 = np.uint64(0x7777777777777777)
_M1 = np.uint64(0x1111111111111111)
_S2, _S3 = np.uint64(2), np.uint64(3)
# std of the random int8 quants below: a sum of four uniform 6-bit values has variance 4 * (64^2 - 1) / 12
_Q8_STD = float(np.sqrt(4 * (64**2 - 1) / 12))
# std of the random 4-bit quants: two uniform 3-bit values plus one bit, variance 2 * 63 / 12 + 1 / 4
_Q4_STD = float(np.sqrt(2 * 63 / 12 + 0.25))
_Q4K_SC = np.arange(32, 64)  # sub-block scales are drawn from 32..63
_Q4K_SC_RMS = float(np.sqrt(np.mean(_Q4K_SC.astype(np.float64) ** 2)))


def _random_int8(rng: np.random.Generator, n: int) -> np.ndarray:
    """n near-Gaussian int8 values in [-126, 126], mean 0, std _Q8_STD (n a multiple of 8).

    Eight values per uint64 word: each byte lane sums four uniform 6-bit values (max 252, so no
    carry crosses into the next lane), then is re-centred to 128 and flipped to two's complement.
    """
    r = rng.bit_generator.random_raw(4 * (n // 8)).reshape(4, -1)  # [4, n/8] uint64
    s = (r[0] >> _S2) & _M6
    for k in range(1, 4):
        s += (r[k] >> _S2) & _M6
    s += _C2
    s ^= _X80
    return s.view(np.int8)


def _random_nibbles(rng: np.random.Generator, n_bytes: int) -> np.ndarray:
    """n_bytes bytes, each holding two near-Gaussian 4-bit values in 0..15, mean 7.5 (n_bytes % 8 == 0).

    Per 4-bit lane: a 3-bit value + another 3-bit value + the spare 4th bit of the first (max 15).
    """
    r = rng.bit_generator.random_raw(2 * (n_bytes // 8)).reshape(2, -1)  # [2, n_bytes/8] uint64
    q = (r[0] & _M3) + (r[1] & _M3) + ((r[0] >> _S3) & _M1)
    return q.view(np.uint8)


def _q8_0_chunks(plan: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Random Q8_0 blocks: [f16 d][32 x int8], value = d * q, so std = plan.std."""
    n_blocks = int(np.prod(plan.shape)) // 32
    per = _CHUNK // 32
    # The per-block jitter exp(0.1 N) inflates E[d^2] by exp(0.02); divide it back out.
    base = plan.std / _Q8_STD / np.exp(0.01)
    for b0 in range(0, n_blocks, per):
        nb = min(n_blocks, b0 + per) - b0
        out = np.empty((nb, 34), dtype=np.uint8)
        d = (base * np.exp(0.1 * rng.standard_normal(nb)) * _block_gain(plan, b0, nb, 32)).astype(np.float16)
        out[:, :2] = d.view(np.uint8).reshape(nb, 2)
        out[:, 2:] = _random_int8(rng, nb * 32).view(np.uint8).reshape(nb, 32)
        yield out


def _q4_k_chunks(plan: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Random Q4_K blocks of 256: [f16 d][f16 dmin][12 bytes of 6-bit scales/mins][128 bytes of nibbles].

    value = d * sc_j * q - dmin * m_j for sub-block j (32 values). With m_j = sc_j and
    dmin = 7.5 d this is d * sc_j * (q - 7.5): zero mean, std = d * rms(sc) * _Q4_STD.
    """
    n_blocks = int(np.prod(plan.shape)) // 256
    per = max(1, _CHUNK // 256)
    base = plan.std / (_Q4_STD * _Q4K_SC_RMS) / np.exp(0.01)
    for b0 in range(0, n_blocks, per):
        nb = min(n_blocks, b0 + per) - b0
        out = np.empty((nb, 144), dtype=np.uint8)
        d = base * np.exp(0.1 * rng.standard_normal(nb)) * _block_gain(plan, b0, nb, 256)
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
    per = _CHUNK // 32
    e0 = 128 + np.log2(plan.std / _MXFP4_STD)
    for b0 in range(0, n_blocks, per):
        nb = min(n_blocks, b0 + per) - b0
        out = np.empty((nb, 17), dtype=np.uint8)
        e = e0 + np.log2(_block_gain(plan, b0, nb, 32)) + rng.integers(-1, 2, size=nb) * 0.5
        out[:, 0] = np.clip(np.rint(e), 1, 254).astype(np.uint8)
        out[:, 1:] = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
        yield out


def _f32_chunks(plan: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    yield from _float_chunks(plan, rng)


def _f16_chunks(plan: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    for x in _float_chunks(plan, rng):
        yield x.astype(np.float16)


_WRITERS: dict[GGMLQuantizationType, Callable[[TensorPlan, np.random.Generator], Iterator[np.ndarray]]] = {
    GGMLQuantizationType.F32: _f32_chunks,
    GGMLQuantizationType.F16: _f16_chunks,
    GGMLQuantizationType.Q8_0: _q8_0_chunks,
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


def _tensor_chunks(plan: TensorPlan, seed: int) -> Iterator[np.ndarray]:
    rng = _rng(seed, plan.name)
    if plan.qtype in _WRITERS:
        yield from _WRITERS[plan.qtype](plan, rng)
        return
    from gguf.quants import quantize

    for x in _float_chunks(plan, rng):
        yield quantize(x, plan.qtype)


# ----------------------------------------------------------------------------------------------
# GGUF encoding


def _gguf_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


_SCALAR = {
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
}


def _kv(key: str, vtype: GGUFValueType, value: object, sub: GGUFValueType | None = None) -> bytes:
    out = _gguf_str(key) + struct.pack("<I", vtype)
    if vtype == GGUFValueType.STRING:
        return out + _gguf_str(str(value))
    if vtype == GGUFValueType.ARRAY:
        assert sub is not None and isinstance(value, (list, tuple))
        out += struct.pack("<IQ", sub, len(value))
        if sub == GGUFValueType.STRING:
            return out + b"".join(_gguf_str(v) for v in value)
        return out + np.asarray(value, dtype=np.dtype(_SCALAR[sub])).tobytes()
    return out + struct.pack(_SCALAR[vtype], value)


def _file_type(plans: list[TensorPlan]) -> int:
    """general.file_type from the type that holds most of the bytes (the experts)."""
    by_type: dict[GGMLQuantizationType, int] = {}
    for p in plans:
        by_type[p.qtype] = by_type.get(p.qtype, 0) + p.nbytes
    main = max(by_type, key=by_type.__getitem__)
    names = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_K": "MOSTLY_Q4_K_M", "MXFP4": "MOSTLY_MXFP4_MOE"}
    return int(LlamaFileType[names.get(main.name, "MOSTLY_" + main.name)])


_V2_FIELDS = ("name", "arch", "n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_expert", "n_expert_used",
               "n_ff_exp", "vocab_size", "n_ctx", "n_ff_shexp", "rope_base", "eps", "tied_output", "qtype",
               "expert_qtype")


def model_fingerprint(spec: ModelSpec, seed: int, qtype: str | None = None) -> str:
    """Hex digest identifying the bytes :func:`write_model` produces for these arguments."""
    # Fields added after version 2 enter only when set, so older presets keep their fingerprint.
    fields = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    d = {k: v for k, v in dataclasses.asdict(spec).items() if k in _V2_FIELDS or v != fields[k]}
    ident = {"spec": d, "seed": seed, "qtype": qtype or spec.qtype, "version": GENERATOR_VERSION}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _metadata(spec: ModelSpec, seed: int, qtype: str | None, plans: list[TensorPlan]) -> list[bytes]:
    U32, F32, STR, BOOL, ARR = (GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING,
                                GGUFValueType.BOOL, GGUFValueType.ARRAY)
    a = spec.arch
    fp = model_fingerprint(spec, seed, qtype)
    kvs = [
        _kv("general.architecture", STR, a),
        _kv("general.name", STR, f"clutor-synth {spec.name} seed {seed} ({fp[:12]})"),
        _kv("general.alignment", U32, ALIGNMENT),
        _kv("general.file_type", U32, _file_type(plans)),
        _kv("general.quantization_version", U32, 2),
        _kv("clutor.synth.fingerprint", STR, fp),
        _kv(f"{a}.context_length", U32, spec.n_ctx),
        _kv(f"{a}.embedding_length", U32, spec.n_embd),
        _kv(f"{a}.block_count", U32, spec.n_layer + spec.n_nextn),
        _kv(f"{a}.attention.head_count", U32, spec.n_head),
        _kv(f"{a}.attention.head_count_kv", U32, spec.n_head_kv if a != "deepseek2" or not spec.mla_split else 1),
        _kv(f"{a}.rope.freq_base", F32, spec.rope_base),
        _kv(f"{a}.attention.layer_norm_rms_epsilon", F32, spec.eps),
        _kv(f"{a}.expert_count", U32, spec.n_expert),
        _kv(f"{a}.expert_used_count", U32, spec.n_expert_used),
    ]
    # Written only when they differ from the default n_embd / n_head, as converters do for
    # olmoe; Qwen3 files always carry them.
    if a == "deepseek2":
        kvs += _mla_metadata(spec)
    elif spec.arch == "qwen3moe" or spec.head_dim * spec.n_head != spec.n_embd or a in ("glm4moe", "gpt-oss"):
        kvs += [_kv(f"{a}.attention.key_length", U32, spec.head_dim), _kv(f"{a}.attention.value_length", U32, spec.head_dim)]
    if spec.n_rot and a != "deepseek2":
        kvs.append(_kv(f"{a}.rope.dimension_count", U32, spec.n_rot))
    if a in ("glm4moe", "deepseek2"):
        kvs += [_kv(f"{a}.leading_dense_block_count", U32, spec.n_dense_lead),
                _kv(f"{a}.expert_shared_count", U32, spec.n_expert_shared)]
        if spec.n_ff:
            kvs.append(_kv(f"{a}.feed_forward_length", U32, spec.n_ff))
    if spec.n_nextn:
        kvs.append(_kv(f"{a}.nextn_predict_layers", U32, spec.n_nextn))
    if spec.gating:
        kvs.append(_kv(f"{a}.expert_gating_func", U32, spec.gating))
    if a in ("glm4moe", "deepseek2"):
        kvs.append(_kv(f"{a}.expert_weights_norm", BOOL, spec.norm_w))
    if spec.w_scale:
        kvs.append(_kv(f"{a}.expert_weights_scale", F32, spec.w_scale))
    if spec.n_group:
        kvs += [_kv(f"{a}.expert_group_count", U32, spec.n_group), _kv(f"{a}.expert_group_used_count", U32, spec.n_group_used)]
    if spec.sliding_window:
        kvs.append(_kv(f"{a}.attention.sliding_window", U32, spec.sliding_window))
    if spec.yarn_factor:
        kvs += [_kv(f"{a}.rope.scaling.type", STR, "yarn"), _kv(f"{a}.rope.scaling.factor", F32, spec.yarn_factor),
                _kv(f"{a}.rope.scaling.original_context_length", U32, spec.yarn_orig_ctx)]
        if spec.yarn_log_mul:
            kvs.append(_kv(f"{a}.rope.scaling.yarn_log_multiplier", F32, spec.yarn_log_mul))
    if a == "llama":  # the expert size is feed_forward_length
        kvs.append(_kv(f"{a}.feed_forward_length", U32, spec.n_ff_exp))
    elif a == "olmoe":  # olmoe has no expert-specific key: feed_forward_length is the expert size
        kvs.append(_kv(f"{a}.feed_forward_length", U32, spec.n_ff_exp))
    else:
        kvs.append(_kv(f"{a}.expert_feed_forward_length", U32, spec.n_ff_exp))
    if a == "qwen2moe":
        kvs += [
            _kv(f"{a}.feed_forward_length", U32, spec.n_ff_shexp),
            _kv(f"{a}.expert_shared_feed_forward_length", U32, spec.n_ff_shexp),
        ]

    tokens, types, merges = train_tokenizer(spec.vocab_size, seed)
    eos = tokens.index("<|endoftext|>")
    kvs += [
        _kv("tokenizer.ggml.model", STR, "gpt2"),
        _kv("tokenizer.ggml.pre", STR, "olmo" if a == "olmoe" else "qwen2"),
        _kv("tokenizer.ggml.tokens", ARR, tokens, GGUFValueType.STRING),
        _kv("tokenizer.ggml.token_type", ARR, types, GGUFValueType.INT32),
        _kv("tokenizer.ggml.merges", ARR, merges, GGUFValueType.STRING),
        _kv("tokenizer.ggml.bos_token_id", U32, eos),
        _kv("tokenizer.ggml.eos_token_id", U32, eos),
        _kv("tokenizer.ggml.padding_token_id", U32, eos),
        _kv("tokenizer.ggml.add_bos_token", BOOL, False),
        _kv("tokenizer.chat_template", STR, OLMOE_TEMPLATE if a == "olmoe" else CHATML_TEMPLATE),
    ]
    return kvs


def _mla_metadata(spec: ModelSpec) -> list[bytes]:
    U32 = GGUFValueType.UINT32
    a, hk, hv, C = spec.arch, spec.head_dim, spec.v_head_dim, spec.kv_lora_rank
    kvs = [_kv(f"{a}.attention.q_lora_rank", U32, spec.q_lora_rank), _kv(f"{a}.attention.kv_lora_rank", U32, C),
           _kv(f"{a}.rope.dimension_count", U32, spec.n_rot)]
    if spec.mla_split:  # the MQA form over the latent, and the per-head sizes under their _mla keys
        kvs += [_kv(f"{a}.attention.key_length", U32, C + spec.n_rot), _kv(f"{a}.attention.value_length", U32, C),
                _kv(f"{a}.attention.key_length_mla", U32, hk), _kv(f"{a}.attention.value_length_mla", U32, hv)]
    else:
        kvs += [_kv(f"{a}.attention.key_length", U32, hk), _kv(f"{a}.attention.value_length", U32, hv)]
    return kvs


def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _header(spec: ModelSpec, seed: int, qtype: str | None, plans: list[TensorPlan]) -> bytes:
    kvs = _metadata(spec, seed, qtype, plans)
    parts = [b"GGUF", struct.pack("<IQQ", 3, len(plans), len(kvs)), *kvs]
    offset = 0
    for p in plans:
        ne = p.shape[::-1]  # GGUF lists the fastest axis first
        parts.append(_gguf_str(p.name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, p.qtype, offset))
        offset += _pad(p.nbytes)
    head = b"".join(parts)
    return head + b"\0" * (_pad(len(head)) - len(head))


def expected_size(spec: ModelSpec, seed: int = 0, qtype: str | None = None) -> int:
    """Size in bytes of the file :func:`write_model` writes for these arguments."""
    plans = plan_tensors(spec, qtype)
    return len(_header(spec, seed, qtype, plans)) + sum(_pad(p.nbytes) for p in plans)


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
    head = _header(spec, seed, qtype, plans)
    total = len(head) + sum(_pad(p.nbytes) for p in plans)
    path = Path(path)
    done = 0
    with open(path, "wb") as f:
        f.write(head)
        done += len(head)
        for p in plans:
            written = 0
            for chunk in _tensor_chunks(p, seed):
                f.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
                written += chunk.nbytes
                if progress is not None:
                    progress(done + written, total)
            if written != p.nbytes:
                raise RuntimeError(f"{p.name}: wrote {written} bytes, planned {p.nbytes}")
            f.write(b"\0" * (_pad(written) - written))
            done += _pad(written)
    if done != total:
        raise RuntimeError(f"{path}: wrote {done} bytes, planned {total}")
    return path


# ----------------------------------------------------------------------------------------------
# The demo model in the user's cache


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "clutor"


def _is_valid(path: Path, spec: ModelSpec, seed: int, qtype: str | None) -> bool:
    """Cheap check that ``path`` is the complete file write_model would produce: same size and
    same fingerprint in the header (the header is rewritten whenever anything that matters changes)."""
    try:
        if path.stat().st_size != expected_size(spec, seed, qtype):
            return False
        want = _header(spec, seed, qtype, plan_tensors(spec, qtype))
        with open(path, "rb") as f:
            return f.read(len(want)) == want
    except OSError:
        return False


_TMP_SUFFIX = ".tmp"
_STALE_SECONDS = 24 * 3600  # a temp file without a live writer's pid in its name, this old, is garbage


def _remove_stale_temps(root: Path) -> None:
    """Delete half-written demo models left by killed runs: `.NAME.PID.RANDOM.tmp` whose PID no longer
    runs (older versions wrote `.NAME.RANDOM.tmp`: those go once a day old)."""
    import time

    for p in root.glob(f".*.gguf.*{_TMP_SUFFIX}"):
        fields = p.name[: -len(_TMP_SUFFIX)].split(".")
        pid = fields[-2] if len(fields) >= 2 else ""
        try:
            if pid.isdigit():
                if _alive(int(pid)):
                    continue
            elif time.time() - p.stat().st_mtime < _STALE_SECONDS:
                continue
            p.unlink()
        except OSError:
            pass  # gone already, or not ours to remove


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def ensure_demo_model(
    cache_dir: str | os.PathLike | None = None,
    *,
    spec: ModelSpec | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Path of the demo model in ``cache_dir`` (default ``$XDG_CACHE_HOME/clutor`` or
    ``~/.cache/clutor``), writing it first if it is missing or stale.

    The file name carries the fingerprint of (spec, seed, generator version); it is written to a
    temporary name in the same directory and renamed into place, so a crash never leaves a
    half-written file under the final name. ``spec`` overrides the ``demo`` preset (for tests).
    """
    spec = spec or PRESETS["demo"]
    root = Path(cache_dir) if cache_dir is not None else _cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ClutorError(f"{root}: cannot create the demo model's directory: {e.strerror or e}") from None
    if not root.is_dir():
        raise ClutorError(f"{root}: cannot write the demo model: not a directory")
    path = root / f"{spec.name}-{model_fingerprint(spec, seed)[:16]}.gguf"
    _remove_stale_temps(root)
    if _is_valid(path, spec, seed, None):
        return path
    try:
        # the pid in the name lets a later run tell a dead writer's leftover from a live writer's file
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=_TMP_SUFFIX, dir=root)
    except OSError as e:
        raise ClutorError(f"{root}: cannot write the demo model: {e.strerror or e}") from None
    os.close(fd)
    try:
        write_model(tmp, spec, seed=seed, progress=progress)
        os.replace(tmp, path)
    except OSError as e:
        raise ClutorError(f"{path}: cannot write the demo model: {e.strerror or e}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)  # after the rename there is nothing left under this name
    return path
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=root)
    os.close(fd)
    try:
        write_model(tmp, spec, seed=seed, progress=progress)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
