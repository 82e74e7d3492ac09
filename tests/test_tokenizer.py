"""Tokenizer: llama.cpp's reference tokenizations, special-token parsing, decoding and streaming."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from clutor.errors import ClutorError, ModelFileError, UnsupportedError
from clutor.model.gguf import GGUFFile
from clutor.model.tokenizer import StreamDecoder, Tokenizer
from conftest import shared_data

# Every vocabulary llama.cpp ships expected tokenizations for (README in shared/data/vocab).
NAMES = ["gpt-2", "qwen2", "llama-spm", "phi-3", "llama-bpe", "deepseek-llm", "deepseek-coder", "qwen35"]
# Byte-level BPE vocabularies the independent oracle below can tokenize (split regex written here).
BPE_NAMES = ["gpt-2", "qwen2", "llama-bpe"]

# GPT-2's byte-level alphabet, rebuilt here independently of the module under test.
_PRINTABLE = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
BYTE_CHAR = {b: chr(b) for b in _PRINTABLE}
BYTE_CHAR.update({b: chr(0x100 + n) for n, b in enumerate(b for b in range(256) if b not in BYTE_CHAR)})


def _vocab_path(name: str) -> Path:
    return shared_data(f"vocab/ggml-vocab-{name}.gguf")


@pytest.fixture(scope="module")
def vocabs() -> dict[str, Tokenizer]:
    return {}


def _tok(vocabs: dict[str, Tokenizer], name: str) -> Tokenizer:
    if name not in vocabs:
        vocabs[name] = Tokenizer.from_gguf(_vocab_path(name))
    return vocabs[name]


@pytest.fixture(scope="module")
def gpt2(vocabs) -> Tokenizer:
    return _tok(vocabs, "gpt-2")


@pytest.fixture(scope="module")
def qwen2(vocabs) -> Tokenizer:
    return _tok(vocabs, "qwen2")


def _reference_cases(name: str) -> list[tuple[str, list[int]]]:
    """The .inp/.out pairs, split the way llama.cpp's test-tokenizer-0 splits them."""
    path = _vocab_path(name)
    raw = Path(f"{path}.inp").read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    cases, pos = [], 0
    while pos < len(raw):  # every case is followed by the separator; nothing after the last one
        nxt = raw.find(sep, pos)
        if nxt < 0:
            cases.append(raw[pos:])
            break
        cases.append(raw[pos:nxt])
        pos = nxt + len(sep)
    expected = [[int(x) for x in line.split()] for line in Path(f"{path}.out").read_text().splitlines()]
    assert len(cases) == len(expected), (len(cases), len(expected))
    assert cases, f"{path}.inp has no cases: a test looping over them would check nothing"
    return list(zip(cases, expected))


# -- llama.cpp's reference tokenizations ---------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_reference_tokenizations(vocabs, name):
    tok = _tok(vocabs, name)
    cases = _reference_cases(name)
    # one string per separator in the .inp, one line each in the .out (llama.cpp reads as many)
    assert len(cases) == (50 if name == "qwen35" else 46)
    # the vectors are llama_tokenize(text, add_special=false, parse_special=false)
    failures = [(text, want, got) for text, want in cases if (got := tok.encode(text, add_bos=False)) != want]
    assert not failures, f"{name}: {len(cases) - len(failures)}/{len(cases)} agree; first: {failures[:3]}"
    for text, want in cases:
        assert tok.decode(want) == text


@pytest.mark.parametrize("name", BPE_NAMES)
def test_independent_bpe_agrees_with_reference(vocabs, name):
    """The pure-Python oracle used below is itself checked against llama.cpp's ids."""
    ref = _ReferenceBPE(_tok(vocabs, name))
    for text, want in _reference_cases(name):
        assert ref.encode(text) == want, text


# -- an independent oracle: plain BPE with no special-token handling at all -----------------------


