"""Saved slots: a sequence's KV pages in one file a client names, as llama-server's
``/slots/{id}?action=save|restore``. A restored file's pages are back in the pool, held for the slot,
so the next prompt that starts with its tokens maps them instead of computing them.

A slot file:

    header   BLOCK-aligned: b"CLUTORSL", the layout version (u32), the JSON's length (u32), then JSON:
             the model file's identity, kv_type, the page format's id, the token ids, and the records'
             (group, page index) in file order
    records  one per page (clutor.model.kv_pages), each at the header's end plus the records before it

Only full pages are saved: n_saved counts their positions. Pages come from the pool, or from the disk
prefix cache where the pool gave them up. A restore checks every record as the disk cache does
(header fields, token chain, checksum) and keeps the prefix whose pages all check.
"""
from __future__ import annotations

import asyncio
import json
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import ClutorError
from ..io.arena import Arena, round_up
from .kv import PAGE, ROOT
from .kv_pages import BLOCK, LAYOUT_VERSION, PageFormat, finish, open_for_write, read_records, write_all

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Saved", "Restored", "save_slot", "restore_slot"]

MAGIC = b"CLUTORSL"


@dataclass
class Saved:
    n_tokens: int     # positions saved (whole pages)
    n_bytes: int      # the file's size


@dataclass
class Restored:
    tokens: list[int]   # the positions restored
    n_bytes: int        # bytes read
    pins: list = field(default_factory=list)  # (group, page) held for the slot; Engine.unpin gives them back


async def save_slot(engine: "Engine", fmt: PageFormat, tokens: Sequence[int], path: str, *, direct: bool) -> Saved:
    """Write the pages the pool (or the disk prefix cache) holds of tokens' longest prefix to path."""
    n_full = len(tokens) // PAGE
    keys = engine.pool.chain_keys(tokens, n_full)
    pins, entries = engine.hold_chain(keys)  # entries [(group, page index, pool page | -1, disk path | None)]
    try:
        n = len({i for _, i, _, _ in entries})
        order = [[gi, i] for gi, i, _, _ in entries]
        head = json.dumps({"model": fmt.model, "kv_type": fmt.kv_type, "format": fmt.id,
                           "tokens": [int(t) for t in tokens[: n * PAGE]], "records": order}).encode()
        prefix = MAGIC + struct.pack("<II", LAYOUT_VERSION, len(head)) + head
        groups = engine.pool.groups

        def write() -> int:
            per = max((fmt.record(gi) for gi, _, _, _ in entries), default=BLOCK)
            hbytes = round_up(len(prefix), BLOCK)
            arena = Arena(1, max(per, hbytes), align=BLOCK)
            tmp = path + ".tmp"
            try:
                fd = open_for_write(tmp, direct)
                try:
                    buf = arena.slot(0)
                    buf[:hbytes] = 0
                    buf[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
                    at = write_all(fd, arena.buffer(0)[:hbytes], 0)
                    for gi, i, page, disk_path in entries:
                        rec = fmt.record(gi)
                        if page >= 0:
                            g = groups[gi]
                            fmt.encode(buf, gi, keys[i], keys[i - 1] if i else ROOT,
                                       np.asarray(tokens[i * PAGE : (i + 1) * PAGE], dtype="<i4"), g.data[page],
                                       g.scales[page] if g.scales is not None else None)
                        else:  # a record of the disk prefix cache, as it is (restore checks it)
                            try:
                                with open(disk_path, "rb") as f:
                                    short = f.readinto(memoryview(buf)[:rec]) != rec
                            except OSError as e:
                                raise ClutorError(f"the prefix cache on disk gave up a page while it was being "
                                                  f"saved ({e.strerror}): save again") from None
                            if short:
                                raise ClutorError(f"{disk_path}: a page of the prefix cache on disk is short")
                        at += write_all(fd, arena.buffer(0)[:rec], at)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
                return at
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            finally:
                arena.close()

        try:
            n_bytes = await finish(asyncio.to_thread(write))
        except OSError as e:
            raise ClutorError(f"cannot write {path}: {e.strerror or e}") from None
        return Saved(n * PAGE, n_bytes)
    finally:
        engine.unpin(pins)


async def restore_slot(engine: "Engine", fmt: PageFormat, path: str, *, io: str, direct: bool) -> Restored:
    """Read a slot file's pages into the pool (held: Restored.pins) and return what they hold.
    ClutorError when the file is not a slot file of this model; records that do not check end the
    restored prefix there."""
    head = await asyncio.to_thread(_read_head, path)
    for name, want in (("model", fmt.model), ("kv_type", fmt.kv_type), ("format", fmt.id)):
        if head.get(name) != want:
            raise ClutorError(f"{os.path.basename(path)}: saved by another model or setting (its {name} is "
                              f"{head.get(name)!r}, this server's is {want!r})")
    try:
        tokens = [int(t) for t in head["tokens"]]
        order = [(int(gi), int(i)) for gi, i in head["records"]]
    except (KeyError, TypeError, ValueError):
        raise ClutorError(f"{os.path.basename(path)}: its header's tokens or records are unreadable") from None
    n = len(tokens) // PAGE
    if any(not 0 <= gi < len(fmt.groups) or not 0 <= i < n for gi, i in order):
        raise ClutorError(f"{os.path.basename(path)}: its records name pages it does not have")
    keys = engine.pool.chain_keys(tokens, n)
    offsets, at = [], head["_bytes"]
    for gi, _ in order:
        offsets.append(at)
        at += fmt.record(gi)
    pins, loads, held = engine.take_pages([(gi, keys[i], keys[i - 1] if i else ROOT) for gi, i in order])
    where = {(gi, keys[i]): at for (gi, i), at in zip(order, offsets)}
    for ld in loads:
        ld.path, ld.offset = path, where[(ld.gi, ld.key)]
    got: list = [None] * len(loads)
    try:
        got = await read_records(fmt, loads, io=io, direct=direct, rejected=lambda ld, why, broken: None)
    finally:
        engine.settle_pages(loads, got)
    ok = held | {(ld.gi, ld.key) for ld, t in zip(loads, got) if t is not None}
    restored = next((i for gi, i in order if (gi, keys[i]) not in ok), n)
    n_read = sum(fmt.record(ld.gi) for ld, t in zip(loads, got) if t is not None)
    return Restored(tokens[: restored * PAGE], n_read, pins)


def _read_head(path: str) -> dict:
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            first = f.read(BLOCK)
            if first[:8] != MAGIC or len(first) < 16:
                raise ClutorError(f"{name}: not a Clutor slot file")
            version, n = struct.unpack_from("<II", first, 8)
            if version != LAYOUT_VERSION:
                raise ClutorError(f"{name}: layout version {version}, this server reads {LAYOUT_VERSION}")
            raw = first[16:] + f.read(max(0, 16 + n - len(first)))
    except OSError as e:
        raise ClutorError(f"{name}: cannot read it ({e.strerror or e})") from None
    try:
        head = json.loads(raw[:n])
    except ValueError:
        raise ClutorError(f"{name}: its header is unreadable") from None
    if not isinstance(head, dict):
        raise ClutorError(f"{name}: its header is unreadable")
    head["_bytes"] = round_up(16 + n, BLOCK)
    return head
