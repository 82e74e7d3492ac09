"""Grammars (what a request constrains the reply to) and matchers (one generation's place in one).

A Matcher is a logits processor in the engine's sense: called on the compute thread before each
sampling with the ids so far and the logits [V], it advances its parser over the tokens sampled
since its last call, computes the mask of what may come next, and sets every other logit to -inf.
llguidance computes a mask in microseconds to a fraction of a millisecond (it drops the GIL while it
does), so the mask is computed right there, off the event loop, with its CPU time counted per matcher
(``stats``): overlapping it with the next forward would save that fraction of a step and cost a
thread hand-off per token.

A matcher never raises into the engine's step: if the parser ends up in an error state, it allows
only the end-of-generation tokens and ``error`` says why.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import ClutorError
from . import compiler
from .vocab import ll_tokenizer

__all__ = ["Grammar", "GrammarError", "Matcher", "MaskStats", "WHITESPACE"]

# JSON whitespace between tokens, as llama.cpp's json-schema-to-grammar allows it: nothing, a space,
# or a line break or two and an indent. Bounded, so a model cannot pad forever between two tokens.
WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"

class GrammarError(ClutorError):
    """The grammar or schema cannot be compiled; the message says where."""


def _limits():
    from llguidance import LLParserLimits

    # llguidance's defaults, with errors that do not echo the grammar back
    return LLParserLimits(verbose_errors=False)


def _compile(ll, llg: str, what: str):
    """The matcher every generation copies (on a compiler thread: the native compiler recurses)."""
    from llguidance import LLMatcher

    is_error, msgs = LLMatcher.validate_grammar_with_warnings(llg, ll, limits=_limits())
    if is_error:
        raise GrammarError(f"{what}: {_brief(msgs[0] if msgs else 'invalid grammar')}")
    m = LLMatcher(ll, llg, log_level=0, limits=_limits())
    if m.is_error():
        raise GrammarError(f"{what}: {_brief(m.get_error() or 'invalid grammar')}")
    return m


def _brief(msg: str, limit: int = 600) -> str:
    """llguidance's message, cut: it quotes the grammar's offending line, which may be a megabyte long."""
    lines = [ln if len(ln) <= 200 else ln[:200] + "..." for ln in msg.splitlines()]
    out = "\n".join(lines)
    return out if len(out) <= limit else out[:limit] + "..."


class Grammar:
    """A compiled constraint for one tokenizer. Build with the class methods; ``matcher()`` per generation."""

    def __init__(self, tokenizer, llg: str, what: str):
        self.tokenizer = tokenizer
        self.what = what
        self._ll = ll_tokenizer(tokenizer)
        self.n_vocab = tokenizer.n_vocab
        # compiled once, on a compiler thread (see compiler.py); each matcher starts from a copy
        self._proto = compiler.run(_compile, self._ll, llg, what)

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def lark(cls, tokenizer, text: str, what: str = "grammar") -> "Grammar":
        """A Lark grammar in llguidance's dialect (``%json {...}`` embeds a JSON schema)."""
        from llguidance import LLMatcher

        compiler.check(text, what)
        return cls(tokenizer, LLMatcher.grammar_from_lark(text), what)

    @classmethod
    def gbnf(cls, tokenizer, text: str, what: str = "grammar") -> "Grammar":
        """A GBNF grammar as llama-server's ``grammar`` field takes it (root rule ``root``)."""
        from llguidance.gbnf_to_lark import any_to_lark

        compiler.check(text, what)  # before converting: the converter is Python, and recursive
        try:
            lark = any_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions on bad input
            raise GrammarError(f"{what}: not a valid GBNF grammar: {e}") from None
        return cls.lark(tokenizer, lark, what)

    @classmethod
    def json_schema(cls, tokenizer, schema: dict, *, strict: bool = True, what: str = "json_schema") -> "Grammar":
        """JSON matching ``schema``; ``strict=False`` ignores keywords llguidance does not implement."""
        return cls.lark(tokenizer, "start: " + json_term(schema, strict=strict), what)

    @classmethod
    def json_object(cls, tokenizer, what: str = "response_format") -> "Grammar":
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls.json_schema(tokenizer, {"type": "object"}, what=what)

    def lit(self, text: str) -> str:
        """A Lark term producing exactly ``text``: the token itself when ``text`` is one of the
        vocabulary's control tokens (it has no spelling in bytes), else the quoted string."""
        return lark_literal(self.tokenizer, text)

    def matcher(self) -> "Matcher":
        return Matcher(self)

    def __repr__(self) -> str:
        return f"<Grammar {self.what}>"


