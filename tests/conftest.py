"""Shared test fixtures: the committed tiny models and their llama.cpp recordings."""
from __future__ import annotations

import asyncio
import gc
import os
import sys
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np
import pytest

from clutor._util import sleeping_kernel_workers

# The test process is ours: its kernel workers sleep between launches, as under Model.open and the
# clutor command (kernel tests launch kernels without opening a model).
sleeping_kernel_workers()

TESTS = Path(__file__).resolve().parent
FIXTURES = TESTS / "fixtures"
GOLDEN = TESTS / "golden"
# ../shared/data next to the checkout (as CI has it), or where CLUTOR_SHARED_DATA says (a worktree elsewhere)
SHARED_DATA = Path(os.environ.get("CLUTOR_SHARED_DATA") or TESTS.parents[1] / "shared" / "data")
# What each directory of ../shared/data is, for the skip message of a test that needs it (CI has the
# directory next to the checkout; a checkout without it skips those tests and says what they need).
SHARED_WHAT = {
    "vocab": "llama.cpp's tokenizer test vocabularies (ggml-vocab-*.gguf, with the tokenizations llama.cpp "
             "recorded for them in .inp/.out)",
    "templates": "the real chat templates of the models Clutor runs (Qwen3, DeepSeek-V3.1, gpt-oss, GLM-4.6, "
                 "Llama 3.3, ...)",
    "models": "a small OLMoE-shaped MoE trained on real text (real-olmoe-q8_0.gguf), whose routing is real",
}


def shared_data(rel: str) -> Path:
    """../shared/data/REL, or a skip that says what that data is and where it is looked for."""
    path = SHARED_DATA / rel
    if not path.exists():
        what = SHARED_WHAT.get(rel.split("/")[0], "shared test data")
        pytest.skip(f"needs {what}: {path} is absent (CI has ../shared/data next to the checkout; "
                    "CLUTOR_SHARED_DATA=DIR points elsewhere)")
    return path


# tools/synth.py writes the random-weight models of every architecture the tests build
sys.path.insert(0, str(TESTS.parent / "tools"))

ARCHS = ("olmoe", "qwen2moe", "qwen3moe")
TYPES = ("F16", "Q8_0", "Q4_K_M", "Q6_K")
# The architectures of issue 11 (tests/test_archs.py): Mixtral (llama with experts), GLM-4.5, DeepSeek
# (MLA with attn_k_b/attn_v_b and q compression; the V2-Lite form with attn_kv_b and no q compression).
NEW_ARCHS = ("mixtral", "glm4moe", "deepseek2", "deepseek2-lite", "gptoss")
NEW_TYPES = ("F16", "Q8_0", "Q4_K_M")
NEW_FIXTURES = [(a, q) for a in NEW_ARCHS for q in NEW_TYPES] + [("gptoss", "MXFP4_MOE")]
# The recurrent hybrids (tests/test_hybrid.py), made through llama.cpp's converter (tools/make_hf_fixture.py).
HYBRID_ARCHS = ("qwen35moe", "qwen3next", "nemotron_h_moe")
HYBRID_TYPES = ("F16", "Q4_K_M")
# The attention-only MoE architectures of 2026 (tests/test_attn_archs.py), made through llama.cpp's converter too.
ATTN_ARCHS = ("minimax-m2", "llama4", "ernie4_5-moe", "bailingmoe2", "glm-dsa")
ATTN_TYPES = ("F16", "Q4_K_M")

# The same positions computed two ways (a batched prefill vs one token at a time, a batched step vs
# each sequence alone), as a share of max|logit|, per activation mode. f32: float rounding only. q8:
# an activation whose float differs in the last bit between the two ways (attention over a block of
# tokens vs one row) can round to the other int8 neighbour, and that moves everything after it
# (llama.cpp, which computes the same way, has the same property). Worst measured over every fixture
# and type: 1.1e-2 (qwen2moe Q8_0); most cases stay below 1e-6.
STEP_TOL = {"f32": 1e-4, "q8": 2.5e-2}
ACTIVATIONS = tuple(STEP_TOL)


