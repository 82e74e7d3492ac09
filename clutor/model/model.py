"""Model: the public facade. Open a GGUF MoE file; generate, chat, logits, embeddings.

What runs underneath, one job per module: the engine (clutor.model.engine) schedules every request
into batched steps; the runner (clutor.model.runner) executes a step through the layers, awaiting each
layer's routed experts from an ExpertSource (mapped from the file, or streamed by the ExpertStore)
without knowing which one it has.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Sequence

import numpy as np

from .._util import AwaitableContext, sleeping_kernel_workers
from ..io.trace import TraceHeader, TraceWriter, check_output
from ..errors import BudgetError, ClosedError, ClutorError, ModelFileError
from ..units import format_bytes, parse_bytes
from .arch import Arch, read_arch
from .gguf import GGUFFile
from . import kernels
from .engine import Engine, Request
from .kv import PAGE, KVPool, NoRoom, sizes as kv_sizes
from .kv_disk import DiskPages
from .kv_pages import PageFormat, file_identity
from .slots import Restored, Saved, restore_slot, save_slot
from .options import (DEFAULTS, ModelOptions, mem_available, resolve_budget, resolve_ctx, resolve_kv_budget,
                      resolve_window, window_bytes_per_token)
from .plan import StepPlan, Want
from .profile import NO_PROFILE, Profile
from .runner import Runner
from .source import ExpertSource, InMemoryExperts
from .state import SequenceState
from .tokenizer import Tokenizer
from .weights import DenseWeights, expert_layout, load_dense, resident_bytes

if TYPE_CHECKING:
    from .generate import GenerationChunk

__all__ = ["Model", "SequenceState"]


class Model:
    """A MoE model ready to run. Create with ``await Model.open(path)`` or ``async with Model.open(path)``."""

    def __init__(self, path: str, f: GGUFFile, arch: Arch, dense: DenseWeights, tokenizer: Tokenizer,
                 experts: ExpertSource, kv: KVPool, n_ctx: int, *, options: ModelOptions, cache_note: str,
                 kv_note: str = "", trace: TraceWriter | None = None, window: tuple[int, str] = (0, "off"),
                 ctx_note: str = "as asked"):
        cfg = arch.cfg
        self.path = path
        self.arch = arch
        self.config = cfg
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.ctx_note = ctx_note  # how n_ctx was chosen: the file's context_length, shortened, or as asked
        self._file = f
        self._w = dense
        self._experts = experts
        self._closed = False
        self.options = options
        self.cache_note = cache_note  # how the expert cache size was chosen (said in the report)
        self.kv = kv                  # every sequence's KV pages, under the kv_cache budget (clutor.model.kv)
        self.kv_note = kv_note        # how that budget was chosen
        self._format: PageFormat | None = None  # the KV pages' file format (saved slots), made when first asked
        self._trace = trace
        self.draft = None  # the draft model (clutor.model.draft.DraftModel), where draft_model was given
        self.profile: Profile = Profile() if options.profile else NO_PROFILE  # where the steps' time goes
        self.kernels = options.kernels  # how this model's products compute (activations, threads)
        if arch.ggml_f16_sums:  # F16 products in llama.cpp's order (slower; only where a model needs it)
            self.kernels = dataclasses.replace(self.kernels, ggml_f16=True)
        for w in dense.matrices():
            w.kernels = self.kernels
        # Prefetch (decode steps only). None, the default: in every decode step, one sequence's or a batch's,
        # where the disk idles while a layer's late experts, the next layer's attention and router and the
        # output head compute, and prefetch reads only an idle disk (on real routing, quiet: one stream
        # 21.3 vs 16.6 tok/s; four streams 32.2-33.2 vs 30.1-30.5, docs/benchmarks.md); not with a cache of
        # fewer than 1.5 tokens' experts, where each wrong guess evicts what the next token needs
        # (runner.PREFETCH_MIN_TOKENS). True: every decode step; False: never.
        prefetch = False if options.io == "memory" else options.prefetch
        self.runner = Runner(arch, dense, experts, kv, n_ctx=n_ctx, kernels_=self.kernels, prefetch=prefetch,
                             tile_rows=options.step_tokens, slice_seconds=options.prefill_slice_ms / 1000,
                             profile=self.profile, trace=trace)
        self.prefill_window, self.window_note = window  # tokens of a prompt one prefill step takes (0: chunks)
        self.engine = Engine(self.runner, kv, name=path, n_vocab=cfg.n_vocab, n_ctx=n_ctx,
                             max_sequences=options.max_sequences, step_tokens=options.step_tokens,
                             prefill_window=self.prefill_window, prefill_slice=options.prefill_slice_ms / 1000)

    # ---- lifecycle -------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, n_ctx: int | None = DEFAULTS.n_ctx,
             expert_cache: int | str | None = DEFAULTS.expert_cache, prefetch: bool | None = DEFAULTS.prefetch,
             policy: str = DEFAULTS.policy, io: str = DEFAULTS.io, direct: bool = DEFAULTS.direct,
             trace: str | os.PathLike | None = None, max_sequences: int = DEFAULTS.max_sequences,
             step_tokens: int = DEFAULTS.step_tokens, prefill_window: int | None = DEFAULTS.prefill_window,
             prefill_slice_ms: float = DEFAULTS.prefill_slice_ms, prefix_cache: int | str = DEFAULTS.prefix_cache,
             prefix_cache_disk: str | os.PathLike | None = DEFAULTS.prefix_cache_disk,
             prefix_cache_disk_size: int | str = DEFAULTS.prefix_cache_disk_size,
             kv_cache: int | str | None = DEFAULTS.kv_cache, kv_type: str = DEFAULTS.kv_type,
             activations: str = DEFAULTS.activations, threads: int | None = DEFAULTS.threads,
             speculative=DEFAULTS.speculative, draft_model: str | os.PathLike | None = None, profile: bool = False,
             progress: Callable[[int, int], None] | None = None) -> AwaitableContext["Model"]:
        """Open a GGUF MoE model.

        n_ctx: context length. Default: the file's context_length, shortened (not below 4096) where one
            sequence's KV at it would take more than half of the memory left after the dense weights and
            the expert cache. Longer than context_length only where the file's RoPE scaling (YaRN) reaches.
        expert_cache: bytes for routed experts: an int, "3GiB", or "25%" of all expert bytes; None picks
            half of the memory available after the dense weights (capped at what all experts need).
        prefetch: during decode, read the experts predicted for the next MoE layer (after the last, the
            next token's first) while this one computes, whenever no demand read is in flight. None
            (default): in decode steps (one sequence's or a batch's), when the cache holds at least 1.5
            tokens' experts (every MoE layer's top-k); True: every decode step; False: never (measured on
            real routing in docs/benchmarks.md).
        policy: cache replacement policy (see clutor.io.policies.POLICIES).
        io: "auto" (io_uring, else threads), "uring", "threads", or "memory" (mmap the file, no cache).
        direct: O_DIRECT reads that bypass the page cache (falls back to buffered where refused).
        trace: write the routing of every token to this JSONL file (the simulator's format).
        max_sequences: generations advanced together in one batched step; more wait their turn.
        step_tokens: tokens one step computes at most over all sequences: long prompts are prefilled in
            chunks of what is left after every decoding sequence's token, so they never freeze the others;
            a long prompt's window runs its attention in tiles of step_tokens.
        prefill_window: tokens of a long prompt one prefill step takes, every layer's experts read once for
            all of them (in chunks of step_tokens, a prompt reads each expert once per chunk). None
            (default): as many as half of the memory left after the dense weights, the expert cache and the
            KV pool holds (clutor.model.options.window_bytes_per_token), at most n_ctx; 0: off. Recurrent
            architectures (their states are checkpointed per step) prefill in chunks.
        prefill_slice_ms: a long prompt's window pauses after about this much work to let the other
            sequences' decode steps run, so a long prompt never freezes them.
        prefix_cache: KV bytes of finished sequences kept (least recently used out) so that a prompt
            starting with the same tokens (the next turn of a chat) reuses them; 0 turns it off. They
            live in the KV pool and are given up first when live sequences need the room.
        prefix_cache_disk: a directory where every full KV page is also written (clutor.model.kv_disk), so
            a prompt that starts like one seen before, since this process or an earlier one, loads those
            pages instead of computing them. Pages are checked (the model file, kv_type, tokens, checksum)
            and any that do not match are computed. None (default): off. Not for recurrent architectures.
        prefix_cache_disk_size: the bytes its files may take ("20GiB"), least recently used removed first.
        kv_cache: bytes for the KV pool, where every sequence's keys and values live in pages (live
            ones, and those kept for prefix reuse): an int, "2GiB", or "10%" of the available memory;
            None picks half of the memory available after the dense weights and the expert cache, capped
            at what max_sequences full contexts can use. Requests are admitted, and grow, within it; when
            it is full the most recent request is set aside and resumed later (recomputing what it lost),
            and a request that could never fit is refused with the numbers.
        kv_type: "f16" (default, as llama.cpp's), "f32", or "q8_0" (int8 with a float16 scale per 32
            values, as llama.cpp's): what the pool stores keys and values as.
        activations: "auto" (default), "q8" (int8 activations with integer dot products, as llama.cpp
            computes; x86 AVX2) or "f32" (float activations, exact up to float rounding); see
            clutor.model.kernel_settings.
        threads: threads each matrix product is split over (default: the CPUs this process may use).
        speculative: draft tokens and verify them in one step (clutor.model.speculative): "ngram" (prompt
            lookup over the request, then n-grams of earlier requests), a dict of SpeculativeParams' fields
            (draft_max, draft_min, ngram_max, ngram_min, adaptive), or None (default): off. Per request,
            generate(speculative=...) overrides it. Greedy and seeded output is the same as without it in
            q8 activations (rows of one step keep their own bits); off with a logits processor (grammars)
            and for architectures with recurrent layers.
        draft_model: a small GGUF model with this one's vocabulary (clutor.model.draft), opened in RAM
            beside it: requests draft with it (speculative "draft", the default once it is given), greedily,
            up to draft_max tokens, stopping where its next token is less likely than draft_p_min.
        profile: time every step's spans (attention, router, experts, waiting for reads, ...) into
            ``model.profile`` (clutor.model.profile; ``clutor bench --profile`` prints it).
        progress: called as progress(bytes_read, dense_bytes) while the dense weights load (from a thread).

        The first open in a process sets OMP_WAIT_POLICY=PASSIVE and OPENBLAS_THREAD_TIMEOUT=4
        unless the application has set them: the kernels' OpenMP workers and OpenBLAS's threads then
        sleep between calls instead of spinning against each other, the event loop and other
        processes (clutor._util.sleeping_kernel_workers). OpenBLAS reads its variable when numpy is
        first imported, so an application sets it before that to get the full prefill speed.
        """
        sleeping_kernel_workers()
        opts = ModelOptions(n_ctx=n_ctx, expert_cache=expert_cache, prefetch=prefetch, policy=policy, io=io,
                            direct=direct, trace=os.fspath(trace) if trace is not None else None,
                            max_sequences=max_sequences, step_tokens=step_tokens, prefill_window=prefill_window,
                            prefill_slice_ms=prefill_slice_ms, prefix_cache=prefix_cache,
                            prefix_cache_disk=os.fspath(prefix_cache_disk) if prefix_cache_disk is not None else None,
                            prefix_cache_disk_size=prefix_cache_disk_size,
                            kv_cache=kv_cache, kv_type=kv_type, activations=activations, threads=threads,
                            speculative=speculative,
                            draft_model=os.fspath(draft_model) if draft_model is not None else None, profile=profile)
        return AwaitableContext(lambda: cls._open(os.fspath(path), opts, progress))

    @classmethod
    async def _open(cls, path: str, opts: ModelOptions, progress=None) -> "Model":
        # Parsing and reading the dense weights are blocking file I/O: keep them off the event loop.
        # Everything that can be refused (file, context, budget) is checked before the dense read.
        def load():
            f = GGUFFile.open(path)
            try:
                arch = read_arch(f)
                cfg = arch.cfg
                tok = Tokenizer.from_metadata(f.metadata, path)
                if tok.n_vocab != cfg.n_vocab:
                    raise ModelFileError(path, "tokenizer.ggml.tokens", f"{cfg.n_vocab} tokens (rows of token_embd)", tok.n_vocab)
                layout = expert_layout(f, arch)
                if opts.trace:
                    check_output(opts.trace, f.paths)  # refused before the dense read, not after
                budget = None
                avail = mem_available()
                dense_bytes = resident_bytes(f, arch)
                if opts.io != "memory":
                    budget = resolve_budget(opts.expert_cache, layout, cfg.n_expert_used, dense_bytes, avail)
                page, state = kv_sizes(arch.layer_states(), opts.kv_type)
                free = avail - dense_bytes - (budget[0] if budget else 0)
                ctx, ctx_note = resolve_ctx(opts.n_ctx, path=str(path), n_ctx_train=cfg.n_ctx_train,
                                            limit=arch.context_limit(), page=page, page_tokens=PAGE, state=state,
                                            free=free)
                one = state + -(-ctx // PAGE) * page  # one sequence at n_ctx
                kv_budget = resolve_kv_budget(opts.kv_cache, one_context=one, all_contexts=opts.max_sequences * one,
                                              free=free, avail=avail)
                if state:  # a recurrent state is checkpointed between steps: its prompts go in chunks
                    window = 0, f"off: {cfg.arch}'s recurrent layers prefill in chunks of step_tokens"
                else:
                    window = resolve_window(opts.prefill_window, free=free - kv_budget[0], n_ctx=ctx,
                                            per_token=window_bytes_per_token(cfg.n_embd, cfg.n_expert_used, cfg.n_ff_exp),
                                            step_tokens=opts.step_tokens)
                dense = load_dense(f, arch, _progress_of(progress, dense_bytes))
                # compile (first run on this machine) or load the cached kernels now, not in the first token
                kernels.warmup(opts.kernels)
                arch.warmup()
                identity = file_identity(f) if opts.prefix_cache_disk and not state else None
            except BaseException:
                f.close()
                raise
            return f, arch, tok, dense, layout, (ctx, ctx_note), budget, kv_budget, window, identity

        f, arch, tok, dense, layout, (ctx, ctx_note), budget, kv_budget, window, identity = await asyncio.to_thread(load)
        cfg = arch.cfg
        experts: ExpertSource | None = None
        trace: TraceWriter | None = None
        pool: KVPool | None = None
        try:
            pool = KVPool(arch.layer_states(), n_ctx=ctx, budget=kv_budget[0], kv_type=opts.kv_type,
                          prefix_budget=opts.prefix_cache_bytes)
            if opts.prefix_cache_disk:
                pool.disk = await asyncio.to_thread(_disk_store, pool, opts, identity, cfg.arch)
            if budget is None:
                experts, why = InMemoryExperts(layout), "all experts mapped from the file (io=memory)"
            else:
                from ..io.store import ExpertStore

                experts = await ExpertStore.open(layout, budget[0], policy=opts.policy, io=opts.io,
                                                 direct=opts.direct, prefetch_slots=0 if opts.prefetch is False else None)
                why = budget[1]
            if opts.trace:
                # expert_bytes = the store's slot size, so `clutor simulate --budget B` models the same cache
                trace = TraceWriter(opts.trace, TraceHeader(len(cfg.moe_layers), cfg.n_expert, cfg.n_expert_used,
                                                            experts.slot_bytes), protect=f.paths)
            model = cls(path, f, arch, dense, tok, experts, pool, ctx, options=opts, cache_note=why,
                        kv_note=kv_budget[1], trace=trace, window=window, ctx_note=ctx_note)
        except BaseException:
            # Whatever failed (even a MemoryError in __init__), give back the trace, the store (ring,
            # eventfd, arena), the KV pool and the file's fds before re-raising.
            await _close_all([trace.abort if trace is not None else None,
                              experts.aclose if experts is not None else None,
                              pool.close if pool is not None else None, f.close])
            raise
        if opts.draft_model is not None:
            from .draft import DraftModel

            try:
                model.draft = model.engine.draft = await DraftModel.open(opts.draft_model, model)
            except BaseException:
                await model.aclose()
                raise
        return model

    async def aclose(self) -> None:
        """Fail generations still running (after the step under way), then free everything."""
        if self._closed:
            return
        try:
            await self.engine.aclose()
        finally:
            self._closed = True
            # Each is closed even when another one's close raises (a trace on a full disk); the first
            # error is raised after all are closed.
            await _close_all([self.draft.aclose if self.draft is not None else None,
                              self._experts.aclose, self.kv.disk.aclose if self.kv.disk is not None else None,
                              self.kv.close, self._file.close,
                              self._trace.close if self._trace is not None else None])

    @property
    def metadata(self):
        """The GGUF file's key-value metadata (read-only mapping)."""
        return self._file.metadata

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.path}: model is closed")

    # ---- forward ---------------------------------------------------------------------------
    # Every forward goes through the runner (clutor.model.runner), the one layer loop: the engine's
    # steps and the direct calls below alike.
    def new_sequence(self) -> SequenceState:
        """A fresh sequence for forward()/forward_batch(); its pages come from the model's KV pool and
        go back with ``seq.release()`` (or when it is garbage-collected)."""
        self._check_open()
        try:
            return self.kv.sequence()
        except NoRoom as e:
            raise self._no_room(e) from None

    def _no_room(self, e: NoRoom) -> BudgetError:
        return BudgetError(f"the KV pool is full ({format_bytes(e.need)} needed, {format_bytes(e.free)} free of "
                           f"kv_cache {format_bytes(self.kv.budget)}): release sequences, or open the model "
                           "with a larger kv_cache")

    async def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of a fresh sequence: float32 [len(ids), n_vocab]. Runs as a
        request of the engine, batched with whatever else is running."""
        self._check_open()
        req = self.engine.submit(Request(list(ids), kind="logits"))
        try:
            return await req.result()
        finally:
            self.engine.release(req)

    async def embed(self, ids: Sequence[int] | str, *, pooling: str = "mean", normalize: bool = True) -> np.ndarray:
        """The prompt's final normed hidden states (what the output projection reads), pooled over its
        positions ("mean", or the "last" one), float32 [n_embd]; L2-normalised unless normalize=False."""
        self._check_open()
        if isinstance(ids, str):
            ids = await asyncio.to_thread(self.tokenizer.encode, ids)
        req = self.engine.submit(Request(list(ids), kind="embed", pooling=pooling))
        try:
            v = await req.result()
        finally:
            self.engine.release(req)
        if normalize:
            norm = float(np.linalg.norm(v))
            v = v / norm if norm > 0 else v
        return v

    async def forward(self, seq: SequenceState, ids: Sequence[int], *, all_logits: bool = False) -> np.ndarray:
        """Append ids to seq (one batched pass); logits [T, V] if all_logits else [1, V] for the last."""
        return (await self.forward_batch([(seq, ids)], all_logits=all_logits))[0]

    async def forward_batch(self, batch: Sequence[tuple[SequenceState, Sequence[int]]], *,
                            all_logits: bool = False, need: Sequence[bool] | None = None) -> list:
        """One step over several sequences at once: each (seq, ids) appends its ids to its own KV
        cache at its own positions; the layers' dense products and each routed expert run once for
        all rows of the step. Returns per sequence logits [T_i, V] (all_logits) or [1, V], None
        where ``need`` says a sequence's logits are not wanted. The first error of a sequence is raised."""
        self._check_open()
        need = [True] * len(batch) if need is None else list(need)
        items = []
        for (seq, ids), ok in zip(batch, need):
            ids = self.engine.check(ids)
            if seq.n + len(ids) > seq.n_ctx:
                raise ClutorError(f"context full: {seq.n} + {len(ids)} tokens > n_ctx {seq.n_ctx} "
                                  "(open the model with a larger n_ctx)")
            items.append((seq, ids, (Want.ALL if all_logits else Want.LAST) if ok else Want.NOTHING))
        copies: list = []
        try:
            for seq, ids, _ in items:
                copies += self.kv.reserve(seq, seq.n + len(ids))
        except NoRoom as e:
            self.kv.done(copies)
            raise self._no_room(e) from None
        try:
            outcomes = await self.runner.run(StepPlan.build(items, copies=copies))
        finally:
            self.kv.done(copies)
        for oc in outcomes:
            if oc.error is not None:
                raise oc.error
        return [oc.value for oc in outcomes]

    def io_stats(self):
        """The expert store's counters (None when experts are mapped from the file)."""
        return self._experts.stats()

    # ---- generation ------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], **options) -> AsyncIterator["GenerationChunk"]:
        """Stream a continuation; see clutor.model.generate.generate for the options. Call it from
        several tasks at once: the generations share one batched step and one expert cache."""
        from .generate import generate

        self._check_open()
        return generate(self, prompt, **options)

    def chat(self, messages: Sequence[dict], *, special_in_content: bool = False,
             **options) -> AsyncIterator["GenerationChunk"]:
        """Stream the assistant's reply to messages ([{"role": ..., "content": ...}]) through the file's
        chat template; options as for generate. The next turn's prompt starts with this one's tokens,
        so its KV cache is reused (GenerationStats.cached_tokens says how many). The messages' text is
        tokenised as text (a "<|im_start|>" in it is not the token) unless ``special_in_content``."""
        from functools import partial

        from .chat import chat_ids, chat_turn

        self._check_open()
        # A recurrent state cannot be cut back: it is kept where the next turn departs (chat_turn).
        render = partial(chat_turn if self.kv.recurrent else chat_ids, special_in_content=special_in_content)
        return self.generate(_Deferred(render, self.tokenizer, list(messages)), **options)

    def engine_stats(self):
        """Live and queued sequences, KV bytes held and kept for reuse, preemptions (clutor.model.engine.EngineStats)."""
        return self.engine.stats()

    # ---- saved slots (clutor.model.slots) --------------------------------------------------------
    async def save_slot(self, ids: Sequence[int], path: str | os.PathLike) -> "Saved":
        """Write the KV pages of ids' longest prefix the KV pool (or the disk prefix cache) still holds
        to path, in whole pages: ``Saved.n_tokens`` says how many positions."""
        return await save_slot(self.engine, await self._page_format(), list(ids), os.fspath(path),
                               direct=self.options.direct)

    async def restore_slot(self, path: str | os.PathLike) -> "Restored":
        """Read a file save_slot wrote (for this model file and kv_type) back into the KV pool: a prompt
        that starts with ``Restored.tokens`` then maps those pages. They are held until
        ``release_slot(restored)``. ClutorError when the file is not one of this model's."""
        return await restore_slot(self.engine, await self._page_format(), os.fspath(path), io=self.options.io,
                                  direct=self.options.direct)

    def release_slot(self, restored: "Restored") -> None:
        """Give a restored slot's pages back to the pool (kept for reuse while there is room)."""
        pins, restored.pins = restored.pins, []
        self.engine.unpin(pins)

    async def _page_format(self) -> PageFormat:
        self._check_open()
        if self.kv.recurrent:
            raise ClutorError(f"{self.config.arch}: its recurrent layers' states are not saved to files")
        if self.kv.disk is not None:
            return self.kv.disk.fmt
        if self._format is None:
            self._format = PageFormat.of(self.kv, await asyncio.to_thread(file_identity, self._file))
        return self._format


