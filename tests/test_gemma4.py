"""Gemma 4 (`gemma4`, the MoE form of Gemma-4-26B-A4B) against llama.cpp's recordings, and its
sliding-window layers keeping only their window's pages.

Fixture: tools/make_hf_fixture.py gemma4 (a tiny Gemma4ForCausalLM checkpoint through llama.cpp's
convert_hf_to_gguf.py, then llama.cpp's quantiser): six layers, five with a 16-token window and one
global with its own head size, KV heads and V = K; every layer a shared GELU MLP plus 8 fused
experts (top 2). Golden files: tools/record_reference.py (tests/fixtures/README.md)."""
from __future__ import annotations

import numpy as np
import pytest

import clutor
from clutor.model.kv import PAGE
from conftest import (ACTIVATIONS, assert_streamed_equals_memory, NEWER_BARS, STEP_TOL, assert_greedy_matches_llama_cpp, assert_logits_match_llama_cpp,
                      assert_prefill_equals_incremental, fixture_path, golden, run)

ARCH = "gemma4"
TYPES = ("F16", "Q4_K_M")


@pytest.mark.parametrize("qtype", TYPES)
def test_logits_match_llama_cpp(qtype):
    """The issue's bars: F16 within 0.02 with every argmax equal; quantised argmax >= 95% and mean
    |diff| <= 0.5% of the largest logit."""
    assert_logits_match_llama_cpp(ARCH, qtype, **NEWER_BARS)


def test_greedy_matches_llama_cpp():
    assert_greedy_matches_llama_cpp(ARCH, "F16")


def test_tokenizer_matches_llama_cpp_on_the_fixture_vocab():
    """Gemma 4's SentencePiece-style BPE (spaces as U+2581, newline runs apart, byte tokens), on
    texts of every kind, as llama.cpp tokenizes them with the fixture's vocabulary; and back."""
    g = golden(ARCH, "F16")
    tok = clutor.Tokenizer.from_gguf(fixture_path(ARCH, "F16"))
    offsets, ids = g["tok_offsets"].tolist(), g["tok_ids"].tolist()
    for i, text in enumerate(str(t) for t in g["tok_texts"]):
        want = ids[offsets[i]:offsets[i + 1]]
        assert tok.encode(text, add_bos=False) == want, text
        assert tok.decode(want) == text, text
    assert tok.encode(str(g["prompt_text"]), add_bos=False) == g["greedy_prompt_ids"].tolist()
    assert tok.add_bos  # llama.cpp always adds BOS for Gemma 4


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_prefill_equals_incremental_decode(activations):
    """48 positions (three windows of 16): one prefill, and 20 then one token at a time. (An f32 KV
    cache: with f16 pages, a key that a prefill's BLAS product and a decode's kernel compute 1e-7
    apart can round to neighbouring halves, 5e-4 apart, which the f32 mode's bound does not allow.)"""

    ids = golden(ARCH, "Q4_K_M")["prompt_ids"].tolist()[:48]
    assert_prefill_equals_incremental(fixture_path(ARCH, "Q4_K_M"), ids, 20, activations, kv_type="f32")


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_streamed_equals_memory_bit_for_bit(activations):
    assert_streamed_equals_memory(ARCH, activations)


def test_window_layers_keep_only_their_window():
    """The window layers form a page group of their own (their KV heads and head size), the global
    layer another; after 75 positions the window group holds only the pages of the last window
    (16 positions: 2 or 3 pages), the global one every page; and a reply built on that sequence
    equals the same positions computed from scratch."""
    prompt = golden(ARCH, "F16")["prompt_ids"].tolist()

    async def go():
        async with clutor.Model.open(fixture_path(ARCH, "F16"), n_ctx=4096, kv_type="f32") as model:
            pool = model.kv
            seq = model.new_sequence()
            await model.forward(seq, prompt[:60])
            steps = [(await model.forward(seq, [t]))[0] for t in prompt[60:]]
            pool.trim_window(seq)
            kinds = {g.window: (g.heads, g.k_dim, len(g.layers)) for g in pool.groups}
            tables = {g.window: list(seq.tables[gi]) for gi, g in enumerate(pool.groups)}
            fresh = await model.logits(prompt)
            return kinds, tables, np.stack(steps), fresh[60:]

    kinds, tables, steps, fresh = run(go())
    assert kinds == {16: (2, 32, 5), 0: (1, 64, 1)}
    n_pages = -(-len(prompt) // PAGE)
    assert all(p >= 0 for p in tables[0]) and len(tables[0]) == n_pages
    held = [i for i, p in enumerate(tables[16]) if p >= 0]
    assert held == list(range((len(prompt) - 16) // PAGE, n_pages))  # the pages of positions 59..74
    np.testing.assert_allclose(steps, fresh, rtol=0, atol=STEP_TOL["q8"] * np.abs(fresh).max())
    assert (steps.argmax(-1) == fresh.argmax(-1)).all()


def test_info_shows_layer_kinds():
    from clutor.cli import main
    import io
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info", str(fixture_path(ARCH, "Q4_K_M"))]) == 0
    text = out.getvalue()
    for w in ("5 window, 1 attention", "sliding window 16 on 5 of 6 layers", "5 sliding-window layers keep only",
              "heads           4 q / 2 kv",
              "per-expert scale"):
        assert w in text, (w, text)
