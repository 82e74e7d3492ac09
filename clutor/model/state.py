"""What a sequence carries from one step to the next, layer by layer.

Each layer of an architecture keeps one kind of state per sequence (``Arch.layer_states()``):

    FullKV(heads, k_dim, v_dim)       keys and values of every position (GQA attention)
    WindowKV(heads, k_dim, v_dim, w)  the same for the last w positions only (sliding-window layers):
                                      pages that fall behind the window are given back
    LatentKV(width, v_dim)            one row per position whose first v_dim columns are the values
                                      (MLA: the compressed latent and the shared RoPE key)
    Recurrent(shapes)                 a fixed-size state (conv state, SSM / delta-rule matrix) updated
                                      in place by every token (Gated DeltaNet, Mamba-2 layers)

The KV kinds live in pages of the model's KV pool (clutor.model.kv): a sequence holds, per page
group, the list of its pages; a Recurrent layer's arrays belong to the sequence itself, and prefix
reuse restores them from checkpoints the pool keeps at chosen positions.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    from .kv import KVPool

__all__ = ["FullKV", "WindowKV", "LatentKV", "Recurrent", "LayerState", "SequenceState"]


@dataclass(frozen=True)
class FullKV:
    heads: int   # kv heads
    k_dim: int
    v_dim: int
    kind: ClassVar[str] = "full"

    @property
    def width(self) -> int:
        """Values stored per head and position: the key, then the value."""
        return self.k_dim + self.v_dim

    @property
    def window(self) -> int:
        return 0


@dataclass(frozen=True)
class WindowKV:
    heads: int
    k_dim: int
    v_dim: int
    size: int    # a query at position i sees keys j with i - j < size
    kind: ClassVar[str] = "window"

    @property
    def width(self) -> int:
        return self.k_dim + self.v_dim

    @property
    def window(self) -> int:
        return self.size


@dataclass(frozen=True)
class LatentKV:
    row: int     # values per position: the latent (v_dim) and the rope key
    v_dim: int   # the values are the row's first v_dim columns
    kind: ClassVar[str] = "latent"
    heads: ClassVar[int] = 1

    @property
    def k_dim(self) -> int:
        return self.row

    @property
    def width(self) -> int:
        return self.row

    @property
    def window(self) -> int:
        return 0


@dataclass(frozen=True)
class Recurrent:
    """A fixed-size per-sequence state: named float32 arrays of these shapes, zero at position 0."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    kind: ClassVar[str] = "recurrent"

    @property
    def nbytes(self) -> int:
        return sum(4 * math.prod(s) for _, s in self.shapes)

    def zeros(self) -> dict[str, np.ndarray]:
        return {name: np.zeros(shape, np.float32) for name, shape in self.shapes}


LayerState = FullKV | WindowKV | LatentKV | Recurrent


class SequenceState:
    """One sequence: ``n`` positions filled, its pages in each page group of the pool (-1 where a
    window group gave a page back), and its recurrent layers' arrays.

    Made by the pool (``KVPool.sequence()``, ``Model.new_sequence()``); its pages go back to the pool
    when it is released or garbage-collected."""

    def __init__(self, pool: "KVPool"):
        self.pool = pool
        self.n = 0
        self.n_ctx = pool.n_ctx
        self.tables: list[list[int]] = [[] for _ in pool.groups]  # per group: page id per P positions
        # layer -> {name: array}: the state after position n - 1 (zeros for a fresh sequence)
        self.recurrent: dict[int, dict[str, np.ndarray]] = {l: spec.zeros() for l, spec in pool.recurrent.items()}
        self.released = False
        self._finalizer = weakref.finalize(self, pool._orphaned, self.tables)

    def truncate(self, n: int) -> None:
        """Keep the first n positions; the next step writes from position n (pages past it go back).
        A sequence with recurrent layers cannot go back (their state is not kept per position)."""
        self.pool.truncate(self, n)

    def release(self) -> None:
        """Give every page back to the pool now (also done when the state is garbage-collected)."""
        self.pool.release(self)

    @property
    def pages(self) -> int:
        return sum(sum(1 for p in t if p >= 0) for t in self.tables)
