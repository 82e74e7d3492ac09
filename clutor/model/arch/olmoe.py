"""OLMoE: QK-norm over the whole q and k vectors (before the head split and RoPE); no biases;
top-k router weights are NOT renormalised; the per-expert hidden size is in `feed_forward_length`
(newer converters also write `expert_feed_forward_length`, which wins when present)."""
from __future__ import annotations

from .common import base_config


def config(f):
    ff_key = "expert_feed_forward_length" if f"{f.arch}.expert_feed_forward_length" in f.metadata else "feed_forward_length"
    return base_config(f, qk_norm="full", qkv_bias=False, norm_topk=False, ff_key=ff_key, shared_ff=False)
