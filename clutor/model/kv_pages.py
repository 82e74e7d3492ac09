"""KV pages as bytes on disk: one format for the disk prefix cache (clutor.model.kv_disk) and for
saved slots (clutor.model.slots).

A record is one full page (PAGE positions of every layer of one page group, clutor.model.kv):

    header   4096 bytes: b"CLUTORKV", the layout version (u32), the JSON's length (u32), then JSON: the
             model file's identity, kv_type, the group, the page's shape, the parent chain key, the
             page's PAGE token ids, the payload's bytes and its CRC-32
    payload  the page's values (``data[page]``), then for q8_0 its scales; zero-padded to 4096

A record is used only when every header field matches what is asked for, its tokens hash to its key
after its parent (so it holds exactly the chain of tokens asked for), and the checksum matches.
Records are read in O_DIRECT batches through the expert store's io backends (clutor.io.open_backend)
into staging buffers, then checked and copied into pool pages on a thread.
"""
from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..errors import ClutorError
from ..io.arena import Arena, round_up
from ..io.backend import ReadRequest
from ..io.open_backend import open_backend
from .kv import PAGE, _key

if TYPE_CHECKING:
    from .gguf import GGUFFile
    from .kv import KVPool

__all__ = ["BLOCK", "HEADER", "LAYOUT_VERSION", "GroupShape", "Load", "PageFormat", "file_identity", "read_records"]

MAGIC = b"CLUTORKV"
LAYOUT_VERSION = 1
HEADER = 4096               # a record's header bytes; the payload starts here (O_DIRECT-aligned)
BLOCK = 4096                # records are padded to this (O_DIRECT's alignment here)
BATCH_BYTES = 64 << 20      # staging buffers of one read batch


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
    """One record to load: group gi's page under chain key ``key`` (after ``parent``), into a pool page."""

    gi: int
    key: bytes
    parent: bytes
    data: np.ndarray              # the pool page's values, written here
    scales: np.ndarray | None     # its q8_0 scales
    page: int = -1                # the pool page
    path: str = ""                # where the record is (read_records)
    offset: int = 0               # ... and at which byte


class PageFormat:
    """The records of one model's pool: its identity, kv_type and page groups."""

    def __init__(self, model: str, kv_type: str, groups: Sequence[GroupShape]):
        self.model = model
        self.kv_type = kv_type
        self.groups = list(groups)
        shapes = [[list(g.shape), g.data_bytes, g.scale_bytes] for g in self.groups]
        # names a directory or file set of this model's pages: another model or kv_type never shares it
        self.id = hashlib.blake2b(json.dumps([model, kv_type, LAYOUT_VERSION, shapes]).encode(),
                                  digest_size=8).hexdigest()

    @classmethod
    def of(cls, pool: "KVPool", model: str) -> "PageFormat":
        return cls(model, pool.kv_type, [GroupShape(tuple(g.data.shape[1:]), g.data[0].nbytes,
                                                    g.scales[0].nbytes if g.scales is not None else 0)
                                         for g in pool.groups])

    def record(self, gi: int) -> int:
        return self.groups[gi].record

    def encode(self, buf: np.ndarray, gi: int, key: bytes, parent: bytes, tokens: np.ndarray, data: np.ndarray,
               scales: np.ndarray | None) -> None:
        """Fill buf (uint8 [record(gi)]) with the record of this page."""
        g = self.groups[gi]
        end = HEADER + g.data_bytes
        buf[HEADER:end] = data.reshape(-1).view(np.uint8)
        if scales is not None:
            buf[end:end + g.scale_bytes] = scales.reshape(-1).view(np.uint8)
        buf[end + g.scale_bytes:] = 0
        crc = zlib.crc32(buf[HEADER:end + g.scale_bytes])
        head = json.dumps({"model": self.model, "kv_type": self.kv_type, "group": gi, "shape": list(g.shape),
                           "parent": parent.hex(), "key": key.hex(), "tokens": np.asarray(tokens).tolist(),
                           "data_bytes": g.data_bytes, "scale_bytes": g.scale_bytes, "crc32": crc}).encode()
        prefix = MAGIC + struct.pack("<II", LAYOUT_VERSION, len(head)) + head
        buf[:HEADER] = 0
        buf[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)

    def check(self, buf: np.ndarray, gi: int, key: bytes, parent: bytes) -> tuple[str | None, np.ndarray | None]:
        """(why buf is not the record of this page, or None; the page's token ids)."""
        g = self.groups[gi]
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
        if not isinstance(h, dict):
            return "header JSON is not an object", None
        want = {"model": self.model, "kv_type": self.kv_type, "group": gi, "shape": list(g.shape),
                "parent": parent.hex(), "key": key.hex(), "data_bytes": g.data_bytes, "scale_bytes": g.scale_bytes}
        for field, v in want.items():
            if h.get(field) != v:
                return f"header field {field!r} is {h.get(field)!r}, expected {v!r}", None
        try:
            tokens = np.asarray(h.get("tokens", []), dtype="<i4")
        except (TypeError, ValueError, OverflowError):
            return "header field 'tokens' is not a list of token ids", None
        if tokens.shape != (PAGE,) or _key(parent, tokens) != key:
            return "its tokens do not hash to its key", None
        crc = zlib.crc32(buf[HEADER : HEADER + g.data_bytes + g.scale_bytes])
        if crc != h.get("crc32"):
            return f"checksum {crc:#010x}, header says {h.get('crc32')!r}", None
        return None, tokens

    def copy_out(self, buf: np.ndarray, it: Load) -> None:
        """A checked record's payload into its pool page."""
        g = self.groups[it.gi]
        end = HEADER + g.data_bytes
        it.data.reshape(-1).view(np.uint8)[:] = buf[HEADER:end]
        if it.scales is not None:
            it.scales.reshape(-1).view(np.uint8)[:] = buf[end:end + g.scale_bytes]


