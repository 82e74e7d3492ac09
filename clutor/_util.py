"""Small helpers with no better home."""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")


class AwaitableContext(Generic[T]):
    """``await f(...)`` or ``async with f(...) as x`` for a coroutine that opens something with aclose().

    The asyncpg-pool idiom: one call supports both forms, and the context form always closes."""

    __slots__ = ("_factory", "_obj")

    def __init__(self, factory: Callable[[], Awaitable[T]]):
        self._factory = factory
        self._obj: Any = None

    def __await__(self):
        return self._factory().__await__()

    async def __aenter__(self) -> T:
        self._obj = await self._factory()
        return self._obj

    async def __aexit__(self, *exc) -> None:
        obj, self._obj = self._obj, None
        if obj is not None:
            await obj.aclose()
