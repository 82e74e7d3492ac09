"""A step's routed experts from experts mapped in memory (io="memory"), in five calls a layer.

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

The general path keeps what this does not take: experts with biases (gpt-oss), products matmul_jobs
runs otherwise (F32, F16 / BF16 in q8 mode, more tokens than the BLAS threshold), router weights not
float32, and every streamed source (its views are cache slots, other ones each step).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ClutorError
from . import kernels
from .arch.common import Arch
from .kernels.routing import (PART_COL, PART_QT, PART_RB, PART_ROWS, negated_gate, route_jobs, slot_sum,
                              swiglu_from_exp)
from .layers import silu
from .profile import kernel_done
from .source import InMemoryExperts

if TYPE_CHECKING:
    from .config import ModelConfig
    from .kernel_settings import KernelSettings

__all__ = ["ResidentExperts", "ResidentLayer"]

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


class ResidentLayer:
    """One layer's experts as addresses: addr int64 [E, P] (P parts: gate, up, down; up, down
    ungated), each part's (type, row bytes, rows, output column) parts int64 [P, 4]. Holds the
    views, so the mappings stay alive as long as the addresses are used."""

    def __init__(self, source: InMemoryExperts, layer: int, arch: "Arch", views, addr: np.ndarray, parts: np.ndarray,
                 blocks: tuple[int, int], work: tuple[float, float], max_tok: int, scale: np.ndarray, D: int, F: int,
                 settings: "KernelSettings"):
        self._source, self._layer, self._arch, self._views = source, layer, arch, views
        self.addr, self.parts = addr, parts  # [E, P], [P, 4]
        self._block_gu, self._block_dn = blocks  # activation blocks (kernels.array_block) of gate | up, of down
        self._work_gu, self._work_dn = work  # weighted weight bytes of one token through an expert's gate | up, its down
        self.max_tok = max_tok  # rows a step may have (each expert's job has at most that many tokens)
        self._scale = scale  # f32 [E] each expert's output scale, or [0]: none
        self._before = bool(arch.weight_before_ffn)
        self._swiglu = type(arch).expert_act is Arch.expert_act and source.layout.gated  # the default activation
        self._D, self._F = D, F
        self._settings = settings

    @classmethod
    def build(cls, source: InMemoryExperts, layer: int, arch: "Arch", lw, cfg: "ModelConfig",
              settings: "KernelSettings") -> "ResidentLayer | None":
        et = lw.experts
        D, F, E = cfg.n_embd, cfg.n_ff_exp, source.layout.n_experts
        gated = source.layout.gated
        if source.layout.n_parts != (3 if gated else 2):  # biases (gpt-oss): the general path adds them
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
        views = source.views_now(layer, range(E))
        addr = np.empty((E, len(shapes)), np.int64)  # [E, P]
        parts = np.empty((len(shapes), 4), np.int64)  # [P, 4]
        for e, v in enumerate(views):
            for p, (arr, (q, rows, cols, col)) in enumerate(zip((v.gate, v.up, v.down) if gated else (v.up, v.down), shapes)):
                rb = kernels.check_weight(arr, q, rows, cols)
                addr[e, p] = arr.ctypes.data
                parts[p, [PART_QT, PART_RB, PART_ROWS, PART_COL]] = (q, rb, rows, col)
        work = (sum(kernels.work_bytes(q, rows * parts[p, PART_RB]) for p, (q, rows, _, _) in enumerate(shapes[:-1])),
                kernels.work_bytes(et.down, D * parts[-1, PART_RB]))
        max_tok = min(kernels.array_max_tokens(blocks[0], settings), kernels.array_max_tokens(blocks[1], settings))
        return cls(source, layer, arch, views, addr, parts, blocks, work, max_tok, scale, D, F, settings)

    def fits(self, sel: np.ndarray, w: np.ndarray) -> bool:
        """Whether sum() computes this step (else the general path): rows the drivers take in one job
        each, float32 weights (the general path multiplies in their type)."""
        return len(sel) <= self.max_tok and w.dtype == np.float32

    def sum(self, h: np.ndarray, sel: np.ndarray, w: np.ndarray) -> np.ndarray:
        """h f32 [R, D] the experts' input, sel [R, K] each row's experts, w f32 [R, K] their weights
        -> [R, D] each row's experts' outputs, weighted, summed in slot order."""
        self._source.check(self._layer)  # before any expert page is touched (InMemoryExperts' docstring)
        D, F = self._D, self._F
        R, K = sel.shape
        S = R * K
        P = self.parts.shape[0]
        sel = np.ascontiguousarray(sel, np.int64)
        w = np.ascontiguousarray(w)
        h = np.ascontiguousarray(h, np.float32)
        xg = np.empty((S, D), np.float32)  # [S, D] each (row, slot) pair's input, grouped by expert
        wf = np.empty(S, np.float32)  # [S] its router weight
        pair = np.empty(S, np.int64)  # [S] its row * K + slot
        jobs_gu = np.empty((S * (P - 1), 7), np.int64)
        jobs_dn = np.empty((S, 7), np.int64)
        m = route_jobs(sel, w, h, self._before, self.addr, self.parts, xg, wf, pair, np.empty(len(self.addr) + 1, np.int64),
                       jobs_gu, jobs_dn)
        if m < 0:
            raise ClutorError(f"router chose an expert outside 0..{len(self.addr) - 1}: {sel.tolist()}")
        gu = np.empty((S, (P - 1) * F), np.float32)  # [S, 2F] gate | up (ungated: [S, F] up)
        t0 = time.perf_counter()
        kernels.run_job_array(jobs_gu[: m * (P - 1)], D, xg, gu, self._block_gu, S * self._work_gu, self._settings)
        kernel_done(t0)
        if self._swiglu:
            a = _swiglu(gu)  # [S, F]
        else:
            a = np.ascontiguousarray(self._arch.expert_act(gu, F))  # [S, F]
            if a.dtype != np.float32:
                raise ClutorError(f"{type(self._arch).__name__}.expert_act gave {a.dtype}, not float32")
        y = np.empty((S, D), np.float32)  # [S, D]
        t0 = time.perf_counter()
        kernels.run_job_array(jobs_dn[:m], F, a, y, self._block_dn, S * self._work_dn, self._settings)
        kernel_done(t0)
        out = np.empty((R, D), np.float32)  # [R, D]
        slot_sum(y, sel, pair, wf, self._scale, not self._before, out)
        return out


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
