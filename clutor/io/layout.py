"""Where each routed expert's bytes lie on disk.

clutor.io knows nothing about GGUF: the model side builds an ExpertLayout from the file's tensor
table and hands it to the store. One expert = three slabs (gate, up, down), each a contiguous run of
bytes, possibly in different files of a split model, and for models whose experts have biases (gpt-oss)
three more (the gate, up and down biases): what belongs to an expert is read with it. Ungated experts
(Nemotron-H's relu^2 ones) have two slabs, up and down.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Slab", "ExpertTensor", "ExpertLayout", "PARTS"]

PARTS = ("gate", "up", "down", "gate bias", "up bias", "down bias")


@dataclass(frozen=True, slots=True)
class Slab:
    path: str      # file holding the bytes
    offset: int    # absolute byte offset in that file (32-byte aligned in GGUF, not block aligned)
    nbytes: int    # length of the slab


@dataclass(frozen=True, slots=True)
class ExpertTensor:
    """One `blk.L.ffn_{part}_exps` tensor: n_experts slabs of slab_bytes, one every `step` bytes
    (back to back; or, for the gate and up halves of a fused ffn_gate_up_exps, every 2 x slab_bytes)."""

    path: str
    offset: int      # absolute offset of expert 0
    slab_bytes: int  # bytes of one expert's slab
    stride: int = 0  # bytes from one expert's slab to the next (0: slab_bytes)

    @property
    def step(self) -> int:
        return self.stride or self.slab_bytes

    def slab(self, expert: int) -> Slab:
        return Slab(self.path, self.offset + expert * self.step, self.slab_bytes)


@dataclass(frozen=True)
class ExpertLayout:
    n_experts: int
    layers: tuple[tuple[ExpertTensor, ...], ...]  # [layer] -> (gate, up, down[, gate bias, up bias, down bias])
    gated: bool = True  # False: each expert is (up, down), no gate slab

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_parts(self) -> int:
        """Slabs per expert: 3, or 6 with biases, or 2 ungated (the same in every layer)."""
        return len(self.layers[0])

    def slabs(self, layer: int, expert: int) -> tuple[Slab, ...]:
        return tuple(t.slab(expert) for t in self.layers[layer])

    def expert_bytes(self, layer: int) -> int:
        return sum(t.slab_bytes for t in self.layers[layer])

    @property
    def max_expert_bytes(self) -> int:
        return max(self.expert_bytes(l) for l in range(self.n_layers))

    @property
    def total_bytes(self) -> int:
        return sum(self.expert_bytes(l) * self.n_experts for l in range(self.n_layers))

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(sorted({t.path for layer in self.layers for t in layer}))
