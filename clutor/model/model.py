"""Model: open a GGUF MoE file, compute logits, generate text.

The layer loop awaits each layer's routed experts from an ExpertSource (in memory here; the
disk-streaming ExpertStore elsewhere) and never knows which one it has.
"""
from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, AsyncIterator, Callable, Sequence

import numpy as np

from .._util import AwaitableContext
from ..io.trace import TraceHeader, TraceWriter
from ..errors import ClosedError, ClutorError, ModelFileError
from .arch import read_config
from .config import ModelConfig
from .gguf import GGUFFile
from .layers import KVCache, Rope, attention, rmsnorm, route, silu
from . import kernels
from .kernels import Job
from .quants import apply_all, matmul_jobs
from ..io.policies import POLICIES
from .options import ModelOptions, resolve_budget
from .source import ExpertSource, InMemoryExperts
from .tokenizer import Tokenizer
from .weights import DenseWeights, LayerWeights, load_dense

if TYPE_CHECKING:
    from .generate import GenerationChunk

__all__ = ["Model", "SequenceState"]


class SequenceState:
    """One sequence's state: its KV cache and how many positions it holds."""

    def __init__(self, cfg: ModelConfig, n_ctx: int):
        self.kv = KVCache(cfg.n_layers, cfg.n_head_kv, n_ctx, cfg.head_dim, cfg.head_dim_v)

    @property
    def n(self) -> int:
        return self.kv.n


