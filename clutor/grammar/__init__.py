"""Constrained decoding: a grammar masks the logits at every step, so the reply parses and validates.

    g = Grammar.json_schema(tokenizer, schema)        # or .json_object, .gbnf, .lark, .tool_calls
    m = g.matcher()                                   # one per generation
    m.apply(logits)      # on the compute thread: disallowed tokens -> -inf (waits for the mask)
    m.accept(token)      # advance; the next mask is computed on a worker thread meanwhile

The engine is llguidance (Microsoft's; what llama.cpp, vLLM and SGLang also build on): an Earley
parser over a lazily built token trie, so a mask costs microseconds to a fraction of a millisecond
even at 150k tokens, needs no per-vocabulary precompilation (xgrammar compiles each grammar against
the vocabulary first), and takes JSON schemas, Lark and GBNF (llama-server's grammar format) alike.
"""
from __future__ import annotations

from .constraint import Grammar, GrammarError, Matcher, MaskStats

__all__ = ["Grammar", "GrammarError", "Matcher", "MaskStats"]
