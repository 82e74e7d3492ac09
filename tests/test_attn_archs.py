"""The attention-only MoE architectures of 2026 (MiniMax-M2, Llama 4, ERNIE 4.5, Ling 2.0) against llama.cpp's
recordings: logits at F16 and Q4_K_M, greedy tokens, the fixture vocabulary's tokenization; then what
the engine must keep: prefill == one token at a time, streamed == in memory bit for bit; `clutor info`;
files llama.cpp would refuse are refused, naming what is wrong.

Fixtures: tools/make_hf_fixture.py (a tiny HF checkpoint through llama.cpp's convert_hf_to_gguf.py,
then llama.cpp's quantiser); golden files: tools/record_reference.py (tests/fixtures/README.md)."""
from __future__ import annotations

import numpy as np
import pytest

import clutor
from clutor.model.arch import read_arch
from clutor.model.gguf import GGUFFile
from conftest import (ACTIVATIONS, assert_streamed_equals_memory, ATTN_ARCHS, ATTN_TYPES, NEWER_BARS, STEP_TOL, assert_greedy_matches_llama_cpp,
                      assert_logits_match_llama_cpp, assert_prefill_equals_incremental, fixture_path,
                      golden, run)


# -- against llama.cpp -----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ATTN_ARCHS)
@pytest.mark.parametrize("qtype", ATTN_TYPES)
def test_logits_match_llama_cpp(arch, qtype):
    """The issue's bars: F16 within 0.02 with every argmax equal; quantised argmax >= 95% and mean
    |diff| <= 0.5% of the largest logit."""
    assert_logits_match_llama_cpp(arch, qtype, **NEWER_BARS)


@pytest.mark.parametrize("arch", ATTN_ARCHS)
@pytest.mark.parametrize("qtype", ATTN_TYPES)
def test_greedy_matches_llama_cpp(arch, qtype):
    assert_greedy_matches_llama_cpp(arch, qtype)


@pytest.mark.parametrize("arch", ATTN_ARCHS)
def test_tokenizer_matches_llama_cpp_on_the_fixture_vocab(arch):
    """A cut of the qwen35 vocabulary with the architecture's own pre-tokenizer (minimax-m2: the
    gpt-4o split rules), tokenized by llama.cpp."""
    g = golden(arch, "F16")
    tok = clutor.Tokenizer.from_gguf(fixture_path(arch, "F16"))
    offsets, ids = g["tok_offsets"].tolist(), g["tok_ids"].tolist()
    for i, text in enumerate(str(t) for t in g["tok_texts"]):
        assert tok.encode(text) == ids[offsets[i]:offsets[i + 1]], text


# -- the engine ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ATTN_ARCHS)
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_prefill_equals_incremental_decode(arch, activations):
    ids = golden(arch, "Q4_K_M")["prompt_ids"].tolist()[:16]
    assert_prefill_equals_incremental(fixture_path(arch, "Q4_K_M"), ids, 8, activations)


@pytest.mark.parametrize("arch", ATTN_ARCHS)
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_streamed_equals_memory_bit_for_bit(arch, activations):
    """Routed experts stream from disk (threads backend, a cache of one layer's top-k slots, with
    and without prefetch): the same bits as io=memory."""
    assert_streamed_equals_memory(arch, activations, caches=((0, False), (2, True)))


@pytest.mark.parametrize("arch, words", [
    ("minimax-m2", ["layer kinds     3 attention", "heads           4 q / 2 kv, head dim 64",
                    "RoPE neox, 32 of 64 dims", "sigmoid + selection bias, top-k, renormalised",
                    "experts         8, top-2, hidden 64"]),
    ("ernie4_5-moe", ["layers          4 (1 dense first): MoE in 1-3", "layer kinds     4 attention",
                      "RoPE norm, 32 of 32 dims", "softmax + selection bias, top-k, renormalised",
                      "experts         8, top-2, hidden 64, shared expert hidden 64"]),
    ("bailingmoe2", ["layers          3 (1 dense first): MoE in 1-2", "RoPE neox, 16 of 32 dims",
                     "sigmoid + selection bias, top 2 of 4 groups, top-k, renormalised, scaled x2.5",
                     "shared expert hidden 64; 1 MTP layers skipped"]),
    ("llama4", ["layers          4 (2 dense interleaved): MoE in 1, 3", "3 chunked layers keep at most one chunk of KV", "layer kinds     3 chunked, 1 attention", "chunks of 8192 in 3 of 4 layers, no RoPE in 1, q/k norm",
                "RoPE norm, 32 of 32 dims, frequencies / rope_freqs", "shared expert hidden 64",
                "top-k of the logits, sigmoid(logit) x the expert's input"]),
])
def test_info_shows_the_layers(arch, words, capsys):
    from clutor.cli import main

    assert main(["info", str(fixture_path(arch, "Q4_K_M"))]) == 0
    out = capsys.readouterr().out
    for w in words:
        assert w in out, (w, out)
    assert "sliding-window" not in out, out  # none of these has a sliding window (Llama 4's are chunks)


