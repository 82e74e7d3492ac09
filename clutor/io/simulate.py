"""Replay a routing trace through the store's own ExpertCache and policies, without any I/O.

Each record is one ``get(layer, experts)``, preceded (version-2 traces) by the hint the model gave
for the next layer at that step (``hint(layer + 1, next)``, as the store receives it). A record's
experts are pinned together (so one expert of a request never evicts another of the same request,
as in the store), a miss is loaded at once, and all are unpinned before the next record. Prefetch is
not modelled. Replayed in the trace's order (the order the model asked the store for experts), the
counts are the store's own. Belady (OPT) runs the same loop with the future known, giving the
ceiling any online policy can reach at that slot count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .cache import ExpertCache
from .policies import POLICIES, Belady, Policy, make_policy
from .trace import Trace, TraceRecord

__all__ = ["SimResult", "simulate", "compare_policies", "slots_for_budget"]


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    n_slots: int
    accesses: int
    hits: int
    misses: int      # includes bypass reads
    bypass: int      # misses that found every slot pinned (only when n_slots < top_k)
    evictions: int
    miss_bytes: int = 0  # bytes the misses read, when simulate() was given the bytes of each expert

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def to_json(self) -> dict:
        return {
            "policy": self.policy,
            "n_slots": self.n_slots,
            "accesses": self.accesses,
            "hits": self.hits,
            "misses": self.misses,
            "bypass": self.bypass,
            "evictions": self.evictions,
            "hit_rate": round(self.hit_rate, 6),
            "miss_bytes": self.miss_bytes,
        }


def slots_for_budget(budget: int, expert_bytes: int) -> int:
    """Cache slots a byte budget buys, as the store computes them: whole experts, less the few spare
    buffers the store keeps for bypass reads (``expert_bytes`` = the store's slot size, as the model's
    trace header records it)."""
    from .store import split_slots  # the store's own rule

    if expert_bytes < 1:
        raise ValueError(f"expert_bytes must be >= 1, got {expert_bytes}")
    return split_slots(budget // expert_bytes)[0]


def _records(trace: Trace | Sequence[TraceRecord]) -> Sequence[TraceRecord]:
    return trace.records if isinstance(trace, Trace) else trace


def simulate(trace: Trace | Sequence[TraceRecord], n_slots: int, policy: str | Policy, *,
             counted: Callable[[TraceRecord], bool] | None = None,
             expert_bytes: Callable[[int, int], int] | None = None) -> SimResult:
    """Replay ``trace`` through an ExpertCache of ``n_slots`` slots under ``policy``.

    ``policy`` is a registry name, ``"belady"`` (offline optimum, every miss inserted), ``"opt"`` (Belady
    with bypass: the fewest misses possible), or a fresh Policy instance (it is consumed).
    ``counted(record)``: which records the counts cover (default all); the others are replayed all the
    same, so a window (a run's decode steps) is counted from the cache state the whole run left it in.
    ``expert_bytes(layer, expert)``: what one miss reads, summed into ``miss_bytes``.
    """
    records = _records(trace)
    if policy in ("belady", "opt"):
        policy = Belady(Trace(tuple(records)).accesses(), bypass=policy == "opt")
    pol = make_policy(policy, n_slots)
    cache = ExpertCache(n_slots, pol)
    optimal = isinstance(pol, Belady) and pol.bypass
    accesses = hits = misses = bypass = nbytes = 0
    for rec in records:
        if rec.next is not None:
            cache.hint(rec.layer + 1, [(rec.layer + 1, e) for e in dict.fromkeys(rec.next)])
        keys = [(rec.layer, e) for e in dict.fromkeys(rec.experts)]  # a duplicate in one request is one access
        count = counted is None or counted(rec)
        accesses += len(keys) * count
        pinned: list[int] = []
        # As ExpertStore.get does: pin the present keys first, so no miss of this request evicts them.
        for key in keys:
            if key in cache:
                pinned.append(cache.acquire(key).slot)
                hits += count
        for key in keys:
            if key in cache:
                continue
            if count:
                misses += 1
                nbytes += expert_bytes(*key) if expert_bytes is not None else 0
            if optimal:
                # Belady's choice between evicting the farthest-used key and caching nothing (class doc).
                victim = cache.victim_key()
                if victim is not None and pol.use_after_next(key) >= pol.next_use(victim):
                    bypass += count
                    pol.on_bypass(key)
                    continue
            grant = cache.acquire(key)
            if grant is None:
                bypass += count
                pol.on_bypass(key)
                continue
            pinned.append(grant.slot)
            cache.complete(grant.slot)
        for slot in pinned:
            cache.unpin(slot)
    return SimResult(pol.name, n_slots, accesses, hits, misses, bypass, cache.evictions, nbytes)


def compare_policies(
    trace: Trace | Sequence[TraceRecord], n_slots: int, policies: Iterable[str] | None = None, *, belady: bool = True
) -> list[SimResult]:
    """One SimResult per policy (default: every registered one), then Belady's."""
    names = list(POLICIES) if policies is None else list(policies)
    results = [simulate(trace, n_slots, name) for name in names]
    if belady:
        results.append(simulate(trace, n_slots, "belady"))
    return results