# The split regexes as the models' tokenizer.json files write them (Unicode categories, no llama.cpp
# rewriting); for these three llama.cpp's hand-written splitters agree with them exactly.
_ORACLE_SPLIT = {
    "gpt-2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


class _ReferenceBPE:
    """Textbook byte-level BPE (regex split, byte alphabet, lowest-rank merge first); Llama-3 takes a
    word that is a vocabulary entry whole (tokenizer.json's ignore_merges)."""

    def __init__(self, tok: Tokenizer):
        regex = pytest.importorskip("regex", reason="the oracle needs the `regex` module for \\p{L}")
        name = Path(tok.path).name.removeprefix("ggml-vocab-").removesuffix(".gguf")
        self.split = regex.compile(_ORACLE_SPLIT[name])
        self.whole_words = name == "llama-bpe"
        md = _metadata(tok.path, "tokenizer.ggml.")
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(md["tokenizer.ggml.merges"])}
        self.ids: dict[str, int] = {}
        for i, t in enumerate(md["tokenizer.ggml.tokens"]):
            self.ids.setdefault(t, i)

    def _pieces(self, text: str) -> list[str]:
        out, pos = [], 0
        for m in self.split.finditer(text):
            if m.start() > pos:
                out.append(text[pos : m.start()])
            if m.end() > m.start():
                out.append(m.group())
            pos = m.end()
        if pos < len(text):
            out.append(text[pos:])
        return out

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._pieces(text):
            syms = [BYTE_CHAR[b] for b in piece.encode("utf-8")]
            if self.whole_words and "".join(syms) in self.ids:
                syms = ["".join(syms)]
            while len(syms) > 1:
                best = min(range(len(syms) - 1), key=lambda k: (self.ranks.get((syms[k], syms[k + 1]), 1 << 60), k))
                if (syms[best], syms[best + 1]) not in self.ranks:
                    break
                syms[best : best + 2] = [syms[best] + syms[best + 1]]
            ids.extend(self.ids[s] for s in syms)
        return ids


TRICKY = [
    "Hello 😀🚀 wörld",
    "👨‍👩‍👧‍👦 family, 🇯🇵 flag",
    "日本語のテキストと中文混合",
    "한국어 문장입니다.",
    "a" + " " * 37 + "b",
    "\t\t  \n   \n\n\n  x  \t",
    "line1\r\nline2\rline3\n\r\n",
    "1234567890 12.5e-3 ٣٤٥ ⅷ",
    "don't WE'LL I'M it's",
    "<|im_end|>",
    "<|im_start|>user\nhi<|im_end|>",
    "text<|endoftext|>more",
    "<|endoftext",
    "</s> a</s>",
    "",
]


@pytest.mark.parametrize("name", BPE_NAMES)
def test_special_false_is_plain_bpe(vocabs, name):
    """special=False: control-token text ("<|im_end|>") is ordinary text, as llama.cpp parse_special=false."""
    tok = _tok(vocabs, name)
    ref = _ReferenceBPE(tok)
    for text in TRICKY:
        assert tok.encode(text, special=False, add_bos=False) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == text


def test_special_true_parses_control_tokens(gpt2, qwen2):
    eot = qwen2.token_id("<|endoftext|>")
    start, end = qwen2.token_id("<|im_start|>"), qwen2.token_id("<|im_end|>")
    assert None not in (eot, start, end)
    assert qwen2.encode("<|endoftext|>", special=True) == [eot]
    assert qwen2.encode("<|im_start|>", special=True) == [start]
    ids = qwen2.encode("<|im_start|>user\nhi<|im_end|>\n", special=True)
    assert ids[0] == start and ids.count(end) == 1 and ids[-2] == end
    assert ids[1:-2] == qwen2.encode("user\nhi")  # the text between is plain BPE
    assert qwen2.encode("<|im_start|>", special=False) != [start]
    assert start not in qwen2.encode("<|im_start|>", special=False)

    g_eot = gpt2.token_id("<|endoftext|>")
    assert gpt2.encode("a<|endoftext|>b", special=True) == [*gpt2.encode("a"), g_eot, *gpt2.encode("b")]
    assert g_eot not in gpt2.encode("a<|endoftext|>b", special=False)


def test_user_defined_tokens_always_parsed(qwen2):
    # llama.cpp (and HF) split user-defined tokens out of the text even with parse_special=false.
    pad = qwen2.token_id("[PAD151650]")
    assert pad is not None
    for special in (False, True):
        assert qwen2.encode("x[PAD151650]y", special=special) == [*qwen2.encode("x"), pad, *qwen2.encode("y")]
    assert qwen2.decode([pad]) == "[PAD151650]"  # user-defined text is shown even without special


def test_qwen2_splits_digits_one_by_one(gpt2, qwen2):
    text = "3141592653"
    ids = qwen2.encode(text)
    assert [qwen2.decode([i]) for i in ids] == list(text)
    assert len(gpt2.encode(text)) < len(text)  # gpt-2 keeps runs of digits together


