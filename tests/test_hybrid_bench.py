"""tools/make_hybrid_bench.py writes what llama.cpp's converter writes: for each preset, the same
metadata keys, the same tensors of the same float types and ranks as the converter-made
fixture of that architecture (the benchmark files are too big to write here: their tables are checked)."""
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import make_hybrid_bench as mhb  # noqa: E402

# keys the converter writes that the benchmark files leave out: the GGUF header's own, and the size
# label (the converter's count of the toy model's parameters)
HEADER = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.size_label"}


@pytest.mark.parametrize("model, fixture, n_layers", [("gemma-4-26b-a4b", mhb.GEMMA_TEMPLATE, 6),
                                                     ("qwen3.6-35b-a3b", mhb.QWEN_TEMPLATE, 4)])
def test_preset_matches_converter_fixture(model, fixture, n_layers):
    preset, r = mhb.PRESETS[model], GGUFReader(str(fixture))
    assert r.fields["general.architecture"].contents() == preset.arch
    assert {k for k, *_ in preset.metadata(n_layers)} == set(r.fields) - HEADER
    want = sorted((t.name, t.tensor_type.name, len(t.shape)) for t in r.tensors)
    got = sorted((p.name, p.qtype.name, len(p.shape)) for p in preset.plans(n_layers))
    assert got == want


def test_gemma_preset_shapes():
    """The 26B's shapes: window layers 8 kv heads of 256, global layers 2 of 512 with no attn_v, 128
    experts of 704 with fused gate+up, vocabulary 262144; a quarter of rope_freqs rotates."""
    plans = {p.name: p for p in mhb.gemma_plans(12)}
    assert plans["token_embd.weight"].shape == (262144, 2816)
    assert plans["blk.0.attn_k.weight"].shape == (8 * 256, 2816) and "blk.0.attn_v.weight" in plans
    assert plans["blk.5.attn_k.weight"].shape == (2 * 512, 2816) and "blk.5.attn_v.weight" not in plans
    assert plans["blk.11.attn_q.weight"].shape == (16 * 512, 2816) and "blk.11.attn_v.weight" not in plans
    assert plans["blk.3.ffn_gate_up_exps.weight"].shape == (128, 1408, 2816)
    assert plans["blk.3.ffn_down_exps.weight"].shape == (128, 2816, 704)
    meta = {k: v for k, v, *_ in mhb.gemma_metadata(12)}
    assert meta["gemma4.attention.sliding_window_pattern"] == [True] * 5 + [False] + [True] * 5 + [False]
    assert meta["gemma4.attention.head_count_kv"] == [8] * 5 + [2] + [8] * 5 + [2]
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.scores"]) == 262144
    f = mhb.gemma_special(plans["rope_freqs.weight"], None)
    assert (f == 1.0).sum() == 64 and (f == 1e30).sum() == 192
