"""Model: open a GGUF MoE file, compute logits, generate text.

The layer loop awaits each layer's routed experts from an ExpertSource (in memory here; the
disk-streaming ExpertStore elsewhere) and never knows which one it has.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Sequence

import numpy as np

from .._util import AwaitableContext, sleeping_kernel_workers
from ..io.policies import DEFAULT_POLICY
from ..io.trace import TraceHeader, TraceWriter, check_output
from ..errors import ClosedError, ClutorError, ModelFileError
from .arch import Arch, read_arch
from .layers import rmsnorm
from .gguf import GGUFFile
from . import kernels
from .compute import compute
from .engine import Engine
from .kernels import Job
from .quants import matmul_jobs
from .options import ModelOptions, resolve_budget
from .profile import NO_PROFILE, Profile
from .source import ExpertSource, InMemoryExperts
from .tokenizer import Tokenizer
from .weights import DenseWeights, expert_layout, load_dense, resident_bytes

if TYPE_CHECKING:
    from .generate import GenerationChunk

__all__ = ["Model", "SequenceState"]


class SequenceState:
    """One sequence's state: its KV cache (laid out as its architecture stores it), the recurrent
    layers' states of a hybrid model (``rs``, clutor.model.recurrent; None when it has none), and
    how many positions it holds.

    A KV cache can be cut back to any shorter prefix; a recurrent state only to a checkpoint, so
    prefix reuse asks ``reusable(n)`` how far back this sequence can go and ``rewind`` goes there."""

    def __init__(self, arch: Arch, n_ctx: int):
        self.kv = arch.new_kv(n_ctx)
        self.rs = arch.new_recurrent()

    @property
    def n(self) -> int:
        return self.kv.n

    @property
    def state_bytes(self) -> int:
        """Bytes held besides the KV cache: recurrent states and their checkpoints."""
        return 0 if self.rs is None else self.rs.nbytes

    def commit(self, n: int) -> None:
        """Positions up to n are filled (every layer has written them)."""
        self.kv.n = n
        if self.rs is not None:
            self.rs.n = n

    def checkpoint(self) -> None:
        """Keep a copy of the recurrent states at the current position, for prefix reuse."""
        if self.rs is not None:
            self.rs.save()

    def reusable(self, n: int) -> int:
        """The longest prefix of at most n positions this sequence can be cut back to."""
        n = min(n, self.kv.n)
        return n if self.rs is None else self.rs.reusable(n)

    def rewind(self, n: int) -> None:
        """Keep the first n positions (n from reusable); later ones are overwritten as new tokens come."""
        if self.rs is not None:
            self.rs.restore(n)
        self.kv.n = n


@dataclass(frozen=True)
class _Segment:
    """One sequence's share of a step: its new ids at positions p0.., rows r0.. of the step."""

    seq: SequenceState
    ids: np.ndarray  # [T_i] int64
    p0: int
    r0: int


@dataclass(frozen=True)
class _Step:
    segments: list[_Segment]
    ids: np.ndarray  # [R] the segments' ids back to back
    pos: np.ndarray  # [R] each row's position in its own sequence
    need: list[bool]  # per segment: compute its logits

    def commit(self) -> None:
        """The step's positions count as filled: only once every layer has written them."""
        for seg in self.segments:
            seg.seq.commit(seg.p0 + len(seg.ids))