class Model:
    """A MoE model ready to run. Create with ``await Model.open(path)`` or ``async with Model.open(path)``."""

    def __init__(self, path: str, f: GGUFFile, cfg: ModelConfig, dense: DenseWeights, tokenizer: Tokenizer,
                 experts: ExpertSource, n_ctx: int, *, options: ModelOptions, cache_note: str,
                 trace: TraceWriter | None = None):
        self.path = path
        self.config = cfg
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self._file = f
        self._w = dense
        self._experts = experts
        self._rope = Rope(cfg.n_rot, cfg.rope_base, n_ctx)
        self._closed = False
        self.options = options
        self.cache_note = cache_note  # how the expert cache size was chosen (said in the report)
        # Off unless asked: on the OLMoE-shaped benchmark (README) it did not beat demand reads alone.
        self._prefetch = options.prefetch is True and options.io != "memory"
        self._trace = trace
        # Most distinct experts one get() may pin (0 = unbounded, in memory): a prefill touching more is
        # served in chunks, leaving room for other sequences and for the next layer's prefetch.
        room = getattr(experts, "n_slots", 0) + getattr(experts, "n_spare", 0)
        self._max_batch = min(room, max(cfg.n_expert_used, room // 2)) if room else cfg.n_expert

    # ---- lifecycle -------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, n_ctx: int | None = None, expert_cache: int | str | None = None,
             prefetch: bool | None = None, policy: str = "forecast", io: str = "auto", direct: bool = True,
             trace: str | os.PathLike | None = None,
             progress: Callable[[int, int], None] | None = None) -> AwaitableContext["Model"]:
        """Open a GGUF MoE model.

        n_ctx: context length (default min(model's, 4096)).
        expert_cache: bytes for routed experts: an int, "3GiB", or "25%" of all expert bytes; None picks
            half of the memory available after the dense weights (capped at what all experts need).
        prefetch: during decode, read the experts predicted for layer l+1 while layer l computes (default:
            off; it did not win the OLMoE-shaped benchmark, see the README).
        policy: cache replacement policy (see clutor.io.policies.POLICIES).
        io: "auto" (io_uring, else threads), "uring", "threads", or "memory" (mmap the file, no cache).
        direct: O_DIRECT reads that bypass the page cache (falls back to buffered where refused).
        trace: write the routing of every token to this JSONL file (the simulator's format).
        progress: called as progress(bytes_read, dense_bytes) while the dense weights load (from a thread).
        """
        opts = ModelOptions(n_ctx=n_ctx, expert_cache=expert_cache, prefetch=prefetch, policy=policy, io=io,
                            direct=direct, trace=os.fspath(trace) if trace is not None else None)
        return AwaitableContext(lambda: cls._open(os.fspath(path), opts, progress))

    @classmethod
    async def _open(cls, path: str, opts: ModelOptions, progress=None) -> "Model":
        # Parsing and reading the dense weights are blocking file I/O: keep them off the event loop.
        # Everything that can be refused (file, context, budget) is checked before the dense read.
        def load():
            f = GGUFFile.open(path)
            try:
                cfg = read_config(f)
                tok = Tokenizer.from_metadata(f.metadata, path)
                if tok.n_vocab != cfg.n_vocab:
                    raise ModelFileError(path, "tokenizer.ggml.tokens", f"{cfg.n_vocab} tokens (rows of token_embd)", tok.n_vocab)
                layout = f.expert_layout(cfg.n_layers, cfg.n_expert)
                ctx = min(cfg.n_ctx_train, 4096) if opts.n_ctx is None else int(opts.n_ctx)
                if not 1 <= ctx <= cfg.n_ctx_train:
                    raise ClutorError(f"n_ctx must be between 1 and the model's context_length {cfg.n_ctx_train}, got {ctx}")
                budget = None
                if opts.io != "memory":
                    dense_bytes = sum(t.nbytes for n, t in f.tensors.items() if not n.endswith("_exps.weight"))
                    budget = resolve_budget(opts.expert_cache, layout, cfg.n_expert_used, dense_bytes)
                dense = load_dense(f, cfg, _progress_of(progress, f))
                # compile (first run on this machine) or load the cached kernels now, not in the first token
                kernels.warmup()
            except BaseException:
                f.close()
                raise
            return f, cfg, tok, dense, layout, ctx, budget

        if opts.io != "memory" and opts.policy not in POLICIES:
            raise ClutorError(f"policy must be one of {', '.join(sorted(POLICIES))}, got {opts.policy!r}")
        f, cfg, tok, dense, layout, ctx, budget = await asyncio.to_thread(load)
        experts: ExpertSource | None = None
        try:
            if budget is None:
                experts, why = InMemoryExperts(layout), "all experts mapped from the file (io=memory)"
            else:
                from ..io.store import ExpertStore

                experts = await ExpertStore.open(layout, budget[0], policy=opts.policy, io=opts.io,
                                                 direct=opts.direct, prefetch_slots=None if opts.prefetch else 0)
                why = budget[1]
            trace = None
            if opts.trace:
                # expert_bytes = the store's slot size, so `clutor simulate --budget B` models the same cache
                slot = getattr(experts, "slot_bytes", layout.max_expert_bytes)
                try:
                    trace = TraceWriter(opts.trace, TraceHeader(cfg.n_layers, cfg.n_expert, cfg.n_expert_used, slot))
                except OSError as e:
                    raise ClutorError(f"{opts.trace}: cannot write the routing trace: {e.strerror}") from None
        except BaseException:
            if experts is not None:
                await experts.aclose()
            f.close()
            raise
        return cls(path, f, cfg, dense, tok, experts, ctx, options=opts, cache_note=why, trace=trace)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._trace is not None:
            self._trace.close()
        await self._experts.aclose()
        self._file.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.path}: model is closed")

    # ---- forward ---------------------------------------------------------------------------
    def new_sequence(self) -> SequenceState:
        return SequenceState(self.config, self.n_ctx)

    async def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of a fresh sequence: float32 [len(ids), n_vocab]."""
        self._check_open()
        return await self.forward(self.new_sequence(), ids, all_logits=True)

    async def forward(self, seq: SequenceState, ids: Sequence[int], *, all_logits: bool = False) -> np.ndarray:
        """Append ids to seq (one batched pass); logits [T, V] if all_logits else [1, V] for the last."""
        cfg = self.config
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # [T]
        T, p0 = len(ids), seq.n
        if T == 0:
            raise ClutorError("forward needs at least one token")
        if ids.min() < 0 or ids.max() >= cfg.n_vocab:
            raise ClutorError(f"token ids must be in [0, {cfg.n_vocab}), got {int(ids.min())}..{int(ids.max())}")
        if p0 + T > seq.kv.n_ctx:
            raise ClutorError(f"context full: {p0} + {T} tokens > n_ctx {seq.kv.n_ctx} (open the model with a larger n_ctx)")
        x = self._w.tok_embd.rows(ids)  # [T, D]
        for l, lw in enumerate(self._w.layers):
            x = x + self._attention(lw, l, x, seq, p0)
            x = x + await self._moe(l, x, p0)
        seq.kv.n = p0 + T
        if not all_logits:
            x = x[-1:]
        return self._w.output(rmsnorm(x, self._w.output_norm, cfg.eps))  # [T or 1, V]

    def _attention(self, lw: LayerWeights, l: int, x: np.ndarray, seq: SequenceState, p0: int) -> np.ndarray:
        cfg = self.config
        T = x.shape[0]
        h = rmsnorm(x, lw.attn_norm, cfg.eps)  # [T, D]
        q, k, v = apply_all((lw.wq, lw.wk, lw.wv), h)  # [T, H*hd], [T, Hkv*hd], [T, Hkv*hdv]
        if cfg.qkv_bias:
            q, k, v = q + lw.bq, k + lw.bk, v + lw.bv
        if cfg.qk_norm == "full":  # olmoe: over the whole vectors, before the head split
            q, k = rmsnorm(q, lw.q_norm, cfg.eps), rmsnorm(k, lw.k_norm, cfg.eps)
        q = q.reshape(T, cfg.n_head, cfg.head_dim)
        k = k.reshape(T, cfg.n_head_kv, cfg.head_dim)
        if cfg.qk_norm == "head":  # qwen3moe: per head, after the split
            q, k = rmsnorm(q, lw.q_norm, cfg.eps), rmsnorm(k, lw.k_norm, cfg.eps)
        q, k = self._rope(q, p0), self._rope(k, p0)
        seq.kv.write(l, p0, k, v.reshape(T, cfg.n_head_kv, cfg.head_dim_v))
        o = attention(q, seq.kv, l, p0, 1.0 / np.sqrt(cfg.head_dim))  # [T, H*hdv]
        return lw.wo(o)

    async def _moe(self, l: int, x: np.ndarray, p0: int) -> np.ndarray:
        """Routed experts (+ qwen2moe's shared expert) on the residual x [T, D] -> the MoE output [T, D]."""
        cfg, lw = self.config, self._w.layers[l]
        D, F = cfg.n_embd, cfg.n_ff_exp
        h = rmsnorm(x, lw.ffn_norm, cfg.eps)  # [T, D]
        sel, w = route(h, lw.router, cfg.n_expert_used, cfg.norm_topk)  # [T, K], [T, K]
        nxt = None
        if len(x) == 1 and l + 1 < cfg.n_layers:
            # Decode: layer l+1's router on this residual predicts its experts. Told to the cache
            # before this layer's get, so this layer's misses do not evict them (and prefetch reads them).
            nxt = self._predict(l + 1, x)
            self._experts.hint(l + 1, nxt)
        if self._trace is not None:
            for t in range(len(sel)):
                self._trace.write(p0 + t, l, sel[t].tolist(), w[t].tolist(), next=nxt)
        wanted = _by_votes(sel)  # each expert read once per layer per batch
        out = np.zeros_like(h)  # [T, D]
        for i in range(0, len(wanted), self._max_batch):
            chunk = wanted[i : i + self._max_batch]
            # Reserved and submitted as one batch, but computed group by group as the bytes arrive (all
            # cached ones at once, then the reads that completed together) while the rest is still
            # read; the sums are taken afterwards in a fixed order, so the result never depends on
            # which read finished first.
            groups = self._experts.get_ready(l, chunk)
            ys: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            try:
                async for views in groups:
                    if not ys and i == 0 and self._prefetch and len(x) == 1 and l + 1 < cfg.n_layers:
                        # Decode only: this layer's experts are pinned and its misses submitted; now
                        # queue the experts layer l+1's router picks from the current hidden state.
                        # (In a prefill nearly every expert is demanded anyway; it measured slower.)
                        self._experts.prefetch(l + 1, nxt)
                    ys.update(self._experts_out(l, h, sel, w, views))
            finally:
                await groups.aclose()
            # Yield once: another sequence waiting for the slots just released gets its turn before
            # this one reserves again (without it, a sequence whose next layer is all hits never
            # suspends and can starve the other).
            await asyncio.sleep(0)
            for e in chunk:
                rows, y = ys[e]
                out[rows] += y
        if cfg.n_ff_shexp:
            g = 1.0 / (1.0 + np.exp(-(h @ lw.sh_gate_inp)))  # [T]
            s = lw.sh_down(silu(lw.sh_gate(h)) * lw.sh_up(h))  # [T, D]
            out += g[:, None].astype(np.float32) * s
        return out

    def _experts_out(self, l: int, h: np.ndarray, sel: np.ndarray, w: np.ndarray,
                     views) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Some of layer l's experts on the normed residual h [T, D]: {expert: (rows, weighted output
        [n, D])} for the n tokens routed to it. Every expert's tokens are gathered into one array so
        that gate and up for all of them are one kernel launch, and down another."""
        cfg, et = self.config, self._w.layers[l].experts
        D, F = cfg.n_embd, cfg.n_ff_exp
        picks = [np.nonzero(sel == v.expert) for v in views]  # (token rows, top-k slots) per expert
        counts = [len(rows) for rows, _ in picks]
        starts = np.cumsum([0] + counts)[:-1].tolist()
        xg = h[np.concatenate([rows for rows, _ in picks])]  # [S, D], S = tokens summed over experts
        gu = np.empty((len(xg), 2 * F), np.float32)  # [S, 2F]: gate | up
        matmul_jobs([job for v, t0, n in zip(views, starts, counts)
                     for job in (Job(v.gate, et.gate, F, t0, n, 0), Job(v.up, et.up, F, t0, n, F))], D, xg, gu)
        a = silu(gu[:, :F]) * gu[:, F:]  # [S, F]
        y = np.empty((len(xg), D), np.float32)  # [S, D]
        matmul_jobs([Job(v.down, et.down, D, t0, n) for v, t0, n in zip(views, starts, counts)], F, a, y)
        y *= np.concatenate([w[rows, slots] for rows, slots in picks])[:, None]
        return {v.expert: (rows, y[t0 : t0 + n]) for v, (rows, _), t0, n in zip(views, picks, starts, counts)}

    def _predict(self, l: int, x: np.ndarray) -> list[int]:
        """Experts layer l will likely want: its router on the current residual, most-voted first."""
        cfg, lw = self.config, self._w.layers[l]
        sel, _ = route(rmsnorm(x, lw.ffn_norm, cfg.eps), lw.router, cfg.n_expert_used, cfg.norm_topk)
        return _by_votes(sel)[: self._max_batch]

    def io_stats(self):
        """The expert store's counters (None when experts are mapped from the file)."""
        stats = getattr(self._experts, "stats", None)
        return stats() if stats is not None else None

    # ---- generation ------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], **options) -> AsyncIterator["GenerationChunk"]:
        """Stream a continuation; see clutor.model.generate.generate for the options."""
        from .generate import generate

        self._check_open()
        return generate(self, prompt, **options)


def _progress_of(progress, f) -> Callable[[int], None] | None:
    """Adapt progress(done, total) to load_dense's per-tensor byte counts."""
    if progress is None:
        return None
    total = sum(t.nbytes for name, t in f.tensors.items() if not name.endswith("_exps.weight"))
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
