"""A prompt refused before it is tokenised when it cannot fit the context (every route with a text input)."""
from __future__ import annotations

import threading
import weakref

from .errors import bad_request

__all__ = ["check_size", "longest_token_bytes"]

_LONGEST: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_LONGEST_LOCK = threading.Lock()


def longest_token_bytes(tokenizer) -> int:
    """The most bytes of text one token of ``tokenizer`` stands for (control tokens' text included:
    a chat prompt parses them), worked out once per tokenizer."""
    with _LONGEST_LOCK:
        n = _LONGEST.get(tokenizer)
        if n is None:
            n = max(max(len(tokenizer.token_bytes(i)), len(tokenizer.token_bytes(i, special=True)))
                    for i in range(tokenizer.n_vocab))
            _LONGEST[tokenizer] = n = max(n, 1)
        return n


def check_size(text: str, tokenizer, n_ctx: int, param: str, room: int = 1) -> None:
    """Refuse, before tokenising, a text that cannot fit the context with ``room`` tokens to spare (one
    to generate). Each token stands for at most ``longest_token_bytes`` bytes of the text, so its UTF-8
    length divided by that is a floor on its token count: sound (a text that fits is never refused
    here), and free next to tokenising a multi-megabyte prompt that never had a chance."""
    longest = longest_token_bytes(tokenizer)
    limit = n_ctx - room
    if 4 * len(text) <= longest * limit:  # (a character is at most 4 bytes: cannot be too long)
        return
    n_bytes = len(text.encode("utf-8", "surrogatepass"))
    floor = -(-n_bytes // longest)
    if floor > limit:
        raise bad_request(param, f"This model's maximum context length is {n_ctx} tokens, but the text is at "
                                 f"least {floor} tokens ({n_bytes} bytes, and no token of this model stands for "
                                 f"more than {longest}). Shorten it.", code="context_length_exceeded")
