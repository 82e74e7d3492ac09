"""How the matrix kernels compute: one small value a model owns and hands to every product it runs.

Nothing about it is process-wide: two models in one process may use different settings, and
importing Clutor changes nothing in the host process. ``Model.open(activations=..., threads=...)``
builds one; ``clutor.model.kernels`` functions take one (``DEFAULT`` when not given).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

from ..errors import ClutorError

__all__ = ["KernelSettings", "DEFAULT", "ACTIVATIONS"]

ACTIVATIONS = ("auto", "q8", "f32")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class KernelSettings:
    """activations: "q8" rounds activations to int8 blocks and multiplies with integer dot products
    (what llama.cpp computes on CPUs; needs x86 AVX2, elsewhere f32 is used); "f32" multiplies the
    dequantised weights by float activations (exact up to float rounding); "auto" (default) is the
    faster of the two where the machine has int8 SIMD (clutor.model.kernels: ``mode``).
    threads: threads one product is split over (None: the CPUs this process may use).
    blas_min_tokens: token count from which a product is dequantised and handed to BLAS (None: the
    measured default, clutor.model.kernels._BLAS_MIN_T).
    ggml_f16: in the q8 mode, F16 products summed in llama.cpp's own order, bit for bit
    (kernels/f16dots.py): 4x slower than BLAS at one token, ~20x in a prefill. Set by Model.open for
    the architectures whose F16 files need it to stay within 0.02 of llama.cpp's logits (Gemma 4:
    its every product rounds its input to half, so one ulp grows layer by layer); False: rounded
    activations times the weights through the float kernels or BLAS."""

    activations: str = "auto"
    threads: int | None = None
    blas_min_tokens: int | None = None
    ggml_f16: bool = False

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise ClutorError(f"activations: expected one of {', '.join(ACTIVATIONS)}, got {self.activations!r}")
        for name in ("threads", "blas_min_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ClutorError(f"{name}: expected an integer >= 1 or None, got {v!r}")

    @cached_property
    def n_threads(self) -> int:
        """Asked once per settings, not per product (a syscall on the kernels' hot path)."""
        return self.threads if self.threads is not None else _cpus()


DEFAULT = KernelSettings()
