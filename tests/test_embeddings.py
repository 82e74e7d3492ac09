"""Model.embed against llama.cpp's own embeddings (tools/record_embeddings.py: llama-cpp-python with
embeddings on, mean and last pooling, an F32 KV cache) on the small MoE trained on real text, fed the
ids llama.cpp read."""
from __future__ import annotations

import numpy as np
import pytest

import clutor
from conftest import GOLDEN, SHARED_DATA, run

MODEL = SHARED_DATA / "models" / "real-olmoe-q8_0.gguf"
REF = GOLDEN / "real-olmoe-q8_0-embeddings.npz"
pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"needs the small MoE trained on real text ({MODEL})")


@pytest.fixture(scope="module")
def ref():
    with np.load(REF, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _texts_ids(ref) -> list[list[int]]:
    o = ref["offsets"]
    return [ref["ids"][o[i]:o[i + 1]].tolist() for i in range(len(o) - 1)]


@pytest.mark.parametrize("activations", ["f32", "q8"])
def test_embeddings_are_llama_cpps(ref, activations):
    async def go():
        async with clutor.Model.open(MODEL, io="memory", activations=activations, kv_type="f32") as model:
            out = {}
            for pooling in ("mean", "last"):
                out[pooling] = np.stack([await model.embed(ids, pooling=pooling, normalize=False)
                                         for ids in _texts_ids(ref)])
            out["normed"] = np.stack([await model.embed(ids) for ids in _texts_ids(ref)])
            return out

    got = run(go())
    # q8 mode rounds activations to int8 blocks and sums as llama.cpp does: measured equal to the last bit.
    # f32 mode computes exact float products where llama.cpp rounds activations to int8: measured up to
    # 1.1e-2 of the largest component (cosine >= 0.99996), as its logits differ (docs/quantization.md)
    tol = {"q8": 1e-5, "f32": 2e-2}[activations]
    for pooling in ("mean", "last"):
        want = ref[pooling]
        assert got[pooling].shape == want.shape
        rel = np.abs(got[pooling] - want).max() / np.abs(want).max()
        assert rel <= tol, f"{pooling} pooling: max |diff| {rel:.2e} of the largest component ({activations})"
        cos = np.sum(got[pooling] * want, -1) / (np.linalg.norm(got[pooling], axis=-1) * np.linalg.norm(want, axis=-1))
        assert cos.min() > 0.9999, f"{pooling} pooling: cosine {cos.min():.6f}"
    unit = ref["mean"] / np.linalg.norm(ref["mean"], axis=-1, keepdims=True)
    assert np.allclose(got["normed"], unit, atol=tol)  # the default: mean pooling, L2-normalised