def _disk_store(pool: KVPool, opts: ModelOptions, identity: str | None, arch: str) -> DiskPages | None:
    """The disk prefix cache for this pool (None, with a log line, where it cannot apply)."""
    if identity is None:
        logging.getLogger("clutor.kv").warning(
            "prefix cache on disk: off for %s: its recurrent layers' states are not stored on disk", arch)
        return None
    return DiskPages(opts.prefix_cache_disk, parse_bytes(opts.prefix_cache_disk_size), PageFormat.of(pool, identity),
                     io=opts.io, direct=opts.direct)


async def _close_all(closers) -> None:
    """Call every closer (sync or async; None skipped) in order, then raise the first error."""
    first: BaseException | None = None
    for close in closers:
        if close is None:
            continue
        try:
            r = close()
            if asyncio.iscoroutine(r):
                await r
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first


def _progress_of(progress, total: int) -> Callable[[int], None] | None:
    """Adapt progress(done, total) to load_dense's per-tensor byte counts."""
    if progress is None:
        return None
    done = 0

    def step(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        progress(done, total)

    return step


class _Deferred:
    """A prompt still to be made (a chat template to render): generate() calls it off the event loop;
    it gives the ids, or (ids, positions where a recurrent state is to be kept)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __call__(self):
        return self.fn(*self.args)
