"""Byte-level BPE pre-tokenizers: every llama.cpp split rule, its category collapse, and its fast paths."""
from __future__ import annotations

import random
import re
import warnings

import pytest

from clutor.model.tokenizer import pretokenize as pt

KINDS = sorted(set(pt.KNOWN_PRE.values()))
ALPHABET = (
    "aZé ÉxY\t\n\r\v  0123٣४_'sSdDtT.,!?-~`$|()[]{}\u3000\u00a0"
    "中文日本語カタカナ한국어ภาษาไทยà\u0301😀🚀👍\ufe0f\u200d"
)


def _random_texts(seed: int, n: int, max_len: int = 40) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, max_len))) for _ in range(n)]


def test_every_kind_compiles_cleanly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. FutureWarning for a set Python would read differently
        for kind in KINDS:
            pt.PreTokenizer(kind)
    assert set(pt.KNOWN_PRE.values()) == set(pt._KINDS)  # no kind without a name, nor the reverse


@pytest.mark.parametrize("kind", KINDS)
def test_pieces_cover_the_text(kind):
    """Nothing is lost, reordered or duplicated, and no piece is empty."""
    split = pt.pre_tokenizer(kind).split
    for text in _random_texts(hash(kind) & 0xFFFF, 150):
        pieces = split(text)
        assert "".join(pieces) == text and all(pieces)


@pytest.mark.parametrize(
    "kind, text, pieces",
    [
        ("gpt2", "Hello world 123!!  x", ["Hello", " world", " 123", "!!", " ", " x"]),
        ("gpt2", "don't", ["don", "'t"]),
        ("default", "hel!!12345", ["hel", "!!", "123", "45"]),  # an absent tokenizer.ggml.pre
        ("llama3", "12345 I'M", ["123", "45", " I", "'M"]),
        ("llama3", "a\n\n  b", ["a", "\n\n", " ", " b"]),
        ("qwen2", "12345", ["1", "2", "3", "4", "5"]),
        ("qwen35", "a\u0301b", ["a\u0301b"]),  # marks stay with their letters
        ("qwen2", "a\u0301b", ["a", "\u0301b"]),  # qwen2's [^\r\n\p{L}\p{N}]? takes the mark as a leader
        ("deepseek-coder", "ab12 c", ["ab", "1", "2", " c"]),
        ("deepseek-llm", "Hello 世界 123\n", ["Hello", " ", "世界", " ", "123", "\n"]),
        ("deepseek3", "ab中文1234", ["ab", "中文", "123", "4"]),
        ("gpt4o", "HelloWorld FOOBar", ["Hello", "World", " FOOBar"]),
        ("gpt4o", "x 1234567", ["x", " ", "123", "456", "7"]),
        ("kimi-k2", "abc中文def's", ["abc", "中文", "def's"]),
        ("afmoe", "1234567", ["1", "234", "567"]),
        ("superbpe", "1234567 x", ["1", "234", "567", " x"]),
        ("tiny-aya", "1234567 89x ⅷ½²𝟘", ["1", "234", "567", " ", "89", "x", " ", "ⅷ", "½²𝟘"]),
    ],
)
def test_known_splits(kind, text, pieces):
    assert pt.pre_tokenizer(kind).split(text) == pieces


def test_collapse_is_llama_cpps():
    """llama.cpp's collapse: one stand-in per category, all letter sub-categories together, and
    non-ASCII whitespace seen as \\v. Its consequences are kept on purpose."""
    gpt4o = pt.pre_tokenizer("gpt4o").split
    # ASCII case is told apart by [^a-z]/[^A-Z], non-ASCII letters count as both cases: "É" is a
    # one-letter "lowercase" word before an uppercase run (a real Unicode regex keeps "ÉCOLE" whole).
    assert gpt4o("ÉCOLE") == ["É", "COLE"]
    # U+3000 is whitespace (\v to the regex), so it is not the " " that " ?\p{L}+" may take.
    assert pt.pre_tokenizer("gpt2").split("a\u3000b") == ["a", "\u3000", "b"]
    assert pt.pre_tokenizer("gpt2").split("a b") == ["a", " b"]
    # ASCII punctuation and symbols are the Unicode ones: DeepSeek-V3's " ?[\p{P}\p{S}]+" takes them
    assert pt.pre_tokenizer("deepseek3").split("x ~^ y !?") == ["x", " ~^", " y", " !?"]


def test_translated_rules():
    pattern, collapsed = pt._translate(r"[^\r\n\p{L}\p{N}]?\p{L}+|\s+$")
    assert collapsed
    assert pattern.startswith("[^\\r\\n" + pt._LET)  # inside a class: no extra brackets
    assert "|\\s+\\Z" in pattern  # $ is the end of the piece only
    assert pt._translate(r"\p{N}")[0] == f"[{pt._NUM}0-9]"
    assert pt._translate("[\u4e00-\u9fa5]+") == ("[\u4e00-\u9fa5]+", False)
    with pytest.raises(ValueError):
        pt._translate("\\p{L}\u00e9")  # llama.cpp refuses categories next to non-ASCII characters


