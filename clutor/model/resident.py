"""A step's routed experts through compiled calls: in memory (io="memory") five a layer, streamed five a group.

    resident = ResidentExperts.of(source, arch, layers, cfg, settings)   # None unless an InMemoryExperts
    table = resident.table(l, layer)            # layer l's (the source's layer `layer`), or None
    if table is not None and table.fits(sel, w):
        routed = table.sum(h, sel, w)           # [R, D]: each row's experts weighted, summed in slot order

The runner's general path (Runner._experts_out, then _moe_add) makes a Job per expert and part, gathers
rows and sums slots with numpy: ~0.4 ms of Python a layer in a one-row decode step whose four 256 x 256
Q8_0 experts compute in ~0.1 (real-olmoe-q8_0). In memory an expert never moves while the source is
open, so each layer's expert addresses are one table, made (and checked) once; a step is then
kernels.routing.route_jobs (grouping and job rows), the gate | up launch, the architecture's own
activation (numpy, as the general path computes it), the down launch and routing.slot_sum: the same
bits as the general path (kernels/routing.py says why).

A streamed source's experts are cache slots, other ones each step, and arrive in groups: StreamedExperts
takes each group through the same compiled products (ExpertKernels, one per layer), from the group's
views' addresses (checked and taken once per view object), writing each (row, slot) pair's weighted
output into the step's SlotOutputs [R * K, D]; _moe_add sums those slots as slot_sum does (same bits as
io="memory").

    acc = streamed.group(l, h, sel, w, views, acc)   # None: the general path computes this group
    routed = acc.sum()                               # [R, D], once the layer's groups are in

The general path keeps what this does not take: experts with biases (gpt-oss), products matmul_jobs
runs otherwise (F32, F16 / BF16 in q8 mode, more tokens than the BLAS threshold), router weights not
float32.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ClutorError
from . import kernels
from .arch.common import Arch
from .kernels.drivers import address as _address
from .kernels.routing import (PART_COL, PART_QT, PART_RB, PART_ROWS, negated_gate, put_slots, route_group, route_jobs,
                              slot_sum, sum_slots, swiglu_from_exp)
from .layers import silu
from .profile import kernel_done
from .source import InMemoryExperts

if TYPE_CHECKING:
    from .config import ModelConfig
    from .kernel_settings import KernelSettings

__all__ = ["ExpertKernels", "ResidentExperts", "ResidentLayer", "SlotOutputs", "StreamedExperts"]

_UNSET = object()


class ResidentExperts:
    """Every MoE layer's ResidentLayer, each made on its first step (None where the general path computes)."""

    def __init__(self, source: InMemoryExperts, arch: "Arch", layers, cfg: "ModelConfig", settings: "KernelSettings"):
        self._source, self._arch, self._layers, self._cfg, self._settings = source, arch, layers, cfg, settings
        self._tables: dict[int, ResidentLayer | None] = {}

    @classmethod
    def of(cls, source, arch: "Arch", layers, cfg: "ModelConfig", settings: "KernelSettings") -> "ResidentExperts | None":
        return cls(source, arch, layers, cfg, settings) if isinstance(source, InMemoryExperts) else None

    def table(self, l: int, layer: int) -> "ResidentLayer | None":
        """Model layer l's table (the source's MoE layer index `layer`), or None: the general path."""
        t = self._tables.get(l, _UNSET)
        if t is _UNSET:
            t = self._tables[l] = ResidentLayer.build(self._source, layer, self._arch, self._layers[l], self._cfg,
                                                      self._settings)
        return t


