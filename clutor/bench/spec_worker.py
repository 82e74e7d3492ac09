"""One speculative-decoding run: one workload, one engine, one drafter (or none), in a process of its own.

    python -m clutor.bench.spec_worker MODEL --json-args '{"engine": "clutor", "workload": "edit", "draft": "ngram"}'

Both engines get the same prompt ids (Clutor's tokenizer over clutor.bench.spec_workloads' text) and
decode greedily, end-of-generation ignored, for ``tokens`` tokens. Decode tok/s counts the tokens after
the first over the time from the first token to the last, as GenerationStats.decode_tps does.
Drafts "ngram": Clutor's n-gram drafter (clutor.model.speculative); llama.cpp's is llama-cpp-python's
``LlamaPromptLookupDecoding`` (prompt lookup, 10 tokens, 2-grams: its defaults). Drafts "model": the
draft model ``draft_model`` (clutor.model.draft); llama.cpp's is llama-server built from llama.cpp's
source with ``-md`` (found as $CLUTOR_LLAMA_SERVER or on PATH), asked through its /completion route. A
fresh process per run, so no run starts with the expert cache or the page cache another left warm.
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
    "draft": "off",          # off | ngram | model (the draft model draft_model)
    "draft_model": None,     # the draft model's GGUF, for draft "model"
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


def _mode(opts: dict) -> str:
    d = opts["draft"]
    mode = "ngram" if d is True else "off" if d is False or d is None else d
    if mode not in ("off", "ngram", "model"):
        raise ClutorError(f"draft: expected 'off', 'ngram' or 'model', got {d!r}")
    if mode == "model" and not opts["draft_model"]:
        raise ClutorError("draft 'model' needs draft_model: the draft model's GGUF")
    return mode


def _clutor(path: str, opts: dict, ids: list[int]) -> dict:
    import asyncio

    import clutor

    mode = _mode(opts)

    async def go():
        spec = ("off" if mode == "off" else
                {"mode": "draft" if mode == "model" else "ngram", "draft_max": int(opts["draft_max"])})
        async with clutor.Model.open(path, io=opts["io"], expert_cache=opts["expert_cache"], n_ctx=opts["n_ctx"],
                                     activations=opts["activations"], prefix_cache=0,
                                     draft_model=opts["draft_model"] if mode == "model" else None) as m:
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
    if _mode(opts) == "model":
        return _llama_server(path, opts, ids, tok)
    from .llama_worker import _import_llama, without_extra_buffers

    llama_cpp = _import_llama()
    if not opts["extra_buffers"]:
        without_extra_buffers(llama_cpp)
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding() if _mode(opts) == "ngram" else None
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


def _llama_server(path: str, opts: dict, ids: list[int], tok) -> dict:
    """llama.cpp with its draft model: llama-server -md, one slot, greedy; decode tok/s and its draft
    counts from the timings of a /completion whose prompt is cached (the same warm-up as the others)."""
    import json
    import shutil
    import socket
    import subprocess
    import tempfile
    import urllib.request

    exe = os.environ.get("CLUTOR_LLAMA_SERVER") or shutil.which("llama-server")
    if not exe:
        raise ClutorError("llama.cpp with a draft model needs llama-server: build it from llama.cpp's source "
                          "(cmake --build build --target llama-server) and set CLUTOR_LLAMA_SERVER=PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [exe, "-m", path, "-md", opts["draft_model"], "-c", str(opts["n_ctx"] + 16),
           "-t", str(os.cpu_count()), "-td", str(os.cpu_count()), "-np", "1", "--no-webui",
           "--spec-type", "draft-simple", "--spec-draft-n-max", str(int(opts["draft_max"])), "--spec-draft-n-min", "0",
           "--port", str(port), "--host", "127.0.0.1"] + ([] if opts["extra_buffers"] else ["--no-repack"])
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def post(body: dict) -> dict:
        req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())

    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise ClutorError(f"llama-server exited ({proc.returncode}): {log.read()[-2000:].decode(errors='replace')}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ClutorError("llama-server did not come up in 600 s")
            time.sleep(0.5)
        base = {"temperature": 0.0, "cache_prompt": True, "ignore_eos": True, "id_slot": 0}
        if opts["warmup"]:
            post({**base, "prompt": ids[-8:][::-1], "n_predict": 4})
        post({**base, "prompt": ids, "n_predict": 1})  # the prefill, kept in its slot
        out = post({**base, "prompt": ids, "n_predict": int(opts["tokens"])})
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    t = out.get("timings", {})
    return {"text": out.get("content", ""), "n_tokens": int(t.get("predicted_n", 0)),
            "decode_tps": float(t.get("predicted_per_second", 0.0)), "decode_seconds": t.get("predicted_ms", 0) / 1000,
            "drafted": int(t.get("draft_n", 0)), "accepted": int(t.get("draft_n_accepted", 0))}


def run(path: str, options: dict) -> dict:
    opts = worker_options(DEFAULTS, {**options, "prompt_tokens": 0})
    if not os.path.isfile(path):
        raise ClutorError(f"{path}: no such model file")
    ids, tok = _ids(path, opts["workload"])
    if options.get("n_ctx") is None:
        opts["n_ctx"] = len(ids) + int(opts["tokens"]) + 8
    res = _clutor(path, opts, ids) if opts["engine"] == "clutor" else _llama(path, opts, ids, tok)
    return {"engine": opts["engine"], "workload": opts["workload"], "draft": _mode(opts),
            "prompt_tokens": len(ids), **res}


if __name__ == "__main__":
    sys.exit(worker_main("clutor.bench.spec_worker", run))