@pytest.mark.parametrize("source", sorted(pt._FUNCTIONS))
def test_fast_rules_equal_their_regex(source):
    """The rules written as functions give the pieces their regex gives (on texts short enough
    for the regex's backtracking not to matter)."""
    func_rule = pt._rule(source)
    if func_rule.func is pt._digit_groups:
        pytest.skip("llama.cpp runs its AFMoE digit code for this rule, not a regex (see test_known_splits)")
    pattern, collapsed = pt._translate(source)
    regex_rule = pt._Rule(source, collapsed, pattern=re.compile(pattern, re.ASCII))
    rng = random.Random(3)
    texts = ["".join(rng.choice("0123456789 a_\n\t.٣") for _ in range(rng.randint(0, 14))) for _ in range(3000)]
    for text in texts:
        for a, b in ((0, len(text)), (len(text) // 3, len(text))):
            got, want = [], []
            func_rule.split(text, a, b, got)
            regex_rule.split(text, a, b, want)
            assert [s for s in got if s[1] > s[0]] == [s for s in want if s[1] > s[0]], (text, a, b)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
def test_long_runs_split_in_one_pass(kind):
    """Inputs that make a backtracking regex rescan a run at every start: all of them finish (a
    quadratic rule would take hours here), and the pieces still cover the text."""
    n = 100_000
    split = pt.pre_tokenizer(kind).split
    for text in (" " * n + "1", "1" * n + "a", "1" * n, "A" * n + "1", "\t" * n + "x", " " * n + "\u20ac",
                 "a " * (n // 2), "\n" * n, "é" * n + " ", "中" * n):
        assert "".join(split(text)) == text


# -- against llama.cpp itself (when llama-cpp-python is installed) --------------------------------

SPLIT_TEXTS = [
    "HelloWorld ÉCOLE's 1234567 x~~ y\n\n  z",
    "中文abc한국어 ١٢٣ 12a_3 …。I'M\t\t\r\n $+<=>^`|~ À",
    "  <sentinel:12>IMGIMGABZ    end 😀🚀 a\u0301b ーカタ",
    "don't WE'LL 3333333 ,.!? ¿¡ «» \u3000x\u00a0y ـ ไทย",
    '$1,000.50 "q" (p) [b] {c} <t> a-b_c\r\r\n\u2028\x0b\x0cz',
    "ÀÉÎ façade naïve ΑΒΓ αβγ \u2126 \u212a ⅷ½²𝟘 1234 12345",
]


def _split_probe_gguf(path, text: str, pre: str) -> None:
    """A vocabulary in which every word the split can make is one token: all substrings of the text
    (in GPT-2's byte alphabet) are entries and any two adjacent pieces of one merge, so the BPE always
    ends with the whole word, and llama.cpp's ids spell out llama.cpp's split."""
    gguf = pytest.importorskip("gguf")
    from clutor.model.tokenizer.bpe import BYTE_TO_CHAR

    chars = "".join(BYTE_TO_CHAR[b] for b in text.encode("utf-8"))
    tokens = [BYTE_TO_CHAR[b] for b in range(256)]
    known, merges = set(tokens), {}
    for s in range(len(chars)):
        for e in range(s + 2, len(chars) + 1):
            for m in range(s + 1, e):
                merges.setdefault(f"{chars[s:m]} {chars[m:e]}", None)
            if chars[s:e] not in known:
                known.add(chars[s:e])
                tokens.append(chars[s:e])
    w = gguf.GGUFWriter(str(path), "gpt2")
    for key, value in (("context_length", 1024), ("embedding_length", 768), ("block_count", 12),
                       ("feed_forward_length", 3072), ("attention.head_count", 12)):
        w.add_uint32(f"gpt2.{key}", value)
    w.add_float32("gpt2.attention.layer_norm_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [1] * len(tokens))
    w.add_array("tokenizer.ggml.merges", list(merges))
    w.add_uint32("tokenizer.ggml.eos_token_id", 0)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", KINDS)
def test_splits_match_llama_cpp(tmp_path, kind):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional bench extra)")
    from clutor.model.tokenizer import Tokenizer

    pre = min(name for name, k in pt.KNOWN_PRE.items() if k == kind)
    for k, text in enumerate(SPLIT_TEXTS + _random_texts(17, 8, max_len=20)):
        path = tmp_path / f"{k}.gguf"
        _split_probe_gguf(path, text, pre)
        tok = Tokenizer.from_gguf(path)
        ours = tok.encode(text, add_bos=False)
        assert [tok.decode([i]) for i in ours] == pt.pre_tokenizer(kind).split(text)  # one token per word
        model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        theirs = model.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        assert ours == theirs, (pre, text, [tok.decode([i]) for i in theirs])
