"""A StepPlan while it runs: what the architectures see of the step (compute thread only).

An architecture's attention (clutor.model.arch) computes q, k, v for all R rows of the step at once
and leaves the rest to the step:

    q, k = step.rope(rope, q), step.rope(rope, k)   # each row at its own position
    o = step.attend(l, q, k, v, scale)              # k, v into each sequence's pages, then attention

or, for rotary attention over every earlier position (no window, no sinks, no latent rows), both in
two compiled passes that read the pages in place (clutor.model.kernels.paged):

    o = step.attend_rotary(l, rope, q, k, v, scale)

A recurrent layer (Gated DeltaNet, Mamba-2) reads and updates each segment's own state in place:
``seg.seq.rs.conv[l]`` and ``seg.seq.rs.ssm[l]`` (clutor.model.recurrent.RecurrentState, at position
``seg.p0`` when the step starts); a decode step stacks the one-token segments' states to batch its
update (recurrent.stacked).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .kernels import paged
from .kernels.dsa import attend_selected
from .kernels.kvpages import gather_f16
from .kernels.rowwise import attend, threads_for
from .kv import PAGE

if TYPE_CHECKING:
    from .kv import KVPool
    from .layers import Rope
    from .plan import Segment, StepPlan

__all__ = ["Step"]

_Q8 = 32


class Step:
    def __init__(self, plan: "StepPlan", pool: "KVPool"):
        self.plan = plan
        self.pool = pool
        self.segments = plan.segments
        self.failed: dict[int, BaseException] = {}  # id(segment) -> why it failed (the rest go on)
        self.accounting = False  # the runner charges the segments' ledgers with this step's expert I/O
        self._angles: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._slots: list[tuple[np.ndarray, np.ndarray]] = []  # per page group: each row's (page, offset)
        self._rotary: dict = {}  # page group -> what attend_rotary reads of it this step (_rotary_group)
        self.carry: dict = {}  # what a layer hands a later layer of this step (GLM-5's shared key selection)
        self.slot_outputs = None  # the layer's routed experts' outputs being filled (runner: SlotOutputs)
        self._tiles: list[tuple[int, int, "Step"]] | None = None

    def tiles(self, rows: int) -> list[tuple[int, int, "Step"]]:
        """The step's rows in tiles of at most ``rows``, each (first row, end row, its own Step): a long
        step's attention runs a tile at a time, so its scores and temporaries stay a tile's size and
        the work between two of the runner's pauses stays bounded. A tile's rows see the keys the
        earlier tiles of the same layer wrote. The same Steps serve every layer (their carry too).
        One tile (the step itself) where the step is short, or where the pool holds recurrent states
        (a recurrent layer's state advances a whole step at a time)."""
        if self._tiles is None:
            R = self.plan.rows
            if R <= rows or self.pool.recurrent:
                self._tiles = [(0, R, self)]
            else:
                self._tiles = []
                for a in range(0, R, rows):
                    t = Step(self.plan.part(a, min(R, a + rows)), self.pool)
                    t.prepare()
                    self._tiles.append((a, min(R, a + rows), t))
        return self._tiles

    def prepare(self) -> None:
        """Before the first layer: the plan's page copies, and where each row's KV goes."""
        plan, pool = self.plan, self.pool
        if plan.copies:
            pool.copy_pages(plan.copies)
        offs = plan.pos % PAGE  # [R]
        idx = plan.pos // PAGE  # [R] page index within each row's sequence
        for gi in range(len(pool.groups)):
            tables = [s.seq.tables[gi] for s in self.segments]
            if len(tables) == 1:
                pages = np.asarray(tables[0], dtype=np.int64)[idx]
            else:
                pages = np.fromiter((tables[si][i] for si, i in zip(plan.seg_of_row.tolist(), idx.tolist())),
                                    np.int64, len(idx))
            self._slots.append((pages, offs))

    def commit(self) -> None:
        """The step's positions count as filled: only once every layer has written them."""
        for seg in self.segments:
            seg.seq.commit(seg.p0 + seg.n)

    def fail_rows(self, rows: np.ndarray, err: BaseException) -> None:
        """Fail the segments owning these rows (their outputs are dropped; the step goes on)."""
        for i in np.unique(self.plan.seg_of_row[rows]).tolist():
            self.failed.setdefault(id(self.segments[i]), err)

    # -- what an attention layer calls ------------------------------------------------------------
    def rope(self, rope: "Rope", x: np.ndarray) -> np.ndarray:
        """x [R, heads, d] rotated, row r at position plan.pos[r]; the angles computed once per step."""
        cs = self._angles.get(id(rope))
        if cs is None:
            cs = self._angles[id(rope)] = rope.angles_at(self.plan.pos)
        return rope.rotate(x, *cs)

    def attend_rotary(self, l: int, rope: "Rope", q: np.ndarray, k: np.ndarray, v: np.ndarray,
                      scale: float) -> np.ndarray:
        """attend(l, rope(q), rope(k), v, scale) for full-context layers: q [R, H, dk], k [R, Hkv, dk]
        rotated and k, v [R, Hkv, dv] written in one pass, then each row attends over its sequence's
        pages as they are stored -> [R, H * dv]."""
        gi, li = self.pool.group_of(l)
        at = self._rotary.get(gi)
        if at is None:
            at = self._rotary[gi] = self._rotary_group(gi)
        if at is False:  # a window or latent rows: the general way
            return self.attend(l, self.rope(rope, q), self.rope(rope, k), v, scale)
        g, store, pages, offs, tab, starts, work = at
        cs = self._angles.get(id(rope))
        if cs is None:
            cs = self._angles[id(rope)] = rope.angles_at(self.plan.pos)
        qr = paged.rope_write(q, k, v, cs[0], cs[1], rope.style == "neox", pages, offs, li, store)
        threads_for(q.shape[1] * work)
        plan = self.plan
        return paged.attend_pages(qr, tab, plan.seg_of_row, plan.pos, li, store, g.k_dim, g.v_dim, scale, starts)

    def _rotary_group(self, gi: int):
        """What attend_rotary reads of page group gi, the same in every layer of this step: (group,
        its storage, the rows' (page, offset), the segments' page table, the rows' attention tiles
        (paged.tiles), multiply-adds per query head) or False where the group is a window's or holds
        latent rows."""
        g = self.pool.groups[gi]
        if g.window or g.latent:
            return False
        pages, offs = self._slots[gi]
        work = len(self.plan.pos) * (int(self.plan.pos.max()) + 1) * (g.k_dim + g.v_dim)
        return (g, paged.storage(g.data, g.scales), pages, offs, self._table(gi), paged.tiles(self.plan.seg_of_row),
                work)

    def _table(self, gi: int) -> np.ndarray:
        """Each segment's pages of group gi through its last position in this step: int64 [S, most pages]."""
        need = [-(-(s.p0 + s.n) // PAGE) for s in self.segments]
        tab = np.zeros((len(need), max(need)), np.int64)
        for i, (s, n) in enumerate(zip(self.segments, need)):
            tab[i, :n] = s.seq.tables[gi][:n]
        return tab

    def attend(self, l: int, q: np.ndarray, k: np.ndarray, v: np.ndarray | None, scale: float, *,
               window: int = 0, sinks: np.ndarray | None = None, kernel=None, chunk: int = 0,
               select=None) -> np.ndarray:
        """Write k [R, Hkv, dk] and v [R, Hkv, dv] (None: the values are k's first columns, MLA's
        latent) at every row's position, then causal attention of q [R, H, dk] for each segment
        over its own sequence -> [R, H * dv]. kernel: an attend() of rowwise.attend's signature
        summing in another order (Gemma 4's: kernels.ggmlmath.attend); None: rowwise.attend.
        chunk > 0 (a multiple of PAGE): a query at i sees only the keys of its own chunk, positions
        from (i // chunk) * chunk (Llama 4's chunked layers).
        select: sparse attention over a latent cache (DSA: GLM-5, DeepSeek-V3.2): select(seg, K) -> bool
        [seg.n, N], the keys each of the segment's rows attends (of its causal ones), from the
        segment's stored rows K [1, N, width] (positions 0 .. N - 1); q then reads K's first dk columns."""
        gi, li = self.pool.group_of(l)
        g = self.pool.groups[gi]
        pages, offs = self._slots[gi]
        _write(g, li, pages, offs, k, v)
        outs = []
        for s in self.segments:
            if chunk:  # each run of the segment's rows within one chunk, over that chunk's keys
                for p0 in _chunk_starts(s.p0, s.n, chunk):
                    end = min(s.p0 + s.n, (p0 // chunk + 1) * chunk)
                    lo = (p0 // chunk) * chunk // PAGE
                    K, V = _gather(g, li, s.seq.tables[gi][lo : -(-end // PAGE)], end - lo * PAGE)
                    outs.append((kernel or attend)(q[s.rows][p0 - s.p0 : end - s.p0], K, V, p0, lo * PAGE, scale,
                                                   sinks=sinks))
                continue
            end = s.p0 + s.n
            lo = max(0, s.p0 - window + 1) // PAGE if window else 0  # keys no query of this step sees are not read
            K, V = _gather(g, li, s.seq.tables[gi][lo : -(-end // PAGE)], end - lo * PAGE)
            if select is not None:
                outs.append(attend_selected(q[s.rows], K, V, s.p0, scale, select(s, K)))
                continue
            # each (row, head) alone, in a fixed order: a row's result is the same in any batch
            outs.append((kernel or attend)(q[s.rows], K, V, s.p0, lo * PAGE, scale, window=window, sinks=sinks))
        return outs[0] if len(outs) == 1 else np.concatenate(outs)


def _chunk_starts(p0: int, n: int, chunk: int) -> list[int]:
    """The first position of each chunk that positions p0 .. p0 + n - 1 touch (p0 itself first)."""
    return [p0] + list(range((p0 // chunk + 1) * chunk, p0 + n, chunk))


def _write(g, li: int, pages: np.ndarray, offs: np.ndarray, k: np.ndarray, v: np.ndarray | None) -> None:
    """Rows' keys (and values) into their pages: data[page, layer, :, offset] = k | v."""
    row = k if v is None else np.concatenate([k, v], axis=-1)  # [R, H, width]
    if g.scales is None:
        g.data[pages, li, :, offs] = row  # cast to the pool's float type (f16: rounded to nearest)
        return
    # q8_0 as llama.cpp quantises a row: per 32 values d = max|x| / 127, q = round(x / d), d kept in f16
    R, H, W = row.shape
    blk = row.reshape(R, H, W // _Q8, _Q8)
    d = np.abs(blk).max(axis=-1) / 127.0  # [R, H, W/32]
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.rint(blk * inv[..., None])
    g.data[pages, li, :, offs] = q.reshape(R, H, W).astype(np.int8)
    g.scales[pages, li, :, offs] = d.astype(np.float16)


def _gather(g, li: int, pages: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first n positions of these pages of layer li as float32 K [Hkv, n, dk], V [Hkv, n, dv]."""
    if g.scales is None and g.data.dtype == np.float16:
        full = gather_f16(g.data, li, np.asarray(pages, np.int64), n)  # [H, n, width], one pass
    elif g.scales is None:
        blk = g.data[pages, li]  # [n_pages, H, PAGE, width] (a copy)
        np_, H, P, W = blk.shape
        full = blk.transpose(1, 0, 2, 3).reshape(H, np_ * P, W)[:, :n]
        if full.dtype != np.float32:
            full = full.astype(np.float32)
    else:
        blk = g.data[pages, li]  # [n_pages, H, PAGE, width] (a copy)
        np_, H, P, W = blk.shape
        sc = g.scales[pages, li].astype(np.float32)  # [n_pages, H, PAGE, width / 32]
        vals = blk.reshape(np_, H, P, W // _Q8, _Q8).astype(np.float32) * sc[..., None]
        full = vals.reshape(np_, H, P, W).transpose(1, 0, 2, 3).reshape(H, np_ * P, W)[:, :n]
    if g.latent:
        return full, full[..., : g.v_dim]
    return full[..., : g.k_dim], full[..., g.k_dim :]
