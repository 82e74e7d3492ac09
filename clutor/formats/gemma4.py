"""Gemma 4's calls: the name, then the arguments as a dict in Gemma's own notation, strings between
``<|"|>`` quotes and keys bare:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,opts:{units:<|"|>metric<|"|>}}<tool_call|>

Reasoning is a channel: ``<|channel>thought\\n...<channel|>``, before the content; with thinking off
the template closes an empty one in the prompt. Empty thought channels and stray channel markers the
model writes around its content are dropped, as llama.cpp's Gemma 4 parser drops them.
"""
from __future__ import annotations

import json
from typing import Sequence

from .base import CallBody, MarkerParser, Opener, Tool, held_suffix, json_string_end
from .family import Family, Lit, alternatives, json_rule, part, raw_text, repeat_calls

__all__ = ["GEMMA4", "Gemma4Args"]

OPEN, CLOSE = "<|tool_call>call:", "<tool_call|>"
QUOTE = '<|"|>'
THOUGHT = ("<|channel>thought", "<channel|>")
CHANNEL_OPEN = "<|channel>"
EMPTY_THOUGHTS = ("<|channel>thought\n<channel|>", "<|channel>thought<channel|>")
_WS = " \t\r\n"
_DELIMS = _WS + ",}]"


class Gemma4Args:
    """Gemma's dict notation turned into a JSON object's text as it streams, in linear time: each call
    of ``feed(text)`` reads the new part of the growing text. Strings stream as they arrive; keys,
    numbers and literals are written once complete. Standard JSON strings ("...") are read too (what
    a JSON grammar writes inside the dict). ``end`` is where the outer dict closed."""

    def __init__(self, start: int):
        self.pos = start         # next character to read
        self.out: list[str] = []
        self.stack: list[str] = []   # 'k' (a dict, before a key), 'v' (a dict, before a value), 'a' (an array)
        self.str_quote: str | None = None  # the open string's quote (QUOTE or '"')
        self.esc = False
        self.end: int | None = None
        self.bad = False         # not Gemma notation: nothing more is read

    def text(self) -> str:
        return "".join(self.out)

    def feed(self, s: str, final: bool) -> str:
        n = len(s)
        i = self.pos
        out = self.out
        while i < n and self.end is None and not self.bad:
            if self.str_quote is not None:
                i = self._string(s, i, final)
                if self.str_quote is not None:
                    break
                continue
            c = s[i]
            if c in _WS:
                i += 1
                continue
            top = self.stack[-1] if self.stack else None
            if top is None:
                if c != "{":
                    self.bad = True
                    break
                self.stack.append("k")
                out.append("{")
                i += 1
                continue
            if top == "k":
                if c == "}":
                    self._close(out, "}")
                    i += 1
                    if not self.stack:
                        self.end = i
                    continue
                if c == ",":
                    out.append(", ")
                    i += 1
                    continue
                if c == '"':
                    j = json_string_end(s, i)
                    if j is None:
                        break
                    k = s.find(":", j)
                    if k < 0:
                        break
                    out.append(json.dumps(json.loads(s[i:j]), ensure_ascii=False) + ": ")
                    self.stack[-1] = "v"
                    i = k + 1
                    continue
                k = _find_any(s, i, ":}")
                if k is None:
                    break
                if s[k] == "}":
                    self.bad = True
                    break
                out.append(json.dumps(s[i:k].strip(), ensure_ascii=False) + ": ")
                self.stack[-1] = "v"
                i = k + 1
                continue
            # a value is expected (in a dict after its key, or in an array)
            if top == "a" and c == "]":
                self._close(out, "]")
                i += 1
                continue
            if top == "a" and c == ",":
                out.append(", ")
                i += 1
                continue
            if s.startswith(QUOTE, i) or c == '"':
                self.str_quote = QUOTE if c == "<" else '"'
                out.append('"')
                i += len(self.str_quote)
                continue
            if c == "<" and QUOTE.startswith(s[i:i + len(QUOTE)]) and not final:
                break  # maybe a quote, still arriving
            if c == "{":
                self._value_done()
                self.stack.append("k")
                out.append("{")
                i += 1
                continue
            if c == "[":
                self._value_done()
                self.stack.append("a")
                out.append("[")
                i += 1
                continue
            j = i
            while j < n and s[j] not in _DELIMS:
                j += 1
            if j >= n and not final:
                break
            lit = s[i:j]
            try:
                v = json.loads(lit)
            except ValueError:
                v = lit  # not a number or literal: kept as text, as llama.cpp keeps what it cannot read
            if isinstance(v, (dict, list)):
                v = lit
            out.append(lit if not isinstance(v, str) else json.dumps(v, ensure_ascii=False))
            self._value_done()
            i = j
        self.pos = i
        return self.text()

    def _value_done(self) -> None:
        if self.stack and self.stack[-1] == "v":
            self.stack[-1] = "k"

    def _close(self, out: list[str], ch: str) -> None:
        self.stack.pop()
        out.append(ch)
        self._value_done()

    def _string(self, s: str, i: int, final: bool) -> int:
        n = len(s)
        q = self.str_quote
        if q == QUOTE:
            k = s.find(QUOTE, i)
            if k < 0:
                keep = 0 if final else held_suffix(s[i:], [QUOTE])
                self.out.append(json.dumps(s[i:n - keep], ensure_ascii=False)[1:-1])
                return n - keep
            self.out.append(json.dumps(s[i:k], ensure_ascii=False)[1:-1] + '"')
            self.str_quote = None
            self._value_done()
            return k + len(QUOTE)
        j = i  # a JSON string: copied as written, escapes and all
        while j < n:
            ch = s[j]
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.out.append(s[i:j + 1])
                self.str_quote = None
                self._value_done()
                return j + 1
            j += 1
        if self.esc:  # keep an escape's backslash with what it escapes
            self.out.append(s[i:n - 1])
            self.esc = False
            return n - 1
        self.out.append(s[i:n])
        return n


