"""The int8 kernels against ggml's own dot products (tests/golden/ggml_dots.npz, recorded by
tools/record_quants.py from llama.cpp's CPU vec_dot of weights quantised by llama.cpp's quantiser,
with activations quantised by its from_float).

Bit for bit where Clutor accumulates as ggml's x86 vec_dot does: every type with a kernel, several
tokens at a time (one accumulator per token, blocks in order). Exceptions, within float rounding:
one or two tokens of a 32-element type (several accumulators, for the FMA latency); Q4_K, whose
kernel sums each super-block whole as ggml's repacked Q4_K product does on x86 (what llama.cpp runs
for Q4_K there), not as the plain vec_dot recorded here; IQ4_NL and MXFP4, whose vec_dot alternates two
accumulators (llama.cpp runs them repacked on x86 too); the i-quants of kernels/iquants.py (IQ3_XXS
... IQ1_M), whose integer sums are ggml's but whose super-block scales multiply in another order (and
IQ1's delta is folded into the integers, where ggml adds it as a separate float sum).

Rows whose Q8_1 sum overflows a half (x ~ 1e4) give inf / NaN in ggml; they must give the same here."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from conftest import GOLDEN
from clutor.model import kernels
from clutor.model.kernel_settings import KernelSettings as KS

K = 1024


def _golden():
    with np.load(GOLDEN / "ggml_activations.npz") as a, np.load(GOLDEN / "ggml_dots.npz") as g:
        x = a["x"][g["dot_rows"]]
        return x, {k.split(".")[0]: (g[f"{k.split('.')[0]}.w"], g[f"{k.split('.')[0]}.dot"]) for k in g.files if "." in k}


X, DOTS = _golden()
IQUANTS = {"IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"}
ROUNDING_ONLY = {"Q4_K", "IQ4_NL", "MXFP4"} | IQUANTS  # see the module docstring


@pytest.mark.parametrize("name", sorted(DOTS))
def test_kernel_equals_ggml_vec_dot(name):
    qt = int(QT[name])
    if not kernels.has_kernel(qt) or kernels.mode(KS("q8")) != "q8":
        pytest.skip(f"no int8 kernel for {name} on this machine")
    w, want = DOTS[name]
    R = w.shape[0]
    raw = np.ascontiguousarray(w).reshape(-1)
    scale = np.abs(want).max(axis=1, keepdims=True)  # [N, 1]: per activation row
    got = kernels.matmul(raw, qt, R, K, X, settings=KS("q8"))  # all rows: four at a time
    if name in ROUNDING_ONLY:
        assert np.abs(got - want).max() <= 2e-6 * scale.max()
    else:
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    one = np.concatenate([kernels.matmul(raw, qt, R, K, X[i : i + 1], settings=KS("q8")) for i in range(len(X))])
    finite = np.isfinite(want)
    np.testing.assert_array_equal(one[~finite], want[~finite])
    assert (np.abs(one - want)[finite] <= 2e-6 * np.broadcast_to(scale, want.shape)[finite]).all()
