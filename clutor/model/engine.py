"""The scheduler: every live request of a model advances in one batched step.

``Model.generate`` (and ``logits``, ``embed``) submit a Request here and read its results back; one
task per model runs the steps. Each round the engine

1. admits waiting requests (first come, first served) while the batch has room (``max_sequences``)
   and the KV pool (clutor.model.kv) has the bytes for them; a prompt that starts with tokens whose
   pages the pool holds (a live sequence's, or a finished one's kept for reuse) maps those pages
   instead of computing them, and one whose next page another request is computing right now waits
   for it rather than computing it twice;
2. plans the step (``StepPlan``, clutor.model.plan): every decoding sequence's last token, then, in
   what is left of the per-step token budget, the next chunk of the prompts being prefilled, with
   the pages each will write reserved; when the pool cannot hold them, the most recently admitted
   request is preempted (its pages kept for reuse, its tokens recomputed where they were given up
   when it resumes) instead of the process growing;
3. hands the plan to the runner (clutor.model.runner), which computes it as ONE forward: the dense
   products run once over all rows, and each layer reads the union of the experts its rows route to;
   a decoding sequence that drafts (clutor.model.speculative) feeds its last token and its draft as one
   segment, its rows verified by its own sampler and those after the first mismatch cut from its pages;
   a prompt longer than step_tokens goes instead as a window of up to ``prefill_window`` tokens in
   one step of its own (each layer's experts read once for the whole window), which the runner runs
   a slice at a time (``prefill_slice`` seconds of work) between the other sequences' steps, so it
   never freezes their decoding; one window at a time, longer prompts waiting their turn;
4. applies the outcomes: sampled tokens to their requests, computed pages published for reuse,
   finished requests out of the batch.

A lone sequence decoding (nothing waiting, nothing else in the batch) does not
come back to the event loop between its tokens: the compute thread runs its steps one after another
(``_solo_steps``: the same plan, run and outcome as a batched step, sampling included) and posts each
token to its reader with call_soon_threadsafe, so a token costs no thread hand-off and the loop's own
work (detokenising, the reader) overlaps the next token's compute. It hands back to the loop at the
first step boundary after a request arrives, the runner is asked for a forward, its reader releases it
(a stop string, cancellation), it ends, or its next page does not fit; the loop then schedules as usual.

Failure isolation: a request is checked (token ids, lengths, whether it can ever fit the KV budget)
before it joins a step, so a bad one is refused to its own caller; a segment that fails inside a step
(a failed expert read it needed, its head raising) fails that request only; an error of the whole
step fails the requests in it.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..errors import BudgetError, ClosedError, ClutorError, QueueFullError
from ..units import format_bytes
from .accounting import Ledger
from .compute import compute
from .kv import PAGE, NoRoom
from .plan import StepPlan, Want
from .speculative import Costs, NgramCache, SpecState, verifier

if TYPE_CHECKING:
    from .kv import KVPool
    from .runner import Runner, Sliced
    from .sampling import Sampler
    from .state import SequenceState

__all__ = ["Engine", "EngineStats", "Request"]

log = logging.getLogger("clutor.kv")


@dataclass(frozen=True)
class EngineStats:
    live_sequences: int      # in the batch now
    queued: int              # submitted, waiting for a place in the batch
    kv_bytes: int            # KV pool bytes held by live sequences (a page they share counted once)
    prefix_entries: int      # pages kept for prefix reuse (no live sequence holds them)
    prefix_bytes: int        # their bytes (<= prefix_cache, and within the KV budget)
    steps: int               # forward steps run so far
    step_rows: int           # tokens computed in those steps (rows over all sequences)
    kv_budget: int = 0       # the KV pool's budget (kv_cache)
    kv_resident: int = 0     # what the pool's memory holds now (<= kv_budget)
    shared_pages: int = 0    # pages mapped by more than one live sequence
    preemptions: int = 0     # requests set aside (and later resumed) because the KV budget was full


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
    # sample(req, logits [V], raw [V]) -> (token, extra); None = sampler.sample(logits). Runs on the
    # compute thread; logits are after the logits processor, raw before it.
    sample: Callable | None = None
    # logits_processor(ids so far, logits [V]) -> logits [V] (e.g. a grammar's mask,
    # clutor.grammar.Matcher), on the compute thread before sampling; the ids are the prompt and the
    # tokens generated so far; it may change logits in place. An exception it raises, or a result of
    # another shape, fails this request alone.
    logits_processor: Callable | None = None
    ledger: Ledger = field(default_factory=Ledger)  # this request's own expert I/O (clutor.model.accounting)
    # speculative decoding (clutor.model.speculative.SpeculativeParams), None: off; the engine keeps its
    # state in spec (None where it cannot: a logits processor, recurrent layers)
    speculative: object = None
    spec: "SpecState | None" = None
    pooling: str = "mean"       # kind "embed": "mean" over the prompt's positions, or "last"
    # prompt positions (besides its end) where a model with recurrent layers keeps its state, so that
    # a later prompt sharing only that much starts there (chat: where the next turn's rendering departs
    # from this one's, clutor.model.chat.chat_turn)
    checkpoints: tuple[int, ...] = ()
    seq: "SequenceState | None" = None
    held: list[int] = field(default_factory=list)   # ids whose positions the sequence holds
    todo: list[int] = field(default_factory=list)   # ids still to feed: the prompt's rest, or the last token
    history: list[int] = field(default_factory=list)  # prompt + generated (the sampler's penalty window)
    n_gen: int = 0
    cached_tokens: int = 0      # prompt positions reused from the prefix cache
    disk_tokens: int = 0        # ... of which loaded from the prefix cache on disk
    disk: str = ""              # the disk prefix cache: "" not tried, "loading", "tried"
    pins: list = field(default_factory=list)  # (group, page) pinned for it while the disk's pages load
    preempted: int = 0          # times set aside for lack of KV room (and resumed)
    keys: list = field(default_factory=list)        # content keys of held's full pages (clutor.model.kv)
    prompt_keys: list = field(default_factory=list)  # ... of the prompt's full pages
    copies: list = field(default_factory=list)      # page copies its next step makes first
    admitted: int = 0           # admission order (the most recent is preempted first)
    started: bool = False       # has run a step since it was (last) admitted
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


class Engine:
    """Owns a model's requests and runs their steps (see the module docstring)."""

    def __init__(self, runner: "Runner", pool: "KVPool", *, name: str, n_vocab: int, n_ctx: int,
                 max_sequences: int, step_tokens: int, max_queue: int | None = None, prefill_window: int = 0,
                 prefill_slice: float = 0.1):
        self.runner = runner
        self.pool = pool
        self.name = name  # for error messages: the model's path
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.max_sequences = max_sequences
        self.step_tokens = step_tokens
        self.prefill_window = prefill_window  # tokens of a prompt one windowed step takes (0: chunks only)
        self.prefill_slice = prefill_slice  # seconds of a window's work between the other steps
        self._window: tuple[Request, "Sliced"] | None = None  # the long prompt's step under way
        self.max_queue = max_queue  # None: no limit
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._in_step: set[int] = set()
        self._promised: dict[bytes, Request] = {}  # page key -> the live request computing that page now
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False
        self._admissions = 0
        self.preemptions = 0
        self._mean_seconds = 5.0  # running mean of a request's time in the engine, for retry_after
        # A lone decoding sequence runs its steps on the compute thread without a trip per token (see the
        # module docstring); False: every step is scheduled from the loop (tests compare the two).
        self.solo_decode = True
        self._stop_solo = False  # set on the loop thread: the compute thread's loop hands back at its next step
        # The pool while a lone sequence's loop changes it on the compute thread: stats() reads it from the loop.
        self._pool_lock = threading.Lock()
        self._loads: set[asyncio.Task] = set()  # pages coming from the disk prefix cache (kv_disk)
        self.spec_costs = Costs()  # what a step's extra rows cost, for the drafts' length
        self.ngram_cache = NgramCache()  # finished requests' n-grams, drafts for later ones
        self.draft = None  # a draft model (clutor.model.draft.DraftModel) for requests in mode "draft"
        self.spec_drafted = 0  # drafted tokens verified, and those kept (the server's /metrics)
        self.spec_accepted = 0

    @property
    def page_bytes(self) -> int:
        """KV bytes of one page (PAGE positions of every layer)."""
        return self.pool.page_bytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one position of one sequence takes (kv_type's, every layer; a page holds PAGE)."""
        return self.pool.page_bytes // PAGE

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
        """Queue a request (checked first: ClutorError, or BudgetError when it could never fit the KV
        budget); QueueFullError when max_queue are waiting."""
        if self._closed:
            raise ClosedError(f"{self.name}: model is closed")
        if req.kind not in ("generate", "logits", "embed"):
            raise ClutorError(f"unknown request kind {req.kind!r}")
        if req.kind == "embed" and req.pooling not in ("mean", "last"):
            raise ClutorError(f"pooling must be 'mean' or 'last', got {req.pooling!r}")
        req.prompt = self.check(req.prompt)
        req.checkpoints = tuple(sorted(p for p in set(req.checkpoints) if 0 < p < len(req.prompt)))
        positions = len(req.prompt) + (max(req.max_new, 1) - 1 if req.kind == "generate" else 0)
        need = self.pool.bytes_for(positions)
        if need > self.pool.budget:
            raise BudgetError(f"this request needs {format_bytes(need)} of KV cache ({positions} positions: "
                              f"{len(req.prompt)} prompt + {positions - len(req.prompt)} generated, "
                              f"{format_bytes(self.bytes_per_token)} each), more than the whole KV budget of "
                              f"{format_bytes(self.pool.budget)}: ask for fewer tokens, or open the model with "
                              "a larger kv_cache")
        if self.max_queue is not None and len(self._waiting) >= self.max_queue:
            retry = self.retry_after()
            raise QueueFullError(f"the engine is at capacity ({len(self._active)} running, {len(self._waiting)} "
                                 f"queued); retry after {retry} s", retry)
        req.history = list(req.prompt)
        req.todo = list(req.prompt)
        if req.speculative is not None and req.kind == "generate" and req.logits_processor is None:
            if self.pool.recurrent:
                log.info("speculative decoding is off for this model: its recurrent layers' states are not "
                         "rolled back")
            else:
                req.spec = SpecState(req.speculative, self.ngram_cache, self.draft)
        req.prompt_keys = self.pool.chain_keys(req.prompt, len(req.prompt) // PAGE)
        req.t_submitted = time.perf_counter()
        self._waiting.append(req)
        self._stop_solo = True  # a lone sequence's loop hands back at its next step: this one joins the batch
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
        self._stop_solo = True
        if req in self._waiting:
            self._waiting.remove(req)
            if req.disk != "loading":  # (a load under way unpins when it ends)
                self._unpin(req)
            if req.spec is not None:
                req.spec.close()
        elif id(req) not in self._in_step and not self._windowed(req):
            self._retire(req)
        if self._wake is not None:
            self._wake.set()  # its room may let a waiting request in

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the queue ahead drained max_sequences at a time."""
        waves = (len(self._waiting) + 1) / self.max_sequences
        return max(1, min(60, math.ceil(waves * self._mean_seconds)))

    def stats(self) -> EngineStats:
        with self._pool_lock:
            ps = self.pool.stats()
        return EngineStats(
            live_sequences=len(self._active), queued=len(self._waiting), kv_bytes=ps.live_bytes,
            prefix_entries=ps.cached_pages, prefix_bytes=ps.cached_bytes,
            steps=self.runner.steps, step_rows=self.runner.rows, kv_budget=ps.budget, kv_resident=ps.resident_bytes,
            shared_pages=ps.shared_pages, preemptions=self.preemptions)

    async def aclose(self) -> None:
        """Fail every request not finished, after the step under way (it may hold pinned experts)."""
        self._closed = True
        self._stop_solo = True
        for req in list(self._waiting) + list(self._active):
            req._events.put_nowait(ClosedError(f"{self.name}: model closed during generation"))
        for req in self._waiting:
            if req.disk != "loading":
                self._unpin(req)
        self._waiting.clear()
        if self._wake is not None:
            self._wake.set()
        if self._loads:  # their reads land in pool pages: over before the pool closes
            await asyncio.gather(*self._loads, return_exceptions=True)
        if self._task is not None:
            try:
                await self._task
            except BaseException:
                pass
        for req in list(self._active):
            self._drop(req)

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
        try:
            while not self._closed:
                self._admit()
                if self._window is None:
                    self._start_window()
                await self._draft_ahead()
                batch = self._schedule()
                if not batch and self._window is None:
                    if self._closed or (not self._waiting and not self._active):
                        return  # the next submit starts a new task
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if batch:
                    if self._window is None and self._solo_ready(batch):
                        await self._solo(batch[0][0])
                    else:
                        await self._step(batch)
                if self._window is not None:
                    await self._advance_window()
        finally:
            if self._window is not None:  # closed (or failed) between two slices: nothing of it is pinned
                self._drop(self._end_window(abandon=True))

    # -- a long prompt's window --------------------------------------------------------------------
    def _windowed(self, req: "Request") -> bool:
        return self._window is not None and self._window[0] is req

    def _long(self, r: "Request") -> bool:
        """r's next step would be a prompt window (windows on, its prompt left longer than a chunk)."""
        return self.prefill_window > self.step_tokens and len(r.todo) > self.step_tokens

    def _start_window(self) -> None:
        """The oldest long prompt's next window, its pages reserved, as a step to run in slices."""
        r = min((q for q in self._active if self._long(q)), key=lambda q: q.admitted, default=None)
        if r is None:
            return
        n = min(len(r.todo), self.prefill_window)
        if not self._reserve(r, n, []):
            return
        plan = self._plan([(r, n)])
        r.copies = []
        r.started = True
        self._window = r, self.runner.start(plan)

    async def _advance_window(self) -> None:
        """One slice of the window's work; its outcome applied once it has finished."""
        r, job = self._window
        try:
            finished = await self.runner.run_slice(job, self.prefill_slice)
        except Exception as e:  # noqa: BLE001 - the window's error is its request's, never lost
            self._fail(self._end_window(abandon=False), e)
            return
        if not finished:
            if r.released:  # its reader left: the rest of the window is not computed
                self._retire(self._end_window(abandon=True))
            return
        self._end_window(abandon=False)
        oc = job.outcomes[0]
        if oc.error is not None:
            self._fail(r, oc.error)
            return
        r.ledger.windows += 1
        self._apply(r, job.plan.segments[0], oc.value, time.perf_counter(), _put)
        if r.released or r.done:
            self._retire(r)
        if self._waiting:
            self._wake.set()

    def _end_window(self, abandon: bool) -> "Request":
        """The window's step over (finished, failed, or abandoned at a pause: closed), its page copies'
        sources unpinned; its request returned, still to be applied, failed or retired."""
        r, job = self._window
        self._window = None
        if abandon:
            job.close()
        if job.plan.copies:
            self.pool.done(job.plan.copies)
        return r

    def _admit(self) -> None:
        """Waiting requests into the batch, oldest first, while there is a place and KV room; one that
        waits for a page another request is computing lets those behind it go first."""
        skipped: list[Request] = []
        try:
            while self._waiting and len(self._active) < self.max_sequences:
                req = self._waiting[0]  # taken off the queue only once admitted: a failure here still reaches it
                tokens = req.held + req.todo  # a resumed request: everything it had, recomputed where not kept
                if self._active and self.pool.room < self.pool.bytes_for(min(len(tokens), self.step_tokens)):
                    break  # no room for its first chunk yet: it would only be set aside again
                match = None
                if req.kind == "generate":
                    keys = req.keys + req.prompt_keys[len(req.keys):]
                    if req.disk == "loading":
                        skipped.append(self._waiting.popleft())
                        continue
                    match = self.pool.match(tokens, len(tokens) - 1, keys=keys)
                    if not req.disk and self.pool.disk_extends(keys[: (len(tokens) - 1) // PAGE], match.n // PAGE):
                        self._load_prefix(req, keys[: (len(tokens) - 1) // PAGE])
                        skipped.append(self._waiting.popleft())  # the others go first while it loads
                        continue
                    nxt = match.n // PAGE
                    owner = self._promised.get(req.prompt_keys[nxt]) if nxt < len(req.prompt_keys) else None
                    if owner is not None and owner is not req and owner in self._active:
                        skipped.append(self._waiting.popleft())  # its next page is being computed: take it when published
                        continue
                try:
                    seq = self.pool.sequence()
                    req.copies = self.pool.adopt(seq, match) if match is not None and match.n else []
                except NoRoom:
                    break
                self._waiting.popleft()
                self._unpin(req)  # its sequence holds what it adopted
                req.seq = seq
                req.held, req.todo = tokens[: seq.n], tokens[seq.n :]
                known = req.keys if len(req.keys) >= len(req.prompt_keys) else req.prompt_keys  # keys of tokens' pages
                req.keys = known[: seq.n // PAGE]
                req.started = False
                if not req.preempted:
                    req.cached_tokens = seq.n
                    req.disk_tokens = min(req.disk_tokens, seq.n)
                    req.t_admitted = time.perf_counter()
                self._admissions += 1
                req.admitted = self._admissions
                self._active.append(req)
                for key in req.prompt_keys[seq.n // PAGE :]:
                    self._promised.setdefault(key, req)
        finally:
            self._waiting.extendleft(reversed(skipped))

    def _load_prefix(self, req: Request, keys: list[bytes]) -> None:
        """Start loading the pages of req's prompt the disk prefix cache holds (pinning those the pool
        holds); req waits in the queue until they are in, then matches them as any kept pages."""
        req.disk = "loading"
        with self._pool_lock:
            req.pins, loads = self.pool.take_prefix(keys)
        task = asyncio.get_running_loop().create_task(self._load_pages(req, loads), name="clutor-kv-disk-load")
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    async def _load_pages(self, req: Request, loads: list) -> None:
        got = [None] * len(loads)
        try:
            got = await self.pool.disk.load(loads)
        except Exception as e:  # noqa: BLE001 - a prefix not loaded is computed
            log.warning("prefix cache on disk: loading %d pages failed (%s: %s); their positions are computed",
                        len(loads), type(e).__name__, e)
        finally:
            self.settle_pages(loads, got)
            full = next(gi for gi, g in enumerate(self.pool.groups) if not g.window)  # (disk_extends: one exists)
            req.disk_tokens = PAGE * sum(1 for ld, t in zip(loads, got) if t is not None and ld.gi == full)
            req.disk = "tried"
            if req.released or self._closed:
                self._unpin(req)
            if self._wake is not None:
                self._wake.set()

    def _unpin(self, req: Request) -> None:
        if req.pins:
            pins, req.pins = req.pins, []
            self.unpin(pins)

    # -- pages held outside a request (clutor.model.slots) -------------------------------------------
    def hold_chain(self, keys: Sequence[bytes]):
        """KVPool.hold_chain under the pool's lock (a lone sequence's loop may be changing it)."""
        with self._pool_lock:
            return self.pool.hold_chain(keys)

    def take_pages(self, want):
        """KVPool.take_pages under the pool's lock: (pins, loads, held); the loads go to settle_pages."""
        with self._pool_lock:
            return self.pool.take_pages(want)

    def settle_pages(self, loads, tokens) -> None:
        with self._pool_lock:
            for ld, t in zip(loads, tokens):
                self.pool.settle(ld, t)

    def unpin(self, pins) -> None:
        if pins:
            with self._pool_lock:
                self.pool.unpin(pins)
            if self._wake is not None:
                self._wake.set()  # their room may let a waiting request in

    def _schedule(self) -> list[tuple[Request, int]]:
        """Every decoding sequence's one token, then prompt chunks (oldest first) in what is left of
        the step's token budget (at least a small chunk, so decoding never starves a prompt), each
        with the pages it writes reserved; preempting the most recent requests when the pool is full."""
        batch: list[tuple[Request, int]] = []
        decoding = [r for r in self._active if r.n_gen > 0 and len(r.todo) == 1]
        # a long prompt waits for its window (the one under way, or the next), never goes in chunks
        prefilling = [r for r in self._active if not (r.n_gen > 0 and len(r.todo) == 1) and not self._long(r)]
        room = max(self.step_tokens - len(decoding), min(32, self.step_tokens))
        for r in decoding + prefilling:
            if r not in self._active:  # preempted while planning this step
                continue
            if r in decoding:
                n = 1 + (len(r.spec.draft) if r.spec is not None and r.spec.heavy else self._draft(r, len(decoding)))
            else:
                if room <= 0:
                    continue
                n = min(len(r.todo), room)
                if self.pool.recurrent:  # stop at a checkpoint: a recurrent state is only there between steps
                    at = len(r.held)
                    n = min([n] + [p - at for p in r.checkpoints if at < p < at + n])
            if n > 1 and r in decoding and self.pool.room < self.pool.bytes_for(n + PAGE):
                r.spec.draft, n = [], 1  # no room for the draft's rows: plain decoding, nobody preempted for it
            if not self._reserve(r, n, batch):
                continue
            batch.append((r, n))
            if r not in decoding:
                room -= n
        return batch

    async def _draft_ahead(self) -> None:
        """The draft model's drafts for the sequences the next step decodes, on the compute thread
        (_schedule, on the loop, takes them as planned)."""
        decoding = [r for r in self._active if r.n_gen > 0 and len(r.todo) == 1]
        heavy = [r for r in decoding if r.spec is not None and r.spec.heavy and not r.spec.draft]
        if heavy:
            n = len(decoding)
            await compute(lambda: [self._draft(r, n) for r in heavy])

    def _draft(self, r: Request, n_decoding: int) -> int:
        """r's draft for its next step (clutor.model.speculative), its length: within max_new and the
        context, and shorter when more sequences decode (their step already shares its reads)."""
        s = r.spec
        if s is None:
            return 0
        cap = min(r.max_new - r.n_gen - 1, self.n_ctx - r.seq.n - 1, s.params.draft_max // max(1, n_decoding))
        return len(s.plan(r.history, self.spec_costs, cap))

    def _reserve(self, r: Request, n: int, batch: list[tuple[Request, int]]) -> bool:
        """Pages for r's next n positions, preempting later-admitted requests not in this step while the
        pool is short. False when r itself must wait (it is then set aside unless nothing else runs)."""
        while True:
            try:
                r.copies += self.pool.reserve(r.seq, r.seq.n + n)
                return True
            except NoRoom as e:
                planned = {id(q) for q, _ in batch} | ({id(self._window[0])} if self._window else set())
                victims = [q for q in self._active if q is not r and id(q) not in planned]
                victim = max(victims, key=lambda q: q.admitted, default=None)
                if victim is not None and victim.admitted > r.admitted:
                    self._preempt(victim)
                    continue
                if batch or victims:
                    # earlier requests hold the room: r waits its turn (set aside, resumed when it frees)
                    self._preempt(r)
                    return False
                err = BudgetError(f"the KV budget of {format_bytes(self.pool.budget)} cannot hold this request "
                                  f"at {r.seq.n + n} positions ({format_bytes(e.need)} more needed, "
                                  f"{format_bytes(e.free)} free): open the model with a larger kv_cache")
                self._fail(r, err)
                return False

    def _preempt(self, req: Request) -> None:
        """Set req aside: its pages go back (kept for reuse where computed), it waits at the front of the
        queue, and resumes from what the pool still holds of it."""
        if req.started:  # (one that never ran since it was admitted only waits longer)
            self.preemptions += 1
            req.preempted += 1
        self._active.remove(req)
        self._forget_promises(req)
        seq, req.seq = req.seq, None
        if req.copies:
            self.pool.done(req.copies)
            req.copies = []
        self.pool.release(seq)
        req.todo = req.held + req.todo
        req.held = []
        if req.spec is not None:
            req.spec.draft = []
        self._waiting.appendleft(req)

    def _plan(self, batch: list[tuple[Request, int]]) -> StepPlan:
        items, heads, copies, ledgers = [], [], [], []
        for r, n in batch:
            ledgers.append(r.ledger)
            last = n == len(r.todo)  # the step reaches the end of what it had to feed
            if r.kind == "logits":
                want, head = Want.ALL, None
            elif r.kind == "embed":
                want, head = Want.HIDDEN, _pooler(r)
            elif r.spec is not None and r.spec.draft and n == 1 + len(r.spec.draft):
                items.append((r.seq, r.todo[:1] + r.spec.draft, Want.ALL))
                heads.append(verifier(r, _sampler(r), r.spec.draft))
                copies += r.copies
                continue
            else:
                want, head = (Want.LAST, _sampler(r)) if last else (Want.NOTHING, None)
            items.append((r.seq, r.todo[:n], want))
            heads.append(head)
            copies += r.copies
        return StepPlan.build(items, heads, ledgers, copies=copies)

    async def _step(self, batch: list[tuple[Request, int]]) -> None:
        reqs = [r for r, _ in batch]
        plan = self._plan(batch)
        for r in reqs:
            r.copies = []  # in the plan now: their sources are unpinned once, after the step
            r.started = True
        self._in_step = {id(r) for r in reqs}
        failure: Exception | None = None
        t0 = time.perf_counter()
        try:
            outcomes = await self.runner.run(plan)
            if len(reqs) == 1 and reqs[0].n_gen:
                self.spec_costs.observe(plan.rows, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - handed to the requests of this step, never lost
            failure = e
        finally:
            self._in_step = set()
            if plan.copies:
                self.pool.done(plan.copies)
        if failure is not None:
            for r in reqs:
                self._fail(r, failure)
            return
        now = time.perf_counter()
        for r, seg, oc in zip(reqs, plan.segments, outcomes):
            if oc.error is not None:
                self._fail(r, oc.error)
                continue
            self._apply(r, seg, oc.value, now, _put)
            if r.released or r.done:
                self._retire(r)
        if self._waiting:
            self._wake.set()

    def _apply(self, r: Request, seg, value, now: float, post: Callable, last: Callable | None = None) -> None:
        """One segment's outcome to its request: the ids it fed are held (their pages published for
        reuse), and a generated token goes to the reader through post(fn, event). Runs on the loop, or
        on the compute thread in a lone sequence's loop (then post is call_soon_threadsafe, and the
        request's last event goes to last(fn, event) instead: the loop posts it once it has retired the
        request, so a reader that has its last token sees the request's pages back in the pool)."""
        fed = seg.ids.tolist()
        del r.todo[: len(fed)]
        tokens = [value] if value is not None else []
        if isinstance(value, list):  # a verified draft: the tokens its rows gave, one per row kept
            tokens = value
            fed = fed[: len(tokens)]  # the last token and the drafts kept; the rows after them are cut
            if r.seq.n > len(r.held) + len(fed):
                self.pool.truncate(r.seq, len(r.held) + len(fed))
            self.spec_drafted += len(r.spec.draft)
            self.spec_accepted += len(fed) - 1
            r.spec.settle(len(fed) - 1)
        r.held.extend(fed)
        n_keys = len(r.keys)
        self.pool.publish(r.seq, r.held, r.keys)
        self.pool.trim_window(r.seq)
        for key in r.keys[n_keys:]:  # pages now published: whoever waited for them takes them
            if self._promised.get(key) is r:
                del self._promised[key]
        if r.n_gen == 0 and (len(r.held) == len(r.prompt) or len(r.held) in r.checkpoints):
            self.pool.save_checkpoint(r.seq, r.held, r.keys)  # recurrent states at the prompt's end, or asked
        if r.kind != "generate":
            r._pieces.append(value)
            if not r.todo and not r.released:
                post(r._events.put_nowait, _result(r))
                r.done = True
        elif not r.released:
            for token, extra in tokens:
                r.n_gen += 1
                r.history.append(token)
                if r.n_gen == 1:
                    r.t_first = now
                reason = "eos" if token in r.stop_ids else "length" if r.n_gen >= r.max_new else None
                (post if reason is None or last is None else last)(r._events.put_nowait, (token, extra, reason))
                if reason is not None:
                    r.done = True
                    break
            if tokens and not r.done:
                r.todo.append(tokens[-1][0])

    # -- a lone sequence's decode loop, on the compute thread ---------------------------------------
    def _solo_ready(self, batch: list[tuple[Request, int]]) -> bool:
        """The step is one sequence's decode token and nothing waits for admission."""
        if not self.solo_decode or len(batch) != 1 or self._waiting:
            return False
        r, n = batch[0]
        return r.kind == "generate" and r.n_gen > 0 and len(r.todo) == 1 and n == 1 + len(r.spec.draft if r.spec else ())

    async def _solo(self, r: Request) -> None:
        """Run r's decode steps on the compute thread until it hands back (see _solo_steps), then
        what the loop owns: retiring it when it ended, failing it when a step failed."""
        loop = asyncio.get_running_loop()
        self._stop_solo = False
        self._in_step = {id(r)}

        def stop() -> None:  # the loop's side of a hand-back: a submit, a release, a close, cancellation
            self._stop_solo = True

        final: list = []  # the request's last event, held back until it is retired
        try:
            failure = await self.runner.run_solo(self._solo_steps, r, loop.call_soon_threadsafe,
                                                 lambda fn, ev: final.append((fn, ev)), on_cancel=stop)
        finally:
            self._in_step = set()
        if failure is not None:
            self._fail(r, failure)
        elif r.released or r.done:
            self._retire(r)
        for fn, ev in final:
            fn(ev)

    def _solo_steps(self, r: Request, post: Callable, last: Callable, run_now: Callable, asked: Callable[[], bool]):
        """Compute thread: r's decode steps one after another, each planned, run (run_now, the runner's
        synchronous step) and applied as a batched step of one would be, each token posted to the
        loop (its last one to last(), posted by the loop after retiring r). Returns None when it hands
        back (the loop retires r if it ended), or the error that failed r. Its first step's pages were
        reserved by the scheduler."""
        first = True
        while True:
            n = 1 + (len(r.spec.draft) if r.spec else 0)
            if not first:
                if self._stop_solo or self._waiting or self._closed or r.released or asked():
                    return None
                n = 1 + self._draft(r, 1)
                try:
                    with self._pool_lock:
                        try:
                            r.copies += self.pool.reserve(r.seq, r.seq.n + n)
                        except NoRoom:
                            if n == 1:
                                raise
                            r.spec.draft, n = [], 1  # no room for the draft's rows: plain decoding
                            r.copies += self.pool.reserve(r.seq, r.seq.n + 1)
                except NoRoom:
                    return None  # the scheduler preempts, or fails it with the numbers
                except ClutorError as e:
                    return e
            first = False
            plan = self._plan([(r, n)])
            r.copies = []
            r.started = True
            t0 = time.perf_counter()
            try:
                oc = run_now(plan)[0]
                self.spec_costs.observe(n, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - the step failed: r's error, handed to the loop
                return e
            finally:
                if plan.copies:
                    with self._pool_lock:
                        self.pool.done(plan.copies)
            if oc.error is not None:
                return oc.error
            with self._pool_lock:
                self._apply(r, plan.segments[0], oc.value, time.perf_counter(), post, last)
            if r.done:
                return None

    def _fail(self, req: Request, e: BaseException) -> None:
        err = e if isinstance(e, ClutorError) else ClutorError(f"generation failed: {type(e).__name__}: {e}")
        if err is not e:
            err.__cause__ = e
        req._events.put_nowait(err)
        self._drop(req)

    def _retire(self, req: Request) -> None:
        """Out of the batch; its computed pages kept for reuse (recurrent states were kept where asked);
        what it generated (and its prompt's end) drafts for later requests."""
        if req in self._active:
            if req.spec is not None and req.n_gen:
                p = req.spec.params
                self.ngram_cache.add(req.history, range(p.ngram_min, p.ngram_max + 1), req.n_gen + 512)
            self._active.remove(req)
            self._forget_promises(req)
            if req.seq is not None:
                self.pool.release(req.seq)
        if req.spec is not None:
            req.spec.close()
        req.seq = None

    def _drop(self, req: Request) -> None:
        """Out of the batch after a failure: positions of the failed step were never published, so
        nothing it wrote is reused."""
        if req in self._active:
            self._active.remove(req)
            self._forget_promises(req)
        if req.seq is not None:
            if req.copies:
                self.pool.done(req.copies)
                req.copies = []
            self.pool.release(req.seq)
        if req.spec is not None:
            req.spec.close()
        req.seq = None

    def _forget_promises(self, req: Request) -> None:
        for key in req.prompt_keys:
            if self._promised.get(key) is req:
                del self._promised[key]


def _put(fn: Callable, event) -> None:
    fn(event)


def _sampler(req: Request) -> Callable[[np.ndarray], tuple[int, object]]:
    """The head of a generate request's step (on the compute thread): the next token from its last
    row of logits [1, V], after its logits processor."""
    def head(logits: np.ndarray):
        raw = row = np.asarray(logits[-1], dtype=np.float32)  # [V]
        if req.logits_processor is not None:
            row = np.asarray(req.logits_processor(req.history, raw.copy()), dtype=np.float32)
            if row.shape != raw.shape:
                raise ClutorError(f"the logits processor returned shape {row.shape}, expected {raw.shape}")
        if req.sample is not None:
            return req.sample(req, row, raw)
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
