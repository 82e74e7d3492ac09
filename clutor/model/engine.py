"""The scheduler: every live generation of a model advances in one batched step.

``Model.generate`` submits a request here and reads its tokens back; one task per model runs the
steps. A step takes every decoding sequence's last token and, within a per-step token budget,
the next chunk of the waiting prompts, and runs them as ONE forward (``Model.forward_batch``): the
dense products run once over all rows, and each layer reads the union of the experts its rows route
to once. Sampling happens on the compute thread at the end of the step. Requests join at step
boundaries; a finished or released request leaves at once, and its KV cache goes to the prefix
cache (LRU, bounded in bytes), where a later prompt that starts with the same tokens (the next turn
of a conversation) picks it up instead of computing those positions again.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..errors import ClosedError, ClutorError

if TYPE_CHECKING:
    from .model import Model, SequenceState
    from .sampling import Sampler

__all__ = ["Engine", "EngineStats", "Request"]


@dataclass(frozen=True)
class EngineStats:
    live_sequences: int      # in the batch now
    queued: int              # submitted, waiting for a place in the batch
    kv_bytes: int            # KV cache held by live sequences (positions filled x bytes per position),
                             # plus their recurrent states and checkpoints
    prefix_entries: int      # idle sequences kept for prefix reuse
    prefix_bytes: int        # their KV bytes (<= the prefix budget)
    steps: int               # forward steps run so far
    step_rows: int           # tokens computed in those steps (rows over all sequences)


@dataclass(eq=False)
class Request:
    """One generation as the scheduler sees it. Created by Engine.submit; read with next()."""

    prompt: list[int]
    sampler: "Sampler"
    max_new: int                # tokens to generate at most (max_tokens, bounded by the context)
    stop_ids: frozenset[int]    # end-of-generation tokens (empty when ignoring them)
    sample: Callable | None = None  # sample(req, logits [V]) -> (token, extra); None = sampler.sample
    checkpoints: tuple[int, ...] = ()  # prompt positions whose recurrent state is kept for reuse (hybrids)
    seq: "SequenceState | None" = None
    held: list[int] = field(default_factory=list)   # ids whose positions the KV cache holds
    todo: list[int] = field(default_factory=list)   # ids still to feed: the prompt's rest, or the last token
    history: list[int] = field(default_factory=list)  # prompt + generated (the sampler's penalty window)
    n_gen: int = 0
    cached_tokens: int = 0      # prompt positions reused from the prefix cache
    t_admitted: float = 0.0
    t_first: float = 0.0        # first token sampled
    released: bool = False
    done: bool = False
    _events: asyncio.Queue = field(default_factory=asyncio.Queue)

    async def next(self) -> tuple[int, object, str | None]:
        """(token, extra, finish reason or None); raises the step's error if the step failed."""
        ev = await self._events.get()
        if isinstance(ev, BaseException):
            raise ev
        return ev


class PrefixCache:
    """Idle sequences whose KV caches may be reused, least recently used first out, bounded by the
    bytes their filled positions hold."""

    def __init__(self, budget: int, bytes_per_token: int):
        self.budget = max(0, int(budget))
        self.bytes_per_token = bytes_per_token
        self._entries: OrderedDict[int, tuple["SequenceState", list[int]]] = OrderedDict()
        self._next = 0

    @property
    def nbytes(self) -> int:
        # every position ever written stays resident, not only the prefix that is reusable; recurrent
        # states and their checkpoints are a fixed size per sequence
        return sum(self._bytes(seq) for seq, _ in self._entries.values())

    def _bytes(self, seq: "SequenceState") -> int:
        return seq.kv.high * self.bytes_per_token + seq.state_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, seq: "SequenceState", held: list[int]) -> None:
        if not held or self._bytes(seq) > self.budget:
            return
        self._entries[self._next] = (seq, held)
        self._next += 1
        while self.nbytes > self.budget:
            self._entries.popitem(last=False)

    def take(self, ids: Sequence[int]) -> tuple["SequenceState", list[int]] | None:
        """The entry sharing the longest prefix with ids, cut to that prefix (at most len(ids) - 1
        positions: the last prompt token is always computed, its logits are the first sample's)."""
        best, best_n = None, 0
        want = np.asarray(ids, dtype=np.int64)
        for key, (seq, held) in self._entries.items():
            n = min(len(held), len(want) - 1)
            if n <= best_n:
                continue
            diff = np.nonzero(np.asarray(held[:n], dtype=np.int64) != want[:n])[0]
            n = int(diff[0]) if len(diff) else n
            n = seq.reusable(n)  # a recurrent state goes back only to a checkpoint
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None
        seq, held = self._entries.pop(best)
        seq.rewind(best_n)  # positions past the shared prefix are overwritten as the new prompt fills them
        return seq, held[:best_n]


