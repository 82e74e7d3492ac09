"""Byte-level BPE tokenizer built from a GGUF file's tables, and a streaming detokenizer.

llama.cpp is the reference: ``encode`` must give the ids llama.cpp gives, ``decode`` the text its
``token_to_piece`` gives. The BPE itself runs in Hugging Face ``tokenizers`` (a BPE model built from
``tokenizer.ggml.tokens`` + ``tokenizer.ggml.merges`` behind the split regex of
``tokenizer.ggml.pre``); the special-token partition is done here, the way llama.cpp does it:

- user-defined tokens (type 4) are always matched in the text, as llama.cpp and HF do;
- control / unknown tokens (types 3, 2) are matched only when ``special=True``; with
  ``special=False`` their text ("<|im_end|>") is tokenized as ordinary bytes;
- matching tries the longest special text first over the whole text, then the next, and so on;
- a token whose text ends a turn ("<|im_end|>", "</s>", ...) counts as control whatever its type
  in the file, and is a stop token (llama.cpp's end-of-generation rule).

Decoding works on bytes: every id maps to the raw bytes it stands for (the byte-level alphabet
undone), and bytes become text only at the end (``decode``) or when a UTF-8 character is complete
(``StreamDecoder``).
"""
from __future__ import annotations

import codecs
import os
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from ..errors import ClutorError, ModelFileError, UnsupportedError
from .config import MAX_VOCAB

__all__ = ["Tokenizer", "StreamDecoder"]

# tokenizer.ggml.token_type values (gguf-py TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex (see shared/notes/gguf-moe.md, checked against llama.cpp)
_SPLIT_PATTERNS: dict[str, str] = {"gpt-2": _GPT2_SPLIT, "olmo": _GPT2_SPLIT, "qwen2": _QWEN2_SPLIT}
_MODELS = ("gpt2",)

# Texts that end a turn in the chat formats we meet (a subset of llama.cpp's end-of-generation list).
_STOP_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<|end_of_text|>", "</s>")


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


_BYTE_TO_CHAR = _byte_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
# str.translate table: alphabet char -> the Latin-1 char of its byte, so `.encode("latin-1")` gives
# the raw bytes. Code points < 256 that are NOT in the alphabet map above U+00FF, which makes the
# latin-1 encode fail and sends that token down the slow, careful path.
_UNMAP = {ord(c): chr(b) for c, b in _CHAR_TO_BYTE.items()}
for _cp in range(256):
    if chr(_cp) not in _CHAR_TO_BYTE:
        _UNMAP[_cp] = "\u0100"


def _normal_token_bytes(text: str) -> bytes:
    try:
        return text.translate(_UNMAP).encode("latin-1")
    except UnicodeEncodeError:
        # A character outside the byte alphabet (malformed vocab): keep it as its own UTF-8 rather
        # than dropping it (llama.cpp prints an "[UNK_BYTE_..]" marker instead).
        return b"".join(
            bytes((_CHAR_TO_BYTE[c],)) if c in _CHAR_TO_BYTE else c.encode("utf-8") for c in text
        )


