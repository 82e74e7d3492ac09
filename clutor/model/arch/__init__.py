"""One module per architecture: its hyper-parameters, its tensors, and what it computes differently.

Everything the architectures share (the layer loop, the expert streaming) lives in
clutor.model.model; the default computation (GQA attention, softmax top-k, SwiGLU experts) is the
``Arch`` base class in .common, which each module overrides where its architecture differs.
"""
from __future__ import annotations

from ...errors import UnsupportedError
from ..config import ModelConfig
from .bailingmoe2 import BailingMoE2
from .common import Arch
from .deepseek2 import DeepSeek2
from .ernie4_5_moe import Ernie45MoE
from .gemma4 import Gemma4
from .glm4moe import GLM4MoE
from .glm_dsa import GlmDsa
from .gptoss import GptOss
from .llama import Llama
from .llama4 import Llama4
from .minimax_m2 import MiniMaxM2
from .nemotron_h_moe import NemotronHMoE
from .olmoe import OLMoE
from .qwen2moe import Qwen2MoE
from .qwen35moe import Qwen35MoE
from .qwen3moe import Qwen3MoE
from .qwen3next import Qwen3Next

__all__ = ["ARCHS", "Arch", "read_arch", "read_config"]

ARCHS: dict[str, type[Arch]] = {a.name: a for a in (OLMoE, Qwen2MoE, Qwen3MoE, Llama, GLM4MoE, DeepSeek2, GptOss,
                                                Qwen3Next, Qwen35MoE, NemotronHMoE, Gemma4, MiniMaxM2, Llama4,
                                                Ernie45MoE, BailingMoE2, GlmDsa)}


def read_arch(f) -> Arch:
    """The architecture of an open GGUFFile, or UnsupportedError naming general.architecture."""
    cls = ARCHS.get(f.arch)
    if cls is None:
        raise UnsupportedError(f.path, "general.architecture", "one of " + ", ".join(sorted(ARCHS)), repr(f.arch))
    scaling = f.get(f"{f.arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) and scaling not in getattr(cls, "rope_scaling", ()):
        raise UnsupportedError(f.path, f"{f.arch}.rope.scaling.type", "none (RoPE scaling is not supported for "
                               f"{f.arch})", repr(scaling))
    # Keys llama.cpp honours that change the numbers and that no supported model needs: refused by name.
    for key, neutral in (("rope.scaling.attn_factor", 1.0),) + (
            (("attention.temperature_scale", 0.0),) if f.arch == "deepseek2" else ()):
        v = f.get(f"{f.arch}.{key}", neutral)
        if v != neutral:
            raise UnsupportedError(f.path, f"{f.arch}.{key}", f"absent or {neutral:g} (not supported)", repr(v))
    arch = cls.read(f)
    moe = arch.cfg.moe_layers
    arch.fused_gate_up = bool(moe) and f"blk.{moe[0]}.ffn_gate_up_exps.weight" in f.tensors
    return arch


def read_config(f) -> ModelConfig:
    """ModelConfig of an open GGUFFile (see read_arch)."""
    return read_arch(f).cfg
