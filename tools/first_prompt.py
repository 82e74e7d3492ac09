#!/usr/bin/env python3
"""What a process's first prompt costs after Model.open: the open, the first generation, the event loop's
worst lag meanwhile, and the compiled kernels that generation loaded (or compiled) that the open had not.

    python tools/first_prompt.py MODEL.gguf [--expert-cache 25% | --io memory] [--prompt-tokens 32]
                                 [--tokens 4] [--fresh-kernels]

--fresh-kernels points numba's cache at an empty directory first: the first run on a new machine, every
kernel compiled. The lag is a 1 ms ticker's on the loop that runs the generation: a kernel loaded or
compiled inside the generation holds the GIL, a page faulted inside a read's submit holds the loop.
A diagnostic, not a benchmark: one process, one open, one generation.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # (as the clutor command sets it)


async def _ticker(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - t - 0.001)


async def _run(a) -> None:
    from clutor.bench.prompt import sampling_options, workload_prompts
    from clutor.model import kernels
    from clutor.model.model import Model

    opts = {"io": "memory"} if a.io == "memory" else {"expert_cache": a.expert_cache, "io": a.io}
    t0 = time.perf_counter()
    async with Model.open(a.model, **opts) as model:
        t_open = time.perf_counter() - t0
        before = kernels.loaded()
        ids = workload_prompts(model.tokenizer, "text", 1, a.prompt_tokens, 0)[0]
        lags: list[float] = []
        stop = asyncio.Event()
        ticker = asyncio.create_task(_ticker(stop, lags))
        t1 = time.perf_counter()
        first = None
        async for chunk in model.generate(ids, max_tokens=a.tokens, ignore_eos=True, **sampling_options("text", 0)):
            if chunk.token is not None and first is None:
                first = time.perf_counter() - t1
        t_gen = time.perf_counter() - t1
        stop.set()
        await ticker
        late = sorted(kernels.loaded() - before)
    print(f"{a.model}: {opts}")
    print(f"open {t_open:.2f} s; first generation {t_gen:.2f} s (first token {first:.3f} s); "
          f"event-loop lag max {max(lags) * 1e3:.1f} ms")
    print(f"kernels first loaded by the generation: {len(late)}" + "".join(f"\n  {k}" for k in late))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--expert-cache", default="25%")
    p.add_argument("--io", default="auto", help="auto | uring | threads | memory (experts mapped: no store)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--fresh-kernels", action="store_true", help="compile every kernel into an empty cache")
    a = p.parse_args(argv)
    if a.fresh_kernels:
        if "numba" in sys.modules:
            raise SystemExit("--fresh-kernels must be set before numba is imported")
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="clutor-kernels-")
    asyncio.run(_run(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