def tiny_demo_spec(name: str = "tiny-olmoe"):
    """The demo model's structure at tiny-olmoe's size: quick to build, for the demo-cache tests."""
    from clutor.cli.demo_model import DemoSpec

    return DemoSpec(name=name, n_layer=2, n_embd=256, n_head=4, head_dim=64, n_expert=8, n_expert_used=2,
                    n_ff_exp=256, vocab_size=512, n_ctx=512)


def fixture_path(arch: str, qtype: str) -> Path:
    return FIXTURES / f"tiny-{arch}-{qtype}.gguf"


def golden(arch: str, qtype: str) -> dict:
    path = GOLDEN / f"tiny-{arch}-{qtype}.npz"
    if not path.exists():
        pytest.fail(f"missing golden file {path}: record it with tools/record_reference.py")
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def assert_matches_golden(got: np.ndarray, ref: np.ndarray, qtype: str, *, agree: float = 0.90,
                          mean_share: float = 0.01) -> None:
    """Our logits [T, V] against llama.cpp's: F16 files within 0.02 absolute with the same argmax at
    every position; quantised files argmax agreement >= agree and mean |diff| <= mean_share of max
    |logit| (llama.cpp rounds activations to 8 bits before quantised dot products, and near-tied
    routers can flip an expert, so quantised files are held to agreement, not equality). The
    architectures added since the first three are held to their issues' bars, agree=0.95 and
    mean_share=0.005 (NEWER_BARS)."""
    assert got.shape == ref.shape
    diff = np.abs(got - ref)
    same_argmax = np.mean(got.argmax(-1) == ref.argmax(-1))
    if qtype == "F16":
        assert diff.max() <= 0.02, f"max |diff| {diff.max():.4f} (max |logit| {np.abs(ref).max():.3f})"
        assert same_argmax == 1.0, f"argmax agrees at {same_argmax:.1%} of positions"
    else:
        assert same_argmax >= agree, f"argmax agrees at {same_argmax:.1%} of positions"
        assert diff.mean() <= mean_share * np.abs(ref).max(), \
            f"mean |diff| {diff.mean():.4f} vs max |logit| {np.abs(ref).max():.3f}"


NEWER_BARS = {"agree": 0.95, "mean_share": 0.005}


def fixture_logits(arch: str, qtype: str, ids: list[int] | None = None, **opts) -> np.ndarray:
    """A fixture's logits [T, V] for ids (default: its golden prompt) with an f32 KV cache, the
    type llama.cpp's logits were recorded with (tools/record_reference.py)."""
    import clutor

    if ids is None:
        ids = golden(arch, qtype)["prompt_ids"].tolist()

    async def go():
        async with clutor.Model.open(fixture_path(arch, qtype), kv_type="f32", **opts) as model:
            return await model.logits(ids)

    return run(go())


def assert_logits_match_llama_cpp(arch: str, qtype: str, **bars) -> None:
    """The fixture's logits on its golden prompt against llama.cpp's recording (assert_matches_golden)."""
    assert_matches_golden(fixture_logits(arch, qtype), golden(arch, qtype)["logits"].astype(np.float32), qtype,
                          **bars)


def assert_greedy_matches_llama_cpp(arch: str, qtype: str, n: int = 24) -> None:
    """n greedy tokens from the golden greedy prompt equal llama.cpp's (f32 KV, as recorded)."""
    import clutor

    g = golden(arch, qtype)

    async def gen():
        async with clutor.Model.open(fixture_path(arch, qtype), kv_type="f32") as model:
            return [o.token async for o in model.generate(g["greedy_prompt_ids"].tolist(), max_tokens=n,
                                                         temperature=0, ignore_eos=True) if o.token is not None]

    assert run(gen()) == g["greedy_ids"].tolist()[:n]


def prefill_and_incremental(path, ids: list[int], split: int, **opts) -> tuple[np.ndarray, np.ndarray]:
    """The logits [T, V] of ids in one prefill, and of ids[:split] prefilled then one token at a time."""
    import clutor

    async def both():
        async with clutor.Model.open(path, **opts) as model:
            full = await model.logits(ids)
            seq = model.new_sequence()
            half = await model.forward(seq, ids[:split], all_logits=True)
            rest = [(await model.forward(seq, [i]))[0] for i in ids[split:]]
            return full, np.concatenate([half, np.stack(rest)])

    return run(both())