def test_whitespace_runs_and_newlines(gpt2, qwen2):
    for tok in (gpt2, qwen2):
        text = "a" + " " * 20 + "b\n\n\n\tc\r\n"
        pieces = [tok.decode([i]) for i in tok.encode(text)]
        assert "".join(pieces) == text
        # `\s+(?!\S)` stops one space short, so the last space joins the word: "a", 19 spaces, " b"
        b = pieces.index(" b")
        assert pieces[0] == "a" and "".join(pieces[1:b]) == " " * 19


def test_round_trip(gpt2, qwen2):
    rng = random.Random(1234)
    alphabet = "abcXYZ019 \t\n\r.,'!?-_<|>[]{}äöüßéñçøåÆ日本語中文한국어ภาษาไทย😀🚀👍🏽❤️‍🔥\u200d\u00a0"
    texts = TRICKY + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(60)]
    for tok in (gpt2, qwen2):
        for text in texts:
            assert tok.decode(tok.encode(text)) == text, text
            assert tok.decode(tok.encode(text, special=True), special=True) == text, text


def test_decode_control_tokens_hidden_unless_special(qwen2):
    end = qwen2.token_id("<|im_end|>")
    ids = [*qwen2.encode("hi"), end]
    assert qwen2.decode(ids) == "hi"
    assert qwen2.decode(ids, special=True) == "hi<|im_end|>"
    assert qwen2.token_bytes(end) == b""
    assert qwen2.token_bytes(end, special=True) == b"<|im_end|>"


def test_properties(gpt2, qwen2):
    assert (gpt2.n_vocab, qwen2.n_vocab) == (50257, 151936)
    assert gpt2.add_bos is False and qwen2.add_bos is False  # gpt2-type vocabs: no BOS by default
    assert qwen2.eos_id == qwen2.token_id("<|endoftext|>") and qwen2.eot_id is None
    # Qwen2's "</s>" is an ordinary token in the file; llama.cpp makes it a control, stopping token
    slash_s = qwen2.token_id("</s>")
    assert slash_s is not None
    assert qwen2.stop_ids == {qwen2.token_id("<|endoftext|>"), qwen2.token_id("<|im_end|>"), slash_s}
    assert qwen2.decode([slash_s]) == "" and qwen2.decode([slash_s], special=True) == "</s>"
    assert qwen2.encode("</s>", special=True) == [slash_s] and slash_s not in qwen2.encode("</s>")
    assert gpt2.stop_ids == {gpt2.token_id("<|endoftext|>")}
    assert qwen2.chat_template and "<|im_start|>" in qwen2.chat_template
    assert gpt2.chat_template is None
    assert qwen2.token_text(qwen2.encode(" hello")[0]) == "Ġhello"
    with pytest.raises(ClutorError):
        qwen2.token_text(qwen2.n_vocab)
    with pytest.raises(ClutorError):
        qwen2.decode([-1])


def test_bos(gpt2):
    assert gpt2.encode("hi", add_bos=True) == [gpt2.bos_id, *gpt2.encode("hi")]
    md = _metadata(gpt2.path, "tokenizer.")
    md["tokenizer.ggml.add_bos_token"] = True
    with_bos = Tokenizer.from_metadata(md, gpt2.path)
    assert with_bos.encode("hi") == [gpt2.bos_id, *gpt2.encode("hi")]
    assert with_bos.encode("hi", add_bos=False) == gpt2.encode("hi")
    assert with_bos.encode("") == [gpt2.bos_id]


def test_llama3_defaults(vocabs):
    """llama-bpe files often carry no add_bos_token: llama.cpp adds BOS for the Llama-3 family."""
    tok = _tok(vocabs, "llama-bpe")
    assert tok.add_bos and tok.encode("hi")[0] == tok.bos_id == tok.token_id("<|begin_of_text|>")
    assert tok.stop_ids == {tok.token_id("<|end_of_text|>"), tok.token_id("<|eot_id|>")}
    header = tok.encode("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", special=True, add_bos=False)
    assert [tok.token_text(i) for i in header] == [
        "<|start_header_id|>", "user", "<|end_header_id|>", "ĊĊ", "hi", "<|eot_id|>"]
    # ignore_merges: a word that is a vocabulary entry is taken whole, even where the merges alone
    # would end in three tokens (" jeho" -> "Ġj", "eh", "o")
    assert tok.encode(" jeho", add_bos=False) == [tok.token_id("Ġjeho")]


