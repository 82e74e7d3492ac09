"""Metadata reading shared by the architecture modules, with the sanity bounds every value must meet."""
from __future__ import annotations

from ...errors import ModelFileError
from ..config import MAX_CTX, MAX_DIM, MAX_EXPERTS, MAX_HEAD_DIM, MAX_LAYERS, MAX_VOCAB, ModelConfig


def _int(f, key: str, lo: int, hi: int, default=None) -> int:
    full = f"{f.arch}.{key}"
    v = f.get(full, default) if default is not None else f.get(full)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ModelFileError(f.path, full, f"an integer in [{lo}, {hi}]", repr(v))
    return v


def _float(f, key: str, default=None) -> float:
    full = f"{f.arch}.{key}"
    v = f.get(full, default) if default is not None else f.get(full)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v == v) or v <= 0:
        raise ModelFileError(f.path, full, "a positive number", repr(v))
    return float(v)


def base_config(f, *, qk_norm: str, qkv_bias: bool, norm_topk: bool, ff_key: str, shared_ff: bool) -> ModelConfig:
    n_embd = _int(f, "embedding_length", 1, MAX_DIM)
    n_head = _int(f, "attention.head_count", 1, 4096)
    n_head_kv = _int(f, "attention.head_count_kv", 1, n_head, default=n_head)
    if n_head % n_head_kv:
        raise ModelFileError(f.path, f"{f.arch}.attention.head_count_kv", f"a divisor of head_count {n_head}", n_head_kv)
    default_hd = n_embd // n_head
    head_dim = _int(f, "attention.key_length", 2, MAX_HEAD_DIM, default=default_hd)
    head_dim_v = _int(f, "attention.value_length", 1, MAX_HEAD_DIM, default=default_hd)
    n_rot = _int(f, "rope.dimension_count", 2, head_dim, default=head_dim)
    if n_rot % 2:
        raise ModelFileError(f.path, f"{f.arch}.rope.dimension_count", "an even number", n_rot)
    n_expert = _int(f, "expert_count", 1, MAX_EXPERTS)
    n_expert_used = _int(f, "expert_used_count", 1, n_expert)
    tok = f.tensor("token_embd.weight")
    if len(tok.shape) != 2 or tok.shape[1] != n_embd:
        raise ModelFileError(f.path, "tensor token_embd.weight", f"shape (n_vocab, {n_embd})", tok.shape)
    if tok.shape[0] > MAX_VOCAB:
        raise ModelFileError(f.path, "tensor token_embd.weight", f"at most {MAX_VOCAB} vocabulary rows", tok.shape[0])
    return ModelConfig(
        arch=f.arch,
        n_layers=_int(f, "block_count", 1, MAX_LAYERS),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_rot=n_rot,
        n_vocab=tok.shape[0],
        n_ctx_train=_int(f, "context_length", 1, MAX_CTX),
        rope_base=_float(f, "rope.freq_base", default=10000.0),
        eps=_float(f, "attention.layer_norm_rms_epsilon"),
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=_int(f, ff_key, 1, MAX_DIM),
        n_ff_shexp=_int(f, "expert_shared_feed_forward_length", 1, MAX_DIM) if shared_ff else 0,
        qk_norm=qk_norm,
        qkv_bias=qkv_bias,
        norm_topk=norm_topk,
        tied_output="output.weight" not in f.tensors,
    )
