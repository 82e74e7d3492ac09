"""The random-weight GGUF generators (tools/synth.py on clutor/cli/demo_model.py): determinism, llama.cpp's
layout, random quant blocks with the intended spread, the trained tokenizer, the demo-model cache."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

from clutor.errors import UnsupportedError
from conftest import run, tiny_demo_spec
import synth
from clutor.cli import demo_model

TINY = ("tiny-olmoe", "tiny-qwen2moe", "tiny-qwen3moe")


def _field(reader: GGUFReader, key: str):
    f = reader.fields[key]
    if f.types[0].name == "STRING":
        return bytes(f.parts[-1]).decode()
    if f.types[0].name == "ARRAY":
        if f.types[1].name == "STRING":
            return [bytes(f.parts[i]).decode() for i in f.data]
        return [f.parts[i][0].item() for i in f.data]
    return f.parts[f.data[0]][0].item()


def _tensors(reader: GGUFReader) -> dict:
    # numpy order: GGUF's ne reversed
    return {t.name: (tuple(int(n) for n in t.shape[::-1]), t.tensor_type) for t in reader.tensors}


# -- determinism ---------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_K"])
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, qtype):
    a = synth.write_model(tmp_path / "a.gguf", "tiny-olmoe", seed=7, qtype=qtype).read_bytes()
    b = synth.write_model(tmp_path / "b.gguf", "tiny-olmoe", seed=7, qtype=qtype).read_bytes()
    c = synth.write_model(tmp_path / "c.gguf", "tiny-olmoe", seed=8, qtype=qtype).read_bytes()
    assert a == b
    assert len(a) == len(c) == synth.expected_size(synth.PRESETS["tiny-olmoe"], 7, qtype)
    assert a != c
    # every tensor differs between seeds, not just the header
    ra, rc = GGUFReader(tmp_path / "a.gguf"), GGUFReader(tmp_path / "c.gguf")
    for ta, tc in zip(ra.tensors, rc.tensors):
        assert not np.array_equal(ta.data, tc.data), ta.name


# -- layout llama.cpp expects ---------------------------------------------------------------------


def _expected(spec: synth.ModelSpec) -> dict[str, tuple[int, ...]]:
    D, V, E, F, Q, KV = spec.n_embd, spec.vocab_size, spec.n_expert, spec.n_ff_exp, spec.n_q, spec.n_kv
    want = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if not spec.tied_output:
        want["output.weight"] = (V, D)
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        want |= {
            b + "attn_norm.weight": (D,), b + "attn_q.weight": (Q, D), b + "attn_k.weight": (KV, D),
            b + "attn_v.weight": (KV, D), b + "attn_output.weight": (D, Q), b + "ffn_norm.weight": (D,),
            b + "ffn_gate_inp.weight": (E, D), b + "ffn_gate_exps.weight": (E, F, D),
            b + "ffn_up_exps.weight": (E, F, D), b + "ffn_down_exps.weight": (E, D, F),
        }
        if spec.arch == "olmoe":
            want |= {b + "attn_q_norm.weight": (Q,), b + "attn_k_norm.weight": (KV,)}
        if spec.arch == "qwen3moe":
            want |= {b + "attn_q_norm.weight": (spec.head_dim,), b + "attn_k_norm.weight": (spec.head_dim,)}
        if spec.arch == "qwen2moe":
            S = spec.n_ff_shexp
            want |= {
                b + "attn_q.bias": (Q,), b + "attn_k.bias": (KV,), b + "attn_v.bias": (KV,),
                b + "ffn_gate_inp_shexp.weight": (D,), b + "ffn_gate_shexp.weight": (S, D),
                b + "ffn_up_shexp.weight": (S, D), b + "ffn_down_shexp.weight": (D, S),
            }
    return want


@pytest.mark.parametrize("preset", TINY)
def test_tensor_names_shapes_types(tmp_path, preset):
    spec = synth.PRESETS[preset]
    path = synth.write_model(tmp_path / "m.gguf", preset, seed=0, qtype="Q8_0")
    r = GGUFReader(path)
    got = _tensors(r)
    want = _expected(spec)
    assert {k: v[0] for k, v in got.items()} == want
    for name, (shape, qt) in got.items():
        always_f32 = len(shape) == 1 or name.endswith("ffn_gate_inp.weight")
        assert qt == (GGMLQuantizationType.F32 if always_f32 else GGMLQuantizationType.Q8_0), name
    # the file's data offsets follow general.alignment
    assert _field(r, "general.alignment") == 32
    assert r.data_offset % 32 == 0
    assert all(t.data_offset % 32 == 0 for t in r.tensors)


@pytest.mark.parametrize("preset", TINY)
def test_metadata(tmp_path, preset):
    spec = synth.PRESETS[preset]
    r = GGUFReader(synth.write_model(tmp_path / "m.gguf", preset, seed=0, qtype="F16"))
    a = spec.arch
    assert _field(r, "general.architecture") == a
    assert _field(r, f"{a}.block_count") == spec.n_layer
    assert _field(r, f"{a}.embedding_length") == spec.n_embd
    assert _field(r, f"{a}.context_length") == spec.n_ctx
    assert _field(r, f"{a}.attention.head_count") == spec.n_head
    assert _field(r, f"{a}.attention.head_count_kv") == spec.n_head_kv
    assert _field(r, f"{a}.expert_count") == spec.n_expert
    assert _field(r, f"{a}.expert_used_count") == spec.n_expert_used
    assert _field(r, f"{a}.attention.layer_norm_rms_epsilon") == pytest.approx(spec.eps)
    assert _field(r, f"{a}.rope.freq_base") == pytest.approx(spec.rope_base)
    if a == "olmoe":
        assert _field(r, f"{a}.feed_forward_length") == spec.n_ff_exp
        assert f"{a}.attention.key_length" not in r.fields  # default n_embd / n_head applies
    else:
        assert _field(r, f"{a}.expert_feed_forward_length") == spec.n_ff_exp
    if a == "qwen2moe":
        assert _field(r, f"{a}.expert_shared_feed_forward_length") == spec.n_ff_shexp
    if a == "qwen3moe":
        assert _field(r, f"{a}.attention.key_length") == spec.head_dim == 128
        assert _field(r, f"{a}.attention.value_length") == spec.head_dim
        assert spec.head_dim != spec.n_embd // spec.n_head
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert len(tokens) == spec.vocab_size
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.pre") == ("olmo" if a == "olmoe" else "qwen2")
    assert tokens[_field(r, "tokenizer.ggml.eos_token_id")] == "<|endoftext|>"
    assert tokens[_field(r, "tokenizer.ggml.bos_token_id")] == "<|endoftext|>"
    assert _field(r, "tokenizer.ggml.add_bos_token") is False
    template = _field(r, "tokenizer.chat_template")
    assert ("<|im_start|>" in template) == (a != "olmoe")


def test_unsupported_qtype_is_a_clutor_error(tmp_path):
    with pytest.raises(UnsupportedError, match="qtype"):
        synth.write_model(tmp_path / "m.gguf", "tiny-olmoe", seed=0, qtype="Q3_K")
    bad = dataclasses.replace(synth.PRESETS["tiny-olmoe"], n_ff_exp=96)  # 96 is not a multiple of 256
    with pytest.raises(UnsupportedError, match="ffn_down_exps"):
        synth.write_model(tmp_path / "m.gguf", bad, seed=0, qtype="Q4_K")


# -- random quant blocks --------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_random_blocks_dequantise_to_the_intended_spread(tmp_path, qtype):
    spec = synth.PRESETS["tiny-olmoe"]
    plans = {p.name: p for p in synth.plan_tensors(spec, qtype)}
    r = GGUFReader(synth.write_model(tmp_path / "m.gguf", spec, seed=3, qtype=qtype))
    for t in r.tensors:
        p = plans[t.name]
        if p.init != "normal" or t.tensor_type == GGMLQuantizationType.F32:
            continue
        x = dequantize(t.data, t.tensor_type).astype(np.float64)
        if p.quiet:  # output rows of control tokens and stray bytes are damped
            quiet = demo_model.quiet_tokens(p.shape[0])
            assert x[quiet].std() == pytest.approx(demo_model.QUIET_ROW_GAIN * p.std, rel=0.1), t.name
            x = x[~quiet]
        assert x.std() == pytest.approx(p.std, rel=0.05), t.name
        assert abs(x.mean()) < 0.02 * p.std, t.name
        # no sub-block (32 values) is offset from zero: scales and mins are packed consistently
        sub = x.reshape(-1, 32).mean(axis=1)
        assert np.abs(sub).max() < 1.0 * p.std, t.name
        # near-Gaussian: about 4.6% of N(0, 1) lies beyond 2 sigma
        tail = np.mean(np.abs(x) > 2 * p.std)
        assert 0.02 < tail < 0.07, (t.name, tail)


def test_q4_k_scale_packing_matches_ggml():
    rng = np.random.default_rng(0)
    sc = rng.integers(0, 64, size=(3, 8), dtype=np.uint8)
    m = rng.integers(0, 64, size=(3, 8), dtype=np.uint8)
    q = rng.integers(0, 16, size=(3, 256), dtype=np.uint8)  # element order within each block
    d, dmin = np.float16(0.01), np.float16(0.02)
    blocks = np.zeros((3, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full(3, d).view(np.uint8).reshape(3, 2)
    blocks[:, 2:4] = np.full(3, dmin).view(np.uint8).reshape(3, 2)
    blocks[:, 4:16] = synth._pack_k4_scales(sc, m)
    # ggml's nibble order: byte j of each 32-byte group holds element j (low) and j + 32 (high)
    for g in range(4):
        lo, hi = q[:, 64 * g : 64 * g + 32], q[:, 64 * g + 32 : 64 * g + 64]
        blocks[:, 16 + 32 * g : 48 + 32 * g] = lo | (hi << 4)
    got = dequantize(blocks, GGMLQuantizationType.Q4_K).reshape(3, 256)
    sub = np.repeat(np.arange(8), 32)
    want = float(d) * sc[:, sub] * q - float(dmin) * m[:, sub]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# -- tokenizer ------------------------------------------------------------------------------------


def test_tokenizer_training_is_deterministic_and_exact_size():
    a_learned, a_merges = demo_model.train_bpe.__wrapped__(500)
    b_learned, b_merges = demo_model.train_bpe.__wrapped__(500)
    assert a_learned == b_learned and a_merges == b_merges
    for size in (512, 4096, 50304):
        tokens, types, merges = demo_model.train_tokenizer(size)
        assert len(tokens) == len(types) == size
        assert len(set(tokens)) == size
        assert tokens[:256] == demo_model.byte_chars()
        end = tokens.index("<|endoftext|>")
        assert tokens[end : end + 3] == list(demo_model.SPECIAL_TOKENS)
        assert set(types[:end]) == {1} and set(types[end:]) == {3}
        assert len(merges) == end - 256
        assert all(t.startswith("<|unused_") for t in tokens[end + 3 :])
        known = set(tokens[:end])
        for rank, merge in enumerate(merges):
            left, right = merge.split(" ")
            assert left in known and right in known and tokens[256 + rank] == left + right


def test_tokenizer_round_trips_text():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, _, merges = demo_model.train_tokenizer(512)
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    for text in ["The miller walked along the river in 1961.", "def f(x):\n    return x ** 2  # ok\n",
                 "  spaces\tand\ttabs  ", "naïve café 東京 🙂"]:
        ids = bpe.encode(text).ids
        assert bpe.decode(ids) == text
        if text.isascii():
            assert len(ids) < len(text.encode())  # the learned merges are used
    end = tokens.index("<|endoftext|>")
    assert max(bpe.encode("The river and the mill").ids) < end


# -- demo model cache -----------------------------------------------------------------------------


def test_ensure_demo_model_writes_once_and_reuses(tmp_path):
    spec = tiny_demo_spec("demo-test")
    path = demo_model.ensure_demo_model(tmp_path, spec=spec, seed=0)
    assert path.parent == tmp_path and path.exists()
    assert path.stat().st_size == demo_model.demo_size(spec, 0)
    r = GGUFReader(path)
    assert _field(r, "clutor.synth.fingerprint") == demo_model.demo_fingerprint(spec, 0)
    stat = path.stat()
    again = demo_model.ensure_demo_model(tmp_path, spec=spec, seed=0)
    assert again == path
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == (stat.st_mtime_ns, stat.st_ino)
    assert sorted(os.listdir(tmp_path)) == [path.name]  # no temporary left behind

    # a truncated file is replaced
    with open(path, "r+b") as f:
        f.truncate(stat.st_size // 2)
    fixed = demo_model.ensure_demo_model(tmp_path, spec=spec, seed=0)
    assert fixed == path and path.stat().st_size == stat.st_size

    # another seed is another file
    other = demo_model.ensure_demo_model(tmp_path, spec=spec, seed=1)
    assert other != path and other.exists()


def test_demo_model_opens_and_generates(tmp_path):
    import clutor

    path = demo_model.ensure_demo_model(tmp_path, spec=tiny_demo_spec("demo-test"))

    async def go():
        async with clutor.Model.open(path, io="threads") as model:
            logits = await model.logits(model.tokenizer.encode("The river and the mill"))
            tokens = [out.token async for out in model.generate("Once", max_tokens=4, temperature=0, ignore_eos=True)
                      if out.token is not None]
        return logits, tokens

    logits, tokens = run(go())
    assert np.isfinite(logits).all() and 1.5 < logits.std(axis=-1).mean() < 6  # LOGIT_STD = 3
    assert len(tokens) == 4


def test_cache_dir_defaults_to_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = demo_model.ensure_demo_model(spec=tiny_demo_spec("demo-test"))
    assert path.parent == tmp_path / "clutor"


def test_big_presets_have_the_real_shapes():
    # planned, not written: the sizes match the anchors measured with llama.cpp (anchors.md)
    olmoe = synth.PRESETS["olmoe-1b-7b-q8"]
    assert synth.expected_size(olmoe) == pytest.approx(7.36e9, rel=0.005)
    assert {p.qtype for p in synth.plan_tensors(olmoe) if len(p.shape) > 1 and "gate_inp" not in p.name} == {
        GGMLQuantizationType.Q8_0}
    demo_size = demo_model.demo_size()
    experts = sum(p.nbytes for p in demo_model._demo_plans(demo_model.DEMO) if "_exps" in p.name)
    assert 0.8e9 < demo_size < 1.1e9 and experts > 0.8 * demo_size
    qwen = synth.plan_tensors(synth.PRESETS["qwen3-30b-a3b-q4k"])
    assert {p.qtype for p in qwen if "_exps" in p.name} == {GGMLQuantizationType.Q4_K}
    assert "output.weight" in {p.name for p in qwen}


# -- llama.cpp loads what we write ----------------------------------------------------------------


@pytest.mark.parametrize("preset", TINY)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_llama_cpp_loads_random_block_files(tmp_path, preset, qtype):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[bench])")
    path = synth.write_model(tmp_path / "m.gguf", preset, seed=0, qtype=qtype)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    try:
        ids = llm.tokenize(b"The river and the mill, 1961.", add_bos=False)
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)])  # [T, V]
    finally:
        llm.close()
    assert logits.shape == (len(ids), synth.PRESETS[preset].vocab_size)
    assert np.isfinite(logits).all()
    assert 1.5 < logits.std(axis=-1).mean() < 6  # LOGIT_STD = 3, give or take the norms


def test_quiet_tokens_are_controls_and_stray_bytes():
    tokens, types, _ = demo_model.train_tokenizer(512)
    quiet = demo_model.quiet_tokens(512)
    assert quiet[[i for i, t in enumerate(types) if t == 3]].all()
    assert quiet[0x80:0x100].all()  # token id b is the lone byte b; bytes >= 0x80 are not UTF-8 alone
    assert quiet[0] and quiet[13] and not quiet[10] and not quiet[9]  # NUL, CR quiet; LF, TAB not
    assert not quiet[tokens.index("Ġthe")]
    assert 0.5 < 1 - quiet.mean() < 0.8  # most of the vocab stays live


@pytest.mark.parametrize("arch", synth.ARCHS)
def test_chat_template_renders(arch):
    import jinja2

    template = demo_model.OLMOE_TEMPLATE if arch == "olmoe" else synth.CHATML_TEMPLATE
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = jinja2.Environment().from_string(template).render(
        messages=msgs, add_generation_prompt=True, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    if arch == "olmoe":
        assert text.startswith("<|endoftext|><|system|>\nBe brief.\n<|user|>\nHi\n")
        assert "<|assistant|>\nHello.<|endoftext|>\n" in text and text.endswith("<|user|>\nBye\n<|assistant|>\n")
    else:
        assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
        assert text.endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