def test_deepseek_user_defined_characters(vocabs):
    """DeepSeek's vocabularies hold thousands of single characters as user-defined tokens: they are
    cut out of any text before the split, and decode as themselves."""
    tok = _tok(vocabs, "deepseek-llm")
    o = tok.token_id("ø")
    assert o is not None and o >= 100002
    for special in (False, True):
        assert tok.encode("ø", special=special, add_bos=False) == [o]
        assert tok.encode("søn", special=special, add_bos=False) == [
            *tok.encode("s", add_bos=False), o, *tok.encode("n", add_bos=False)]
    assert tok.decode([o]) == "ø"
    assert tok.add_bos and tok.encode("x")[0] == tok.bos_id
    assert tok.stop_ids == {tok.eos_id}


def _harmony_metadata() -> dict[str, object]:
    """A tiny o200k_harmony-like vocabulary: gpt-oss's special tokens, all control in the file."""
    specials = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
                "<|constrain|>", "<|endoftext|>", "<|fim_pad|>"]
    tokens = [BYTE_CHAR[b] for b in range(256)] + ["ab"] + specials
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 257 + [3] * 8 + [4],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 256 + 8,  # <|endoftext|>
        "general.name": "gpt-oss-tiny",
    }


def test_harmony_special_tokens():
    tok = Tokenizer.from_metadata(_harmony_metadata(), "harmony.gguf")
    tid = {t: tok.token_id(t) for t in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                                         "<|call|>", "<|constrain|>", "<|endoftext|>", "<|fim_pad|>")}
    # <|end|> closes a message, not the reply; <|return|> and <|call|> end generation (llama.cpp's rule
    # when both are present); FIM pad is made control and stops too
    assert tok.stop_ids == {tid["<|return|>"], tid["<|call|>"], tid["<|endoftext|>"], tid["<|fim_pad|>"]}
    text = "<|start|>assistant<|channel|>final<|message|>ab<|end|>"
    ids = tok.encode(text, special=True)
    assert ids == [tid["<|start|>"], *tok.encode("assistant"), tid["<|channel|>"], *tok.encode("final"),
                   tid["<|message|>"], 256, tid["<|end|>"]]
    # the four llama.cpp makes user-defined (and <|end|>) are cut out and shown even without special,
    # so the channel structure of a reply is visible in the streamed text
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text
    assert tok.decode([tid["<|return|>"]]) == "" and tok.decode([tid["<|return|>"]], special=True) == "<|return|>"
    assert tid["<|fim_pad|>"] not in tok.encode("<|fim_pad|>")  # user-defined in the file, made control


def test_pre_absent_is_default_split():
    md = _tiny_metadata(**{"tokenizer.ggml.pre": None})
    tok = Tokenizer.from_metadata(md, "nopre.gguf")
    assert tok.pre == "default"
    assert tok.encode("hel!!12") == [257, ord("!"), ord("!"), ord("1"), ord("2")]


# -- streaming -----------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    s = tok.stream()
    assert isinstance(s, StreamDecoder)
    return [s.push(i) for i in ids], s.flush()


def test_stream_holds_back_partial_characters(gpt2, qwen2):
    for tok in (gpt2, qwen2):
        text = "日本語 😀🚀👨‍👩‍👧 ẞ€ 한국어"
        ids = tok.encode(text)
        # the case must really split characters: some token is not valid UTF-8 on its own
        assert any(_invalid_alone(tok.token_bytes(i)) for i in ids)
        pushes, tail = _stream(tok, ids)
        assert all("\ufffd" not in p for p in pushes)
        assert "".join(pushes) + tail == tok.decode(ids) == text
        assert tail == ""


def test_stream_single_byte_tokens(qwen2):
    grin = "😀".encode("utf-8")  # 4 bytes -> 4 single-byte tokens
    ids = [qwen2.token_id(BYTE_CHAR[b]) for b in grin]
    assert None not in ids
    pushes, tail = _stream(qwen2, [*ids, *qwen2.encode("a")])
    assert pushes == ["", "", "", "😀", "a"] and tail == ""
    # an incomplete character left at the end becomes U+FFFD, exactly as decode() shows it
    pushes, tail = _stream(qwen2, ids[:2])
    assert pushes == ["", ""] and tail == "\ufffd" == qwen2.decode(ids[:2])
    # a broken sequence followed by ASCII: replaced when it is known to be broken, as decode() does
    pushes, tail = _stream(qwen2, [ids[0], *qwen2.encode("x")])
    assert "".join(pushes) + tail == qwen2.decode([ids[0], *qwen2.encode("x")]) == "\ufffdx"


