"""Two engine rows that a count of tokens per second does not show: the memory of many long requests at
once, and the prompt tokens computed when requests share a system prompt.

Uses only the public API (Model.open, generate, the final GenerationStats), so the same script measures an
older checkout beside this one in one run (A/B); run each row in its own process so that its peak resident
set is its own:

    cd /old/checkout && python /this/checkout/tools/bench_engine_rows.py MODEL --row kv
    cd /this/checkout && python tools/bench_engine_rows.py MODEL --row kv --kv-cache 256MiB
    ... --row prefix

``--row kv``: ``--requests`` (32) concurrent requests of ``--prompt-tokens`` (560) prompt tokens and
``--tokens`` (40) greedy tokens each: the process's peak resident set (VmHWM, as the requests' stats
give it), wall time, and each request's tokens (a digest: equal digests mean equal tokens in every
request).

``--row prefix``: 8 requests whose prompts share a ``--shared-tokens`` (256) system prompt and differ in a
32-token tail, started 100 ms apart: prompt tokens computed (prompt tokens minus those reused from the KV of
another request) against the prompt tokens sent.

Prints one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout being measured, not necessarily this one
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # before numpy loads: as the clutor command sets it

import clutor  # noqa: E402
from clutor.bench.prompt import bench_prompt  # noqa: E402


async def generate(model, prompt: list[int], max_tokens: int) -> tuple[list[int], object]:
    tokens, stats = [], None
    async for c in model.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        if c.token is not None:
            tokens.append(c.token)
        if c.stats is not None:
            stats = c.stats
    return tokens, stats


async def kv_row(model, args) -> dict:
    prompts = [bench_prompt(model.tokenizer, args.prompt_tokens, 100 + i) for i in range(args.requests)]
    await generate(model, prompts[0][:8], 1)  # warm-up: compile and first touches, before the clock
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(generate(model, p, args.tokens) for p in prompts))
    seconds = time.perf_counter() - t0
    digest = hashlib.blake2b(json.dumps([t for t, _ in outs]).encode(), digest_size=8).hexdigest()
    row = {"row": "kv", "requests": args.requests, "positions": args.prompt_tokens + args.tokens,
           "seconds": round(seconds, 2), "tokens_digest": digest,
           "peak_rss": max(st.peak_rss for _, st in outs)}  # each stats' VmHWM: the last is the run's peak
    es = model.engine_stats() if hasattr(model, "engine_stats") else None
    if hasattr(es, "preemptions"):  # an engine with a KV pool
        row.update(preemptions=es.preemptions, kv_bytes_per_token=model.engine.bytes_per_token)
    return row


async def prefix_row(model, args) -> dict:
    shared = bench_prompt(model.tokenizer, args.shared_tokens, 7)
    tails = [bench_prompt(model.tokenizer, 33, 200 + i)[1:] for i in range(8)]  # 32 tokens, no second BOS
    await generate(model, bench_prompt(model.tokenizer, 8, 3), 1)  # warm-up, a prompt that shares nothing

    async def later(i: int):
        await asyncio.sleep(0.1 * i)
        return await generate(model, shared + tails[i], args.tokens)

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(later(i) for i in range(8)))
    seconds = time.perf_counter() - t0
    sent = sum(s.prompt_tokens for _, s in outs)
    reused = sum(s.cached_tokens for _, s in outs)
    return {"row": "prefix", "requests": 8, "shared_tokens": args.shared_tokens, "prompt_tokens_sent": sent,
            "prompt_tokens_computed": sent - reused, "seconds": round(seconds, 2)}


async def run(args) -> dict:
    opts = {"expert_cache": args.expert_cache, "max_sequences": args.requests if args.row == "kv" else 8}
    if args.kv_cache:
        opts["kv_cache"] = args.kv_cache
    async with clutor.Model.open(args.model, **opts) as model:
        row = await (kv_row if args.row == "kv" else prefix_row)(model, args)
    row.update(checkout=os.getcwd(), kv_cache=args.kv_cache or "default", expert_cache=args.expert_cache)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--row", choices=("kv", "prefix"), required=True)
    p.add_argument("--requests", type=int, default=32, help="concurrent requests of the kv row")
    p.add_argument("--prompt-tokens", type=int, default=560, help="each kv-row request's prompt")
    p.add_argument("--shared-tokens", type=int, default=256, help="the prefix row's shared system prompt")
    p.add_argument("--tokens", type=int, default=40, help="greedy tokens per request")
    p.add_argument("--expert-cache", default="256MiB")
    p.add_argument("--kv-cache", help="the KV pool's bytes (engines that have one); default: the engine's own")
    print(json.dumps(asyncio.run(run(p.parse_args()))))


if __name__ == "__main__":
    main()
