"""The GGML weight types Clutor reads: one table, keyed by gguf-py's GGMLQuantizationType.

Per type, ``TYPES`` says which Clutor kernel multiplies it (or that none does), the activation block
of the int8 path, and how it is dequantised where no kernel runs. Its block geometry is gguf-py's
``GGML_QUANT_SIZES`` (not retyped here). Everything else derives from this table: the types the
GGUF parser accepts, quants.SUPPORTED, the kernels' per-type code (kernels/drivers.py FORMATS),
names in messages and ``clutor info``.

A type without a kernel works, but slowly: every product dequantises the whole weight with gguf-py's
numpy reference, per call (quants.matmul). ``clutor info`` says so for each such type in a file.
Whether a kernel really runs is decided on the machine (``kernels.has_kernel``: F16 has none on an
x86 CPU without F16C); this module imports no numba, so the parser and ``quants`` stay cheap to import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ..errors import ClutorError

__all__ = ["QT", "WeightType", "TYPES", "SUPPORTED", "weight_type", "type_name", "row_bytes"]


def _view_f32(rows: np.ndarray, qtype: QT) -> np.ndarray:
    return rows.view(np.float32)


def _numpy_f16(rows: np.ndarray, qtype: QT) -> np.ndarray:
    return rows.view(np.float16).astype(np.float32)


def _gguf_py(rows: np.ndarray, qtype: QT) -> np.ndarray:
    from gguf import quants

    return quants.dequantize(rows, qtype).astype(np.float32, copy=False)


@dataclass(frozen=True)
class WeightType:
    qtype: QT
    # "blas": used in place by BLAS (F32); "floats" | "legacy" | "kquants" | "iquants": the module of
    # clutor.model.kernels whose FORMATS[name] describes its blocks; None: no kernel (dequantised per call)
    kernel: str | None
    q8_block: int | None = None  # int8 path: activation elements per scale (Q8_0-style 32, Q8_K-style 256)
    # uint8 rows [R, row_bytes] -> float32 [R, row elements], equal to gguf-py's reference
    dequantiser: Callable[[np.ndarray, QT], np.ndarray] = _gguf_py

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def block(self) -> int:
        """Elements per block (gguf-py's GGML_QUANT_SIZES)."""
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]

    def dequantize(self, rows: np.ndarray) -> np.ndarray:
        """uint8 [R, row_bytes] -> float32 [R, row elements]."""
        return self.dequantiser(rows, self.qtype)


TYPES: dict[QT, WeightType] = {t.qtype: t for t in (
    WeightType(QT.F32, "blas", dequantiser=_view_f32),
    WeightType(QT.F16, "floats", dequantiser=_numpy_f16),
    WeightType(QT.BF16, "floats"),
    WeightType(QT.Q8_0, "legacy", 32),
    WeightType(QT.Q4_0, "legacy", 32),
    WeightType(QT.Q4_1, "legacy", 32),
    WeightType(QT.Q5_0, "legacy", 32),
    WeightType(QT.Q5_1, "legacy", 32),
    WeightType(QT.IQ4_NL, "legacy", 32),
    WeightType(QT.MXFP4, "legacy", 32),
    WeightType(QT.Q4_K, "kquants", 256),
    WeightType(QT.Q5_K, "kquants", 256),
    WeightType(QT.Q6_K, "kquants", 256),
    WeightType(QT.IQ3_XXS, "iquants", 256),
    WeightType(QT.IQ3_S, "iquants", 256),
    WeightType(QT.IQ2_XXS, "iquants", 256),
    WeightType(QT.IQ2_XS, "iquants", 256),
    WeightType(QT.IQ2_S, "iquants", 256),
    WeightType(QT.IQ1_S, "iquants", 256),
    WeightType(QT.IQ1_M, "iquants", 256),
    WeightType(QT.Q2_K, "kquants", 256),
    WeightType(QT.Q3_K, "kquants", 256),
    WeightType(QT.IQ4_XS, "kquants", 256),
)}

SUPPORTED: frozenset[QT] = frozenset(TYPES)


def type_name(qtype: int) -> str:
    """'Q4_K' for 12; 'unknown type N' for an id gguf-py does not know."""
    try:
        return QT(qtype).name
    except ValueError:
        return f"unknown type {qtype}"


def weight_type(qtype: int) -> WeightType:
    """The table's entry for a type id; a ClutorError for a type Clutor does not read."""
    try:
        return TYPES[QT(qtype)]
    except (ValueError, KeyError):
        raise ClutorError(f"{type_name(qtype)} weights are not supported (supported: "
                          + ", ".join(t.name for t in TYPES.values()) + ")") from None


def row_bytes(qtype: int, n_cols: int) -> int:
    """Bytes of one row of n_cols elements (a multiple of the type's block)."""
    t = weight_type(qtype)
    if n_cols % t.block:
        raise ClutorError(f"a {t.name} row must hold a multiple of {t.block} elements, got {n_cols}")
    return n_cols // t.block * t.block_bytes
