"""One error hierarchy for everything Clutor raises on purpose.

Every message says where (file, field or offset), what was expected, and what was found, so the
CLI can print ``str(err)`` and exit without a traceback.
"""
from __future__ import annotations

import os

__all__ = [
    "ClutorError",
    "ModelFileError",
    "UnsupportedError",
    "ClutorIOError",
    "ExpertReadError",
    "BudgetError",
    "QueueFullError",
    "ClosedError",
]


class ClutorError(Exception):
    """Base class of every error Clutor raises deliberately."""


class ModelFileError(ClutorError):
    """A model or vocabulary file is malformed: wrong magic, truncated, missing or mis-shaped tensor."""

    def __init__(self, path: str | os.PathLike, field: str, expected: str, got: object = None):
        self.path = os.fspath(path)
        self.field = field
        self.expected = expected
        self.got = got
        msg = f"{self.path}: {field}: expected {expected}"
        if got is not None:
            msg += f", got {got}"
        super().__init__(msg)


class UnsupportedError(ModelFileError):
    """The file is well-formed but uses something Clutor does not implement (architecture, type, tokenizer)."""


class ClutorIOError(ClutorError):
    """A read failed or came back short."""

    def __init__(self, path: str | os.PathLike, offset: int, length: int, reason: str):
        self.path = os.fspath(path)
        self.offset = offset
        self.length = length
        self.reason = reason
        super().__init__(f"{self.path}: read of {length} bytes at offset {offset} failed: {reason}")


class ExpertReadError(ClutorIOError):
    """Reading one routed expert failed: ``layer`` (the expert store's layer) and ``expert`` say which,
    so that only the requests routed to it fail."""

    def __init__(self, path: str | os.PathLike, offset: int, length: int, reason: str, layer: int, expert: int):
        super().__init__(path, offset, length, reason)
        self.layer = layer
        self.expert = expert


class BudgetError(ClutorError):
    """A memory budget is too small for what must fit in it."""


class QueueFullError(ClutorError):
    """The model's engine holds as many waiting requests as it was told to (``max_queue``);
    ``retry_after``: whole seconds after which a place is likely free."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ClosedError(ClutorError):
    """The object was used after aclose()."""