async def read_records(fmt: PageFormat, items: Sequence[Load], *, io: str, direct: bool,
                       rejected: Callable[[Load, str, bool], None]) -> list[np.ndarray | None]:
    """Read each item's record (item.path at item.offset), check it and copy it into its pool page.
    Per item: the page's token ids, or None (after ``rejected(item, why, broken)``, on a thread or
    the loop, for a record that could not be read, broken=False, or did not check, broken=True)."""
    out: list[np.ndarray | None] = [None] * len(items)
    if not items:
        return out
    per = max(fmt.record(it.gi) for it in items)
    arena = Arena(max(1, min(len(items), BATCH_BYTES // per)), per, align=BLOCK)
    io = "auto" if io == "memory" else io
    try:
        for at in range(0, len(items), arena.n_slots):
            batch = list(items[at : at + arena.n_slots])
            try:
                reads = await _read(fmt, arena, batch, io, direct)
            except (ClutorError, OSError) as e:
                for it in batch:
                    rejected(it, f"unreadable ({e})", False)
                continue

            def accept(batch=batch, reads=reads) -> list[np.ndarray | None]:
                got = []
                for j, (it, n) in enumerate(zip(batch, reads)):
                    rec = fmt.record(it.gi)
                    broken = True
                    if isinstance(n, BaseException):
                        why, tokens, broken = f"unreadable ({n})", None, False
                    elif n < rec:
                        why, tokens = f"{n} bytes, a page is {rec}: truncated", None
                    else:
                        why, tokens = fmt.check(arena.slot(j), it.gi, it.key, it.parent)
                    if why is None:
                        fmt.copy_out(arena.slot(j), it)
                    else:
                        rejected(it, why, broken)
                    got.append(tokens)
                return got

            for i, tokens in enumerate(await finish(asyncio.to_thread(accept)), start=at):
                out[i] = tokens
    finally:
        arena.close()
    return out


async def _read(fmt: PageFormat, arena: Arena, batch: list[Load], io: str, direct: bool) -> list:
    paths = sorted({it.path for it in batch})
    index = {p: i for i, p in enumerate(paths)}
    backend = open_backend(paths, [arena.buffer(j) for j in range(len(batch))], io=io, direct=direct)
    try:
        handles = backend.submit([ReadRequest(index[it.path], it.offset, fmt.record(it.gi), j)
                                  for j, it in enumerate(batch)])
        return list(await asyncio.gather(*(h.wait() for h in handles), return_exceptions=True))
    finally:
        await backend.aclose()


def open_for_write(path: str, direct: bool) -> int:
    """A new file for records: O_DIRECT where the filesystem takes it (tmpfs refuses it: EINVAL)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644)


def write_all(fd: int, view: memoryview, at: int) -> int:
    """All of view at offset at (a short write is continued; none at all is ENOSPC) -> its length."""
    done = 0
    while done < len(view):
        k = os.pwrite(fd, view[done:], at + done)
        if k <= 0:
            raise OSError(errno.ENOSPC, f"wrote {done} of {len(view)} bytes")
        done += k
    return done


async def finish(coro):
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