class ExpertKernels:
    """One MoE layer's routed-expert products as the compiled path runs them, all but the addresses:
    each part's (type, row bytes, rows, output column) parts int64 [P, 4] (P parts: gate, up, down;
    up, down ungated), the activation blocks, the thread rule's work, the output scale. Shared by the
    in-memory table (addresses made once) and the streamed groups (addresses of each group's views)."""

    def __init__(self, arch: "Arch", gated: bool, parts: np.ndarray, types: tuple, blocks: tuple[int, int],
                 work: tuple[float, float], max_tok: int, scale: np.ndarray, D: int, F: int,
                 settings: "KernelSettings"):
        self._arch = arch
        self.parts, self._types = parts, types  # [P, 4]; each part's (type, rows, columns)
        self._block_gu, self._block_dn = blocks  # activation blocks (kernels.array_block) of gate | up, of down
        self._work_gu, self._work_dn = work  # weighted weight bytes of one token through an expert's gate | up, its down
        self.max_tok = max_tok  # rows a step may have (each expert's job has at most that many tokens)
        self.scale = scale  # f32 [E] each expert's output scale, or [0]: none
        self.before = bool(arch.weight_before_ffn)
        self._swiglu = type(arch).expert_act is Arch.expert_act and gated  # the default activation
        self._gated = gated
        self.D, self.F = D, F
        self._settings = settings

    @classmethod
    def build(cls, layout, arch: "Arch", lw, cfg: "ModelConfig", settings: "KernelSettings",
              view) -> "ExpertKernels | None":
        """From the source's layout and one of the layer's expert views (its parts' bytes checked), or
        None where the general path computes."""
        et = lw.experts
        D, F, E = cfg.n_embd, cfg.n_ff_exp, layout.n_experts
        gated = layout.gated
        if layout.n_parts != (3 if gated else 2):  # biases (gpt-oss): the general path adds them
            return None
        gu_types = (et.gate, et.up) if gated else (et.up,)
        blocks = (kernels.array_block(gu_types, settings), kernels.array_block((et.down,), settings))
        if None in blocks:
            return None
        scale = arch.expert_scale(lw)  # [E] or None
        if scale is None:
            scale = np.empty(0, np.float32)
        elif scale.dtype != np.float32 or scale.shape != (E,):  # the general path's y *= scale[e] rounds otherwise
            return None
        scale = np.ascontiguousarray(scale)
        # (type, rows, columns, first output column) per part: gate | up side by side in one output, then down
        shapes = [(q, F, D, F * i) for i, q in enumerate(gu_types)] + [(et.down, D, F, 0)]
        parts = np.empty((len(shapes), 4), np.int64)  # [P, 4]
        for p, (arr, (q, rows, cols, col)) in enumerate(zip(_arrays(view, gated), shapes)):
            parts[p, [PART_QT, PART_RB, PART_ROWS, PART_COL]] = (q, kernels.check_weight(arr, q, rows, cols), rows, col)
        work = (sum(kernels.work_bytes(q, rows * parts[p, PART_RB]) for p, (q, rows, _, _) in enumerate(shapes[:-1])),
                kernels.work_bytes(et.down, D * parts[-1, PART_RB]))
        max_tok = min(kernels.array_max_tokens(blocks[0], settings), kernels.array_max_tokens(blocks[1], settings))
        return cls(arch, gated, parts, tuple((q, rows, cols) for q, rows, cols, _ in shapes), blocks, work, max_tok,
                   scale, D, F, settings)

    def fits(self, sel: np.ndarray, w: np.ndarray) -> bool:
        """Whether the compiled path computes this step (else the general path): rows the drivers take
        in one job each, float32 weights (the general path multiplies in their type)."""
        return len(sel) <= self.max_tok and w.dtype == np.float32

    def addresses(self, view, out: np.ndarray) -> None:
        """view's parts' addresses into out int64 [P], after checking each is the weight parts says
        (what the drivers read without bounds checks)."""
        for p, (arr, (q, rows, cols)) in enumerate(zip(_arrays(view, self._gated), self._types)):
            kernels.check_weight(arr, q, rows, cols)
            out[p] = _address(arr)

    def products(self, xg: np.ndarray, m: int, n: int, jobs_gu: np.ndarray, jobs_dn: np.ndarray) -> np.ndarray:
        """The jobs route_jobs / route_group made (m experts, n pairs) on xg f32 [>= n, D] -> y f32 [n, D]
        each pair's down product: gate | up in one launch, the activation, down in another."""
        D, F = self.D, self.F
        P = self.parts.shape[0]
        gu = np.empty((n, (P - 1) * F), np.float32)  # [n, 2F] gate | up (ungated: [n, F] up)
        xg = xg[:n]  # the pairs' rows only: a q8 launch rounds every row of its input to int8 first
        t0 = time.perf_counter()
        kernels.run_job_array(jobs_gu[: m * (P - 1)], D, xg, gu, self._block_gu, n * self._work_gu, self._settings)
        kernel_done(t0)
        if self._swiglu:
            a = _swiglu(gu)  # [n, F]
        else:
            a = np.ascontiguousarray(self._arch.expert_act(gu, F))  # [n, F]
            if a.dtype != np.float32:
                raise ClutorError(f"{type(self._arch).__name__}.expert_act gave {a.dtype}, not float32")
        y = np.empty((n, D), np.float32)  # [n, D]
        t0 = time.perf_counter()
        kernels.run_job_array(jobs_dn[:m], F, a, y, self._block_dn, n * self._work_dn, self._settings)
        kernel_done(t0)
        return y