def test_stream_matches_decode_on_random_ids(gpt2, qwen2):
    rng = random.Random(7)
    for tok in (gpt2, qwen2):
        # single-byte tokens >= 0x80 make partial and invalid sequences frequent
        high = [tok.token_id(BYTE_CHAR[b]) for b in range(0x80, 0x100)]
        for _ in range(200):
            ids = [rng.choice(high) if rng.random() < 0.5 else rng.randrange(tok.n_vocab) for _ in range(rng.randint(0, 12))]
            pushes, tail = _stream(tok, ids)
            assert "".join(pushes) + tail == tok.decode(ids)


def _invalid_alone(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


# -- construction errors (synthetic metadata; no shared data needed) -----------------------------


def _tiny_metadata(**overrides) -> dict[str, object]:
    tokens = [BYTE_CHAR[b] for b in range(256)] + ["he", "hel", "<|end|>", "<tool>"]
    types = [1] * 258 + [3, 4]
    md: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["h e", "he l"],
        "tokenizer.ggml.eos_token_id": 258,
    }
    md.update(overrides)
    return {k: v for k, v in md.items() if v is not None}


def test_tiny_vocab():
    tok = Tokenizer.from_metadata(_tiny_metadata(), "tiny.gguf")
    assert tok.encode("hello") == [257, ord("l"), ord("o")]
    assert tok.encode("<|end|>", special=True) == [258]
    assert 258 not in tok.encode("<|end|>")
    assert tok.encode("a<tool>b") == [ord("a"), 259, ord("b")]
    assert tok.stop_ids == {258}
    assert tok.decode([257, 258, 259]) == "hel<tool>"
    assert tok.decode([257, 258, 259], special=True) == "hel<|end|><tool>"


def test_token_texts_that_are_not_utf8():
    """The GGUF reader keeps bytes that are not UTF-8 as surrogate escapes; pieces give those bytes back."""
    md = _tiny_metadata()
    md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"][:-1], "<\udcff>"]  # user-defined, byte 0xFF
    tok = Tokenizer.from_metadata(md, "tiny.gguf")
    assert tok.token_bytes(259) == b"<\xff>" and tok.decode([259]) == "<\ufffd>"
    md["tokenizer.ggml.token_type"] = [1] * 260  # as a normal token: outside GPT-2's alphabet
    md["tokenizer.ggml.eos_token_id"] = None
    tok = Tokenizer.from_metadata({k: v for k, v in md.items() if v is not None}, "tiny.gguf")
    # llama.cpp's marker for a character outside the alphabet (it reads the byte as U+FFFD)
    assert tok.token_bytes(259) == b"<[UNK_BYTE_0xefbfbd<\xff>]>"


@pytest.mark.parametrize(
    "overrides, error, field",
    [
        ({"tokenizer.ggml.model": "bert"}, UnsupportedError, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.model": None}, UnsupportedError, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.pre": "no-such-split"}, UnsupportedError, "tokenizer.ggml.pre"),
        ({"tokenizer.ggml.pre": "gemma4"}, UnsupportedError, "tokenizer.ggml.pre"),  # SPM-style BPE: not supported
        ({"tokenizer.ggml.add_bos_token": "yes"}, ModelFileError, "tokenizer.ggml.add_bos_token"),
        ({"tokenizer.ggml.token_type": None, "tokenizer.ggml.tokens": ["a", "b", 7]}, ModelFileError,
         "tokenizer.ggml.tokens[2]"),
        ({"tokenizer.ggml.tokens": None}, ModelFileError, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": None}, ModelFileError, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.merges": ["h e", "nospace"]}, ModelFileError, "tokenizer.ggml.merges[1]"),
        ({"tokenizer.ggml.merges": ["h e", "q z"]}, ModelFileError, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.token_type": [1, 1]}, ModelFileError, "tokenizer.ggml.token_type"),
        ({"tokenizer.ggml.eos_token_id": 999}, ModelFileError, "tokenizer.ggml.eos_token_id"),
        ({"tokenizer.ggml.add_bos_token": True}, ModelFileError, "tokenizer.ggml.bos_token_id"),
    ],
)
def test_bad_metadata(overrides, error, field):
    with pytest.raises(error) as info:
        Tokenizer.from_metadata(_tiny_metadata(**overrides), "bad.gguf")
    assert type(info.value) is error
    assert info.value.field == field and info.value.path == "bad.gguf"
    assert "bad.gguf" in str(info.value)
    if field in ("tokenizer.ggml.model", "tokenizer.ggml.pre") and overrides[field]:  # the refused name is quoted
        assert repr(overrides[field]) in str(info.value)


