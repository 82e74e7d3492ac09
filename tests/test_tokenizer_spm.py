"""SentencePiece vocabularies (tokenizer.ggml.model = llama: Llama-2/Mixtral, Phi-3): merges by score,
byte fallback, llama.cpp's leading-space rule, special tokens, BOS/EOS per the file, streaming."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from clutor.errors import ClutorError, ModelFileError
from clutor.model.gguf import GGUFFile
from clutor.model.tokenizer import Tokenizer
from clutor.model.tokenizer.spm import SentencePiece
from conftest import shared_data

SPACE = "\u2581"


def _path(name: str) -> Path:
    return shared_data(f"vocab/ggml-vocab-{name}.gguf")


def _metadata(path: Path) -> dict:
    with GGUFFile.open(path) as f:
        return dict(f.metadata)


@pytest.fixture(scope="module")
def llama() -> Tokenizer:
    return Tokenizer.from_gguf(_path("llama-spm"))


@pytest.fixture(scope="module")
def phi3() -> Tokenizer:
    return Tokenizer.from_gguf(_path("phi-3"))


class _ReferenceSPM:
    """Textbook SentencePiece BPE: repeatedly merge the adjacent pair whose concatenation is the
    best-scoring vocabulary entry (leftmost on ties); characters left over become <0xXX> bytes."""

    def __init__(self, path: Path):
        md = _metadata(path)
        self.ids: dict[str, int] = {}
        for i, t in enumerate(md["tokenizer.ggml.tokens"]):
            self.ids.setdefault(t, i)
        self.scores = [float(s) for s in md["tokenizer.ggml.scores"]]

    def encode(self, text: str) -> list[int]:
        syms = list(SPACE + text.replace(" ", SPACE)) if text else []
        while True:
            best = None
            for k in range(len(syms) - 1):
                tid = self.ids.get(syms[k] + syms[k + 1])
                if tid is not None and (best is None or self.scores[tid] > best[0]):
                    best = (self.scores[tid], k)
            if best is None:
                break
            k = best[1]
            syms[k : k + 2] = [syms[k] + syms[k + 1]]
        out = []
        for s in syms:
            if s in self.ids:
                out.append(self.ids[s])
            else:
                out.extend(self.ids[f"<0x{b:02X}>"] for b in s.encode("utf-8"))
        return out


TEXTS = [
    "Hello world",
    "  leading and trailing  ",
    "\t tab\nnew line\r\n",
    "日本語 😀🚀 👨‍👩‍👧 emoji and \u00e9\u0301 marks",
    "Ünïcödé ñ ß Æ ø å ⅷ ٣٤٥",
    "<s> </s> <unk> <|end|> [INST] plain text that looks special",
    "a" * 50 + " " * 7 + "b",
    "",
]


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_matches_textbook_spm(name):
    tok = Tokenizer.from_gguf(_path(name))
    ref = _ReferenceSPM(_path(name))
    rng = random.Random(11)
    alphabet = "abcXYZ019 \t\n.,'!?-_<|>[]{}äöüßéñ日本語中文한국어😀🚀\u200d"
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(80)]
    for text in texts:
        # these texts hold no user-defined token text ("</s>" in Phi-3 is one, and is control too)
        assert tok.encode(text, add_bos=False) == ref.encode(text), text
        assert tok.decode(tok.encode(text, add_bos=False)) == text, text


def test_byte_fallback(llama):
    # "🦙" is not in the vocabulary: its four UTF-8 bytes become <0xF0> <0x9F> <0xA6> <0x99>
    ids = llama.encode("🦙", add_bos=False)
    assert [llama.token_text(i) for i in ids] == [SPACE, "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert [llama.token_bytes(i) for i in ids] == [b" ", b"\xf0", b"\x9f", b"\xa6", b"\x99"]
    assert llama.decode(ids) == "🦙" and llama.decode(ids[1:]) == "🦙"
    assert llama.decode(ids[1:3]) == "\ufffd"  # half a character, shown only at the end
    # a byte token decodes to its byte whatever the text around it
    newline = llama.token_id("<0x0A>")
    assert llama.encode("a\nb", add_bos=False) == [llama.token_id(SPACE + "a"), newline, llama.token_id("b")]


def test_stream_decodes_byte_fallback_pieces(llama):
    ids = llama.encode("x 🦙🦙 ü", add_bos=False)
    s = llama.stream()
    pushes = [s.push(i) for i in ids]
    assert "".join(pushes) + s.flush() == " x 🦙🦙 ü"  # streamed text keeps its leading space
    assert all("\ufffd" not in p for p in pushes)
    llama_bytes = [llama.token_id(f"<0x{b:02X}>") for b in "🦙".encode()]
    s = llama.stream()
    assert [s.push(i) for i in llama_bytes] == ["", "", "", "🦙"] and s.flush() == ""
    s = llama.stream()
    assert [s.push(i) for i in llama_bytes[:3]] == ["", "", ""] and s.flush() == "\ufffd"


def test_leading_space_rule(llama):
    """llama.cpp puts a space before every plain fragment that starts the text or follows a special
    token, and only there; decode drops the first token's leading space again."""
    hello = llama.token_id(SPACE + "Hello")
    assert llama.encode("Hello", add_bos=False) == [hello]
    assert llama.encode("Hello") == [llama.bos_id, hello]
    # " Hello" gets its own space too: "▁▁Hello" -> "▁", "▁Hello"
    assert llama.encode(" Hello", add_bos=False) == [llama.token_id(SPACE), hello]
    # after a parsed special token the next fragment starts a new "sentence"
    assert llama.encode("Hello</s>Hello", special=True, add_bos=False) == [hello, llama.eos_id, hello]
    # not parsed, "</s>" is plain text and the second "Hello" gets no space
    plain = llama.encode("Hello</s>Hello", add_bos=False)
    assert llama.eos_id not in plain and plain[-1] == llama.token_id("Hello")
    assert llama.decode([hello]) == "Hello"
    assert llama.decode([llama.bos_id, hello]) == " Hello"  # llama.cpp: the BOS piece takes the strip
    assert llama.decode([hello, hello]) == "Hello Hello"


