"""Hyper-parameters every architecture has, read from the file's metadata and checked against its tensors.

What an architecture does differently (its attention, router, FFN, KV layout and the keys they read)
lives in its own module under clutor.model.arch; this is only the common shape of the model.
"""
from __future__ import annotations

from dataclasses import dataclass

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
    n_layers: int          # transformer layers computed (MTP / nextn layers a file may carry excluded)
    n_embd: int            # D
    n_head: int            # H (query heads)
    n_head_kv: int         # Hkv (1 for MLA: one latent shared by all heads)
    head_dim: int          # hd of q and k
    head_dim_v: int        # hd of v
    n_rot: int             # dimensions of each head rotated by RoPE
    n_vocab: int           # V
    n_ctx_train: int
    rope_base: float
    eps: float
    n_expert: int          # E
    n_expert_used: int     # K (top-k)
    n_ff_exp: int          # F, hidden size of one routed expert
    n_ff_shexp: int        # hidden size of the shared expert(s), 0 when there are none
    n_ff: int              # hidden size of the dense FFN of the leading dense layers, 0 when there are none
    moe_layers: tuple[int, ...]  # layers with routed experts; the expert store's layer i is moe_layers[i]
    kv_floats: int         # float32 values the KV cache holds per position per layer
    tied_output: bool      # no `output` tensor: logits reuse token_embd
    kv_layers: tuple[int, ...] | None = None  # layers with a KV cache (None: all; hybrids: their attention layers)
    recurrent_bytes: int = 0  # fixed state one sequence keeps in recurrent layers (conv + SSM / delta-rule)

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.n_head // self.n_head_kv

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one position of one sequence takes over all layers (float32)."""
        n = self.n_layers if self.kv_layers is None else len(self.kv_layers)
        return n * self.kv_floats * 4
