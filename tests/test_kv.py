"""The KV pool (clutor.model.kv): pages under a byte budget, shared by prefix, preemption, KV types.

Each claim is checked against the same model run another way: a preempted request against the
same request alone, a prompt built on shared pages against a fresh model, f16 and q8_0 keys and
values against f32, the pool's own figures against the kernel's (RSS, memory maps, a cgroup's cap).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import clutor
from clutor.model.kv import PAGE, KVPool, NoRoom
from clutor.model.state import FullKV, WindowKV
from conftest import ARCHS, NEW_ARCHS, fixture_path, golden, run

OLMOE = fixture_path("olmoe", "Q8_0")


async def _gen(model, prompt, n, *, delay=0.0, capture=False, **opts):
    """(tokens, stats, the raw logits rows sampled from) of one greedy generation."""
    await asyncio.sleep(delay)
    tokens, stats, rows = [], None, []

    def keep(ids, row):
        rows.append(row.copy())
        return row

    async for c in model.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True,
                                  logits_processor=keep if capture else None, **opts):
        if c.token is not None:
            tokens.append(c.token)
        stats = c.stats or stats
    return tokens, stats, rows


# -- the pool itself --------------------------------------------------------------------------------
def _fill(pool: KVPool, seq, tokens: list[int], keys: list) -> None:
    """What a step and the engine do to a sequence's pages, without computing anything."""
    pool.done(pool.reserve(seq, len(tokens)))
    seq.n = len(tokens)
    pool.publish(seq, tokens, keys)


def test_pages_are_shared_by_reference_copied_where_partial_and_kept_least_recently_used():
    spec = FullKV(2, 8, 8)
    pool = KVPool([spec] * 3, n_ctx=256, budget=12 * 3 * 2 * PAGE * 16 * 4, kv_type="f32")
    page = pool.page_bytes
    assert page == 3 * 2 * PAGE * 16 * 4 and pool.budget // page == 12
    a_tokens = list(range(100, 140))  # 40 positions: pages 0, 1 full, page 2 holds 8
    a, a_keys = pool.sequence(), []
    _fill(pool, a, a_tokens, a_keys)
    assert [len(t) for t in a.tables] == [3] and len(a_keys) == 2

    # a prompt sharing 37 tokens: pages 0 and 1 by reference, 5 positions of page 2 copied
    prompt = a_tokens[:37] + [7, 7, 7]
    m = pool.match(prompt, len(prompt) - 1)
    assert m.n == 37 and m.pages == [a.tables[0][:2]] and m.tails == [a.tables[0][2]]
    b = pool.sequence()
    copies = pool.adopt(b, m)
    assert b.n == 37 and b.tables[0][:2] == a.tables[0][:2] and b.tables[0][2] != a.tables[0][2]
    assert copies == [(0, a.tables[0][2], b.tables[0][2], 5)]
    pool.done(copies)
    assert pool.stats().shared_pages == 2
    # b writes on: into its own copy, never into a's page
    assert pool.reserve(b, 40) == []
    # a goes: its shared pages stay b's, its own page is kept for reuse
    pool.release(a)
    st = pool.stats()
    assert st.cached_pages == 1 and st.live_bytes == 3 * page and st.shared_pages == 0
    # a prompt sharing only 20 tokens with a diverges inside page 1: page 0 mapped, 4 positions copied
    m = pool.match(a_tokens[:20] + [1, 2], 21)
    assert m.n == 20 and m.pages == [b.tables[0][:1]] and m.tails == [b.tables[0][1]]

    # the budget binds: 12 pages, 3 live, 1 kept; a sequence needing 9 more gets them by giving up
    # the kept page, one needing 10 gets NoRoom and nothing changes
    c = pool.sequence()
    with pytest.raises(NoRoom):
        pool.reserve(c, 10 * PAGE)
    assert pool.stats().cached_pages == 1 and pool.stats().evictions == 0
    pool.done(pool.reserve(c, 9 * PAGE))
    assert pool.stats().cached_pages == 0 and pool.stats().evictions == 1
    assert pool.used == pool.budget
    pool.release(b)
    pool.release(c)
    # kept: a's two published pages b had mapped; freed: b's own copy and c's pages (never published)
    assert pool.cached == pool.used == 2 * page
    pool.close()


