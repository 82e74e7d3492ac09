"""The scheduler: every live request of a model advances in one batched step.

``Model.generate`` (and ``logits``, ``embed``) submit a Request here and read its results back; one
task per model runs the steps. Each round the engine

1. admits waiting requests (first come, first served) while there is room in the batch,
2. plans the step (``StepPlan``, clutor.model.plan): every decoding sequence's last token, then, in
   what is left of the per-step token budget, the next chunk of the prompts being prefilled,
3. hands the plan to the runner (clutor.model.runner), which computes it as ONE forward: the dense
   products run once over all rows, and each layer reads the union of the experts its rows route to,
4. applies the outcomes: sampled tokens to their requests, finished requests out of the batch.

Requests join at step boundaries; a finished or released request leaves at once, and its KV goes to
the prefix cache, where a later prompt that starts with the same tokens (the next turn of a
conversation) picks it up instead of computing those positions again.

Failure isolation: a request is checked (token ids, lengths) before it joins a step, so a bad one is
refused to its own caller; a segment that fails inside a step (a failed expert read it needed, its
head raising) fails that request only; an error of the whole step fails the requests in it.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..errors import ClosedError, ClutorError, QueueFullError
from .plan import StepPlan, Want

if TYPE_CHECKING:
    from .runner import Runner
    from .sampling import Sampler
    from .state import SequenceState

__all__ = ["Engine", "EngineStats", "Request"]


@dataclass(frozen=True)
class EngineStats:
    live_sequences: int      # in the batch now
    queued: int              # submitted, waiting for a place in the batch
    kv_bytes: int            # KV cache held by live sequences (positions filled x bytes per position)
    prefix_entries: int      # idle sequences kept for prefix reuse
    prefix_bytes: int        # their KV bytes (<= the prefix budget)
    steps: int               # forward steps run so far
    step_rows: int           # tokens computed in those steps (rows over all sequences)


@dataclass(eq=False)
class Request:
    """One request as the scheduler sees it. Created by the caller, handed to Engine.submit.

    kind "generate": prompt, then tokens sampled one by one (read with next()).
    kind "logits": the logits of every prompt position, float32 [T, V] (await result()).
    kind "embed": the final normed hidden states pooled over the prompt, float32 [D] (await result()).
    """

    prompt: list[int]
    kind: str = "generate"
    sampler: "Sampler | None" = None
    max_new: int = 1            # tokens to generate at most (max_tokens, bounded by the context)
    stop_ids: frozenset[int] = frozenset()  # end-of-generation tokens (empty when ignoring them)
    # sample(req, logits [V]) -> (token, extra); None = sampler.sample. Runs on the compute thread.
    sample: Callable | None = None
    # logits_processor(req, logits [V]) -> logits [V] (e.g. a grammar's mask), on the compute thread,
    # before sampling; an exception it raises fails this request alone.
    logits_processor: Callable | None = None
    pooling: str = "mean"       # kind "embed": "mean" over the prompt's positions, or "last"
    seq: "SequenceState | None" = None
    held: list[int] = field(default_factory=list)   # ids whose positions the KV cache holds
    todo: list[int] = field(default_factory=list)   # ids still to feed: the prompt's rest, or the last token
    history: list[int] = field(default_factory=list)  # prompt + generated (the sampler's penalty window)
    n_gen: int = 0
    cached_tokens: int = 0      # prompt positions reused from the prefix cache
    t_submitted: float = 0.0
    t_admitted: float = 0.0
    t_first: float = 0.0        # first token sampled
    released: bool = False
    done: bool = False
    _pieces: list = field(default_factory=list)     # kind "logits" / "embed": what the chunks gave
    _events: asyncio.Queue = field(default_factory=asyncio.Queue)

    async def next(self) -> tuple[int, object, str | None]:
        """(token, extra, finish reason or None); raises the error that failed the request."""
        ev = await self._events.get()
        if isinstance(ev, BaseException):
            raise ev
        return ev

    async def result(self):
        """kind "logits" / "embed": the whole result; raises the error that failed the request."""
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
        # every position ever written stays resident, not only the prefix that is reusable
        return sum(seq.kv.high for seq, _ in self._entries.values()) * self.bytes_per_token

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, seq: "SequenceState", held: list[int]) -> None:
        if not held or seq.kv.high * self.bytes_per_token > self.budget:
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
        for key, (_, held) in self._entries.items():
            n = min(len(held), len(want) - 1)
            if n <= best_n:
                continue
            diff = np.nonzero(np.asarray(held[:n], dtype=np.int64) != want[:n])[0]
            n = int(diff[0]) if len(diff) else n
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None
        seq, held = self._entries.pop(best)
        seq.truncate(best_n)  # positions past the shared prefix are overwritten as the new prompt fills them
        return seq, held[:best_n]


class Engine:
    """Owns a model's requests and runs their steps (see the module docstring)."""

    def __init__(self, runner: "Runner", new_state: Callable[[], "SequenceState"], *, name: str, n_vocab: int,
                 n_ctx: int, bytes_per_token: int, max_sequences: int, step_tokens: int, prefix_bytes: int,
                 max_queue: int | None = None):
        self.runner = runner
        self._new_state = new_state
        self.name = name  # for error messages: the model's path
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.max_sequences = max_sequences
        self.step_tokens = step_tokens
        self.max_queue = max_queue  # None: no limit
        self.bytes_per_token = bytes_per_token  # the architecture's KV layout (MLA: the latent)
        self.prefix = PrefixCache(prefix_bytes, bytes_per_token)
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._in_step: set[int] = set()
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False
        self._mean_seconds = 5.0  # running mean of a request's time in the engine, for retry_after

    # -- the request side ------------------------------------------------------------------------
    def check(self, prompt: Sequence[int]) -> list[int]:
        """The prompt as a list of ids, or ClutorError saying what is wrong with it (its caller's error,
        raised before it can join a step)."""
        ids = [int(i) for i in prompt]
        if not ids:
            raise ClutorError("the prompt is empty: give at least one token")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.n_vocab:
            bad = lo if lo < 0 else hi
            raise ClutorError(f"token ids must be in [0, {self.n_vocab}) (the model's vocabulary), got {bad} "
                              f"at position {ids.index(bad)}")
        if len(ids) > self.n_ctx:
            raise ClutorError(f"the prompt is {len(ids)} tokens, {len(ids) - self.n_ctx} more than the context "
                              f"(n_ctx {self.n_ctx}): shorten it or open the model with a larger n_ctx")
        return ids

    def submit(self, req: Request) -> Request:
        """Queue a request (its prompt checked first); QueueFullError when max_queue are waiting."""
        if self._closed:
            raise ClosedError(f"{self.name}: model is closed")
        if req.kind not in ("generate", "logits", "embed"):
            raise ClutorError(f"unknown request kind {req.kind!r}")
        if req.kind == "embed" and req.pooling not in ("mean", "last"):
            raise ClutorError(f"pooling must be 'mean' or 'last', got {req.pooling!r}")
        req.prompt = self.check(req.prompt)
        if self.max_queue is not None and len(self._waiting) >= self.max_queue:
            retry = self.retry_after()
            raise QueueFullError(f"the engine is at capacity ({len(self._active)} running, {len(self._waiting)} "
                                 f"queued); retry after {retry} s", retry)
        req.history = list(req.prompt)
        req.t_submitted = time.perf_counter()
        self._waiting.append(req)
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="clutor-engine")
        self._wake.set()
        return req

    def release(self, req: Request) -> None:
        """The reader is done with req (finished, stopped on a stop string, or cancelled): it leaves
        the batch now, or right after the step it is part of."""
        if not req.released and req.t_submitted:
            self._mean_seconds += 0.2 * (time.perf_counter() - req.t_submitted - self._mean_seconds)
        req.released = True
        if req in self._waiting:
            self._waiting.remove(req)
        elif id(req) not in self._in_step:
            self._retire(req)

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the queue ahead drained max_sequences at a time."""
        waves = (len(self._waiting) + 1) / self.max_sequences
        return max(1, min(60, math.ceil(waves * self._mean_seconds)))

    def stats(self) -> EngineStats:
        return EngineStats(
            live_sequences=len(self._active), queued=len(self._waiting),
            kv_bytes=sum(r.seq.kv.high for r in self._active if r.seq is not None) * self.bytes_per_token,
            prefix_entries=len(self.prefix), prefix_bytes=self.prefix.nbytes,
            steps=self.runner.steps, step_rows=self.runner.rows)

    async def aclose(self) -> None:
        """Fail every request not finished, after the step under way (it may hold pinned experts)."""
        self._closed = True
        for req in list(self._waiting) + list(self._active):
            req._events.put_nowait(ClosedError(f"{self.name}: model closed during generation"))
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
            batch = self._schedule()
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
            # every position's logits (or hidden state) is wanted: nothing can be reused
            reuse = self.prefix.take(req.prompt) if req.kind == "generate" else None
            if reuse is not None:
                req.seq, req.held = reuse
            else:
                req.seq, req.held = self._new_state(), []
            req.cached_tokens = len(req.held)
            req.todo = req.prompt[len(req.held):]
            req.t_admitted = time.perf_counter()
            self._active.append(req)

    def _schedule(self) -> list[tuple[Request, int]]:
        """Every decoding sequence's one token, then prompt chunks (oldest first) in what is left of
        the step's token budget; at least a small chunk, so decoding never starves a prompt."""
        decoding = [(r, 1) for r in self._active if r.n_gen > 0]
        room = max(self.step_tokens - len(decoding), min(32, self.step_tokens))
        batch = decoding
        for r in self._active:
            if r.n_gen == 0 and room > 0:
                n = min(len(r.todo), room)
                batch.append((r, n))
                room -= n
        return batch

    def _plan(self, batch: list[tuple[Request, int]]) -> StepPlan:
        items, heads = [], []
        for r, n in batch:
            last = n == len(r.todo)  # the step reaches the end of what it had to feed
            if r.kind == "logits":
                want, head = Want.ALL, None
            elif r.kind == "embed":
                want, head = Want.HIDDEN, _pooler(r)
            else:
                want, head = (Want.LAST, _sampler(r)) if last else (Want.NOTHING, None)
            items.append((r.seq, r.todo[:n], want))
            heads.append(head)
        return StepPlan.build(items, heads)

    async def _step(self, batch: list[tuple[Request, int]]) -> None:
        reqs = [r for r, _ in batch]
        plan = self._plan(batch)
        self._in_step = {id(r) for r in reqs}
        try:
            outcomes = await self.runner.run(plan)
        except Exception as e:  # noqa: BLE001 - handed to the requests of this step, never lost
            self._in_step = set()
            for r in reqs:
                self._fail(r, e)
            return
        self._in_step = set()
        now = time.perf_counter()
        for r, seg, oc in zip(reqs, plan.segments, outcomes):
            if oc.error is not None:
                self._fail(r, oc.error)
                continue
            fed = seg.ids.tolist()
            r.held.extend(fed)
            del r.todo[: len(fed)]
            if r.kind != "generate":
                r._pieces.append(oc.value)
                if not r.todo and not r.released:
                    r._events.put_nowait(_result(r))
                    r.done = True
            elif oc.value is not None and not r.released:
                token, extra = oc.value
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

    def _fail(self, req: Request, e: BaseException) -> None:
        err = e if isinstance(e, ClutorError) else ClutorError(f"generation failed: {type(e).__name__}: {e}")
        if err is not e:
            err.__cause__ = e
        req._events.put_nowait(err)
        self._drop(req)

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


def _sampler(req: Request) -> Callable[[np.ndarray], tuple[int, object]]:
    """The head of a generate request's step (on the compute thread): the next token from its last
    row of logits [1, V], after its logits processor."""
    def head(logits: np.ndarray):
        row = np.asarray(logits[-1], dtype=np.float32)  # [V]
        if req.logits_processor is not None:
            row = req.logits_processor(req, row)
        if req.sample is not None:
            return req.sample(req, row)
        return req.sampler.sample(row, req.history), None

    return head


def _pooler(req: Request) -> Callable[[np.ndarray], np.ndarray]:
    """The head of an embed request's chunk (compute thread): the chunk's sum of hidden states, or its last."""
    if req.pooling == "last":
        return lambda hidden: hidden[-1].astype(np.float64)
    return lambda hidden: hidden.sum(axis=0, dtype=np.float64)


def _result(req: Request):
    if req.kind == "logits":
        return np.concatenate(req._pieces) if len(req._pieces) > 1 else req._pieces[0]
    if req.pooling == "last":
        return req._pieces[-1].astype(np.float32)
    return (np.sum(req._pieces, axis=0) / len(req.prompt)).astype(np.float32)