def json_term(schema: dict, *, strict: bool = True) -> str:
    """An llguidance Lark term for one JSON value matching ``schema``, with bounded whitespace."""
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    s = dict(schema)
    opts = s.get("x-guidance")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise GrammarError(f"'x-guidance' must be an object of llguidance's JSON options, got {type(opts).__name__}")
    opts = dict(opts)
    if "whitespace_pattern" in opts:
        raise GrammarError("'x-guidance.whitespace_pattern' cannot be set: whitespace between JSON tokens is "
                           "bounded by this server (set 'whitespace_flexible': false for none)")
    if opts.get("whitespace_flexible", True) is not False:
        opts.pop("whitespace_flexible", None)
        opts["whitespace_pattern"] = WHITESPACE
    if not strict:
        opts.setdefault("lenient", True)
    s["x-guidance"] = opts
    return "%json " + json.dumps(s, ensure_ascii=False)


def lark_literal(tokenizer, text: str) -> str:
    i = tokenizer.token_id(text)
    if i is not None and not tokenizer.token_bytes(i) and tokenizer.token_bytes(i, special=True) == text.encode():
        return f"<[{i}]>"
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True)
class MaskStats:
    masks: int               # masks computed (one per sampled token)
    cpu_seconds: float       # CPU time computing them (thread time of the compute thread)
    apply_seconds: float     # time setting the disallowed logits to -inf

    @property
    def us_per_mask(self) -> float:
        return 1e6 * self.cpu_seconds / self.masks if self.masks else 0.0


class Matcher:
    """One generation's place in a grammar; ``matcher(ids, logits) -> logits`` (see the module docstring)."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._m = grammar._proto.deep_copy()
        self.n_vocab = grammar.n_vocab
        self._words = (self.n_vocab + 31) // 32
        self._bits = np.empty(self._words, dtype=np.int32)  # [V/32] one bit per token
        self._stops = np.array(sorted(grammar.tokenizer.stop_ids), dtype=np.int64)
        self.error: str | None = self._m.get_error() or None
        self._start: int | None = None  # len(ids) at the first call: the prompt
        self._seen = 0
        self._masks = 0
        self._cpu = self._apply = 0.0

    def __call__(self, ids: Sequence[int], logits: np.ndarray) -> np.ndarray:
        """The engine's logits processor: ``ids`` so far (prompt + reply), ``logits`` [V] float32, masked in place."""
        if self._start is None:
            self._start = self._seen = len(ids)
        for t in ids[self._seen:]:
            self.accept(int(t))
        self._seen = len(ids)
        self.apply(logits)
        return logits

    def allowed(self) -> np.ndarray | None:
        """[V] bool: what the grammar allows next (None when the matcher is in error)."""
        if self._m.is_error():
            return None
        c0 = time.thread_time()
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab].view(np.bool_)  # [V]
        self._cpu += time.thread_time() - c0
        self._masks += 1
        return allowed

    def apply(self, logits: np.ndarray) -> None:
        """Set the logits [V] of every token the grammar does not allow now to -inf (in place)."""
        allowed = self.allowed()
        t1 = time.perf_counter()
        if allowed is None or not allowed.any():
            if self.error is None:
                self.error = self._m.get_error() or "the grammar allows no token here"
            allowed = np.zeros(self.n_vocab, dtype=np.bool_)
            allowed[self._stops[self._stops < self.n_vocab]] = True  # end the reply
        np.copyto(logits[: self.n_vocab], -np.inf, where=~allowed)
        if logits.shape[0] > self.n_vocab:  # a padded output row: the padding is never a token
            logits[self.n_vocab:] = -np.inf
        self._apply += time.perf_counter() - t1

    def accept(self, token: int) -> None:
        """Advance over a sampled token."""
        if not self._m.consume_token(int(token)) and self.error is None:
            self.error = self._m.get_error() or f"token {token} is not allowed by the grammar"

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more but the end."""
        return self._m.is_stopped()

    @property
    def stats(self) -> MaskStats:
        return MaskStats(self._masks, self._cpu, self._apply)
