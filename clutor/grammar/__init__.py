"""Constrained decoding: a grammar masks the logits at every step, so the reply parses and validates.

    g = Grammar.json_schema(tokenizer, schema)        # or .json_object, .gbnf, .lark
    model.generate(prompt, logits_processor=g.matcher())  # one matcher per generation
    # each step, on the compute thread: matcher(ids so far, logits) masks what the grammar forbids

The engine is llguidance (guidance-ai's; llama.cpp, vLLM and SGLang build on it too): an Earley
parser over a token trie, so a mask costs microseconds to a fraction of a millisecond even at 150k
tokens with no compile step per grammar (xgrammar precompiles each grammar's masks against the
vocabulary), and one grammar can mix Lark rules, special tokens and embedded JSON schemas, which
the tool-call grammars of each model family need; llama-server's GBNF converts to it.
"""
from __future__ import annotations

from .constraint import Grammar, GrammarError, Matcher, MaskStats

__all__ = ["Grammar", "GrammarError", "Matcher", "MaskStats"]