def assert_prefill_equals_incremental(path, ids: list[int], split: int, activations: str, **opts) -> None:
    """prefill_and_incremental's two ways agree within the activation mode's STEP_TOL, argmax equal."""
    full, mixed = prefill_and_incremental(path, ids, split, activations=activations, **opts)
    np.testing.assert_allclose(mixed, full, rtol=0, atol=STEP_TOL[activations] * np.abs(full).max())
    assert (mixed.argmax(-1) == full.argmax(-1)).all()


async def greedy_and_cached(model, prompt, n: int = 6) -> tuple[list[int], int]:
    """n greedy tokens of a generation and how many of its prompt's tokens came from a cached prefix."""
    outs = [o async for o in model.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True)]
    return [o.token for o in outs if o.token is not None], outs[-1].stats.cached_tokens


def run(coro):
    """Run a coroutine on a fresh loop that fails the test if the loop logged an exception."""
    errors: list[dict] = []

    async def wrapper():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        return await coro

    result = asyncio.run(wrapper())
    assert not errors, f"event loop logged: {errors}"
    return result


def expert_slots(path) -> tuple[int, int]:
    """(top-k, bytes of one expert slot) of a fixture: the unit its streamed tests size caches in."""
    from clutor.model.arch import read_arch
    from clutor.model.gguf import GGUFFile
    from clutor.model.options import slot_bytes
    from clutor.model.weights import expert_layout

    with GGUFFile.open(path) as f:
        arch = read_arch(f)
        return arch.cfg.n_expert_used, slot_bytes(expert_layout(f, arch))


def logits_and_steps(path, prompt: list[int], **opts):
    """A fixture opened with opts: the prompt's full logits [T, V], the last logits of a 5-token
    prefill and 8 greedy steps after it [9, V], and the model's io_stats()."""
    import clutor

    async def once():
        async with clutor.Model.open(path, **opts) as model:
            full = await model.logits(prompt)
            seq = model.new_sequence()
            steps = [(await model.forward(seq, prompt[:5]))[-1]]
            for _ in range(8):
                steps.append((await model.forward(seq, [int(np.argmax(steps[-1]))]))[-1])
            return full, np.stack(steps), model.io_stats()

    return run(once())


def assert_streamed_equals_memory(arch: str, activations: str, *, io: str = "threads", qtype: str = "Q4_K_M",
                                   caches: tuple[tuple[int, bool], ...] = ((0, False),)) -> None:
    """The fixture's golden prompt (40 tokens) and 8 greedy steps with routed experts streamed from
    disk (io, a cache of top-k + extra slots, prefetch on or off, for each (extra, prefetch) in caches)
    give the same bits as io="memory": the products must not care how the experts arrived. Each
    streamed run must have missed and evicted, or it tested nothing."""
    import clutor

    path = fixture_path(arch, qtype)
    prompt = golden(arch, qtype)["prompt_ids"].tolist()[:40]
    k, slot = expert_slots(path)
    full, steps, _ = logits_and_steps(path, prompt, io="memory", activations=activations)
    for extra, prefetch in caches:
        try:
            got, got_steps, st = logits_and_steps(path, prompt, io=io, expert_cache=(k + extra) * slot,
                                                  prefetch=prefetch, activations=activations)
        except clutor.ClutorError as e:
            if io == "uring":
                pytest.skip(f"io_uring unavailable here: {e}")
            raise
        what = f"{arch} io={io} cache={k + extra} slots prefetch={prefetch}"
        assert np.array_equal(got, full), f"{what}: prefill logits differ from io=memory"
        assert np.array_equal(got_steps, steps), f"{what}: decode logits differ from io=memory"
        assert st.backend == io and st.misses > 0 and st.evictions > 0, f"{what}: {st}"


def smaps_field(addr: int, field: str) -> list[str]:
    """The values of one field (``Rss``, ``VmFlags``, ...) of this process's mapping holding addr, from
    /proc/self/smaps (Linux)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field + ":":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}, or it has no {field}")


def resident_bytes(addr: int) -> int:
    """Resident bytes (smaps' Rss, in kB there) of this process's mapping holding addr."""
    return int(smaps_field(addr, "Rss")[0]) * 1024


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