def test_add_space_prefix_false():
    md = _metadata(_path("llama-spm"))
    md["tokenizer.ggml.add_space_prefix"] = False
    tok = Tokenizer.from_metadata(md, "no-prefix.gguf")
    ids = tok.encode("Hello world", add_bos=False)
    assert tok.token_text(ids[0]) == "Hello" and tok.token_text(ids[-1]) == SPACE + "world"
    assert tok.decode(ids) == "Hello world"


def test_bos_eos_per_file(llama):
    assert llama.add_bos and not llama.add_eos
    assert (llama.bos_id, llama.eos_id, llama.unk_id) == (1, 2, 0)
    assert llama.encode("") == [1] and llama.encode("", add_bos=False) == []
    md = _metadata(_path("llama-spm"))
    md.update({"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True})
    tok = Tokenizer.from_metadata(md, "eos.gguf")
    assert tok.encode("hi") == [*llama.encode("hi", add_bos=False), 2]
    assert tok.encode("hi", add_bos=False) == llama.encode("hi", add_bos=False)
    # SentencePiece files default to Llama's ids when the keys are absent, as llama.cpp does
    for k in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
              "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"):
        md.pop(k)
    tok = Tokenizer.from_metadata(md, "defaults.gguf")
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.add_bos, tok.add_eos) == (1, 2, 0, True, False)


def test_special_tokens(llama):
    assert llama.encode("<s>", special=True, add_bos=False) == [1]
    assert 1 not in llama.encode("<s>", add_bos=False)
    assert llama.decode([1, 2, 0]) == "" and llama.decode([1, 2, 0], special=True) == "<s></s><unk>"
    assert llama.stop_ids == {2}
    assert llama.chat_template is None