class ResidentLayer:
    """One layer's experts as addresses: addr int64 [E, P] with its ExpertKernels (parts [P, 4]). Holds
    the views, so the mappings stay alive as long as the addresses are used."""

    def __init__(self, source: InMemoryExperts, layer: int, k: ExpertKernels, views, addr: np.ndarray):
        self._source, self._layer, self._k, self._views = source, layer, k, views
        self.addr, self.parts = addr, k.parts  # [E, P], [P, 4]
        self.max_tok = k.max_tok

    @classmethod
    def build(cls, source: InMemoryExperts, layer: int, arch: "Arch", lw, cfg: "ModelConfig",
              settings: "KernelSettings") -> "ResidentLayer | None":
        views = source.views_now(layer, range(source.layout.n_experts))
        k = ExpertKernels.build(source.layout, arch, lw, cfg, settings, views[0])
        if k is None:
            return None
        addr = np.empty((len(views), k.parts.shape[0]), np.int64)  # [E, P]
        for e, v in enumerate(views):
            k.addresses(v, addr[e])
        return cls(source, layer, k, views, addr)

    def fits(self, sel: np.ndarray, w: np.ndarray) -> bool:
        """ExpertKernels.fits: whether sum() computes this step (else the general path)."""
        return self._k.fits(sel, w)

    def sum(self, h: np.ndarray, sel: np.ndarray, w: np.ndarray) -> np.ndarray:
        """h f32 [R, D] the experts' input, sel [R, K] each row's experts, w f32 [R, K] their weights
        -> [R, D] each row's experts' outputs, weighted, summed in slot order."""
        self._source.check(self._layer)  # before any expert page is touched (InMemoryExperts' docstring)
        k = self._k
        R, K = sel.shape
        S = R * K
        P = self.parts.shape[0]
        sel = np.ascontiguousarray(sel, np.int64)
        w = np.ascontiguousarray(w)
        h = np.ascontiguousarray(h, np.float32)
        xg = np.empty((S, k.D), np.float32)  # [S, D] each (row, slot) pair's input, grouped by expert
        wf = np.empty(S, np.float32)  # [S] its router weight
        pair = np.empty(S, np.int64)  # [S] its row * K + slot
        jobs_gu = np.empty((S * (P - 1), 7), np.int64)
        jobs_dn = np.empty((S, 7), np.int64)
        m = route_jobs(sel, w, h, k.before, self.addr, self.parts, xg, wf, pair, np.empty(len(self.addr) + 1, np.int64),
                       jobs_gu, jobs_dn)
        if m < 0:
            raise ClutorError(f"router chose an expert outside 0..{len(self.addr) - 1}: {sel.tolist()}")
        y = k.products(xg, m, S, jobs_gu, jobs_dn)  # [S, D]
        out = np.empty((R, k.D), np.float32)  # [R, D]
        slot_sum(y, sel, pair, wf, k.scale, not k.before, out)
        return out


class SlotOutputs:
    """A streamed layer's routed outputs in one step, group by group: slots f32 [R * K, D] each (row,
    slot) pair's weighted output by flat index row * K + slot (a slot whose expert failed stays 0: its
    row has failed). Made for one (h, sel), the layer's normed residual and choices."""

    __slots__ = ("h", "sel", "slots")

    def __init__(self, h: np.ndarray, sel: np.ndarray):
        self.h, self.sel = h, sel
        self.slots = np.zeros((sel.size, h.shape[1]), np.float32)  # [R * K, D]

    def put(self, flat: np.ndarray, y: np.ndarray) -> None:
        """The general path's outputs y [n, D] (weighted already) of the pairs flat [n]."""
        self.slots[flat] = y

    def sum(self) -> np.ndarray:
        """-> [R, D] each row's slots summed in router order: slot_sum's bits."""
        out = np.empty((len(self.sel), self.h.shape[1]), np.float32)  # [R, D]
        sum_slots(self.slots, out)
        return out


