#!/usr/bin/env python3
"""Make a tiny random-weight model the way real GGUF files are made: a Hugging Face checkpoint
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the model family's chat
template), converted by llama.cpp's own convert_hf_to_gguf.py, then quantised by llama.cpp's own
quantiser (llama-cpp-python's llama_model_quantize).

    python tools/make_hf_fixture.py PRESET LLAMA_CPP_DIR OUT_DIR [--types F16 Q4_K_M] [--seed 0]

writes OUT_DIR/tiny-<preset>-<type>.gguf for each type. LLAMA_CPP_DIR is a llama.cpp checkout (its
convert_hf_to_gguf.py, conversion/ and gguf-py/ are used from there; nothing of it is copied).
Needs torch, transformers and safetensors (the converter's own requirements; sentencepiece for ERNIE 4.5,
whose converter reads a SentencePiece tokenizer.model) and llama-cpp-python.

The vocabulary is a cut of a real one: the first tokens of ggml-vocab-qwen35.gguf (shared/data/vocab)
with the merges among them, plus the family's special tokens, so the file is small. The converter
identifies a tokenizer's split rules by hashing how it tokenizes a test text, which a cut vocabulary
cannot reproduce; the tool therefore tells it the pre-tokenizer by name (`qwen35`), which is the one
thing it decides for the converter. Multi-token-prediction layers are not made (--no-mtp, where the
converter takes it): transformers' model classes do not have them, and Clutor does not compute them.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
if not SHARED.exists():
    SHARED = Path("/work/shared/data")
QWEN35_VOCAB = SHARED / "vocab" / "ggml-vocab-qwen35.gguf"
QWEN35_TEMPLATE = SHARED / "templates" / "Qwen3.5-4B.jinja"
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                 "</tool_response>", "<think>", "</think>"]
LLAMA_FTYPES = {"F16": 1, "Q8_0": 7, "Q4_K_M": 15, "Q6_K": 18}

# Shapes: n_embd 128 so rows are shorter than a K-quant block (llama.cpp's Q4_K_M then falls back to
# Q5_0 / Q8_0 for them, as it does in real files for such rows); v heads = 2 x k heads so that the
# tiled (qwen35moe) and grouped (qwen3next) head orders differ; prompts of ~90 tokens then span two
# 64-token chunks of the delta rule.
PRESETS = {
    "qwen35moe": dict(
        cls="Qwen3_5MoeForCausalLM", config="Qwen3_5MoeTextConfig", vocab=768,
        hf=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [3, 3, 2], "mrope_interleaved": True},
                tie_word_embeddings=False)),
    "qwen3next": dict(
        cls="Qwen3NextForCausalLM", config="Qwen3NextConfig", vocab=768,
        hf=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False)),
    "nemotron_h_moe": dict(
        cls="NemotronHForCausalLM", config="NemotronHConfig", vocab=768, pre="pixtral", specials_first=True,
        specials=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                  "</tool_call>"], eos="<|im_end|>", pad="<unk>", bos="<s>",
        hf=dict(hidden_size=128, layers_block_type=["linear_attention", "moe", "full_attention", "moe",
                                                    "linear_attention", "moe"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, mamba_num_heads=8, mamba_head_dim=16,
                ssm_state_size=16, n_groups=2, conv_kernel=4, expand=1, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=64, moe_shared_expert_intermediate_size=64, n_shared_experts=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1, layer_norm_epsilon=1e-5,
                max_position_embeddings=4096, tie_word_embeddings=False, use_conv_bias=True,
                pad_token_id=0, bos_token_id=1, eos_token_id=4)),
    # Gemma-4-26B-A4B's form at toy size: five sliding-window layers (window 16, so ~90-token prompts
    # leave it) to one global, global layers with their own head size and KV heads and V = K
    # (attention_k_eq_v), 25% proportional RoPE there; every layer a shared GELU MLP plus fused experts.
    "gemma4": dict(
        cls="Gemma4ForCausalLM", config="Gemma4TextConfig", vocab=1024, spm=True,
        specials=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|channel>", "<channel|>",
                  "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|think|>"],
        eos="<eos>", pad="<pad>", bos="<bos>", no_mtp=False,  # its converter refuses --no-mtp
        hf=dict(hidden_size=128, num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1, head_dim=32,
                global_head_dim=64, attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=2,
                moe_intermediate_size=32, intermediate_size=96, sliding_window=16, final_logit_softcapping=30.0,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=1024, num_kv_shared_layers=0,
                rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1000000.0}},
                pad_token_id=0, eos_token_id=1, bos_token_id=2)),
    # MiniMax-M2: head_dim 64 x 4 heads = 256 wide on n_embd 128 (the real model: 128 x 48 on 3072), RoPE on
    # half of each head; config_extra holds the keys of the real config.json that the converter reads
    # (rotary_dim, scoring_func) and transformers' config class does not keep.
    "minimax-m2": dict(
        cls="MiniMaxM2ForCausalLM", config="MiniMaxM2Config", vocab=768, pre="minimax-m2",
        specials=["]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"],
        eos="[e~[", pad="[e~[", bos="]~!b[", init_buffers=True, no_mtp=False,  # the converter has no MTP for it
        config_extra=dict(rotary_dim=32, scoring_func="sigmoid", use_qk_norm=True, qk_norm_type="per_layer",
                          use_routing_bias=True),
        hf=dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
                max_position_embeddings=4096, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
                bos_token_id=761, eos_token_id=763, pad_token_id=763)),
    # Llama 4 (Scout's layout, Maverick's interleave): 4 layers = 3 chunked RoPE layers + 1 full NoPE layer,
    # MoE in every 2nd (1, 3) with a shared expert, dense SwiGLU (intermediate_size_mlp) between; RoPE with
    # Scout's llama3 scaling (factor 16, low = high = 1, original 8192: rope_freqs 1 or 16 per pair).
    "llama4": dict(
        cls="Llama4ForCausalLM", config="Llama4TextConfig", vocab=768, pre="llama4",
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>",
                  "<|python_start|>", "<|python_end|>"],
        eos="<|eot|>", pad="<|end_of_text|>", bos="<|begin_of_text|>", no_mtp=False,
        hf=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                intermediate_size=64, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                interleave_moe_layer_step=2, rms_norm_eps=1e-5, max_position_embeddings=16384,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
                tie_word_embeddings=False, bos_token_id=761, eos_token_id=765, pad_token_id=762)),
    # ERNIE-4.5-21B-A3B's form: a leading dense layer, then MoE in every layer (moe_layer_interval 1) with one
    # shared expert; adjacent-pair RoPE over the whole head; the output tied to the embeddings (as in 21B),
    # embeddings at 3 / sqrt(n_embd) so that tied logits sit near N(0, 3^2). Its converter reads a
    # SentencePiece tokenizer.model, and sizes the shared expert as intermediate_size / num_key_value_heads
    # (what 21B's numbers give): intermediate_size 128 / 2 kv heads = moe_intermediate_size x 1 shared.
    "ernie4_5-moe": dict(
        cls="Ernie4_5_MoeForCausalLM", config="Ernie4_5_MoeConfig", vocab=1024, sp_model=True, no_mtp=False,
        specials=["<|begin_of_sentence|>", "<|end_of_sentence|>", "<|im_start|>", "<|im_end|>", "<think>",
                  "</think>", "<tool_call>", "</tool_call>"], embed_std=3.0,
        hf=dict(hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, moe_intermediate_size=64, moe_k=2, moe_num_experts=8, moe_num_shared_experts=1,
                moe_layer_start_index=1, moe_layer_end_index=3, moe_layer_interval=1, use_bias=False,
                rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Ling-mini-2.0's form (transformers has no class for it: the checkpoint is written with the names of its
    # own modeling code, see write_bailingmoe2): fused query_key_value, per-head q/k norms, NEOX RoPE on half
    # of each head, one leading dense layer, sigmoid routing limited to the 2 best of 4 groups with a
    # selection bias, weights renormalised x 2.5, one shared expert; plus one MTP layer, which llama.cpp
    # loads and skips.
    "bailingmoe2": dict(
        cls="BailingMoeV2ForCausalLM", config=None, vocab=768, pre="bailingmoe2", no_mtp=False,
        specials=["<|startoftext|>", "<|endoftext|>", "<role>", "</role>", "<|role_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>"], eos="<|role_end|>", pad="<|endoftext|>", bos="<|startoftext|>",
        hf=dict(model_type="bailing_moe_v2", hidden_size=128, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                n_group=4, topk_group=2, num_shared_experts=1, moe_intermediate_size=64, first_k_dense_replace=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, score_function="sigmoid",
                moe_router_enable_expert_bias=True, use_qk_norm=True, use_qkv_bias=False, use_bias=False,
                partial_rotary_factor=0.5, rope_theta=600000.0, rope_scaling=None, rms_norm_eps=1e-6,
                max_position_embeddings=4096, num_nextn_predict_layers=1, tie_word_embeddings=False,
                hidden_act="silu", vocab_size=768, bos_token_id=759, eos_token_id=763, pad_token_id=760)),
    # GLM-5 (GLM-MoE-DSA): MLA (q rank 64, latent 64, heads of 32 + 32 RoPE, values 32) with DeepSeek's
    # sparse-attention indexer in every layer but one: 4 indexer heads of 64 (RoPE on the first 32),
    # each query keeping its top 8 keys (prompts of ~70 tokens, so the selection matters); layer 2
    # "shared" reuses layer 1's selection (GLM-5.2's indexer_types). One dense layer, then 8 experts
    # top-2 + a shared expert, sigmoid routing with GLM's selection bias, renormalised, scaled x2.5.
    "glm-dsa": dict(
        cls="GlmMoeDsaForCausalLM", config="GlmMoeDsaConfig", vocab=768, pre="glm4", init_buffers=True,
        specials=["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
        eos="<|endoftext|>", pad="<|endoftext|>", bos="[gMASK]",
        hf=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                index_n_heads=4, index_head_dim=64, index_topk=8, indexer_types=["full", "full", "shared", "full"],
                first_k_dense_replace=1, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
                routed_scaling_factor=2.5, rms_norm_eps=1e-5, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
                bos_token_id=756, eos_token_id=754, pad_token_id=754)),
}


# ---- tokenizer --------------------------------------------------------------------------------
def write_tokenizer(out: Path, n_vocab: int, specials: list[str], template: str | None, eos: str, pad: str,
                    bos: str | None = None, specials_first: bool = False) -> None:
    """tokenizer.json: the first n_vocab - len(specials) tokens of the qwen35 vocabulary (byte
    alphabet first, then tokens in merge order, so the first merges build exactly them) and the
    special tokens after them (or before them: Nemotron's vocabulary starts with its control
    tokens); tokenizer_config.json with the chat template, if any."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    r = GGUFReader(str(QWEN35_VOCAB))
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    m = r.fields["tokenizer.ggml.merges"]
    merges = [bytes(m.parts[i]).decode("utf-8") for i in m.data]
    n_base = n_vocab - len(specials)
    first = len(specials) if specials_first else 0
    vocab = {t: i + first for i, t in enumerate(tokens[:n_base])}
    kept = [tuple(x.split(" ", 1)) for x in merges[: n_base - 256]]
    assert all(a in vocab and b in vocab and a + b in vocab for a, b in kept), "merge order does not follow ids"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=kept, byte_fallback=False, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    if specials_first:  # ids 0.. are the control tokens: put them there in the model's table
        d = json.loads(tok.to_str())
        d["model"]["vocab"] = {**{s: i for i, s in enumerate(specials)}, **d["model"]["vocab"]}
        d["added_tokens"] = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for i, s in enumerate(specials)]
        tok = Tokenizer.from_str(json.dumps(d))
    else:
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_prefix_space": False,
              "bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": None, "model_max_length": 4096}
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_spm_tokenizer(out: Path, n_vocab: int, specials: list[str], eos: str, pad: str, bos: str) -> None:
    """A SentencePiece-style BPE tokenizer.json as Gemma's: spaces normalised to U+2581, merges over
    characters, byte fallback (<0x00>..<0xFF>) for what no token spells; trained on Clutor's corpus
    (clutor/data/corpus.txt) with the control tokens first and the byte tokens after them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    # (the alphabet limited so that merges fill the rest of the vocabulary)
    trainer = trainers.BpeTrainer(vocab_size=n_vocab, special_tokens=specials + byte_tokens, limit_alphabet=150,
                                  show_progress=False)
    tok.train([str(ROOT / "clutor" / "data" / "corpus.txt")], trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
              "bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": "<unk>", "model_max_length": 4096}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_sp_model(out: Path, n_vocab: int, specials: list[str]) -> None:
    """A SentencePiece tokenizer.model as ERNIE 4.5's: BPE with byte fallback, <unk> <s> </s> at ids
    0-2, the family's control tokens after them; trained on Clutor's corpus (clutor/data/corpus.txt) by
    sentencepiece's own trainer, the file its converter reads."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=str(ROOT / "clutor" / "data" / "corpus.txt"), model_prefix=str(out / "tokenizer"), model_type="bpe",
        vocab_size=n_vocab, byte_fallback=True, character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        user_defined_symbols=specials, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2, num_threads=1)
    (out / "tokenizer.vocab").unlink()
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 4096}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


