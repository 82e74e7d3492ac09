"""Mistral's [TOOL_CALLS]: a JSON array of calls (Mistral-Nemo, Small 3.x), or one call per marker
with the name and then [ARGS] (Ministral 3, Magistral, Devstral 2):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

Nothing closes a call: it ends with its JSON. Mistral's templates want call ids of nine letters or digits.
"""
from __future__ import annotations

import json
import secrets
import string
from typing import Sequence

from .base import CallBody, MarkerParser, Opener, Tool, scan_json_value
from .family import Family, Lit, alternatives, json_rule, nested, object_schema
from .json_fields import object_fields, string_field

__all__ = ["MISTRAL", "MISTRAL_ARGS"]

CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_WS = " \t\r\n"


def mistral_body(text: str, final: bool) -> CallBody:
    t = text.lstrip()
    off = len(text) - len(t)
    if not t:
        return CallBody()
    if t[0] == "[":  # a JSON array of {"name", "arguments"}
        calls, i, n = [], off + 1, len(text)
        while True:
            while i < n and (text[i] in _WS or text[i] == ","):
                i += 1
            if i >= n:
                return CallBody(calls=calls, end=n if final else None)
            if text[i] == "]":
                return CallBody(calls=calls, end=i + 1)
            e = scan_json_value(text, i)
            if e is None:
                return CallBody(calls=calls, end=n if final else None)
            fields, _ = object_fields(text, i)
            name = string_field(text, fields.get("name"))
            span = fields.get("arguments") or fields.get("parameters")
            if name is not None:
                args = text[span[0]:span[1]].strip() if span and span[1] is not None else "{}"
                calls.append((name, args))
            i = e
    k = t.find(ARGS)
    if k < 0:
        return CallBody(t.strip() or None, "{}", end=len(text)) if final else CallBody()
    name, a = t[:k].strip(), off + k + len(ARGS)
    e = scan_json_value(text, a)
    if e is None:
        return CallBody(name, text[a:].strip() or ("{}" if final else ""), end=len(text) if final else None)
    return CallBody(name, text[a:e].strip(), end=e)


def _nine() -> str:
    chars = string.ascii_letters + string.digits
    return "".join(secrets.choice(chars) for _ in range(9))


class _Mistral(Family):
    markers = (CALLS, ARGS)

    def __init__(self, args_form: bool):
        self.args_form = args_form
        self.name = "mistral" + (" [ARGS]" if args_form else "")

    def detect(self, template: str) -> bool:
        return CALLS in template and (ARGS in template) == self.args_form

    def new_id(self) -> str:
        return _nine()

    def parser(self, tools, *, think, starts_in_reasoning, prefix=""):
        return MarkerParser(reasoning=think, starts_in_reasoning=starts_in_reasoning, prefix=prefix, new_id=_nine,
                            openers=[Opener(CALLS)] if tools is not None else (), body=mistral_body)

    def call_grammar(self, tools: Sequence[Tool], parallel: bool, lit: Lit) -> str:
        if self.args_form:
            rules = {f"call{k}": f'{lit(CALLS)} "{t.name}" {lit(ARGS)} {json_rule(object_schema(t))}'
                     for k, t in enumerate(tools)}
            return alternatives(rules) + "\ncalls: call" + ("+" if parallel else "")
        defs: dict = {}
        one = {"oneOf": [{"type": "object", "properties": {"name": {"const": t.name},
                                                           "arguments": nested(object_schema(t), f"tool{k}", defs)},
                          "required": ["name", "arguments"], "additionalProperties": False}
                         for k, t in enumerate(tools)]}
        array = {"type": "array", "items": one, "minItems": 1}
        if defs:
            array["$defs"] = defs
        if not parallel:
            array["maxItems"] = 1
        return f"calls: {lit(CALLS)} {json_rule(array)}"

    def render_calls(self, calls) -> str:
        if self.args_form:
            return "".join(f"{CALLS}{n}{ARGS}{json.dumps(a, ensure_ascii=False)}" for n, a in calls)
        return CALLS + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


MISTRAL = _Mistral(args_form=False)
MISTRAL_ARGS = _Mistral(args_form=True)
