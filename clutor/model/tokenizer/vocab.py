"""The vocabulary of a GGUF file: special tokens, ``encode``, ``decode`` and streaming decode.

llama.cpp is the reference: ``encode`` gives the ids ``llama_tokenize`` gives, ``token_bytes`` the
bytes ``llama_token_to_piece`` gives. What llama.cpp does around the tokenizer proper, done here:

- Token attributes come from ``tokenizer.ggml.token_type``, then llama.cpp's corrections by text: a
  token whose text ends a turn ("<|im_end|>", "</s>", "<|return|>", ...) or names a fill-in-the-middle
  role becomes control (and the end-of-turn ones, FIM pad/repo/file-separator too, stop generation);
  gpt-oss's "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>" become user-defined, and its
  "<|end|>" does not stop (it separates messages; "<|return|>"/"<|call|>" end the reply); Phi-3's
  special tokens eat the whitespace that follows them.
- Special-token partition: user-defined tokens are always cut out of the text; control and unknown
  ones only with ``special=True``. The longest special text (in bytes) is cut first everywhere, then
  the next, and so on; what remains is plain text for the tokenizer.
- Quoting (``quote``, ``encode(..., quoted=True)``): a conversation's own text (what users, tools and
  earlier replies wrote) goes into a template whose markup is special tokens. Quoted text keeps its
  control-token texts as text, so a user's "<|im_start|>" cannot forge a turn, nor "<|endoftext|>"
  end the prompt, while the template's markup around it is still parsed.
- SentencePiece vocabularies put a space before each plain fragment that starts the text or follows a
  special token (``add_space_prefix``), and write spaces as "▁".
- BOS (and EOS) per ``add_bos_token``/``add_eos_token``; absent, llama.cpp's default for the
  vocabulary kind (SentencePiece and the Llama-3 family: BOS).

Decoding works on bytes: every id maps to the bytes it stands for, and bytes become text only at the
end (``decode``) or when a UTF-8 character is complete (``StreamDecoder``).
"""
from __future__ import annotations

import codecs
import operator
import os
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from ...errors import ClutorError, ModelFileError, UnsupportedError
from ..config import MAX_VOCAB
from .bpe import ByteLevelBPE, SpaceBPE, raw_bytes, token_text_bytes
from .pretokenize import KNOWN_PRE, pre_tokenizer
from .spm import SPACE, SentencePiece

__all__ = ["Tokenizer", "StreamDecoder", "QUOTE"]

# Put after the first character of a control-token text in quoted text, so that the text no longer
# matches the token (a noncharacter: no text a person writes holds it next to a token's text, and
# where one does, quoting adds one more, so unquoting gives it back).
QUOTE = "\uffff"

# Token attributes: llama.cpp's llama_token_attr bits.
_UNKNOWN, _UNUSED, _NORMAL, _CONTROL, _USER, _BYTE = 1, 2, 4, 8, 16, 32
_LSTRIP, _RSTRIP = 128, 256
_SPECIAL = _UNKNOWN | _CONTROL  # hidden unless special, parsed only with special
# tokenizer.ggml.token_type -> attribute; other values are "undefined" (0): never shown
_TYPE_ATTR = {1: _NORMAL, 2: _UNKNOWN, 3: _CONTROL, 4: _USER, 5: _UNUSED, 6: _BYTE}

_MODELS = ("gpt2", "llama", "gemma4")
_C_SPACE = " \t\n\v\f\r"  # C isspace(): what a strip attribute removes next to a special token

