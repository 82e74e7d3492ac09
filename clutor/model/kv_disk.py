"""The prefix cache on disk: KV pages kept in files under a byte bound, found by the pool's hash chain,
so a prompt that starts like a recent one loads its keys and values instead of computing them, even
after the RAM pool gave them up or the server restarted.

Each full page (PAGE positions of every layer of one page group, clutor.model.kv) is written once,
when it is published, as one record (clutor.model.kv_pages) in ``ROOT/<format id>/g<group>-<chain
key>.kvp``. The format id names the model file's identity, the KV type and the layout version, so
another model (or another kv_type) never looks in this directory; the record's header names them
again, and a page is used only when it checks (kv_pages.PageFormat.check). Anything else is ignored
with a log line and its positions are computed: a full disk, a read-only directory, a truncated or
foreign file never fail a request.

Writes: a writer thread copies the page (which the pool holds unchanged until the writer is done
with it) and writes it O_DIRECT (through the page cache where the filesystem refuses O_DIRECT) under
a temporary name renamed into place. Reads: kv_pages.read_records, through the io backends.

Byte bound: this store's files total at most ``size`` bytes, least recently used (by mtime, which a
load refreshes) removed first.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..io.arena import Arena
from ..units import format_bytes
from .kv_pages import BLOCK, Load, PageFormat, open_for_write, read_records, write_all

__all__ = ["DiskPages", "DiskStats"]

log = logging.getLogger("clutor.kv")

SUFFIX = ".kvp"


@dataclass(frozen=True)
class DiskStats:
    root: str
    size: int            # the byte bound
    files: int
    bytes: int
    written: int         # pages written since open
    loaded: int          # pages loaded since open
    rejected: int        # files ignored (did not match, unreadable)
    dropped: int         # pages not written (writes failing)


class DiskPages:
    """The disk prefix cache of one model (see the module docstring). ``has``, ``spill`` and ``load``
    run on the loop (``spill`` also under the engine's pool lock on the compute thread)."""

    def __init__(self, root: str, size: int, fmt: PageFormat, *, io: str = "auto", direct: bool = True):
        self.size = int(size)
        self.fmt = fmt
        self.io = io
        self.direct = direct
        self.root = os.path.join(os.fspath(root), fmt.id)
        self._lock = threading.Lock()      # the index and counts, between the loop, the writer and loads
        self._index: OrderedDict[tuple[int, bytes], int] = OrderedDict()  # (group, key) -> bytes; oldest first
        self.bytes = 0
        self.written = self.loaded = self.rejected = self.dropped = 0
        self._queued: set[tuple[int, bytes]] = set()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._buffers: dict[int, Arena] = {}  # the writer's staging record per group
        self._warned: set[str] = set()
        self.writable = True
        try:
            os.makedirs(self.root, exist_ok=True)
            self._scan()
        except OSError as e:
            self._warn("open", f"prefix cache on disk: cannot use {self.root} ({e.strerror}); "
                               "pages are neither stored nor loaded")
            self.writable = False
        self._writer = threading.Thread(target=self._write_loop, name="clutor-kv-disk", daemon=True)
        self._writer.start()

    # -- the index -------------------------------------------------------------------------------
    def _path(self, gi: int, key: bytes) -> str:
        return os.path.join(self.root, f"g{gi}-{key.hex()}{SUFFIX}")

    def _scan(self) -> None:
        """The index from the directory: files in mtime order (oldest first), unfinished writes removed."""
        found = []
        with os.scandir(self.root) as it:
            for e in it:
                if e.name.endswith(".tmp"):
                    _unlink(e.path)
                    continue
                gi, key = _parse_name(e.name)
                if gi is None or gi >= len(self.fmt.groups):
                    continue
                st = e.stat()
                found.append((st.st_mtime_ns, gi, key, st.st_size))
        for _, gi, key, nbytes in sorted(found):
            self._index[(gi, key)] = nbytes
            self.bytes += nbytes
        self._bound(0)

    def has(self, gi: int, key: bytes) -> bool:
        return (gi, key) in self._index

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(self.root, self.size, len(self._index), self.bytes, self.written, self.loaded,
                             self.rejected, self.dropped)

    def record_path(self, gi: int, key: bytes) -> str | None:
        """The file of this page, if the store has it (a slot save copies it)."""
        return self._path(gi, key) if (gi, key) in self._index else None

    def _bound(self, incoming: int) -> None:
        """Remove the least recently used files until ``incoming`` more bytes fit (lock held)."""
        while self._index and self.bytes + incoming > self.size:
            (gi, key), nbytes = self._index.popitem(last=False)
            self.bytes -= nbytes
            _unlink(self._path(gi, key))

    # -- writing ---------------------------------------------------------------------------------
    def spill(self, gi: int, key: bytes, parent: bytes, tokens: np.ndarray, data: np.ndarray,
              scales: np.ndarray | None, done: Callable[[], None]) -> bool:
        """Queue a full, published page for writing, unless the store has it (False). ``data``/``scales``
        view the pool's page, which the pool keeps as it is until the writer calls ``done()`` (from its
        thread), written or not."""
        rec = self.fmt.record(gi)
        with self._lock:
            if not self.writable or rec > self.size or (gi, key) in self._index or (gi, key) in self._queued:
                return False
            self._queued.add((gi, key))
        self._jobs.put((gi, key, parent, np.array(tokens, dtype="<i4"), data, scales, done))
        return True

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            gi, key, done = job[0], job[1], job[-1]
            try:
                if self.writable:
                    self._write(*job[:-1])
                else:
                    self._count("dropped")
            except Exception as e:  # noqa: BLE001 - a page not stored is a recompute, never a failure
                self._warn(f"write-{type(e).__name__}", f"prefix cache on disk: a page was not stored ({e})")
                self._count("dropped")
            finally:
                with self._lock:
                    self._queued.discard((gi, key))
                done()

    def _write(self, gi: int, key: bytes, parent: bytes, tokens: np.ndarray, data: np.ndarray,
               scales: np.ndarray | None) -> None:
        rec = self.fmt.record(gi)
        arena = self._buffers.get(gi)
        if arena is None:
            arena = self._buffers[gi] = Arena(1, rec, align=BLOCK)
        self.fmt.encode(arena.slot(0), gi, key, parent, tokens, data, scales)
        with self._lock:
            self._bound(rec)
        path = self._path(gi, key)
        tmp = path + ".tmp"
        try:
            fd = open_for_write(tmp, self.direct)
            try:
                write_all(fd, arena.buffer(0)[:rec], 0)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            self._count("dropped")
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                self.writable = False
                self._warn("write-readonly", f"prefix cache on disk: {self.root} cannot be written "
                                             f"({e.strerror}); no more pages are stored, stored ones still load")
            else:
                self._warn(f"write-{e.errno}", f"prefix cache on disk: a page was not stored in {self.root} "
                                               f"({e.strerror or e}); its positions are computed when needed")
            return
        with self._lock:
            self._index[(gi, key)] = rec
            self.bytes += rec
            self.written += 1

    # -- reading ---------------------------------------------------------------------------------
    async def load(self, items: Sequence[Load]) -> list[np.ndarray | None]:
        """Read, check and copy these pages into their pool pages. Per item: the page's token ids, or
        None when it is not here or did not check (a log line says why)."""
        out: list[np.ndarray | None] = [None] * len(items)
        here = [i for i, it in enumerate(items) if self.has(it.gi, it.key)]
        for i in here:
            items[i].path, items[i].offset = self._path(items[i].gi, items[i].key), 0
        got = await read_records(self.fmt, [items[i] for i in here], io=self.io, direct=self.direct,
                                 rejected=self._rejected)
        for i, tokens in zip(here, got):
            out[i] = tokens
            if tokens is not None:
                self._used(items[i])
        return out

    def _rejected(self, it: Load, why: str, broken: bool) -> None:
        self._warn("reject", f"prefix cache on disk: ignored {it.path}: {why}; its positions are computed")
        with self._lock:
            self.rejected += 1
            nbytes = self._index.pop((it.gi, it.key), None)
            if nbytes is not None:
                self.bytes -= nbytes
        if broken:
            _unlink(it.path)

    def _used(self, it: Load) -> None:
        with self._lock:
            if (it.gi, it.key) in self._index:
                self._index.move_to_end((it.gi, it.key))
            self.loaded += 1
        try:
            os.utime(it.path)  # its place in the byte bound's order after a restart
        except OSError:
            pass

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Write what is queued, then stop (blocking: call from a thread, see aclose)."""
        if self._writer.is_alive():
            self._jobs.put(None)
            self._writer.join()
        for a in self._buffers.values():
            a.close()
        self._buffers.clear()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def _warn(self, kind: str, message: str) -> None:
        """Log a kind of failure once (then it is counted, in DiskStats)."""
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message)

    def describe(self) -> str:
        s = self.stats()
        return f"{s.files} pages, {format_bytes(s.bytes)} of {format_bytes(s.size)} in {s.root}"


def _parse_name(name: str) -> tuple[int | None, bytes]:
    if not (name.startswith("g") and name.endswith(SUFFIX)):
        return None, b""
    gi, _, key = name[1 : -len(SUFFIX)].partition("-")
    try:
        k = bytes.fromhex(key)
        return (int(gi), k) if len(k) == 16 else (None, b"")
    except ValueError:
        return None, b""


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
