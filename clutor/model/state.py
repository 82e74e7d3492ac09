"""What a sequence carries from one step to the next, layer by layer.

Each layer of an architecture keeps one kind of state per sequence (``Arch.layer_states()``):

    FullKV(heads, k_dim, v_dim)       keys and values of every position (GQA attention)
    WindowKV(heads, k_dim, v_dim, w)  the same for the last w positions only (sliding-window layers):
                                      pages that fall behind the window are given back
    LatentKV(width, v_dim)            one row per position whose first v_dim columns are the values
                                      (MLA: the compressed latent and the shared RoPE key)
    Recurrent(shape)                  a fixed-size state (conv state, SSM / delta-rule matrix) updated
                                      in place by every token (Gated DeltaNet, Mamba-2 layers)

The KV kinds live in pages of the model's KV pool (clutor.model.kv): a sequence holds, per page
group, the list of its pages; a Recurrent layer's arrays belong to the sequence itself (its
RecurrentState), and prefix reuse restores them from checkpoints the pool keeps at chosen positions
(a prompt's end, a chat turn's departure: Request.checkpoints).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol


if TYPE_CHECKING:
    from .recurrent import LayerShape

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
    """A fixed-size per-sequence state: the layer's conv state and SSM / delta-rule matrix
    (clutor.model.recurrent.LayerShape), zero at position 0."""

    shape: "LayerShape"
    kind: ClassVar[str] = "recurrent"

    @property
    def nbytes(self) -> int:
        return self.shape.nbytes

    @property
    def window(self) -> int:
        return 0


LayerState = FullKV | WindowKV | LatentKV | Recurrent  # or None: a layer that keeps nothing (an FFN-only layer)


class Pages(Protocol):
    """What a sequence asks of the pool that made it (clutor.model.kv.KVPool, the one owner of pages)."""

    n_ctx: int
    groups: list
    recurrent: dict
    _orphaned: Callable[[list[list[int]]], None]

    def truncate(self, seq: "SequenceState", n: int, *, recurrent_checked: bool = False) -> None: ...

    def release(self, seq: "SequenceState") -> None: ...


class SequenceState:
    """One sequence: ``n`` positions filled, its pages in each page group of the pool (-1 where a
    window group gave a page back), and its recurrent layers' states (``rs``, a
    clutor.model.recurrent.RecurrentState; None when the model has no recurrent layer).

    Made by the pool (``KVPool.sequence()``, ``Model.new_sequence()``); its pages go back to the pool
    when it is released or garbage-collected. KV pages can be cut back to any shorter prefix
    (``truncate``); a recurrent state only to a checkpoint the sequence took (``checkpoint``), so
    ``reusable(n)`` says how far back it can go and ``rewind`` goes there."""

    def __init__(self, pool: Pages):
        from .recurrent import RecurrentState

        self.pool = pool
        self.n = 0
        self.n_ctx = pool.n_ctx
        self.tables: list[list[int]] = [[] for _ in pool.groups]  # per group: page id per PAGE positions
        self.rs = RecurrentState({l: s.shape for l, s in pool.recurrent.items()}) if pool.recurrent else None
        self.released = False
        self._finalizer = weakref.finalize(self, pool._orphaned, self.tables)

    @property
    def state_bytes(self) -> int:
        """Bytes held besides KV pages: recurrent states and this sequence's own checkpoints."""
        return 0 if self.rs is None else self.rs.nbytes

    def commit(self, n: int) -> None:
        """Positions up to n are filled (every layer has written them)."""
        self.n = n
        if self.rs is not None:
            self.rs.n = n

    def truncate(self, n: int) -> None:
        """Keep the first n positions; the next step writes from position n (pages past it go back).
        With recurrent layers only to 0, the current position, or a checkpoint (see rewind)."""
        self.pool.truncate(self, n)

    def checkpoint(self) -> None:
        """Keep a copy of the recurrent states at the current position, to rewind to."""
        if self.rs is not None:
            self.rs.save()

    def reusable(self, n: int) -> int:
        """The longest prefix of at most n positions this sequence can be cut back to."""
        n = min(n, self.n)
        return n if self.rs is None else self.rs.reusable(n)

    def rewind(self, n: int) -> None:
        """Back to n positions (n from reusable): KV pages cut back, recurrent states restored."""
        if n != self.reusable(n):
            raise ValueError(f"cannot rewind to {n}: the recurrent state has no checkpoint there")
        if self.rs is not None:
            self.rs.restore(n)
        self.pool.truncate(self, n, recurrent_checked=True)

    def release(self) -> None:
        """Give every page back to the pool now (also done when the state is garbage-collected)."""
        self.pool.release(self)

    @property
    def pages(self) -> int:
        return sum(sum(1 for p in t if p >= 0) for t in self.tables)
