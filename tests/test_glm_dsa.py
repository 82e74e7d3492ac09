"""GLM-5's sparse attention (`glm-dsa`): what tests/test_attn_archs.py does not already hold it to (logits at
F16 and Q4_K_M against llama.cpp, greedy tokens, prefill == decode, streamed == memory). Here: the
selection matters (attending every key moves the logits far past the bar), ties fall as llama.cpp's
CPU breaks them (std::partial_sort, recorded by tools/record_topk_ties.py), a "shared" layer reuses
the previous full layer's choice, a batch equals each sequence alone, the prompt fed in steps equals
one shot, files missing what llama.cpp needs are refused by name, a file carrying MTP layers loads.

Fixture: tools/make_hf_fixture.py glm-dsa (transformers' GlmMoeDsaForCausalLM through llama.cpp's
convert_hf_to_gguf.py and quantiser): 4 layers (indexer types full, full, shared, full), each query's
top 8 keys of prompts of ~90 positions."""
from __future__ import annotations

import numpy as np
import pytest

import clutor
from clutor.model.arch import glm_dsa
from clutor.model.kernels import dsa
from conftest import GOLDEN, STEP_TOL, fixture_path, golden, greedy_and_cached, run

ARCH = "glm-dsa"


def _logits(qtype: str, ids: list[int], **opts) -> np.ndarray:
    async def go():
        async with clutor.Model.open(fixture_path(ARCH, qtype), kv_type="f32", **opts) as model:
            return await model.logits(ids)

    return run(go())


def test_ties_fall_as_llama_cpps_top_k_breaks_them():
    """400 score rows full of exact ties (zeros, repeated levels, -inf): the kept keys are those GCC's
    std::partial_sort keeps (what ggml_top_k calls); a stable sort would differ in many of them."""
    z = np.load(GOLDEN / "topk_ties.npz")
    off = coff = differs = 0
    for n, k in zip(z["lens"].tolist(), z["ks"].tolist()):
        s, want = z["scores"][off:off + n], z["chosen"][coff:coff + k]
        assert np.array_equal(dsa.heap_select(s, k), want), (n, k)
        differs += not np.array_equal(np.sort(np.argsort(-s, kind="stable")[:k]), want)
        off, coff = off + n, coff + k
    assert differs > 100  # the rows do exercise the tie order


def test_index_topk_keeps_the_best_causal_keys():
    """index_topk against the indexer's formula written out: sum_h relu(q_h . k_j) w_h over j <= p."""
    rng = np.random.default_rng(0)
    T, H, D, p0, k = 6, 3, 64, 20, 5
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    keys = rng.standard_normal((p0 + T, D)).astype(np.float32)
    w = rng.standard_normal((T, H)).astype(np.float32)
    sel = dsa.index_topk(q, keys, w, p0, k)
    score = np.einsum("thd,nd->thn", q.astype(np.float64), keys.astype(np.float64))
    score = (np.maximum(score, 0) * w[..., None]).sum(1)  # [T, N]
    for t in range(T):
        p = p0 + t
        want = np.zeros(p0 + T, bool)
        want[np.argsort(-score[t, :p + 1])[:k]] = True
        assert np.array_equal(sel[t], want), t
    short = dsa.index_topk(q[:2], keys[:3], w[:2], 1, 8)  # fewer causal keys than k: all of them
    assert short.tolist() == [[True, True, False], [True, True, True]]


def test_attending_every_key_would_miss_llama_cpp_by_far():
    """The bar (max |diff| <= 0.02 at F16, test_attn_archs) is met only with the indexer's selection:
    the same file with every causal key attended moves the logits by far more."""
    g = golden(ARCH, "F16")
    ref = g["logits"].astype(np.float32)
    ids = g["prompt_ids"].tolist()
    got = _logits("F16", ids)
    assert np.abs(got - ref).max() <= 0.02

    def every_key(q, keys, w, p0, top_k):
        n = keys.shape[0]
        return np.tril(np.ones((q.shape[0], n), bool), k=p0)

    mp = pytest.MonkeyPatch()
    mp.setattr(glm_dsa, "index_topk", every_key)
    try:
        dense = _logits("F16", ids)
    finally:
        mp.undo()
    diff = np.abs(dense - ref).max(-1)
    assert diff[:8].max() <= 0.02  # below top-k (8) every key is kept anyway
    assert diff.max() > 0.5 and (diff > 0.02).mean() > 0.5, diff


