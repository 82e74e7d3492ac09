"""The model's only door to routed experts.

``ExpertSource`` is what the layer loop awaits; the disk-streaming ExpertStore (clutor.io.store) and
the in-memory source below both implement it, so the model never knows where experts come from.
"""
from __future__ import annotations

import mmap
from typing import AsyncIterator, Protocol, Sequence, runtime_checkable

import numpy as np

from ..io.layout import ExpertLayout
from ..io.store import StoreStats
from ..io.views import ExpertBatch, ExpertView

__all__ = ["ExpertSource", "InMemoryExperts"]


@runtime_checkable
class ExpertSource(Protocol):
    """Where the layer loop gets routed experts from. ``capacity``: the most distinct experts one
    get may hold pinned at once (0 = no limit); ``slot_bytes``: what one cached expert occupies (a
    routing trace's header carries it, so the simulator models the same cache); ``stats()``: the
    store's counters, None where nothing is cached."""

    capacity: int
    slot_bytes: int

    def stats(self) -> StoreStats | None: ...
    async def get(self, layer: int, experts: Sequence[int]) -> ExpertBatch: ...
    def get_ready(self, layer: int, experts: Sequence[int]) -> AsyncIterator[list[ExpertView]]: ...
    def prefetch(self, layer: int, experts: Sequence[int]) -> None: ...
    async def aclose(self) -> None: ...


class InMemoryExperts:
    """Experts as views into read-only mmaps of the model files (the page cache holds them).

    The mappings are populated when opened (MAP_POPULATE, as llama.cpp does): page-table faults on
    first touch cost a 64-token prefill of the OLMoE-shaped model ~1 s otherwise, paid by whichever
    tokens first route to each expert."""

    capacity = 0  # every expert is always there: nothing to pin

    def __init__(self, layout: ExpertLayout):
        self.layout = layout
        self.slot_bytes = layout.max_expert_bytes
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
            g, u, d, *b = (self._slab(s) for s in self.layout.slabs(layer, int(e)))
            views.append(ExpertView(layer, int(e), g, u, d, tuple(b)))
        return ExpertBatch(views)

    async def get_ready(self, layer: int, experts: Sequence[int]) -> AsyncIterator[list[ExpertView]]:
        yield list(await self.get(layer, list(dict.fromkeys(int(e) for e in experts))))

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        pass

    def stats(self) -> None:
        return None

    async def aclose(self) -> None:
        # Views may still be referenced by callers; dropping our references lets the mmaps close
        # when the last view goes, instead of raising BufferError here.
        self._maps.clear()
        self._mmaps.clear()
