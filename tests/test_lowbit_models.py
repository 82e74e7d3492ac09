"""Files in llama.cpp's low-bit mixes, made by its own quantiser (the i-quants with a uniform importance
matrix; tests/fixtures/README.md), against llama.cpp's logits (tests/golden, tools/record_reference.py):
the K-quant mixes Q2_K and Q3_K_M, IQ4_XS, and the i-quant mixes IQ3_XXS, IQ3_M, IQ2_XXS, IQ2_XS, IQ2_M,
IQ1_S and IQ1_M."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import clutor
from clutor.model.gguf import GGUFFile
from clutor.model.kernels import has_kernel, mode
from clutor.model.weight_types import type_name
from conftest import assert_matches_golden, fixture_path, golden, run

# (arch, llama.cpp file type) -> the types its matrices hold that the file type is named for
FIXTURES = {
    ("olmoe", "Q2_K"): {"Q2_K"},
    ("olmoe", "Q3_K_M"): {"Q3_K"},
    ("olmoe", "IQ4_XS"): {"IQ4_XS"},
    ("olmoe", "IQ3_XXS"): {"IQ3_XXS", "IQ2_S"},
    ("qwen3moe", "IQ3_M"): {"IQ3_S"},
    ("olmoe", "IQ2_XXS"): {"IQ2_XXS"},
    ("qwen3moe", "IQ2_XS"): {"IQ2_XS"},
    ("olmoe", "IQ2_M"): {"IQ2_S"},
    ("olmoe", "IQ1_S"): {"IQ1_S"},
    ("qwen3moe", "IQ1_M"): {"IQ1_M"},
}


async def _logits(path, ids, activations):
    async with clutor.Model.open(path, activations=activations) as model:
        return await model.logits(ids)


@pytest.mark.parametrize("arch, ftype", list(FIXTURES))
def test_mix_is_what_llama_cpp_wrote(arch, ftype):
    """Each fixture really holds the types it is named for in its matrices, every product of it has a kernel
    (token_embd is only looked up), and `clutor info` says so per type."""
    from clutor.cli.info import describe

    with GGUFFile.open(fixture_path(arch, ftype)) as f:
        types = Counter(type_name(t.qtype) for t in f.tensors.values() if len(t.shape) >= 2)
        assert all(has_kernel(t.qtype) for t in f.tensors.values() if not t.name.startswith("token_embd")), types
    assert FIXTURES[arch, ftype] <= set(types), types
    info = describe(str(fixture_path(arch, ftype)))["tensor_types"]
    assert all(info[t]["kernel"] for t in FIXTURES[arch, ftype]), info


@pytest.mark.parametrize("arch, ftype", list(FIXTURES))
def test_logits_match_llama_cpp(arch, ftype):
    """In int8 mode, which computes as llama.cpp does (the default where the CPU has the int8
    instructions): argmax equal at >= 95% of positions and mean |diff| <= 0.5% of the largest logit.
    Float mode is held to the bar of every other quantised fixture (conftest.assert_matches_golden)."""
    g = golden(arch, ftype)
    ref = g["logits"].astype(np.float32)  # [T, V]
    ids = g["prompt_ids"].tolist()
    assert_matches_golden(run(_logits(fixture_path(arch, ftype), ids, "f32")), ref, ftype)
    if mode() != "q8":
        pytest.skip("no int8 kernels on this CPU (x86 AVX2 needed): the float path was checked")
    got = run(_logits(fixture_path(arch, ftype), ids, "q8"))
    assert got.shape == ref.shape
    diff = np.abs(got - ref)
    same = np.mean(got.argmax(-1) == ref.argmax(-1))
    assert same >= 0.95, f"argmax agrees at {same:.1%} of positions"
    assert diff.mean() <= 0.005 * np.abs(ref).max(), f"mean |diff| {diff.mean():.4f}, max |logit| {np.abs(ref).max():.3f}"
