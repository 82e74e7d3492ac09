"""A StepPlan while it runs: what the architectures see of the step (compute thread only).

An architecture's attention (clutor.model.arch) computes q, k, v for all R rows of the step at once
and leaves the rest to the step:

    q, k = step.rope(rope, q), step.rope(rope, k)   # each row at its own position
    o = step.attend(l, q, k, v, scale)              # writes k, v into each sequence's state, attends
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .layers import attention

if TYPE_CHECKING:
    from .layers import Rope
    from .plan import Segment, StepPlan

__all__ = ["Step"]


class Step:
    def __init__(self, plan: "StepPlan", rope: "Rope"):
        self.plan = plan
        self.segments = plan.segments
        self.failed: dict[int, BaseException] = {}  # id(segment) -> why it failed (the rest go on)
        self._angles: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def prepare(self) -> None:
        """Before the first layer."""

    def commit(self) -> None:
        """The step's positions count as filled: only once every layer has written them."""
        for seg in self.segments:
            seg.seq.kv.n = seg.p0 + seg.n

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

    def attend(self, l: int, q: np.ndarray, k: np.ndarray, v: np.ndarray | None, scale: float, *,
               window: int = 0, sinks: np.ndarray | None = None) -> np.ndarray:
        """Write k [R, Hkv, dk] and v [R, Hkv, dv] (None: the values are k's first columns, MLA's
        latent) at every row's position, then causal attention of q [R, H, dk] for each segment
        over its own sequence -> [R, H * dv]."""
        outs = []
        for s in self.segments:
            rows = s.rows
            kv = s.seq.kv
            kv.write(l, s.p0, k[rows], None if v is None else v[rows])
            outs.append(attention(q[rows], kv, l, s.p0, scale, window=window, sinks=sinks))
        return outs[0] if len(outs) == 1 else np.concatenate(outs)