class Model:
    """A MoE model ready to run. Create with ``await Model.open(path)`` or ``async with Model.open(path)``."""

    def __init__(self, path: str, f: GGUFFile, arch: Arch, dense: DenseWeights, tokenizer: Tokenizer,
                 experts: ExpertSource, n_ctx: int, *, options: ModelOptions, cache_note: str,
                 trace: TraceWriter | None = None):
        cfg = arch.cfg
        self.path = path
        self.arch = arch
        self.config = cfg
        self._moe_index = {l: i for i, l in enumerate(cfg.moe_layers)}  # layer -> the expert store's layer
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self._file = f
        self._w = dense
        self._experts = experts
        self._rope = arch.make_rope(n_ctx)
        self._closed = False
        self.options = options
        self.cache_note = cache_note  # how the expert cache size was chosen (said in the report)
        # Prefetch (decode steps only) only when asked for: on real routing (docs/benchmarks.md, "Streaming
        # on real routing") it lost at 4 streams in three runs of three (its wrong guesses add 37% to the
        # bytes of a disk-bound step), was slower at 16, and at 1 won twice and lost once within the noise, at 1.6x
        # the bytes; it had won at 16 streams on random-weight routing only. None/False = never, True = every decode step.
        self._prefetch = options.io != "memory" and options.prefetch is True
        self._hints = experts.wants_hints
        self._trace = trace
        # Most distinct experts one get() may pin (0 = unbounded, in memory): a prefill touching more is
        # served in chunks, leaving room for other sequences and for the next layer's prefetch.
        room = experts.capacity
        self._max_batch = min(room, max(cfg.n_expert_used, room // 2)) if room else cfg.n_expert
        self.profile: Profile = Profile() if options.profile else NO_PROFILE  # where the steps' time goes
        self.kernels = options.kernels  # how this model's products compute (activations, threads)
        for w in dense.matrices():
            w.kernels = self.kernels
        self.engine = Engine(self, max_sequences=options.max_sequences, step_tokens=options.step_tokens,
                             prefix_bytes=options.prefix_cache_bytes)

    # ---- lifecycle -------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, n_ctx: int | None = None, expert_cache: int | str | None = None,
             prefetch: bool | None = None, policy: str = DEFAULT_POLICY, io: str = "auto", direct: bool = True,
             trace: str | os.PathLike | None = None, max_sequences: int = 16, step_tokens: int = 256,
             prefix_cache: int | str = "256MiB", activations: str = "auto", threads: int | None = None,
             profile: bool = False, progress: Callable[[int, int], None] | None = None) -> AwaitableContext["Model"]:
        """Open a GGUF MoE model.

        n_ctx: context length (default min(model's, 4096)).
        expert_cache: bytes for routed experts: an int, "3GiB", or "25%" of all expert bytes; None picks
            half of the memory available after the dense weights (capped at what all experts need).
        prefetch: during decode, read the experts predicted for layer l+1 while layer l computes. None
            (default): in steps that decode several sequences at once, where it measured a win, not for
            a single one, where it did not (README); True: always; False: never.
        policy: cache replacement policy (see clutor.io.policies.POLICIES).
        io: "auto" (io_uring, else threads), "uring", "threads", or "memory" (mmap the file, no cache).
        direct: O_DIRECT reads that bypass the page cache (falls back to buffered where refused).
        trace: write the routing of every token to this JSONL file (the simulator's format).
        max_sequences: generations advanced together in one batched step; more wait their turn.
        step_tokens: tokens one step computes at most over all sequences: long prompts are prefilled in
            chunks of what is left after every decoding sequence's token, so they never freeze the others.
        prefix_cache: KV bytes of finished sequences kept (least recently used out) so that a prompt
            starting with the same tokens (the next turn of a chat) reuses them; 0 turns it off.
        activations: "auto" (default), "q8" (int8 activations with integer dot products, as llama.cpp
            computes; x86 AVX2) or "f32" (float activations, exact up to float rounding); see
            clutor.model.kernel_settings.
        threads: threads each matrix product is split over (default: the CPUs this process may use).
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
                            max_sequences=max_sequences, step_tokens=step_tokens, prefix_cache=prefix_cache,
                            activations=activations, threads=threads, profile=profile)
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
                ctx = min(cfg.n_ctx_train, 4096) if opts.n_ctx is None else int(opts.n_ctx)
                if not 1 <= ctx <= cfg.n_ctx_train:
                    raise ClutorError(f"n_ctx must be between 1 and the model's context_length {cfg.n_ctx_train}, got {ctx}")
                budget = None
                if opts.io != "memory":
                    dense_bytes = resident_bytes(f, arch)
                    budget = resolve_budget(opts.expert_cache, layout, cfg.n_expert_used, dense_bytes)
                dense = load_dense(f, arch, _progress_of(progress, resident_bytes(f, arch)))
                # compile (first run on this machine) or load the cached kernels now, not in the first token
                kernels.warmup(opts.kernels)
            except BaseException:
                f.close()
                raise
            return f, arch, tok, dense, layout, ctx, budget

        f, arch, tok, dense, layout, ctx, budget = await asyncio.to_thread(load)
        cfg = arch.cfg
        experts: ExpertSource | None = None
        trace: TraceWriter | None = None
        try:
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
            return cls(path, f, arch, dense, tok, experts, ctx, options=opts, cache_note=why, trace=trace)
        except BaseException:
            # Whatever failed (even a MemoryError in __init__), give back the trace, the store (ring,
            # eventfd, arena) and the file's fds before re-raising.
            await _close_all([trace.abort if trace is not None else None,
                              experts.aclose if experts is not None else None, f.close])
            raise

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
            await _close_all([self._experts.aclose, self._file.close,
                              self._trace.close if self._trace is not None else None])

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.path}: model is closed")

    # ---- forward ---------------------------------------------------------------------------
    # The one data path. Every numerical step is a plain method run on the compute thread
    # (``await compute(...)``); what stays on the event loop is only the expert I/O: reserving a
    # layer's experts, submitting the misses and taking completions (``self._experts.get_ready``).
    def new_sequence(self) -> SequenceState:
        return SequenceState(self.arch, self.n_ctx)

    async def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of a fresh sequence: float32 [len(ids), n_vocab]."""
        self._check_open()
        return await self.forward(self.new_sequence(), ids, all_logits=True)

    async def forward(self, seq: SequenceState, ids: Sequence[int], *, all_logits: bool = False) -> np.ndarray:
        """Append ids to seq (one batched pass); logits [T, V] if all_logits else [1, V] for the last."""
        return (await self.forward_batch([(seq, ids)], all_logits=all_logits))[0]

    async def forward_batch(self, batch: Sequence[tuple[SequenceState, Sequence[int]]], *,
                            all_logits: bool = False, need: Sequence[bool] | None = None,
                            head: Callable | None = None) -> list:
        """One step over several sequences at once: each (seq, ids) appends its ids to its own KV
        cache at its own positions; the layers' dense products and each routed expert run once for
        all rows of the step. Returns per sequence logits [T_i, V] (all_logits) or [1, V], None
        where ``need`` says a sequence's logits are not wanted (a prompt chunk that is not its last);
        ``head(that list)``, if given, runs on the compute thread and its result is returned instead."""
        self._check_open()
        step = self._plan(batch, need)
        phase = "decode" if len(step.ids) == len(step.segments) else "prefill"
        with self.profile.step(phase, len(step.ids)):
            if self._experts.immediate:
                # Experts mapped from the file never wait for a read: the whole step is one trip to
                # the compute thread instead of two per layer.
                return await compute(self._forward_now, step, all_logits, head)
            x = h = ys = None
            for l in range(self.config.n_layers):
                # One trip to the compute thread per layer boundary (each trip costs a thread hand-off):
                # the previous layer's expert sum (or the embedding), then this layer's attention and router.
                x, h, sel, w, nxt = await compute(self._layer_start, l, x, h, ys, step)  # x [R, D], R = rows of all sequences
                ys = await self._routed_experts(l, x, h, sel, w, step, nxt) if sel is not None else []
            step.commit()
            return await compute(self._head, x, h, ys, step, all_logits, head)

    def _forward_now(self, step: "_Step", all_logits: bool, head: Callable | None):
        """forward_batch's layer loop in one call on the compute thread, for an immediate source."""
        x = h = ys = None
        for l in range(self.config.n_layers):
            x, h, sel, w, _ = self._layer_start(l, x, h, ys, step)
            if sel is None:
                ys = []
                continue
            wanted = _by_votes(sel)
            out = self._experts_out(l, h, sel, w, self._experts.views_now(self._moe_index[l], wanted))
            ys = [out[e] for e in wanted]
        step.commit()
        return self._head(x, h, ys, step, all_logits, head)

    def _plan(self, batch, need) -> "_Step":
        cfg = self.config
        segments, r = [], 0
        need = [True] * len(batch) if need is None else list(need)
        for seq, ids in batch:
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # [T_i]
            if len(ids) == 0:
                raise ClutorError("forward needs at least one token")
            if ids.min() < 0 or ids.max() >= cfg.n_vocab:
                raise ClutorError(f"token ids must be in [0, {cfg.n_vocab}), got {int(ids.min())}..{int(ids.max())}")
            if seq.n + len(ids) > seq.kv.n_ctx:
                raise ClutorError(f"context full: {seq.n} + {len(ids)} tokens > n_ctx {seq.kv.n_ctx} "
                                  "(open the model with a larger n_ctx)")
            if any(s.seq is seq for s in segments):
                raise ClutorError("a sequence can appear only once in a step")
            segments.append(_Segment(seq, ids, seq.n, r))
            r += len(ids)
        if not segments:
            raise ClutorError("forward needs at least one sequence")
        return _Step(segments, np.concatenate([s.ids for s in segments]),
                     np.concatenate([s.p0 + np.arange(len(s.ids)) for s in segments]), need)

    # -- compute thread ------------------------------------------------------------------------
    def _layer_start(self, l: int, x: np.ndarray | None, h: np.ndarray | None, ys: list | None, step: "_Step"):
        """The residual entering layer l (the embedding, or layer l-1's output: x plus its FFN),
        then its attention and router: (x + attention [R, D], h = the FFN's input [R, D],
        experts [R, K], weights [R, K]; both None in a dense layer)."""
        arch, lw, prof = self.arch, self._w.layers[l], self.profile
        if l == 0:
            with prof.span("embed"):
                x = self._w.tok_embd.rows(step.ids)  # [R, D]
        else:
            with prof.span("shared + sum"):
                x = self._moe_add(l - 1, x, h, ys)  # [R, D]
        with prof.span("attention"):
            x = x + arch.attention(lw, l, x, step, self._rope)
        with prof.span("router"):
            h = arch.ffn_input(lw, x)  # [R, D]
            if lw.experts is None:
                return x, h, None, None, None
            sel, w = arch.route(lw, h)  # [R, K], [R, K]
        nxt = None
        if len(sel) == len(step.segments) and l + 1 in self._moe_index and self._predicting(len(sel)):
            # Decode (one row per sequence): layer l+1's router on this residual predicts its experts,
            # told to the cache before this layer's get (and read ahead by prefetch when it is on).
            with prof.span("predict"):
                nxt = self._predict(l + 1, x)
        if self._trace is not None:
            for r in range(len(sel)):
                self._trace.write(int(step.pos[r]), self._moe_index[l], sel[r].tolist(), w[r].tolist(), next=nxt)
        return x, h, sel, w, nxt

    def _experts_out(self, l: int, h: np.ndarray, sel: np.ndarray, w: np.ndarray,
                     views) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Some of layer l's experts on the normed residual h [R, D]: {expert: (rows, weighted output
        [n, D])} for the n rows routed to it. Every expert's rows are gathered into one array so
        that gate and up for all of them are one kernel launch, and down another."""
        with self.profile.span("experts"):
            cfg, et = self.config, self._w.layers[l].experts
            D, F = cfg.n_embd, cfg.n_ff_exp
            # Each view's (row, top-k slot) pairs, found by one sort of the step's choices rather than
            # a comparison of all of them per expert: flat index i = row * K + slot.
            K = sel.shape[1]
            flat = sel.ravel()  # [R*K]
            order = np.argsort(flat, kind="stable")  # grouped by expert, row-major within each
            ids = np.fromiter((v.expert for v in views), np.int64, len(views))
            grouped = flat[order]  # [R*K] expert ids, ascending
            lo = np.searchsorted(grouped, ids, "left")
            hi = np.searchsorted(grouped, ids, "right")
            counts = (hi - lo).tolist()
            starts = np.cumsum([0] + counts)[:-1].tolist()
            picked = np.concatenate([order[a:b] for a, b in zip(lo.tolist(), hi.tolist())])  # [S]
            rows = picked // K  # [S], S = rows summed over experts
            xg = h[rows]  # [S, D]
            if views[0].gate is None:  # ungated experts (Nemotron-H): the activation reads up [S, F] alone
                gu = np.empty((len(xg), F), np.float32)
                jobs = [Job(v.up, et.up, F, t0, n, 0) for v, t0, n in zip(views, starts, counts)]
            else:
                gu = np.empty((len(xg), 2 * F), np.float32)  # [S, 2F]: gate | up
                jobs = [job for v, t0, n in zip(views, starts, counts)
                        for job in (Job(v.gate, et.gate, F, t0, n, 0), Job(v.up, et.up, F, t0, n, F))]
            matmul_jobs(jobs, D, xg, gu, self.kernels)
            biased = bool(views[0].biases)  # gpt-oss: each expert's gate/up/down biases, read with it (float32)
            if biased:
                for v, t0, n in zip(views, starts, counts):
                    gu[t0 : t0 + n, :F] += v.biases[0].view(np.float32)
                    gu[t0 : t0 + n, F:] += v.biases[1].view(np.float32)
            a = self.arch.expert_act(gu, F)  # [S, F]
            y = np.empty((len(xg), D), np.float32)  # [S, D]
            matmul_jobs([Job(v.down, et.down, D, t0, n) for v, t0, n in zip(views, starts, counts)], F, a, y,
                        self.kernels)
            if biased:
                for v, t0, n in zip(views, starts, counts):
                    y[t0 : t0 + n] += v.biases[2].view(np.float32)
            y *= w.reshape(-1)[picked][:, None]
            return {v.expert: (rows[t0 : t0 + n], y[t0 : t0 + n]) for v, t0, n in zip(views, starts, counts)}

    def _moe_add(self, l: int, x: np.ndarray, h: np.ndarray, ys: list) -> np.ndarray:
        """x + the routed experts' outputs (summed in the order the experts were asked for, so the
        result never depends on which read finished first) + what the architecture adds (shared
        experts, or a dense layer's FFN)."""
        out = np.zeros_like(h)  # [R, D]
        for rows, y in ys:
            out[rows] += y
        extra = self.arch.ffn_extra(self._w.layers[l], h)
        if extra is not None:
            out += extra
        return x + out

    def _head(self, x: np.ndarray, h: np.ndarray, ys: list, step: "_Step", all_logits: bool, head: Callable | None):
        """The last layer's output, then the output projection of the rows wanted: all of a
        segment's, or its last (the others' logits would cost a [V, D] product per row for nothing)."""
        cfg = self.config
        with self.profile.span("shared + sum"):
            x = self._moe_add(cfg.n_layers - 1, x, h, ys)  # [R, D]
        with self.profile.span("output"):
            out = self._output(x, step, all_logits)
        if head is None:
            return out
        with self.profile.span("sampling"):
            return head(out)

    def _output(self, x: np.ndarray, step: "_Step", all_logits: bool) -> list[np.ndarray | None]:
        cfg = self.config
        spans = [(s.r0, len(s.ids)) if all_logits else (s.r0 + len(s.ids) - 1, 1) for s in step.segments]
        wanted = [span for span, ok in zip(spans, step.need) if ok]
        out: list[np.ndarray | None] = [None] * len(spans)
        if wanted:
            rows = np.concatenate([np.arange(r0, r0 + n) for r0, n in wanted])
            logits = self._w.output(rmsnorm(x[rows], self._w.output_norm, cfg.eps))  # [rows, V]
            at = 0
            for i, ((_, n), ok) in enumerate(zip(spans, step.need)):
                if ok:
                    out[i], at = logits[at : at + n], at + n
        return out

    def _prefetching(self, n_seq: int) -> bool:
        return self._prefetch

    def _predicting(self, n_seq: int) -> bool:
        """The next layer's router on the current residual (one small product per layer and decode
        step) only when something uses it: prefetch, or a cache policy that takes hints."""
        return self._hints or self._prefetching(n_seq)

    def _predict(self, l: int, x: np.ndarray) -> list[int]:
        """Experts layer l will likely want: its router on the current residual, most-voted first."""
        lw = self._w.layers[l]
        sel, _ = self.arch.route(lw, self.arch.ffn_input(lw, x))
        return _by_votes(sel)[: self._max_batch]

    # -- event loop: expert I/O ------------------------------------------------------------------
    async def _routed_experts(self, l: int, x: np.ndarray, h: np.ndarray, sel: np.ndarray, w: np.ndarray,
                              step: "_Step", nxt: list[int] | None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Layer l's routed experts for every row of the step: each expert read once, computed on the
        compute thread group by group as its bytes arrive, while the rest are still being read."""
        wanted = _by_votes(sel)  # each expert once per layer per step
        ys: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if nxt is not None:  # before this layer's get: its misses then spare layer l+1's experts
            self._experts.hint(self._moe_index[l + 1], nxt)
        for i in range(0, len(wanted), self._max_batch):
            chunk = wanted[i : i + self._max_batch]
            groups = self._experts.get_ready(self._moe_index[l], chunk)
            try:
                first = True
                t_wait = time.perf_counter()
                async for views in groups:
                    self.profile.add("wait for reads", time.perf_counter() - t_wait)
                    if first and i == 0 and nxt is not None and self._prefetching(len(step.segments)):
                        # This layer's experts are pinned and its misses submitted: queue the experts
                        # layer l+1's router picks from the current hidden state, read while this
                        # layer computes. (In a prefill nearly every expert is demanded anyway.)
                        self._experts.prefetch(self._moe_index[l + 1], nxt)
                    first = False
                    ys.update(await compute(self._experts_out, l, h, sel, w, views))
                    t_wait = time.perf_counter()
            finally:
                await groups.aclose()
            # Let another forward waiting for the slots just released reserve before this one does
            # again (a forward whose next layer is all hits would otherwise never suspend).
            await asyncio.sleep(0)
        return [ys[e] for e in wanted]

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

    def chat(self, messages: Sequence[dict], **options) -> AsyncIterator["GenerationChunk"]:
        """Stream the assistant's reply to messages ([{"role": ..., "content": ...}]) through the file's
        chat template; options as for generate. The next turn's prompt starts with this one's tokens,
        so its KV cache is reused (GenerationStats.cached_tokens says how many)."""
        from .chat import chat_ids, chat_turn

        self._check_open()
        if not self.config.recurrent_bytes:
            return self.generate(chat_ids(self.tokenizer, list(messages)), **options)
        ids, keep = chat_turn(self.tokenizer, list(messages))  # where the next turn departs (recurrent state)
        return self.generate(ids, **{"checkpoints": keep, **options})

    def engine_stats(self):
        """Live and queued sequences, KV bytes held, prefix cache (clutor.model.engine.EngineStats)."""
        return self.engine.stats()


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


def _by_votes(sel: np.ndarray) -> list[int]:
    """Distinct experts of sel [T, K], most-chosen first, ties in router order (token 0's rank 0 first),
    so a one-token step asks for its experts exactly in the order the router ranked them."""
    flat = sel.reshape(-1)
    ids, first, counts = np.unique(flat, return_index=True, return_counts=True)
    order = np.lexsort((first, -counts))  # by count descending, then first appearance
    return ids[order].tolist()
