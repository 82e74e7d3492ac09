"""Clutor: run Mixture-of-Experts GGUF models larger than RAM.

    async with clutor.Model.open("model.gguf") as model:
        async for out in model.generate("Once upon a time", max_tokens=64):
            print(out.text, end="")
"""
from __future__ import annotations

from .errors import BudgetError, ClosedError, ClutorError, ClutorIOError, ModelFileError, UnsupportedError
from .model.generate import GenerationChunk, GenerationStats, IOReport
from .model.model import Model
from .model.sampling import SamplingParams
from .model.tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "Model",
    "Tokenizer",
    "GenerationChunk",
    "GenerationStats",
    "IOReport",
    "SamplingParams",
    "ClutorError",
    "ModelFileError",
    "UnsupportedError",
    "ClutorIOError",
    "BudgetError",
    "ClosedError",
]