def test_phi3_special_tokens(phi3):
    end, user, asst = (phi3.token_id(t) for t in ("<|end|>", "<|user|>", "<|assistant|>"))
    assert phi3.stop_ids == {phi3.token_id("</s>"), phi3.token_id("<|endoftext|>"), end}
    # Phi-3's special tokens swallow the whitespace after them (llama.cpp's rule for this model name)
    ids = phi3.encode("<|user|>\n Hi<|end|>\n<|assistant|>", special=True, add_bos=False)
    assert ids == [user, *phi3.encode("Hi", add_bos=False), end, asst]
    # "</s>" is user-defined in the file but ends a turn, so it is control: parsed only when special
    assert phi3.encode("a</s>", special=True, add_bos=False)[-1] == phi3.token_id("</s>")
    assert phi3.token_id("</s>") not in phi3.encode("a</s>", add_bos=False)
    # unknown-type tokens ([PAD32011]...) are like control ones: parsed and shown only when special
    pad = phi3.token_id("[PAD32011]")
    assert phi3.encode("[PAD32011]", special=True, add_bos=False) == [pad]
    assert pad not in phi3.encode("[PAD32011]", add_bos=False)
    assert phi3.decode([pad]) == "" and phi3.decode([pad], special=True) == "[PAD32011]"


def _tiny(**overrides) -> dict:
    tokens = ["<unk>", "<s>", "</s>", SPACE, "a", "b", SPACE + "a", "ab", SPACE + "ab", "<0x0A>"]
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -2.0, -3.0, -1.5, 0.0],
        "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1, 1, 6],
    }
    md.update(overrides)
    return {k: v for k, v in md.items() if v is not None}


def test_tiny_vocab_scores_and_fallback():
    tok = Tokenizer.from_metadata(_tiny(), "tiny.gguf")
    # "▁ab": "▁a" (-2) vs "ab" (-3): "▁a" merges first, then "▁ab" (-1.5) from "▁a"+"b"
    assert tok.encode("ab", add_bos=False) == [8]
    # "c" is neither a token nor has byte tokens: the unknown token stands for it
    assert tok.encode("c", add_bos=False) == [3, 0]
    assert tok.encode("a\n", add_bos=False) == [6, 9]
    assert tok.decode([8, 9, 0]) == "ab\n"  # first token's space dropped, <unk> hidden
    # without byte tokens and without an unknown token (llama.cpp would throw) the error names the character
    with pytest.raises(ClutorError, match=r"tiny.gguf: 'c' is not in the vocabulary"):
        SentencePiece({"a": 0}, [0.0], None, "tiny.gguf").encode("ac", [])
    no_unk = _tiny(**{"tokenizer.ggml.tokens": ["x", "<s>", "</s>", SPACE, "a", "b", SPACE + "a", "ab",
                                               SPACE + "ab", "<0x0A>"]})
    tok = Tokenizer.from_metadata(no_unk, "tiny.gguf")
    assert tok.encode("c", add_bos=False) == [3, 0]  # id 0 is the default unknown id, whatever its text


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"tokenizer.ggml.scores": [0.0] * 3}, "tokenizer.ggml.scores"),
        ({"tokenizer.ggml.scores": "high"}, "tokenizer.ggml.scores"),
        ({"tokenizer.ggml.bos_token_id": 10}, "tokenizer.ggml.bos_token_id"),
        ({"tokenizer.ggml.add_space_prefix": 1}, "tokenizer.ggml.add_space_prefix"),
    ],
)
def test_bad_spm_metadata(overrides, field):
    with pytest.raises(ModelFileError) as info:
        Tokenizer.from_metadata(_tiny(**overrides), "bad.gguf")
    assert info.value.field == field and "bad.gguf" in str(info.value)
