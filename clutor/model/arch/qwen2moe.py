"""Qwen1.5-MoE / Qwen2-MoE: biases on q, k, v; a shared expert gated by sigmoid(w . h) added to the
routed mixture; top-k router weights are NOT renormalised."""
from __future__ import annotations

from .common import base_config


def config(f):
    return base_config(f, qk_norm="none", qkv_bias=True, norm_topk=False,
                       ff_key="expert_feed_forward_length", shared_ff=True)
