"""The resident (dense) part of a model, read once at open into memory the process owns, and the
description of the routed experts that stay on disk."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import ModelFileError
from .config import ModelConfig
from .quants import SUPPORTED, Weight, dequantize, type_name

__all__ = ["LayerWeights", "ExpertTypes", "DenseWeights", "load_dense"]


@dataclass(frozen=True)
class ExpertTypes:
    """Types of one layer's routed expert matrices (each expert's slab has the tensor's type)."""

    gate: int  # slab shape (F, D)
    up: int    # slab shape (F, D)
    down: int  # slab shape (D, F)


@dataclass(eq=False)
class LayerWeights:
    attn_norm: np.ndarray          # [D]
    wq: Weight                     # (H*hd, D)
    wk: Weight                     # (Hkv*hd, D)
    wv: Weight                     # (Hkv*hdv, D)
    wo: Weight                     # (D, H*hdv)
    bq: np.ndarray | None          # [H*hd]   qwen2moe
    bk: np.ndarray | None          # [Hkv*hd]
    bv: np.ndarray | None          # [Hkv*hdv]
    q_norm: np.ndarray | None      # olmoe: [H*hd]; qwen3moe: [hd]
    k_norm: np.ndarray | None      # olmoe: [Hkv*hd]; qwen3moe: [hd]
    ffn_norm: np.ndarray           # [D]
    router: np.ndarray             # [E, D] float32
    experts: ExpertTypes
    sh_gate_inp: np.ndarray | None  # [D]  qwen2moe shared-expert gate
    sh_gate: Weight | None          # (Fs, D)
    sh_up: Weight | None            # (Fs, D)
    sh_down: Weight | None          # (D, Fs)


@dataclass(eq=False)
class DenseWeights:
    tok_embd: Weight       # (V, D)
    output_norm: np.ndarray  # [D]
    output: Weight         # (V, D); the same object as tok_embd when tied
    layers: list[LayerWeights]

    @property
    def nbytes(self) -> int:
        seen: dict[int, int] = {}

        def add(a):
            if a is None:
                return
            arr = a.raw if isinstance(a, Weight) else a
            seen[id(arr)] = arr.nbytes

        for a in (self.tok_embd, self.output_norm, self.output):
            add(a)
        for lw in self.layers:
            for a in vars(lw).values():
                if isinstance(a, (Weight, np.ndarray)):
                    add(a)
        return sum(seen.values())


def load_dense(f, cfg: ModelConfig, progress: Callable[[int], None] | None = None) -> DenseWeights:
    """Validate every tensor's shape and type, then read the dense ones. Experts are only checked.

    Validation of the whole tensor table happens before the first read, so a bad file fails fast
    without having allocated anything large."""
    D, V, E, F = cfg.n_embd, cfg.n_vocab, cfg.n_expert, cfg.n_ff_exp
    qd, kd, vd = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_head_kv * cfg.head_dim_v
    od = cfg.n_head * cfg.head_dim_v
    norm_q = {"full": (qd,), "head": (cfg.head_dim,)}.get(cfg.qk_norm)
    norm_k = {"full": (kd,), "head": (cfg.head_dim,)}.get(cfg.qk_norm)

    want: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if not cfg.tied_output:
        want["output.weight"] = (V, D)
    for l in range(cfg.n_layers):
        b = f"blk.{l}."
        want |= {
            b + "attn_norm.weight": (D,), b + "attn_q.weight": (qd, D), b + "attn_k.weight": (kd, D),
            b + "attn_v.weight": (vd, D), b + "attn_output.weight": (D, od), b + "ffn_norm.weight": (D,),
            b + "ffn_gate_inp.weight": (E, D), b + "ffn_gate_exps.weight": (E, F, D),
            b + "ffn_up_exps.weight": (E, F, D), b + "ffn_down_exps.weight": (E, D, F),
        }
        if cfg.qkv_bias:
            want |= {b + "attn_q.bias": (qd,), b + "attn_k.bias": (kd,), b + "attn_v.bias": (vd,)}
        if norm_q:
            want |= {b + "attn_q_norm.weight": norm_q, b + "attn_k_norm.weight": norm_k}
        if cfg.n_ff_shexp:
            Fs = cfg.n_ff_shexp
            want |= {b + "ffn_gate_inp_shexp.weight": (D,), b + "ffn_gate_shexp.weight": (Fs, D),
                     b + "ffn_up_shexp.weight": (Fs, D), b + "ffn_down_shexp.weight": (D, Fs)}
    for name, shape in want.items():
        info = f.tensor(name)  # raises ModelFileError naming a missing tensor
        if tuple(info.shape) != shape:
            raise ModelFileError(f.path, f"tensor {name} shape", f"{shape} (numpy order)", tuple(info.shape))
        if info.qtype not in SUPPORTED:
            raise ModelFileError(f.path, f"tensor {name} type", "a supported type", type_name(info.qtype))

    done = 0

    def read(name: str):
        nonlocal done
        raw = f.read(name)
        done += raw.nbytes
        if progress:
            progress(raw.nbytes)
        return raw

    def weight(name: str) -> Weight:
        info = f.tensors[name]
        return Weight(name, read(name), info.qtype, tuple(info.shape))

    def vector(name: str) -> np.ndarray:
        info = f.tensors[name]
        return np.ascontiguousarray(dequantize(read(name), info.qtype, tuple(info.shape)), dtype=np.float32)

    def opt(name: str, fn):
        return fn(name) if name in want else None

    tok = weight("token_embd.weight")
    layers = []
    for l in range(cfg.n_layers):
        b = f"blk.{l}."
        layers.append(LayerWeights(
            attn_norm=vector(b + "attn_norm.weight"),
            wq=weight(b + "attn_q.weight"), wk=weight(b + "attn_k.weight"),
            wv=weight(b + "attn_v.weight"), wo=weight(b + "attn_output.weight"),
            bq=opt(b + "attn_q.bias", vector), bk=opt(b + "attn_k.bias", vector), bv=opt(b + "attn_v.bias", vector),
            q_norm=opt(b + "attn_q_norm.weight", vector), k_norm=opt(b + "attn_k_norm.weight", vector),
            ffn_norm=vector(b + "ffn_norm.weight"),
            router=vector(b + "ffn_gate_inp.weight"),
            experts=ExpertTypes(*(f.tensors[b + f"ffn_{p}_exps.weight"].qtype for p in ("gate", "up", "down"))),
            sh_gate_inp=opt(b + "ffn_gate_inp_shexp.weight", vector),
            sh_gate=opt(b + "ffn_gate_shexp.weight", weight), sh_up=opt(b + "ffn_up_shexp.weight", weight),
            sh_down=opt(b + "ffn_down_shexp.weight", weight),
        ))
    return DenseWeights(
        tok_embd=tok,
        output_norm=vector("output_norm.weight"),
        output=tok if cfg.tied_output else weight("output.weight"),
        layers=layers,
    )


def dense_tensor_names(f) -> list[str]:
    """Every tensor that is not a routed expert (what `clutor info` counts as dense)."""
    return [n for n in f.tensors if not n.endswith("_exps.weight")]
