"""One module per architecture: how its hyper-parameters and tensors are named, and what differs.

Everything the three share (the layer loop, attention, the MoE block) lives in clutor.model.layers
and clutor.model.model; an architecture module only fills a ModelConfig from the file.
"""
from __future__ import annotations

from ...errors import UnsupportedError
from ..config import ModelConfig
from . import olmoe, qwen2moe, qwen3moe

__all__ = ["ARCHS", "read_config"]

ARCHS = {"olmoe": olmoe.config, "qwen2moe": qwen2moe.config, "qwen3moe": qwen3moe.config}


def read_config(f) -> ModelConfig:
    """ModelConfig for an open GGUFFile, or UnsupportedError naming general.architecture."""
    build = ARCHS.get(f.arch)
    if build is None:
        raise UnsupportedError(f.path, "general.architecture", "one of " + ", ".join(sorted(ARCHS)), repr(f.arch))
    return build(f)
