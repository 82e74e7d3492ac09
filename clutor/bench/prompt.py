"""The benchmark prompts: the same token ids for Clutor and llama.cpp.

Two workloads: ``ids`` (seeded token ids, independent of any text, greedy decode: the historical rows) and
``text`` (slices of the bundled English corpus, clutor/data/corpus.txt, with llama.cpp's default sampling: a
model trained on real text then routes as it does on real requests, and sampling keeps it out of the loops
greedy decoding falls into).
"""
from __future__ import annotations

import hashlib
from importlib import resources
from typing import Sequence

import numpy as np

from ..errors import ClutorError

__all__ = ["WORKLOADS", "bench_prompt", "text_prompts", "workload_prompts", "sampling_options", "prompt_digest"]

WORKLOADS = ("ids", "text")
# Tokens of the warm-up prompt at most: past step_tokens, so a long prompt's window path is warmed
# too; short enough that a 32k-token row does not prefill twice.
WARMUP_PROMPT_TOKENS = 512


def bench_prompt(tokenizer, n: int, seed: int = 0) -> list[int]:
    """``n`` token ids: BOS when the file asks for one, then ordinary tokens in a seeded order.

    Control, unknown and unused tokens (no bytes of their own) and end-of-generation tokens are skipped:
    they are not what a prompt holds, and an EOS mid-prompt would make the models behave atypically.
    The order is a seeded permutation of the eligible ids, cycled, so no id repeats before the whole
    eligible vocabulary has been used.
    """
    if n < 1:
        raise ClutorError(f"the benchmark prompt needs at least 1 token, got {n}")
    stop = tokenizer.stop_ids
    eligible = np.array(
        [i for i in range(tokenizer.n_vocab) if i not in stop and tokenizer.token_bytes(i)], dtype=np.int64
    )  # [n_eligible]
    if len(eligible) == 0:
        raise ClutorError(f"{tokenizer.path}: the vocabulary has no ordinary tokens to build a prompt from")
    ids: list[int] = []
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        ids.append(int(tokenizer.bos_id))
    order = np.random.default_rng(seed).permutation(eligible)  # [n_eligible]
    need = n - len(ids)
    ids.extend(int(order[i % len(order)]) for i in range(need))
    return ids


def prompt_digest(ids: Sequence[int]) -> str:
    """A short fingerprint of a prompt, so a report can show that two engines got the same ids."""
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()[:16]


def text_prompts(tokenizer, n_prompts: int, n: int, seed: int = 0) -> list[list[int]]:
    """``n_prompts`` prompts of ``n`` tokens each (BOS first when the file adds one), cut from the bundled
    corpus (its header skipped) at seeded offsets spread over the text, as few overlapping as it allows."""
    if n < 1 or n_prompts < 1:
        raise ClutorError(f"text prompts need n >= 1 tokens and >= 1 prompt, got {n} and {n_prompts}")
    text = resources.files("clutor").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    body = tokenizer.encode(text.split("\n\n", 2)[-1])
    bos = [int(tokenizer.bos_id)] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    need = n - len(bos)
    if len(body) < need:
        raise ClutorError(f"the bundled corpus is {len(body)} tokens with this vocabulary, fewer than a {n}-token prompt")
    span = len(body) - need + 1
    rng = np.random.default_rng(seed)
    base = int(rng.integers(0, span))
    step = max(1, span // n_prompts)
    return [bos + [int(t) for t in body[(base + i * step) % span:][:need]] for i in range(n_prompts)]


def workload_prompts(tokenizer, workload: str, n_prompts: int, n: int, seed: int) -> list[list[int]]:
    """The prompts of one run: ``n_prompts`` of ``n`` tokens for ``workload`` (see the module doc)."""
    if workload == "ids":
        return [bench_prompt(tokenizer, n, seed + i) for i in range(n_prompts)]
    if workload == "text":
        return text_prompts(tokenizer, n_prompts, n, seed)
    raise ClutorError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")


def sampling_options(workload: str, seed: int) -> dict:
    """generate() options of one stream: greedy for ``ids``; llama.cpp's default sampler chain, seeded per
    stream, for ``text``."""
    if workload == "ids":
        return {"temperature": 0.0}
    from ..model.sampling import SamplingParams

    p = SamplingParams()
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "seed": seed}