def test_from_gguf_writes_and_reads_back(tmp_path):
    gguf = pytest.importorskip("gguf")
    md = _tiny_metadata(**{"tokenizer.chat_template": "{{ messages }}"})
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_eos_token_id(258)
    w.add_chat_template("{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_gguf(path)
    assert tok.encode("hello") == [257, ord("l"), ord("o")]
    assert tok.eos_id == 258 and tok.chat_template == "{{ messages }}"

    data = path.read_bytes()
    (tmp_path / "magic.gguf").write_bytes(b"GGUX" + data[4:])
    with pytest.raises(ModelFileError) as info:
        Tokenizer.from_gguf(tmp_path / "magic.gguf")
    assert info.value.field == "magic"
    (tmp_path / "short.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated"):
        Tokenizer.from_gguf(tmp_path / "short.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelFileError):
        Tokenizer.from_gguf(tmp_path / "empty.gguf")


# -- differential check against llama.cpp itself (when llama-cpp-python is installed) ------------


@pytest.mark.parametrize("name", NAMES)
def test_matches_llama_cpp(vocabs, name):
    """Every token's piece (special on/off), the stop set, and encode() of tricky strings, vs llama.cpp."""
    _check_against_llama_cpp(_tok(vocabs, name), _vocab_path(name), _reference_cases(name))


def test_harmony_matches_llama_cpp(tmp_path):
    """The gpt-oss corrections (user-defined channel tokens, <|end|> not stopping) and the gpt-4o split,
    on a small harmony-like vocabulary written to a GGUF and loaded by llama.cpp too."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional bench extra)")
    md = _harmony_metadata()
    path = tmp_path / "harmony.gguf"
    _write_vocab_gguf(path, md)
    _check_against_llama_cpp(Tokenizer.from_gguf(path), path, [("HelloWorld ÉCOLE's 1234567 ab!!", [])])


def _write_vocab_gguf(path: Path, md: dict) -> None:
    """A vocab-only GGUF llama.cpp can load: GPT-2 hyper-parameters, then the tokenizer keys of md."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "gpt2")
    for key, value in _metadata(_vocab_path("gpt-2"), "gpt2.").items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    for key, value in md.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _check_against_llama_cpp(tok: Tokenizer, path: Path, cases) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional bench extra)")
    import ctypes

    needed = ("llama_model_get_vocab", "llama_token_to_piece", "llama_vocab_is_eog", "llama_tokenize")
    if not all(hasattr(llama_cpp, f) for f in needed):
        pytest.skip(f"llama_cpp {llama_cpp.__version__} lacks the low-level vocab API")
    model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(model.model)

    buf = ctypes.create_string_buffer(1024)
    for special in (False, True):
        for i in range(tok.n_vocab):
            n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, special)
            assert 0 <= n <= len(buf)
            assert buf.raw[:n] == tok.token_bytes(i, special), (i, special)
    assert tok.stop_ids == {i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)}

    texts = TRICKY + [text for text, _ in cases]
    texts += ["<|im_start|>system\n<|im_end|>\n<|im_start|>user\n</s><|endoftext|>", "<|im_end|<|im_end|>>",
              "x[PAD151650]y[PAD151651]", "<s>[INST] hi [/INST]</s>", "<|user|>\n hi<|end|>\n<|assistant|>",
              "<|start|>assistant<|channel|>final<|message|>hi<|end|><|return|>"]
    for text in texts:
        for special in (False, True):
            want = model.tokenize(text.encode("utf-8"), add_bos=False, special=special)
            assert tok.encode(text, special=special, add_bos=False) == want, (text, special)
        # BOS/EOS as the file (or llama.cpp's default for the vocabulary) says
        assert tok.encode(text, special=True) == model.tokenize(text.encode("utf-8"), add_bos=True, special=True)


def _metadata(path, prefix: str) -> dict:
    with GGUFFile.open(path) as f:
        return {k: v for k, v in f.metadata.items() if k.startswith(prefix)}
