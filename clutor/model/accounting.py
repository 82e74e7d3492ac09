"""Each request's own expert I/O: the step's reads, hits and waits shared out by the experts each needed.

A step reads each expert once for all its rows, so the store's counters say what the step cost, not
what each request cost. The runner charges every expert access of a step to the segments whose rows
routed to it, in equal shares:

- an expert found in the cache: one access and one hit, shared;
- an expert that had to be read (or waited for): one access and one miss, shared, with its share of
  the bytes its layer's get() read on demand and of the time that get() waited;
- what the step prefetched (read ahead for the next layer): shared by all the step's segments.

So a request's Ledger is its own, and the Ledgers of all requests sum to the store's counters over
the same steps (up to float rounding: shares are fractions).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Ledger"]


@dataclass
class Ledger:
    """One request's share of the expert I/O of the steps it took part in (fractions of accesses)."""

    accesses: float = 0.0       # expert accesses (per layer, per step)
    hits: float = 0.0           # ... found in the cache
    misses: float = 0.0         # ... that waited for a read
    bytes_demand: float = 0.0   # bytes read for the experts it needed
    bytes_prefetch: float = 0.0  # its share of what its steps read ahead
    wait_seconds: float = 0.0   # its share of the time its steps waited for reads
    steps: int = 0              # steps it took part in
    windows: int = 0            # of them, prompt windows (each expert read once per layer for the whole window)

    def add(self, accesses: float = 0.0, hits: float = 0.0, misses: float = 0.0, bytes_demand: float = 0.0,
            wait_seconds: float = 0.0) -> None:
        self.accesses += accesses
        self.hits += hits
        self.misses += misses
        self.bytes_demand += bytes_demand
        self.wait_seconds += wait_seconds

    @property
    def bytes_read(self) -> float:
        return self.bytes_demand + self.bytes_prefetch

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
