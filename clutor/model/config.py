"""Hyper-parameters of a MoE model, read from the file's metadata and checked against its tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ModelConfig"]

# Upper bounds that no real model comes near; anything above is a corrupt or hostile file, refused
# before any buffer is sized from it.
MAX_DIM = 1 << 20
MAX_LAYERS = 4096
MAX_EXPERTS = 4096
MAX_CTX = 1 << 24
MAX_HEAD_DIM = 4096  # real heads are 64..256 wide
MAX_VOCAB = 1 << 20  # real vocabularies stop near 262k tokens; each token costs ~650 bytes of tables


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    n_embd: int            # D
    n_head: int            # H (query heads)
    n_head_kv: int         # Hkv
    head_dim: int          # hd of q and k
    head_dim_v: int        # hd of v
    n_rot: int             # dimensions rotated by RoPE (== head_dim for all three archs)
    n_vocab: int           # V
    n_ctx_train: int
    rope_base: float
    eps: float
    n_expert: int          # E
    n_expert_used: int     # K (top-k)
    n_ff_exp: int          # F, hidden size of one routed expert
    n_ff_shexp: int        # hidden size of the shared expert (qwen2moe), 0 otherwise
    qk_norm: Literal["none", "full", "head"]  # olmoe: over all of q/k; qwen3moe: per head
    qkv_bias: bool         # qwen2moe
    norm_topk: bool        # renormalise top-k router weights (qwen3moe only)
    tied_output: bool      # no `output` tensor: logits reuse token_embd

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.n_head // self.n_head_kv
