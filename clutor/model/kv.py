"""The KV pool: every sequence's attention state in pages, under one byte budget, shared by prefix.

A page holds PAGE consecutive positions of every layer of one page group: the full-context layers
(FullKV, LatentKV) form one group, the sliding-window layers of each window size another (their pages
behind the window go back as the sequence advances). Per group, storage is one lazily mapped array

    data [n_pages, layers, heads, PAGE, width]      width = k_dim + v_dim (FullKV), the row (LatentKV)
    scales [n_pages, layers, heads, PAGE, width / 32]   (kv_type q8_0: one float16 scale per 32 values)

so memory becomes resident only as pages are first written, and never more than the budget: pages
are handed out lowest id first and reused. A sequence's pages are listed in its SequenceState.

Budget: the bytes of pages in use (by live sequences, or kept for reuse), recurrent states and their
checkpoints never exceed ``budget``; a page kept for reuse (reference count 0) is given up, least
recently used first, when a live sequence needs the room, and kept for reuse only up to
``prefix_budget`` bytes. When live sequences alone need more, ``reserve`` raises NoRoom and the
engine preempts one (clutor.model.engine).

Prefix sharing: a page whose positions are computed is published under a content key (a 128-bit
BLAKE2b of its parent's key and its tokens, so a key names the whole token chain up to it). A prompt
maps every full page of its longest published prefix by reference (reference counts) and copies the
filled part of the page where it diverges (or ends), so reuse is exact to the token. Recurrent
layers' states are restored from checkpoints published under the key of the position they were taken at.
"""
from __future__ import annotations

import hashlib
import heapq
import math
import mmap
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import BudgetError, ClutorError
from ..units import format_bytes
from .options import KV_TYPES
from .state import FullKV, LatentKV, Recurrent, SequenceState, WindowKV

if TYPE_CHECKING:
    from .kv_disk import DiskPages
    from .kv_pages import Load
    from .state import LayerState

__all__ = ["PAGE", "KV_TYPES", "KVPool", "Match", "NoRoom", "PoolStats", "refusal", "sizes"]

PAGE = 16  # positions per page: the granularity of sharing and of allocation
_DTYPE = {"f32": np.float32, "f16": np.float16, "q8_0": np.int8}
_Q8 = 32  # q8_0: values per scale
ROOT = b""  # the key before position 0


class NoRoom(Exception):
    """Not enough of the budget for what a sequence needs, even after giving up every kept page."""

    def __init__(self, need: int, free: int):
        super().__init__(f"{need} bytes needed, {free} free")
        self.need = need
        self.free = free


