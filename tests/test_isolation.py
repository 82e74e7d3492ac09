"""One caller's bad input, or one failed expert read, fails only the requests concerned; and each
request's I/O figures are its own, summing to the store's.

The expectations come from the same model run another way: which requests a failed read must fail is
read off each request's own routing, recorded while it ran alone.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import clutor
from faults import FaultyBackend

from conftest import fixture_path, run

PATH = fixture_path("olmoe", "Q8_0")
PROMPTS = ["Hello there", "Good morning to you", "The quick brown fox", "Once upon a time", "In a hole in the ground",
           "It was a bright cold day", "Call me Ishmael", "All happy families"]
N = 4  # tokens each


async def _gen(model, prompt, n=N):
    out, stats = [], None
    async for o in model.generate(prompt, max_tokens=n, ignore_eos=True, temperature=0):
        if o.token is not None:
            out.append(o.token)
        stats = o.stats or stats
    return out, stats


# -- a bad request is refused to its own caller, before it joins a step ----------------------------
def test_bad_token_ids_fail_their_own_caller_only():
    async def go():
        async with clutor.Model.open(PATH, io="memory") as model:
            solo = [(await _gen(model, p))[0] for p in PROMPTS[:2]]
            V = model.config.n_vocab
            steps0 = model.engine_stats().steps
            good = [asyncio.create_task(_gen(model, p)) for p in PROMPTS[:2]]
            bad = [asyncio.create_task(_gen(model, [1, 2, V])), asyncio.create_task(_gen(model, [-1, 5])),
                   asyncio.create_task(model.logits([3, V + 7])), asyncio.create_task(model.embed([V]))]
            seq_ok, seq_bad = model.new_sequence(), model.new_sequence()
            with pytest.raises(clutor.ClutorError, match="vocabulary"):
                await model.forward_batch([(seq_ok, [1, 2, 3]), (seq_bad, [4, V])])
            assert seq_ok.n == 0 and seq_bad.n == 0  # refused before the step: nothing was written
            errors = await asyncio.gather(*bad, return_exceptions=True)
            return solo, await asyncio.gather(*good), errors, model.engine_stats(), steps0

    solo, good, errors, st, steps0 = run(go())
    assert [t for t, _ in good] == solo
    for e in errors:
        assert isinstance(e, clutor.ClutorError) and "token ids must be in [0," in str(e), e
    # the bad requests never took part in a step: the good ones' steps only (their prefill + decode)
    assert st.steps - steps0 <= 2 * N and st.live_sequences == 0


# -- a failed expert read fails the requests whose rows needed that expert -------------------------
def _layer0_experts(model, log: list) -> None:
    """Record every step's layer-0 routing (the first MoE layer) into log."""
    arch, first = model.arch, model.runner._w.layers[model.config.moe_layers[0]]
    real = arch.route

    def route(lw, h):
        sel, w = real(lw, h)
        if lw is first:
            log.append(sel.copy())
        return sel, w

    arch.route = route


def test_a_failed_expert_read_fails_only_the_requests_routed_to_it():
    async def solo_runs():
        async with clutor.Model.open(PATH, io="memory") as model:
            out = []
            for p in PROMPTS:
                log: list = []
                _layer0_experts(model, log)
                tokens, _ = await _gen(model, p)
                out.append((tokens, set(np.concatenate(log).ravel().tolist())))
                del model.arch.route
            return out

    solo = run(solo_runs())
    # an expert some requests route to at layer 0 (at some step) and others never do
    counts = {}
    for _, used in solo:
        for e in used:
            counts[e] = counts.get(e, 0) + 1
    bad = min((e for e, c in counts.items() if 0 < c < len(PROMPTS)), key=lambda e: abs(counts[e] - len(PROMPTS) / 2))
    hit = [bad in used for _, used in solo]

    async def together():
        async with clutor.Model.open(PATH, io="threads", expert_cache="100%", prefix_cache=0) as model:
            store = model._experts
            layer = 0  # the store's numbering: the first MoE layer
            spans = {(part.file, part.offset) for part in store._parts_of((layer, bad))}
            store.backend = FaultyBackend(store.backend,
                                          fail=lambda r: "injected fault" if (r.file, r.offset) in spans else None)
            res = await asyncio.gather(*(_gen(model, p) for p in PROMPTS), return_exceptions=True)
            after = await _gen(model, PROMPTS[hit.index(False)])  # the model goes on
            return res, after, store.backend.injected, model.engine_stats()

    res, after, injected, st = run(together())
    assert injected > 0
    for (tokens, _), needed, r in zip(solo, hit, res):
        if needed:
            assert isinstance(r, clutor.ExpertReadError) and r.expert == bad and "injected fault" in str(r), r
        else:
            assert not isinstance(r, BaseException), r
            assert r[0] == tokens
    assert after[0] == solo[hit.index(False)][0]
    assert st.live_sequences == 0 and st.kv_bytes == 0


