"""llama-server's slot files: ``POST /slots/{id}?action=save|restore|erase`` with ``--slot-save-path DIR``.

A slot here names a sequence's tokens: a generation request that gives ``id_slot`` (llama-server's
field; without it, slot 0) leaves its prompt and generated tokens as that slot's when it ends. save
writes the KV pages the pool still holds of them to DIR/filename (clutor.model.slots: whole pages;
n_saved counts their positions); restore reads such a file back into the pool, where its pages stay
held for the slot until the slot's next request ends, the slot is erased, or another file is restored
into it, so a prompt that starts with those tokens maps them instead of computing them.
"""
from __future__ import annotations

import os
import time
import unicodedata
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from ..errors import ClutorError
from .errors import APIError, bad_request
from .responses import JSON

__all__ = ["SlotBook", "slots_route"]


@dataclass
class SlotBook:
    """Each slot's tokens and the pages a restore holds for it."""

    save_path: str | None
    tokens: dict[int, list[int]] = field(default_factory=dict)
    restored: dict[int, object] = field(default_factory=dict)  # slot -> clutor.model.slots.Restored

    def ended(self, model, slot: int | None, tokens: list[int]) -> None:
        """A generation on this slot ended, holding these tokens' positions."""
        slot = slot or 0
        self.tokens[slot] = tokens
        self._release(model, slot)

    def _release(self, model, slot: int) -> None:
        r = self.restored.pop(slot, None)
        if r is not None:
            model.release_slot(r)

    def close(self, model) -> None:
        for slot in list(self.restored):
            self._release(model, slot)


def slots_route(state):
    async def route(request: Request) -> Response:
        from .plumbing import read_json, ready

        book: SlotBook = state.slots
        if book.save_path is None:
            raise APIError(501, "This server does not support slots action: start it with --slot-save-path DIR",
                           code="not_supported")
        ready(state)
        model = state.model
        n = state.admission.max_live  # the server's parallel sequences, as llama-server's --parallel slots
        raw = request.path_params["id_slot"]
        if not raw.isdigit() or int(raw) >= n:
            raise bad_request("id_slot", f"slot id must be an integer in [0, {n}) (the sequences served at once), "
                                        f"got {raw!r}")
        slot = int(raw)
        action = request.query_params.get("action")
        if action not in ("save", "restore", "erase"):
            raise bad_request("action", f"Invalid action {action!r}: expected save, restore or erase")
        if action == "erase":
            n_erased = len(book.tokens.pop(slot, []))
            book._release(model, slot)
            return JSON({"id_slot": slot, "n_erased": n_erased})
        body = await read_json(request, state, lambda b: b)
        name = body.get("filename")
        why = filename_problem(name)
        if why:
            raise bad_request("filename", f"Invalid filename: {why}")
        path = os.path.join(book.save_path, name)
        t0 = time.perf_counter()
        if action == "save":
            try:
                saved = await model.save_slot(book.tokens.get(slot, []), path)
            except ClutorError as e:
                raise APIError(500, state.public(str(e), path), code="slot_save_failed") from None
            return JSON({"id_slot": slot, "filename": name, "n_saved": saved.n_tokens, "n_written": saved.n_bytes,
                         "timings": {"save_ms": (time.perf_counter() - t0) * 1000}})
        if not os.path.isfile(path):
            raise APIError(404, f"no slot file {name!r} in the slot save path", param="filename", code="not_found")
        try:
            restored = await model.restore_slot(path)
        except ClutorError as e:
            raise bad_request("filename", state.public(str(e), path)) from None
        book._release(model, slot)
        book.restored[slot] = restored
        book.tokens[slot] = list(restored.tokens)
        return JSON({"id_slot": slot, "filename": name, "n_restored": len(restored.tokens), "n_read": restored.n_bytes,
                     "timings": {"restore_ms": (time.perf_counter() - t0) * 1000}})

    return route


_RESERVED = set('/\\:*?"<>|')


def filename_problem(name) -> str | None:
    """Why name may not be a file name under the slot save path (None: it may), as llama.cpp decides:
    one path component of printable characters, no reserved ones, no leading or trailing space or
    trailing dot, not . or .."""
    if not isinstance(name, str) or not name:
        return "expected a non-empty string"
    if len(name.encode("utf-8")) > 255:
        return "longer than 255 bytes"
    if name in (".", "..") or name.startswith(".."):
        return "a path component, not a file name"
    if name != name.strip() or name.endswith("."):
        return "leading or trailing space, or a trailing dot"
    for ch in name:
        if ch in _RESERVED or unicodedata.category(ch)[0] == "C" or ch == "\ufeff":
            return f"it contains {ch!r}"
    return None
