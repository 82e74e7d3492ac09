#!/usr/bin/env python3
"""A file's logits in Clutor next to llama.cpp's, position by position, with llama.cpp's top-2 gap.

    python tools/compare_logits.py FILE.gguf [--prompt-tokens 64] [--kv f16|f32] [--activations q8|f32]

The prompt is `clutor bench`'s (the seeded ids of clutor.bench.prompt, seed 0), evaluated as one batch by
both engines (llama-cpp-python, 2 threads, logits at every position; Clutor in RAM). Per position: max and
mean |diff|, the mean as a share of the largest |logit| (the test suite's bar: 0.5%), llama.cpp's top-1 /
top-2 gap and both argmaxes. A position whose top-2 gap is below max |diff| is a near-tie: either token is
within the two engines' rounding of each other, and greedy decoding parts there (random-weight files have
many). Needs llama-cpp-python; compute-heavy (run it under /work/bin/heavy on a shared machine).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GGML_TYPE = {"f32": 0, "f16": 1}


def llama_logits(path: str, ids: list[int], kv: str) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=max(64, 2 * len(ids)), n_batch=max(64, len(ids)), n_threads=2,
                          logits_all=True, seed=0, type_k=GGML_TYPE[kv], type_v=GGML_TYPE[kv], verbose=False)
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], np.float32)  # [T, V]
    del llm
    return out


def clutor_logits(path: str, ids: list[int], kv: str, activations: str) -> np.ndarray:
    import clutor

    async def go():
        async with clutor.Model.open(path, io="memory", activations=activations, kv_type=kv) as m:
            return await m.logits(ids)

    return asyncio.run(go())  # [T, V]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--kv", choices=list(GGML_TYPE), default="f16", help="both engines' KV cache type (default: "
                    "llama.cpp's and Clutor's default, f16)")
    ap.add_argument("--activations", choices=["q8", "f32"], default="q8")
    args = ap.parse_args()

    from clutor.bench.prompt import bench_prompt
    from clutor.model.tokenizer import Tokenizer

    ids = bench_prompt(Tokenizer.from_gguf(args.file), args.prompt_tokens, 0)
    ref = llama_logits(args.file, ids, args.kv)
    ours = clutor_logits(args.file, ids, args.kv, args.activations)
    d = np.abs(ours - ref)  # [T, V]
    top = np.sort(ref, axis=1)[:, -2:]  # [T, 2]
    gap = top[:, 1] - top[:, 0]
    biggest = np.abs(ref).max(axis=1)
    print(f"{args.file}: {len(ids)} positions, KV {args.kv}, Clutor activations {args.activations}")
    print("pos  max|d|  mean|d|  mean/max  top-2 gap  argmax llama.cpp / Clutor")
    for t in range(len(ids)):
        tie = "  near-tie" if gap[t] < d[t].max() else ""
        diff = "" if ref[t].argmax() == ours[t].argmax() else "  (differ)"
        print(f"{t:3d}  {d[t].max():6.4f}  {d[t].mean():7.5f}  {100 * d[t].mean() / biggest[t]:6.3f}%  "
              f"{gap[t]:9.4f}  {ref[t].argmax()} / {ours[t].argmax()}{diff}{tie}")
    agree = float((ref.argmax(1) == ours.argmax(1)).mean())
    ties = int((gap < d.max(axis=1)).sum())
    print(f"all: mean|d| {100 * float((d.mean(1) / biggest).mean()):.3f}% of the largest logit, max|d| {d.max():.4f}, "
          f"argmax equal at {100 * agree:.1f}% of positions, {ties} near-ties (top-2 gap < max|d|)")


if __name__ == "__main__":
    main()
