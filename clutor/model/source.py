"""The model's only door to routed experts.

``ExpertSource`` is what the layer loop awaits; the disk-streaming ExpertStore (clutor.io.store) and
the in-memory source below both implement it, so the model never knows where experts come from.
"""
from __future__ import annotations

import mmap
from typing import AsyncIterator, Protocol, Sequence, runtime_checkable

import numpy as np

from ..io.layout import ExpertLayout
from ..io.views import ExpertBatch, ExpertView

__all__ = ["ExpertSource", "InMemoryExperts"]


@runtime_checkable
class ExpertSource(Protocol):
    async def get(self, layer: int, experts: Sequence[int]) -> ExpertBatch: ...
    def get_ready(self, layer: int, experts: Sequence[int]) -> AsyncIterator[list[ExpertView]]: ...
    def prefetch(self, layer: int, experts: Sequence[int]) -> None: ...
    def hint(self, layer: int, experts: Sequence[int]) -> None: ...
    async def aclose(self) -> None: ...


class InMemoryExperts:
    """Experts as views into read-only mmaps of the model files (the page cache holds them).

    The mappings are populated when opened (MAP_POPULATE, as llama.cpp does): page-table faults on
    first touch cost a 64-token prefill of the OLMoE-shaped model ~1 s otherwise, paid by whichever
    tokens first route to each expert."""

    def __init__(self, layout: ExpertLayout):
        self.layout = layout
        self._maps: dict[str, np.ndarray] = {}
        self._mmaps: list[mmap.mmap] = []
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        for path in layout.files:
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
            self._mmaps.append(m)
            self._maps[path] = np.frombuffer(m, dtype=np.uint8)  # [file_bytes]

    def _slab(self, slab) -> np.ndarray:
        return self._maps[slab.path][slab.offset : slab.offset + slab.nbytes]

    async def get(self, layer: int, experts: Sequence[int]) -> ExpertBatch:
        views = []
        for e in experts:
            g, u, d = self.layout.slabs(layer, int(e))
            views.append(ExpertView(layer, int(e), self._slab(g), self._slab(u), self._slab(d)))
        return ExpertBatch(views)

    async def get_ready(self, layer: int, experts: Sequence[int]) -> AsyncIterator[list[ExpertView]]:
        yield list(await self.get(layer, list(dict.fromkeys(int(e) for e in experts))))

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        pass

    def hint(self, layer: int, experts: Sequence[int]) -> None:
        pass

    async def aclose(self) -> None:
        # Views may still be referenced by callers; dropping our references lets the mmaps close
        # when the last view goes, instead of raising BufferError here.
        self._maps.clear()
        self._mmaps.clear()
