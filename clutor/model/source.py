"""The model's only door to routed experts.

``ExpertSource`` is what the layer loop (on the compute thread) takes experts from; the disk-streaming
ExpertStore (clutor.io.store) and the in-memory source below both implement it, so the model never
knows where experts come from.
"""
from __future__ import annotations

import mmap
import os
from typing import AsyncIterator, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import ClosedError, ClutorIOError
from ..io.layout import ExpertLayout
from ..io.store import StoreStats
from ..io.views import ExpertBatch, ExpertView

__all__ = ["ExpertSource", "InMemoryExperts"]


@runtime_checkable
class ExpertSource(Protocol):
    """Where the layer loop gets routed experts from: ``views_now()`` where they never wait for a read
    (``immediate``), else ``take()``, whose groups block the compute thread until their bytes are in
    (an iterator the caller closes: ``close()`` releases the views).
    ``capacity``: the most distinct experts one get may hold pinned at once (0 = no limit);
    ``slot_bytes``: what one cached expert occupies (a routing trace's header carries it, so the
    simulator models the same cache); ``stats()``: the store's counters, None where nothing is cached."""

    capacity: int
    slot_bytes: int
    wants_hints: bool  # hint() can change something: worth predicting the next layer's experts for
    immediate: bool    # experts never wait for a read: views_now() hands them out synchronously

    def stats(self) -> StoreStats | None: ...
    async def get(self, layer: int, experts: Sequence[int]) -> ExpertBatch: ...
    def get_ready(self, layer: int, experts: Sequence[int]) -> AsyncIterator[list[ExpertView]]: ...
    def take(self, layer: int, experts: Sequence[int]) -> Iterator[list[ExpertView]]: ...
    def prefetch(self, layer: int, experts: Sequence[int]) -> None: ...
    def hint(self, layer: int, experts: Sequence[int]) -> None: ...
    def views_now(self, layer: int, experts: Sequence[int]) -> list[ExpertView]: ...
    async def aclose(self) -> None: ...


class InMemoryExperts:
    """Experts as views into read-only mmaps of the model files (the page cache holds them).

    The mappings are populated when opened (MAP_POPULATE, as llama.cpp does): otherwise every first
    touch of a page is a page-table fault, a cost paid inside the compute of whichever tokens first
    route to each expert.

    A mapping outlives changes to its file: if the file is truncated, touching a page past the new
    end raises SIGBUS, which no Python code can catch (the process dies). So every get() first checks
    (one fstat per file, cheap beside a layer's compute) that each file still reaches past its last
    expert byte, and raises ClutorIOError otherwise instead of handing out views into pages that are
    gone. The check cannot
    cover a truncation during the very compute that uses the views; io="auto"/"threads" (pread into
    memory the process owns) have no such window.
    """

    capacity = 0  # every expert is always there: nothing to pin
    immediate = True

    def __init__(self, layout: ExpertLayout):
        self.layout = layout
        self.slot_bytes = layout.max_expert_bytes
        self._maps: dict[str, np.ndarray] = {}
        self._mmaps: list[mmap.mmap] = []
        self._fds: dict[str, int] = {}
        # (layer, expert) -> its view, made on first use: slices of the mappings, fixed while they are
        # open (building one costs ~10 us of Python, paid per expert and decode step otherwise)
        self._views: dict[tuple[int, int], ExpertView] = {}
        # bytes each file must hold: the end of its last expert slab
        self._need: dict[str, int] = {}
        for tensors in layout.layers:
            for t in tensors:
                self._need[t.path] = max(self._need.get(t.path, 0), t.offset + layout.n_experts * t.slab_bytes)
        self._layer_files = [tuple(dict.fromkeys(t.path for t in tensors)) for tensors in layout.layers]  # [layer]
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        try:
            for path in layout.files:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
                self._fds[path] = fd
                self._check(path)
                m = mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ)
                self._mmaps.append(m)
                self._maps[path] = np.frombuffer(m, dtype=np.uint8)  # [file_bytes]
        except OSError as e:
            self._close_fds()
            raise ClutorIOError(getattr(e, "filename", None) or layout.files[0], 0, 0, e.strerror or str(e)) from None
        except BaseException:
            self._close_fds()
            raise

    def _check(self, path: str) -> None:
        size = os.fstat(self._fds[path]).st_size
        need = self._need[path]
        if size < need:
            raise ClutorIOError(path, size, need - size,
                                f"the file is {size} bytes, shorter than its experts need ({need}): "
                                "it was truncated while open")

    def _close_fds(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def _slab(self, slab) -> np.ndarray:
        return self._maps[slab.path][slab.offset : slab.offset + slab.nbytes]

    async def get(self, layer: int, experts: Sequence[int]) -> ExpertBatch:
        return ExpertBatch(self.views_now(layer, experts))

    def views_now(self, layer: int, experts: Sequence[int]) -> list[ExpertView]:
        """The experts' views, from any thread (nothing here touches the event loop)."""
        self.check(layer)
        views = []
        for e in experts:
            v = self._views.get((layer, e))
            if v is None:
                e = int(e)
                v = self._views[(layer, e)] = ExpertView.of(
                    layer, e, [self._slab(s) for s in self.layout.slabs(layer, e)], self.layout.gated)
            views.append(v)
        return views

    def check(self, layer: int) -> None:
        """Before any page of the layer's views is touched, each time (see the class docstring): the
        source is open and its files still hold every expert byte; ClosedError / ClutorIOError if not."""
        if not self._fds:
            raise ClosedError("expert source used after aclose()")
        for path in self._layer_files[layer]:
            self._check(path)

    async def get_ready(self, layer: int, experts: Sequence[int]) -> AsyncIterator[list[ExpertView]]:
        yield list(await self.get(layer, list(dict.fromkeys(int(e) for e in experts))))

    def take(self, layer: int, experts: Sequence[int]) -> Iterator[list[ExpertView]]:
        yield self.views_now(layer, list(dict.fromkeys(int(e) for e in experts)))

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        pass

    wants_hints = False

    def hint(self, layer: int, experts: Sequence[int]) -> None:
        pass

    def stats(self) -> None:
        return None

    async def aclose(self) -> None:
        # Views may still be referenced by callers; dropping our references lets the mmaps close
        # when the last view goes, instead of raising BufferError here.
        self._maps.clear()
        self._mmaps.clear()
        self._views.clear()
        self._close_fds()
