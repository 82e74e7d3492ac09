"""Mixtral, GLM-4.5, DeepSeek (MLA) and gpt-oss fixtures: prefill against incremental decode, streamed
against in-memory bit for bit, each architecture's KV layout. (Their logits and greedy tokens against
llama.cpp's recordings run with the others' in tests/test_model.py.)"""
from __future__ import annotations

import numpy as np
import pytest

import clutor
from clutor.model.arch import read_arch
from clutor.model.gguf import GGUFFile
from clutor.model.weights import _squeezed, expert_layout
from clutor.model.options import slot_bytes
from conftest import (ACTIVATIONS, assert_streamed_equals_memory, FIXTURES, NEW_ARCHS, assert_prefill_equals_incremental, fixture_path,
                      golden, greedy_and_cached, run)


@pytest.mark.parametrize("arch", NEW_ARCHS)
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_prefill_equals_incremental_decode(arch, activations):
    ids = golden(arch, "Q8_0")["prompt_ids"].tolist()[:16]
    assert_prefill_equals_incremental(fixture_path(arch, "Q8_0"), ids, 8, activations)


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("io", ["threads", "uring"])
@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_streamed_equals_memory_bit_for_bit(arch, io, activations):
    """Bit for bit in every activation mode: io="memory" runs a step in one compute call, the read
    backends layer by layer as experts arrive, and the products must not care."""
    assert_streamed_equals_memory(arch, activations, io=io, caches=((0, False), (2, True)))


def test_kv_cache_follows_the_architecture():
    """MLA caches the latent (kv_lora + rope floats per layer and position), the engine counts that;
    gpt-oss's sliding-window layers are a page group of their own, which gives back what falls behind."""
    from clutor.model.kv import PAGE

    async def go(arch, n=3):
        async with clutor.Model.open(fixture_path(arch, "Q8_0"), kv_type="f32") as model:
            seq = model.new_sequence()
            await model.forward(seq, list(range(1, n + 1)))
            await model.forward(seq, [1])
            model.kv.trim_window(seq)
            groups = [(g.window, len(g.layers), g.data.shape, [p >= 0 for p in seq.tables[i]])
                      for i, g in enumerate(model.kv.groups)]
            return model.config, model.kv.page_bytes, model.engine.bytes_per_token, sorted(groups)
    cfg, page_bytes, per_token, groups = run(go("deepseek2"))
    assert cfg.kv_floats == 64 + 16 and per_token == cfg.n_layers * (64 + 16) * 4
    assert len(groups) == 1 and groups[0][2][2:] == (1, PAGE, 64 + 16) and page_bytes == per_token * PAGE
    cfg, page_bytes, per_token, _ = run(go("glm4moe"))
    assert per_token == cfg.n_layers * cfg.n_head_kv * (cfg.head_dim + cfg.head_dim_v) * 4 == page_bytes // PAGE
    cfg, page_bytes, per_token, groups = run(go("gptoss", 3 * PAGE + 8))
    (_, n_full, _, full), (window, n_window, _, slid) = groups
    assert window == 8 and n_full + n_window == cfg.n_layers
    # 3 pages + 9 positions: the full layers hold all 4 pages; the window layers only the last, which
    # holds every key the next position sees (the 8 before it)
    assert full == [True] * 4 and slid == [False, False, False, True]


@pytest.mark.parametrize("arch, words", [
    ("mixtral", ["RoPE norm", "softmax, top-k, renormalised"]),
    ("glm4moe", ["1 dense first", "sigmoid + selection bias", "1 MTP layers skipped", "16 of 32 dims"]),
    ("deepseek2", ["MLA: latent 64 + rope 16", "top 2 of 4 groups", "YaRN x4", "1 dense first"]),
    ("deepseek2-lite", ["attn_kv_b", "q direct", "softmax", "gate+up fused in one tensor"]),
    ("gptoss", ["GQA with sinks", "sliding window 8 on 1 of 2 layers", "YaRN x4", "softmax over the chosen"]),
])
def test_info_shows_the_arch_specifics(arch, words, capsys):
    from clutor.cli import main

    assert main(["info", str(fixture_path(arch, "Q8_0"))]) == 0
    out = capsys.readouterr().out
    for w in words:
        assert w in out, (w, out)


