"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3, and Clutor's format for templates without tools):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

One block per call; the arguments stream as the model writes them. Some models write "parameters"
for "arguments", or the arguments as a JSON string; both are read.
"""
from __future__ import annotations

import json
from typing import Sequence

from .base import CallBody, MarkerParser, Opener, Tool, ValueScanner, loads_or
from .family import Family, Lit, alternatives, json_rule, nested, object_schema, repeat_calls
from .json_fields import object_fields, string_field

__all__ = ["HERMES", "HERMES_FALLBACK", "hermes_body"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesBody:
    """The body parser of one reply's calls. A call's text only grows until the next call starts, so
    once the arguments' value has begun it is scanned incrementally (a long argument streams in linear
    time); the fields before it are read whole, once each piece. ``reset()`` starts the next call."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """A new call begins (MarkerParser says so when it opens one)."""
        self.scan: ValueScanner | None = None
        self.start = 0           # where the arguments' value starts
        self.name: str | None = None

    def __call__(self, text: str, final: bool) -> CallBody:
        if self.scan is None:
            start = text.find("{")
            if start < 0:
                return CallBody()
            fields, end = object_fields(text, start)
            self.name = string_field(text, fields.get("name"))
            span = fields.get("arguments") or fields.get("parameters")
            if span is None:
                return CallBody(self.name, "{}" if end is not None and self.name is not None else "")
            a, b = span
            if text[a:a + 1] == '"':  # the arguments as a JSON string: only once complete
                inner = loads_or(text[a:b], None) if b is not None else None
                return CallBody(self.name, inner.strip() if isinstance(inner, str) else "")
            if text[a:a + 1] not in ("{", "["):
                return CallBody(self.name, (text[a:b] if b is not None else text[a:]).strip())
            self.scan, self.start = ValueScanner(a), a
        b = self.scan.feed(text)
        args = (text[self.start:b] if b is not None else text[self.start:]).strip()
        if self.name is None and b is not None:  # "name" after "arguments"
            self.name = string_field(text, object_fields(text, text.find("{"))[0].get("name"))
        return CallBody(self.name, args)


def hermes_body(text: str, final: bool) -> CallBody:
    """One call's body read on its own (a fresh HermesBody)."""
    return HermesBody()(text, final)


class _Hermes(Family):
    name = "hermes"
    markers = (OPEN, CLOSE)

    def __init__(self, native: bool):
        self.native = native
        if not native:
            self.name = "hermes (tools in the system prompt)"

    def detect(self, template: str) -> bool:
        return OPEN in template

    def parser(self, tools, *, think, starts_in_reasoning, prefix=""):
        return MarkerParser(reasoning=think, starts_in_reasoning=starts_in_reasoning, prefix=prefix,
                            openers=[Opener(OPEN, (CLOSE,))] if tools is not None else (), body=HermesBody())

    def call_grammar(self, tools: Sequence[Tool], parallel: bool, lit: Lit) -> str:
        rules = {}
        for k, t in enumerate(tools):
            defs: dict = {}
            schema = {"type": "object", "properties": {"name": {"const": t.name},
                                                       "arguments": nested(object_schema(t), "tool", defs)},
                      "required": ["name", "arguments"], "additionalProperties": False}
            if defs:
                schema["$defs"] = defs
            rules[f"call{k}"] = f'{lit(OPEN)} "\\n" {json_rule(schema)} "\\n" {lit(CLOSE)}'
        return alternatives(rules) + "\n" + repeat_calls(parallel, '"\\n"')

    def tools_prompt(self, tools: Sequence[Tool]) -> str | None:
        if self.native:
            return None
        lines = "\n".join(json.dumps({"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters}}, ensure_ascii=False)
            for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and "
                "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_calls(self, calls) -> str:
        return "\n".join(f"{OPEN}\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + f"\n{CLOSE}"
                         for n, a in calls)


HERMES = _Hermes(native=True)
HERMES_FALLBACK = _Hermes(native=False)
