"""A model split in llama.cpp's NAME-0000k-of-0000N.gguf parts (written by gguf-py's own sharding) gives
exactly the single file's logits, from memory and streamed, with experts spread over several parts."""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest

import clutor
from clutor.model.arch import read_arch
from clutor.model.gguf import GGUFFile
from clutor.model.weights import expert_layout
from conftest import fixture_path, run
from gguf_util import copy_gguf


def split_copy(src: Path, dst_dir: Path, n_parts: int) -> Path:
    """Rewrite src as n_parts split files with GGUFWriter(split_max_tensors=...); returns part 1."""
    n_tensors = len(gguf.GGUFReader(src).tensors)
    copy_gguf(src, dst_dir / "m.gguf", split_max_tensors=math.ceil(n_tensors / n_parts))
    return dst_dir / f"m-00001-of-{n_parts:05d}.gguf"


@pytest.mark.parametrize("arch, qtype", [("qwen2moe", "Q4_K_M"), ("qwen3moe", "Q8_0")])
def test_split_model_equals_single_file(tmp_path, arch, qtype):
    single = fixture_path(arch, qtype)
    first = split_copy(single, tmp_path, 3)
    with GGUFFile.open(first) as f:
        assert len(f.paths) == 3
        layout = expert_layout(f, read_arch(f))
        assert len(layout.files) > 1  # experts really come from more than one part
    ids = list(range(5, 45))

    async def logits(path, **kw):
        async with clutor.Model.open(path, **kw) as model:
            return await model.logits(ids)

    want = run(logits(single, io="memory"))
    np.testing.assert_array_equal(run(logits(first, io="memory")), want)
    for io in ("threads", "auto"):  # auto: io_uring where the kernel allows it
        np.testing.assert_array_equal(run(logits(first, io=io, expert_cache="25%")), want)
