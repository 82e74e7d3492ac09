"""What a benchmark row could reach, from the same run: the compute bound and the disk bound.

A streamed row decodes at most as fast as

* the same workload with every expert in memory (the **compute bound**: measured, same run, `io=memory`), and
* the disk can deliver the fewest bytes that workload must read (the **disk bound**: fio's O_DIRECT bandwidth,
  measured in the same run, over Belady's minimal bytes per token for a cache of the row's size, replayed on
  the row's own routing trace).

A pipeline that overlaps reads with compute perfectly runs at min(compute, disk): the row's **bound**. The
same with the row's own bytes per token in place of Belady's is the bound for the bytes the row chose to read
(``own``): achieved / own says how well the pipeline uses what it reads, whatever its cache policy.

Belady here is the simulator's "opt" (clutor.io.simulate: the store's own cache code, a request's experts
pinned together; Belady's farthest-next-use eviction, and a miss read past the cache when it is needed later
than every evictable expert, as the store can into a spare buffer: the fewest misses possible), replayed over
the whole trace (warm-up, prefill and decode, as the live cache saw them) and
counted over the decode records only: positions at or after the prompt's end. Its bytes are each missed
expert's reads as the store issues them (every slab widened to the O_DIRECT alignment).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..io.arena import widen
from ..io.backend import DEFAULT_ALIGN
from ..io.layout import ExpertLayout
from ..io.trace import Trace, TraceRecord

__all__ = ["expert_read_bytes", "step_unions", "WindowReplay", "replay_window", "Bounds", "bounds",
           "prefill_distinct_bytes", "prefill_bounds"]


def expert_read_bytes(layout: ExpertLayout, align: int = DEFAULT_ALIGN) -> np.ndarray:
    """Bytes the store reads for each expert [layers, experts]: its slabs, each widened to ``align``."""
    out = np.zeros((layout.n_layers, layout.n_experts), np.int64)
    for l in range(layout.n_layers):
        for e in range(layout.n_experts):
            out[l, e] = sum(widen(s.offset, s.nbytes, align)[1] for s in layout.slabs(l, e))
    return out


def step_unions(trace: Trace) -> Trace:
    """The trace as the store saw it: a batched step writes one record per row for each layer, back to back,
    and asks the store once for their union, so consecutive records of one layer become one record of
    their distinct experts (in first-asked order; the first record's position and hint). With a single
    MoE layer consecutive steps cannot be told apart, so such a trace is returned as it is."""
    recs = trace.records
    n_layers = trace.header.n_layers if trace.header else len({r.layer for r in recs})
    if n_layers < 2:
        return trace
    out: list[TraceRecord] = []
    for r in recs:
        if out and out[-1].layer == r.layer:
            last = out[-1]
            out[-1] = TraceRecord(last.token, last.layer, tuple(dict.fromkeys(last.experts + r.experts)), None, last.next)
        else:
            out.append(TraceRecord(r.token, r.layer, r.experts, None, r.next))
    return Trace(tuple(out), trace.header, trace.path)


@dataclass(frozen=True)
class WindowReplay:
    """A trace's window (records at positions >= ``first_position``) replayed at ``n_slots``."""

    n_slots: int
    tokens: int            # decode tokens in the window (records / MoE layers)
    accesses: int
    belady_misses: int
    belady_bytes: int      # bytes Belady's misses read in the window
    policy: str | None     # the row's own policy, replayed the same way (None: not asked)
    policy_hits: int | None
    policy_bytes: int | None

    @property
    def belady_bytes_per_token(self) -> float:
        return self.belady_bytes / self.tokens if self.tokens else 0.0

    @property
    def belady_hit_rate(self) -> float:
        return 1 - self.belady_misses / self.accesses if self.accesses else 0.0

    @property
    def policy_hit_rate(self) -> float | None:
        return None if self.policy_hits is None or not self.accesses else self.policy_hits / self.accesses

    def to_json(self) -> dict:
        return {**asdict(self), "belady_bytes_per_token": self.belady_bytes_per_token,
                "belady_hit_rate": self.belady_hit_rate, "policy_hit_rate": self.policy_hit_rate}


def replay_window(trace: Trace, n_slots: int, read_bytes: np.ndarray, first_position: int,
                  policy: str | None = None) -> WindowReplay:
    """Belady (and ``policy``, if given) over the whole trace as the store saw it (``step_unions``: a
    step's distinct experts per layer, so hit rates compare with the store's), counted at positions >=
    first_position; ``tokens`` counts the window's per-token records."""
    from ..io.simulate import simulate

    def counted(rec) -> bool:
        return rec.token >= first_position

    def cost(layer: int, expert: int) -> int:
        return int(read_bytes[layer, expert])

    n_layers = trace.header.n_layers if trace.header else len({r.layer for r in trace.records})
    n_window = sum(1 for r in trace.records if counted(r))
    trace = step_unions(trace)
    opt = simulate(trace, n_slots, "opt", counted=counted, expert_bytes=cost)
    own = simulate(trace, n_slots, policy, counted=counted, expert_bytes=cost) if policy else None
    return WindowReplay(n_slots, n_window // n_layers, opt.accesses, opt.misses, opt.miss_bytes,
                        policy, None if own is None else own.hits, None if own is None else own.miss_bytes)


@dataclass(frozen=True)
class Bounds:
    """One row against its bounds (tok/s; bytes per token; disk bandwidth in bytes/s)."""

    achieved: float
    compute: float | None          # the same workload in RAM
    disk_bps: float | None         # fio, same run
    belady_bytes_per_token: float | None
    own_bytes_per_token: float | None

    @staticmethod
    def _disk(bps: float | None, per_token: float | None) -> float | None:
        if bps is None or per_token is None:
            return None
        return math.inf if per_token <= 0 else bps / per_token

    @property
    def disk(self) -> float | None:
        """fio bandwidth / Belady's bytes per token (inf when Belady reads nothing)."""
        return self._disk(self.disk_bps, self.belady_bytes_per_token)

    @property
    def disk_own(self) -> float | None:
        """fio bandwidth / the row's own bytes per token."""
        return self._disk(self.disk_bps, self.own_bytes_per_token)

    @staticmethod
    def _min(*xs: float | None) -> float | None:
        known = [x for x in xs if x is not None]
        return min(known) if len(known) == len(xs) else None

    @property
    def bound(self) -> float | None:
        return self._min(self.compute, self.disk)

    @property
    def own_bound(self) -> float | None:
        return self._min(self.compute, self.disk_own)

    @property
    def of_bound(self) -> float | None:
        b = self.bound
        return self.achieved / b if b else None

    @property
    def of_own_bound(self) -> float | None:
        b = self.own_bound
        return self.achieved / b if b else None

    @property
    def limited_by(self) -> str | None:
        """Which bound binds: "compute" or "disk"."""
        if self.bound is None:
            return None
        return "compute" if self.compute <= self.disk else "disk"

    def to_json(self) -> dict:
        def finite(x):
            return None if x is None else (x if math.isfinite(x) else "inf")

        return {**asdict(self), **{k: finite(getattr(self, k)) for k in (
            "disk", "disk_own", "bound", "own_bound", "of_bound", "of_own_bound")}, "limited_by": self.limited_by}


def bounds(achieved: float, compute: float | None, disk_bps: float | None, belady_bytes_per_token: float | None,
           own_bytes_per_token: float | None) -> Bounds:
    return Bounds(achieved, compute, disk_bps, belady_bytes_per_token, own_bytes_per_token)


# ---- a prompt's time to first token --------------------------------------------------------------
#
# A streamed prefill takes at least as long as the same prompt with every expert in memory (the compute
# bound, seconds) and as reading, once, every expert the prompt routes to (the disk bound: their bytes
# over fio's bandwidth). Its bound is the larger of the two: a prefill that overlaps its reads with its
# compute perfectly, and reads each expert once per prompt, takes exactly that.

def prefill_distinct_bytes(trace: Trace, read_bytes: np.ndarray, prompt_tokens: int) -> int:
    """Bytes of the distinct (layer, expert) pairs the last prompt of the trace routed to: its last
    prompt_tokens x MoE layers records below position prompt_tokens (a prefill writes one record per
    row and MoE layer; a warm-up's records come before, decode records sit at later positions)."""
    recs = [r for r in trace.records if r.token < prompt_tokens]
    seen = {(r.layer, e) for r in recs[-prompt_tokens * read_bytes.shape[0]:] for e in r.experts}
    return int(sum(int(read_bytes[l, e]) for l, e in seen))


def prefill_bounds(seconds: float, compute_seconds: float | None, disk_bps: float | None,
                   distinct_bytes: int | None, read_bytes: int | None) -> dict:
    """A streamed prompt's time to first token against its bound (seconds): {achieved, compute, disk
    (distinct_bytes / disk_bps), bound (the larger), of_bound (bound / achieved: 1 at the bound),
    limited_by, distinct and read bytes, read_over_distinct}."""
    disk = distinct_bytes / disk_bps if distinct_bytes is not None and disk_bps else None
    parts = [x for x in (compute_seconds, disk) if x is not None]
    bound = max(parts) if parts else None
    return {"achieved": seconds, "compute": compute_seconds, "disk": disk, "bound": bound,
            "of_bound": bound / seconds if bound and seconds else None,
            "limited_by": None if bound is None else ("compute" if bound == compute_seconds else "disk"),
            "distinct_bytes": distinct_bytes, "read_bytes": read_bytes,
            "read_over_distinct": read_bytes / distinct_bytes if read_bytes is not None and distinct_bytes else None}
