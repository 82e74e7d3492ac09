"""The forward pass against llama.cpp's recorded logits and greedy tokens (tests/golden, made by
tools/record_reference.py from the committed fixtures with llama-cpp-python)."""
from __future__ import annotations

import numpy as np
import pytest

import clutor
from conftest import (assert_matches_golden, ACTIVATIONS, ARCHS, NEW_ARCHS, NEW_FIXTURES, STEP_TOL, TYPES, fixture_path,
                      golden, run)


async def _logits(path, ids):
    # llama.cpp's logits were recorded with an f32 KV cache (tools/record_reference.py)
    async with clutor.Model.open(path, kv_type="f32") as model:
        return await model.logits(ids)


# every fixture: the first architectures in every type, the later ones (tests/test_archs.py) in theirs
@pytest.mark.parametrize("arch, qtype", [(a, q) for a in ARCHS for q in TYPES] + NEW_FIXTURES)
def test_logits_match_llama_cpp(arch, qtype):
    g = golden(arch, qtype)
    ref = g["logits"].astype(np.float32)  # [T, V]
    got = run(_logits(fixture_path(arch, qtype), g["prompt_ids"].tolist()))
    assert_matches_golden(got, ref, qtype)


# Quantised fixtures in the default q8 mode, which computes with ggml's own activation blocks: what
# remains is float rounding in attention and norms, where an activation one ulp apart can round to the
# other int8 neighbour in a later product (worst measured: 0.18% of max |logit|, qwen3moe Q6_K; most
# files below 0.03%, several exactly 0). f32 mode stays at 0.1-0.6%, as llama.cpp's own rounding is.
Q8_MEAN_TOL = 0.0025


@pytest.mark.parametrize("arch, qtype", [(a, q) for a in ARCHS for q in TYPES if q != "F16"]
                         + [f for f in NEW_FIXTURES if f[1] != "F16"])
def test_q8_mode_reproduces_llama_cpp(arch, qtype):
    g = golden(arch, qtype)
    ref = g["logits"].astype(np.float32)

    async def go():
        # (llama.cpp's logits were recorded with an f32 KV cache, tools/record_reference.py)
        async with clutor.Model.open(fixture_path(arch, qtype), activations="q8", kv_type="f32") as model:
            return await model.logits(g["prompt_ids"].tolist())

    got = run(go())
    diff = np.abs(got - ref)
    assert diff.mean() <= Q8_MEAN_TOL * np.abs(ref).max(), f"mean |diff| {diff.mean():.5f}, max {diff.max():.4f}"
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.97


@pytest.mark.parametrize("arch", ["deepseek2", "deepseek2-lite"])
def test_deepseek_mla_q8_0_is_llama_cpp_to_rounding(arch):
    """Both MLA forms in Q8_0: llama.cpp multiplies q_nope by attn_k_b and the attended latents by
    attn_v_b as quantised products (Q8_0 activations), and the older attn_kv_b form expands the
    rounded latents. Computing those in float left the V3 form 0.5% of max |logit| away on average;
    done as llama.cpp does them, what remains is float rounding."""
    g = golden(arch, "Q8_0")
    ref = g["logits"].astype(np.float32)

    async def go():
        async with clutor.Model.open(fixture_path(arch, "Q8_0"), activations="q8", kv_type="f32") as model:  # f32-KV goldens
            return await model.logits(g["prompt_ids"].tolist())

    got = run(go())
    diff = np.abs(got - ref)
    assert diff.mean() <= 5e-4 * np.abs(ref).max(), f"mean |diff| {diff.mean():.5f}, max {diff.max():.4f}"
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("arch", ARCHS + NEW_ARCHS)
def test_greedy_matches_llama_cpp(arch):
    g = golden(arch, "F16")
    want = g["greedy_ids"].tolist()
    assert len(want) >= 24

    async def gen():
        async with clutor.Model.open(fixture_path(arch, "F16"), kv_type="f32") as model:
            return [o.token async for o in model.generate(g["greedy_prompt_ids"].tolist(), max_tokens=24,
                                                         temperature=0, ignore_eos=True) if o.token is not None]

    assert run(gen()) == want[:24]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype", ["F16", "Q4_K_M"])
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_prefill_equals_incremental_decode(arch, qtype, activations):
    async def both():
        async with clutor.Model.open(fixture_path(arch, qtype), activations=activations) as model:
            ids = golden(arch, qtype)["prompt_ids"].tolist()[:16]
            full = await model.logits(ids)
            seq = model.new_sequence()
            steps = [(await model.forward(seq, [i]))[0] for i in ids]
            # and a split prefill: half batched, the rest one by one
            seq2 = model.new_sequence()
            half = await model.forward(seq2, ids[:8], all_logits=True)
            rest = [(await model.forward(seq2, [i]))[0] for i in ids[8:]]
            return full, np.stack(steps), np.concatenate([half, np.stack(rest)])

    full, steps, mixed = run(both())
    scale = np.abs(full).max()
    np.testing.assert_allclose(steps, full, rtol=0, atol=STEP_TOL[activations] * scale)
    np.testing.assert_allclose(mixed, full, rtol=0, atol=STEP_TOL[activations] * scale)
    assert (steps.argmax(-1) == full.argmax(-1)).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_matches_llama_cpp_on_model_vocab(arch):
    g = golden(arch, "F16")
    tok = clutor.Tokenizer.from_gguf(fixture_path(arch, "F16"))
    texts = [str(t) for t in g["tok_texts"]]
    offsets = g["tok_offsets"].tolist()
    ids = g["tok_ids"].tolist()
    assert len(texts) + 1 == len(offsets)
    for i, text in enumerate(texts):
        assert tok.encode(text) == ids[offsets[i]:offsets[i + 1]], text
    assert tok.encode(str(g["prompt_text"])) == g["greedy_prompt_ids"].tolist()