class StreamedExperts:
    """A streamed source's groups (views of cache slots, other ones each step) through the compiled
    path: each layer's ExpertKernels made on its first group, then per group its views' addresses
    (checked), route_group, the two launches and put_slots into the step's SlotOutputs.

        streamed = StreamedExperts.of(source, arch, layers, cfg, settings)  # None without a layout
        acc = streamed.group(l, h, sel, w, views, acc)  # None: the general path computes this group

    The views must stay pinned while group() runs (the store's take() pins them until it is closed)."""

    def __init__(self, layout, arch: "Arch", layers, cfg: "ModelConfig", settings: "KernelSettings"):
        self._layout, self._arch, self._layers, self._cfg, self._settings = layout, arch, layers, cfg, settings
        self._kernels: dict[int, ExpertKernels | None] = {}
        self._pos = np.empty(layout.n_experts, np.int64)  # route_group's scratch [E]
        # id(view) -> (view, its parts' addresses): the store makes a view once per buffer and expert
        # and hands the same object out while the buffer holds that expert, so a view's addresses are
        # checked and taken once (~4 us an expert otherwise). Holding the view keeps its id from being
        # reused by another; the dict is emptied when it outgrows a few views per expert.
        self._addr: dict[int, tuple[object, tuple[int, ...]]] = {}
        self._addr_max = 4 * layout.n_experts * layout.n_layers + 64
        self.groups = 0  # groups computed here (the rest went the general path)

    @classmethod
    def of(cls, source, arch: "Arch", layers, cfg: "ModelConfig", settings: "KernelSettings") -> "StreamedExperts | None":
        layout = getattr(source, "layout", None)
        return None if layout is None or isinstance(source, InMemoryExperts) else cls(layout, arch, layers, cfg, settings)

    def group(self, l: int, h: np.ndarray, sel: np.ndarray, w: np.ndarray, views,
              acc: "SlotOutputs | None") -> "SlotOutputs | None":
        """Model layer l's experts `views` for the rows routed to them: their weighted outputs put into
        acc (a new SlotOutputs unless acc is this (h, sel)'s); returns it, or None (nothing computed)
        where the general path computes."""
        k = self._kernels.get(l, _UNSET)
        if k is _UNSET:
            k = self._kernels[l] = ExpertKernels.build(self._layout, self._arch, self._layers[l], self._cfg,
                                                       self._settings, views[0])
        if k is None or not k.fits(sel, w) or h.dtype != np.float32:
            return None
        if acc is None or acc.h is not h or acc.sel is not sel:
            acc = SlotOutputs(h, sel)
        R, K = sel.shape
        G, P = len(views), k.parts.shape[0]
        ids = np.array([v.expert for v in views], np.int64)  # [G]
        addr = np.array([self._addresses(k, v) for v in views], np.int64)  # [G, P]
        S = R * K  # at most the group's pairs
        xg = np.empty((S, k.D), np.float32)  # [S, D] the group's pairs' inputs, grouped by expert
        wf = np.empty(S, np.float32)
        pair = np.empty(S, np.int64)
        jobs_gu = np.empty((G * (P - 1), 7), np.int64)
        jobs_dn = np.empty((G, 7), np.int64)
        sel_c = np.ascontiguousarray(sel, np.int64)
        m, n = route_group(sel_c, np.ascontiguousarray(w), np.ascontiguousarray(h), k.before, ids, addr, k.parts,
                           self._pos, xg, wf, pair, jobs_gu, jobs_dn)
        if m < 0:
            raise ClutorError(f"layer {l}: an expert outside 0..{len(self._pos) - 1} or a repeated one: "
                              f"group {ids.tolist()}, router {sel.tolist()}")
        if n:
            y = k.products(xg, m, n, jobs_gu, jobs_dn)  # [n, D]
            put_slots(y, sel_c, pair, wf, k.scale, not k.before, n, acc.slots)
        self.groups += 1
        return acc

    def _addresses(self, k: ExpertKernels, view) -> tuple[int, ...]:
        """view's parts' addresses (ExpertKernels.addresses), once per view object."""
        got = self._addr.get(id(view))
        if got is not None and got[0] is view:
            return got[1]
        row = np.empty(k.parts.shape[0], np.int64)  # [P]
        k.addresses(view, row)
        if len(self._addr) >= self._addr_max:
            self._addr.clear()
        got = self._addr[id(view)] = (view, tuple(row.tolist()))
        return got[1]


def _arrays(view, gated: bool) -> tuple:
    """An expert view's weight parts in ExpertKernels' order."""
    return (view.gate, view.up, view.down) if gated else (view.up, view.down)


def _swiglu(gu: np.ndarray) -> np.ndarray:
    """Arch.expert_act, silu(gate) * up of gu f32 [S, 2F] -> [S, F], with its bits in three calls
    instead of six numpy ones and an np.errstate (~20 us a layer): numpy's exp between two compiled loops."""
    S, F = gu.shape[0], gu.shape[1] // 2
    e = np.empty((S, F), np.float32)  # [S, F] -gate, then exp(-gate)
    if negated_gate(gu, e):  # numpy's exp may overflow here (to inf, as silu takes it): silu's own way
        return silu(gu[:, :F]) * gu[:, F:]
    np.exp(e, out=e)
    a = np.empty((S, F), np.float32)
    swiglu_from_exp(gu, e, a)
    return a