# -- each request's I/O is its own; together they are the store's ------------------------------------
def test_per_request_io_figures_are_their_own_and_sum_to_the_stores():
    async def go():
        async with clutor.Model.open(PATH, io="threads", expert_cache="25%", prefix_cache=0) as model:
            before = model.io_stats()
            alone = await _gen(model, PROMPTS[0], 6)
            mid = model.io_stats()
            res = await asyncio.gather(*(_gen(model, p, 6 + i) for i, p in enumerate(PROMPTS[1:5])))
            return before, alone, mid, res, model.io_stats(), model.config

    before, (_, alone), mid, res, end, cfg = run(go())
    # alone, a request's figures are the store's
    io = alone.io
    assert io.accesses == mid.accesses - before.accesses and io.hits == mid.hits - before.hits
    assert io.bytes_read == mid.bytes_demand - before.bytes_demand + mid.bytes_prefetch - before.bytes_prefetch
    assert abs(io.wait_seconds - (mid.wait_seconds - before.wait_seconds)) < 1e-9
    # together, each request's figures are a share of the steps it was in, and the shares add up
    ios = [s.io for _, s in res]
    accesses = end.accesses - mid.accesses
    assert abs(sum(i.accesses for i in ios) - accesses) <= len(ios)  # (each rounded to a whole access)
    assert abs(sum(i.hits for i in ios) - (end.hits - mid.hits)) <= len(ios)
    read = end.bytes_demand - mid.bytes_demand + end.bytes_prefetch - mid.bytes_prefetch  # (batched: prefetch on)
    assert abs(sum(i.bytes_read for i in ios) - read) <= len(ios)
    assert abs(sum(i.wait_seconds for i in ios) - (end.wait_seconds - mid.wait_seconds)) < 1e-6
    assert all(0 < i.accesses < accesses for i in ios)
    # a request needs at most top-k experts per layer per position it computed: its share is at most that
    top_k, layers = cfg.n_expert_used, len(cfg.moe_layers)
    for (tokens, s) in res:
        positions = s.prompt_tokens + len(tokens) - 1
        assert s.io.accesses <= positions * top_k * layers
    # a longer request (more steps) is charged more than the shortest one
    assert ios[-1].accesses > ios[0].accesses


# -- the logits processor: run before sampling, its failure is its own request's ------------------
def test_logits_processor_runs_before_sampling_and_fails_only_its_request():
    async def go():
        async with clutor.Model.open(PATH, io="memory") as model:
            solo = (await _gen(model, PROMPTS[0]))[0]
            seen = []

            def only_7(ids, logits):  # every token but 7 masked out
                seen.append(len(ids))
                logits[:] = -np.inf
                logits[7] = 0.0
                return logits

            def boom(ids, logits):
                raise ValueError("processor failed")

            async def forced():
                out = []
                async for o in model.generate(PROMPTS[1], max_tokens=N, ignore_eos=True, temperature=0,
                                              logits_processor=only_7, logprobs=1):
                    if o.token is not None:
                        out.append((o.token, o.logprob))
                return out

            async def failing(fn):
                async for _ in model.generate(PROMPTS[2], max_tokens=N, logits_processor=fn):
                    pass

            res = await asyncio.gather(_gen(model, PROMPTS[0]), forced(), failing(boom),
                                       failing(lambda ids, logits: logits[:5]), return_exceptions=True)
            return solo, res, seen

    solo, (plain, forced, boom, short), seen = run(go())
    assert plain[0] == solo  # batched beside the others, untouched by their processors
    assert [t for t, _ in forced] == [7] * N
    # the processor saw the ids so far (prompt, then one more each step); logprobs are the raw logits'
    assert seen == [seen[0] + i for i in range(N)]
    assert all(lp < 0 for _, lp in forced)
    assert isinstance(boom, ValueError) or (isinstance(boom, clutor.ClutorError) and "processor failed" in str(boom))
    assert isinstance(short, clutor.ClutorError) and "shape" in str(short)