def test_logits_are_fresh_per_call():
    path = fixture_path("olmoe", "F16")
    ids = golden("olmoe", "F16")["prompt_ids"].tolist()[:10]

    async def twice():
        async with clutor.Model.open(path) as model:
            return await model.logits(ids), await model.logits(ids)

    a, b = run(twice())
    np.testing.assert_array_equal(a, b)


def test_generate_options_and_stop():
    path = fixture_path("qwen3moe", "F16")

    async def go():
        async with clutor.Model.open(path) as model:
            outs = [o async for o in model.generate("Hello there", max_tokens=8, temperature=0.9, seed=3,
                                                    ignore_eos=True)]
            again = [o async for o in model.generate("Hello there", max_tokens=8, temperature=0.9, seed=3,
                                                     ignore_eos=True)]
            greedy = [o async for o in model.generate("Hello there", max_tokens=12, temperature=0, ignore_eos=True)]
            text = "".join(o.text for o in greedy)
            # a stop string from the middle of the greedy text: the same run must end just before it
            assert len(text) > 4, f"greedy text too short to take a stop string from: {text!r}"
            # (one whose characters occur before it: a string split into one stop per character would end sooner)
            i = next((i for i in range(len(text) // 2, len(text) - 1) if set(text[i:i + 2]) & set(text[:i])),
                     len(text) // 2)
            stop = text[i:i + 2]
            stopped = [o async for o in model.generate("Hello there", max_tokens=12, temperature=0,
                                                       ignore_eos=True, stop=[stop])]
            one = [o async for o in model.generate("Hello there", max_tokens=12, temperature=0,
                                                   ignore_eos=True, stop=stop)]  # a str, not a list
            assert "".join(o.text for o in one) == "".join(o.text for o in stopped)
            return outs, again, greedy, text, stop, stopped

    outs, again, greedy, text, stop, stopped = run(go())
    assert [o.token for o in outs] == [o.token for o in again]  # seeded sampling is reproducible
    assert outs[-1].stats is not None and outs[-1].stats.generated_tokens == 8
    assert sum(o.token is not None for o in outs) == 8
    assert greedy[-1].stats.stop_reason == "length"
    stext = "".join(o.text for o in stopped)
    assert stop not in stext and text.startswith(stext)
    assert stopped[-1].stats.stop_reason == "stop"


@pytest.mark.parametrize("kwargs, words", [
    ({"policy": "bogus"}, "policy must be one of"),
    ({"trace": "/nonexistent-dir/trace.jsonl"}, "cannot write the routing trace"),
    ({"n_ctx": 10**9}, "n_ctx must be between"),
    ({"expert_cache": "lots"}, "expert_cache"),
])
def test_bad_options_are_clear_errors(kwargs, words):
    async def go():
        async with clutor.Model.open(fixture_path("olmoe", "Q8_0"), **kwargs):
            pass

    with pytest.raises(clutor.ClutorError, match=words):
        run(go())
