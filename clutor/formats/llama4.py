"""Llama 4's calls: a JSON object per call, as its template asks for them and writes them back,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

with nothing around it, or after ``<|python_start|>...<|python_end|>`` (the template writes an
assistant's text between those before its calls). An object whose "name" is not one of the request's
tools is the model's text, not a call. The template describes the tools itself (in the first user
message, or the system message).
"""
from __future__ import annotations

import json
from typing import Sequence

from .base import CallBody, MarkerParser, Opener, Tool, ValueScanner
from .family import Family, Lit, alternatives, json_rule, object_schema, repeat_calls
from .json_fields import object_fields, string_field

__all__ = ["LLAMA4"]

PY_START, PY_END = "<|python_start|>", "<|python_end|>"
OPEN = '{"name"'


class Llama4Body:
    """One reply's call bodies (each starting at '{"name"'); ``reset()`` starts the next."""

    def __init__(self, tools: dict[str, Tool]):
        self.tools = tools
        self.reset()

    def reset(self) -> None:
        self.scan: ValueScanner | None = None
        self.obj = ValueScanner(0)   # the whole object's end
        self.start = 0
        self.name: str | None = None

    def __call__(self, text: str, final: bool) -> CallBody:
        end = self.obj.feed(text)
        if self.name is None:
            fields, _ = object_fields(text, 0)
            span = fields.get("name")
            if span is None or span[1] is None:
                return CallBody(end=end if end is not None else (len(text) if final else None))
            name = string_field(text, span)
            if name not in self.tools:  # not a call to one of the tools: the model's own text, read again
                return CallBody(end=span[1])  # from its name's end (wherever the pieces were cut)
            self.name = name
        if self.scan is None:
            fields, _ = object_fields(text, 0)
            span = fields.get("parameters") or fields.get("arguments")
            if span is None:
                return CallBody(self.name, "{}" if end is not None or final else "", end=end)
            if text[span[0]:span[0] + 1] not in ("{", "["):
                a, b = span
                return CallBody(self.name, (text[a:b] if b is not None else text[a:]).strip(), end=end)
            self.scan, self.start = ValueScanner(span[0]), span[0]
        b = self.scan.feed(text)
        args = (text[self.start:b] if b is not None else text[self.start:]).strip()
        return CallBody(self.name, args, end=end if end is not None else (len(text) if final else None))


class _Llama4(Family):
    name = "llama4"
    markers = (PY_START, PY_END)

    def detect(self, template: str) -> bool:
        return "<|header_start|>" in template and '"parameters": ' in template

    def parser(self, tools, *, think, starts_in_reasoning, prefix=""):
        if tools is None:
            return MarkerParser(reasoning=think, starts_in_reasoning=starts_in_reasoning, prefix=prefix)
        return MarkerParser(reasoning=think, starts_in_reasoning=starts_in_reasoning, prefix=prefix,
                            openers=[Opener(OPEN, keep=True)], dropped=(PY_START, PY_END),
                            body=Llama4Body(tools), keep_unreadable=True)

    def call_grammar(self, tools: Sequence[Tool], parallel: bool, lit: Lit) -> str:
        # spelled out (not one JSON schema) so the call starts with '{"name"', where the parser looks
        rules = {f"call{k}": f'"{{\\"name\\": \\"{t.name}\\", \\"parameters\\": " {json_rule(object_schema(t))} "}}"'
                 for k, t in enumerate(tools)}
        return alternatives(rules) + "\n" + repeat_calls(parallel)

    def render_calls(self, calls) -> str:
        return "".join('{"name": "' + n + '", "parameters": ' + json.dumps(a, ensure_ascii=False) + "}"
                       for n, a in calls)


LLAMA4 = _Llama4()
