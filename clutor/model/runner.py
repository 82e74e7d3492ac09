"""The runner: executes one StepPlan through every layer. The only layer loop there is.

    outcomes = await runner.run(plan)   # one Outcome per segment, in the plan's order

A step is one trip to the compute thread (clutor.model.compute), which runs the whole layer loop. With a
source whose experts never wait (io="memory") it takes each layer's views directly; from the expert
store it takes them with ``store.take``: the cached experts pinned and computed at once, with no turn
of the event loop, while the loop submits the misses' reads and takes their completions, which wake the
compute thread group by group as the bytes arrive. The event loop does only that expert I/O, and a
layer boundary costs no hand-off between threads.

Per layer (the architecture's methods, clutor.model.arch.common):
    x = x + arch.attention(lw, l, x, step, rope)     the sequences' own KV state, through ``step``
    h = arch.ffn_input(lw, x); sel, w = arch.route(lw, arch.router_input(lw, x, h))
    x = arch.ffn_out(lw, x, h, sum over routed experts (each read once per step, for every row that
          chose it)): by default x + that sum + arch.ffn_extra(lw, h)
then the output rows each segment wants (logits, or the final hidden states), and its head (sampling)
on the compute thread.

Failure isolation: a read that fails fails the segments whose rows routed to that expert, and the
rest of the step goes on without it (the expert is not asked for again in this step); an error in one
segment's head fails that segment. Anything else fails the whole step.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ExpertReadError
from . import kernels
from .compute import compute
from .kernels import Job
from .layers import rmsnorm
from .plan import Outcome, StepPlan, Want
from .profile import NO_PROFILE, Profile
from .quants import matmul_jobs
from .resident import ResidentExperts, SlotOutputs, StreamedExperts
from .step import Step

if TYPE_CHECKING:
    from ..io.trace import TraceWriter
    from .arch import Arch
    from .kernel_settings import KernelSettings
    from .kv import KVPool
    from .source import ExpertSource
    from .weights import DenseWeights

__all__ = ["Runner", "Sliced"]

PREFETCH_RANKS = 2  # of each row's predicted experts for the next MoE layer, how many prefetch reads
# ... or, where the router's weights are its softmax over every expert (olmoe, qwen2moe: top-k not
# renormalised), each predicted expert the router gives at least this weight: on real routing
# (wide.gguf, 3 x 96 sampled tokens in RAM) as many right picks as the best two ranks (coverage 0.418
# vs 0.414 of the experts then routed) with a quarter fewer wrong ones (223 vs 295 of ~1700; by weight:
# < 0.1 56% right, 0.1-0.2 82%, >= 0.2 99%). Renormalised weights are shares of the top-k instead, not
# comparable across rows or models: there the ranks decide.
PREFETCH_MIN_WEIGHT = 0.1
# prefetch=None (the default) prefetches decode steps, of one sequence or batched, only where the cache
# holds at least this many tokens' experts (each MoE layer's top-k): in a smaller one each wrong guess
# evicts an expert the next token wants again. wide.gguf, one stream, quiet, same sitting: a cache of one
# token's experts (12.5%, 16) read 57.7 MiB/token with prefetch and 48.3 without (7.8 vs 11.9 tok/s); one
# of two tokens' (25%, 32) 27.0 against 29.6 prefetching by rank (docs/benchmarks.md, "One stream, phase 4").
# A batched step prefetches the union of its rows' picks by the same rule: its reads of layer l+1 then
# fill the disk's idle time while layer l's late experts, the next attention and the output head compute
# (4 streams, 25%: 32.2-33.2 vs 30.1-30.5 tok/s, 44.2 vs 38.4 MiB/token, 83% of prefetches used; picks
# of weight >= 0.05 read 61 MiB/token and lost, >= 0.15-0.2 saved less wait: docs/benchmarks.md).
PREFETCH_MIN_TOKENS = 1.5


class Sliced:
    """A step run a slice at a time (a long prompt's window between other sequences' decode steps):
    ``advance(seconds)`` on the compute thread runs its layer loop to the next pause past that much
    work; ``outcomes`` once it has finished. ``close()`` abandons it (at a pause: nothing pinned)."""

    def __init__(self, runner: "Runner", plan: StepPlan):
        self.runner = runner
        self.plan = plan
        self.outcomes: list[Outcome] | None = None
        self._work = runner._layers(Step(plan, runner.kv))

    def advance(self, seconds: float) -> bool:
        """Compute thread: work until ``seconds`` have passed (at the next pause) or the step ends."""
        r = self.runner
        t0 = time.perf_counter()
        with r.profile.step("prefill", 0):
            try:  # (a layer loop that raised is over: nothing to close)
                while True:
                    next(self._work)
                    if time.perf_counter() - t0 >= seconds:
                        return False
            except StopIteration as done:
                self.outcomes = done.value
        r.profile.count("prefill", self.plan.rows)
        r.steps += 1
        r.rows += self.plan.rows
        return True

    def close(self) -> None:
        self._work.close()


class Runner:
    """Runs steps of one model; one at a time (a lock orders the engine's steps and direct forwards)."""

    def __init__(self, arch: "Arch", weights: "DenseWeights", experts: "ExpertSource", kv: "KVPool", *, n_ctx: int,
                 kernels_: "KernelSettings", prefetch: bool | None, profile: Profile = NO_PROFILE,
                 trace: "TraceWriter | None" = None, tile_rows: int = 256, slice_seconds: float = 0.1):
        cfg = arch.cfg
        self.arch = arch
        self.config = cfg
        self.experts = experts
        self.kv = kv
        self.kernels = kernels_
        self.profile = profile
        self._w = weights
        self._moe_index = {l: i for i, l in enumerate(cfg.moe_layers)}  # layer -> the expert source's layer
        # MoE layer -> the MoE layer whose experts decode predicts from its residual: l + 1 when that one
        # is MoE; the last MoE layer's is the first (the next token's).
        moe = cfg.moe_layers
        self._ahead = {l: l + 1 for l in moe if l + 1 in self._moe_index}
        if moe:
            self._ahead[moe[-1]] = moe[0]
        self._rope = arch.make_rope(n_ctx)
        arch.ggml_numerics = kernels.mode(kernels_) == "q8"
        self._trace = trace
        from .arch.common import Arch
        self._pick_by_weight = type(arch).route is Arch.route  # softmax over all experts, top-k kept as is
        self._hints = experts.wants_hints
        # experts mapped in memory: each layer's addresses as one table, a step's experts in five calls a layer
        self._resident = ResidentExperts.of(experts, arch, weights.layers, cfg, kernels_)
        # ... and streamed ones (cache slots, other ones each step) group by group through the same
        # compiled path, into one [R * K, D] array of the layer's slots (Step.slot_outputs, the step's own)
        self._streamed = StreamedExperts.of(experts, arch, weights.layers, cfg, kernels_)
        # A step of more rows than tile_rows (a long prompt's window) runs its attention, and in memory
        # its experts, a tile of rows at a time, and its streamed experts a few at a time (sized to
        # slice_seconds of compute), pausing between them: Sliced runs it a slice at a time.
        self.tile_rows = tile_rows
        self.slice_seconds = slice_seconds
        self._pair_seconds = 0.0  # compute of one (row, expert) pair in a long step's chunk, last measured
        # Most distinct experts one get() may pin (0 = unbounded, in memory): a prefill touching more is
        # served in chunks, leaving room for other sequences and for the next layer's prefetch.
        room = experts.capacity
        self._max_batch = min(room, max(cfg.n_expert_used, room // 2)) if room else cfg.n_expert
        roomy = not room or room >= PREFETCH_MIN_TOKENS * len(cfg.moe_layers) * cfg.n_expert_used
        # Read the next MoE layer's predicted experts while this one computes, in every decode step: the
        # prefetch option (see Model.open), None meaning where the cache is roomy.
        self._prefetch = roomy if prefetch is None else prefetch
        self._lock = asyncio.Lock()
        self._asking = 0  # run() calls waiting for (or holding) the runner
        self.steps = 0  # steps run
        self.rows = 0   # rows computed over those steps

    # -- the step ----------------------------------------------------------------------------------
    async def run(self, plan: StepPlan) -> list[Outcome]:
        """Execute the plan: every segment's ids written into its state, one Outcome per segment."""
        return await self._held(self.run_now, plan)

    async def _held(self, fn, *args):
        """fn(*args) on the compute thread, holding the runner (counted as asking for it meanwhile)."""
        self._asking += 1
        try:
            async with self._lock:
                return await compute(fn, *args)
        finally:
            self._asking -= 1

    def run_now(self, plan: StepPlan) -> list[Outcome]:
        """Compute thread: the whole step in one call. Call it from run, or from fn in run_solo (which
        holds the runner for it); never on the event loop, which a streaming source needs for its reads."""
        step = Step(plan, self.kv)
        try:
            with self.profile.step("decode" if plan.decode else "prefill", plan.rows):
                work = self._layers(step)
                while True:
                    next(work)
        except StopIteration as done:
            return done.value
        finally:
            self.steps += 1
            self.rows += plan.rows

    def start(self, plan: StepPlan) -> "Sliced":
        """The plan as a step to run a slice at a time (Sliced.advance, on the compute thread)."""
        return Sliced(self, plan)

    async def run_slice(self, job: "Sliced", seconds: float) -> bool:
        """Advance job by about ``seconds`` of work, holding the runner; True once it has finished."""
        return await self._held(job.advance, seconds)

    async def run_solo(self, fn, *args, on_cancel=None):
        """Hold the runner and call fn(*args, run_now, asked) on the compute thread: fn runs steps with
        run_now until it returns, and should return soon after asked() is True (a forward is waiting for
        the runner). on_cancel() is called at once when the caller is cancelled, to make fn return (fn's
        steps are never abandoned half-done)."""
        async with self._lock:
            return await compute(fn, *args, self.run_now, lambda: self._asking > 0, on_cancel=on_cancel)

    def _layers(self, step: Step):
        """The layer loop, on the compute thread: each layer's routed experts from the source at once
        (_routed_now), or taken from the store group by group as their bytes arrive (_routed_taken).
        A generator that returns the step's outcomes; it yields where a long step may pause (between
        tiles and expert chunks, never with experts pinned or a profile span open)."""
        streamed = not self.experts.immediate
        before = self.experts.stats() if streamed and any(s.ledger is not None for s in step.segments) else None
        step.accounting = before is not None
        x = h = ys = None
        for l in range(self.config.n_layers):
            if l:  # layer l-1's output: x plus its FFN; its experts' outputs dropped before layer l makes its own
                with self.profile.span("shared + sum"):
                    x = self._moe_add(l - 1, x, h, ys, step)  # [R, D]
                ys = None
            x, h, sel, w, nxt = yield from self._layer_start(l, x, step)  # x [R, D]
            if sel is None:
                ys = []
            elif streamed:
                ys = yield from self._routed_taken(l, h, sel, w, step, nxt)
            else:
                ys = yield from self._routed_now(l, h, sel, w, step)
        if before is not None:  # what the step read ahead, shared by its segments (clutor.model.accounting)
            share = (self.experts.stats().bytes_prefetch - before.bytes_prefetch) / len(step.segments)
            for s in step.segments:
                if s.ledger is not None:
                    s.ledger.bytes_prefetch += share
                    s.ledger.steps += 1
        return self._finish(x, h, ys, step)

    def _routed_now(self, l: int, h: np.ndarray, sel: np.ndarray, w: np.ndarray, step: Step):
        """Layer l's routed experts from an immediate source, for _moe_add: their weighted sum [R, D]
        where the layer's resident table computes it (clutor.model.resident), a tile of rows at a
        time in a long step (each row's sum is its own), else each expert's (rows, output) from the
        general path."""
        table = self._resident.table(l, self._moe_index[l]) if self._resident is not None else None
        R, tile = len(sel), self.tile_rows
        if table is not None and table.fits(sel[:tile], w):
            if R <= tile:
                with self.profile.span("experts"):
                    return table.sum(h, sel, w)
            out = np.empty_like(h)  # [R, D]
            for a in range(0, R, tile):
                with self.profile.span("experts"):
                    out[a : a + tile] = table.sum(h[a : a + tile], sel[a : a + tile], w[a : a + tile])
                yield
            return out
        wanted = _by_votes(sel)
        out = self._experts_out(l, h, sel, w, self.experts.views_now(self._moe_index[l], wanted), step)
        return [out[e] for e in wanted]

    # -- compute thread ------------------------------------------------------------------------------
    def _layer_start(self, l: int, x: np.ndarray | None, step: Step):
        """The residual entering layer l (the embedding where x is None, else layer l-1's output),
        then its attention and router: (x + attention [R, D], h = the FFN's input [R, D],
        experts [R, K], weights [R, K]; both None in a dense layer, and the next MoE layer's predicted
        experts: (all, those to prefetch) or None)."""
        arch, lw, prof = self.arch, self._w.layers[l], self.profile
        if l == 0:
            step.prepare()
            with prof.span("embed"):
                x = arch.embed(self._w.tok_embd.rows(step.plan.ids))  # [R, D]
        tiles = step.tiles(self.tile_rows)
        if len(tiles) == 1:
            with prof.span("attention"):
                x = x + arch.attention(lw, l, x, step, self._rope)
        else:  # a tile's rows at a time, each seeing the keys the tiles before it wrote in this layer
            out = np.empty_like(x)  # [R, D]
            for a, b, tile in tiles:
                with prof.span("attention"):
                    out[a:b] = x[a:b] + arch.attention(lw, l, x[a:b], tile, self._rope)
                yield
            x = out
        with prof.span("router"):
            h = arch.ffn_input(lw, x)  # [R, D]
            if lw.experts is None:
                return x, h, None, None, None
            sel, w = arch.route(lw, arch.router_input(lw, x, h))  # [R, K], [R, K]
        nxt = ahead_pf = None
        ahead = self._ahead.get(l)
        if step.plan.decode and ahead is not None and (self._predicting() if ahead == l + 1 else self._prefetch):
            # Decode (one row per sequence): the next MoE layer's router on this residual predicts its
            # experts, told to the cache before this layer's get (and read ahead by prefetch when it is
            # on). After the last MoE layer that is the first one, for the next token: read while this
            # token's last layers, output and sampling compute (prefetch only: hints and the trace
            # speak of layer l+1).
            with prof.span("predict"):
                nxt, ahead_pf = self._predict(ahead, x)
        if self._trace is not None:
            pos = step.plan.pos
            for r in range(len(sel)):
                self._trace.write(int(pos[r]), self._moe_index[l], sel[r].tolist(), w[r].tolist(),
                                  next=nxt if ahead == l + 1 else None)
        return x, h, sel, w, None if nxt is None else (nxt, ahead_pf)

    def _experts_out(self, l: int, h: np.ndarray, sel: np.ndarray, w: np.ndarray,
                     views, step: Step) -> "dict[int, tuple[np.ndarray, np.ndarray] | SlotOutputs]":
        """Some of layer l's experts on the normed residual h [R, D], for _moe_add: {expert: the
        layer's SlotOutputs} where the streamed source's compiled path computes them (their rows'
        weighted outputs written into its slots), else the general path's {expert: (rows, weighted
        output [n, D])}."""
        if self._streamed is not None:
            with self.profile.span("experts"):
                acc = self._streamed.group(l, h, sel, w, views, step.slot_outputs)
            if acc is not None:
                step.slot_outputs = acc
                return dict.fromkeys([v.expert for v in views], acc)
        return self._experts_general(l, h, sel, w, views)

    def _experts_general(self, l: int, h: np.ndarray, sel: np.ndarray, w: np.ndarray,
                         views) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """The general path: {expert: (rows, weighted output [n, D])} for the n rows routed to each
        expert of views. Every expert's rows are gathered into one array so that gate and up for all
        of them are one kernel launch, and down another."""
        with self.profile.span("experts"):
            cfg, et = self.config, self._w.layers[l].experts
            D, F = cfg.n_embd, cfg.n_ff_exp
            # Each view's (row, top-k slot) pairs, found by one sort of the step's choices rather than
            # a comparison of all of them per expert: flat index i = row * K + slot.
            K = sel.shape[1]
            if len(sel) == 1:  # one row (a one-sequence decode step): view i's expert is in slot picked[i]
                slots = sel[0].tolist()
                picked = np.array([slots.index(v.expert) for v in views], np.int64)  # [S]
                counts, starts = [1] * len(views), range(len(views))
                xg = np.repeat(h, len(views), axis=0)  # [S, D]
            else:
                flat = sel.ravel()  # [R*K]
                order = np.argsort(flat, kind="stable")  # grouped by expert, row-major within each
                ids = np.fromiter((v.expert for v in views), np.int64, len(views))
                grouped = flat[order]  # [R*K] expert ids, ascending
                lo = np.searchsorted(grouped, ids, "left")
                hi = np.searchsorted(grouped, ids, "right")
                counts = (hi - lo).tolist()
                starts = np.cumsum([0] + counts)[:-1].tolist()
                picked = np.concatenate([order[a:b] for a, b in zip(lo.tolist(), hi.tolist())])  # [S]
                xg = h[picked // K]  # [S, D], S = rows summed over experts
            wf = w.reshape(-1)[picked][:, None]  # [S, 1]: each (row, slot)'s router weight
            before = self.arch.weight_before_ffn
            if before:  # Llama 4: the weight scales the expert's input, not its output
                xg = xg * wf
            if views[0].gate is None:  # ungated experts (Nemotron-H): the activation reads up [S, F] alone
                gu = np.empty((len(xg), F), np.float32)
                jobs = [Job(v.up, et.up, F, t0, n, 0) for v, t0, n in zip(views, starts, counts)]
            else:
                gu = np.empty((len(xg), 2 * F), np.float32)  # [S, 2F]: gate | up
                jobs = [job for v, t0, n in zip(views, starts, counts)
                        for job in (Job(v.gate, et.gate, F, t0, n, 0), Job(v.up, et.up, F, t0, n, F))]
            matmul_jobs(jobs, D, xg, gu, self.kernels, order="mul_mat_id")  # llama.cpp's MUL_MAT_ID sums
            biased = bool(views[0].biases)  # gpt-oss: each expert's gate/up/down biases, read with it (float32)
            if biased:
                for v, t0, n in zip(views, starts, counts):
                    gu[t0 : t0 + n, :F] += v.biases[0].view(np.float32)
                    gu[t0 : t0 + n, F:] += v.biases[1].view(np.float32)
            a = self.arch.expert_act(gu, F)  # [S, F]
            y = np.empty((len(xg), D), np.float32)  # [S, D]
            matmul_jobs([Job(v.down, et.down, D, t0, n) for v, t0, n in zip(views, starts, counts)], F, a, y,
                        self.kernels, order="mul_mat_id")
            if biased:
                for v, t0, n in zip(views, starts, counts):
                    y[t0 : t0 + n] += v.biases[2].view(np.float32)
            scale = self.arch.expert_scale(self._w.layers[l])  # [E] or None
            if scale is not None:  # each expert's own output scale, then the router's weight
                for v, t0, n in zip(views, starts, counts):
                    y[t0 : t0 + n] *= scale[v.expert]
            if not before:
                y *= wf
            # keyed by (row, top-k slot) as row * K + slot: _moe_add sums each row's slots in order
            return {v.expert: (picked[t0 : t0 + n], y[t0 : t0 + n]) for v, t0, n in zip(views, starts, counts)}

    def _moe_add(self, l: int, x: np.ndarray, h: np.ndarray, ys: "list | np.ndarray", step: Step) -> np.ndarray:
        """The layer's output from x and the routed experts' outputs (arch.ffn_out: by default x + them
        + what the architecture adds, shared experts or a dense layer's FFN). Each row's experts are
        summed in its router's slot order (as llama.cpp adds them), never in the order they were asked for or read: that order depends on the other rows
        of the step (most-voted first) and on the cache, and float sums in another order differ in
        their last bits, so a row's result would depend on what it was batched with."""
        R, D = h.shape
        acc = next((y for y in ys if isinstance(y, SlotOutputs)), None) if isinstance(ys, list) else None
        if isinstance(ys, np.ndarray):  # summed already (_routed_now's resident table), in the same order
            out = ys
        elif acc is not None:  # the compiled path's slots (StreamedExperts), the general path's groups put in
            for y in ys:
                if y is not acc:
                    acc.put(*y)
            out = acc.sum()  # [R, D]
            if step.slot_outputs is acc:
                step.slot_outputs = None
        elif ys:
            K = self.config.n_expert_used
            slots = np.zeros((R * K, D), np.float32)  # a slot whose expert failed stays 0 (its row has failed)
            for flat, y in ys:
                slots[flat] = y
            slots = slots.reshape(R, K, D)
            out = slots[:, 0].copy()  # [R, D]
            for k in range(1, K):
                out += slots[:, k]
        else:
            out = np.zeros_like(h)  # [R, D]
        return self.arch.ffn_out(self._w.layers[l], x, h, out)

    def _finish(self, x: np.ndarray, h: np.ndarray, ys: list, step: Step) -> list[Outcome]:
        """The last layer's output, then what each segment wants: the output projection of the
        rows wanted (all of a segment's, or its last: the others' logits would cost a [V, D] product
        per row for nothing), or the final hidden states; then each segment's head."""
        cfg, plan = self.config, step.plan
        with self.profile.span("shared + sum"):
            x = self._moe_add(cfg.n_layers - 1, x, h, ys, step)  # [R, D]
        step.commit()
        with self.profile.span("output"):
            outs = self._outputs(x, plan)
        results: list[Outcome] = []
        with self.profile.span("sampling"):
            for seg, out in zip(plan.segments, outs):
                err = step.failed.get(id(seg))
                if err is not None:
                    results.append(Outcome(error=err))
                elif seg.head is None:
                    results.append(Outcome(out))
                else:
                    try:
                        results.append(Outcome(seg.head(out)))
                    except Exception as e:  # noqa: BLE001 - this segment's head failed: only this segment
                        results.append(Outcome(error=e))
        return results

    def _outputs(self, x: np.ndarray, plan: StepPlan) -> list[np.ndarray | None]:
        cfg, w = self.config, self._w
        spans: list[tuple[int, int] | None] = []
        hidden: list[tuple[int, int] | None] = []
        for s in plan.segments:
            spans.append((s.r0, s.n) if s.want is Want.ALL else (s.r0 + s.n - 1, 1) if s.want is Want.LAST else None)
            hidden.append((s.r0, s.n) if s.want is Want.HIDDEN else None)
        out: list[np.ndarray | None] = [None] * len(spans)
        wanted = [sp for sp in spans if sp is not None]
        if wanted:
            rows = np.concatenate([np.arange(r0, r0 + n) for r0, n in wanted]) if len(wanted) > 1 else \
                np.arange(wanted[0][0], wanted[0][0] + wanted[0][1])
            logits = self.arch.final_logits(w.output(rmsnorm(x[rows], w.output_norm, cfg.eps)))  # [rows, V]
            at = 0
            for i, sp in enumerate(spans):
                if sp is not None:
                    out[i], at = logits[at : at + sp[1]], at + sp[1]
        for i, sp in enumerate(hidden):
            if sp is not None:
                out[i] = rmsnorm(x[sp[0] : sp[0] + sp[1]], w.output_norm, cfg.eps)  # [T, D]
        return out

    def _predicting(self) -> bool:
        """The next layer's router on the current residual (one small product per layer and decode
        step) only when something uses it: prefetch, or a cache policy that takes hints."""
        return self._hints or self._prefetch

    def _predict(self, l: int, x: np.ndarray) -> tuple[list[int], list[int]]:
        """Experts layer l will likely want: its router on the current residual, most-voted first;
        and the part of them prefetch reads: each row's experts of router weight >= PREFETCH_MIN_WEIGHT
        where weights are probabilities, else its PREFETCH_RANKS best-ranked (in a batch, the union of
        the rows' picks, most-voted first). The others are mostly wrong, and each wrong one costs an
        expert's read and evicts a cached expert."""
        lw = self._w.layers[l]
        h = self.arch.ffn_input(lw, x)  # [R, D]
        sel, w = self.arch.route(lw, self.arch.router_input(lw, x, h))  # [R, K], each row best first
        if self._pick_by_weight:
            picks = sel[w >= PREFETCH_MIN_WEIGHT]  # [P], row-major: each row's best first
            pf = picks.tolist() if len(sel) == 1 else _by_votes(picks.reshape(-1, 1))  # one row: distinct already
        else:
            pf = _by_votes(sel[:, :PREFETCH_RANKS])
        return _by_votes(sel)[: self._max_batch], pf[: self._max_batch]

    # -- compute thread: streamed experts --------------------------------------------------------------
    def _routed_taken(self, l: int, h: np.ndarray, sel: np.ndarray, w: np.ndarray, step: Step,
                      nxt: tuple[list[int], list[int]] | None) -> "list[tuple[np.ndarray, np.ndarray]]":
        """Layer l's routed experts for every row of the step from the streaming source: each expert read
        once, computed group by group as its bytes arrive (the cached ones first, while the misses are
        read). An expert whose read fails fails the segments routed to it; the others go on without it."""
        wanted = _by_votes(sel)  # each expert once per layer per step
        ys: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        layer = self._moe_index[l]
        ahead = self._ahead.get(l)
        if nxt is not None and ahead == l + 1:  # before this layer's get: its misses then spare layer l+1's experts
            self.experts.hint(self._moe_index[l + 1], nxt[0])
        users = _users(sel, step.plan.seg_of_row) if step.accounting else None  # expert -> segment indices
        todo = list(wanted)
        first_get = True
        long = len(sel) > self.tile_rows
        if long:  # chunks of experts by the pairs they compute: a slice of compute, a chunk step's memory
            pairs = np.bincount(sel.reshape(-1), minlength=self.config.n_expert)  # [E] rows routed to each
            most = self.tile_rows * sel.shape[1]  # what a step of tile_rows computes (its temporaries' size)
            if self._pair_seconds:
                most = max(1, min(most, int(self.slice_seconds / self._pair_seconds)))
        while todo:
            n = self._max_batch
            if long:  # the next chunk read meanwhile
                n = _within(todo[:n], pairs, most)
            chunk, todo = todo[:n], todo[n:]
            before = self.experts.stats() if users is not None else None
            hits: list[int] = []
            t_chunk = time.perf_counter()
            groups = self.experts.take(layer, chunk)
            if long and todo:
                self.experts.prefetch(layer, todo[:n])
            try:
                first_group = True
                while True:
                    t_wait = time.perf_counter()
                    views = next(groups, None)
                    self.profile.add("wait for reads", time.perf_counter() - t_wait)
                    if views is None:
                        break
                    if first_group and before is not None and self.experts.stats().hits > before.hits:
                        hits = [v.expert for v in views]  # the first group is the cached experts, if any
                    first_group = False
                    if first_get and nxt is not None and self._prefetch:
                        # This layer's experts are pinned and its misses on their way: queue the experts
                        # the next MoE layer's router picks from the current hidden state, read once this
                        # layer's misses are in (the store's idle-disk rule) while it computes. (In a
                        # prefill nearly every expert is demanded anyway.)
                        self.experts.prefetch(self._moe_index[ahead], nxt[1])
                    first_get = False
                    ys.update(self._experts_out(l, h, sel, w, views, step))
                if before is not None:
                    _charge(step, users, chunk, hits, before, self.experts.stats())
            except ExpertReadError as e:
                if e.layer != layer or e.expert not in chunk:
                    raise
                # Fail the segments whose rows chose this expert; ask again for the rest of the chunk
                # not computed yet (their reads may have been cut short by this one's failure).
                step.fail_rows(np.nonzero((sel == e.expert).any(axis=1))[0], e)
                todo = [x for x in chunk if x not in ys and x != e.expert] + todo
            finally:
                groups.close()
            first_get = False
            if long:
                self._pair_seconds = (time.perf_counter() - t_chunk) / max(1, int(pairs[chunk].sum()))
                yield
        return [ys[e] for e in wanted if e in ys]


def _users(sel: np.ndarray, seg_of_row: np.ndarray) -> dict[int, list[int]]:
    """Which segments chose each expert of sel [R, K] (seg_of_row [R]): {expert: [segment index]}."""
    n = int(seg_of_row[-1]) + 1
    if n == 1:  # one segment (a lone sequence's decode step): every expert is its
        return {e: [0] for e in sel.reshape(-1).tolist()}
    pairs = np.unique(sel.astype(np.int64) * n + seg_of_row[:, None])  # expert * n + segment, distinct
    out: dict[int, list[int]] = {}
    for e, si in zip((pairs // n).tolist(), (pairs % n).tolist()):
        out.setdefault(e, []).append(si)
    return out


def _charge(step: Step, users: dict[int, list[int]], chunk: list[int], hits: list[int], before, after) -> None:
    """One get()'s I/O to the ledgers of the segments whose rows needed its experts (clutor.model.accounting):
    each expert's access shared equally by its users; the get's demand bytes and wait by its misses."""
    misses = [e for e in chunk if e not in hits]
    per_miss_bytes = (after.bytes_demand - before.bytes_demand) / len(misses) if misses else 0.0
    per_miss_wait = (after.wait_seconds - before.wait_seconds) / len(misses) if misses else 0.0
    segments = step.segments
    for e in chunk:
        who = users.get(e, ())
        if not who:
            continue
        f = 1.0 / len(who)
        missed = e not in hits
        for si in who:
            led = segments[si].ledger
            if led is not None:
                led.add(f, 0.0 if missed else f, f if missed else 0.0,
                        per_miss_bytes * f if missed else 0.0, per_miss_wait * f if missed else 0.0)


def _within(experts: list[int], pairs: np.ndarray, most: int) -> int:
    """How many of experts (in order) compute at most `most` pairs together (pairs [E]: each expert's
    rows); at least one."""
    total = np.cumsum(pairs[experts])
    return max(1, int(np.searchsorted(total, most, "right")))


def _by_votes(sel: np.ndarray) -> list[int]:
    """Distinct experts of sel [T, K], most-chosen first, ties in router order (token 0's rank 0 first),
    so a one-token step asks for its experts exactly in the order the router ranked them."""
    if len(sel) == 1:  # one row: its experts are distinct, each chosen once, in router order
        return sel[0].tolist()
    flat = sel.reshape(-1)
    ids, first, counts = np.unique(flat, return_index=True, return_counts=True)
    order = np.lexsort((first, -counts))  # by count descending, then first appearance
    return ids[order].tolist()
