"""The trained real-routing model widened to real expert sizes (tools/widen.py) computes the trained network:
a narrow widening by the same code gives the small model's logits in Clutor, and llama.cpp's logits on the
full-size widening (recorded by tools/record_widened.py) match Clutor's small model as llama.cpp matches
any Q8_0 file."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

import clutor
from conftest import GOLDEN, SHARED_DATA, STEP_TOL, run

SMALL = SHARED_DATA / "models" / "real-olmoe-q8_0.gguf"
pytestmark = pytest.mark.skipif(not SMALL.exists(), reason=f"needs the small MoE trained on real text ({SMALL})")


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    from widen import WIDE_PRESETS, widen_model

    spec = WIDE_PRESETS["real-olmoe-wide-512"]
    return widen_model(SMALL, tmp_path_factory.mktemp("wide") / "wide512.gguf", spec.n_embd, spec.n_ff, name=spec.name)


def _corpus_ids(tok, n: int) -> list[int]:
    from importlib.resources import files

    text = files("clutor").joinpath("data/corpus.txt").read_text(encoding="utf-8")[:4000]
    return tok.encode(text)[:n]


async def _logits(path, ids, activations):
    # an f32 KV cache: the claim is about the products; a float16 one rounds keys and values that
    # differ in their last float bits (sums over 512 dims, not 256) to halves apart (1.1e-4 of max |logit|)
    async with clutor.Model.open(path, io="memory", activations=activations, kv_type="f32") as model:
        return await model.logits(ids)


def test_widened_file_keeps_the_converters_keys_and_real_sizes(narrow):
    small, wide = GGUFReader(str(SMALL)), GGUFReader(str(narrow))
    assert set(wide.fields) == set(small.fields)  # no key of our own, none dropped
    kv = {k: f.contents() for k, f in wide.fields.items() if not k.startswith("tokenizer.")}
    assert (kv["olmoe.embedding_length"], kv["olmoe.feed_forward_length"]) == (512, 512)
    eps = small.fields["olmoe.attention.layer_norm_rms_epsilon"].contents()
    assert kv["olmoe.attention.layer_norm_rms_epsilon"] == pytest.approx(eps * 256 / 512, rel=1e-6)
    shapes = {t.name: t.shape.tolist() for t in wide.tensors}
    assert shapes["blk.0.ffn_gate_exps.weight"] == [512, 512, 32]
    assert shapes["blk.0.ffn_down_exps.weight"] == [512, 512, 32]
    assert shapes["blk.0.attn_q.weight"] == [512, 512] and shapes["token_embd.weight"] == [512, 50257]
    # every trained Q8_0 block is in the wide file byte for byte: the down projection's first rows
    sd = {t.name: t for t in small.tensors}["blk.2.ffn_down_exps.weight"].data  # [E, 256, 8 blocks x 34]
    wd = {t.name: t for t in wide.tensors}["blk.2.ffn_down_exps.weight"].data   # [E, 512, 16 blocks x 34]
    assert np.array_equal(wd[:, :256, : sd.shape[-1]], sd) and not wd[:, :256, sd.shape[-1]:].any()
    assert not wd[:, 256:].any()


def test_narrow_widening_gives_the_small_models_logits(narrow):
    tok = clutor.Tokenizer.from_gguf(SMALL)
    ids = _corpus_ids(tok, 16)
    small = run(_logits(SMALL, ids, "f32"))
    wide = run(_logits(narrow, ids, "f32"))
    scale = np.abs(small).max()
    # f32 activations: the same products over the trained dims, summed in another order
    np.testing.assert_allclose(wide, small, rtol=0, atol=STEP_TOL["f32"] * scale)
    assert (wide.argmax(-1) == small.argmax(-1)).all()


def test_llama_cpp_on_the_full_widening_matches_the_small_model():
    path = GOLDEN / "real-olmoe-wide.npz"
    with np.load(path, allow_pickle=False) as z:
        ids, ref = z["prompt_ids"].tolist(), z["logits"]
        # llama.cpp itself gave the small file's logits on the widened one (recorded alongside)
        assert float(z["small_max_diff"]) <= 0.02 * np.abs(ref).max()
    got = run(_logits(SMALL, ids, "auto"))
    diff, scale = np.abs(got - ref), np.abs(ref).max()
    # as for every quantised golden (conftest.assert_matches_golden), and no position off by more than a
    # q8 rounding step; the argmax wherever llama.cpp's top two are not tied (a 0.003 gap in this prompt)
    assert diff.mean() <= 0.01 * scale and diff.max() <= STEP_TOL["q8"] * scale, (diff.mean(), diff.max(), scale)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.1
    assert clear.sum() >= len(ids) - 1
    assert (got.argmax(-1) == ref.argmax(-1))[clear].all()


def test_widening_refuses_what_it_cannot_keep_exact(tmp_path):
    from widen import WidenError, widen_model

    with pytest.raises(WidenError, match="multiple of the trained one"):
        widen_model(SMALL, tmp_path / "x.gguf", 384, 512)  # wide head 48 is not a multiple of 32
    with pytest.raises(WidenError, match="must not shrink"):
        widen_model(SMALL, tmp_path / "x.gguf", 512, 128)
    assert not list(tmp_path.iterdir())