# -- files llama.cpp refuses -----------------------------------------------------------------------
@pytest.mark.parametrize("drop, field, error", [
    # llama.cpp reads the gating function as optional, then aborts building the MoE graph without it
    ("minimax-m2.expert_gating_func", "minimax-m2.expert_gating_func", clutor.ModelFileError),
    # required by llama.cpp's load_hparams (it sizes nothing: the experts are feed_forward_length wide)
    ("minimax-m2.expert_feed_forward_length", "minimax-m2.expert_feed_forward_length", clutor.ModelFileError),
    ("output.weight", "tensor output.weight", clutor.ModelFileError),  # never tied
    ("blk.1.exp_probs_b.bias", "tensor blk.1.exp_probs_b.bias", clutor.ModelFileError),
])
def test_minimax_m2_file_without_what_llama_cpp_requires_is_refused(tmp_path, drop, field, error):
    from gguf_util import copy_gguf

    dst = tmp_path / "cut.gguf"
    copy_gguf(fixture_path("minimax-m2", "Q4_K_M"), dst, drop=frozenset({drop}))
    with pytest.raises(error) as e:
        run(clutor.Model.open(dst).__aenter__())
    assert e.value.field == field and str(dst) in str(e.value), str(e.value)


def test_minimax_m2_gating_other_than_softmax_or_sigmoid_is_refused():
    from clutor.model.arch.common import TableView

    with GGUFFile.open(fixture_path("minimax-m2", "Q4_K_M")) as f:
        meta = {k: v for k, v in f.metadata.items() if k.startswith("minimax-m2.")}
        shapes = {n: f.tensors[n].shape for n in ("token_embd.weight", "output.weight")}
    meta["minimax-m2.expert_gating_func"] = 4  # sqrt(softplus): DeepSeek-V4's, not MiniMax's
    with pytest.raises(clutor.UnsupportedError) as e:
        read_arch(TableView("minimax-m2", meta, shapes, path="g4.gguf"))
    assert e.value.field == "minimax-m2.expert_gating_func" and "sigmoid" in str(e.value)


# -- Llama 4's chunks ------------------------------------------------------------------------------
def test_llama4_chunks_and_temperature_tuning_match_an_independent_reference(monkeypatch):
    """Llama 4's chunk (8192) and temperature floor (8192) are hard-coded in llama.cpp, beyond any
    prompt a test can afford: both shrunk to 32 here, in Clutor and in tools/record_reference.py's
    float64 forward pass (written from llama.cpp's graph, independent of Clutor), so that 86 positions
    cross two chunk edges and three temperature steps. Chunked layers must then see only their chunk's
    keys: with full attention the logits part by far more than the bar (checked below)."""
    import record_reference
    from clutor.model.arch import llama4

    g = golden("llama4", "F16")
    ids = g["prompt_ids"].tolist()
    ref = record_reference.Reference(fixture_path("llama4", "F16"))
    ref.chunk = ref.temp_floor = 32
    want, _ = ref.run(ids)
    monkeypatch.setattr(llama4, "CHUNK", 32)

    async def go(**opts):
        async with clutor.Model.open(fixture_path("llama4", "F16"), kv_type="f32", **opts) as model:
            full = await model.logits(ids)
            seq = model.new_sequence()  # the same positions in steps that straddle the chunk edges
            parts = [await model.forward(seq, ids[a:b], all_logits=True) for a, b in ((0, 20), (20, 50), (50, len(ids)))]
            return full, np.concatenate(parts)

    got, stepped = run(go())
    assert np.abs(got - want).max() <= 0.02 and (got.argmax(-1) == want.argmax(-1)).all(), np.abs(got - want).max()
    np.testing.assert_allclose(stepped, got, rtol=0, atol=STEP_TOL["q8"] * np.abs(got).max())
    plain, _ = record_reference.Reference(fixture_path("llama4", "F16")).run(ids)  # one chunk: all keys
    assert np.abs(plain - want)[40:].max() > 0.1  # the chunks matter at these positions


# -- ERNIE 4.5 and Ling 2.0: what llama.cpp requires ------------------------------------------------
@pytest.mark.parametrize("arch, drop, field", [
    ("ernie4_5-moe", "ernie4_5-moe.interleave_moe_layer_step", "ernie4_5-moe.interleave_moe_layer_step"),
    ("ernie4_5-moe", "ernie4_5-moe.expert_feed_forward_length", "ernie4_5-moe.expert_feed_forward_length"),
    ("ernie4_5-moe", "blk.1.ffn_gate_exps.weight", "tensor blk.1.ffn_gate_exps.weight"),
    ("ernie4_5-moe", "blk.0.ffn_up.weight", "tensor blk.0.ffn_up.weight"),  # the leading dense layer's
    ("bailingmoe2", "bailingmoe2.expert_gating_func", "bailingmoe2.expert_gating_func"),
    ("bailingmoe2", "bailingmoe2.expert_shared_count", "bailingmoe2.expert_shared_count"),
    ("bailingmoe2", "output.weight", "tensor output.weight"),  # never tied
    ("bailingmoe2", "blk.2.attn_k_norm.weight", "tensor blk.2.attn_k_norm.weight"),
    ("bailingmoe2", "blk.1.ffn_up_shexp.weight", "tensor blk.1.ffn_up_shexp.weight"),
])
def test_file_without_what_llama_cpp_requires_is_refused(tmp_path, arch, drop, field):
    from gguf_util import copy_gguf

    dst = tmp_path / "cut.gguf"
    copy_gguf(fixture_path(arch, "Q4_K_M"), dst, drop=frozenset({drop}))
    with pytest.raises(clutor.ModelFileError) as e:
        run(clutor.Model.open(dst).__aenter__())
    assert e.value.field == field and str(dst) in str(e.value), str(e.value)


