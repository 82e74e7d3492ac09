"""One speculative-decoding run: one workload, one engine, drafting on or off, in a process of its own.

    python -m clutor.bench.spec_worker MODEL --json-args '{"engine": "clutor", "workload": "edit", "draft": true}'

Both engines get the same prompt ids (Clutor's tokenizer over clutor.bench.spec_workloads' text) and
decode greedily, end-of-generation ignored, for ``tokens`` tokens. Decode tok/s counts the tokens after
the first over the time from the first token to the last, as GenerationStats.decode_tps does.
Clutor drafts with its n-gram drafter (clutor.model.speculative); llama.cpp with llama-cpp-python's
``LlamaPromptLookupDecoding`` (prompt lookup, 10 tokens, 2-grams: its defaults). A fresh process per
run, so no run starts with the expert cache or the page cache another left warm.
"""
from __future__ import annotations

import os
import sys
import time

from ..errors import ClutorError
from .protocol import worker_main, worker_options
from .spec_workloads import SPEC_WORKLOADS, spec_prompt

__all__ = ["DEFAULTS", "run"]

DEFAULTS: dict = {
    "engine": "clutor",      # clutor | llama.cpp
    "workload": "edit",      # clutor.bench.spec_workloads.SPEC_WORKLOADS
    "draft": False,          # n-gram drafts on
    "tokens": 96,
    "draft_max": 16,         # Clutor's draft_max
    "io": "memory",          # Clutor: memory (the compute bound) | auto / uring / threads (streamed)
    "expert_cache": None,    # Clutor's expert cache when streamed
    "activations": "auto",
    "extra_buffers": True,   # llama.cpp's repacked weights (off under a cap below the file size)
    "n_ctx": None, "prompt_tokens": 0, "seed": 0, "warmup": True,
}


def _ids(path: str, workload: str) -> list[int]:
    from ..model.tokenizer import Tokenizer

    if workload not in SPEC_WORKLOADS:
        raise ClutorError(f"workload: expected one of {', '.join(SPEC_WORKLOADS)}, got {workload!r}")
    tok = Tokenizer.from_gguf(path)
    return tok.encode(spec_prompt(workload)), tok


def _clutor(path: str, opts: dict, ids: list[int]) -> dict:
    import asyncio

    import clutor

    async def go():
        spec = {"draft_max": int(opts["draft_max"])} if opts["draft"] else "off"
        async with clutor.Model.open(path, io=opts["io"], expert_cache=opts["expert_cache"], n_ctx=opts["n_ctx"],
                                     activations=opts["activations"], prefix_cache=0) as m:
            if opts["warmup"]:  # the kernels' first calls, with another prompt: nothing of ids is cached
                async for _ in m.generate(ids[-8:][::-1], max_tokens=4, temperature=0, ignore_eos=True,
                                          speculative="off"):
                    pass
            toks, stats, at_first = [], None, None
            async for c in m.generate(ids, max_tokens=int(opts["tokens"]), temperature=0, ignore_eos=True,
                                      speculative=spec):
                if c.token is not None:
                    toks.append(c.token)
                    if at_first is None:
                        at_first = m.io_stats()
                else:
                    stats = c.stats
            end = m.io_stats()
            decode_bytes = 0
            if at_first is not None and end is not None:
                decode_bytes = (end.bytes_demand + end.bytes_prefetch) - (at_first.bytes_demand + at_first.bytes_prefetch)
            return {"tokens": toks, "decode_tps": stats.decode_tps, "decode_seconds": stats.decode_seconds,
                    "drafted": stats.drafted_tokens, "accepted": stats.accepted_tokens,
                    "draft_steps": stats.draft_steps, "decode_bytes": decode_bytes,
                    "hit_rate": stats.io.hit_rate if stats.io else None, "peak_rss": stats.peak_rss}

    return asyncio.run(go())


def _llama(path: str, opts: dict, ids: list[int], tok) -> dict:
    from .llama_worker import _import_llama, without_extra_buffers

    llama_cpp = _import_llama()
    if not opts["extra_buffers"]:
        without_extra_buffers(llama_cpp)
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding() if opts["draft"] else None
    # (+16: llama-cpp-python evaluates a draft past the last token's position and fails where n_ctx ends)
    llm = llama_cpp.Llama(path, n_ctx=opts["n_ctx"] + 16, n_threads=os.cpu_count(), n_batch=512, n_ubatch=512,
                          verbose=False, draft_model=draft)
    no_eos = {int(t): -1e30 for t in tok.stop_ids}
    if opts["warmup"]:
        llm.create_completion(ids[-8:][::-1], max_tokens=4, temperature=0.0, logit_bias=no_eos)
        llm.reset()
    llm.create_completion(ids, max_tokens=1, temperature=0.0, logit_bias=no_eos)  # the prefill, kept
    t0 = time.perf_counter()
    out = llm.create_completion(ids, max_tokens=int(opts["tokens"]), temperature=0.0, logit_bias=no_eos)
    dt = time.perf_counter() - t0  # the prompt's KV is reused: one eval of its last token, then decode
    n = int(out["usage"]["completion_tokens"])
    return {"text": out["choices"][0]["text"], "n_tokens": n, "decode_tps": n / dt if dt > 0 else 0.0,
            "decode_seconds": dt}


def run(path: str, options: dict) -> dict:
    opts = worker_options(DEFAULTS, {**options, "prompt_tokens": 0})
    if not os.path.isfile(path):
        raise ClutorError(f"{path}: no such model file")
    ids, tok = _ids(path, opts["workload"])
    if options.get("n_ctx") is None:
        opts["n_ctx"] = len(ids) + int(opts["tokens"]) + 8
    res = _clutor(path, opts, ids) if opts["engine"] == "clutor" else _llama(path, opts, ids, tok)
    return {"engine": opts["engine"], "workload": opts["workload"], "draft": bool(opts["draft"]),
            "prompt_tokens": len(ids), **res}


if __name__ == "__main__":
    sys.exit(worker_main("clutor.bench.spec_worker", run))