class Engine:
    """Owns a model's live sequences and runs their steps (see the module docstring)."""

    def __init__(self, model: "Model", *, max_sequences: int, step_tokens: int, prefix_bytes: int):
        cfg = model.config
        self.model = model
        self.max_sequences = max_sequences
        self.step_tokens = step_tokens
        self.bytes_per_token = cfg.kv_bytes_per_token  # the architecture's KV layout (MLA: the latent)
        self.prefix = PrefixCache(prefix_bytes, self.bytes_per_token)
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._in_step: set[int] = set()
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False
        self._steps = 0
        self._rows = 0

    # -- the generation side ---------------------------------------------------------------------
    def submit(self, prompt: list[int], sampler: "Sampler", max_new: int, stop_ids: frozenset[int],
               sample: Callable | None = None, checkpoints: Sequence[int] = ()) -> Request:
        """checkpoints: prompt positions (besides its end) where a recurrent model keeps its state, so
        that a later prompt sharing only that much can start from there (chat: where the next turn's
        rendering departs from this one's, clutor.model.chat.chat_turn)."""
        if self._closed:
            raise ClosedError(f"{self.model.path}: model is closed")
        req = Request(list(prompt), sampler, max_new, stop_ids, sample,
                      tuple(sorted(p for p in set(checkpoints) if 0 < p < len(prompt))))
        req.history = list(prompt)
        self._waiting.append(req)
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="clutor-engine")
        self._wake.set()
        return req

    def release(self, req: Request) -> None:
        """The reader is done with req (finished, stopped on a stop string, or cancelled): it leaves
        the batch now, or right after the step it is part of."""
        req.released = True
        if req in self._waiting:
            self._waiting.remove(req)
        elif id(req) not in self._in_step:
            self._retire(req)

    def stats(self) -> EngineStats:
        return EngineStats(
            live_sequences=len(self._active), queued=len(self._waiting),
            kv_bytes=sum(self.prefix._bytes(r.seq) for r in self._active if r.seq is not None),
            prefix_entries=len(self.prefix), prefix_bytes=self.prefix.nbytes,
            steps=self._steps, step_rows=self._rows)

    async def aclose(self) -> None:
        """Fail every request not finished, after the step under way (it may hold pinned experts)."""
        self._closed = True
        for req in list(self._waiting) + list(self._active):
            req._events.put_nowait(ClosedError(f"{self.model.path}: model closed during generation"))
        self._waiting.clear()
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            try:
                await self._task
            except BaseException:
                pass
        self._active.clear()
        self.prefix = PrefixCache(0, self.bytes_per_token)

    # -- the step loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._loop()
        except BaseException as e:
            # A bug outside a step (or the loop shutting down) must not leave readers waiting forever.
            err = e if isinstance(e, ClutorError) else ClutorError(f"the scheduler stopped: {type(e).__name__}: {e}")
            for req in list(self._waiting) + list(self._active):
                req._events.put_nowait(err)
                self._drop(req)
            self._waiting.clear()
            if not isinstance(e, Exception):
                raise

    async def _loop(self) -> None:
        while not self._closed:
            self._admit()
            batch = self._plan()
            if not batch:
                if self._closed or (not self._waiting and not self._active):
                    return  # the next submit starts a new task
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._step(batch)

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.max_sequences:
            req = self._waiting.popleft()
            reuse = self.prefix.take(req.prompt)
            if reuse is not None:
                req.seq, req.held = reuse
            else:
                req.seq, req.held = self.model.new_sequence(), []
            req.cached_tokens = len(req.held)
            req.todo = req.prompt[len(req.held):]
            req.t_admitted = time.perf_counter()
            self._active.append(req)

    def _plan(self) -> list[tuple[Request, int]]:
        """Every decoding sequence's one token, then prompt chunks (oldest first) in what is left of
        the step's token budget; at least a small chunk, so decoding never starves a prompt."""
        decoding = [(r, 1) for r in self._active if r.n_gen > 0]
        room = max(self.step_tokens - len(decoding), min(32, self.step_tokens))
        batch = decoding
        for r in self._active:
            if r.n_gen == 0 and room > 0:
                n = min(len(r.todo), room)
                if r.seq.rs is not None:  # stop at a checkpoint: the state is kept between steps only
                    at = len(r.held)
                    n = min([n] + [p - at for p in r.checkpoints if at < p < at + n])
                batch.append((r, n))
                room -= n
        return batch

    async def _step(self, batch: list[tuple[Request, int]]) -> None:
        reqs = [r for r, _ in batch]
        feeds = [r.todo[:n] for r, n in batch]
        last = [n == len(r.todo) for r, n in batch]  # the step reaches the end of what it had to feed
        self._in_step = {id(r) for r in reqs}
        try:
            results = await self.model.forward_batch(
                [(r.seq, f) for r, f in zip(reqs, feeds)], need=last,
                head=lambda logits: [self._sample(r, lg) if lg is not None else None for r, lg in zip(reqs, logits)])
        except Exception as e:  # noqa: BLE001 - handed to the requests of this step, never lost
            self._in_step = set()
            err = e if isinstance(e, ClutorError) else ClutorError(f"generation failed: {type(e).__name__}: {e}")
            if err is not e:
                err.__cause__ = e
            for r in reqs:
                r._events.put_nowait(err)
                self._drop(r)
            return
        finally:
            self._steps += 1
            self._rows += sum(len(f) for f in feeds)
        self._in_step = set()
        now = time.perf_counter()
        for r, f, out in zip(reqs, feeds, results):
            r.held.extend(f)
            del r.todo[: len(f)]
            if r.n_gen == 0 and (len(r.held) == len(r.prompt) or len(r.held) in r.checkpoints):
                r.seq.checkpoint()  # a recurrent state at the prompt's end or a requested position
            if out is not None and not r.released:
                token, extra = out
                r.n_gen += 1
                r.history.append(token)
                if r.n_gen == 1:
                    r.t_first = now
                reason = "eos" if token in r.stop_ids else "length" if r.n_gen >= r.max_new else None
                r._events.put_nowait((token, extra, reason))
                if reason is None:
                    r.todo.append(token)
                else:
                    r.done = True
            if r.released or r.done:
                self._retire(r)

    def _sample(self, req: Request, logits: np.ndarray):
        """On the compute thread: the request's next token from its last row of logits [1, V]."""
        row = np.asarray(logits[-1], dtype=np.float32)  # [V]
        if req.sample is not None:
            return req.sample(req, row)
        return req.sampler.sample(row, req.history), None

    def _retire(self, req: Request) -> None:
        """Out of the batch; its KV cache (the positions filled) kept for prefix reuse."""
        if req in self._active:
            self._active.remove(req)
            if req.seq is not None and not self._closed:
                self.prefix.put(req.seq, req.held)
        req.seq = None

    def _drop(self, req: Request) -> None:
        """Out of the batch after a failed step; its KV is not trusted for reuse."""
        if req in self._active:
            self._active.remove(req)
        req.seq = None