def _find_any(s: str, i: int, chars: str) -> int | None:
    for j in range(i, len(s)):
        if s[j] in chars:
            return j
    return None


class Gemma4Body:
    """One reply's call bodies: ``NAME{...}``. ``reset()`` starts the next call."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.args: Gemma4Args | None = None
        self.name: str | None = None

    def __call__(self, text: str, final: bool) -> CallBody:
        if self.args is None:
            k = text.find("{")
            if k < 0:  # the name is not complete until its dict opens
                return CallBody()
            self.name = text[:k].strip() or None
            if self.name is None:
                return CallBody()
            self.args = Gemma4Args(k)
        args = self.args.feed(text, final)
        return CallBody(self.name, args)


class _Gemma4(Family):
    name = "gemma4"
    # the texts the parser reads, as the vocabulary's tokens: shown even where they are control tokens
    markers = ("<|tool_call>", CLOSE, QUOTE, CHANNEL_OPEN, THOUGHT[1])
    think = THOUGHT

    def detect(self, template: str) -> bool:
        return "<|tool_call>call:" in template

    def parser(self, tools, *, think, starts_in_reasoning, prefix=""):
        dropped = (EMPTY_THOUGHTS + (THOUGHT[1], CHANNEL_OPEN)) if think else ()
        return MarkerParser(reasoning=think, starts_in_reasoning=starts_in_reasoning, prefix=prefix,
                            openers=[Opener(OPEN, (CLOSE,))] if tools is not None else (), dropped=dropped,
                            body=Gemma4Body(), keep_unreadable=True)

    def call_grammar(self, tools: Sequence[Tool], parallel: bool, lit: Lit) -> str:
        rules, defs = {}, []
        for k, t in enumerate(tools):
            props = (t.parameters or {}).get("properties") or {}
            required = [key for key in ((t.parameters or {}).get("required") or ()) if key in props]
            parts = []
            for key in required + [key for key in props if key not in required]:
                spec = props[key]
                if t.is_string(key):
                    value = f"{lit(QUOTE)} {raw_text(t.spec(key) or spec, QUOTE, defs)} {lit(QUOTE)}"
                else:
                    value = json_rule(part(t.parameters, spec) if isinstance(spec, dict) else {})
                parts.append((key in required, f'"{key}:" {value}'))
            # required arguments first, in order, then any optional ones, comma-separated
            req = [one for r, one in parts if r]
            opt = [one for r, one in parts if not r]
            if req:
                body = " " + ' "," '.join(req) + "".join(f' ("," {one})?' for one in opt)
            elif opt:  # the first argument present has no comma before it
                body = " (" + " | ".join(opt[i] + "".join(f' ("," {one})?' for one in opt[i + 1:])
                                          for i in range(len(opt))) + ")?"
            else:
                body = ""
            rules[f"call{k}"] = f'{lit("<|tool_call>")} "call:{t.name}{{"{body} "}}" {lit(CLOSE)}'
        return "\n".join([alternatives(rules), repeat_calls(parallel)] + defs)

    def render_calls(self, calls) -> str:
        return "".join(f"{OPEN}{n}{{{_gemma_args(a)}}}{CLOSE}" for n, a in calls)

    def template_messages(self, messages: list[dict], template: str) -> list[dict]:
        # Gemma 4's first templates read tool results only from the assistant message's own
        # 'tool_responses' (the later ones also take role 'tool' messages, OpenAI's way): for those the
        # results move there, as llama.cpp moves them
        if OPENAI_TOOL_MESSAGES in template:
            return messages
        return tool_responses_inline(messages)

    def template_prompt(self, prompt: str, add_generation_prompt: bool) -> str:
        # after a model turn with text and tool results the template opens no new turn: llama.cpp does
        if add_generation_prompt and prompt.endswith("<turn|>\n"):
            return prompt + "<|turn>model\n"
        return prompt


OPENAI_TOOL_MESSAGES = "{#- OpenAI Chat Completions:"


def tool_responses_inline(messages: list[dict]) -> list[dict]:
    """assistant(tool_calls) -> tool... -> assistant(text) as one assistant message with tool_calls,
    tool_responses [{name, response}] (a result that is JSON as its value) and the text."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        calls = list(m["tool_calls"])
        merged = {"role": "assistant", "tool_calls": calls}
        if isinstance(m.get("reasoning_content"), str):
            merged["reasoning_content"] = m["reasoning_content"]
        responses = []
        i += 1
        while i < len(messages) and messages[i].get("role") == "tool":
            t = messages[i]
            body = t.get("content")
            if isinstance(body, str):
                try:
                    body = json.loads(body)
                except ValueError:
                    pass
            k = len(responses)
            name = calls[k].get("function", {}).get("name", "") if k < len(calls) else ""
            responses.append({"name": name or t.get("tool_call_id", ""), "response": body})
            i += 1
        if responses:
            merged["tool_responses"] = responses
        if i < len(messages) and messages[i].get("role") == "assistant" and not messages[i].get("tool_calls") \
                and messages[i].get("content"):
            merged["content"] = messages[i]["content"]
            i += 1
        out.append(merged)
    return out


def _gemma_value(v) -> str:
    if isinstance(v, str):
        return QUOTE + v + QUOTE
    if isinstance(v, dict):
        return "{" + _gemma_args(v) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_gemma_value(x) for x in v) + "]"
    return json.dumps(v)


def _gemma_args(args: dict) -> str:
    return ",".join(f"{k}:{_gemma_value(v)}" for k, v in sorted(args.items()))


GEMMA4 = _Gemma4()
