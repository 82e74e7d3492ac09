"""Clutor: run Mixture-of-Experts GGUF models larger than RAM.

    async with clutor.Model.open("model.gguf") as model:
        async for out in model.generate("Once upon a time", max_tokens=64):
            print(out.text, end="")
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import (BudgetError, ClosedError, ClutorError, ClutorIOError, ExpertReadError, ModelFileError,  # noqa: F401
                     QueueFullError, UnsupportedError)
from .errors import __all__ as _error_names  # the error hierarchy, exported whole

if TYPE_CHECKING:
    from .model.generate import GenerationChunk, GenerationStats, IOReport
    from .model.model import Model
    from .model.tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "Model",
    "Tokenizer",
    "GenerationChunk",
    "GenerationStats",
    "IOReport",
    *_error_names,
]

# Imported on first use (numpy, numba and the kernels take a noticeable fraction of a second): the
# command line starts at once, and a Ctrl-C during those imports reaches its handler, not the
# interpreter's traceback printer.
_LAZY = {
    "Model": ".model.model",
    "Tokenizer": ".model.tokenizer",
    "GenerationChunk": ".model.generate",
    "GenerationStats": ".model.generate",
    "IOReport": ".model.generate",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'clutor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
