"""What constrained decoding costs: the grammar's mask per token, and tok/s with and without a schema.

1. Mask cost: a JSON schema's matcher (clutor.grammar over llguidance) walked for --steps tokens,
   each drawn uniformly among the allowed ones, at two vocabularies: the demo model's (4,096 tokens)
   and Qwen2's (151,936, llama.cpp's test vocabulary in ../shared/data/vocab). Per mask: the CPU time
   computing it (thread time) and the time writing -inf into the disallowed logits; median, p90, max.
   With --vs-llama-cpp, llama.cpp's own grammar sampler (llama-cpp-python's build: the same schema
   converted to GBNF by its json_schema_to_gbnf, which leaves integer ranges out, so its grammar is
   a little looser) walked the same way at the same two vocabularies, in the same run: the full mask
   (every token checked, as Clutor does), and the one-token check llama.cpp's own sampler tries first
   (it samples without the grammar, checks that token, and masks the whole vocabulary only when the
   token is refused).
2. Same run, the demo model (``clutor demo``'s, built into --cache-dir if missing), streamed with a
   --expert-cache budget: decode tok/s of a reply constrained by a schema (an array of 64 integers),
   and of an unconstrained reply of the same length (ignore_eos), alternated --rounds times.

    python tools/bench_grammar.py --cache-dir /work/scratch/agents/demo --expert-cache 256MiB [--vs-llama-cpp]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # before numpy loads OpenBLAS (clutor/_util.py says why)
import numpy as np  # noqa: E402

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


def llama_cpp_mask_cost(vocab_path: Path, steps: int, seed: int = 0) -> dict:
    """llama.cpp's grammar sampler on the schema: thread CPU time of a full mask and of a one-token check."""
    import ctypes
    import time

    import llama_cpp as L
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    quiet = L.llama_log_callback(lambda level, text, user: None)
    L.llama_log_set(quiet, None)  # its loader's report would bury the table
    L.llama_backend_init()
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(vocab_path).encode(), params)
    if not model:
        raise SystemExit(f"{vocab_path}: llama.cpp could not load its vocabulary")
    vocab = L.llama_model_get_vocab(model)
    n = L.llama_vocab_n_tokens(vocab)
    eog = {t for t in range(n) if L.llama_vocab_is_eog(vocab, t)}
    gbnf = json_schema_to_gbnf(json.dumps(SCHEMA)).encode()
    smpl = L.llama_sampler_init_grammar(vocab, gbnf, b"root")
    data = (L.llama_token_data * n)()
    one = (L.llama_token_data * 1)()
    view = np.ctypeslib.as_array(data)  # (n,) records id, logit, p over the sampler's own buffer
    ids = np.arange(n, dtype=np.int32)
    rng = np.random.default_rng(seed)
    full, check = [], []

    def apply(buf, size) -> None:
        arr = L.llama_token_data_array(data=ctypes.cast(buf, L.llama_token_data_p), size=size, selected=-1,
                                       sorted=False)
        L.llama_sampler_apply(smpl, ctypes.byref(arr))

    done = 0
    while done < steps:
        L.llama_sampler_reset(smpl)
        while done < steps:
            view["id"], view["logit"], view["p"] = ids, 0.0, 0.0
            t0 = time.thread_time()
            apply(data, n)
            full.append(time.thread_time() - t0)
            allowed = np.flatnonzero(np.isfinite(view["logit"]))
            t = int(rng.choice(allowed))
            one[0].id, one[0].logit, one[0].p = t, 0.0, 0.0
            t0 = time.thread_time()
            apply(one, 1)
            check.append(time.thread_time() - t0)
            done += 1
            if t in eog:
                break
            L.llama_sampler_accept(smpl, t)
    L.llama_sampler_free(smpl)
    L.llama_model_free(model)
    us = lambda xs, q: 1e6 * float(np.quantile(xs, q))  # noqa: E731
    return {"vocab": n, "masks": len(full), "mask_us_median": us(full, 0.5), "mask_us_p90": us(full, 0.9),
            "mask_us_max": 1e6 * max(full), "check_us_median": us(check, 0.5), "check_us_p90": us(check, 0.9)}


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
    ap.add_argument("--vs-llama-cpp", action="store_true",
                    help="also time llama.cpp's grammar sampler (needs llama-cpp-python)")
    args = ap.parse_args()

    from clutor.cli.demo_model import ensure_demo_model

    path = ensure_demo_model(args.cache_dir)
    print(f"CPU: {cpu_name()}")
    vocabs = [("demo model", path)]
    if VOCAB_150K.exists():
        vocabs.append(("Qwen2 vocab", VOCAB_150K))
    print("\nmask cost per token (JSON schema, uniform walk):")
    print(f"{'vocabulary':<14}{'tokens':>8}{'masks':>7}{'mask us median':>16}{'p90':>8}{'max':>9}"
          f"{'apply us median':>17}{'p90':>8}")
    for name, vocab_path in vocabs:
        r = mask_cost(Tokenizer.from_gguf(vocab_path), args.steps)
        print(f"{name:<14}{r['vocab']:>8}{r['masks']:>7}{r['mask_us_median']:>16.1f}{r['mask_us_p90']:>8.1f}"
              f"{r['mask_us_max']:>9.1f}{r['apply_us_median']:>17.1f}{r['apply_us_p90']:>8.1f}")
    if args.vs_llama_cpp:
        print("\nllama.cpp's grammar sampler, same schema as GBNF, same walk (thread CPU time):")
        print(f"{'vocabulary':<14}{'tokens':>8}{'masks':>7}{'mask us median':>16}{'p90':>8}{'max':>9}"
              f"{'1-token check us':>18}{'p90':>8}")
        for name, vocab_path in vocabs:
            r = llama_cpp_mask_cost(vocab_path, args.steps)
            print(f"{name:<14}{r['vocab']:>8}{r['masks']:>7}{r['mask_us_median']:>16.1f}{r['mask_us_p90']:>8.1f}"
                  f"{r['mask_us_max']:>9.1f}{r['check_us_median']:>18.1f}{r['check_us_p90']:>8.1f}")
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
