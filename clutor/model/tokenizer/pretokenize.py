"""Byte-level BPE pre-tokenizers: how llama.cpp cuts text into words before the BPE merges.

``tokenizer.ggml.pre`` names a *kind*; a kind is a chain of split rules. Each rule cuts every
current piece further: its matches become pieces, and so does the unmatched text between two
matches (nothing is dropped). Merges never cross a piece boundary.

The rules are llama.cpp's regexes, and they are evaluated the way llama.cpp evaluates them, which is
not quite how a Unicode regex engine would:

- A rule that names Unicode categories (``\\p{L}``, ``\\p{N}``, ``\\p{P}``, ``\\p{S}``, ``\\p{M}``,
  ``\\p{Lu}``...) runs on a *collapsed* copy of the text where every non-ASCII code point is replaced
  by one stand-in character for its category and non-ASCII whitespace by ``\\v``; ``\\p{X}`` becomes
  a class of that stand-in plus the ASCII members of X. All letter sub-categories share one stand-in
  (beyond ASCII, ``\\p{Lu}`` cannot be told from ``\\p{Ll}``). That is llama.cpp's choice; we keep it
  so that the ids are llama.cpp's ids.
- A rule without categories runs on the text with non-ASCII whitespace replaced by ``\\v``.
- ``\\s``, ``\\d``, ``\\w``, ``\\b`` are ASCII-only (C++ std::regex in the C locale) and ``$`` is the
  end of the piece.

The collapse replaces one code point by one character, so match offsets in the collapsed copy are
offsets in the real text. Category data comes from Python's ``unicodedata``; llama.cpp's tables may
be from a newer Unicode version, which only matters for characters assigned since.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Callable

__all__ = ["PreTokenizer", "pre_tokenizer", "KNOWN_PRE"]

# -- the collapse ------------------------------------------------------------------------------

# Stand-ins for non-ASCII code points, one per category llama.cpp distinguishes (its 0xD0..0xD5),
# plus Han letters apart, which only the Kimi-K2 rule tells from other letters.
_OTHER, _NUM, _LET, _PUN, _MARK, _SYM, _HAN = (chr(0xE000 + k) for k in range(7))
_BY_CATEGORY = {"N": _NUM, "L": _LET, "P": _PUN, "M": _MARK, "S": _SYM}
# Unicode White_Space beyond ASCII (what llama.cpp's tables mark as whitespace); stable for decades.
_WHITESPACE = frozenset(
    [0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)
_HAN_RANGES = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)


def _is_han(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _HAN_RANGES)


_TABLE_MAX = 200_000  # code points remembered per table (every assigned one fits; a few MiB at most)


class _CollapseTable(dict):
    """str.translate table, filled on first sight of each code point."""

    def __missing__(self, cp: int) -> int:
        if cp < 0x80:
            v = cp
        elif cp in _WHITESPACE:
            v = 0x0B
        else:
            cat = unicodedata.category(chr(cp))[0]
            v = ord(_HAN if cat == "L" and _is_han(cp) else _BY_CATEGORY.get(cat, _OTHER))
        if len(self) < _TABLE_MAX:
            self[cp] = v
        return v


class _SpaceTable(dict):
    def __missing__(self, cp: int) -> int:
        v = 0x0B if cp in _WHITESPACE else cp
        if len(self) < _TABLE_MAX:
            self[cp] = v
        return v


_COLLAPSE = _CollapseTable()
_SPACES = _SpaceTable()

# \p{NAME} -> (stand-ins, ASCII members) written into a character class. The ASCII members are
# llama.cpp's (punctuation !"#%&'()*,-./:;?@[\]_{}, symbols $+<=>^`|~).
_CLASSES: dict[str, str] = {
    "N": _NUM + "0-9",
    "L": _LET + _HAN + "A-Za-z",
    "P": _PUN + r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "M": _MARK,
    "S": _SYM + r"\$\+<->\^`\|~",
    # Our own names, for the Kimi-K2 rule that llama.cpp hand-codes.
    "Han": _HAN,
    "NonHanL": _LET + "A-Za-z",
}
for _sub in ("Lu", "Ll", "Lt", "Lm", "Lo"):
    _CLASSES[_sub] = _CLASSES["L"]
_CATEGORY = re.compile(r"\\p\{(\w+)\}")


def _translate(pattern: str) -> tuple[str, bool]:
    """A llama.cpp rule as a Python pattern for the collapsed (True) or the plain text (False)."""
    collapsed = any(m.group(1) in _CLASSES for m in _CATEGORY.finditer(pattern))
    if collapsed and not pattern.isascii():
        raise ValueError(f"rule mixes categories and non-ASCII characters: {pattern!r}")
    out, inside, i = [], False, 0
    while i < len(pattern):
        c = pattern[i]
        escaped = i > 0 and pattern[i - 1] == "\\"
        m = _CATEGORY.match(pattern, i) if c == "\\" else None
        if m and m.group(1) in _CLASSES:
            cls = _CLASSES[m.group(1)]
            out.append(cls if inside else f"[{cls}]")
            i = m.end()
            continue
        if c == "[" and not escaped:
            inside = True
        elif c == "]" and inside and not escaped:
            inside = False
        elif c == "$" and not escaped and not inside:
            c = r"\Z"  # ECMAScript's $ without multiline: the end only (Python's also before a last \n)
        out.append(c)
        i += 1
    return "".join(out), collapsed


# -- rules -------------------------------------------------------------------------------------

Span = tuple[int, int]


@dataclass(frozen=True)
class _Rule:
    """One split rule: a compiled pattern, or a function (a rule llama.cpp hand-codes, or one whose
    regex would be quadratic here)."""

    source: str
    collapsed: bool
    pattern: re.Pattern[str] | None = None
    func: Callable[[str, int, int], list[Span]] | None = None

    def split(self, text: str, a: int, b: int, out: list[Span]) -> None:
        if self.func is not None:
            out.extend(self.func(text, a, b))
            return
        pos = a
        for m in self.pattern.finditer(text, a, b):
            s, e = m.span()
            if s > pos:
                out.append((pos, s))
            if e > s:
                out.append((s, e))
            pos = e
        if pos < b:
            out.append((pos, b))


def _digit_groups(text: str, a: int, b: int) -> list[Span]:
    """AFMoE's digit rule (llama.cpp's custom code, kept as it behaves; it also stands for Tiny Aya's
    ``\\d{1,3}(?=(?:\\d{3})*\\b)``): a run of n numbers (\\p{N}) is cut into n % 3 leading ones then
    threes; text before a run is cut together with its first group."""
    out: list[Span] = []
    prev = pos = a
    while pos < b:
        if not _is_digit(text[pos]):
            pos += 1
            continue
        start = pos
        while pos < b and _is_digit(text[pos]):
            pos += 1
        cut = start + (pos - start) % 3
        if cut > start:
            out.append((prev, cut))
            prev = cut
        while cut < pos:
            cut += 3
            out.append((prev, cut))
            prev = cut
    if prev < b:
        out.append((prev, b))
    return out


def _is_digit(c: str) -> bool:
    return "0" <= c <= "9" or c == _NUM


# Two rules are written as functions because Python's backtracking makes their regexes quadratic
# on long runs (a regex that fails at every start of a run rescans the run each time); the functions
# give the same pieces in one pass.

def _trailing_space(text: str, a: int, b: int) -> list[Span]:
    r"""``\s+$``: the whitespace run that ends the piece (the regex fails at every start of a run
    that does not reach the end)."""
    k = b
    while k > a and text[k - 1] in " \t\n\v\f\r":
        k -= 1
    return [(a, k), (k, b)] if a < k < b else [(a, b)]


def _thousands_cuts(text: str, a: int, b: int) -> list[Span]:
    r"""``(?=(\d{3})+(?!\d))``: an empty match (a cut) before every digit followed by a positive
    multiple of three digits up to the end of its run."""
    cuts, run = [], 0
    for p in range(b - 1, a, -1):
        run = run + 1 if "0" <= text[p] <= "9" else 0
        if run and run % 3 == 0:
            cuts.append(p)
    out, prev = [], a
    for p in reversed(cuts):
        out.append((prev, p))
        prev = p
    out.append((prev, b))
    return out


def _rule(source: str) -> _Rule:
    if source in _FUNCTIONS:
        func, collapsed = _FUNCTIONS[source]
        return _Rule(source, collapsed, func=func)
    pattern, collapsed = _translate(source)
    return _Rule(source, collapsed, pattern=re.compile(pattern, re.ASCII))


# -- the kinds ---------------------------------------------------------------------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_JAIS2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
    + r"|\s{1,2}(?!\S)|\s{1}"
)
# DeepSeek LLM's letters: the cased letters (Lu, Ll, Lt) of the Unicode version it was made with.
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_ASCII_PUNCT_WORD = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
_DEEPSEEK3 = (
    _ASCII_PUNCT_WORD
    + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"((?=[\p{L}])([^a-z]))"  # llama.cpp's stand-in for [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]
_LOWER = r"((?=[\p{L}])([^A-Z]))"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CASED = (  # the tokenizer.json form, where llama.cpp's collapse makes both classes "any letter"
    rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]*[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]+[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]*{_CONTRACTIONS}?"
)
_NOT_SEPARATOR = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_AFMOE_DIGITS = r"\p{AFMoE_digits}"
_SUPERBPE_CUTS = r"(?=(\d{3})+(?!\d))"
_AYA_DIGITS = r"\d{1,3}(?=(?:\d{3})*\b)"
_FUNCTIONS: dict[str, tuple[Callable[[str, int, int], list[Span]], bool]] = {
    _AFMOE_DIGITS: (_digit_groups, True),
    r"\s+$": (_trailing_space, False),
    _SUPERBPE_CUTS: (_thousands_cuts, False),
    _AYA_DIGITS: (_digit_groups, True),  # llama.cpp runs AFMoE's digit code for this regex
}

# kind -> (rules, ignore_merges, add_bos by default)
_KINDS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"), False, False),
    "gpt2": ((_GPT2,), False, False),
    "llama3": ((_LLAMA3,), True, True),
    "llama3-merges": ((_LLAMA3,), False, False),  # dbrx, smaug, chatglm-bpe: the same split, merges always
    "glm4": ((_LLAMA3,), True, False),
    "jais2": ((_JAIS2,), False, False),
    "deepseek-llm": (
        ("[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
         r"\s+$", _CJK_HANGUL, r"\p{N}+"),
        False, False,
    ),
    "deepseek-coder": (("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"), False, False),
    "deepseek3": ((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3), False, False),
    "spark2_5": (
        (r"\p{N}{1,3}", _CJK_KANA,
         _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
         r"\p{N}"),
        False, False,
    ),
    "youtu": (
        ("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
         "\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
         _CASED + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
        True, False,
    ),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"), False, False),
    "starcoder": ((r"\p{N}", _GPT2), False, False),
    "qwen2": ((_QWEN2,), False, False),
    "qwen35": ((_QWEN35,), False, False),
    "poro": ((_NOT_SEPARATOR,), False, False),
    "viking": ((_NOT_SEPARATOR, r"\p{N}"), False, False),
    "tekken": (
        (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
         r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
        True, True,
    ),
    "chameleon": (
        ("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
         r"[\p{P}!-/:-@\[-`{-~]", _GPT2),
        False, True,
    ),
    "gpt4o": ((_GPT4O,), False, False),
    "granite-emb-multi": (
        (_GPT4O.replace(r"(?=[\p{L}])", r"(?=[\p{L}\p{M}])"),), True, False,
    ),
    "tiny-aya": (
        (_AYA_DIGITS,
         _CASED + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
        False, False,
    ),
    "kimi-k2": (
        (r"\p{Han}+|[^\r\n\p{L}\p{N}]?\p{NonHanL}+" + _CONTRACTIONS + "?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
        False, False,
    ),
    "superbpe": ((r"\p{N}+", _SUPERBPE_CUTS), False, False),
    "bailingmoe": (
        (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",),
        False, False,
    ),
    "seed-coder": (
        (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",),
        False, False,
    ),
    "ufakzeka": (
        (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",), False, False,
    ),
    "afmoe": (
        (_AFMOE_DIGITS,
         "[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
         "\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af"
         "\u1100-\u11ff]+",
         _DEEPSEEK3),
        False, False,
    ),
    "laguna": (("[^\\n]+|[\\n]+", _QWEN2), False, False),
    "exaone-moe": (
        (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",),
        False, False,
    ),
    "minicpm5": (
        (r"\p{N}{1,3}",
         _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
        True, False,
    ),
}

# tokenizer.ggml.pre -> kind, as llama.cpp's vocabulary loader reads them.
KNOWN_PRE: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe"), "llama3-merges"),
    **dict.fromkeys(("glm4", "glm5"), "glm4"),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"),
                    "gpt2"),
    "jais-2": "jais2",
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"), "deepseek3"),
    "spark2_5": "spark2_5",
    "youtu": "youtu",
    "falcon": "falcon",
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
                     "mellum2"), "starcoder"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                     "solar-open", "grok-2"), "qwen2"),
    "qwen35": "qwen35",
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), "poro"),
    "viking": "viking",
    "tekken": "tekken",
    "chameleon": "chameleon",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt4o"),
    "granite-embed-multi-97m": "granite-emb-multi",
    **dict.fromkeys(("tiny_aya", "cohere2moe"), "tiny-aya"),
    "kimi-k2": "kimi-k2",
    "superbpe": "superbpe",
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe"),
    "seed-coder": "seed-coder",
    "ufakzeka": "ufakzeka",
    "afmoe": "afmoe",
    "laguna": "laguna",
    "exaone-moe": "exaone-moe",
    "minicpm5": "minicpm5",
}


class PreTokenizer:
    """The split chain of one kind: ``split(text)`` gives the words BPE runs on, in order."""

    def __init__(self, kind: str):
        sources, self.ignore_merges, self.add_bos = _KINDS[kind]
        self.kind = kind
        self._rules = tuple(_rule(s) for s in sources)
        self._collapse = any(r.collapsed for r in self._rules)
        self._plain = not all(r.collapsed for r in self._rules)

    def split(self, text: str) -> list[str]:
        if not text:
            return []
        ascii_only = text.isascii()
        collapsed = text if ascii_only or not self._collapse else text.translate(_COLLAPSE)
        plain = text if ascii_only or not self._plain else text.translate(_SPACES)
        spans: list[Span] = [(0, len(text))]
        for rule in self._rules:
            source = collapsed if rule.collapsed else plain
            out: list[Span] = []
            for a, b in spans:
                rule.split(source, a, b, out)
            spans = out
        return [text[a:b] for a, b in spans if b > a]

    def __repr__(self) -> str:
        return f"PreTokenizer({self.kind!r})"


_CACHE: dict[str, PreTokenizer] = {}


def pre_tokenizer(kind: str) -> PreTokenizer:
    """The (shared, immutable) pre-tokenizer of a kind; compiled on first use."""
    pt = _CACHE.get(kind)
    if pt is None:
        pt = _CACHE[kind] = PreTokenizer(kind)
    return pt
