"""Helpers for tests/test_streaming.py: a child process that generates under a memory cap, and the
writer of a model whose routed experts are far larger than that cap.

Run as a script (inside clutor.bench.memcap.run_capped) it prints ONE JSON line on stdout::

    python tests/streaming_util.py generate MODEL --io threads --cache 96MiB --tokens 8
    python tests/streaming_util.py baseline MODEL      # imports + a forward pass: the runtime allowance
    python tests/streaming_util.py slurp MODEL         # every byte of MODEL in anonymous memory
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_env() -> dict:
    """The parent's environment with this checkout first on the path (the repo is not installed in CI)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def child_cmd(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


def proc_status() -> dict[str, int]:
    """The kB fields of /proc/self/status (VmHWM, VmRSS, RssAnon, RssFile, ...), in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def os_figures() -> dict[str, int]:
    """The kernel's own peak-memory figures for this process, read without clutor's help."""
    st = proc_status()
    return {
        "vm_hwm": st["VmHWM"],
        "rss_anon": st.get("RssAnon", 0),
        "rss_file": st.get("RssFile", 0),
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
    }


# -- a model whose experts dwarf the cap ---------------------------------------------------------
def big_spec():
    """olmoe structure, Q8_0: 6 layers x 32 experts of 3.19 MiB = 612 MiB of routed experts, ~27 MiB dense."""
    from synth import ModelSpec

    return ModelSpec(
        name="streaming-big", arch="olmoe", n_layer=6, n_embd=1024, n_head=8, n_head_kv=8, head_dim=128,
        n_expert=32, n_expert_used=4, n_ff_exp=1024, vocab_size=512, n_ctx=256, eps=1e-5, qtype="Q8_0",
    )


# -- child commands ------------------------------------------------------------------------------
async def _generate(args) -> dict:
    import clutor

    async with clutor.Model.open(args.model, io=args.io, direct=not args.buffered, expert_cache=args.cache,
                                 prefetch=not args.no_prefetch) as model:
        async def one(prompt: str):
            tokens, stats = [], None
            async for out in model.generate(prompt, max_tokens=args.tokens, temperature=0, ignore_eos=True):
                if out.token is not None:
                    tokens.append(out.token)
                stats = out.stats or stats
            return tokens, stats

        # --concurrency N: N generations at once, each its own prompt, in one batch
        runs = await asyncio.gather(*(one(args.prompt + " " * i + str(i) if i else args.prompt)
                                      for i in range(args.concurrency)))
        tokens, stats = runs[0]
        streams = [t for t, _ in runs]
        engine = model.engine_stats()
        store = model.io_stats()
        figures = os_figures()  # before close: the arena is still mapped and resident
    io = stats.io
    return {
        "tokens": tokens,
        "streams": streams,
        "steps": engine.steps,
        "peak_rss": stats.peak_rss,
        "io": {k: getattr(io, k) for k in ("backend", "mode", "cache_bytes", "accesses", "hits", "misses",
                                            "prefetch_issued", "bytes_read")},
        "evictions": store.evictions,
        "os": figures,
    }


async def _baseline(args) -> dict:
    """What the runtime costs besides the model's own bytes: interpreter, numpy, numba, clutor, and a
    streamed generation on a tiny model (so kernels are loaded and the event loop and backend run)."""
    import clutor

    async with clutor.Model.open(args.model, io="threads", expert_cache="50%") as model:
        async for out in model.generate("Once upon a time", max_tokens=4, temperature=0, ignore_eos=True):
            pass
        dense = model._w.nbytes
        cache = out.stats.io.cache_bytes
        kv = model.kv.stats().resident_bytes
    return {"os": os_figures(), "dense_bytes": dense, "cache_bytes": cache, "kv_bytes": kv}


def _slurp(args) -> dict:
    import numpy as np

    data = np.fromfile(args.model, dtype=np.uint8)  # [file_bytes], anonymous memory
    return {"bytes": int(data.nbytes), "checksum": int(data[:: 1 << 20].sum()), "os": os_figures()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("model")
    g.add_argument("--io", default="threads")
    g.add_argument("--cache", default="96MiB")
    g.add_argument("--tokens", type=int, default=8)
    g.add_argument("--prompt", default="The expert cache streams")
    g.add_argument("--buffered", action="store_true")
    g.add_argument("--no-prefetch", action="store_true")
    g.add_argument("--concurrency", type=int, default=1)
    b = sub.add_parser("baseline")
    b.add_argument("model")
    s = sub.add_parser("slurp")
    s.add_argument("model")
    args = p.parse_args(argv)
    if args.cmd == "generate":
        result = asyncio.run(_generate(args))
    elif args.cmd == "baseline":
        result = asyncio.run(_baseline(args))
    else:
        result = _slurp(args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
