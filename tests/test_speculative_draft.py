"""Speculative decoding with a draft model: a small model with the same vocabulary drafts greedily and
the target verifies; what decoding without drafts gives is kept.

Checked against the target decoding alone: greedy and seeded tokens equal, with a draft that is mostly
right (the same model at another quantisation) and one that is mostly wrong (another architecture), a
request alone and several batched; the draft's sequences go back to its pool; a draft whose tokens mean
something else, or whose state cannot be cut back, is refused naming the file and the field.
"""
from __future__ import annotations

import asyncio

import pytest

import clutor
from clutor.errors import ClutorError, ModelFileError

from conftest import fixture_path, run
from test_speculative import _gen

TARGET = fixture_path("olmoe", "Q8_0")


PROMPTS = ([5, 17, 300, 42, 8, 99, 100, 7], [400, 12, 12, 12, 9, 3, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
SAMPLING = ({"temperature": 0}, {"temperature": 0.9, "seed": 3, "top_k": 0})


@pytest.mark.parametrize("draft", [("olmoe", "Q4_K_M"), ("qwen3moe", "Q8_0")])
def test_tokens_equal_decoding_without_drafts(draft):
    """Alone, then three requests batched (their drafts made on the compute thread before the step):
    greedy and seeded tokens as the target gives alone; drafts verified (long ones forced: draft_max 6,
    not adaptive); every draft sequence back in the draft's pool after."""
    async def go():
        async with clutor.Model.open(TARGET, io="memory", activations="q8") as m:
            base = {(i, s["temperature"]): await _gen(m, p, 30, ignore_eos=True, **s)
                    for i, p in enumerate(PROMPTS) for s in SAMPLING}
        forced = {"mode": "draft", "draft_max": 6, "adaptive": False}
        async with clutor.Model.open(TARGET, io="memory", activations="q8",
                                     draft_model=fixture_path(*draft)) as m:
            alone = {(i, s["temperature"]): await _gen(m, p, 30, ignore_eos=True, speculative=forced, **s)
                     for i, p in enumerate(PROMPTS) for s in SAMPLING}
            batched = {}
            for s in SAMPLING:
                got = await asyncio.gather(*(_gen(m, p, 30, ignore_eos=True, speculative=forced, **s)
                                             for p in PROMPTS))
                batched.update({(i, s["temperature"]): g for i, g in enumerate(got)})
            left = m.draft.model.kv.stats().live_bytes
        return base, alone, batched, left

    base, alone, batched, left = run(go())
    for key, (toks, _) in base.items():
        assert len(toks) == 30
        assert alone[key][0] == toks, ("alone", key)
        assert batched[key][0] == toks, ("batched", key)
    assert sum(st.drafted_tokens for _, st in alone.values()) > 0
    assert sum(st.drafted_tokens for _, st in batched.values()) > 0
    assert left == 0


def test_a_mostly_right_draft_keeps_most_and_a_wrong_one_little():
    """The acceptance follows the draft: the target's own weights at Q4_K_M agree with it far more
    often than another architecture's."""
    async def rate(draft):
        async with clutor.Model.open(TARGET, io="memory", activations="q8", draft_model=draft) as m:
            _, st = await _gen(m, PROMPTS[0], 40, ignore_eos=True, temperature=0,
                               speculative={"draft_max": 4, "adaptive": False})
            return st.accepted_tokens / st.drafted_tokens

    right = run(rate(fixture_path("olmoe", "Q4_K_M")))
    wrong = run(rate(fixture_path("qwen3moe", "Q8_0")))
    assert right > 0.5 and right > 2 * wrong, (right, wrong)


def test_the_default_mode_with_a_draft_model_is_the_draft():
    async def go():
        async with clutor.Model.open(TARGET, io="memory", draft_model=fixture_path("olmoe", "Q4_K_M")) as m:
            _, st = await _gen(m, PROMPTS[1], 20, ignore_eos=True, temperature=0,
                               speculative={"draft_max": 3, "adaptive": False})  # fields only: the model's mode
            return m.options.speculative.mode, st.drafted_tokens

    mode, drafted = run(go())
    assert mode == "draft" and drafted > 0


def test_a_draft_with_another_vocabulary_is_refused_naming_the_file():
    draft = fixture_path("gemma4", "F16")
    with pytest.raises(ModelFileError) as e:
        run(clutor.Model.open(TARGET, io="memory", draft_model=draft))
    assert str(draft) in str(e.value) and "tokenizer.ggml.model" in str(e.value)


def test_a_recurrent_draft_is_refused():
    draft = fixture_path("nemotron_h_moe", "Q4_K_M")
    with pytest.raises(ModelFileError) as e:
        run(clutor.Model.open(TARGET, io="memory", draft_model=draft))
    assert str(draft) in str(e.value) and "recurrent" in str(e.value)


def test_draft_mode_without_a_draft_model_is_refused():
    with pytest.raises(ClutorError, match="draft model"):
        run(clutor.Model.open(TARGET, io="memory", speculative="draft"))

    async def go():
        async with clutor.Model.open(TARGET, io="memory") as m:
            await _gen(m, PROMPTS[0], 4, speculative="draft")

    with pytest.raises(ClutorError, match="without a draft model"):
        run(go())