class Tokenizer:
    """A GGUF byte-level BPE vocabulary: ``encode`` text to ids, ``decode`` ids to text."""

    def __init__(
        self,
        *,
        path: str,
        tokens: list[str],
        token_types: list[int],
        merges: list[tuple[str, str]],
        pre: str,
        bos_id: int | None,
        eos_id: int | None,
        eot_id: int | None,
        add_bos: bool,
        chat_template: str | None,
    ):
        self.path = path
        self.pre = pre
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._tokens = tokens
        self._bos_id, self._eos_id, self._eot_id = bos_id, eos_id, eot_id

        # Where a token string appears twice, the first id wins (shared/notes/gguf-moe.md).
        text_to_id: dict[str, int] = {}
        for i, t in enumerate(tokens):
            text_to_id.setdefault(t, i)
        self._text_to_id = text_to_id

        # llama.cpp treats a token with an end-of-turn text as a control token whatever its type
        # (Qwen2's vocab has "</s>" as an ordinary token, 128247): it ends generation, decodes to
        # nothing unless special, and is parsed from text only with special=True.
        stop_by_text = {text_to_id[t] for t in _STOP_TEXTS if t in text_to_id}
        token_types = list(token_types)
        for i in stop_by_text:
            token_types[i] = _CONTROL
        self.stop_ids: frozenset[int] = frozenset(
            stop_by_text | {i for i in (eos_id, eot_id) if i is not None}
        )

        try:
            bpe = models.BPE(vocab=text_to_id, merges=merges)
        except Exception as e:  # tokenizers raises plain Exception for merges naming unknown tokens
            raise ModelFileError(path, "tokenizer.ggml.merges", "merges of tokens in the vocabulary", e) from e
        hf = _HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PATTERNS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        hf.decoder = decoders.ByteLevel()
        self._hf = hf

        # id -> raw bytes of its piece when special tokens are hidden; control/unknown text apart.
        plain: list[bytes] = []
        special_text: dict[int, bytes] = {}
        for i, (t, ty) in enumerate(zip(tokens, token_types)):
            if ty in (_NORMAL, _BYTE):
                plain.append(_normal_token_bytes(t))
            elif ty == _USER_DEFINED:
                plain.append(t.encode("utf-8"))
            else:
                plain.append(b"")
                if ty in (_CONTROL, _UNKNOWN):
                    special_text[i] = t.encode("utf-8")
        self._plain = plain
        self._special_text = special_text

        # Specials matched in the text, longest (in bytes) first, like llama.cpp's partition.
        def ordered(kinds: tuple[int, ...]) -> tuple[tuple[str, int], ...]:
            ids = [i for i, ty in enumerate(token_types) if ty in kinds and tokens[i]]
            ids.sort(key=lambda i: (-len(tokens[i].encode("utf-8")), i))
            return tuple((tokens[i], i) for i in ids)

        self._match_special = ordered((_CONTROL, _USER_DEFINED, _UNKNOWN))
        self._match_plain = ordered((_USER_DEFINED,))
        self._any_special = _any_of(self._match_special)
        self._any_user = _any_of(self._match_plain)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Read the tokenizer tables of a GGUF file (a full model or a vocab-only file)."""
        path = os.fspath(path)
        from .gguf import GGUFFile

        with GGUFFile.open(path) as f:
            return cls.from_metadata(f.metadata, os.fspath(path))

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, object], path: str) -> "Tokenizer":
        """Build from GGUF metadata (key -> Python value); ``path`` is only used in error messages."""
        model = metadata.get("tokenizer.ggml.model")
        if model not in _MODELS:
            raise UnsupportedError(
                path, "tokenizer.ggml.model", f"one of {', '.join(_MODELS)}", _shown(model)
            )
        pre = metadata.get("tokenizer.ggml.pre")
        if not isinstance(pre, str) or pre not in _SPLIT_PATTERNS:
            raise UnsupportedError(
                path, "tokenizer.ggml.pre", f"one of {', '.join(sorted(_SPLIT_PATTERNS))}", _shown(pre)
            )

        raw_tokens = metadata.get("tokenizer.ggml.tokens")
        if isinstance(raw_tokens, (list, tuple)) and len(raw_tokens) > MAX_VOCAB:
            # the tables built below cost ~650 bytes and ~5 us per token: refuse before building them
            raise ModelFileError(path, "tokenizer.ggml.tokens", f"at most {MAX_VOCAB} tokens", len(raw_tokens))
        tokens = _strings(metadata, "tokenizer.ggml.tokens", path)
        n = len(tokens)
        if n == 0:
            raise ModelFileError(path, "tokenizer.ggml.tokens", "a non-empty array of strings", "0 tokens")
        raw_merges = _strings(metadata, "tokenizer.ggml.merges", path)
        merges = []
        for k, m in enumerate(raw_merges):
            # llama.cpp splits at the first space after position 0, so a merge may start with " "
            cut = m.find(" ", 1)
            if cut < 0:
                raise ModelFileError(path, f"tokenizer.ggml.merges[{k}]", "'left right'", repr(m))
            merges.append((m[:cut], m[cut + 1 :]))

        types_raw = metadata.get("tokenizer.ggml.token_type")
        if types_raw is None:
            types = [_NORMAL] * n  # llama.cpp: a vocab without types is all normal tokens
        else:
            if isinstance(types_raw, (str, bytes)) or not isinstance(types_raw, (Sequence, np.ndarray)):
                raise ModelFileError(path, "tokenizer.ggml.token_type", "an array of integers", type(types_raw).__name__)
            types = []
            for k, t in enumerate(types_raw):
                # integers only: a float (even 1.0, or inf) means the array was written wrong
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                    raise ModelFileError(path, f"tokenizer.ggml.token_type[{k}]", "an integer", _shown(t))
                types.append(int(t))
            if len(types) != n:
                raise ModelFileError(
                    path, "tokenizer.ggml.token_type", f"{n} entries (one per token)", len(types)
                )

        def token_id(key: str) -> int | None:
            v = metadata.get(key)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < n:
                raise ModelFileError(path, key, f"a token id in [0, {n})", _shown(v))
            return int(v)

        bos_id = token_id("tokenizer.ggml.bos_token_id")
        eos_id = token_id("tokenizer.ggml.eos_token_id")
        eot_id = token_id("tokenizer.ggml.eot_token_id")
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))  # gpt2 vocabs: no BOS
        if add_bos and bos_id is None:
            raise ModelFileError(
                path, "tokenizer.ggml.bos_token_id", "a token id (add_bos_token is true)", "absent"
            )
        template = metadata.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ModelFileError(path, "tokenizer.chat_template", "a string", type(template).__name__)

        return cls(
            path=path,
            tokens=tokens,
            token_types=types,
            merges=merges,
            pre=str(pre),
            bos_id=bos_id,
            eos_id=eos_id,
            eot_id=eot_id,
            add_bos=add_bos,
            chat_template=template or None,
        )

    # -- properties ---------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def eot_id(self) -> int | None:
        return self._eot_id

    def token_text(self, token_id: int) -> str:
        """The token's string as stored in the vocabulary (byte-level alphabet, e.g. "Ġhello")."""
        return self._tokens[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id whose vocabulary string is ``text`` (the first one if repeated), or None."""
        return self._text_to_id.get(text)

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The raw bytes ``token_id`` stands for; control tokens give b"" unless ``special``."""
        i = self._check_id(token_id)
        if special and i in self._special_text:
            return self._special_text[i]
        return self._plain[i]

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, special: bool = False, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text`` as llama.cpp's ``llama_tokenize(text, add_special, parse_special=special)``.

        ``add_bos=None`` follows the file's ``tokenizer.ggml.add_bos_token``.
        Text that is not valid Unicode (lone surrogates, as Python gives for undecodable bytes in
        argv or a file read with errors="surrogateescape") is tokenized as its bytes decoded with
        U+FFFD for each invalid sequence, as llama.cpp's tools do with invalid UTF-8 input.
        """
        text = _valid_text(text)
        ids: list[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self._bos_id is None:
                raise ModelFileError(self.path, "tokenizer.ggml.bos_token_id", "a token id to prepend", "absent")
            ids.append(self._bos_id)
        for frag in self._partition(text, special):
            if isinstance(frag, int):
                ids.append(frag)
            else:
                ids.extend(self._hf.encode(frag, add_special_tokens=False).ids)
        return ids

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD (only after all bytes are joined)."""
        return b"".join(self.token_bytes(i, special) for i in ids).decode("utf-8", errors="replace")

    def stream(self, special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, special)

    # -- internals ----------------------------------------------------------------------------

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Split ``text`` into raw-text fragments and special-token ids (llama.cpp's st_partition)."""
        candidates, any_re = (
            (self._match_special, self._any_special) if special else (self._match_plain, self._any_user)
        )
        if not text:
            return []
        if any_re is None or any_re.search(text) is None:
            return [text]
        frags: list[str | int] = [text]
        for tok_text, tok_id in candidates:
            out: list[str | int] = []
            hit = False
            for f in frags:
                if isinstance(f, int) or tok_text not in f:
                    out.append(f)
                    continue
                hit = True
                for k, piece in enumerate(f.split(tok_text)):
                    if k:
                        out.append(tok_id)
                    if piece:
                        out.append(piece)
            if hit:
                frags = out
        return frags

    def _check_id(self, token_id: int) -> int:
        i = int(token_id)
        if not 0 <= i < len(self._tokens):
            raise ClutorError(f"{self.path}: token id {i} outside the vocabulary [0, {len(self._tokens)})")
        return i

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, pre={self.pre!r}, n_vocab={self.n_vocab})"


class StreamDecoder:
    """Turns ids into text one at a time, never emitting half a UTF-8 character.

    A token may end inside a multi-byte character; its leading bytes are held back until the
    character completes. ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self._tokenizer = tokenizer
        self._special = special
        # Python's incremental UTF-8 decoder holds back exactly an incomplete trailing sequence and
        # replaces invalid bytes the same way a one-shot bytes.decode(errors="replace") does.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became complete (maybe "")."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id, self._special))

    def flush(self) -> str:
        """Emit what is held back (an incomplete character becomes U+FFFD) and reset."""
        return self._utf8.decode(b"", final=True)


def _valid_text(text: str) -> str:
    """``text`` with lone surrogates resolved: surrogate-escaped bytes (U+DC80..U+DCFF) become the
    bytes they stand for, then every invalid UTF-8 sequence (and any other lone surrogate) U+FFFD."""
    if not isinstance(text, str):
        raise ClutorError(f"text to encode must be str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    out = bytearray()
    for ch in text:
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:
            out.append(o - 0xDC00)
        elif 0xD800 <= o <= 0xDFFF:
            out += "\ufffd".encode()
        else:
            out += ch.encode()
    return out.decode("utf-8", errors="replace")


def _any_of(candidates: Sequence[tuple[str, int]]) -> re.Pattern[str] | None:
    """One regex that finds whether any special text occurs at all (the common case is none)."""
    if not candidates:
        return None
    return re.compile("|".join(re.escape(t) for t, _ in candidates))


def _shown(v: object) -> str:
    return "(absent)" if v is None else repr(v)


def _strings(metadata: Mapping[str, object], key: str, path: str) -> list[str]:
    v = metadata.get(key)
    if v is None:
        raise ModelFileError(path, key, "an array of strings", "(absent)")
    if isinstance(v, (str, bytes)) or not isinstance(v, (Sequence, np.ndarray)):
        raise ModelFileError(path, key, "an array of strings", type(v).__name__)
    out = []
    for k, s in enumerate(v):
        if isinstance(s, bytes):
            try:
                s = s.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ModelFileError(path, f"{key}[{k}]", "UTF-8 text", repr(s)) from e
        elif not isinstance(s, str):
            raise ModelFileError(path, f"{key}[{k}]", "a string", type(s).__name__)
        out.append(s)
    return out


# -- a minimal GGUF metadata reader ----------------------------------------------------------
# Enough to open vocab-only files without the full model loader (clutor.model.gguf), and much
# faster than gguf.GGUFReader for 150k-entry string arrays.

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
