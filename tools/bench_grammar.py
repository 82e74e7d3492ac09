"""What constrained decoding costs: the grammar's mask per token, and tok/s with and without a schema.

1. Mask cost: a JSON schema's matcher (clutor.grammar over llguidance) walked for --steps tokens,
   each drawn uniformly among the allowed ones, at two vocabularies: the demo model's (4,096 tokens)
   and Qwen2's (151,936, llama.cpp's test vocabulary in ../shared/data/vocab). Per mask: the CPU time
   computing it (thread time) and the time writing -inf into the disallowed logits; median, p90, max.
2. Same run, the demo model (``clutor demo``'s, built into --cache-dir if missing), streamed with a
   --expert-cache budget: decode tok/s of a reply constrained by a schema (an array of 64 integers),
   and of an unconstrained reply of the same length (ignore_eos), alternated --rounds times.

    python tools/bench_grammar.py --cache-dir /work/scratch/agents/demo --expert-cache 256MiB
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from clutor.grammar import Grammar  # noqa: E402
from clutor.model.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}
ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 64, "maxItems": 64}
VOCAB_150K = REPO.parent / "shared" / "data" / "vocab" / "ggml-vocab-qwen2.gguf"


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def mask_cost(tok: Tokenizer, steps: int, seed: int = 0) -> dict:
    g = Grammar.json_schema(tok, SCHEMA)
    rng = np.random.default_rng(seed)
    cpu, apply = [], []
    done = 0
    while done < steps:
        m, ids = g.matcher(), []
        while done < steps:
            before = m.stats
            logits = m(ids, np.zeros(tok.n_vocab, dtype=np.float32))
            after = m.stats
            cpu.append(after.cpu_seconds - before.cpu_seconds)
            apply.append(after.apply_seconds - before.apply_seconds)
            done += 1
            t = int(rng.choice(np.flatnonzero(np.isfinite(logits))))
            if t in tok.stop_ids:
                break
            ids.append(t)
    us = lambda xs, q: 1e6 * float(np.quantile(xs, q))  # noqa: E731
    return {"vocab": tok.n_vocab, "masks": len(cpu), "mask_us_median": us(cpu, 0.5), "mask_us_p90": us(cpu, 0.9),
            "mask_us_max": 1e6 * max(cpu), "apply_us_median": us(apply, 0.5), "apply_us_p90": us(apply, 0.9)}


async def throughput(path, expert_cache: str, rounds: int) -> dict:
    import clutor

    out = {"constrained": [], "free": [], "tokens": []}
    async with clutor.Model.open(path, expert_cache=expert_cache) as model:
        g = Grammar.json_schema(model.tokenizer, ARRAY)
        prompt = model.tokenizer.encode("A list of numbers:")
        for r in range(rounds + 1):  # the first round warms the cache and is not counted
            m = g.matcher()
            text = []
            async for c in model.generate(prompt, max_tokens=600, temperature=0, logits_processor=m):
                text.append(c.text)
            s_con = c.stats
            json.loads("".join(text))  # it is the array
            async for c in model.generate(prompt, max_tokens=s_con.generated_tokens, temperature=0,
                                          ignore_eos=True):
                pass
            s_free = c.stats
            if r:
                out["constrained"].append(s_con.decode_tps)
                out["free"].append(s_free.decode_tps)
                out["tokens"].append(s_con.generated_tokens)
                out.setdefault("mask_us", []).append(m.stats.us_per_mask)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", default=None, help="where the demo model is (or is built)")
    ap.add_argument("--expert-cache", default="256MiB")
    ap.add_argument("--steps", type=int, default=3000, help="masks measured per vocabulary")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from clutor.cli.demo_model import ensure_demo_model

    path = ensure_demo_model(args.cache_dir)
    print(f"CPU: {cpu_name()}")
    vocabs = [("demo model", Tokenizer.from_gguf(path))]
    if VOCAB_150K.exists():
        vocabs.append(("Qwen2 vocab", Tokenizer.from_gguf(VOCAB_150K)))
    print("\nmask cost per token (JSON schema, uniform walk):")
    print(f"{'vocabulary':<14}{'tokens':>8}{'masks':>7}{'mask us median':>16}{'p90':>8}{'max':>9}"
          f"{'apply us median':>17}{'p90':>8}")
    for name, tok in vocabs:
        r = mask_cost(tok, args.steps)
        print(f"{name:<14}{r['vocab']:>8}{r['masks']:>7}{r['mask_us_median']:>16.1f}{r['mask_us_p90']:>8.1f}"
              f"{r['mask_us_max']:>9.1f}{r['apply_us_median']:>17.1f}{r['apply_us_p90']:>8.1f}")
    t = asyncio.run(throughput(path, args.expert_cache, args.rounds))
    con, free = statistics.median(t["constrained"]), statistics.median(t["free"])
    print(f"\ndemo model, expert cache {args.expert_cache}, greedy, {t['tokens'][0]}-token replies, "
          f"median of {args.rounds} rounds:")
    print(f"  with the schema     {con:8.2f} tok/s   (mask {statistics.median(t['mask_us']):.1f} us/token)")
    print(f"  without             {free:8.2f} tok/s")
    print(f"  ratio               {con / free:8.3f}")
    print("  per round: constrained " + ", ".join(f"{x:.2f}" for x in t["constrained"])
          + "; free " + ", ".join(f"{x:.2f}" for x in t["free"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
