"""One Clutor benchmark run in this process.

    python -m clutor.bench.worker MODEL --json-args '{"expert_cache": "25%", "prefetch": true, ...}'

Opens the model with the given options, runs a warm-up of WARMUP_TOKENS tokens from a different prompt
of the same length (first allocations, first page touches of a mapped model, the first compile or cache
load of the decode kernels, a cache in steady state; excluded from the figures), then the measured
generation of ``tokens`` tokens from the ``prompt_tokens``-token benchmark prompt with EOS ignored, and
prints one JSON line (see ``run``). The warm-up uses another prompt so it does not pre-load exactly the
prompt's experts.

``workload``: "ids" (seeded token ids, greedy) or "text" (slices of the bundled corpus, llama.cpp's default
sampling seeded per stream); see clutor.bench.prompt. ``trace``: record the run's routing and replay it
(clutor.bench.bounds): Belady's minimal bytes for the decode tokens at the run's cache size, and the run's own
policy on the same trace, reported as ``replay``.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import time

from .._util import sleeping_kernel_workers
from ..errors import ClutorError
from ..io.policies import DEFAULT_POLICY
from ..model.profile import to_json
from .process import peak_memory, storage_read_bytes
from .prompt import WARMUP_PROMPT_TOKENS, prompt_digest, sampling_options, workload_prompts
from .protocol import COMMON_OPTIONS, worker_main, worker_options

__all__ = ["DEFAULTS", "run", "to_jsonable"]

# Options of the run; the Model.open ones are passed through as given.
DEFAULTS: dict = {
    **COMMON_OPTIONS,
    "expert_cache": None,
    "prefetch": None,
    "policy": DEFAULT_POLICY,
    "io": "auto",
    "direct": True,
    "concurrency": None,     # N: N streams at once, each its own prompt (see _run_concurrent)
    "during": None,          # N: N short streams' inter-token latency, alone, then while the prompt prefills
    "profile": False,        # time each step's spans (clutor.model.profile); the result carries them
    "activations": "auto",   # kernels: auto | q8 | f32
    "kv_cache": None,        # KV pool bytes (None: Model.open's default)
    "kv_type": "f16",        # f32 | f16 | q8_0
    "prefill_window": None,  # tokens of a long prompt one step takes (None: Model.open's default, 0: chunks)
    "prefix_cache_disk": None,  # a directory for KV pages on disk (None: off)
    "trace": False,          # record the routing and replay it: Belady's bytes for the decode tokens
}
STORE_KEYS = ("expert_cache", "prefetch", "policy", "io", "direct")
OPEN_KEYS = STORE_KEYS + ("profile", "activations", "kv_cache", "kv_type", "prefill_window", "prefix_cache_disk")
# Values that ask for nothing beyond what a Model.open without that option does (experts from memory;
# a checkout from before the KV pool kept float32 keys and values, with no budget).
_NEUTRAL = {"expert_cache": None, "prefetch": None, "policy": DEFAULT_POLICY, "io": "memory", "direct": True,
            "profile": False, "activations": "auto", "kv_cache": None, "kv_type": "f32", "prefill_window": 0,
            "prefix_cache_disk": None}


def to_jsonable(obj):
    """Dataclasses (with their properties such as decode_tps) and plain objects as JSON-ready dicts."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if dataclasses.is_dataclass(obj):
        out = {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        for name, attr in inspect.getmembers(type(obj)):
            if isinstance(attr, property) and name not in out and not name.startswith("_"):
                try:
                    out[name] = to_jsonable(getattr(obj, name))
                except Exception:  # a derived figure that cannot be computed is simply left out
                    pass
        return out
    if hasattr(obj, "__dict__"):
        return {k: to_jsonable(v) for k, v in vars(obj).items() if not k.startswith("_")}
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    return str(obj)


def _open_kwargs(open_fn, opts: dict) -> tuple[dict, list[str]]:
    """Options Model.open takes; an option it does not take is dropped only when it asks for nothing
    (e.g. io="memory" on a build without a streaming store), otherwise that is an error: a knob that
    silently does nothing would make the benchmark lie."""
    params = inspect.signature(open_fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict = {"n_ctx": opts["n_ctx"]}
    ignored: list[str] = []
    # Without a store (io="memory") the cache options have nothing to act on.
    storeless = opts["io"] == "memory" and not (takes_any or "io" in params)
    for key in (k for k in OPEN_KEYS if k in opts):
        value = opts[key]
        if takes_any or key in params:
            kwargs[key] = value
        elif (storeless and key in STORE_KEYS) or value == _NEUTRAL[key]:
            ignored.append(key)
        else:
            raise ClutorError(f"this Clutor's Model.open has no {key!r} option (asked for {key}={value!r})")
    return kwargs, ignored


# The warm-up's tokens: the prompt's prefill gives the first, the second is a decode step. A prefill
# alone never calls the decode-only kernel specialisations (RoPE's one-row write among them), which
# would then compile (a checkout's first run) or load from numba's cache inside the measured window:
# such a run's in-RAM bound came out at half its value (wide.gguf, one stream, AMD EPYC Zen 3: 27.6
# against 58-61 tok/s in the runs after it).
WARMUP_TOKENS = 2


async def _generate(model, ids: list[int], max_tokens: int, sampling: dict | None = None):
    """Tokens, the final stats, and the storage-read counter and store counters when the first token
    arrived (that is, after the prefill): the split of reads between prefill and decode."""
    tokens: list[int] = []
    stats = None
    read_at_first = io_at_first = None
    async for chunk in model.generate(ids, max_tokens=max_tokens, ignore_eos=True, **(sampling or {"temperature": 0})):
        if chunk.token is not None:
            if not tokens:
                read_at_first = storage_read_bytes()
                io_at_first = model.io_stats()
            tokens.append(chunk.token)
        if chunk.stats is not None:
            stats = chunk.stats
    return tokens, stats, read_at_first, io_at_first


def window_io(a, b, tokens: int) -> dict | None:
    """What the store did between two of its StoreStats (a window of ``tokens`` generated tokens): bytes
    and hits per token, and the prefetcher's accuracy (prefetched experts that served a demand, hits on
    staged slots and reads a demand caught in flight, over experts prefetched) and waste (prefetched
    experts given up unused, at the window's mean bytes per expert read)."""
    if a is None or b is None:
        return None
    d = {k: getattr(b, k) - getattr(a, k) for k in (
        "accesses", "hits", "misses", "staging_hits", "prefetch_issued", "prefetch_late", "prefetch_wasted",
        "bytes_demand", "bytes_prefetch", "wait_seconds", "bypass_reads")}
    read = d["bytes_demand"] + d["bytes_prefetch"]
    reads = d["misses"] - d["prefetch_late"] + d["prefetch_issued"]  # experts read (a late prefetch counts once)
    per_expert = read / reads if reads > 0 else 0.0
    used = d["staging_hits"] + d["prefetch_late"]
    return {
        **d, "tokens": tokens, "bytes_read": read,
        "bytes_per_token": read / tokens if tokens else None,
        "hit_rate": d["hits"] / d["accesses"] if d["accesses"] else None,
        "prefetch_accuracy": used / d["prefetch_issued"] if d["prefetch_issued"] else None,
        "prefetch_wasted_bytes_per_token": d["prefetch_wasted"] * per_expert / tokens if tokens else None,
        "n_slots": b.n_slots, "slot_bytes": b.slot_bytes, "backend": b.backend, "mode": b.mode,
    }


def _replay(path: str, trace_path: str, n_slots: int | None, first_position: int, policy: str) -> dict:
    """Belady (and the run's policy) over the run's own trace, counted over its decode tokens (where
    the store has slots), and the bytes of the distinct experts its prompt routed to."""
    from ..io.trace import read_trace
    from ..model.gguf import GGUFFile
    from ..model.arch import read_arch
    from ..model.weights import expert_layout
    from .bounds import expert_read_bytes, prefill_distinct_bytes, replay_window

    with GGUFFile.open(path) as f:
        layout = expert_layout(f, read_arch(f))
    trace = read_trace(trace_path)
    read_bytes = expert_read_bytes(layout)
    out = replay_window(trace, n_slots, read_bytes, first_position, policy).to_json() if n_slots else {}
    return {**out, "prefill_distinct_bytes": prefill_distinct_bytes(trace, read_bytes, first_position)}


async def _run(path: str, opts: dict) -> dict:
    from ..model.model import Model

    kwargs, ignored = _open_kwargs(Model.open, opts)
    with _trace_file(opts) as trace_path:
        if trace_path is not None:
            kwargs["trace"] = trace_path
        if opts["during"] is not None:
            out = await _run_during(path, opts, kwargs)
        elif opts["concurrency"] is not None:
            out = await _run_concurrent(path, opts, kwargs)
        else:
            out = await _run_one(path, opts, kwargs)
        out["ignored_options"] = ignored
        if trace_path is not None:
            out["replay"] = _replay(path, trace_path, (out.get("decode_io") or {}).get("n_slots"),
                                    opts["prompt_tokens"], opts["policy"])
    return out


class _trace_file:
    """A temporary trace path when the run records one (removed afterwards), else None."""

    def __init__(self, opts: dict):
        self.want = bool(opts["trace"])
        self.dir = None

    def __enter__(self) -> str | None:
        if not self.want:
            return None
        import tempfile

        self.dir = tempfile.TemporaryDirectory(prefix="clutor-bench-trace-")
        return os.path.join(self.dir.name, "trace.jsonl")

    def __exit__(self, *exc) -> None:
        if self.dir is not None:
            self.dir.cleanup()


async def _run_one(path: str, opts: dict, kwargs: dict) -> dict:
    from ..model.model import Model

    t0 = time.perf_counter()
    async with Model.open(path, **kwargs) as model:
        t_open = time.perf_counter() - t0
        *prompts, warm = workload_prompts(model.tokenizer, opts["workload"], 2, opts["prompt_tokens"], opts["seed"])
        ids = prompts[0]
        sampling = sampling_options(opts["workload"], opts["seed"])
        t_warm = 0.0
        if opts["warmup"]:
            t1 = time.perf_counter()
            await _generate(model, warm[:WARMUP_PROMPT_TOKENS], WARMUP_TOKENS, sampling)
            t_warm = time.perf_counter() - t1
        if opts["profile"]:
            model.profile.reset()  # the figures are the measured generation's, not the warm-up's
        read0 = storage_read_bytes()
        t2 = time.perf_counter()
        tokens, stats, read_mid, io_first = await _generate(model, ids, opts["tokens"], sampling)
        t_gen = time.perf_counter() - t2
        read1 = storage_read_bytes()
        io_end = model.io_stats()
        cfg = model.config
        n_ctx = model.n_ctx
        profile = to_json(model.profile) if opts["profile"] else None  # (older checkouts have no .profile)
        store = getattr(getattr(model, "kv", None), "disk", None)
        if store is not None:
            await store.aclose()  # what it has queued is written: the next process (a restart) finds it
            disk_cache = to_jsonable(store.stats())
        else:
            disk_cache = None
    t_total = time.perf_counter() - t0
    s = to_jsonable(stats) or {}
    io = s.pop("io", None)
    return {
        "engine": "clutor",
        "model": path,
        "options": {k: opts[k] for k in DEFAULTS},
        "n_ctx": n_ctx,
        "config": {"arch": cfg.arch, "n_layers": cfg.n_layers, "n_expert": cfg.n_expert,
                   "n_expert_used": cfg.n_expert_used},
        "prompt_digest": prompt_digest(ids),
        "stats": s,
        "io": io,
        "tokens": tokens,
        "peak_rss": s.pop("peak_rss", None) or peak_memory()["ru_maxrss"],
        "memory": peak_memory(),
        "storage_read_bytes": None if read0 is None or read1 is None else read1 - read0,
        "storage_read_bytes_by_phase": None if None in (read0, read_mid, read1)
        else {"prefill": read_mid - read0, "decode": read1 - read_mid},
        "seconds": {"open": t_open, "warmup": t_warm, "generate": t_gen, "total": t_total},
        "threads": os.cpu_count(),
        "profile": profile,
        "decode_io": window_io(io_first, io_end, len(tokens) - 1),  # the decode steps' reads
        "disk_cache": disk_cache,
    }


STREAM_PROMPT_TOKENS = 32  # the decoding streams' prompts in a --during run


async def _run_during(path: str, opts: dict, kwargs: dict) -> dict:
    """N short streams decoding, alone for ``tokens`` tokens each, then again while the long prompt (the
    run's prompt_tokens) prefills: each stream's gaps between tokens in both phases (the second phase's
    are those wholly between the long prompt's submission and its first token), and its time to first
    token."""
    import asyncio

    from ..model.model import Model

    n = int(opts["during"])
    if n < 1:
        raise ClutorError(f"during must be >= 1, got {n}")
    kwargs = {**kwargs, "max_sequences": n + 1, "prefix_cache": 0}
    async with Model.open(path, **kwargs) as model:
        long, *_ = workload_prompts(model.tokenizer, "ids", 1, opts["prompt_tokens"], opts["seed"])
        shorts = [workload_prompts(model.tokenizer, "ids", 1, STREAM_PROMPT_TOKENS, opts["seed"] + 100 + i)[0]
                  for i in range(n)]
        if opts["warmup"]:
            warm = workload_prompts(model.tokenizer, "ids", 1, opts["prompt_tokens"], opts["seed"] + 1)[0]
            await _generate(model, warm[:WARMUP_PROMPT_TOKENS], WARMUP_TOKENS, None)

        async def streams(stamps: list[list[float]], stop: asyncio.Event | None, limit: int) -> list[list[float]]:
            async def one(i: int):
                agen = model.generate(shorts[i], max_tokens=limit, ignore_eos=True, temperature=0)
                try:
                    async for chunk in agen:
                        if chunk.token is not None:
                            stamps[i].append(time.perf_counter())
                        if stop is not None and stop.is_set():
                            break
                finally:
                    await agen.aclose()
            await asyncio.gather(*(one(i) for i in range(n)))
            return stamps

        solo = await streams([[] for _ in range(n)], None, opts["tokens"])
        done = asyncio.Event()
        during: list[list[float]] = [[] for _ in range(n)]
        # the streams' context: long enough to keep decoding through the whole prefill
        task = asyncio.create_task(streams(during, done, model.n_ctx - STREAM_PROMPT_TOKENS - 1))
        while min(len(st) for st in during) < 2 and not task.done():  # every stream decoding first
            await asyncio.sleep(0.01)
        t_submit = time.perf_counter()
        _, stats, _, _ = await _generate(model, long, 1, None)
        t_first = t_submit + stats.prefill_seconds
        done.set()
        await task
    gaps_solo = [b - a for st in solo for a, b in zip(st, st[1:])]
    gaps_during = [b - a for st in during for a, b in zip(st, st[1:]) if a >= t_submit and b <= t_first]
    return {
        "engine": "clutor",
        "model": path,
        "options": {k: opts[k] for k in DEFAULTS},
        "during": n,
        "prompt_tokens": len(long),
        "stats": to_jsonable(stats),
        "ttft": stats.prefill_seconds,
        "prefill_slice_ms": model.options.prefill_slice_ms,
        "prefill_window": model.prefill_window,
        "gaps_solo": gaps_solo,
        "gaps_during": gaps_during,
        "memory": peak_memory(),
        "threads": os.cpu_count(),
    }


async def _run_concurrent(path: str, opts: dict, kwargs: dict) -> dict:
    """N greedy streams at once, each from its own seeded prompt, started together; the figures are
    those of the steady state in which all N decode together: from the moment the last stream has
    its first token until the first stream ends. Beside it a 5 ms ticker measures the event loop's lag."""
    import asyncio

    import numpy as np

    from ..model.model import Model

    n = int(opts["concurrency"])
    if n < 1:
        raise ClutorError(f"concurrency must be >= 1, got {n}")
    # Every prompt in the first step, so all streams decode in every step after it: the window is then
    # exactly the decode steps (positions >= the prompt's length), which the trace replay counts.
    kwargs = {**kwargs, "max_sequences": n, "prefix_cache": 0, "step_tokens": max(256, n * opts["prompt_tokens"])}
    async with Model.open(path, **kwargs) as model:
        workload = opts["workload"]
        if workload == "ids":  # (the seeds these rows have always used)
            prompts = [workload_prompts(model.tokenizer, "ids", 1, opts["prompt_tokens"], opts["seed"] + 100 + i)[0]
                       for i in range(n)]
            warm = workload_prompts(model.tokenizer, "ids", 1, opts["prompt_tokens"], opts["seed"] + 1)[0]
        else:
            *prompts, warm = workload_prompts(model.tokenizer, workload, n + 1, opts["prompt_tokens"], opts["seed"])
        samplings = [sampling_options(workload, opts["seed"] + i) for i in range(n)]
        if opts["warmup"]:
            await _generate(model, warm[:WARMUP_PROMPT_TOKENS], WARMUP_TOKENS, samplings[0])
        # per stream: (engine step that produced the token, when its reader got it)
        stamps: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        loop_cpu: dict[int, float] = {}  # engine step -> the event-loop thread's CPU time when a reader saw it
        io_at: dict[int, object] = {}  # engine step -> the store's counters just after it
        lags: list[float] = []
        first_tokens: list[int] = []  # stream 0's ids (llama.cpp's row decodes them: --vs-llama-cpp)
        running = True

        async def stream(i: int):
            async for chunk in model.generate(prompts[i], max_tokens=opts["tokens"], ignore_eos=True, **samplings[i]):
                if chunk.token is not None:
                    if i == 0:
                        first_tokens.append(chunk.token)
                    step = model.engine_stats().steps
                    stamps[i].append((step, time.perf_counter()))
                    io_at.setdefault(step, model.io_stats())
                    loop_cpu.setdefault(step, time.thread_time())

        async def ticker():
            while running:
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - t - 0.005)

        tick = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        await asyncio.gather(*(stream(i) for i in range(n)))
        t_all = time.perf_counter() - t0
        running = False
        await tick
    # The steady state: after the step that gave the last stream its first token, up to the step that
    # gave some stream its last one; every stream decodes in every step of it.
    sa = max(st[0][0] for st in stamps)
    sb = min(st[-1][0] for st in stamps)
    when = {}
    for st in stamps:
        for step, t in st:
            when[step] = min(t, when.get(step, t))
    ta, tb = when[sa], when[sb]
    window = max(tb - ta, 1e-9)
    tokens = sum(1 for st in stamps for step, _ in st if sa < step <= sb)
    ioa, iob = io_at[sa], io_at[sb]
    read = None if ioa is None else (iob.bytes_demand + iob.bytes_prefetch) - (ioa.bytes_demand + ioa.bytes_prefetch)
    acc = None if ioa is None else iob.accesses - ioa.accesses
    lag = np.array(lags) if lags else np.zeros(1)
    io = window_io(ioa, iob, tokens)
    return {
        "engine": "clutor",
        "model": path,
        "options": {k: opts[k] for k in DEFAULTS},
        "concurrency": n,
        "aggregate_decode_tps": tokens / window,
        "stream_decode_tps": tokens / window / n,
        "window": {"seconds": window, "tokens": tokens, "steps": sb - sa},
        "time_to_all_first_tokens": ta - t0,
        "total_seconds": t_all,
        "bytes_per_step": None if read is None or sb == sa else read / (sb - sa),
        "bytes_per_token": None if read is None or not tokens else read / tokens,
        "hit_rate": None if not acc else (iob.hits - ioa.hits) / acc,
        "decode_io": io,
        # what the event loop (expert I/O submission and completion, scheduling, the readers) cost per token
        "loop_cpu_per_token": (loop_cpu[sb] - loop_cpu[sa]) / tokens if tokens else None,
        "prompt_digests": [prompt_digest(p) for p in prompts],
        "tokens": first_tokens,
        "loop_lag_p99": float(np.percentile(lag, 99)),
        "loop_lag_max": float(lag.max()),
        "peak_rss": peak_memory()["ru_maxrss"],
        "memory": peak_memory(),
    }


def run(path: str, options: dict) -> dict:
    """Run one benchmark; options are DEFAULTS' keys (unknown keys are an error)."""
    opts = worker_options(DEFAULTS, options)
    from ..cli import run_coro

    return run_coro(_run(path, opts))


if __name__ == "__main__":
    sleeping_kernel_workers()  # as the clutor command runs them
    sys.exit(worker_main("python -m clutor.bench.worker", run))
