"""The resident (dense) part of a model, read once at open into memory the process owns, and the
description of the routed experts that stay on disk. Which tensors there are is the architecture's
business (clutor.model.arch: ``layer_tensors``); this module validates and reads them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import ModelFileError
from .quants import SUPPORTED, Weight, dequantize, type_name

__all__ = ["LayerWeights", "ExpertTypes", "DenseWeights", "load_dense", "expert_layout", "resident_bytes"]


@dataclass(frozen=True)
class ExpertTypes:
    """Types of one layer's routed expert matrices (each expert's slab has the tensor's type)."""

    gate: int  # slab shape (F, D)
    up: int    # slab shape (F, D)
    down: int  # slab shape (D, F)


class LayerWeights:
    """One layer's resident tensors, one attribute per entry of the architecture's layer_tensors:
    a Weight (matrices, kept in their file type) or a float32 array (norms, biases, routers).
    A tensor the file does not have, or the architecture does not read, is None. ``experts`` is
    the routed experts' types in a MoE layer (None in a dense layer)."""

    experts: ExpertTypes | None = None

    def __init__(self, **tensors):
        self.__dict__.update(tensors)

    def __getattr__(self, name: str):  # only called for attributes not set: an absent tensor
        if name.startswith("__"):
            raise AttributeError(name)
        return None


@dataclass(eq=False)
class DenseWeights:
    tok_embd: Weight       # (V, D)
    output_norm: np.ndarray  # [D]
    output: Weight         # (V, D); the same object as tok_embd when tied
    layers: list[LayerWeights]

    def matrices(self):
        """Every resident Weight (a tied output once)."""
        seen: set[int] = set()
        for a in [self.tok_embd, self.output] + [a for lw in self.layers for a in vars(lw).values()]:
            if isinstance(a, Weight) and id(a) not in seen:
                seen.add(id(a))
                yield a

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


def _tables(arch) -> list[dict]:
    """The architecture's tensor tables: the global one, then one per layer."""
    return [arch.global_tensors()] + [arch.layer_tensors(l) for l in range(arch.cfg.n_layers)]


def check_tensors(f, arch) -> None:
    """Every tensor the architecture reads is in the file (unless optional) with the expected shape
    and a supported type; then the architecture's own checks. Nothing is read."""
    for table in _tables(arch):
        for t in table.values():
            if t.name not in f.tensors and not t.required:
                continue
            info = f.tensor(t.name)  # raises ModelFileError naming a missing tensor
            if _squeezed(info.shape, len(t.shape)) != t.shape:
                raise ModelFileError(f.path, f"tensor {t.name} shape", f"{t.shape} (numpy order)", tuple(info.shape))
            if info.qtype not in SUPPORTED:
                raise ModelFileError(f.path, f"tensor {t.name} type", "a supported type", type_name(info.qtype))
    arch.check_file(f)


def _squeezed(shape, n: int) -> tuple[int, ...]:
    """A file's numpy shape without leading 1s beyond n dims (ggml's trailing ne of 1: llama.cpp's
    converter writes a [n_embd] gate as ne {n_embd, 1}, which llama.cpp reads as {n_embd})."""
    shape = tuple(shape)
    while len(shape) > n and shape[0] == 1:
        shape = shape[1:]
    return shape


def load_dense(f, arch, progress: Callable[[int], None] | None = None) -> DenseWeights:
    """Validate every tensor's shape and type, then read the resident ones. Experts are only checked.

    Validation of the whole tensor table happens before the first read, so a bad file fails fast
    without having allocated anything large."""
    check_tensors(f, arch)

    def load(t):
        if t.name not in f.tensors:
            return None
        info = f.tensors[t.name]
        raw = f.read(t.name)
        if progress:
            progress(raw.nbytes)
        if t.kind == "weight":
            return Weight(t.name, raw, info.qtype, tuple(info.shape))
        if t.kind == "heads":  # [H, R, K]: one matrix per head, rows of all heads in one Weight [H * R, K]
            return Weight(t.name, raw, info.qtype, (int(np.prod(info.shape[:-1])), int(info.shape[-1])))
        return np.ascontiguousarray(dequantize(raw, info.qtype, tuple(info.shape)), dtype=np.float32).reshape(t.shape)

    glob, *layer_tables = _tables(arch)
    glob = {k: load(t) for k, t in glob.items()}
    arch.prepare_global(glob)
    layers = []
    for table in layer_tables:
        lw = LayerWeights(**{k: load(t) for k, t in table.items() if t.resident})
        lw.experts = _expert_types(f, table)
        arch.prepare(lw)
        layers.append(lw)
    return DenseWeights(tok_embd=glob["tok_embd"], output_norm=glob["output_norm"],
                        output=glob["tok_embd"] if glob.get("output") is None else glob["output"], layers=layers)


def _expert_types(f, table: dict) -> ExpertTypes | None:
    """The routed expert matrices' types in this layer (gate and up share one when fused), or None."""
    qtype = {t.part: f.tensors[t.name].qtype for t in table.values() if t.kind == "expert"}
    if not qtype:
        return None
    if "gate+up" in qtype:
        qtype["gate"] = qtype["up"] = qtype["gate+up"]
    return ExpertTypes(qtype.get("gate", qtype["up"]), qtype["up"], qtype["down"])


_SLAB_ORDER = ("gate", "gate+up", "up", "down", "gate bias", "up bias", "down bias")  # clutor.io.layout.PARTS


def expert_layout(f, arch):
    """Where each routed expert's slabs lie in the file (clutor.io.layout.ExpertLayout), for the
    architecture's MoE layers in order: built from the expert entries of its tensor table."""
    cfg = arch.cfg
    layers = []
    for l in cfg.moe_layers:
        parts = [t for t in arch.layer_tensors(l).values() if t.kind == "expert"]
        parts.sort(key=lambda t: _SLAB_ORDER.index(t.part))
        layers.append([(t.name, t.part) for t in parts])
    return f.expert_slabs(layers, cfg.n_expert)


def resident_bytes(f, arch) -> int:
    """Bytes of the tensors load_dense reads (what stays in memory; MTP layers a file may carry and
    routed experts are not among them)."""
    names = {t.name for table in _tables(arch) for t in table.values() if t.resident}
    return sum(f.tensors[n].nbytes for n in names if n in f.tensors)