def _key(parent: bytes, tokens) -> bytes:
    """The content key of a run of tokens after the chain named by parent."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype="<i4").tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class PoolStats:
    budget: int          # bytes the pool may hold
    live_bytes: int      # pages referenced by live sequences (a shared page once) + their recurrent states
    cached_bytes: int    # pages and checkpoints kept for prefix reuse (reference count 0)
    cached_pages: int
    resident_bytes: int  # what the pool's memory holds now (pages ever handed out, not given back)
    shared_pages: int    # pages mapped by more than one sequence
    evictions: int       # kept pages given up to make room
    page_bytes: int      # bytes of one page over all groups (PAGE positions of every layer)


@dataclass
class Match:
    """The longest reusable prefix of a prompt (see KVPool.match)."""

    n: int                                   # positions reusable
    pages: list[list[int]]                   # per group: pages mapped by reference (-1: not needed)
    tails: list[int | None]                  # per group: the page whose first n % PAGE positions are copied
    checkpoint: tuple | None = None          # recurrent layers: ({layer: conv}, {layer: ssm}) at position n


class _Group:
    """Layers whose KV shares one page table (see the module docstring)."""

    def __init__(self, layers: list[int], spec: "LayerState", kv_type: str, n_pages: int):
        self.layers = layers
        self.slot = {l: i for i, l in enumerate(layers)}  # model layer -> index in data's layer axis
        self.spec = spec
        self.window = spec.window
        self.heads, self.width = spec.heads, spec.width
        self.k_dim = spec.k_dim
        self.v_dim = spec.v_dim
        self.latent = isinstance(spec, LatentKV)
        self.kv_type = kv_type
        L, H, W = len(layers), self.heads, self.width
        why = refusal(spec, kv_type)
        if why:
            raise ClutorError(why)
        self.page_bytes = _page_bytes(spec, L, kv_type)
        self.n_pages = n_pages
        self.data, self._maps = _lazy((n_pages, L, H, PAGE, W), _DTYPE[kv_type])
        self.scales = None
        if kv_type == "q8_0":
            self.scales, m = _lazy((n_pages, L, H, PAGE, W // _Q8), np.float16)
            self._maps += m
        self.free: list[int] = list(range(n_pages))  # a heap: lowest id first, so used pages stay packed
        self.refs = [0] * n_pages
        self.filled = [0] * n_pages        # positions published (0: not published)
        self.parent: list[bytes | None] = [None] * n_pages
        self.entries: list[list[bytes] | None] = [None] * n_pages  # its keys in by_prefix
        self.by_prefix: dict[bytes, int] = {}  # key of (parent, first k tokens) -> a page holding them, k=1..PAGE
        self.high = 0                      # pages ever handed out: the resident part of data

    def close(self) -> None:
        self.data = self.scales = None
        self._maps.clear()


def _grouped(specs: Sequence["LayerState"]) -> list[tuple[list[int], "LayerState"]]:
    """The page groups of these layers: layers of one attention kind and shape share a page table."""
    kinds: dict[tuple, list[int]] = {}
    for l, s in enumerate(specs):
        if isinstance(s, (FullKV, WindowKV, LatentKV)):
            kinds.setdefault((type(s), s.heads, s.k_dim, s.v_dim, s.window), []).append(l)
    return [(layers, specs[layers[0]]) for layers in kinds.values()]


def _page_bytes(spec: "LayerState", n_layers: int, kv_type: str) -> int:
    n = n_layers * spec.heads * PAGE * spec.width
    return n * np.dtype(_DTYPE[kv_type]).itemsize + (n // _Q8 * 2 if kv_type == "q8_0" else 0)


def refusal(spec: "LayerState", kv_type: str) -> str | None:
    """Why these layers' KV cannot be stored as kv_type (None: it can)."""
    if kv_type != "q8_0":
        return None
    for what, d in ((("row", spec.width),) if isinstance(spec, LatentKV) else (("key", spec.k_dim), ("value", spec.v_dim))):
        if d % _Q8:
            return f"kv_type q8_0 needs {_Q8}-value blocks: this model's KV {what} is {d} wide (use kv_type f16 or f32)"
    return None


def sizes(specs: Sequence["LayerState"], kv_type: str) -> tuple[int, int]:
    """(bytes of one page over every group, bytes of one sequence's recurrent states) for these layers."""
    return (sum(_page_bytes(spec, len(layers), kv_type) for layers, spec in _grouped(specs)),
            sum(s.nbytes for s in specs if isinstance(s, Recurrent)))


def _lazy(shape: tuple[int, ...], dtype) -> tuple[np.ndarray, list]:
    """Zeros in an anonymous mapping (zero pages until written), without huge pages (a huge page
    would make 2 MiB resident for the first position written in it)."""
    nbytes = max(math.prod(shape) * np.dtype(dtype).itemsize, 1)
    try:
        m = mmap.mmap(-1, nbytes)
    except (OSError, OverflowError, MemoryError, ValueError) as e:
        raise BudgetError(f"a KV pool of {nbytes} bytes ({format_bytes(nbytes)}) cannot be mapped ({e}): "
                          "open the model with a smaller kv_cache (or a smaller n_ctx)") from None
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, dtype=dtype, count=math.prod(shape)).reshape(shape), [m]


