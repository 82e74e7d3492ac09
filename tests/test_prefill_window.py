"""A long prompt as one window: each layer's experts read once for all its tokens, its attention in
tiles, run a slice at a time between the other sequences' decode steps (clutor.model.engine, runner.Sliced).

Tiny fixtures with step_tokens=8, so that their golden prompts (84 tokens) are windows of 11 tiles."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import clutor
from conftest import (assert_matches_golden, expert_slots, fixture_logits, fixture_path, golden, run,
                      NEWER_BARS)

WINDOW = {"step_tokens": 8, "prefill_window": 512}
CHUNKS = {"step_tokens": 8, "prefill_window": 0}

# every architecture whose prompts go in windows (the recurrent ones go in chunks), with its bars
ARCHS = [("olmoe", "Q8_0", {}), ("qwen2moe", "Q8_0", {}), ("qwen3moe", "Q4_K_M", {}), ("mixtral", "Q4_K_M", {}),
         ("deepseek2", "Q4_K_M", {}), ("glm4moe", "Q4_K_M", NEWER_BARS), ("gptoss", "Q8_0", NEWER_BARS),
         ("gemma4", "F16", {}), ("llama4", "Q4_K_M", NEWER_BARS), ("glm-dsa", "F16", {}),
         ("minimax-m2", "Q4_K_M", NEWER_BARS), ("bailingmoe2", "Q4_K_M", NEWER_BARS),
         ("ernie4_5-moe", "Q4_K_M", NEWER_BARS)]


@pytest.mark.parametrize("arch,qtype,bars", ARCHS, ids=[f"{a}-{q}" for a, q, _ in ARCHS])
def test_window_matches_llama_cpp_and_the_chunked_bits(arch, qtype, bars):
    """The windowed prefill's logits against llama.cpp's recording, and to the bit those of the same
    prompt in chunks of step_tokens (q8 activations: every row's products, attention and expert sums
    are its own, whatever else is in the step); float16 files within their llama.cpp bar."""
    got = fixture_logits(arch, qtype, activations="q8", **WINDOW)
    assert_matches_golden(got, golden(arch, qtype)["logits"].astype(np.float32), qtype, **bars)
    chunked = fixture_logits(arch, qtype, activations="q8", **CHUNKS)
    if qtype == "F16":  # float16 weights take float products (BLAS: a row's sums depend on the row count)
        assert np.abs(got - chunked).max() <= 0.02 and (got.argmax(-1) == chunked.argmax(-1)).all()
    else:
        assert np.array_equal(got, chunked), f"max |diff| {np.abs(got - chunked).max()}"


@pytest.mark.parametrize("io", ["memory", "threads"])
def test_window_reads_each_expert_once_per_layer(io):
    """Greedy text of an 84-token prompt equal in a window and in chunks; streamed under a cache of a
    third of the experts, the window reads fewer expert bytes than the chunks (each chunk of 8 reads
    its layer's experts again), and its stats say it took one window."""
    path = fixture_path("qwen3moe", "Q8_0")
    g = golden("qwen3moe", "Q8_0")
    k, slot = expert_slots(path)
    cache = {} if io == "memory" else {"expert_cache": 3 * k * slot}

    async def gen(opts):
        async with clutor.Model.open(path, io=io, **cache, **opts) as m:
            outs = [o async for o in m.generate(g["prompt_ids"].tolist(), max_tokens=6, temperature=0,
                                                ignore_eos=True)]
            return [o.token for o in outs if o.token is not None], outs[-1].stats

    win_ids, win = run(gen(WINDOW))
    chunk_ids, chunk = run(gen(CHUNKS))
    assert win_ids == chunk_ids
    assert win.prompt_windows == 1 and chunk.prompt_windows == 0
    if io != "memory":
        assert win.io.bytes_read < 0.7 * chunk.io.bytes_read, (win.io, chunk.io)


def test_decoding_goes_on_while_a_window_prefills():
    """A sequence decoding when a long prompt arrives gets its tokens between the window's slices (1 ms
    each), not after it: counted in tokens, not in time."""
    path = fixture_path("qwen3moe", "Q8_0")
    prompt = golden("qwen3moe", "Q8_0")["prompt_ids"].tolist()

    async def go():
        async with clutor.Model.open(path, io="memory", step_tokens=8, prefill_window=512, prefill_slice_ms=1) as m:
            events: list[str] = []

            async def short():
                async for o in m.generate(prompt[:4], max_tokens=400, temperature=0, ignore_eos=True):
                    if o.token is not None:
                        events.append("a")

            async def long():
                while events.count("a") < 3:
                    await asyncio.sleep(0.001)
                events.append("submit")
                async for o in m.generate(prompt * 4, max_tokens=1, temperature=0, ignore_eos=True):
                    if o.token is not None:
                        events.append("b")
                    if o.stats is not None:
                        assert o.stats.prompt_windows == 1

            await asyncio.gather(short(), long())
            return events

    events = run(go())
    during = events[events.index("submit") : events.index("b")].count("a")
    assert during >= 3, f"{during} tokens of the decoding sequence while the window prefilled"


def test_a_window_left_by_its_reader_stops_and_frees_its_pages():
    """Cancelled mid-window, the prompt's window stops at its next pause: its pages go back, the model
    serves the next request with the same tokens as before."""
    path = fixture_path("qwen3moe", "Q8_0")
    prompt = golden("qwen3moe", "Q8_0")["prompt_ids"].tolist()

    async def go():
        async with clutor.Model.open(path, io="memory", step_tokens=8, prefill_window=512, prefill_slice_ms=1,
                                     prefix_cache=0) as m:
            async def long():
                async for _ in m.generate(prompt * 4, max_tokens=4, temperature=0):
                    pass

            task = asyncio.create_task(long())
            while m.engine._window is None:
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if m.engine._window is None:
                    break
                await asyncio.sleep(0.005)
            assert m.engine._window is None
            assert m.engine.stats().kv_bytes == 0
            outs = [o.token async for o in m.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True)]
            return [t for t in outs if t is not None]

    async def ref():
        async with clutor.Model.open(path, io="memory", **CHUNKS) as m:
            return [o.token async for o in m.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True)
                    if o.token is not None]

    assert run(go()) == run(ref())


