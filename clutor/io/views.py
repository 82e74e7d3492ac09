"""What a get() hands to the model: raw quantised bytes of each expert, pinned until released."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["ExpertView", "ExpertBatch"]


@dataclass(frozen=True, slots=True)
class ExpertView:
    layer: int
    expert: int
    gate: np.ndarray | None  # uint8 [slab_bytes] exactly the gate slab as stored in the file (None: ungated)
    up: np.ndarray    # uint8 [slab_bytes]
    down: np.ndarray  # uint8 [slab_bytes]
    biases: tuple[np.ndarray, ...] = ()  # uint8 slabs of the gate, up and down biases (gpt-oss), else empty

    @classmethod
    def of(cls, layer: int, expert: int, slabs, gated: bool = True) -> "ExpertView":
        """From an expert's slabs in layout order: (gate,) up, down, then any biases."""
        if gated:
            g, u, d, *b = slabs
        else:
            g, (u, d, *b) = None, slabs
        return cls(layer, expert, g, u, d, tuple(b))


class ExpertBatch:
    """The experts of one get(), in the order asked. Views stay valid until release().

    Usable as ``with await store.get(l, ids) as batch:``; release() is idempotent.
    """

    __slots__ = ("views", "_release")

    def __init__(self, views: Sequence[ExpertView], release: Callable[[], None] | None = None):
        self.views = list(views)
        self._release = release

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, i: int) -> ExpertView:
        return self.views[i]

    def __iter__(self):
        return iter(self.views)

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> "ExpertBatch":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