def test_old_per_expert_mixtral_layout_is_refused(tmp_path):
    """One tensor per expert (blk.N.ffn_gate.E.weight) is the layout llama.cpp no longer loads."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "old.gguf"), "llama")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(32); w.add_head_count(2)
    w.add_expert_count(2); w.add_expert_used_count(1); w.add_layer_norm_rms_eps(1e-5); w.add_feed_forward_length(32)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    for e in range(2):
        for part in ("gate", "up", "down"):
            w.add_tensor(f"blk.0.ffn_{part}.{e}.weight", np.zeros((32, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with GGUFFile.open(tmp_path / "old.gguf") as f:
        with pytest.raises(clutor.ModelFileError, match="one tensor per expert"):
            read_arch(f)


def _tiny_file(path, arch: str, keys: dict, tensors: dict) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for k, v in keys.items():
        if isinstance(v, bool):
            w.add_bool(f"{arch}.{k}", v)
        elif isinstance(v, int):
            w.add_uint32(f"{arch}.{k}", v)
        elif isinstance(v, float):
            w.add_float32(f"{arch}.{k}", v)
        else:
            w.add_string(f"{arch}.{k}", v)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


_BASE = {"block_count": 2, "context_length": 64, "embedding_length": 32, "attention.head_count": 2,
         "attention.layer_norm_rms_epsilon": 1e-5, "feed_forward_length": 32}


def test_gptoss_rope_dimension_count_defaults_to_the_head_size(tmp_path):
    """llama.cpp reads rope.dimension_count for every architecture with the key's head size
    (attention.key_length, itself defaulting to n_embd / n_head) as its default: a gpt-oss file
    without the key opens and computes exactly what the file with it computes."""
    from gguf_util import copy_gguf

    src, dst = fixture_path("gptoss", "Q8_0"), tmp_path / "no-rope-dims.gguf"
    copy_gguf(src, dst, drop=frozenset({"gpt-oss.rope.dimension_count"}))
    with GGUFFile.open(src) as f:
        want = read_arch(f).cfg
    with GGUFFile.open(dst) as f:
        assert "gpt-oss.rope.dimension_count" not in f.metadata
        cfg = read_arch(f).cfg
    assert cfg == want and cfg.n_rot == cfg.head_dim

    async def logits(path):
        async with clutor.Model.open(path) as model:
            return await model.logits(golden("gptoss", "Q8_0")["prompt_ids"].tolist()[:12])

    np.testing.assert_array_equal(run(logits(dst)), run(logits(src)))


@pytest.mark.parametrize("fixture", ["deepseek2", "deepseek2-lite"])
def test_deepseek2_rope_dimension_count_absent_is_refused_naming_it(tmp_path, fixture):
    """llama.cpp's default for rope.dimension_count is attention.key_length for deepseek2 too: in a
    converter's file (the MQA form, key_length = kv_lora + rope = 80 here; the older form, key_length =
    the head's 48) that leaves no non-RoPE part of the head, and llama.cpp stops at its assertion
    n_embd_head_qk_nope >= 1 (checked with llama-cpp-python 0.3.36 on these files without the key).
    Clutor takes the same default and refuses the file, naming the key and the default's value."""
    from gguf_util import copy_gguf

    src, dst = fixture_path(fixture, "Q8_0"), tmp_path / "no-rope-dims.gguf"
    copy_gguf(src, dst, drop=frozenset({"deepseek2.rope.dimension_count"}))
    with GGUFFile.open(src) as f:
        k_len = f.metadata["deepseek2.attention.key_length"]
        assert read_arch(f).cfg.n_rot == f.metadata["deepseek2.rope.dimension_count"] < k_len
    with GGUFFile.open(dst) as f, pytest.raises(clutor.ModelFileError) as e:
        assert "deepseek2.rope.dimension_count" not in f.metadata
        read_arch(f)
    assert e.value.field == "deepseek2.rope.dimension_count" and str(dst) in str(e.value)
    assert f"attention.key_length = {k_len}" in str(e.value), str(e.value)


_DS2 = {"expert_count": 8, "expert_used_count": 2, "attention.kv_lora_rank": 16, "rope.dimension_count": 8,
        "attention.key_length": 24, "attention.value_length": 16, "expert_feed_forward_length": 32,
        "expert_shared_count": 1}


@pytest.mark.parametrize("layers, vocab, lite", [(27, 102400, True), (26, 128256, True), (48, 128256, True),
                                                 (48, 154880, False), (3, 128256, False)])
def test_deepseek2_q_lora_rank_defaults_as_in_llama_cpp(tmp_path, layers, vocab, lite):
    """llama.cpp lets the "lite" deepseek2 models (26 or 27 layers, DeepSeek-V2-Lite and GigaChat3-10B;
    48 layers with a 128256-token vocabulary, Kanana-2-30B-A3B) omit attention.q_lora_rank (q straight
    from the hidden state); any other file without it is refused, naming the key."""
    path = tmp_path / "ds2.gguf"
    _tiny_file(path, "deepseek2", _BASE | _DS2 | {"block_count": layers, "vocab_size": vocab},
               {"token_embd.weight": np.zeros((8, 32), np.float32)})
    with GGUFFile.open(path) as f:
        if lite:
            assert read_arch(f).q_lora == 0
        else:
            with pytest.raises(clutor.ModelFileError) as e:
                read_arch(f)
            assert e.value.field == "deepseek2.attention.q_lora_rank"