def test_window_layers_give_back_what_falls_behind_and_match_only_with_their_window():
    pool = KVPool([FullKV(1, 8, 8), WindowKV(1, 8, 8, 20)], n_ctx=512, budget=1 << 20, kv_type="f32")
    full, window = (0, 1) if pool.groups[0].window == 0 else (1, 0)
    tokens = list(range(1, 101))  # 100 positions: 7 pages
    seq, keys = pool.sequence(), []
    _fill(pool, seq, tokens, keys)
    pool.trim_window(seq)
    # the next position (100) sees keys 81..99: pages 5 and 6 only
    assert [p >= 0 for p in seq.tables[window]] == [False] * 5 + [True] * 2
    assert all(p >= 0 for p in seq.tables[full])
    pool.release(seq)
    # the window pages given back were kept (published): a prompt sharing 100 tokens finds every group's
    m = pool.match(tokens + [5], 100)
    assert m.n == 100
    # with the window group's early pages gone, a 50-token prefix needs pages 1..3 of the window group
    for gi, page in [(window, p) for p in range(pool.groups[window].high)]:
        key = (gi, page)
        if key in pool._lru and pool.groups[gi].filled[page] == PAGE:
            pool._evict(key)
    m = pool.match(tokens[:51], 50)
    assert m.n == 0 or all(p >= 0 for p in m.pages[window][max(0, m.n - 20 + 1) // PAGE :])
    pool.close()


# -- preemption and the budget -----------------------------------------------------------------------
@pytest.mark.parametrize("prefix_cache", ["256MiB", 0], ids=["pages-kept", "recomputed"])
def test_preempted_requests_resume_with_exactly_their_solo_tokens(prefix_cache):
    """Four requests whose pages cannot all fit: the newest ones are set aside as the others grow,
    and resumed from what the pool still holds (kept pages, or recomputed when none are kept)."""
    rng = np.random.default_rng(0)
    opts = dict(io="memory", activations="f32", kv_type="f32")

    async def go():
        async with clutor.Model.open(OLMOE, **opts) as m:
            prompts = [rng.integers(3, m.config.n_vocab, 20).tolist() for _ in range(4)]
            solo = [(await _gen(m, p, 40))[0] for p in prompts]
            budget = 9 * m.engine.page_bytes  # 4 x 60 positions need 16 pages
        async with clutor.Model.open(OLMOE, kv_cache=budget, prefix_cache=prefix_cache, **opts) as m:
            together = await asyncio.gather(*(_gen(m, p, 40) for p in prompts))
            return solo, [t for t, _, _ in together], m.engine_stats()

    solo, together, st = run(go())
    assert st.preemptions >= 1, st
    assert together == solo
    assert st.kv_resident <= st.kv_budget and st.live_sequences == 0 and st.kv_bytes == 0


def test_a_request_that_can_never_fit_is_refused_with_the_numbers():
    async def go():
        async with clutor.Model.open(OLMOE, io="memory", kv_cache="64KiB", kv_type="f32") as m:
            per = m.engine.bytes_per_token
            with pytest.raises(clutor.BudgetError) as e:
                async for _ in m.generate(list(range(3, 40)), max_tokens=40):
                    pass
            ok, _, _ = await _gen(m, [5, 6, 7], 4)  # and the engine goes on
            return str(e.value), per, ok

    msg, per, ok = run(go())
    assert "76 positions" in msg and "64.00 KiB" in msg and "kv_cache" in msg, msg
    assert len(ok) == 4


def test_kv_budget_options_are_checked_and_reported():
    async def opened(**kw):
        async with clutor.Model.open(OLMOE, io="memory", **kw) as m:
            return m.kv.budget, m.kv_note

    budget, note = run(opened(kv_cache="1MiB"))
    assert budget == 1 << 20 and "1MiB" in note
    budget, note = run(opened())
    assert note.startswith("default") and budget > 0
    for bad, words in (({"kv_cache": "lots"}, "kv_cache"), ({"kv_type": "q4"}, "kv_type"),
                       ({"kv_cache": "1KiB"}, "holds no sequence")):
        with pytest.raises(clutor.ClutorError, match=words):
            run(opened(**bad))


# -- sharing --------------------------------------------------------------------------------------------
def _shared_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 500, 256).tolist()
    return [prefix + rng.integers(3, 500, 10).tolist() for _ in range(n)]


@pytest.mark.parametrize("delay", [0.1, 0.0], ids=["100ms-apart", "at-once"])
def test_a_shared_prefix_is_computed_once(delay):
    """8 requests sharing a 256-token system prompt: started 100 ms apart, or all at once (then the
    later ones wait for the first one's pages rather than computing them too). The logits a request
    samples from, computed on shared pages, equal a fresh model's."""
    prompts = _shared_prompts(8)
    opts = dict(io="memory", activations="f32", kv_type="f32", step_tokens=64)

    async def go():
        async with clutor.Model.open(OLMOE, **opts) as m:
            res = await asyncio.gather(*(_gen(m, p, 6, delay=i * delay, capture=True) for i, p in enumerate(prompts)))
            st = m.engine_stats()
        async with clutor.Model.open(OLMOE, **opts) as fresh:
            ref = await fresh.logits(prompts[5])
        return res, st, ref

    res, st, ref = run(go())
    cached = [s.cached_tokens for _, s, _ in res]
    assert sum(cached) >= 7 * (256 - PAGE), cached
    # the rows computed: the prefix once, then each prompt's own 10 and 5 decode steps
    assert st.step_rows <= 256 + 8 * (10 + 5) + 8 * PAGE, (st.step_rows, cached)
    first = res[5][2][0]  # request 5's first sampled row: its prompt's last position
    assert np.max(np.abs(first - ref[-1])) <= 1e-4 * np.max(np.abs(ref[-1]))


def test_prefix_reuse_counts_what_is_resident_and_maps_nothing_per_entry():
    """Issue 21 item 6: 3000 two-token prompts used to leave 16x more resident than the prefix cache
    said, two memory maps each, and a linear scan per lookup. Now the pool's figures are its pages,
    all in one mapping per page group, and the process grows by no more than the budget."""
    from streaming_util import proc_status

    def maps() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    async def go():
        async with clutor.Model.open(OLMOE, io="memory", prefix_cache="4MiB", kv_cache="8MiB") as m:
            await _gen(m, [1, 2], 2)
            rss0, maps0 = proc_status()["VmRSS"], maps()
            for i in range(3000):
                await _gen(m, [3 + i % 500, 3 + i // 500], 2)
            st = m.engine_stats()
            return st, proc_status()["VmRSS"] - rss0, maps() - maps0, m.kv.page_bytes

    st, grew, new_maps, page = run(go())
    assert st.prefix_bytes <= 4 << 20 and st.prefix_bytes == st.prefix_entries * page
    assert st.kv_resident <= 8 << 20
    assert new_maps <= 2, new_maps
    assert grew <= (8 << 20) + (24 << 20), grew  # the pool's budget, plus allocator noise


# -- KV types -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS + NEW_ARCHS)
def test_f16_kv_is_within_1e_2_of_f32(arch):
    """f32 activations: what changes is the KV type alone (in q8 mode a last-bit difference can also
    round an activation to the other int8 neighbour, conftest.STEP_TOL's effect, which is not the KV's)."""
    ids = golden(arch, "Q8_0")["prompt_ids"].tolist()

    async def logits(kv_type):
        async with clutor.Model.open(fixture_path(arch, "Q8_0"), io="memory", kv_type=kv_type,
                                     activations="f32") as m:
            return await m.logits(ids)

    ref, got = run(logits("f32")), run(logits("f16"))
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err <= 1e-2, err


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_kv_stays_close_to_f32(arch):
    ids = golden(arch, "Q8_0")["prompt_ids"].tolist()

    async def logits(kv_type):
        async with clutor.Model.open(fixture_path(arch, "Q8_0"), io="memory", kv_type=kv_type,
                                     activations="f32") as m:
            return await m.logits(ids), m.engine.bytes_per_token

    (ref, f32), (got, q8) = run(logits("f32")), run(logits("q8_0"))
    assert q8 * 32 == f32 * 34 // 4  # 34 bytes per 32 values, as llama.cpp's block_q8_0
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.9
    assert np.mean(np.abs(got - ref)) <= 0.01 * np.max(np.abs(ref))


# -- 32 requests in a cgroup ---------------------------------------------------------------------------
CGROUP_CHILD = r"""
import asyncio, json, sys
import numpy as np
import clutor

async def main(path, budget):
    rng = np.random.default_rng(1)
    async with clutor.Model.open(path, io="memory", kv_cache=budget, kv_type="f32", activations="f32",
                                 max_sequences=32, prefix_cache=0) as m:
        prompts = [rng.integers(3, m.config.n_vocab, 560).tolist() for _ in range(32)]

        async def one(p):
            out = []
            async for c in m.generate(p, max_tokens=40, temperature=0, ignore_eos=True):
                if c.token is not None:
                    out.append(c.token)
            return out

        together = await asyncio.gather(*(one(p) for p in prompts))
        st = m.engine_stats()
        solo = [await one(p) for p in prompts]
    print(json.dumps({"together": together, "solo": solo, "preemptions": st.preemptions,
                      "kv_resident": st.kv_resident, "per_token": m.engine.bytes_per_token}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_32_concurrent_600_token_requests_fit_a_cgroup_sized_to_the_kv_budget(tmp_path):
    """32 requests of 600 positions want 32 x 600 x 32 KiB = 600 MiB of KV at once; with kv_cache
    256 MiB, inside a cgroup of file + 256 MiB + the runtime, all complete, none is killed, and each
    gives its solo tokens."""
    from clutor.bench import memcap
    from streaming_util import child_env
    from synth import ModelSpec, write_model
    from test_streaming import RUNTIME_ALLOWANCE  # the runtime's own footprint, as measured there

    if why := memcap.unavailable_reason():
        pytest.skip(f"cgroup memory caps unavailable: {why}")
    # 8 layers x 4 kv heads x 128 x 2 x 4 bytes = 32 KiB of f32 KV per position; small matrices
    spec = ModelSpec(name="kv32", arch="olmoe", n_layer=8, n_embd=256, n_head=4, n_head_kv=4, head_dim=128,
                     n_expert=8, n_expert_used=2, n_ff_exp=128, vocab_size=512, n_ctx=1024, qtype="Q8_0")
    path = tmp_path / "kv32.gguf"
    write_model(path, spec, seed=5)
    budget = 256 << 20
    cap = path.stat().st_size + budget + RUNTIME_ALLOWANCE
    script = tmp_path / "child.py"
    script.write_text(CGROUP_CHILD)
    r = memcap.run_capped([sys.executable, str(script), str(path), str(budget)], cap, env=child_env(), timeout=600)
    assert not r.oom_killed and r.returncode == 0, (r.returncode, r.oom_killed, r.stderr[-2000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["per_token"] == 32 << 10
    assert out["preemptions"] > 0 and out["kv_resident"] <= budget
    assert out["together"] == out["solo"]
    assert r.peak <= cap
    # without the budget the requests' KV alone would not fit the cap
    assert 32 * 600 * out["per_token"] > cap - path.stat().st_size


def test_f16_pages_widen_as_numpy_does():
    """The page gather's half -> float table is numpy's conversion for every half (subnormals, infinities,
    NaNs), and it lays the pages out as attention reads them (heads, positions, width)."""
    from clutor.model.kernels.kvpages import HALF_TO_FLOAT, gather_f16

    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(HALF_TO_FLOAT.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32))
    rng = np.random.default_rng(0)
    data = rng.integers(0, 65536, (6, 3, 2, PAGE, 5), dtype=np.uint16).view(np.float16)  # [pages, L, H, PAGE, W]
    pages, n = np.array([4, 1, 3]), 2 * PAGE + 3
    want = data[pages, 2].transpose(1, 0, 2, 3).reshape(2, 3 * PAGE, 5)[:, :n].astype(np.float32)
    assert np.array_equal(gather_f16(data, 2, pages, n).view(np.uint32), want.view(np.uint32))