def test_shared_layer_reuses_the_previous_full_layers_choice():
    """indexer.types = full, full, shared, full: three indexers per step, and layer 2 attends
    exactly the keys layer 1 chose."""
    calls = []
    seen = []
    real = glm_dsa.index_topk

    def spy(q, keys, w, p0, top_k):
        sel = real(q, keys, w, p0, top_k)
        calls.append(sel)
        return sel

    from clutor.model import step as step_mod
    real_attend = step_mod.attend_selected

    def spy_attend(q, K, V, p0, scale, sel):
        seen.append(sel)
        return real_attend(q, K, V, p0, scale, sel)

    mp = pytest.MonkeyPatch()
    mp.setattr(glm_dsa, "index_topk", spy)
    mp.setattr(step_mod, "attend_selected", spy_attend)
    try:
        _logits("Q4_K_M", golden(ARCH, "Q4_K_M")["prompt_ids"].tolist()[:30])
    finally:
        mp.undo()
    assert len(calls) == 3 and len(seen) == 4
    assert seen[2] is seen[1] and seen[1] is calls[1] and seen[3] is calls[2]
    assert not np.array_equal(calls[0], calls[1])


def test_prompt_in_steps_equals_one_shot_and_llama_cpp():
    """The golden prompt fed as 20 + 30 + the rest (keys cached across steps, the indexer's with
    them), then as single tokens from position 60: the one-shot logits, and llama.cpp's."""
    g = golden(ARCH, "F16")
    ids = g["prompt_ids"].tolist()

    async def go():
        async with clutor.Model.open(fixture_path(ARCH, "F16"), kv_type="f32") as model:
            full = await model.logits(ids)
            seq = model.new_sequence()
            parts = [await model.forward(seq, ids[a:b], all_logits=True) for a, b in ((0, 20), (20, 50), (50, 60))]
            parts += [await model.forward(seq, [t]) for t in ids[60:]]
            return full, np.concatenate(parts)

    full, stepped = run(go())
    np.testing.assert_allclose(stepped, full, rtol=0, atol=STEP_TOL["q8"] * np.abs(full).max())
    ref = g["logits"].astype(np.float32)
    assert np.abs(stepped - ref).max() <= 0.02 and (stepped.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("activations", ["q8", "f32"])
def test_a_batch_equals_each_sequence_alone(activations):
    """Sequences of 30, 1, 45 and 12 tokens in one step (each its own keys and selection), then one
    decode step of all four."""
    rng = np.random.default_rng(3)

    async def go():
        async with clutor.Model.open(fixture_path(ARCH, "Q4_K_M"), io="memory", activations=activations) as model:
            V = model.config.n_vocab
            prompts = [rng.integers(0, V, n).tolist() for n in (30, 1, 45, 12)]
            solo = [await model.logits(p) for p in prompts]
            seqs = [model.new_sequence() for _ in prompts]
            both = await model.forward_batch(list(zip(seqs, prompts)), all_logits=True)
            nxt = rng.integers(0, V, len(prompts)).tolist()
            step = await model.forward_batch([(s, [t]) for s, t in zip(seqs, nxt)])
            alone = [(await model.logits(p + [t]))[-1] for p, t in zip(prompts, nxt)]
            return solo, both, step, alone

    solo, both, step, alone = run(go())
    tol = STEP_TOL[activations]
    for s, b in zip(solo, both):
        np.testing.assert_allclose(b, s, rtol=0, atol=tol * np.abs(s).max())
    for s, a in zip(step, alone):
        np.testing.assert_allclose(np.ravel(s), a, rtol=0, atol=tol * np.abs(a).max())


def test_info_shows_the_indexer(capsys):
    from clutor.cli import main

    assert main(["info", str(fixture_path(ARCH, "Q4_K_M"))]) == 0
    out = capsys.readouterr().out
    for w in ("layers          4 (1 dense first)", "layer kinds     2 sparse attention, 1 sparse attention (shared top-k), 1 sparse attention",
              "DSA indexer: 4 heads of 64, each query attends its top 8 keys",
              "indexer keys 64 values per position in 3 of 4 layers (192 per position in all; 384 B as f16, in the KV cache)",
              "1 reuses the previous selection", "sigmoid, top-k, renormalised, scaled x2.5 (selection bias exp_probs_b)",
              # per position: 3 x (latent 64 + rope 32 + indexer 64) + 1 x (64 + 32) = 576 values
              "1.12 KiB per token as f16"):
        assert w in out, (w, out)


# -- files llama.cpp refuses or cannot run ---------------------------------------------------------
@pytest.mark.parametrize("drop, field", [
    ("glm-dsa.attention.indexer.top_k", "glm-dsa.attention.indexer.top_k"),  # required keys of its loader
    ("glm-dsa.attention.indexer.head_count", "glm-dsa.attention.indexer.head_count"),
    ("glm-dsa.attention.indexer.key_length", "glm-dsa.attention.indexer.key_length"),
    ("glm-dsa.attention.q_lora_rank", "glm-dsa.attention.q_lora_rank"),
    ("glm-dsa.attention.key_length_mla", "glm-dsa.attention.key_length_mla"),  # "GLM_DSA architecture requires MLA"
    # optional to llama.cpp's loader, then multiplied by in its graph
    ("blk.1.indexer.attn_k.weight", "tensor blk.1.indexer.attn_k.weight"),
    ("blk.0.indexer.proj.weight", "tensor blk.0.indexer.proj.weight"),
    ("blk.3.indexer.attn_q_b.weight", "tensor blk.3.indexer.attn_q_b.weight"),
    # without the types every layer of a < 2^20 context file runs its own indexer: layer 2 has none
    ("glm-dsa.attention.indexer.types", "tensor blk.2.indexer."),
])
def test_a_file_without_what_llama_cpp_needs_is_refused(tmp_path, drop, field):
    from gguf_util import copy_gguf

    dst = tmp_path / "cut.gguf"
    copy_gguf(fixture_path(ARCH, "Q4_K_M"), dst, drop=frozenset({drop}))
    with pytest.raises(clutor.ModelFileError) as e:
        run(clutor.Model.open(dst).__aenter__())
    assert e.value.field.startswith(field) and str(dst) in str(e.value), str(e.value)


def test_a_missing_indexer_key_norm_is_computed_without_it(tmp_path):
    """llama.cpp skips an absent indexer k_norm weight or bias (build_norm with none): so does Clutor."""
    from gguf_util import copy_gguf

    dst = tmp_path / "nonorm.gguf"
    copy_gguf(fixture_path(ARCH, "Q4_K_M"), dst, drop=frozenset({"blk.1.indexer.k_norm.bias"}))
    ids = golden(ARCH, "Q4_K_M")["prompt_ids"].tolist()[:24]

    async def go(path):
        async with clutor.Model.open(path) as model:
            return await model.logits(ids)

    with_bias, without = run(go(fixture_path(ARCH, "Q4_K_M"))), run(go(dst))
    assert np.abs(with_bias - without).max() > 1e-3  # the bias mattered, and its absence was not refused


def test_a_file_carrying_mtp_layers_loads_and_computes_the_same(tmp_path, capsys):
    """GLM-5's GGUFs end with a multi-token-prediction (nextn) layer: block_count counts it,
    nextn_predict_layers says so, blk.4 holds a full layer plus its nextn tensors. It is not computed:
    the logits are those of the file without it, bit for bit."""
    import gguf
    from clutor.cli import main

    src, dst = fixture_path(ARCH, "Q4_K_M"), tmp_path / "mtp.gguf"
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, ARCH)
    for name, fld in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = fld.types[0]
        val = 5 if name == "glm-dsa.block_count" else fld.contents()
        w.add_key_value(name, val, vt, sub_type=fld.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    w.add_key_value("glm-dsa.nextn_predict_layers", 1, gguf.GGUFValueType.UINT32)

    def add(name, t):
        qt = gguf.GGMLQuantizationType(t.tensor_type)
        w.add_tensor(name, np.asarray(t.data), raw_dtype=None if qt in (gguf.GGMLQuantizationType.F32,
                                                                         gguf.GGMLQuantizationType.F16) else qt)

    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        if t.name.startswith("output"):
            continue
        add(t.name, t)
    for name, t in tensors.items():  # the MTP layer: layer 3's tensors again, plus its nextn part
        if name.startswith("blk.3."):
            add(name.replace("blk.3.", "blk.4."), t)
    D = r.fields["glm-dsa.embedding_length"].contents()
    rng = np.random.default_rng(0)
    w.add_tensor("blk.4.nextn.eh_proj.weight", rng.standard_normal((D, 2 * D)).astype(np.float16))
    for n in ("enorm", "hnorm", "shared_head_norm"):
        w.add_tensor(f"blk.4.nextn.{n}.weight", np.ones(D, np.float32))
    for t in r.tensors:
        if t.name.startswith("output"):
            add(t.name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ids = golden(ARCH, "Q4_K_M")["prompt_ids"].tolist()[:30]

    async def go(path):
        async with clutor.Model.open(path) as model:
            return model.config.n_layers, await model.logits(ids)

    (n_plain, plain), (n_mtp, mtp) = run(go(src)), run(go(dst))
    assert n_plain == n_mtp == 4 and np.array_equal(plain, mtp)
    assert main(["info", str(dst)]) == 0
    assert "1 MTP layers skipped" in capsys.readouterr().out


def _glm5_header(**over):
    """GLM-5's config.json (zai-org/GLM-5) as the converter writes it: 78 layers + 1 MTP layer, MLA
    (q rank 2048, latent 512, heads 192 + 64, values 256), 32 indexer heads of 128, top 2048."""
    a = ARCH
    meta = {f"{a}.block_count": 79, f"{a}.nextn_predict_layers": 1, f"{a}.context_length": 202752,
            f"{a}.embedding_length": 6144, f"{a}.feed_forward_length": 12288, f"{a}.attention.head_count": 64,
            f"{a}.attention.head_count_kv": 1, f"{a}.rope.freq_base": 1e6, f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
            f"{a}.expert_count": 256, f"{a}.expert_used_count": 8, f"{a}.expert_group_count": 1,
            f"{a}.expert_group_used_count": 1, f"{a}.attention.key_length": 576, f"{a}.attention.value_length": 512,
            f"{a}.leading_dense_block_count": 3, f"{a}.attention.q_lora_rank": 2048, f"{a}.attention.kv_lora_rank": 512,
            f"{a}.attention.key_length_mla": 256, f"{a}.attention.value_length_mla": 256,
            f"{a}.expert_feed_forward_length": 2048, f"{a}.expert_shared_count": 1, f"{a}.expert_weights_scale": 2.5,
            f"{a}.expert_weights_norm": True, f"{a}.rope.dimension_count": 64, f"{a}.attention.indexer.head_count": 32,
            f"{a}.attention.indexer.key_length": 128, f"{a}.attention.indexer.top_k": 2048}
    return {k: v for k, v in (meta | over).items() if v is not None}


def test_glm5_and_glm5_2_headers_are_read_as_llama_cpp_reads_them():
    """Without attention.indexer.types, a context below 2^20 (GLM-5, 5.1) means an indexer in every
    layer; 2^20 or more (GLM-5.2) llama.cpp's built-in pattern (full in layers 0, 1, 2, 6, 10, ...)."""
    from clutor.model.arch import read_arch
    from clutor.model.arch.common import TableView

    shapes = {"token_embd.weight": (154880, 6144), "output.weight": (154880, 6144), "blk.3.exp_probs_b.bias": (256,)}
    glm5 = read_arch(TableView(ARCH, _glm5_header(), shapes, path="glm5.gguf"))
    assert glm5.cfg.n_layers == 78 and glm5.n_nextn == 1 and all(glm5.full) and glm5.top_k == 2048
    assert glm5.cfg.head_dim == 256 and glm5.kq_scale == pytest.approx(1 / 16) and glm5.func == "sigmoid"
    # per position and layer: latent 512 + rope 64 + the indexer's key 128
    assert {s.row for s in glm5.layer_states()} == {704}
    assert glm5.describe()["indexer"]["kv_values_per_position"] == 78 * 128
    glm52 = read_arch(TableView(ARCH, _glm5_header(**{f"{ARCH}.context_length": 1 << 20}), shapes, path="glm52.gguf"))
    assert [i for i, f in enumerate(glm52.full) if f][:6] == [0, 1, 2, 6, 10, 14] and sum(glm52.full) == 21
    assert {s.row for s in glm52.layer_states()} == {704, 576}
    with pytest.raises(clutor.UnsupportedError) as e:  # llama.cpp's Hadamard rotation needs a power of two >= 64
        read_arch(TableView(ARCH, _glm5_header(**{f"{ARCH}.attention.indexer.key_length": 96}), shapes, path="x.gguf"))
    assert e.value.field == f"{ARCH}.attention.indexer.key_length"
    with pytest.raises(clutor.ModelFileError) as e:  # a shared layer needs an earlier full one
        read_arch(TableView(ARCH, _glm5_header(**{f"{ARCH}.attention.indexer.types": [False] + [True] * 77}), shapes,
                            path="x.gguf"))
    assert e.value.field == f"{ARCH}.attention.indexer.types"


def test_a_reused_prefix_carries_the_indexers_keys():
    """A prompt extending an earlier one starts from the cached prefix (its latent rows, the indexer's
    keys in them) and generates what a fresh model does, past the top-k (positions 30 .. 46)."""
    ids = golden(ARCH, "Q4_K_M")["prompt_ids"].tolist()
    first, longer = ids[:30], ids[:30] + ids[40:50]

    async def go():
        async with clutor.Model.open(fixture_path(ARCH, "Q4_K_M")) as model:
            await greedy_and_cached(model, first)
            again = await greedy_and_cached(model, longer)
        async with clutor.Model.open(fixture_path(ARCH, "Q4_K_M"), prefix_cache=0) as fresh:
            return again, await greedy_and_cached(fresh, longer)

    (tokens, cached), (fresh, _) = run(go())
    assert cached >= 30 and tokens == fresh
