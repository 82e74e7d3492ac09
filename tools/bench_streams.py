"""N concurrent greedy streams through whichever clutor is importable from the current directory.

Uses only the public API (Model.open, generate, io_stats), so the same script measures an older
checkout beside this one in one run (A/B):

    cd /path/to/old/checkout && python /path/to/this/tools/bench_streams.py MODEL --streams 16
    cd /path/to/this/checkout && python tools/bench_streams.py MODEL --streams 16

Prints one JSON line: steady-state aggregate decode tok/s (from the moment the last stream has its
first token until the first stream ends), tok/s over the whole run, expert bytes read per token and
the cache hit rate. Drop the page cache between runs (as root: sync; echo 1 > /proc/sys/vm/drop_caches)
for a cold start; O_DIRECT expert reads bypass it anyway.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout being measured, not necessarily this one

import clutor  # noqa: E402
from clutor.bench.prompt import bench_prompt  # noqa: E402


async def run(args) -> dict:
    opts = {"expert_cache": args.expert_cache, "policy": args.policy}
    if args.prefetch != "default":
        opts["prefetch"] = args.prefetch == "on"
    if args.trace:
        opts["trace"] = args.trace
    async with clutor.Model.open(args.model, **opts) as model:
        prompts = [bench_prompt(model.tokenizer, args.prompt_tokens, 100 + i) for i in range(args.streams)]
        async for _ in model.generate(bench_prompt(model.tokenizer, args.prompt_tokens, 1), max_tokens=1, temperature=0):
            pass  # warm-up: first allocations and page touches
        s0 = model.io_stats()
        stamps: list[list[float]] = [[] for _ in range(args.streams)]

        async def one(i: int) -> None:
            async for c in model.generate(prompts[i], max_tokens=args.tokens, temperature=0, ignore_eos=True):
                if c.token is not None:
                    stamps[i].append(time.perf_counter())

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.streams)))
        t_all = time.perf_counter() - t0
        s1 = model.io_stats()
    ta, tb = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    window = sum(1 for s in stamps for t in s if ta < t <= tb)
    total = sum(len(s) for s in stamps)
    read = (s1.bytes_demand + s1.bytes_prefetch) - (s0.bytes_demand + s0.bytes_prefetch)
    return {"streams": args.streams, "policy": args.policy, "prefetch": args.prefetch,
            "window_tps": window / max(tb - ta, 1e-9), "all_tps": total / t_all,
            "bytes_per_token": read / total, "hit_rate": (s1.hits - s0.hits) / max(1, s1.accesses - s0.accesses)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--trace", help="also write the run's routing trace here (replay it with clutor simulate)")
    p.add_argument("--expert-cache", default="25%")
    p.add_argument("--policy", default="lrfu")
    p.add_argument("--prefetch", choices=("on", "off", "default"), default="off")
    print(json.dumps(asyncio.run(run(p.parse_args()))))


if __name__ == "__main__":
    main()
