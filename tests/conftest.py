"""Shared test fixtures: the committed tiny models and their llama.cpp recordings."""
from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent
FIXTURES = TESTS / "fixtures"
GOLDEN = TESTS / "golden"
SHARED_DATA = TESTS.parents[1] / "shared" / "data"

ARCHS = ("olmoe", "qwen2moe", "qwen3moe")
TYPES = ("F16", "Q8_0", "Q4_K_M", "Q6_K")
# The architectures of issue 11 (tests/test_archs.py): Mixtral (llama with experts), GLM-4.5, DeepSeek
# (MLA with attn_k_b/attn_v_b and q compression; the V2-Lite form with attn_kv_b and no q compression).
NEW_ARCHS = ("mixtral", "glm4moe", "deepseek2", "deepseek2-lite", "gptoss")
NEW_TYPES = ("F16", "Q8_0", "Q4_K_M")
NEW_FIXTURES = [(a, q) for a in NEW_ARCHS for q in NEW_TYPES] + [("gptoss", "MXFP4_MOE")]


def fixture_path(arch: str, qtype: str) -> Path:
    return FIXTURES / f"tiny-{arch}-{qtype}.gguf"


def golden(arch: str, qtype: str) -> dict:
    path = GOLDEN / f"tiny-{arch}-{qtype}.npz"
    if not path.exists():
        pytest.fail(f"missing golden file {path}: record it with tools/record_reference.py")
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def run(coro):
    """Run a coroutine on a fresh loop that fails the test if the loop logged an exception."""
    errors: list[dict] = []

    async def wrapper():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        return await coro

    result = asyncio.run(wrapper())
    assert not errors, f"event loop logged: {errors}"
    return result


def run_on_loop(make: Callable[[], Awaitable], loop_kind: str = "asyncio"):
    """Run make() on a fresh asyncio or uvloop loop; fail if the loop logged any exception (including
    futures whose exception nobody retrieved, which complain when collected)."""
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    logged: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: logged.append(ctx))
    try:
        result = loop.run_until_complete(make())
        gc.collect()
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    assert not logged, f"event loop logged: {logged}"
    return result