def test_window_size_from_memory_and_options():
    """The window a model takes: as asked (0 or <= step_tokens: off), by default from the memory left,
    never past n_ctx; recurrent architectures say why theirs is off; bad values are refused by name."""
    from clutor.model.options import resolve_window

    assert resolve_window(None, per_token=1000, free=10_000_000, step_tokens=256, n_ctx=4096)[0] == 4096
    assert resolve_window(None, per_token=1000, free=1_000_000, step_tokens=256, n_ctx=4096)[0] == 500
    assert resolve_window(None, per_token=1000, free=100_000, step_tokens=256, n_ctx=4096)[0] == 0
    assert resolve_window(300, per_token=1000, free=0, step_tokens=256, n_ctx=4096)[0] == 300
    assert resolve_window(200, per_token=1000, free=0, step_tokens=256, n_ctx=4096)[0] == 0

    async def note(arch, qtype):
        async with clutor.Model.open(fixture_path(arch, qtype), io="memory") as m:
            return m.prefill_window, m.window_note

    assert run(note("qwen3moe", "Q8_0"))[0] == 512  # the fixture's whole context
    n, why = run(note("qwen3next", "Q4_K_M"))
    assert n == 0 and "recurrent" in why
    for bad in (-1, 1.5, True):
        with pytest.raises(clutor.ClutorError, match="prefill_window"):
            run(clutor.Model.open(fixture_path("qwen3moe", "Q8_0"), prefill_window=bad).__aenter__())
    with pytest.raises(clutor.ClutorError, match="prefill_slice_ms"):
        run(clutor.Model.open(fixture_path("qwen3moe", "Q8_0"), prefill_slice_ms=0).__aenter__())
