"""What a sequence carries from one step to the next: its KV cache, laid out as its architecture stores it."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .arch import Arch

__all__ = ["SequenceState"]


class SequenceState:
    """One sequence's state and how many positions it holds."""

    def __init__(self, arch: "Arch", n_ctx: int):
        self.kv = arch.new_kv(n_ctx)
        self.n_ctx = n_ctx

    @property
    def n(self) -> int:
        return self.kv.n

    def truncate(self, n: int) -> None:
        """Keep the first n positions; the next step writes from position n."""
        if not 0 <= n <= self.kv.n:
            raise ValueError(f"cannot truncate a sequence of {self.kv.n} positions to {n}")
        self.kv.n = n
