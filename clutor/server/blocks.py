"""A streamed reply as a run of blocks: reasoning, text, tool calls, each opened, filled and closed in
turn. Anthropic's content blocks and the Responses API's output items are both this shape."""
from __future__ import annotations

from dataclasses import dataclass

from ..formats import CallDelta, Delta

__all__ = ["Blocks", "Start", "Fill", "Stop"]


@dataclass(frozen=True)
class Start:
    index: int
    kind: str                       # "reasoning" | "text" | "call"
    call: CallDelta | None = None   # a call's id and name


@dataclass(frozen=True)
class Fill:
    index: int
    kind: str
    text: str                       # reasoning or text, or a fragment of a call's arguments


@dataclass(frozen=True)
class Stop:
    index: int
    kind: str


class Blocks:
    def __init__(self):
        self.index = -1
        self.kind: str | None = None

    def _to(self, kind: str) -> list:
        if self.kind == kind and kind != "call":
            return []
        out = self._close()
        self.index += 1
        self.kind = kind
        return out + [Start(self.index, kind)]

    def _close(self) -> list:
        if self.kind is None:
            return []
        out = [Stop(self.index, self.kind)]
        self.kind = None
        return out

    def feed(self, d: Delta) -> list:
        out: list = []
        if d.reasoning:
            out += self._to("reasoning")
            out.append(Fill(self.index, "reasoning", d.reasoning))
        if d.content:
            out += self._to("text")
            out.append(Fill(self.index, "text", d.content))
        for c in d.calls:
            if c.name is not None:
                out += self._close()
                self.index += 1
                self.kind = "call"
                out.append(Start(self.index, "call", c))
            if c.arguments:
                out.append(Fill(self.index, "call", c.arguments))
        return out

    def finish(self) -> list:
        return self._close()
