"""Constrained decoding (clutor.grammar over llguidance) on a random-weight model: the reply follows the
grammar every time. Validity is judged by the jsonschema package's validator, not by our own code."""
from __future__ import annotations

import json

import numpy as np
import pytest

llguidance = pytest.importorskip("llguidance", reason="llguidance (constrained decoding) is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="the jsonschema validator is in the test extra")

import clutor  # noqa: E402
from clutor.grammar import Grammar, GrammarError  # noqa: E402
from clutor.model.tokenizer import Tokenizer  # noqa: E402
from conftest import SHARED_DATA, fixture_path, run  # noqa: E402

MODEL = fixture_path("qwen3moe", "Q8_0")
OPEN = dict(io="threads", n_ctx=512)

# Ten schemas: nested objects, arrays, enums, required fields, numbers with ranges. Strings and arrays
# carry bounds so that even a random-weight model's reply ends within the token budget.
S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "shade": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "email": S}, "required": ["id", "email"],
        "additionalProperties": False}, "active": {"type": "boolean"}}, "required": ["user", "active"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "enum": [200, 404, 500]},
                                      "detail": {"anyOf": [S, {"type": "null"}]}},
     "required": ["status", "code", "detail"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "integer", "exclusiveMinimum": 0,
                                                                          "exclusiveMaximum": 10}},
     "required": ["ok", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"enum": ["x", "y"]}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}, "n": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     "required": ["a", "n"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(MODEL)


async def _reply(model, grammar, **kw):
    text, last = [], None
    m = grammar.matcher() if grammar is not None else None
    async for c in model.generate("Answer in JSON:", logits_processor=m, max_tokens=400, **kw):
        text.append(c.text)
        last = c
    return "".join(text), (last.stats, m.stats if m is not None else None)


def test_schemas_validate_greedy_and_sampled(tok):
    """generate(grammar=) in the library (the server tests run all ten schemas through the openai client)."""
    async def main():
        async with clutor.Model.open(MODEL, **OPEN) as model:
            for k, schema in enumerate(SCHEMAS[:3]):
                g = Grammar.json_schema(tok, schema)
                for kw in (dict(temperature=0), dict(temperature=1.5, seed=k, top_k=0, top_p=1.0, min_p=0)):
                    text, (stats, masks) = await _reply(model, g, **kw)
                    assert stats.stop_reason == "eos", (k, kw, text)
                    jsonschema.validate(json.loads(text), schema)
                    assert masks.masks == stats.generated_tokens  # one mask per sampled token

    run(main())


def _completes_to_object(prefix: str) -> bool:
    """Whether some ending makes ``prefix`` a JSON object, judged by the json module: the open strings and
    containers are closed after each of a few short middles (a key's colon and value, a literal's tail)."""
    stack, in_str, esc = [], False, False
    for ch in prefix:
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append(ch)
        elif ch in "}]":
            stack.pop()
    head = prefix + ("n" if esc else "")
    closers = "".join("}" if c == "{" else "]" for c in reversed(stack))
    middles = ['"', '":0', '": 0', '"0'] if in_str else [
        "", "0", ':0', '"":0', "ull", "ll", "l", "rue", "ue", "e", "alse", "lse", "se"]
    for mid in middles:
        try:
            if isinstance(json.loads(head + mid + closers), dict):
                return True
        except ValueError:
            pass
    return False


def test_json_object_and_unconstrained_differ(tok):
    """Under the json_object grammar the reply is a JSON object, or (a random model may write one key for
    ever) the start of one when the token budget ends it; the model alone writes no JSON."""
    assert _completes_to_object('{"a": [1, {"b": "x\\') and not _completes_to_object('{"a" 1')

    async def main():
        async with clutor.Model.open(MODEL, **OPEN) as model:
            text, (stats, _) = await _reply(model, Grammar.json_object(tok), temperature=0)
            if stats.stop_reason == "eos":
                assert isinstance(json.loads(text), dict), text
            else:
                assert stats.stop_reason == "length" and _completes_to_object(text), (stats.stop_reason, text)
            free, _ = await _reply(model, None, temperature=0, ignore_eos=True)
            with pytest.raises(ValueError):
                json.loads(free)  # the random model alone does not write JSON

    run(main())


def test_gbnf_grammar(tok):
    gbnf = r'''root ::= "Answer: " ("yes" | "no") ", because " [a-z ]{1,20} "."'''
    import re

    async def main():
        async with clutor.Model.open(MODEL, **OPEN) as model:
            for seed in range(3):
                text, _ = await _reply(model, Grammar.gbnf(tok, gbnf), temperature=1.0, seed=seed)
                assert re.fullmatch(r"Answer: (yes|no), because [a-z ]{1,20}\.", text), text

    run(main())


def test_bad_grammars_name_the_problem(tok):
    with pytest.raises(GrammarError, match="grammar"):
        Grammar.gbnf(tok, "root ::= missing_rule")
    with pytest.raises(GrammarError):
        Grammar.json_schema(tok, {"type": "object", "properties": {"a": {"type": "nosuchtype"}}})
    with pytest.raises(GrammarError):
        Grammar.json_schema(tok, ["not", "a", "schema"])


def test_mask_allows_exactly_the_grammar(tok):
    """Every allowed token keeps the text a prefix of the grammar's language; the mask costs are counted."""
    g = Grammar.lark(tok, 'start: "abc" ("d" | "e")')
    m = g.matcher()
    prompt = [1, 2, 3]
    logits = m(prompt, np.zeros(tok.n_vocab, dtype=np.float32))
    allowed = np.flatnonzero(np.isfinite(logits))
    texts = {tok.token_bytes(int(i)) for i in allowed}
    assert texts and all(b"abcd".startswith(t) or b"abce".startswith(t) for t in texts)
    a = tok.encode("abc", add_bos=False)
    logits = m(prompt + a, np.zeros(tok.n_vocab, dtype=np.float32))  # the tokens since the last call are read
    assert {tok.token_bytes(int(i)) for i in np.flatnonzero(np.isfinite(logits))} == {b"d", b"e"}
    assert m.stats.masks == 2 and m.stats.cpu_seconds >= 0


def test_a_token_the_grammar_refuses_ends_the_reply(tok):
    m = Grammar.lark(tok, 'start: "abc"').matcher()
    m([0], np.zeros(tok.n_vocab, dtype=np.float32))
    logits = m([0, tok.encode("zzz", add_bos=False)[0]], np.zeros(tok.n_vocab, dtype=np.float32))  # refused
    assert m.error
    assert set(np.flatnonzero(np.isfinite(logits)).tolist()) == set(tok.stop_ids)


VOCAB_150K = SHARED_DATA / "vocab" / "ggml-vocab-qwen2.gguf"


@pytest.mark.skipif(not VOCAB_150K.exists(), reason=f"Qwen2's 151,936-token vocabulary (llama.cpp's test vocab) "
                                                    f"is not at {VOCAB_150K}")
def test_random_walk_under_a_150k_vocabulary():
    """Drawing uniformly among the allowed tokens of a real 150k vocabulary still yields valid JSON."""
    tok = Tokenizer.from_gguf(VOCAB_150K)
    schema = SCHEMAS[3]
    g = Grammar.json_schema(tok, schema)
    rng = np.random.default_rng(0)
    for _ in range(3):
        m, ids = g.matcher(), []
        for _ in range(300):
            logits = m(ids, np.zeros(tok.n_vocab, dtype=np.float32))
            allowed = np.flatnonzero(np.isfinite(logits))
            t = int(rng.choice(allowed))
            if t in tok.stop_ids:
                break
            ids.append(t)
        assert m.error is None
        jsonschema.validate(json.loads(tok.decode(ids)), schema)
