"""Gemma 4's float arithmetic in the q8 mode against llama.cpp's own intermediate tensors, bit for bit
(tests/golden/ggml_gemma4_math.npz: layers 0 (a 16-token window) and 5 (global, rope_freqs) of the
gemma4 F16 fixture on 40 tokens in one batch, recorded by tools/llama_tensors.py --save; its inputs
are llama.cpp's, so each check is one operation alone): RoPE (libm's cosf / sinf, one FMA per
rotated value), attention without flash attention (kernels.ggmlmath.attend), the router's softmax
and the GELU table. Every F16 product rounds its input to half, so one ulp apart here flips a half
in the next product and grows through the model (on this fixture's six sibling seeds, ulps in these
four took the logits 0.015-0.028 from llama.cpp's)."""
from __future__ import annotations

import numpy as np
import pytest

import clutor
from clutor.model.arch.gemma4 import gelu
from clutor.model.kernels import ggmlmath
from conftest import GOLDEN, fixture_path, run

T = 40  # tokens of the recording (positions 0..39: the window layers' 16 keys, and chunks of 8 not aligned)


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(GOLDEN / "ggml_gemma4_math.npz") as g:
        out = {k: g[k] for k in g.files}
    assert len(out["ids"]) == T
    return out


@pytest.fixture(scope="module")
def arch():
    async def go():
        async with clutor.Model.open(fixture_path("gemma4", "F16"), kv_type="f32") as m:
            return m.arch

    return run(go())


def _heads(ref, name: str, l: int, n_heads: int) -> np.ndarray:
    return ref[f"{name}_{l}"].reshape(T, n_heads, -1)  # [T, heads, hd]


@pytest.mark.parametrize("l", [0, 5])
def test_rope_equals_llama_cpp(ref, arch, l):
    ropes = arch.make_rope(512)
    rope = ropes.swa if arch.swa[l] else ropes.full
    pos = np.arange(T)
    for name, n_heads in (("Qcur", arch.cfg.n_head), ("Kcur", arch.n_kv[l])):
        got = rope.rotate(_heads(ref, f"{name}_normed", l, n_heads), *rope.angles_at(pos))
        want = _heads(ref, f"{name}_pos", l, n_heads)
        assert np.array_equal(got, want), (name, int(np.sum(got != want)), np.abs(got - want).max())


@pytest.mark.parametrize("l", [0, 5])
def test_attention_equals_llama_cpp(ref, arch, l):
    q = _heads(ref, "Qcur_pos", l, arch.cfg.n_head)  # [T, H, hd]
    K = _heads(ref, "Kcur_pos", l, arch.n_kv[l]).transpose(1, 0, 2).copy()  # [Hkv, T, hd]
    V = _heads(ref, "Vcur_normed", l, arch.n_kv[l]).transpose(1, 0, 2).copy()
    window = arch.window if arch.swa[l] else 0
    assert (window == 16) == (l == 0)
    got = ggmlmath.attend(q, K, V, 0, 0, 1.0, window=window)  # [T, H * hd]
    want = ref[f"kqv_out_{l}"].reshape(T, -1)
    assert np.array_equal(got, want), (int(np.sum(got != want)), np.abs(got - want).max())
    if window:  # keys gathered from a later page (as a step reads them), queries that see no earlier key:
        # the lanes and chunks follow the positions, not the gathered array's index
        got31 = ggmlmath.attend(q[31:], K[:, 16:], V[:, 16:], 31, 16, 1.0, window=window)
        assert np.array_equal(got31, want[31:])


def test_router_softmax_equals_llama_cpp(ref):
    logits = ref["ffn_moe_logits_0"].reshape(T, -1)
    got = ggmlmath.softmax(logits)
    want = ref["ffn_moe_probs_0"].reshape(T, -1)
    assert np.array_equal(got, want), (int(np.sum(got != want)), np.abs(got - want).max())
    # numpy's exp and sum do not give these bits (what the check would miss if it passed anyway)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    assert not np.array_equal(e / e.sum(-1, keepdims=True), want)


def test_gelu_table_equals_llama_cpp(ref):
    g, u = ref["ffn_gate_0"].reshape(T, -1), ref["ffn_up_0"].reshape(T, -1)
    got = gelu(g, True) * u
    assert np.array_equal(got, ref["ffn_geglu_0"].reshape(T, -1))
    tab = ggmlmath.gelu_table()
    assert tab.shape == (65536,) and tab[0] == 0 and tab[0x3C00] == np.float32(np.float16(0.8413447460685429))  # GELU(1) as a half


def test_expf_is_ggml_v_expf_on_its_edges():
    """ggml_v_expf: 0 for -inf, 1 at 0, and within 2 ulps of exp down to its slow path and past it."""
    x = np.array([-np.inf, 0.0, -1.0, -10.0, -87.0, -88.5, -100.0, -104.0, -200.0], np.float32)
    got = ggmlmath.expf(x)
    assert got[0] == 0 and got[1] == 1 and got[-1] == 0
    want = np.exp(x[2:-1].astype(np.float64))
    assert np.all(np.abs(got[2:-1] - want) <= 2 * np.spacing(want.astype(np.float32)) + 1e-45)