def _table(arch, **changes):
    from clutor.model.arch.common import TableView

    with GGUFFile.open(fixture_path(arch, "Q4_K_M")) as f:
        meta = {k: v for k, v in f.metadata.items() if k.startswith(arch + ".")}
        shapes = {n: f.tensors[n].shape for n in ("token_embd.weight", "output.weight") if n in f.tensors}
    for k, v in changes.items():
        if v is None:
            meta.pop(f"{arch}.{k}")
        else:
            meta[f"{arch}.{k}"] = v
    return TableView(arch, meta, shapes, path="t.gguf")


def test_ernie_moe_step_that_leaves_dense_layers_among_the_experts_is_refused():
    """llama.cpp loads expert tensors in every layer from leading_dense_block_count on and runs them
    only where (i + 1) % step == 0: a step of 2 would leave layer 2 with no FFN it can build."""
    with pytest.raises(clutor.UnsupportedError) as e:
        read_arch(_table("ernie4_5-moe", interleave_moe_layer_step=2))
    assert e.value.field == "ernie4_5-moe.interleave_moe_layer_step"
    arch = read_arch(_table("ernie4_5-moe", leading_dense_block_count=None))  # absent: 0, every layer MoE
    assert arch.cfg.moe_layers == (0, 1, 2, 3) and arch.cfg.n_ff == 0


def test_ernie_shared_expert_follows_its_own_length_key():
    """llama.cpp builds the shared expert from expert_shared_feed_forward_length alone (expert_shared_count
    sizes nothing): absent or 0, no shared expert."""
    assert read_arch(_table("ernie4_5-moe")).cfg.n_ff_shexp == 64
    assert read_arch(_table("ernie4_5-moe", expert_shared_count=4)).cfg.n_ff_shexp == 64
    arch = read_arch(_table("ernie4_5-moe", expert_shared_feed_forward_length=None))
    assert arch.cfg.n_ff_shexp == 0 and "sh_gate" not in arch.layer_tensors(1)


def test_bailing_shared_expert_size_rule():
    """llama.cpp: (expert_shared_feed_forward_length, or the expert size where it is 0) x expert_shared_count."""
    assert read_arch(_table("bailingmoe2")).cfg.n_ff_shexp == 64
    assert read_arch(_table("bailingmoe2", expert_shared_count=2)).cfg.n_ff_shexp == 128
    assert read_arch(_table("bailingmoe2", expert_shared_feed_forward_length=None, expert_shared_count=3)).cfg.n_ff_shexp == 192
    assert read_arch(_table("bailingmoe2", expert_shared_feed_forward_length=48, expert_shared_count=2)).cfg.n_ff_shexp == 96


def test_bailing_mtp_layers_are_in_the_table_but_not_computed():
    """The fixture carries one MTP layer (block_count 4, nextn_predict_layers 1), as the converter writes
    Ling 2.0's: 3 layers run; the MTP layer's tensors are listed as unread, and each one is in the file."""
    with GGUFFile.open(fixture_path("bailingmoe2", "F16")) as f:
        arch = read_arch(f)
        assert f.metadata["bailingmoe2.block_count"] == 4 and arch.cfg.n_layers == 3 and arch.n_nextn == 1
        unread = arch.unread_tensors()
        assert {t.name for t in unread if t.required} <= set(f.tensors)
        assert {n for n in f.tensors if n.startswith("blk.3.")} == {t.name for t in unread}
        table = {t.name for t in arch.file_tensors()}
        assert set(f.tensors) == table  # the converter's tensors, no more, no fewer


def test_bailing_gating_other_than_softmax_or_sigmoid_is_refused():
    with pytest.raises(clutor.UnsupportedError) as e:
        read_arch(_table("bailingmoe2", expert_gating_func=4))
    assert e.value.field == "bailingmoe2.expert_gating_func"


def test_bailing_heads_must_fill_the_fused_qkv_q_part():
    with pytest.raises(clutor.ModelFileError) as e:
        read_arch(_table("bailingmoe2", **{"attention.key_length": 64, "attention.value_length": 64}))
    assert e.value.field == "bailingmoe2.attention.key_length"
