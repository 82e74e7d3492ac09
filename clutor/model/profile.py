"""Where a forward step's time goes: ``Model.open(..., profile=True)``, ``clutor bench --profile``.

A step is split into spans, each timed on the thread that runs it:

    embed / attention / router / predict / experts / shared + sum / output    compute thread
    wait for reads                                                       the model coroutine, awaiting expert bytes
    sampling                                                             compute thread (the engine's head hook)

and every span's time is split again into its matrix products (the kernels: quants.matmul and
matmul_jobs report to the span that is active on their thread) and the rest (numpy glue: norms,
RoPE, softmax, gathers, the attention over the KV cache). What the spans do not cover is "hand-off
and Python": the trips to the compute thread, the event loop, the coroutines' own code. Steps are
counted apart by phase: "prefill" (some sequence brings several tokens) and "decode" (one token
per sequence), so a generation's decode steps can be read without its prompt.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

__all__ = ["Profile", "PhaseProfile", "NO_PROFILE", "kernel_done", "render", "to_json", "from_json"]

_active = threading.local()  # .span: the _Span accumulating on this thread, if any

# Spans in the order a step runs them (the report's row order); others follow alphabetically.
ORDER = ("embed", "attention", "router", "predict", "wait for reads", "experts", "shared + sum", "output", "sampling")


@dataclass
class _Span:
    seconds: float = 0.0
    kernel_seconds: float = 0.0
    calls: int = 0


@dataclass
class PhaseProfile:
    """One phase's totals: steps, tokens, wall seconds of the steps, and seconds per span."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    spans: dict[str, _Span] = field(default_factory=lambda: defaultdict(_Span))

    @property
    def rest(self) -> float:
        """Step wall time no span covers: hand-off to the compute thread, event loop, Python."""
        return self.seconds - sum(s.seconds for s in self.spans.values())


class Profile:
    """Per-phase span totals of one model. Spans are entered on the compute thread and on the
    model's coroutine; a model runs one step at a time, so the current phase is a plain field."""

    def __init__(self) -> None:
        self.phases: dict[str, PhaseProfile] = defaultdict(PhaseProfile)
        self._phase = "decode"
        self._lock = threading.Lock()

    @contextmanager
    def step(self, phase: str, tokens: int):
        self._phase = phase
        t0 = time.perf_counter()
        try:
            yield
        finally:
            p = self.phases[phase]
            p.steps += 1
            p.tokens += tokens
            p.seconds += time.perf_counter() - t0

    @contextmanager
    def span(self, name: str):
        """Time a span on this thread; matrix products inside it report their share to it."""
        with self._lock:
            s = self.phases[self._phase].spans[name]
        outer = getattr(_active, "span", None)
        _active.span = s
        t0 = time.perf_counter()
        try:
            yield
        finally:
            s.seconds += time.perf_counter() - t0
            s.calls += 1
            _active.span = outer

    def add(self, name: str, seconds: float) -> None:
        """Time measured by the caller (an await, which a context manager across threads cannot span)."""
        with self._lock:
            s = self.phases[self._phase].spans[name]
        s.seconds += seconds
        s.calls += 1

    def count(self, phase: str, tokens: int) -> None:
        """Tokens of a step run in several slices, each its own profile.step(phase, 0)."""
        with self._lock:
            self.phases[phase].tokens += tokens

    def reset(self) -> None:
        self.phases.clear()


class _NoProfile:
    """What a model without profiling holds: the same calls, doing nothing."""

    phases: dict = {}
    _null = nullcontext()

    def step(self, phase: str, tokens: int):
        return self._null

    def span(self, name: str):
        return self._null

    def add(self, name: str, seconds: float) -> None:
        pass

    def count(self, phase: str, tokens: int) -> None:
        pass

    def reset(self) -> None:
        pass


NO_PROFILE = _NoProfile()


def kernel_done(t0: float) -> None:
    """Called by the matmul entry points with their start time: counts the product against the
    span active on this thread (nothing when no profile is running here)."""
    s = getattr(_active, "span", None)
    if s is not None:
        s.kernel_seconds += time.perf_counter() - t0


def to_json(profile: "Profile") -> dict:
    return {phase: {"steps": p.steps, "tokens": p.tokens, "seconds": p.seconds,
                    "spans": {n: vars(s).copy() for n, s in p.spans.items()}}
            for phase, p in profile.phases.items()}


def from_json(data: dict) -> dict[str, PhaseProfile]:
    return {phase: PhaseProfile(d["steps"], d["tokens"], d["seconds"],
                                {n: _Span(**s) for n, s in d["spans"].items()})
            for phase, d in data.items()}


def render(phase: str, p: PhaseProfile) -> str:
    """A table of one phase: per span, milliseconds per step, share of the step, and how much of it
    the matrix-product kernels took."""
    if p.steps == 0:
        return f"{phase}: no steps"
    per = 1e3 / p.steps
    lines = [f"{phase}: {p.steps} steps, {p.tokens} tokens, {p.seconds * per:.2f} ms per step "
             f"({p.tokens / p.seconds:.2f} tok/s)",
             f"  {'span':<22} {'ms/step':>8} {'share':>6} {'kernels':>8} {'glue':>8}"]
    names = [n for n in ORDER if n in p.spans] + sorted(n for n in p.spans if n not in ORDER)
    for name in names:
        s = p.spans[name]
        lines.append(f"  {name:<22} {s.seconds * per:8.2f} {s.seconds / p.seconds:6.1%} "
                     f"{s.kernel_seconds * per:8.2f} {(s.seconds - s.kernel_seconds) * per:8.2f}")
    lines.append(f"  {'hand-off and Python':<22} {p.rest * per:8.2f} {p.rest / p.seconds:6.1%}")
    kern = sum(s.kernel_seconds for s in p.spans.values())
    lines.append(f"  {'all kernels':<22} {kern * per:8.2f} {kern / p.seconds:6.1%}")
    return "\n".join(lines)
