"""SentencePiece (``tokenizer.ggml.model = llama``) encoding as llama.cpp does it.

The text (spaces already escaped to "▁") starts as one symbol per character. Every pair of
neighbouring symbols whose concatenation is a vocabulary entry is a candidate; the candidate whose
entry has the highest score merges first (ties: the leftmost), and new candidates form with the new
neighbours. When nothing merges any more, each symbol is its vocabulary entry; a character that is
not an entry becomes the tokens of its UTF-8 bytes ("<0xE2>", "<0x96>", ...): byte fallback.

A merged symbol is always an entry (it was one when its pair was chosen), so only single characters
ever fall back to bytes. Entries are looked up by text whatever their type, as llama.cpp does.
"""
from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from ...errors import ClutorError

__all__ = ["SentencePiece", "SPACE"]

SPACE = "\u2581"  # "▁", SentencePiece's visible space


class SentencePiece:
    def __init__(self, text_to_id: Mapping[str, int], scores: Sequence[float], unk_id: int | None, path: str):
        self._ids = text_to_id
        self._scores = scores
        self._unk = unk_id
        self._path = path
        # byte -> token: "<0xXX>", else (ASCII only) the one-character entry, as llama.cpp's byte_to_token
        self._byte_ids: list[int | None] = [
            text_to_id.get(f"<0x{b:02X}>", text_to_id.get(chr(b)) if b < 0x80 else None) for b in range(256)
        ]

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of ``text`` (already "▁"-escaped) to ``out``."""
        n = len(text)
        if n == 0:
            return
        ids, scores = self._ids, self._scores
        # Symbol i covers text[i : i + size[i]] (merges only ever grow a symbol to the right);
        # size 0 marks a symbol merged away. nxt/prv: the linked list of live symbols.
        size = [1] * n
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))

        heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, length of the pair)
        for i in range(n - 1):
            tid = ids.get(text[i : i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)

        def candidate(left: int, right: int) -> None:
            length = size[left] + size[right]
            tid = ids.get(text[left : left + length])
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, length))

        while heap:
            _, left, right, length = heapq.heappop(heap)
            # stale when either side merged since: sizes only grow, so the sum no longer matches
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
                continue
            size[left] = length
            size[right] = 0
            nxt[left] = after = nxt[right]
            if after >= 0:
                prv[after] = left
                candidate(left, after)
            if prv[left] >= 0:
                candidate(prv[left], left)

        i = 0
        while i >= 0:
            piece = text[i : i + size[i]]
            tid = ids.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                self._bytes(piece, out)
            i = nxt[i]

    def _bytes(self, char: str, out: list[int]) -> None:
        for b in char.encode("utf-8"):
            tid = self._byte_ids[b]
            if tid is None:
                tid = self._unk
                if tid is None:
                    raise ClutorError(
                        f"{self._path}: {char!r} is not in the vocabulary and neither is byte <0x{b:02X}> "
                        "(no byte fallback) nor an unknown token"
                    )
                out.append(tid)
                return  # one unknown token for the whole character
            out.append(tid)
