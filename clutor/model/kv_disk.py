"""The prefix cache on disk: KV pages kept in files under a byte bound, found by the pool's hash chain,
so a prompt that starts like a recent one loads its keys and values instead of computing them, even
after the RAM pool gave them up or the server restarted.

Each full page (PAGE positions of every layer of one page group, clutor.model.kv) is written once,
when it is published, to ``ROOT/<store id>/g<group>-<chain key>.kvp``:

    header   4096 bytes: b"CLUTORKV", the layout version (u32), the JSON's length (u32), then JSON: the
             model file's identity, kv_type, the group, the page's shape, the parent chain key, the
             page's PAGE token ids, the payload's bytes and its CRC-32
    payload  the page's values (``data[page]``), then for q8_0 its scales; zero-padded to 4096

The store id names the model file's identity, the KV type and the layout version, so another model
(or another kv_type) never looks in this directory; the header names them again, and a page is used
only when every field, the token chain (its tokens hash to its key after its parent) and the checksum
match. Anything else is ignored with a log line and its positions are computed: a full disk, a
read-only directory, a truncated or foreign file never fail a request.

Writes: a writer thread copies the page (unless the pool has since reused it: its generation
changed) and writes it O_DIRECT (through the page cache where the filesystem refuses O_DIRECT) under
a temporary name renamed into place. Reads: O_DIRECT batches through the expert store's io backends
(clutor.io.open_backend) into staging buffers, checked and copied into pool pages on a thread.

Byte bound: this store's files total at most ``size`` bytes, least recently used (by mtime, which a
load refreshes) removed first.
"""
from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..errors import ClutorError
from ..io.arena import Arena, round_up
from ..io.backend import ReadRequest
from ..io.open_backend import open_backend
from ..units import format_bytes

if TYPE_CHECKING:
    from .gguf import GGUFFile

__all__ = ["DiskPages", "DiskStats", "Load", "file_identity", "LAYOUT_VERSION"]

log = logging.getLogger("clutor.kv")

MAGIC = b"CLUTORKV"
LAYOUT_VERSION = 1
HEADER = 4096               # header bytes; the payload starts here (O_DIRECT-aligned)
BLOCK = 4096                # records are padded to this (O_DIRECT's alignment here)
BATCH_BYTES = 64 << 20      # staging buffers of one read batch
QUEUE_BYTES = 256 << 20     # pages waiting for the writer; more are not written (counted in dropped)
SUFFIX = ".kvp"