# Texts that end generation (llama.cpp's list); each is made a control token.
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
)
# Fill-in-the-middle roles found by text when the file does not name them; the first present wins.
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_GPT_OSS_USER = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """A GGUF vocabulary (byte-level BPE or SentencePiece): ``encode`` text to ids, ``decode`` ids."""

    def __init__(self, metadata: Mapping[str, object], path: str):
        """Use ``from_gguf`` / ``from_metadata``; ``path`` is only used in error messages."""
        self.path = path
        model = metadata.get("tokenizer.ggml.model")
        if model not in _MODELS:
            raise UnsupportedError(path, "tokenizer.ggml.model", f"one of {', '.join(_MODELS)}", _shown(model))
        self.model: str = str(model)
        spm = self.model == "llama"
        spaced = self.model == "gemma4"  # BPE over U+2581-escaped text, byte tokens <0xXX> (Gemma 4)

        # The pre-tokenizer: BPE only (llama.cpp ignores the field for SentencePiece). An absent name
        # is llama.cpp's "default" split (it warns that quality suffers), an unknown one is refused.
        pre = metadata.get("tokenizer.ggml.pre")
        if pre is not None and not isinstance(pre, str):
            raise ModelFileError(path, "tokenizer.ggml.pre", "a string", type(pre).__name__)
        self.pre: str = pre or "default"
        self._pretok = None
        if spaced:
            self.pre = "gemma4"  # llama.cpp's only split for this model, whatever the file says
        elif not spm:
            if self.pre not in KNOWN_PRE:
                raise UnsupportedError(path, "tokenizer.ggml.pre", f"one of {', '.join(sorted(KNOWN_PRE))}",
                                       _shown(pre))
            self._pretok = pre_tokenizer(KNOWN_PRE[self.pre])

        raw_tokens = metadata.get("tokenizer.ggml.tokens")
        if isinstance(raw_tokens, (list, tuple)) and len(raw_tokens) > MAX_VOCAB:
            # the tables built below cost memory and time for every token: refuse before building them
            raise ModelFileError(path, "tokenizer.ggml.tokens", f"at most {MAX_VOCAB} tokens", len(raw_tokens))
        tokens = _strings(metadata, "tokenizer.ggml.tokens", path)
        n = len(tokens)
        if n == 0:
            raise ModelFileError(path, "tokenizer.ggml.tokens", "a non-empty array of strings", "0 tokens")
        # llama.cpp names an empty entry so it can still be looked up and printed.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._tokens = tokens
        # Where a token string appears twice, the first id wins (shared/notes/gguf-moe.md).
        text_to_id: dict[str, int] = {}
        for i, t in enumerate(tokens):
            text_to_id.setdefault(t, i)
        self._text_to_id = text_to_id

        attrs = [_TYPE_ATTR.get(t, 0) for t in _ints(metadata, "tokenizer.ggml.token_type", path, n, default=1)]

        def token_id(key: str, default: int | None = None) -> int | None:
            v = metadata.get(key)
            if v is None:
                return default if default is not None and default < n else None
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < n:
                raise ModelFileError(path, key, f"a token id in [0, {n})", _shown(v))
            return int(v)

        # SentencePiece files default to Llama's ids, as in llama.cpp; BPE files name theirs.
        self._bos_id = token_id("tokenizer.ggml.bos_token_id", 1 if spm else None)
        self._eos_id = token_id("tokenizer.ggml.eos_token_id", 2 if spm else None)
        self._unk_id = token_id("tokenizer.ggml.unknown_token_id", 0 if spm else None)
        self._eot_id = token_id("tokenizer.ggml.eot_token_id")
        eom_id = token_id("tokenizer.ggml.eom_token_id")
        fim = {role: token_id(f"tokenizer.ggml.{role}_token_id") for role in _FIM_TEXTS}
        for role, old in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle")):
            deprecated = token_id(f"tokenizer.ggml.{old}_token_id")
            if deprecated is not None:  # read after the new key, as llama.cpp does
                fim[role] = deprecated

        self.add_space_prefix: bool = _flag(metadata, "tokenizer.ggml.add_space_prefix", spm, path)
        self.add_bos: bool = _flag(metadata, "tokenizer.ggml.add_bos_token",
                                   spm or (self._pretok is not None and self._pretok.add_bos), path)
        if spaced:
            self.add_bos = True  # llama.cpp overrides a false add_bos_token for Gemma 4
        self.add_eos: bool = _flag(metadata, "tokenizer.ggml.add_eos_token", False, path)
        for flag, key, tid in ((self.add_bos, "bos", self._bos_id), (self.add_eos, "eos", self._eos_id)):
            if flag and tid is None:
                raise ModelFileError(path, f"tokenizer.ggml.{key}_token_id", f"a token id (add_{key}_token is true)",
                                     "absent")

        template = metadata.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ModelFileError(path, "tokenizer.chat_template", "a string", type(template).__name__)
        self.chat_template: str | None = template or None

        stop = _correct_by_text(tokens, text_to_id, attrs, fim, (self._eos_id, self._eot_id, eom_id))
        self.stop_ids: frozenset[int] = frozenset(stop)
        special_ids = [i for i, a in enumerate(attrs) if a & (_CONTROL | _USER | _UNKNOWN)]
        name = str(metadata.get("general.name") or "").lower()
        if "phi-3" in name or "phi3" in name:
            # llama.cpp's rule for Phi-3 by model name: its specials eat the whitespace after them
            for i in special_ids:
                attrs[i] |= _RSTRIP
            for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if t in text_to_id:
                    i = text_to_id[t]
                    attrs[i] = attrs[i] | _RSTRIP if on else attrs[i] & ~_RSTRIP

        # Specials cut out of the text, longest (in bytes) first, like llama.cpp's partition.
        special_ids.sort(key=lambda i: (-len(raw_bytes(tokens[i])), i))
        self._special = tuple((tokens[i], i, attrs[i]) for i in special_ids)
        # what quoting breaks: the control tokens, and gpt-oss's markup that llama.cpp makes user-defined
        markup = set(_GPT_OSS_USER) | {"<|end|>"}
        self._quoted = frozenset(k for k, (t, _, a) in enumerate(self._special)
                                 if t and (a & _SPECIAL or t in markup))
        self._quote_res: dict[int, tuple[re.Pattern, re.Pattern]] = {}
        self._special_by_first: dict[str, list[int]] = {}
        for k, (t, _, _) in enumerate(self._special):
            self._special_by_first.setdefault(t[0], []).append(k)

        self._plain, self._shown = _pieces(tokens, attrs, spm or spaced)

        if spm:
            scores = _floats(metadata, "tokenizer.ggml.scores", path, n)
            self._spm = SentencePiece(text_to_id, scores, self._unk_id, path)
            self._bpe = None
        else:
            if "tokenizer.ggml.merges" not in metadata and self.pre == "kimi-k2":
                raw_merges: list[str] = []  # llama.cpp accepts Kimi-K2 files without merges
            else:
                raw_merges = _strings(metadata, "tokenizer.ggml.merges", path)
            merges = []
            for k, m in enumerate(raw_merges):
                # llama.cpp splits at the first space after position 0, so a merge may start with " "
                cut = m.find(" ", 1)
                if cut < 0:
                    raise ModelFileError(path, f"tokenizer.ggml.merges[{k}]", "'left right'", repr(m))
                merges.append((m[:cut], m[cut + 1:]))
            self._bpe = (SpaceBPE(text_to_id, merges, path) if spaced
                         else ByteLevelBPE(text_to_id, merges, self._pretok.ignore_merges, path))
            self._spm = None

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Read the tokenizer tables of a GGUF file (a full model or a vocab-only file)."""
        path = os.fspath(path)
        from ..gguf import GGUFFile

        with GGUFFile.open(path) as f:
            return cls(f.metadata, path)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, object], path: str) -> "Tokenizer":
        """Build from GGUF metadata (key -> Python value); ``path`` is only used in error messages."""
        return cls(metadata, os.fspath(path))

    # -- properties ---------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    # The special ids as the file gives them (None where it has none); read-only.
    bos_id = property(operator.attrgetter("_bos_id"))
    eos_id = property(operator.attrgetter("_eos_id"))
    eot_id = property(operator.attrgetter("_eot_id"),
                      doc="``tokenizer.ggml.eot_token_id`` as the file gives it (end-of-turn texts are in ``stop_ids``).")
    unk_id = property(operator.attrgetter("_unk_id"))

    def token_text(self, token_id: int) -> str:
        """The token's string as stored in the vocabulary (e.g. "Ġhello", "▁hello", "<0x0A>")."""
        return self._tokens[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id whose vocabulary string is ``text`` (the first one if repeated), or None."""
        return self._text_to_id.get(text)

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The raw bytes ``token_id`` stands for; control tokens give b"" unless ``special``."""
        i = self._check_id(token_id)
        if special and i in self._shown:
            return self._shown[i]
        return self._plain[i]

    # -- encode / decode ----------------------------------------------------------------------

    def quote(self, text: str) -> str:
        """``text`` with each control-token text in it broken by ``QUOTE`` after its first character,
        so that ``encode(..., special=True, quoted=True)`` reads it as the plain text it was."""
        for k in self._quoted_in(text):
            t = self._special[k][0]
            text = self._quote_re(k)[0].sub(lambda m, a=t[0], b=t[1:]: a + QUOTE + m.group(1) + b, text)
        return text

    def _quoted_in(self, text: str) -> list[int]:
        """The quotable specials whose text (or quoted text) may be in ``text``, in partition order."""
        return [k for k in self._candidates(text) if k in self._quoted and self._special[k][0][1:] in text]

    def _candidates(self, text: str) -> list[int]:
        """Specials whose first character occurs in ``text``, in partition order: only these can occur
        (this keeps vocabularies with thousands of user-defined tokens, DeepSeek's, cheap)."""
        present: set[int] = set()
        for c in set(text) & self._special_by_first.keys():
            present.update(self._special_by_first[c])
        return sorted(present)

    def _quote_re(self, k: int) -> tuple[re.Pattern, re.Pattern]:
        res = self._quote_res.get(k)
        if res is None:
            t = self._special[k][0]
            a, b = re.escape(t[0]), re.escape(t[1:])
            res = self._quote_res[k] = (re.compile(f"{a}({QUOTE}*){b}"), re.compile(f"{a}{QUOTE}({QUOTE}*){b}"))
        return res

    def unquote(self, text: str) -> str:
        """``quote``'s inverse: the text as it was before quoting."""
        for k in reversed(self._quoted_in(text)):
            t = self._special[k][0]
            text = self._quote_re(k)[1].sub(lambda m, a=t[0], b=t[1:]: a + m.group(1) + b, text)
        return text

    def encode(self, text: str, special: bool = False, add_bos: bool | None = None,
               quoted: bool = False) -> list[int]:
        """Token ids of ``text`` as llama.cpp's ``llama_tokenize(text, add_special, parse_special=special)``.

        ``add_bos=None`` follows the file (``add_bos_token``, and ``add_eos_token`` for an EOS at the
        end); ``False`` adds neither; ``True`` adds BOS (and EOS if the file asks for it).
        Text that is not valid Unicode (lone surrogates, as Python gives for undecodable bytes in
        argv or a file read with errors="surrogateescape") is tokenized as its bytes decoded with
        U+FFFD for each invalid sequence, as llama.cpp's tools do with invalid UTF-8 input.
        ``quoted``: the text holds ``quote``d parts, read as the text they were quoted from.
        """
        text = _valid_text(text)
        ids: list[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self._bos_id is None:
                raise ModelFileError(self.path, "tokenizer.ggml.bos_token_id", "a token id to prepend", "absent")
            ids.append(self._bos_id)
        frags = self._partition(text, special)
        if quoted:
            frags = [self.unquote(f) if isinstance(f, str) and QUOTE in f else f for f in frags]
        if self._spm is not None:
            after_special = True  # the first fragment counts as following a special token
            for frag in frags:
                if isinstance(frag, int):
                    ids.append(frag)
                    after_special = True
                    continue
                if self.add_space_prefix and after_special:
                    frag = " " + frag
                self._spm.encode(frag.replace(" ", SPACE), ids)
                after_special = False
        else:
            for frag in frags:
                if isinstance(frag, int):
                    ids.append(frag)
                elif self._pretok is None:  # SpaceBPE: its own split
                    self._bpe.encode(frag, ids)
                else:
                    self._bpe.encode(self._pretok.split(frag), ids)
        if self.add_eos and add_bos is not False:
            ids.append(self._eos_id)
        return ids

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of ``ids`` (llama.cpp's detokenize): invalid UTF-8 becomes U+FFFD (only after all
        bytes are joined); with ``add_space_prefix`` the first token's leading space is dropped."""
        pieces = [self.token_bytes(i, special) for i in ids]
        if self.add_space_prefix and pieces and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def stream(self, special: bool = False, show: Iterable[int] = ()) -> "StreamDecoder":
        """An incremental decoder for generated tokens (no leading space is dropped: they continue a text);
        ``show``: control-token ids whose text is shown even without ``special``."""
        return StreamDecoder(self, special, show)

    # -- internals ----------------------------------------------------------------------------

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Split ``text`` into raw-text fragments and special-token ids (llama.cpp's st_partition)."""
        if not text:
            return []
        frags: list[str | int] = [text]
        for k in self._candidates(text):
            tok_text, tok_id, attr = self._special[k]
            if not special and attr & _SPECIAL:
                continue
            if tok_text not in text:
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or tok_text not in f:
                    out.append(f)
                    continue
                pos = 0
                while True:
                    hit = f.find(tok_text, pos)
                    if hit < 0:
                        if pos < len(f):
                            out.append(f[pos:])
                        break
                    left = f[pos:hit]
                    if attr & _LSTRIP:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        out.append(left)
                    out.append(tok_id)
                    pos = hit + len(tok_text)
                    if attr & _RSTRIP:
                        while pos < len(f) and f[pos] in _C_SPACE:
                            pos += 1
            frags = out
        return frags

    def _check_id(self, token_id: int) -> int:
        i = int(token_id)
        if not 0 <= i < len(self._tokens):
            raise ClutorError(f"{self.path}: token id {i} outside the vocabulary [0, {len(self._tokens)})")
        return i

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab})"


class StreamDecoder:
    """Turns ids into text one at a time, never emitting half a UTF-8 character.

    A token may end inside a multi-byte character (a byte-fallback "<0xE2>" always does); its
    leading bytes are held back until the character completes.
    ``"".join(push(i) for i in ids) + flush()`` is the text of the ids with nothing stripped.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False, show: Iterable[int] = ()):
        self._tokenizer = tokenizer
        self._special = special
        self._show = frozenset(int(i) for i in show)
        # Python's incremental UTF-8 decoder holds back exactly an incomplete trailing sequence and
        # replaces invalid bytes the same way a one-shot bytes.decode(errors="replace") does.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became complete (maybe "")."""
        special = self._special or token_id in self._show
        return self._utf8.decode(self._tokenizer.token_bytes(token_id, special))

    def flush(self) -> str:
        """Emit what is held back (an incomplete character becomes U+FFFD) and reset."""
        return self._utf8.decode(b"", final=True)


def _correct_by_text(tokens: list[str], text_to_id: dict[str, int], attrs: list[int], fim: dict[str, int | None],
                     ends: tuple[int | None, ...]) -> set[int]:
    """llama.cpp's corrections of token attributes by text, in its order (``attrs`` and ``fim`` are
    updated in place); returns the ids that end generation."""
    for role, texts in _FIM_TEXTS.items():
        if fim[role] is None:
            found = next((text_to_id[t] for t in texts if t in text_to_id), None)
            if found is not None:
                fim[role] = found
                attrs[found] |= _CONTROL
    stop = {fim[r] for r in ("fim_pad", "fim_rep", "fim_sep") if fim[r] is not None}
    for t in _EOG_TEXTS:
        i = text_to_id.get(t)
        if i is not None:
            stop.add(i)
            attrs[i] |= _CONTROL
    for t in _GPT_OSS_USER:
        if t in text_to_id:
            attrs[text_to_id[t]] = _USER
    stop |= {i for i in ends if i is not None}
    stop_texts = {tokens[i]: i for i in stop}
    end = stop_texts.get("<|end|>")
    calls = "<|call|>" in stop_texts or "<|calls|>" in stop_texts
    if end is not None and calls and ("<|return|>" in stop_texts or "<|flush|>" in stop_texts):
        stop.discard(end)  # harmony: <|end|> closes a message, the reply goes on
        attrs[end] = _USER
    if "</s>" in stop_texts and ("<|tool_response>" in stop_texts or "<|plamo:eos|>" in stop_texts):
        stop.discard(stop_texts["</s>"])
        attrs[stop_texts["</s>"]] = _NORMAL
    return stop


def _pieces(tokens: list[str], attrs: list[int], spm: bool) -> tuple[list[bytes], dict[int, bytes]]:
    """id -> the bytes of its piece (llama.cpp's token_to_piece), and the text of control/unknown
    tokens, shown only when asked for."""
    plain: list[bytes] = []
    shown: dict[int, bytes] = {}
    for i, (t, a) in enumerate(zip(tokens, attrs)):
        if a & (_SPECIAL | _USER):
            piece = raw_bytes(t)
            if a & _SPECIAL:
                shown[i], piece = piece, b""
        elif a & _NORMAL:
            piece = raw_bytes(t.replace(SPACE, " ")) if spm else token_text_bytes(t)
        elif a & _BYTE:
            m = _HEX_BYTE.fullmatch(t)
            piece = bytes((int(m.group(1), 16),)) if m else token_text_bytes(t)
        else:
            piece = b""  # unused / undefined: never shown
        plain.append(piece)
    return plain, shown


def _valid_text(text: str) -> str:
    """``text`` with lone surrogates resolved: surrogate-escaped bytes (U+DC80..U+DCFF) become the
    bytes they stand for, then every invalid UTF-8 sequence (and any other lone surrogate) U+FFFD."""
    if not isinstance(text, str):
        raise ClutorError(f"text to encode must be str, got {type(text).__name__}")
    if text.isascii():
        return text
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


# -- metadata helpers ----------------------------------------------------------------------------


def _shown(v: object) -> str:
    return "(absent)" if v is None else repr(v)


def _flag(metadata: Mapping[str, object], key: str, default: bool, path: str) -> bool:
    v = metadata.get(key)
    if v is None:
        return default
    if not isinstance(v, (bool, np.bool_)):
        raise ModelFileError(path, key, "a boolean", _shown(v))
    return bool(v)


def _array(metadata: Mapping[str, object], key: str, path: str, what: str) -> Sequence | np.ndarray:
    v = metadata.get(key)
    if v is None:
        raise ModelFileError(path, key, what, "(absent)")
    if isinstance(v, (str, bytes)) or not isinstance(v, (Sequence, np.ndarray)):
        raise ModelFileError(path, key, what, type(v).__name__)
    return v


def _ints(metadata: Mapping[str, object], key: str, path: str, n: int, default: int) -> list[int]:
    if metadata.get(key) is None:
        return [default] * n  # llama.cpp: a vocabulary without types is all normal tokens
    v = _array(metadata, key, path, "an array of integers")
    out = []
    for k, t in enumerate(v):
        # integers only: a float (even 1.0, or inf) means the array was written wrong
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ModelFileError(path, f"{key}[{k}]", "an integer", _shown(t))
        out.append(int(t))
    if len(out) != n:
        raise ModelFileError(path, key, f"{n} entries (one per token)", len(out))
    return out


def _floats(metadata: Mapping[str, object], key: str, path: str, n: int) -> list[float]:
    if metadata.get(key) is None:
        return [0.0] * n  # llama.cpp: no scores, all zero
    v = _array(metadata, key, path, "an array of numbers")
    out = []
    for k, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)) or t != t:
            raise ModelFileError(path, f"{key}[{k}]", "a number", _shown(t))
        out.append(float(t))
    if len(out) < n:
        raise ModelFileError(path, key, f"{n} entries (one per token)", len(out))
    return out


def _strings(metadata: Mapping[str, object], key: str, path: str) -> list[str]:
    v = _array(metadata, key, path, "an array of strings")
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