@pytest.mark.parametrize("layers, vocab, keys, func", [
    (47, 154880, {}, "sigmoid"), (48, 154880, {"expert_gating_func": 0}, "sigmoid"),  # GLM-4.7-Lite's files
    (48, 128256, {}, "softmax"), (3, 154880, {}, "softmax"),                           # DeepSeek-V2 / V2.5's
    (47, 154880, {"expert_gating_func": 1}, "softmax")])                               # the key decides
def test_deepseek2_gating_func_defaults_as_in_llama_cpp(tmp_path, layers, vocab, keys, func):
    """Without expert_gating_func (or with 0, none) llama.cpp routes with a softmax, as DeepSeek-V2 and
    V2.5's files need, except in GLM-4.7-Lite's (47 or 48 layers, 154880 tokens), which use a sigmoid."""
    path = tmp_path / "ds2.gguf"
    _tiny_file(path, "deepseek2", _BASE | _DS2 | {"block_count": layers, "vocab_size": vocab,
                                                  "attention.q_lora_rank": 16} | keys,
               {"token_embd.weight": np.zeros((8, 32), np.float32)})
    with GGUFFile.open(path) as f:
        assert read_arch(f).func == func


def test_qwen2moe_expert_sizes_default_as_in_llama_cpp(tmp_path):
    """llama.cpp's defaults for Qwen2-MoE (and Qwen3-MoE): expert_feed_forward_length =
    feed_forward_length / expert_used_count, expert_shared_feed_forward_length = feed_forward_length
    (the fixture's keys equal those defaults, as in Qwen1.5-MoE-A2.7B: 5632 / 4 = 1408)."""
    from gguf_util import copy_gguf

    src = fixture_path("qwen2moe", "Q8_0")
    with GGUFFile.open(src) as f:
        want = read_arch(f).cfg
    for drop in ("qwen2moe.expert_feed_forward_length", "qwen2moe.expert_shared_feed_forward_length"):
        dst = tmp_path / f"{drop}.gguf"
        copy_gguf(src, dst, drop=frozenset({drop}))
        with GGUFFile.open(dst) as f:
            assert drop not in f.metadata
            assert read_arch(f).cfg == want, drop
    dst = tmp_path / "neither.gguf"  # no size at all: the error names the expert size's key
    copy_gguf(src, dst, drop=frozenset({"qwen2moe.expert_feed_forward_length", "qwen2moe.feed_forward_length"}))
    with GGUFFile.open(dst) as f, pytest.raises(clutor.ModelFileError) as e:
        read_arch(f)
    assert e.value.field == "qwen2moe.expert_feed_forward_length"


