#!/usr/bin/env python3
"""How well can a decode step's experts be named before their layer's router runs?

Generates from real-text prompts with llama.cpp's default sampling, experts in RAM, and records every
decode step's residuals and routing. Then, for each MoE layer, the share of the experts it routed that a
predictor named (right) and the experts named that it did not route (wrong, per token):

- ``layer l-1's residual``: layer l's router on the residual after layer l-1's attention (what prefetch
  reads while layer l-1 computes);
- for the first MoE layer, whose predictor must run a token ahead:
  ``last residual``: its router on the previous token's last residual (what prefetch reads while the
  previous token's last layers and output head compute); ``embedding``: its router on the new token's
  embedding alone (known right after sampling, before the layer's attention); ``embedding + last
  attention``: the new token's embedding plus the previous token's attention output at that layer
  (where the first MoE layer is the model's first);
  ``previous token``: the experts the previous token routed there (what a recency cache keeps);
  and ``new`` rows: the same, counting only experts the previous token did not route (the ones a cache
  of recent experts misses, where a prediction would pay).

    python tools/predict_experts.py wide.gguf --prompts 6 --tokens 96

Predictors use the router's top-k (the router's own k).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from clutor.bench.prompt import sampling_options, workload_prompts  # noqa: E402
from clutor.model import runner as runner_mod  # noqa: E402
from clutor.model.model import Model  # noqa: E402


async def record(path: str, prompts: int, tokens: int, seed: int):
    """Each sequence's decode steps [{layer: (ids [1], sel [1, K], residual after attention [1, D])}], the runner."""
    seqs: list[list[dict]] = []
    orig = runner_mod.Runner._layer_start

    def layer_start(self, l, x, step):  # (Runner._layer_start is a generator: it pauses between tiles)
        out = yield from orig(self, l, x, step)
        if step.plan.decode and len(step.plan.ids) == 1 and out[2] is not None:
            steps = seqs[-1]
            if not steps or l <= max(steps[-1]):
                steps.append({})
            steps[-1][l] = (step.plan.ids.copy(), out[2].copy(), out[0].copy())
        return out

    runner_mod.Runner._layer_start = layer_start
    try:
        model = await Model.open(path, io="memory")
        try:
            for i, p in enumerate(workload_prompts(model.tokenizer, "text", prompts, 32, seed)):
                seqs.append([])
                async for _ in model.generate(p, max_tokens=tokens, ignore_eos=True,
                                              **sampling_options("text", seed + i)):
                    pass
            return seqs, model.runner
        finally:
            await model.aclose()
    finally:
        runner_mod.Runner._layer_start = orig


class Tally:
    """One predictor's score: experts it named that were routed (right), named and not routed (wrong),
    routed in all, over ``tokens`` decode steps."""

    def __init__(self):
        self.right = self.wrong = self.routed = self.tokens = 0

    def add(self, named: set, routed: set) -> None:
        self.right += len(named & routed)
        self.wrong += len(named - routed)
        self.routed += len(routed)
        self.tokens += 1

    def row(self, what: str) -> str:
        return (f"| {what} | {self.right / max(1, self.routed):.3f} | {self.wrong / max(1, self.tokens):.2f} "
                f"| {self.routed / max(1, self.tokens):.2f} |")


def score(seqs: list[list[dict]], named, embed) -> dict[str, Tally]:
    """Every predictor's Tally over the recorded sequences (see record). named(layer, x [1, D]) -> the
    experts that layer's router picks on x; embed(ids [1]) -> the embedding [1, D] the first layer reads."""
    layers = sorted({l for steps in seqs for s in steps for l in s})
    first = layers[0]
    tallies: dict[str, Tally] = {}

    def tally(what: str) -> Tally:
        return tallies.setdefault(what, Tally())

    for prev, cur in ((p, c) for steps in seqs for p, c in zip([{}] + steps, steps)):
        for i, l in enumerate(layers[1:], 1):
            if l in cur and layers[i - 1] in cur:
                tally(f"layer {l}: layer {layers[i - 1]}'s residual").add(named(l, cur[layers[i - 1]][2]),
                                                                           set(cur[l][1][0].tolist()))
        if first not in cur or first not in prev or layers[-1] not in prev:
            continue  # a sequence's first decode step: no previous token to predict from
        ids, sel, _ = cur[first]
        routed = set(sel[0].tolist())
        before = set(prev[first][1][0].tolist())
        emb = embed(ids)  # [1, D]
        guesses = {"last residual": named(first, prev[layers[-1]][2]), "embedding": named(first, emb),
                   "previous token": before}
        if first == 0:  # its residual is the embedding plus its attention (after dense layers, it is not)
            attn = prev[first][2] - embed(prev[first][0])  # the previous token's attention output there [1, D]
            guesses["embedding + last attention"] = named(first, emb + attn)
        for what, g in guesses.items():
            tally(f"layer {first}: {what}").add(g, routed)
            if what != "previous token":
                tally(f"layer {first}, new: {what}").add(g - before, routed - before)
    return tallies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    seqs, runner = asyncio.run(record(a.model, a.prompts, a.tokens, a.seed))
    arch, w = runner.arch, runner._w

    def named(layer: int, x: np.ndarray) -> set:
        lw = w.layers[layer]
        sel, _ = arch.route(lw, arch.router_input(lw, x, arch.ffn_input(lw, x)))
        return set(sel[0].tolist())

    tallies = score(seqs, named, lambda ids: arch.embed(w.tok_embd.rows(ids)))
    n = sum(len(steps) for steps in seqs)
    print(f"{a.model}: {a.prompts} prompts x {a.tokens} sampled tokens ({n} decode steps recorded), "
          f"top-{arch.cfg.n_expert_used} of {arch.cfg.n_expert}\n")
    print("| predictor | right (share of routed) | wrong per token | routed per token |")
    print("| --- | --- | --- | --- |")
    for what, t in sorted(tallies.items()):
        print(t.row(what))
    return 0


if __name__ == "__main__":
    sys.exit(main())