def file_identity(f: "GGUFFile") -> str:
    """A name for the model file's contents: a BLAKE2b of each part's header (metadata and tensor
    table, raw), its size, and 64 bytes at the start, middle and end of every tensor. A copy of the
    file has the same identity; a file of other weights (another seed, another fine-tune) does not."""
    h = hashlib.blake2b(digest_size=16)
    firsts: dict[str, int] = {}
    for t in f.tensors.values():
        firsts[t.path] = min(firsts.get(t.path, t.offset), t.offset)
    fds: dict[str, int] = {}
    try:
        for path in f.paths:
            fds[path] = fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            h.update(os.fstat(fd).st_size.to_bytes(8, "little"))
            h.update(os.pread(fd, firsts.get(path, 0), 0))
        for name in sorted(f.tensors):
            t = f.tensors[name]
            for at in (t.offset, t.offset + t.nbytes // 2, t.offset + max(0, t.nbytes - 64)):
                h.update(os.pread(fds[t.path], min(64, t.nbytes), at))
    finally:
        for fd in fds.values():
            os.close(fd)
    return h.hexdigest()


@dataclass(frozen=True)
class GroupShape:
    """What one page of a page group is on disk."""

    shape: tuple[int, ...]   # data[page]: (layers, heads, PAGE, width)
    data_bytes: int
    scale_bytes: int         # q8_0's scales (0 otherwise)

    @property
    def record(self) -> int:
        return round_up(HEADER + self.data_bytes + self.scale_bytes, BLOCK)


@dataclass
class Load:
    """One page to load: group gi's page under chain key ``key`` (after ``parent``), into dst."""

    gi: int
    key: bytes
    parent: bytes
    data: np.ndarray              # the pool page's values, written here
    scales: np.ndarray | None     # its q8_0 scales
    page: int = -1                # the pool page (KVPool.take_prefix)


@dataclass(frozen=True)
class DiskStats:
    root: str
    size: int            # the byte bound
    files: int
    bytes: int
    written: int         # pages written since open
    loaded: int          # pages loaded since open
    rejected: int        # files ignored (did not match, unreadable)
    dropped: int         # pages not written (the writer behind, or writes failing)


class DiskPages:
    """The disk prefix cache of one model (see the module docstring). ``has``, ``spill`` and ``load``
    run on the loop (``spill`` also under the engine's pool lock on the compute thread)."""

    def __init__(self, root: str, size: int, *, model: str, kv_type: str, groups: Sequence[GroupShape],
                 io: str = "auto", direct: bool = True):
        self.size = int(size)
        self.model = model
        self.kv_type = kv_type
        self.groups = list(groups)
        self.io = "auto" if io == "memory" else io
        self.direct = direct
        shapes = [[list(g.shape), g.data_bytes, g.scale_bytes] for g in self.groups]
        store = hashlib.blake2b(json.dumps([model, kv_type, LAYOUT_VERSION, shapes]).encode(), digest_size=8)
        self.root = os.path.join(os.fspath(root), store.hexdigest())
        self._lock = threading.Lock()      # the index, between the loop, the writer and the loader threads
        self._index: OrderedDict[tuple[int, bytes], int] = OrderedDict()  # (group, key) -> bytes; oldest first
        self.bytes = 0
        self.written = self.loaded = self.rejected = self.dropped = 0
        self._queued: set[tuple[int, bytes]] = set()
        self._queued_bytes = 0
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
                if gi is None or gi >= len(self.groups):
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

    def _bound(self, incoming: int) -> None:
        """Remove the least recently used files until ``incoming`` more bytes fit (lock held)."""
        while self._index and self.bytes + incoming > self.size:
            (gi, key), nbytes = self._index.popitem(last=False)
            self.bytes -= nbytes
            _unlink(self._path(gi, key))

    def _forget(self, gi: int, key: bytes, remove: bool) -> None:
        with self._lock:
            nbytes = self._index.pop((gi, key), None)
            if nbytes is not None:
                self.bytes -= nbytes
        if remove:
            _unlink(self._path(gi, key))

    # -- writing ---------------------------------------------------------------------------------
    def spill(self, gi: int, key: bytes, parent: bytes, tokens: np.ndarray, data: np.ndarray,
              scales: np.ndarray | None, valid: Callable[[], bool]) -> None:
        """Queue a full, published page for writing. ``data``/``scales`` view the pool's page, read by
        the writer only while ``valid()`` (the pool has not reused it) holds."""
        rec = self.groups[gi].record
        with self._lock:
            if not self.writable or rec > self.size or (gi, key) in self._index or (gi, key) in self._queued:
                return
            if self._queued_bytes + rec > QUEUE_BYTES:
                self.dropped += 1
                return
            self._queued.add((gi, key))
            self._queued_bytes += rec
        self._jobs.put((gi, key, parent, np.array(tokens, dtype="<i4"), data, scales, valid))

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            gi, key = job[0], job[1]
            try:
                if self.writable:
                    self._write(*job)
            except Exception as e:  # noqa: BLE001 - a page not stored is a recompute, never a failure
                self._warn(f"write-{type(e).__name__}", f"prefix cache on disk: a page was not stored ({e})")
                self.dropped += 1
            finally:
                with self._lock:
                    self._queued.discard((gi, key))
                    self._queued_bytes -= self.groups[gi].record

    def _write(self, gi: int, key: bytes, parent: bytes, tokens: np.ndarray, data: np.ndarray,
               scales: np.ndarray | None, valid: Callable[[], bool]) -> None:
        g = self.groups[gi]
        arena = self._buffers.get(gi)
        if arena is None:
            arena = self._buffers[gi] = Arena(1, g.record, align=BLOCK)
        buf = arena.slot(0)  # uint8 [record]; zeros past the payload (never written)
        end = HEADER + g.data_bytes
        buf[HEADER:end] = data.reshape(-1).view(np.uint8)
        if scales is not None:
            buf[end:end + g.scale_bytes] = scales.reshape(-1).view(np.uint8)
        if not valid():  # the pool reused the page while it was copied: what was copied is not this page
            self.dropped += 1
            return
        crc = zlib.crc32(buf[HEADER:end + g.scale_bytes])
        head = json.dumps({"model": self.model, "kv_type": self.kv_type, "group": gi, "shape": list(g.shape),
                           "parent": parent.hex(), "key": key.hex(), "tokens": tokens.tolist(),
                           "data_bytes": g.data_bytes, "scale_bytes": g.scale_bytes, "crc32": crc}).encode()
        prefix = MAGIC + struct.pack("<II", LAYOUT_VERSION, len(head)) + head
        buf[:HEADER] = 0
        buf[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
        with self._lock:
            self._bound(g.record)
        path = self._path(gi, key)
        tmp = path + ".tmp"
        try:
            fd = _open_for_write(tmp, self.direct)
            try:
                done = os.pwrite(fd, arena.buffer(0)[: g.record], 0)
            finally:
                os.close(fd)
            if done != g.record:
                raise OSError(errno.ENOSPC, f"wrote {done} of {g.record} bytes")
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            self.dropped += 1
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                self.writable = False
                self._warn("write-readonly", f"prefix cache on disk: {self.root} cannot be written "
                                             f"({e.strerror}); no more pages are stored, stored ones still load")
            else:
                self._warn(f"write-{e.errno}", f"prefix cache on disk: a page was not stored in {self.root} "
                                               f"({e.strerror or e}); its positions are computed when needed")
            return
        with self._lock:
            self._index[(gi, key)] = g.record
            self.bytes += g.record
            self.written += 1

    # -- reading ---------------------------------------------------------------------------------
    async def load(self, items: Sequence[Load]) -> list[np.ndarray | None]:
        """Read, check and copy these pages into their pool pages. Per item: the page's token ids, or
        None when it is not here or did not check (a log line says why)."""
        out: list[np.ndarray | None] = [None] * len(items)
        todo = [i for i, it in enumerate(items) if self.has(it.gi, it.key)]
        if not todo:
            return out
        per = max(self.groups[items[i].gi].record for i in todo)
        arena = Arena(max(1, min(len(todo), BATCH_BYTES // per)), per, align=BLOCK)
        try:
            for at in range(0, len(todo), arena.n_slots):
                batch = todo[at : at + arena.n_slots]
                try:
                    reads = await self._read(arena, [items[i] for i in batch])
                except (ClutorError, OSError) as e:
                    self._warn("read", f"prefix cache on disk: a read of {len(batch)} pages failed ({e}); "
                                       "their positions are computed")
                    continue
                got = await _finish(asyncio.to_thread(self._accept, arena, [items[i] for i in batch], reads))
                for i, tokens in zip(batch, got):
                    out[i] = tokens
        finally:
            arena.close()
        return out

    async def _read(self, arena: Arena, batch: list[Load]) -> list[int | BaseException]:
        backend = open_backend([self._path(it.gi, it.key) for it in batch],
                               [arena.buffer(j) for j in range(len(batch))], io=self.io, direct=self.direct)
        try:
            handles = backend.submit([ReadRequest(j, 0, self.groups[it.gi].record, j) for j, it in enumerate(batch)])
            return list(await asyncio.gather(*(h.wait() for h in handles), return_exceptions=True))
        finally:
            await backend.aclose()

    def _accept(self, arena: Arena, batch: list[Load], reads: list) -> list[np.ndarray | None]:
        """Thread: each read page checked against what it must be, and copied into the pool."""
        out: list[np.ndarray | None] = []
        for j, (it, n) in enumerate(zip(batch, reads)):
            why = None
            g = self.groups[it.gi]
            if isinstance(n, BaseException):
                why = f"unreadable ({n})"
            elif n < g.record:
                why = f"{n} bytes, a page is {g.record}: truncated"
            tokens = None
            if why is None:
                buf = arena.slot(j)
                why, tokens = self._check(buf, it, g)
            if why is not None:
                self._warn("reject", f"prefix cache on disk: ignored {self._path(it.gi, it.key)}: {why}; "
                                     "its positions are computed")
                with self._lock:
                    self.rejected += 1
                self._forget(it.gi, it.key, remove=True)
                out.append(None)
                continue
            end = HEADER + g.data_bytes
            it.data.reshape(-1).view(np.uint8)[:] = buf[HEADER:end]
            if it.scales is not None:
                it.scales.reshape(-1).view(np.uint8)[:] = buf[end:end + g.scale_bytes]
            with self._lock:
                if (it.gi, it.key) in self._index:
                    self._index.move_to_end((it.gi, it.key))
                self.loaded += 1
            try:
                os.utime(self._path(it.gi, it.key))  # its place in the byte bound's order after a restart
            except OSError:
                pass
            out.append(tokens)
        return out

    def _check(self, buf: np.ndarray, it: Load, g: GroupShape) -> tuple[str | None, np.ndarray | None]:
        """(why this record is not the page asked for, or None; its token ids)."""
        from .kv import PAGE, _key

        raw = buf[:HEADER].tobytes()
        if raw[:8] != MAGIC:
            return "not a Clutor KV page (magic)", None
        version, n = struct.unpack_from("<II", raw, 8)
        if version != LAYOUT_VERSION:
            return f"layout version {version}, expected {LAYOUT_VERSION}", None
        try:
            h = json.loads(raw[16 : 16 + n])
        except ValueError:
            return "header JSON unreadable", None
        want = {"model": self.model, "kv_type": self.kv_type, "group": it.gi, "shape": list(g.shape),
                "parent": it.parent.hex(), "key": it.key.hex(), "data_bytes": g.data_bytes,
                "scale_bytes": g.scale_bytes}
        for field, v in want.items():
            if h.get(field) != v:
                return f"header field {field!r} is {h.get(field)!r}, expected {v!r}", None
        tokens = np.asarray(h.get("tokens", []), dtype="<i4")
        if len(tokens) != PAGE or _key(it.parent, tokens) != it.key:
            return "its tokens do not hash to its key", None
        crc = zlib.crc32(buf[HEADER : HEADER + g.data_bytes + g.scale_bytes])
        if crc != h.get("crc32"):
            return f"checksum {crc:#010x}, header says {h.get('crc32')!r}", None
        return None, tokens

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


def _open_for_write(path: str, direct: bool) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: the filesystem refuses O_DIRECT (tmpfs)
                raise
    return os.open(path, flags, 0o644)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


async def _finish(coro):
    """Await a thread's work; if the caller is cancelled meanwhile, still wait for the thread (it
    writes into pool pages and reads staging buffers that are freed after), then re-raise."""
    fut = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue
        raise