class KVPool:
    """Pages of every sequence of one model (see the module docstring). Used from the event loop;
    the compute thread only writes and reads page contents, through a running Step."""

    def __init__(self, specs: Sequence["LayerState"], *, n_ctx: int, budget: int, kv_type: str = "f32",
                 prefix_budget: int | None = None):
        if kv_type not in KV_TYPES:
            raise ClutorError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        self.n_ctx = n_ctx
        self.kv_type = kv_type
        self.budget = int(budget)
        self.prefix_budget = self.budget if prefix_budget is None else min(int(prefix_budget), self.budget)
        self.recurrent: dict[int, Recurrent] = {l: s for l, s in enumerate(specs) if isinstance(s, Recurrent)}
        self.state_bytes = sum(s.nbytes for s in self.recurrent.values())  # per live sequence
        probe = _grouped(specs)
        per_page = [_page_bytes(spec, len(layers), kv_type) for layers, spec in probe]
        self.page_bytes = sum(per_page)
        self.groups: list[_Group] = []
        if self.budget < self.bytes_for(1):
            raise BudgetError(f"kv_cache of {format_bytes(self.budget)} holds no sequence: one position needs "
                              f"{format_bytes(self.bytes_for(1))} ({self.bytes_for(1)} bytes: a page of {PAGE} "
                              f"positions of every layer{' and the recurrent state' if self.state_bytes else ''})")
        try:
            for (layers, spec), pb in zip(probe, per_page):
                self.groups.append(_Group(layers, spec, kv_type, self.budget // pb))
        except BaseException:
            self.close()
            raise
        self._group_of = {l: (gi, g.slot[l]) for gi, g in enumerate(self.groups) for l in g.layers}
        self.used = 0          # bytes in use: pages with refs or kept, recurrent states, checkpoints
        self.cached = 0        # of which kept for reuse (pages at refs 0, checkpoints)
        self._lru: OrderedDict[tuple, None] = OrderedDict()  # kept pages (gi, page) and checkpoints ("c", key)
        self._ckpts: dict[bytes, tuple] = {}  # position key -> (({layer: conv}, {layer: ssm}), bytes, parent, offset)
        self._ckpt_offsets: dict[bytes, dict[int, int]] = {}  # a page's parent key -> {offset: checkpoints there}
        self._orphans: list[list[list[int]]] = []  # tables of sequences collected without release()
        self.evictions = 0
        self.disk: "DiskPages | None" = None  # the prefix cache on disk (clutor.model.kv_disk), if any
        self._written: list[tuple[int, int]] = []  # pages the disk's writer is done with (its thread appends)

    # -- sizes --------------------------------------------------------------------------------------
    def bytes_for(self, n: int) -> int:
        """What one sequence of n positions needs of the budget on its own (window groups: their window)."""
        total = self.state_bytes
        groups = [(g.page_bytes, g.window) for g in self.groups] or [(self.page_bytes, 0)]  # (before they exist)
        for pb, w in groups:
            pages = -(-n // PAGE)
            if w:  # the window's pages, the page being written, and one more straddling the window's start
                pages = min(pages, -(-(w - 1) // PAGE) + 2)
            total += pages * pb
        return total


    def group_of(self, layer: int) -> tuple[int, int]:
        """(group index, the layer's index in that group's data)."""
        return self._group_of[layer]

    @property
    def room(self) -> int:
        """Bytes a live sequence could still get (free now, or held by pages kept for reuse)."""
        return self.budget - self.used + self.cached

    def stats(self) -> PoolStats:
        self._collect()
        live = self.used - self.cached
        shared = sum(1 for g in self.groups for r in g.refs[: g.high] if r > 1)
        resident = sum(g.high * g.page_bytes for g in self.groups) + (live - sum(
            sum(1 for r in g.refs[: g.high] if r > 0) * g.page_bytes for g in self.groups)) + sum(
            c[1] for c in self._ckpts.values())
        kept = sum(1 for k in self._lru if k[0] != "c")
        return PoolStats(self.budget, live, self.cached, kept, resident, shared, self.evictions, self.page_bytes)

    # -- sequences -------------------------------------------------------------------------------
    def sequence(self) -> SequenceState:
        """A fresh sequence (its recurrent states charged to the budget); NoRoom if they do not fit."""
        self._collect()
        if self.state_bytes:
            self._charge(self.state_bytes)
        return SequenceState(self)

    def release(self, seq: SequenceState) -> None:
        """Every page of seq back (kept for reuse where published), its recurrent states uncharged."""
        if seq.released:
            return
        seq.released = True
        seq._finalizer.detach()
        self._drop_tables(seq.tables)
        if self.state_bytes:
            self.used -= self.state_bytes
        self._trim()

    def _orphaned(self, tables: list[list[int]]) -> None:
        # weakref.finalize callback: any thread, at any time; the tables are handled at the next call here
        self._orphans.append(tables)

    def _collect(self) -> None:
        while self._written:  # each was referenced while it waited for the writer
            self._unref(*self._written.pop())
        while self._orphans:
            self._drop_tables(self._orphans.pop())
            if self.state_bytes:
                self.used -= self.state_bytes

    def _drop_tables(self, tables: list[list[int]]) -> None:
        for gi, t in enumerate(tables):
            for page in reversed(t):  # the tail first: kept pages of one sequence go oldest-last
                if page >= 0:
                    self._unref(gi, page)
            t.clear()

    def truncate(self, seq: SequenceState, n: int, *, recurrent_checked: bool = False) -> None:
        """Keep seq's first n positions (see SequenceState.truncate); recurrent_checked: its recurrent
        states were put back to n already (SequenceState.rewind)."""
        if not 0 <= n <= seq.n:
            raise ClutorError(f"cannot truncate a sequence of {seq.n} positions to {n}")
        if seq.rs is not None and not recurrent_checked and n not in (0, seq.n):
            raise ClutorError(f"cannot cut a sequence with recurrent layers back to {n} positions: their state "
                              f"has absorbed all {seq.n} (rewind to a checkpoint instead: seq.reusable(n))")
        keep = -(-n // PAGE)
        for gi, g in enumerate(self.groups):
            t = seq.tables[gi]
            if g.window and n and any(p < 0 for p in t[max(0, n - g.window) // PAGE : keep]):
                raise ClutorError(f"cannot truncate to {n}: the sliding-window layers gave back the pages of "
                                  f"positions before {seq.n - g.window}")
            for page in reversed(t[keep:]):
                if page >= 0:
                    self._unref(gi, page)
            del t[keep:]
        if n == 0 and seq.rs is not None:
            seq.rs.restore(0)
        seq.commit(n)

    # -- pages for a step --------------------------------------------------------------------------
    def reserve(self, seq: SequenceState, upto: int) -> list[tuple[int, int, int, int]]:
        """Pages so that seq can write positions seq.n .. upto - 1, all or none: a page seq shares (or
        has published further than seq.n) is first copied (copy-on-write). Returns the copies the step
        must make first, (group, source page, destination page, positions); the source stays pinned
        until ``done(copies)``. NoRoom when the budget cannot hold them."""
        self._collect()
        if upto > seq.n_ctx:
            raise ClutorError(f"context full: {upto} positions > n_ctx {seq.n_ctx}")
        need: list[tuple[int, int, int | None]] = []  # (group, page index, copy-on-write source)
        first, off = seq.n // PAGE, seq.n % PAGE
        last = (upto - 1) // PAGE
        for gi, g in enumerate(self.groups):
            t = seq.tables[gi]
            for i in range(first, last + 1):
                page = t[i] if i < len(t) else -1
                if page < 0:
                    need.append((gi, i, None))
                elif i == first and off and (g.refs[page] > 1 or g.filled[page] > off):
                    need.append((gi, i, page))
        if not need:
            return []
        self._charge(sum(self.groups[gi].page_bytes for gi, _, _ in need))
        copies = []
        for gi, i, src in need:
            page = self._alloc(gi)
            t = seq.tables[gi]
            if i >= len(t):
                t.extend([-1] * (i + 1 - len(t)))
            t[i] = page
            if src is not None:
                copies.append((gi, src, page, off))  # the source's ref moves to the copy, released by done()
        return copies

    def done(self, copies: Sequence[tuple[int, int, int, int]]) -> None:
        """The step that made these copies ran: unpin their sources."""
        for gi, src, _, _ in copies:
            self._unref(gi, src)
        self._trim()

    def copy_pages(self, copies: Sequence[tuple[int, int, int, int]]) -> None:
        """Compute thread, before a step's first layer: each copy's first positions into its new page."""
        for gi, src, dst, n in copies:
            g = self.groups[gi]
            g.data[dst, :, :, :n] = g.data[src, :, :, :n]
            if g.scales is not None:
                g.scales[dst, :, :, :n] = g.scales[src, :, :, :n]

    def trim_window(self, seq: SequenceState) -> None:
        """Give back the pages sliding-window groups no longer need: those wholly behind the window of
        the next position (they stay kept for reuse where published)."""
        for gi, g in enumerate(self.groups):
            if not g.window:
                continue
            t = seq.tables[gi]
            behind = max(0, seq.n - g.window + 1) // PAGE  # pages 0 .. behind - 1 hold no visible position
            for i in range(min(behind, len(t))):
                if t[i] >= 0:
                    self._unref(gi, t[i])
                    t[i] = -1

    # -- publishing and matching ------------------------------------------------------------------
    def chain_keys(self, tokens: Sequence[int], n_pages: int) -> list[bytes]:
        """Content keys of the first n_pages full pages of tokens."""
        keys, k = [], ROOT
        a = np.asarray(tokens[: n_pages * PAGE], dtype="<i4")
        for i in range(n_pages):
            k = _key(k, a[i * PAGE : (i + 1) * PAGE])
            keys.append(k)
        return keys

    def publish(self, seq: SequenceState, tokens: Sequence[int], keys: list[bytes]) -> None:
        """seq's computed positions (tokens = the ids at positions 0 .. seq.n - 1) become reusable:
        ``keys`` is seq's list of chain keys, extended here to its full pages."""
        n = seq.n
        if len(tokens) != n:
            raise ClutorError(f"publish: {len(tokens)} tokens for a sequence of {n} positions")
        n_full = n // PAGE
        a = None
        if len(keys) < n_full:
            a = np.asarray(tokens, dtype="<i4")
            k = keys[-1] if keys else ROOT
            for i in range(len(keys), n_full):
                k = _key(k, a[i * PAGE : (i + 1) * PAGE])
                keys.append(k)
        for gi, g in enumerate(self.groups):
            t = seq.tables[gi]
            for i in range(min(len(t), -(-n // PAGE))):
                page = t[i]
                filled = min(PAGE, n - i * PAGE)
                if page < 0 or g.filled[page] >= filled:
                    continue
                if a is None:
                    a = np.asarray(tokens, dtype="<i4")
                parent = keys[i - 1] if i else ROOT
                self._publish_page(g, page, parent, a[i * PAGE : i * PAGE + filled])
                if filled == PAGE and self.disk is not None:
                    self._spill(gi, page, parent, keys[i], a[i * PAGE : (i + 1) * PAGE])

    def _publish_page(self, g: _Group, page: int, parent: bytes, tokens: np.ndarray) -> None:
        if g.filled[page] and g.parent[page] != parent:
            return  # published under another chain (should not happen: writes past it copy first)
        entries = g.entries[page] or []
        for k in range(g.filled[page] + 1, len(tokens) + 1):
            key = _key(parent, tokens[:k])
            g.by_prefix.setdefault(key, page)
            if g.by_prefix[key] == page:
                entries.append(key)
        g.entries[page] = entries
        g.parent[page] = parent
        g.filled[page] = len(tokens)

    def _spill(self, gi: int, page: int, parent: bytes, key: bytes, tokens: np.ndarray) -> None:
        """A full page just published: to the disk store, unless it has it. The page is referenced until
        the writer is done with it (its contents cannot change meanwhile: a published page is written
        to only after a copy), so it is written even when its sequence ends first."""
        g = self.groups[gi]
        self._ref(gi, page)
        if not self.disk.spill(gi, key, parent, tokens, g.data[page], g.scales[page] if g.scales is not None else None,
                               lambda: self._written.append((gi, page))):
            self._unref(gi, page)

    # -- the disk store's pages ------------------------------------------------------------------
    def disk_extends(self, keys: Sequence[bytes], start: int) -> bool:
        """Whether the disk store holds the full-context groups' page ``start`` of this chain."""
        if self.disk is None or start >= len(keys) or self.recurrent:
            return False
        return all(self.disk.has(gi, keys[start]) for gi, g in enumerate(self.groups) if not g.window) and any(
            not g.window for g in self.groups)

    def take_prefix(self, keys: Sequence[bytes]) -> tuple[list[tuple[int, int]], list["Load"]]:
        """Before a prompt of these full pages' chain keys is matched: the pages the pool holds of its
        longest prefix held here or on disk are pinned (so loading the rest cannot give them up), and
        a page is taken for each one the disk holds, to load into (see take_pages). Window groups:
        only the pages of the last window."""
        full = [gi for gi, g in enumerate(self.groups) if not g.window]
        n = 0
        while n < len(keys) and all(self._holds(gi, keys[n]) or self.disk.has(gi, keys[n]) for gi in full):
            n += 1
        want = []
        for i in range(n):
            for gi, g in enumerate(self.groups):
                if g.window and i < max(0, n * PAGE - g.window + 1) // PAGE:
                    continue
                if self._holds(gi, keys[i]) or self.disk.has(gi, keys[i]):
                    want.append((gi, keys[i], keys[i - 1] if i else ROOT))
        pins, loads, _ = self.take_pages(want)
        return pins, loads

    def take_pages(self, want: Sequence[tuple[int, bytes, bytes]]
                   ) -> tuple[list[tuple[int, int]], list["Load"], set[tuple[int, bytes]]]:
        """For each (group, chain key, parent key): the page the pool holds is pinned, or a page is
        taken (allocated, unpublished) to load it into. Returns (pins: every (group, page) referenced
        here, the taken ones included; loads; the (group, key) pairs held already). Stops where the
        budget has no room for a taken page. Give the loads to ``settle``, the pins to ``unpin``."""
        from .kv_pages import Load

        pins: list[tuple[int, int]] = []
        loads: list[Load] = []
        held: set[tuple[int, bytes]] = set()
        for gi, key, parent in want:
            g = self.groups[gi]
            if self._holds(gi, key):
                page = g.by_prefix[key]
                self._ref(gi, page)
                pins.append((gi, page))
                held.add((gi, key))
                continue
            try:
                self._charge(g.page_bytes)
            except NoRoom:
                break
            page = self._alloc(gi)
            pins.append((gi, page))
            loads.append(Load(gi, key, parent, g.data[page], g.scales[page] if g.scales is not None else None, page))
        return pins, loads, held

    def hold_chain(self, keys: Sequence[bytes]) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, str | None]]]:
        """The pages of the longest prefix of this chain the pool or the disk store holds in every
        full-context group, for a copy to be made: (pins, [(group, page index, pool page, or -1 and the
        disk store's file)]). Window groups' pages are listed where held."""
        pins: list[tuple[int, int]] = []
        out: list[tuple[int, int, int, str | None]] = []
        for i, key in enumerate(keys):
            row = []
            for gi, g in enumerate(self.groups):
                if self._holds(gi, key):
                    row.append((gi, i, g.by_prefix[key], None))
                elif self.disk is not None and self.disk.record_path(gi, key):
                    row.append((gi, i, -1, self.disk.record_path(gi, key)))
                elif not g.window:
                    return pins, out
            for gi, _, page, _ in row:
                if page >= 0:
                    self._ref(gi, page)
                    pins.append((gi, page))
            out += row
        return pins, out

    def _holds(self, gi: int, key: bytes) -> bool:
        g = self.groups[gi]
        page = g.by_prefix.get(key, -1)
        return page >= 0 and g.filled[page] == PAGE

    def settle(self, load: "Load", tokens: np.ndarray | None) -> None:
        """A taken page's load is over: published (tokens: what it holds) unless it failed or the pool
        got the page meanwhile (it stays pinned until ``unpin``, then is given back)."""
        if tokens is not None and not self._holds(load.gi, load.key):
            self._publish_page(self.groups[load.gi], load.page, load.parent, tokens)

    def unpin(self, pins: Sequence[tuple[int, int]]) -> None:
        for gi, page in pins:
            self._unref(gi, page)
        self._trim()

    def match(self, tokens: Sequence[int], limit: int, *, keys: list[bytes] | None = None) -> Match:
        """The longest prefix of tokens[:limit] whose positions published pages hold in every group
        (window groups: the pages of its last window), and, with recurrent layers, for which a
        checkpoint exists. ``keys``: tokens' chain keys if already known. Takes no reference."""
        self._collect()
        n_groups = len(self.groups)
        empty = Match(0, [[] for _ in range(n_groups)], [None] * n_groups)
        if limit <= 0 or not self.groups:
            return empty
        n_full = limit // PAGE
        keys = (keys or [])[:n_full]
        if len(keys) < n_full:
            keys = keys + self.chain_keys(tokens, n_full)[len(keys):]
        a = np.asarray(tokens[:limit], dtype="<i4")
        # full pages held by every group (a window group needs only its window's; settled below)
        full = [g for g in self.groups if not g.window]
        n_pages = n_full
        for g in full:
            i = 0
            while i < n_pages and g.by_prefix.get(keys[i], -1) >= 0 and g.filled[g.by_prefix[keys[i]]] == PAGE:
                i += 1
            n_pages = i
        m = n_pages * PAGE
        # the tail: the longest run after the last full page that some published page of every group starts with
        if m < limit:
            parent = keys[n_pages - 1] if n_pages else ROOT
            rest = a[m : min(limit, m + PAGE - 1)]
            for k in range(len(rest), 0, -1):
                if self._tail(parent, rest[:k]) is not None:
                    m += k
                    break
        ckpt = None
        while True:  # settle m: the window groups' pages, then a checkpoint of the recurrent states
            m0 = m = self._window_cover(keys, a, m)
            if self.recurrent:
                m, ckpt = self._checkpoint_at(keys, a, m)
            if m == m0:
                break
        if m == 0:
            return empty
        tails: list[int | None] = [None] * n_groups
        if m % PAGE:
            i = m // PAGE
            tails = self._tail(keys[i - 1] if i else ROOT, a[i * PAGE : m])
        pages = []
        for gi, g in enumerate(self.groups):
            row = []
            lo = max(0, m - g.window + 1) // PAGE if g.window else 0
            for i in range(m // PAGE):
                row.append(g.by_prefix[keys[i]] if i >= lo else -1)
            pages.append(row)
        return Match(m, pages, tails, ckpt)

    def _tail(self, parent: bytes, run: np.ndarray) -> list[int] | None:
        """Per group, a published page whose positions start with run after parent's chain (None: a
        group has none)."""
        key = _key(parent, run)
        found = [g.by_prefix.get(key, -1) for g in self.groups]
        if all(p >= 0 and g.filled[p] >= len(run) for g, p in zip(self.groups, found)):
            return found
        return None

    def _window_cover(self, keys: list[bytes], a: np.ndarray, m: int) -> int:
        """m, lowered until every window group holds the pages of the window before it (and, inside a
        page, the tail in every group)."""
        while m > 0:
            i = m // PAGE
            if m % PAGE and self._tail(keys[i - 1] if i else ROOT, a[i * PAGE : m]) is None:
                m = i * PAGE
                continue
            short = None
            for g in self.groups:
                if not g.window:
                    continue
                lo = max(0, m - g.window + 1) // PAGE
                for j in range(lo, i):
                    p = g.by_prefix.get(keys[j], -1)
                    if p < 0 or g.filled[p] < PAGE:
                        short = j if short is None else min(short, j)
                        break
            if short is None:
                return m
            m = short * PAGE
        return 0

    def _checkpoint_at(self, keys: list[bytes], a: np.ndarray, m: int) -> tuple[int, tuple | None]:
        """The largest position <= m along this token chain with a published checkpoint of the
        recurrent states, and that checkpoint. Checkpoints are found page by page from the last: each
        page's chain key lists the offsets in it that have one."""
        for i in range((m - 1) // PAGE, -1, -1):
            parent = keys[i - 1] if i else ROOT
            for k in sorted(self._ckpt_offsets.get(parent, ()), reverse=True):
                p = i * PAGE + k
                if p > m:
                    continue
                key = keys[i] if k == PAGE else _key(parent, a[i * PAGE : p])
                hit = self._ckpts.get(key)
                if hit is not None:
                    self._lru.move_to_end(("c", key))
                    return p, hit[0]
        return 0, None

    def adopt(self, seq: SequenceState, match: Match) -> list[tuple[int, int, int, int]]:
        """Map a match into a fresh sequence: its full pages by reference, its tail page copied.
        Returns the copies its first step makes (see reserve). A tail that finds no room is left out
        (and then, with recurrent layers, the whole match: their checkpoint is the tail's)."""
        if seq.n or any(seq.tables):
            raise ClutorError("adopt: the sequence is not fresh")
        m = match.n
        if m == 0:
            return []
        for gi in range(len(self.groups)):  # referenced first: making room for the tail cannot give them up
            for p in match.pages[gi][: m // PAGE]:
                if p >= 0:
                    self._ref(gi, p)
        copies: list[tuple[int, int, int, int]] = []
        if m % PAGE:
            srcs = [(gi, p) for gi, p in enumerate(match.tails)]
            for gi, p in srcs:
                self._ref(gi, p)  # pinned until the copy is made (done())
            try:
                self._charge(sum(self.groups[gi].page_bytes for gi, _ in srcs))
                copies = [(gi, p, self._alloc(gi), m % PAGE) for gi, p in srcs]
            except NoRoom:
                for gi, p in srcs:
                    self._unref(gi, p)
                m -= m % PAGE
                if self.recurrent:
                    for gi in range(len(self.groups)):
                        for p in match.pages[gi][: m // PAGE]:
                            if p >= 0:
                                self._unref(gi, p)
                    return []
        for gi in range(len(self.groups)):
            t = seq.tables[gi]
            t.extend(match.pages[gi][: m // PAGE])
        for gi, _, dst, _ in copies:
            seq.tables[gi].append(dst)
        if match.checkpoint is not None:
            conv, ssm = match.checkpoint
            for l in seq.rs.conv:
                seq.rs.conv[l][...] = conv[l]
                seq.rs.ssm[l][...] = ssm[l]
        seq.commit(m)
        return copies

    def save_checkpoint(self, seq: SequenceState, tokens: Sequence[int], keys: list[bytes]) -> None:
        """Keep seq's recurrent states at its position seq.n (tokens: its ids so far, keys: their full
        pages' chain keys) for prefix reuse, under the key of that position."""
        if seq.rs is None or seq.n == 0:
            return
        i = (seq.n - 1) // PAGE
        k = seq.n - i * PAGE  # 1 .. PAGE: the position's offset in page i (PAGE: the page's end)
        parent = keys[i - 1] if i else ROOT
        key = keys[i] if k == PAGE and len(keys) > i else _key(parent, np.asarray(tokens[i * PAGE : seq.n], dtype="<i4"))
        if key in self._ckpts:
            self._lru.move_to_end(("c", key))
            return
        nbytes = self.state_bytes
        if nbytes > self.prefix_budget:
            return
        try:
            self._charge(nbytes)
        except NoRoom:
            return
        rs = seq.rs
        self._ckpts[key] = (({l: a.copy() for l, a in rs.conv.items()}, {l: a.copy() for l, a in rs.ssm.items()}),
                            nbytes, parent, k)
        offsets = self._ckpt_offsets.setdefault(parent, {})
        offsets[k] = offsets.get(k, 0) + 1
        self._lru[("c", key)] = None
        self.cached += nbytes
        self._bound_cache()

    # -- internals -------------------------------------------------------------------------------------
    def _charge(self, nbytes: int) -> None:
        """Room for nbytes more in use, giving up kept pages least recently used first; NoRoom (and
        nothing given up) if even all of them would not make it."""
        if self.used + nbytes - self.cached > self.budget:
            raise NoRoom(nbytes, self.room)
        while self.used + nbytes > self.budget:
            self._evict(next(iter(self._lru)))
        self.used += nbytes

    def _alloc(self, gi: int) -> int:
        """A free page of group gi; its bytes were charged by the caller."""
        g = self.groups[gi]
        page = heapq.heappop(g.free)
        g.refs[page] = 1
        g.high = max(g.high, page + 1)
        return page

    def _ref(self, gi: int, page: int) -> None:
        g = self.groups[gi]
        if g.refs[page] == 0:  # kept for reuse: live again (its bytes stay in use, no longer cached)
            del self._lru[(gi, page)]
            self.cached -= g.page_bytes
        g.refs[page] += 1

    def _unref(self, gi: int, page: int) -> None:
        g = self.groups[gi]
        g.refs[page] -= 1
        if g.refs[page] > 0:
            return
        if g.filled[page] and g.page_bytes <= self.prefix_budget:
            self._lru[(gi, page)] = None  # kept for reuse, most recently used
            self.cached += g.page_bytes
            self._bound_cache()
        else:
            self._free(gi, page)

    def _bound_cache(self) -> None:
        while self.cached > self.prefix_budget and self._lru:
            self._evict(next(iter(self._lru)))

    def _evict(self, victim: tuple) -> None:
        del self._lru[victim]
        self.evictions += 1
        if victim[0] == "c":
            _, nbytes, parent, k = self._ckpts.pop(victim[1])
            offsets = self._ckpt_offsets[parent]  # offset -> checkpoints there (of different tokens)
            offsets[k] -= 1
            if not offsets[k]:
                del offsets[k]
                if not offsets:
                    del self._ckpt_offsets[parent]
            self.used -= nbytes
            self.cached -= nbytes
            return
        gi, page = victim
        self.cached -= self.groups[gi].page_bytes
        self._free(gi, page)

    def _free(self, gi: int, page: int) -> None:
        g = self.groups[gi]
        for key in g.entries[page] or ():
            if g.by_prefix.get(key) == page:
                del g.by_prefix[key]
        g.entries[page] = None
        g.filled[page] = 0
        g.parent[page] = None
        g.refs[page] = 0
        heapq.heappush(g.free, page)
        self.used -= g.page_bytes

    def _trim(self) -> None:
        """With several page groups, give free pages at the top of a group's memory back to the OS
        when the groups together hold more than the budget resident."""
        if len(self.groups) < 2 or sum(g.high * g.page_bytes for g in self.groups) <= self.budget:
            return
        for g in self.groups:
            free = set(g.free)
            top = g.high
            while top > 0 and (top - 1) in free:
                top -= 1
            if top == g.high:
                continue
            for arr, m in zip((g.data, g.scales), g._maps):
                per = arr[0].nbytes  # one page's bytes in this array
                lo, hi = -(-top * per // mmap.PAGESIZE) * mmap.PAGESIZE, g.high * per // mmap.PAGESIZE * mmap.PAGESIZE
                if hi > lo and hasattr(mmap, "MADV_DONTNEED"):
                    m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            g.high = top

    def close(self) -> None:
        if getattr(self, "disk", None) is not None:
            self.disk.close()  # its writer reads pool pages: stopped before they are unmapped
        for g in self.groups:
            g.close()
        self.groups = []
        getattr(self, "_ckpts", {}).clear()
        getattr(self, "_lru", {}).clear()
