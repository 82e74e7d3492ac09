"""The step as data: what one forward step computes, decided before it runs.

The scheduler (clutor.model.engine) decides each step and writes it down as a ``StepPlan``: which
sequences take part, which tokens each appends at which positions, and what each wants back. The
runner (clutor.model.runner) executes a plan and returns one ``Outcome`` per segment; the engine
applies the outcomes afterwards (tokens to their requests, positions committed, pages indexed).
Nothing in a plan changes while it runs.

Rows: a step's R rows are its segments' tokens back to back; segment i owns rows r0 .. r0 + T_i.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..errors import ClutorError

if TYPE_CHECKING:
    from .accounting import Ledger
    from .state import SequenceState

__all__ = ["Want", "Segment", "StepPlan", "Outcome"]


class Want(enum.Enum):
    """What a segment's step returns (before its head, if any, turns it into something else)."""

    NOTHING = 0   # a prompt chunk that is not the prompt's last: no output row is computed
    LAST = 1      # logits of its last row, float32 [1, V]
    ALL = 2       # logits of every row, float32 [T, V]
    HIDDEN = 3    # the final normed hidden state of every row, float32 [T, D] (embeddings)


@dataclass(eq=False)
class Segment:
    """One sequence's share of a step: its ids appended at positions p0 .. p0 + T - 1, rows r0 .. of the step."""

    seq: "SequenceState"
    ids: np.ndarray        # [T] int64
    p0: int
    r0: int
    want: Want = Want.LAST
    # Run on the compute thread on this segment's output (sampling, a logits processor, pooling):
    # its return value is the segment's outcome. An exception it raises fails this segment alone.
    head: Callable[[np.ndarray], object] | None = None
    ledger: "Ledger | None" = None  # charged with this segment's share of the step's expert I/O

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def rows(self) -> slice:
        return slice(self.r0, self.r0 + len(self.ids))


@dataclass(eq=False)
class StepPlan:
    segments: list[Segment]
    ids: np.ndarray   # [R] every segment's ids back to back
    pos: np.ndarray   # [R] each row's position in its own sequence
    seg_of_row: np.ndarray  # [R] index of the segment each row belongs to
    # Page copies done on the compute thread before the first layer: (src page, dst page, positions).
    # A prefix shared up to the middle of a page gets its own copy of that page's filled part.
    copies: list[tuple[int, int, int]] = field(default_factory=list)

    @classmethod
    def build(cls, items: Sequence[tuple["SequenceState", Sequence[int] | np.ndarray, Want]],
              heads: Sequence[Callable | None] | None = None, ledgers: Sequence["Ledger | None"] | None = None,
              copies: Sequence[tuple[int, int, int]] = ()) -> "StepPlan":
        """Segments from (state, ids, want), each at its state's next position; ids are not
        range-checked here (the engine and Model.forward_batch check them per request first)."""
        segments, r = [], 0
        seen: set[int] = set()
        for i, (seq, ids, want) in enumerate(items):
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # [T_i]
            if len(ids) == 0:
                raise ClutorError("a step needs at least one token per sequence")
            if id(seq) in seen:
                raise ClutorError("a sequence can appear only once in a step")
            seen.add(id(seq))
            segments.append(Segment(seq, ids, seq.n, r, want, heads[i] if heads else None,
                                    ledgers[i] if ledgers else None))
            r += len(ids)
        if not segments:
            raise ClutorError("a step needs at least one sequence")
        ids = np.concatenate([s.ids for s in segments]) if len(segments) > 1 else segments[0].ids
        pos = np.concatenate([s.p0 + np.arange(s.n) for s in segments])
        seg_of_row = np.repeat(np.arange(len(segments)), [s.n for s in segments])
        return cls(segments, ids, pos, seg_of_row, list(copies))

    @property
    def rows(self) -> int:
        return len(self.ids)

    def part(self, a: int, b: int) -> "StepPlan":
        """Rows a .. b - 1 as a plan of their own (a tile of a long step, whose attention runs a tile at
        a time): each segment cut to those rows at its own positions, wanting nothing, with no page
        copies (the whole step does them once)."""
        segments = []
        for s in self.segments:
            lo, hi = max(a, s.r0), min(b, s.r0 + s.n)
            if lo < hi:
                segments.append(Segment(s.seq, s.ids[lo - s.r0 : hi - s.r0], s.p0 + lo - s.r0, lo - a, Want.NOTHING))
        seg_of_row = self.seg_of_row[a:b] - self.seg_of_row[a]
        return StepPlan(segments, self.ids[a:b], self.pos[a:b], seg_of_row)

    @property
    def decode(self) -> bool:
        """Every segment brings one token (the shape of a decode step)."""
        return len(self.ids) == len(self.segments)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one segment's step gave: its output (or its head's result), or the error that failed it alone."""

    value: object = None
    error: BaseException | None = None