# ---- weights ----------------------------------------------------------------------------------
def init_weights(model, seed: int, init_buffers: bool = False, embed_std: float | None = None) -> None:
    """Random weights at scales that keep a tiny model's activations and logits well spread: linear
    maps N(0, 1/fan_in), norms 1 + N(0, 0.1) (stored as offsets from 1 where the family's RMSNorm
    computes x (1 + w)), a decay of exp(-(0.05..1) softplus(...)) per token in the recurrent layers,
    routers and the output sharper than the rest so that routing and argmax have clear winners.
    init_buffers: also draw the expert selection bias where the model keeps it as a buffer (after
    every parameter, so the parameters' draws do not move). embed_std: the embeddings drawn at
    embed_std / sqrt(n_embd) (a tied head's logits then sit near N(0, embed_std^2))."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    offset_norms = not type(model).__name__.startswith(("NemotronH", "Gemma4", "MiniMaxM2", "Llama4", "Ernie4_5",
                                                            "BailingMoeV2", "GlmMoeDsa"))  # these compute x w
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):  # Gemma 4's scales
                v = normal(shape, 0.2) + 1.0
            elif name.endswith("A_log"):
                v = torch.log(torch.rand(shape, generator=g) * 0.95 + 0.05)
            elif name.endswith("dt_bias"):
                v = normal(shape, 0.5)
            elif "conv1d" in name:
                v = normal(shape, 0.5)
            elif name.endswith("norm.bias"):  # a LayerNorm's shift (GLM-5's indexer key norm)
                v = normal(shape, 0.1)
            elif len(shape) == 1 and "norm" in name:
                gated = "linear_attn.norm" in name or "mixer.norm" in name
                v = normal(shape, 0.1) + (1.0 if gated or not offset_norms else 0.0)
            elif name.endswith(".bias") or name.endswith(".D"):
                v = normal(shape, 0.3) + (1.0 if name.endswith(".D") else 0.0)
            elif name.endswith(("e_score_correction_bias", "expert_bias")):  # an expert selection bias
                v = normal(shape, 0.1)
            elif ("embed_tokens" in name or "embeddings" in name) and embed_std is not None:
                v = normal(shape, embed_std / np.sqrt(shape[-1]))
            elif ("embed_tokens" in name or "embeddings" in name) and not offset_norms and "Gemma4" in type(model).__name__:
                # Gemma multiplies its embeddings by sqrt(n_embd) and ties the head to them: rows of
                # N(0, 9 / n_embd) give a residual of N(0, 9) and logits of about N(0, 3^2) before the
                # 30 tanh(z / 30) cap, as a trained model's sit (N(0, 1) rows would put them at 11^2,
                # in the cap's flat part, every sublayer's output a tenth of the embedding)
                v = normal(shape, 3.0 / np.sqrt(shape[-1]))
            elif "embed_tokens" in name or "embeddings" in name:
                v = normal(shape, 1.0)
            elif name == "lm_head.weight":
                v = normal(shape, 3.0 / np.sqrt(shape[-1]))
            elif name.endswith(("mlp.gate.weight", "mixer.gate.weight", "feed_forward.router.weight")):  # the router
                v = normal(shape, 2.0 / np.sqrt(shape[-1]))
            elif name.endswith("router.proj.weight"):
                # Gemma 4's router reads rms_norm(x) / sqrt(n_embd): weights sqrt(n_embd) times the
                # others' give its logits the same spread (N(0, 2^2)); at 2 / sqrt(n_embd) they would
                # be N(0, 0.18^2) and every top-k choice a near-tie (gaps of 1e-3..3e-2)
                v = normal(shape, 2.0)
            else:
                fan_in = shape[-1]
                v = normal(shape, 1.0 / np.sqrt(fan_in))
            p.copy_(v.reshape(shape))
        for name, b in model.named_buffers() if init_buffers else ():
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(tuple(b.shape), 0.1))


def bailingmoe2_tensors(hf: dict, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """The tensors of a BailingMoeV2 checkpoint (Ling 2.0's modeling code: names and [out, in] shapes),
    the MTP layers (num_nextn_predict_layers, after the others) included."""
    D, H, Hkv, hd = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    E, F, S = hf["num_experts"], hf["moe_intermediate_size"], hf["moe_intermediate_size"] * hf["num_shared_experts"]
    n, n_mtp = hf["num_hidden_layers"], hf["num_nextn_predict_layers"]
    t = {"model.word_embeddings.weight": (n_vocab, D)}
    for l in range(n + n_mtp):
        b = f"model.layers.{l}."
        t |= {b + "input_layernorm.weight": (D,), b + "attention.query_key_value.weight": ((H + 2 * Hkv) * hd, D),
              b + "attention.query_layernorm.weight": (hd,), b + "attention.key_layernorm.weight": (hd,),
              b + "attention.dense.weight": (D, H * hd), b + "post_attention_layernorm.weight": (D,)}
        if l < hf["first_k_dense_replace"]:
            Fd = hf["intermediate_size"]
            t |= {b + "mlp.gate_proj.weight": (Fd, D), b + "mlp.up_proj.weight": (Fd, D), b + "mlp.down_proj.weight": (D, Fd)}
        else:
            t |= {b + "mlp.gate.weight": (E, D), b + "mlp.gate.expert_bias": (E,)}
            for e in range(E):
                t |= {b + f"mlp.experts.{e}.gate_proj.weight": (F, D), b + f"mlp.experts.{e}.up_proj.weight": (F, D),
                      b + f"mlp.experts.{e}.down_proj.weight": (D, F)}
            t |= {b + "mlp.shared_experts.gate_proj.weight": (S, D), b + "mlp.shared_experts.up_proj.weight": (S, D),
                  b + "mlp.shared_experts.down_proj.weight": (D, S)}
        if l >= n:  # an MTP layer: the embedding and the hidden state, normed, projected; its own final norm
            t |= {b + "enorm.weight": (D,), b + "hnorm.weight": (D,), b + "eh_proj.weight": (D, 2 * D),
                  b + "final_layernorm.weight": (D,)}
    return t | {"model.norm.weight": (D,), "lm_head.weight": (n_vocab, D)}


def write_bailingmoe2(out: Path, spec: dict, seed: int) -> None:
    """A BailingMoeV2 checkpoint without a transformers class: config.json with the keys of Ling 2.0's,
    model.safetensors drawn by init_weights (through a module tree of the same names)."""
    import torch
    from safetensors.torch import save_file

    tree = type(spec["cls"], (torch.nn.Module,), {})()
    for name, shape in bailingmoe2_tensors(spec["hf"], spec["vocab"]).items():
        *path, leaf = name.split(".")
        m = tree
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape), requires_grad=False))
    init_weights(tree, seed)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tree.state_dict().items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    conf = {"architectures": [spec["cls"]], **spec["hf"], "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(conf, indent=2))


# ---- conversion -------------------------------------------------------------------------------
CONVERT = r"""
import sys
sys.argv = [sys.argv[0]] + sys.argv[2:]
llama = __import__("pathlib").Path(sys.path[0])
import os
import conversion.base as base
# A cut vocabulary cannot match the converter's tokenizer hashes: say which split rules it has.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: os.environ["FIXTURE_PRE"]
import runpy
runpy.run_path(str(llama / "convert_hf_to_gguf.py"), run_name="__main__")
"""


def convert(hf_dir: Path, llama_dir: Path, out: Path, pre: str, no_mtp: bool = True) -> None:
    env = dict(os.environ, PYTHONPATH=f"{llama_dir}{os.pathsep}{llama_dir / 'gguf-py'}", FIXTURE_PRE=pre)
    cmd = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(llama_dir)!r}); exec({CONVERT!r})",
           "convert", str(hf_dir), "--outtype", "f16", *(["--no-mtp"] if no_mtp else []), "--outfile", str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=llama_dir)


def quantize(src: Path, out: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[ftype]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({src} -> {out}, {ftype}) failed with code {rc}")


def make_checkpoint(preset: str, out: Path, seed: int) -> None:
    import transformers

    spec = PRESETS[preset]
    if spec["config"] is None:  # no transformers class: written with the checkpoint's own names
        write_bailingmoe2(out, spec, seed)
    else:
        cfg = getattr(transformers, spec["config"])(vocab_size=spec["vocab"], **spec["hf"])
        cfg.architectures = [spec["cls"]]
        if "specials" not in spec:
            cfg.eos_token_id = cfg.pad_token_id = None
        model = getattr(transformers, spec["cls"])(cfg)
        init_weights(model, seed, spec.get("init_buffers", False), spec.get("embed_std"))
        model.save_pretrained(out, safe_serialization=True)
    if "config_extra" in spec:
        conf = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(conf | spec["config_extra"], indent=2))
    if spec.get("sp_model"):
        write_sp_model(out, spec["vocab"], spec["specials"])
    elif spec.get("spm"):
        write_spm_tokenizer(out, spec["vocab"], spec["specials"], eos=spec["eos"], pad=spec["pad"], bos=spec["bos"])
    elif "specials" in spec:
        write_tokenizer(out, spec["vocab"], spec["specials"], None, eos=spec["eos"], pad=spec["pad"], bos=spec["bos"],
                        specials_first=spec.get("specials_first", False))
    else:
        write_tokenizer(out, spec["vocab"], QWEN_SPECIALS, QWEN35_TEMPLATE.read_text(), eos="<|im_end|>",
                        pad="<|endoftext|>")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("llama_cpp", type=Path, help="a llama.cpp checkout (its convert_hf_to_gguf.py is run)")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--types", nargs="+", default=["F16", "Q4_K_M"], choices=sorted(LLAMA_FTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-hf", type=Path, help="keep the Hugging Face checkpoint in this directory")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = args.keep_hf or Path(tmp) / "hf"
        make_checkpoint(args.preset, hf, args.seed)
        f16 = args.out_dir / f"tiny-{args.preset}-F16.gguf"
        spec = PRESETS[args.preset]
        convert(hf, args.llama_cpp.resolve(), f16, spec.get("pre", "qwen35"), spec.get("no_mtp", True))
        for t in args.types:
            if t != "F16":
                quantize(f16, args.out_dir / f"tiny-{args.preset}-{t}.gguf", t)
        if "F16" not in args.types:
            f16.unlink()
    for t in args.types:
        p = args.out_dir / f"tiny-{args.preset}-{t}.gguf"
        print(f"{p}: {p.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
