"""Page-aligned slot memory for expert bytes: one anonymous mapping cut into equal slots.

Layout of the one mapping (every boundary a multiple of ``align``):

    [slot 0][slot 1]...[slot n_slots-1][spare 0]...[spare n_spare-1]

Slots hold cached experts; spares take bypass reads when every slot is pinned. A slot can be cut
further into aligned sub-regions (gate, up, down slabs of one expert) with ``region``; the store
registers those sub-regions with the backend once, at start-up, and reuses them.

Why ``close()`` does not always unmap: liburing's ``Iovec`` takes a buffer export on the memoryview it
is given and never releases it, so once the io_uring backend has built its Iovecs the ``mmap`` object
can never be closed (``mmap.close()`` raises BufferError) nor freed. Unmapping behind Python's back
(libc ``munmap`` via ctypes) would turn any stale numpy view into a segfault. Instead ``close()``
tries ``mmap.close()`` and, when the mapping is still exported, hands its pages back to the kernel
with ``madvise(MADV_DONTNEED)``: the RAM is released at once, only the virtual address range stays
reserved until the process exits, and a stale view reads zeros instead of crashing. Call ``close()``
only after every backend using the arena has finished ``aclose()`` (no read may be in flight).
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np

from clutor._util import libc
from clutor.errors import BudgetError, ClosedError

__all__ = ["Arena", "round_up", "widen"]

_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault every page of the range in, writable (no constant in Python < 3.13)


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def widen(offset: int, length: int, align: int) -> tuple[int, int, int]:
    """Aligned bounds covering ``[offset, offset + length)``.

    Returns ``(aligned_off, aligned_len, skip)``: read ``aligned_len`` bytes at ``aligned_off``; the
    wanted bytes then start ``skip`` bytes into the buffer. Both bounds are multiples of ``align``.
    """
    if offset < 0 or length < 0 or align <= 0:
        raise ValueError(f"widen: need offset >= 0, length >= 0, align > 0; got {offset}, {length}, {align}")
    aligned_off = offset - offset % align
    skip = offset - aligned_off
    return aligned_off, round_up(skip + length, align), skip


class Arena:
    """``n_slots + n_spare`` page-aligned buffers of ``slot_bytes`` (rounded up to ``align``) each."""

    def __init__(self, n_slots: int, slot_bytes: int, *, n_spare: int = 0, align: int = 4096):
        if n_slots < 0 or n_spare < 0 or n_slots + n_spare == 0:
            raise BudgetError(f"Arena: expected at least one slot or spare, got n_slots={n_slots}, n_spare={n_spare}")
        if slot_bytes <= 0:
            raise BudgetError(f"Arena: expected slot_bytes > 0, got {slot_bytes}")
        if align <= 0 or align & (align - 1):
            raise ValueError(f"Arena: align must be a power of two, got {align}")
        self.n_slots = n_slots
        self.n_spare = n_spare
        self.align = align
        self.slot_bytes = round_up(slot_bytes, align)
        # An anonymous mapping starts on a page boundary; align > page size is met by over-allocating
        # and starting at the first aligned address inside it.
        self._base = 0
        size = self.slot_bytes * (n_slots + n_spare)
        extra = align - mmap.PAGESIZE if align > mmap.PAGESIZE else 0
        try:
            self._mm: mmap.mmap | None = mmap.mmap(-1, size + extra, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as err:
            raise BudgetError(f"Arena: could not map {size} bytes for {n_slots}+{n_spare} slots: {err}") from err
        # Huge pages under the slots: an O_DIRECT read pins its buffer's pages and hands the disk one
        # segment per physically contiguous run, so a 2.125 MiB slab in 4 KiB pages is 544 pages and
        # three requests (virtio-blk here takes 254 segments each), in 2 MiB pages a few. AMD EPYC Zen 4,
        # a virtio disk: fio's slab reads x 32 ran 2.3-2.6 GiB/s into huge pages against 1.2-1.4 into
        # small ones, and the event loop, which submits them, spent 2.6-3.2 against 5.3-7.1 ms of CPU a
        # token at 4 streams (docs/benchmarks.md). Only a hint: where transparent huge pages are off (or
        # not Linux) the mapping stays as it is.
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self._all = np.frombuffer(self._mm, dtype=np.uint8)  # uint8 [size + extra]
        if extra:
            self._base = (-self._all.ctypes.data) % align
        self._all = self._all[self._base:self._base + size]  # uint8 [size]
        self._mv = memoryview(self._mm)[self._base:self._base + size]
        self._nbytes = size

    # -- geometry -----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of slot and spare memory (excluding any over-allocation for align > page size)."""
        return self._nbytes

    @property
    def n_buffers(self) -> int:
        return self.n_slots + self.n_spare

    @property
    def closed(self) -> bool:
        return self._mm is None

    def spare_index(self, j: int) -> int:
        """Buffer index of spare ``j`` (spares follow the slots)."""
        if not 0 <= j < self.n_spare:
            raise IndexError(f"spare {j} out of range [0, {self.n_spare})")
        return self.n_slots + j

    def _start(self, i: int) -> int:
        if self._mm is None:
            raise ClosedError("Arena is closed")
        if not 0 <= i < self.n_slots + self.n_spare:
            raise IndexError(f"buffer {i} out of range [0, {self.n_slots + self.n_spare})")
        return i * self.slot_bytes

    # -- views --------------------------------------------------------------------------------
    def slot(self, i: int) -> np.ndarray:
        """uint8 [slot_bytes] view of slot ``i`` (indices >= n_slots are the spares)."""
        s = self._start(i)
        return self._all[s:s + self.slot_bytes]

    def spare(self, j: int) -> np.ndarray:
        return self.slot(self.spare_index(j))

    def buffer(self, i: int) -> memoryview:
        """Writable memoryview of the whole of slot ``i``: what a backend registers."""
        s = self._start(i)
        return self._mv[s:s + self.slot_bytes]

    def region(self, i: int, start: int, length: int) -> memoryview:
        """Writable memoryview of ``[start, start + length)`` inside slot ``i``; ``start`` must be aligned.

        Use it to register one backend buffer per sub-region (e.g. gate/up/down of one expert) once.
        """
        s = self._start(i)
        if start % self.align or start < 0 or length <= 0 or start + length > self.slot_bytes:
            raise ValueError(
                f"region({i}, {start}, {length}): need start a multiple of {self.align} and "
                f"0 < start + length <= slot_bytes={self.slot_bytes}"
            )
        return self._mv[s + start:s + start + length]

    def region_array(self, i: int, start: int, length: int) -> np.ndarray:
        """uint8 [length] view of the same bytes as ``region``; any start allowed (for reading results)."""
        s = self._start(i)
        if start < 0 or length < 0 or start + length > self.slot_bytes:
            raise ValueError(f"region_array({i}, {start}, {length}) outside slot of {self.slot_bytes} bytes")
        return self._all[s + start:s + start + length]

    # -- lifetime -----------------------------------------------------------------------------
    def populate(self) -> None:
        """Fault every page in now, as huge pages where the hint took: once, at start-up, off the event
        loop (1 GiB took 0.1 s, 0.7-2.7 s where the virtual machine's host had not backed that memory
        yet: AMD EPYC Zen 4, a 2-core VM). Left to the reads, each
        slot's first O_DIRECT read faulted its pages inside io_uring_submit, on the event loop: 70-90 ms
        a submit on a cold cache where faults are dear (wide.gguf, that VM's first runs after boot), so
        the caller's loop stalled through the first prompt. Whether the memory is there is then also
        known at open, not mid-generation."""
        if self._mm is None:
            raise ClosedError("Arena is closed")
        if self._nbytes:
            # ctypes drops the GIL for the call (mmap.madvise would hold it throughout)
            madvise = libc().madvise
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            if madvise(self._all.ctypes.data, self._nbytes, _MADV_POPULATE_WRITE) == 0:
                return
        self._all[:: mmap.PAGESIZE] = 0  # an older kernel: one write in each page

    def close(self) -> None:
        """Release the memory (see the module docstring for why it may stay reserved). Idempotent."""
        mm, self._mm = self._mm, None
        if mm is None:
            return
        self._all = np.empty(0, dtype=np.uint8)
        self._mv.release()
        try:
            mm.close()
        except BufferError:
            # Still exported (an Iovec, or a caller's view): give the pages back, keep the range.
            mm.madvise(mmap.MADV_DONTNEED)

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else f"{self._nbytes} bytes"
        return f"Arena(n_slots={self.n_slots}, n_spare={self.n_spare}, slot_bytes={self.slot_bytes}, {state})"
