"""The benchmark prompt: the same token ids for Clutor and llama.cpp, independent of any text."""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from ..errors import ClutorError

__all__ = ["bench_prompt", "prompt_digest"]


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
