"""Qwen3-MoE: QK-norm per head (weights of size head_dim) after the head split, before RoPE;
head_dim may differ from n_embd / n_head; top-k router weights ARE renormalised; `output` may be
absent (tied to token_embd)."""
from __future__ import annotations

from .common import base_config


def config(f):
    return base_config(f, qk_norm="head", qkv_bias=False, norm_topk=True,
                       ff_key="expert_feed_forward_length", shared_ff=False)
