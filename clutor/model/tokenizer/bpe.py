"""Byte-level BPE (``tokenizer.ggml.model = gpt2``): GPT-2's byte alphabet and the merges.

Words come from the pre-tokenizer (pretokenize.py); each word's UTF-8 bytes are written in GPT-2's
byte alphabet and merged pair by pair, lowest merge rank first (ties: leftmost), never across words.
The merge loop itself runs in Hugging Face ``tokenizers`` (a BPE model built from the GGUF tables),
which merges exactly like llama.cpp and is much faster than Python. With ``ignore_merges`` (the
Llama-3 family) a word that is itself a vocabulary entry is taken whole, as llama.cpp does.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models, pre_tokenizers

from ...errors import ModelFileError

__all__ = ["ByteLevelBPE", "SpaceBPE", "token_text_bytes", "raw_bytes"]


def raw_bytes(text: str) -> bytes:
    """The bytes a vocabulary string was stored as: the GGUF reader keeps bytes that are not UTF-8 as
    surrogate escapes (U+DC80..U+DCFF), which this undoes; any other lone surrogate is passed through."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE.

    Bytes that are printable Latin-1 stand for themselves; the other 68 are moved to U+0100 and
    up, in byte order, so that every token string is printable and contains no whitespace.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return table


BYTE_TO_CHAR = _byte_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
# str.translate table: alphabet char -> the Latin-1 char of its byte, so `.encode("latin-1")` gives
# the raw bytes. Code points < 256 that are NOT in the alphabet map above U+00FF, which makes the
# latin-1 encode fail and sends that token down the slow, careful path.
_UNMAP = {ord(c): chr(b) for c, b in _CHAR_TO_BYTE.items()}
for _cp in range(256):
    if chr(_cp) not in _CHAR_TO_BYTE:
        _UNMAP[_cp] = "\u0100"


def token_text_bytes(text: str) -> bytes:
    """The raw bytes a normal token's text stands for (GPT-2 alphabet undone), as llama.cpp prints it:
    a character outside the alphabet (a malformed vocabulary) shows as "[UNK_BYTE_0x<hex><text>]"."""
    try:
        return text.translate(_UNMAP).encode("latin-1")
    except UnicodeEncodeError:
        out = bytearray()
        for c in text:
            b = _CHAR_TO_BYTE.get(c)
            if b is not None:
                out.append(b)
            else:
                # llama.cpp reads a byte that is not UTF-8 as U+FFFD (EF BF BD)
                utf8 = c.encode("utf-8") if _valid(c) else "\ufffd".encode("utf-8")
                out += b"[UNK_BYTE_0x" + utf8.hex().encode() + raw_bytes(text) + b"]"
        return bytes(out)


def _valid(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


class ByteLevelBPE:
    def __init__(self, text_to_id: Mapping[str, int], merges: Sequence[tuple[str, str]], ignore_merges: bool,
                 path: str):
        # Entries that are not valid Unicode (bytes kept as surrogate escapes) can never be formed from
        # the alphabet, so leaving them (and merges naming them) out changes nothing; HF refuses them.
        vocab = {t: i for t, i in text_to_id.items() if _valid(t)}
        merges = [m for m in merges if _valid(m[0]) and _valid(m[1])]
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges)
        except Exception as e:  # tokenizers raises plain Exception for merges naming unknown tokens
            raise ModelFileError(path, "tokenizer.ggml.merges", "merges of tokens in the vocabulary", e) from e
        hf = _HFTokenizer(bpe)
        # The words are already split: only map their bytes to the alphabet, do not split again.
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self._hf = hf

    def encode(self, words: list[str], out: list[int]) -> None:
        """Append the ids of the pre-tokenized ``words`` (plain text, not yet byte-mapped) to ``out``."""
        if words:
            # encode_batch, not encode: it releases the GIL while it runs (encode holds it throughout:
            # half a second per megabyte of prompt in which no other thread, the event loop's included, runs)
            out.extend(self._hf.encode_batch([words], is_pretokenized=True, add_special_tokens=False)[0].ids)


class SpaceBPE:
    """SentencePiece-style BPE (``tokenizer.ggml.model = gemma4``), as llama.cpp runs it: spaces
    written as U+2581, the text cut into runs of newlines and runs of anything else (a run of newlines
    that is itself a token is taken whole), each run merged over its characters by merge rank, and
    whatever no token spells written as byte tokens <0xXX>."""

    _RUNS = re.compile(r"[^\n]+|\n+")

    def __init__(self, text_to_id: Mapping[str, int], merges: Sequence[tuple[str, str]], path: str):
        vocab = {t: i for t, i in text_to_id.items() if _valid(t)}
        merges = [m for m in merges if _valid(m[0]) and _valid(m[1])]
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, byte_fallback=True)
        except Exception as e:
            raise ModelFileError(path, "tokenizer.ggml.merges", "merges of tokens in the vocabulary", e) from e
        self._hf = _HFTokenizer(bpe)
        self._text_to_id = text_to_id

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of plain ``text`` (spaces not yet escaped) to ``out``."""
        words = self._RUNS.findall(text.replace(" ", "\u2581"))
        todo: list[str] = []
        for w in words:
            if w[0] == "\n" and w in self._text_to_id:
                if todo:
                    out.extend(self._hf.encode_batch([todo], is_pretokenized=True, add_special_tokens=False)[0].ids)
                    todo = []
                out.append(self._text_to_id[w])
            else:
                todo.append(w)
        if todo:
            out.extend(self._hf.encode_batch([todo], is_pretokenized=True, add_special_tokens=False)[0].ids)
