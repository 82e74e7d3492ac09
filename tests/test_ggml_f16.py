"""F16 products, RMS norms and the router's F32 product in the q8 mode against llama.cpp's own
intermediate tensors, bit for bit (tests/golden/ggml_f16_products{,_1}.npz: layer 0 of the gemma4 F16
fixture on 12 tokens in one batch, and on 1, recorded by tools/llama_tensors.py --save). Twelve tokens
take llamafile's tinyBLAS order, one token ggml_vec_dot_f16's (kernels/f16dots.py): one ulp apart
would flip a half in the next product's input and grow through the model."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from clutor.model import kernels
from clutor.model.kernel_settings import KernelSettings
from clutor.model.kernels.rowwise import rowdot
from clutor.model.layers import rmsnorm
from clutor.model.weight_types import QT
from conftest import GOLDEN, fixture_path

Q8 = KernelSettings("q8", ggml_f16=True)
EPS = np.float32(1e-6)  # the fixture's attention.layer_norm_rms_epsilon


@pytest.fixture(scope="module")
def tensors():
    r = GGUFReader(fixture_path("gemma4", "F16"))
    return {t.name: np.array(t.data) for t in r.tensors if t.name.startswith(("blk.0.", "output_norm"))}


def _golden(n_tok: int) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / ("ggml_f16_products.npz" if n_tok > 1 else "ggml_f16_products_1.npz")) as g:
        return {k: g[k].reshape(n_tok, -1) if k != "ids" else g[k] for k in g.files}


def _f16(tensors, name: str, x: np.ndarray) -> np.ndarray:
    w = tensors[name]
    assert w.dtype == np.float16
    return kernels.matmul(w.view(np.uint8).reshape(-1), int(QT.F16), w.shape[0], w.shape[1],
                          np.ascontiguousarray(x), settings=Q8)


@pytest.mark.parametrize("n_tok", [12, 1])
def test_f16_products_and_norms_equal_llama_cpp(tensors, n_tok):
    g = _golden(n_tok)
    assert len(g["ids"]) == n_tok
    assert np.array_equal(rmsnorm(g["inp_scaled"], tensors["blk.0.attn_norm.weight"], EPS), g["attn_norm_0"])
    h = g["attn_norm_0"]
    for name, ref in (("attn_q", "Qcur_0"), ("attn_k", "Kcur_0"), ("attn_v", "Vcur_0")):
        got = _f16(tensors, f"blk.0.{name}.weight", h)
        assert np.array_equal(got, g[ref]), (name, np.abs(got - g[ref]).max())
    m = g["ffn_norm_1_0"]
    for name, ref in (("ffn_gate", "ffn_gate_0"), ("ffn_up", "ffn_up_0")):
        got = _f16(tensors, f"blk.0.{name}.weight", m)
        assert np.array_equal(got, g[ref]), (name, np.abs(got - g[ref]).max())


def test_router_product_equals_llama_cpp_on_several_tokens(tensors):
    """The router's F32 product as tinyBLAS sums it (llama.cpp's order from two tokens on; one token
    takes ggml_vec_dot_f32 there, while rowdot keeps one order whatever the batch)."""
    g = _golden(12)
    got = rowdot(g["node_40"], tensors["blk.0.ffn_gate_inp.weight"])
    assert np.array_equal(got, g["ffn_moe_logits_0"]), np.abs(got - g["ffn_moe_logits_0"]).max()