@pytest.mark.parametrize("key", ["attention.head_count", "attention.head_count_kv", "expert_used_count"])
def test_per_layer_arrays_read_as_llama_cpp_reads_them(tmp_path, key):
    """llama.cpp reads head_count, head_count_kv, feed_forward_length and expert_used_count as one
    number or an array of one per layer (block_count of them). The same value in every layer opens as
    the number does; values that differ, or an array of another length, are an error naming the file
    and the key."""
    from gguf_util import copy_gguf

    src = fixture_path("olmoe", "Q8_0")
    full = f"olmoe.{key}"
    with GGUFFile.open(src) as f:
        want, n, v = read_arch(f).cfg, f.metadata["olmoe.block_count"], f.metadata[full]
    same = tmp_path / "same.gguf"
    copy_gguf(src, same, as_arrays={full: [v] * n})
    with GGUFFile.open(same) as f:
        assert isinstance(f.metadata[full], list)
        assert read_arch(f).cfg == want
    for name, arr, what in (("differ", [v] * (n - 1) + [max(1, v // 2)], "the same value in every layer"),
                            ("short", [v] * (n + 1), f"{n} (block_count)")):
        bad = tmp_path / f"{name}.gguf"
        copy_gguf(src, bad, as_arrays={full: arr})
        with GGUFFile.open(bad) as f, pytest.raises(clutor.ClutorError) as e:
            read_arch(f)
        assert e.value.field == full and what in str(e.value) and str(bad) in str(e.value), str(e.value)


@pytest.mark.parametrize("arch, keys, field", [
    ("llama", {}, "llama.expert_count"),                                     # a dense llama: nothing to stream
    ("deepseek2", {"expert_count": 6, "expert_used_count": 2, "expert_group_count": 4,
                   "attention.q_lora_rank": 0, "attention.kv_lora_rank": 16, "rope.dimension_count": 8,
                   "attention.key_length": 24, "attention.value_length": 16, "expert_feed_forward_length": 32,
                   "expert_shared_count": 1}, "deepseek2.expert_group_count"),  # groups must divide the experts
    ("glm4moe", {"rope.dimension_sections": 4}, "glm4moe.rope.dimension_sections"),  # M-RoPE
    ("llama", {"expert_count": 2, "expert_used_count": 1, "rope.scaling.type": "linear"},
     "llama.rope.scaling.type"),
])
def test_bad_arch_metadata_is_a_clear_error(tmp_path, arch, keys, field):
    path = tmp_path / "bad.gguf"
    _tiny_file(path, arch, _BASE | keys, {"token_embd.weight": np.zeros((8, 32), np.float32)})
    with GGUFFile.open(path) as f:
        with pytest.raises(clutor.ModelFileError) as e:
            read_arch(f)
    assert e.value.field == field and str(path) in str(e.value)


def test_gptoss_expert_biases_travel_with_the_expert():
    """gpt-oss's per-expert biases are slabs of the expert (read by the store with its weights), not
    resident dense weights: the slot holds all six, and the logits match llama.cpp (above)."""
    path = fixture_path("gptoss", "Q8_0")
    with GGUFFile.open(path) as f:
        cfg = read_arch(f).cfg
        layout = expert_layout(f, read_arch(f))
        bias_bytes = sum(f.tensors[f"blk.0.ffn_{p}_exps.bias"].nbytes for p in ("gate", "up", "down")) // cfg.n_expert
        weight_bytes = sum(f.tensors[f"blk.0.ffn_{p}_exps.weight"].nbytes for p in ("gate", "up", "down")) // cfg.n_expert
    assert layout.n_parts == 6 and layout.expert_bytes(0) == weight_bytes + bias_bytes

    async def go():
        async with clutor.Model.open(path, io="threads", expert_cache=f"{3 * slot_bytes(layout)}") as model:
            lw = model._w.layers[0]
            batch = await model._experts.get(0, [1])
            try:
                v = batch[0]
                return lw.gate_b, [b.view(np.float32).copy() for b in v.biases]
            finally:
                batch.release()

    resident, biases = run(go())
    assert resident is None
    import gguf
    want = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors if t.name.startswith("blk.0.ffn_")}
    for got, p in zip(biases, ("gate", "up", "down")):
        np.testing.assert_array_equal(got, want[f"blk.0.ffn_{p}_exps.bias"][1])


@pytest.mark.parametrize("arch", ["deepseek2", "gptoss"])
def test_prefix_reuse_with_the_arch_kv_layout(arch):
    """A second prompt that starts like a finished one reuses its KV (MLA's latent cache, gpt-oss's
    sliding-window layers) and generates what a fresh model does."""
    ids = golden(arch, "Q8_0")["prompt_ids"].tolist()
    first, second = ids[:30], ids[:30] + ids[40:50]

    async def go():
        async with clutor.Model.open(fixture_path(arch, "Q8_0")) as model:
            await greedy_and_cached(model, first)
            reused = await greedy_and_cached(model, second)
        async with clutor.Model.open(fixture_path(arch, "Q8_0")) as model:
            fresh = await greedy_and_cached(model, second)
        return reused, fresh

    (tokens, cached), (want, cached_fresh) = run(go())
    assert cached >= 29 and cached_fresh == 0
    assert tokens == want


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.gguf")), ids=lambda p: p.stem)
def test_each_file_holds_exactly_its_architectures_table(path):
    """The architecture's tensor table is the one statement of its tensors: every tensor of a file
    (llama.cpp's converter or quantiser wrote it) is in the table with its shape, every required
    entry is in the file, and the expert layout names every routed-expert tensor of the file."""
    with GGUFFile.open(path) as f:
        arch = read_arch(f)
        table = {t.name: t for t in arch.file_tensors()}
        assert len(table) == len(arch.file_tensors())  # no name stated twice
        assert sorted(set(f.tensors) - set(table)) == []
        assert sorted(n for n, t in table.items() if t.required and n not in f.tensors) == []
        # (the loader's rule: leading 1s squeezed, as llama.cpp's converter writes some vectors as [1, D])
        assert [n for n in f.tensors if _squeezed(f.tensors[n].shape, len(table[n].shape)) != table[n].shape] == []
        experts = {n for n, t in table.items() if t.kind == "expert" and n in f.tensors}
        # (Gemma 4's ffn_down_exps.scale is one number per expert, kept resident)
        assert experts and experts == {n for n in f.tensors if "_exps." in n and not n.endswith(".scale")}
