"""llguidance's view of a Clutor vocabulary: every token's bytes, which are special, which end a reply.

Built from Clutor's own tables (``Tokenizer.token_bytes``), not from a Hugging Face tokenizer: the
bytes each id stands for are exactly what our decoder shows. Control tokens (no text in a plain
decode: ``<|im_end|>``, ``[TOOL_CALLS]``) are marked special (a 0xFF byte first, llguidance's
convention), so a grammar names them as tokens (``<|im_end|>``) and no spelling in bytes produces
them. The end-of-generation ids are the tokenizer's stop ids: a finished grammar allows only those.
"""
from __future__ import annotations

import threading
import weakref

__all__ = ["ll_tokenizer"]

_cache: "weakref.WeakKeyDictionary[object, object]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class _Tables:
    """The duck-typed tokenizer llguidance's TokenizerWrapper reads."""

    def __init__(self, tok):
        self._tok = tok
        tokens, special = [], []
        for i in range(tok.n_vocab):
            plain, shown = tok.token_bytes(i), tok.token_bytes(i, special=True)
            if not plain and shown:
                special.append(i)
                shown = b"\xff" + shown
            tokens.append(shown)
        self.tokens = tokens
        self.special_token_ids = special
        stops = sorted(tok.stop_ids)
        self.eos_token_id = stops[0] if stops else tok.eos_id
        self.bos_token_id = tok.bos_id
        self.stops = stops

    def __call__(self, text) -> list[int]:
        # llguidance tokenizes forced text with this (bytes, maybe ending inside a character)
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="surrogateescape")
        return self._tok.encode(text, add_bos=False)


def ll_tokenizer(tokenizer):
    """The llguidance LLTokenizer of ``tokenizer`` (built once per tokenizer: ~0.6 s at 150k tokens)."""
    from llguidance import LLTokenizer
    from llguidance._tokenizer import TokenizerWrapper

    with _lock:
        ll = _cache.get(tokenizer)
        if ll is None:
            tables = _Tables(tokenizer)
            ll = LLTokenizer(TokenizerWrapper(tables), eos_token=tables.stops or None)
            _cache[tokenizer] = ll
        return ll
