"""Speculative decoding: drafts verified in one step keep what decoding without them gives.

Each claim is checked against the same model decoding without speculation: greedy and seeded tokens
equal, batched and alone, with sliding-window layers and stop tokens inside a kept draft; the
verification rule keeps the target distribution (a chi-square test against the sampler's own
probabilities); rejected rows' pages go back to the pool.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import clutor
from clutor.errors import ClutorError
from clutor.model.sampling import Sampler, SamplingParams
from clutor.model.speculative import Drafter, NgramCache, Pacer, SpeculativeParams, parse_speculative, verifier

from conftest import ARCHS, HYBRID_ARCHS, fixture_path, run, shared_data

CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n")
EDIT = "Here is a file:\n" + CODE + "\nThe same file with sub renamed to minus:\n"


async def _gen(model, prompt, n, **opts):
    toks, stats = [], None
    async for c in model.generate(prompt, max_tokens=n, **opts):
        if c.token is not None:
            toks.append(c.token)
        else:
            stats = c.stats
    return toks, stats


def _repeating(V: int, seed: int) -> list[int]:
    """Ids whose second half repeats the first: prompt lookup drafts from it at once."""
    rng = np.random.default_rng(seed)
    part = rng.integers(0, V, 40).tolist()
    return part + part[:20]


@pytest.mark.parametrize("arch,qtype", [(a, "Q8_0") for a in ARCHS] + [("gptoss", "Q8_0"), ("olmoe", "Q4_K_M")])
def test_greedy_and_seeded_tokens_equal_decoding_without_drafts(arch, qtype):
    """Greedy and seeded sampling give the same tokens with n-gram drafts (every draft length the
    pacer picks, non-adaptive to force long ones) as without; gpt-oss has sliding-window layers, whose
    pages are cut back after a rejected draft too."""
    async def go():
        async with clutor.Model.open(fixture_path(arch, qtype), io="memory", activations="q8") as m:
            ids = _repeating(m.config.n_vocab, 5)
            out = {}
            for name, spec in (("off", "off"), ("ngram", "ngram"),
                               ("long", {"draft_max": 8, "adaptive": False, "ngram_min": 1})):
                for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 11, "top_k": 0}):
                    out[name, sampling["temperature"]] = await _gen(m, ids, 40, ignore_eos=True, speculative=spec,
                                                                    **sampling)
            return out

    out = run(go())
    for t in (0, 0.9):
        base = out["off", t][0]
        assert len(base) == 40
        for name in ("ngram", "long"):
            toks, st = out[name, t]
            assert toks == base, (name, t)
        assert out["long", t][1].drafted_tokens > 0  # it did verify drafts (some may be rejected)
    assert out["off", 0][1].drafted_tokens == 0


def test_an_edit_on_the_real_text_model_keeps_most_drafts():
    """On the model trained on real text, an answer that repeats code from the prompt drafts from it:
    tokens equal to plain greedy decoding, most drafts kept, fewer steps than tokens."""
    path = shared_data("models/real-olmoe-q8_0.gguf")

    async def go():
        async with clutor.Model.open(path, io="memory", activations="q8") as m:
            prompt = "Here is a file:\n" + CODE + "\nThe same file again:\n"
            base, _ = await _gen(m, prompt, 60, temperature=0, ignore_eos=True)
            spec, st = await _gen(m, prompt, 60, temperature=0, ignore_eos=True, speculative="ngram")
            steps0 = m.engine_stats().steps
            return base, spec, st, steps0

    base, spec, st, _ = run(go())
    assert spec == base
    assert st.drafted_tokens > 0 and st.accepted_tokens > 0
    assert st.draft_steps < st.generated_tokens


def test_concurrent_speculative_streams_give_their_solo_tokens():
    """Three streams drafting in one batched step (the scheduler's path, not the lone-sequence loop)
    give the tokens each gives alone without drafts."""
    path = fixture_path("olmoe", "Q8_0")

    async def go():
        async with clutor.Model.open(path, io="memory", activations="q8") as m:
            V = m.config.n_vocab
            prompts = [_repeating(V, s) for s in (1, 2, 3)]
            alone = [(await _gen(m, p, 24, temperature=0, ignore_eos=True))[0] for p in prompts]
            both = await asyncio.gather(*[_gen(m, p, 24, temperature=0, ignore_eos=True,
                                               speculative={"draft_max": 4, "adaptive": False, "ngram_min": 1})
                                          for p in prompts])
            return alone, both, m.engine_stats()

    alone, both, es = run(go())
    for a, (b, st) in zip(alone, both):
        assert b == a
    assert sum(st.drafted_tokens for _, st in both) > 0
    assert es.live_sequences == 0 and es.kv_bytes == 0  # every page of the rejected rows went back


def test_a_stop_token_inside_a_kept_draft_ends_there_and_max_tokens_holds():
    """A draft that runs past max_tokens or through an end-of-generation token is cut at it: exactly
    max_tokens tokens, and eos ends the reply as without drafts."""
    path = fixture_path("olmoe", "Q8_0")

    async def go():
        async with clutor.Model.open(path, io="memory", activations="q8") as m:
            ids = _repeating(m.config.n_vocab, 7)
            out = []
            for n in (1, 2, 3, 9):
                a, _ = await _gen(m, ids, n, temperature=0, ignore_eos=True)
                b, st = await _gen(m, ids, n, temperature=0, ignore_eos=True,
                                   speculative={"draft_max": 8, "adaptive": False, "ngram_min": 1})
                out.append((n, a, b, st))
            # the third greedy token made the stop id: the reply ends at it, drafted or not
            base, _ = await _gen(m, ids, 12, temperature=0, ignore_eos=True)
            stop = base[2]
            from clutor.model.engine import Request
            from clutor.model.sampling import Sampler, SamplingParams as SP

            res = []
            for spec in (None, SpeculativeParams(draft_max=8, adaptive=False, ngram_min=1)):
                req = m.engine.submit(Request(list(ids), sampler=Sampler(SP(temperature=0)), max_new=12,
                                              stop_ids=frozenset([stop]), speculative=spec))
                got = []
                while True:
                    tok, _, end = await req.next()
                    got.append(tok)
                    if end:
                        break
                m.engine.release(req)
                res.append((got, end))
            return out, res, base

    out, res, base = run(go())
    for n, a, b, st in out:
        assert len(b) == n and b == a
    (plain, end0), (drafted, end1) = res
    assert plain == drafted == base[: base.index(base[2]) + 1] and end0 == end1 == "eos"


def test_speculation_is_off_with_a_logits_processor_and_for_recurrent_layers():
    async def go(path):
        async with clutor.Model.open(path, io="memory") as m:
            ids = _repeating(m.config.n_vocab, 3)
            a, _ = await _gen(m, ids, 12, temperature=0, ignore_eos=True)
            b, st = await _gen(m, ids, 12, temperature=0, ignore_eos=True, speculative="ngram",
                               logits_processor=lambda h, x: x)
            c, st2 = await _gen(m, ids, 12, temperature=0, ignore_eos=True, speculative="ngram")
            return a, b, c, st, st2, m.kv.recurrent

    a, b, _, st, _, _ = run(go(fixture_path("olmoe", "Q8_0")))
    assert a == b and st.drafted_tokens == 0 and st.draft_steps == 0
    a, _, c, _, st2, recurrent = run(go(fixture_path("nemotron_h_moe", "Q4_K_M")))
    assert recurrent and a == c and st2.drafted_tokens == 0


def test_the_verification_rule_keeps_the_target_distribution():
    """A deterministic draft d verified by sampling: P(token) must be the sampler's own distribution,
    d included (kept with probability p(d), the remainder renormalised otherwise). Chi-square over
    20,000 draws of a 6-token vocabulary, the 0.1% critical value for 5 degrees of freedom."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5], np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    p = np.exp(logits - logits.max())
    p /= p.sum()

    class Req:
        history: list[int] = []
        stop_ids = frozenset()
        n_gen = 0
        max_new = 100

    req = Req()
    sampler = Sampler(params)
    head = lambda rows: (sampler.sample(rows[-1], req.history), None)  # noqa: E731
    N = 20_000
    counts = np.zeros(6)
    kept = 0
    two = np.stack([logits, logits])
    for _ in range(N):
        out = verifier(req, head, [1])(two)  # draft token 1 (p = 0.16)
        counts[out[0][0]] += 1
        kept += out[0][0] == 1
        assert len(out) == (2 if out[0][0] == 1 else 1)
    chi2 = float(((counts - N * p) ** 2 / (N * p)).sum())
    assert chi2 < 20.52, (counts, N * p)
    assert abs(kept / N - p[1]) < 4 * np.sqrt(p[1] * (1 - p[1]) / N)


def test_prompt_lookup_and_the_session_cache():
    params = SpeculativeParams(ngram_min=2, ngram_max=3)
    d = Drafter(params)
    h = [1, 2, 3, 4, 5, 9, 2, 3]
    assert d.propose(h, 3) == [4, 5, 9]  # "2 3" was followed by 4 5 9
    assert d.propose(h + [7, 1, 2, 3], 2) == [4, 5]  # the longest match first: "1 2 3" was followed by 4 5
    d = Drafter(params)
    assert d.propose(h + [7, 8, 2, 3], 2) == [7, 8]  # "8 2 3" is new; of the "2 3"s the latest
    assert d.propose([8, 8, 6], 4) == []
    cache = NgramCache()
    cache.add([5, 6, 7, 8, 9, 10], range(2, 4), tail=6)
    d2 = Drafter(params, cache)
    assert d2.propose([1, 6, 7], 3) == [8, 9, 10]
    assert NgramCache(max_entries=4).add(list(range(50)), range(2, 3), 50) is None


def test_the_pacer_drafts_where_it_pays_and_stops_where_it_does_not():
    p = Pacer(SpeculativeParams(draft_max=16))
    cheap = lambda r: 1 + 0.15 * (r - 1)  # noqa: E731
    p.first, p.cont = 0.9, 0.9
    long = p.choose(cheap, cap=16)
    p.cont = 0.5
    short = p.choose(cheap, cap=16)
    assert long > short >= 1
    p.first = 0.05
    assert p.choose(lambda r: 1 + 0.5 * (r - 1), cap=16) == 0  # a row that costs half a step, drafts almost never kept
    assert Pacer(SpeculativeParams(draft_max=4)).choose(lambda r: 1.0, cap=2) <= 2
    for _ in range(12):
        p.update(8, 8)
    assert p.first > 0.9 and p.cont > 0.9
    for _ in range(12):
        p.update(8, 0)
    assert p.first < 0.1 and p.cont > 0.9  # lost at the first token: the runs that were kept stay long


@pytest.mark.parametrize("value,field", [({"draft_max": 0}, "draft_max"), ({"n_max": 200}, "draft_max"),
                                         ({"ngram_min": 5, "ngram_max": 2}, "ngram_min"), ("eagle", "mode"),
                                         ({"bogus": 1}, "bogus"), (3.5, "speculative")])
def test_bad_speculative_settings_name_the_field(value, field):
    with pytest.raises(ClutorError, match=field):
        parse_speculative(value)
    assert parse_speculative({"n_max": 5, "n_min": 1}) == SpeculativeParams(draft_max=5, draft_min=1)
    assert parse_speculative("off") is None and parse_speculative(None) is None
