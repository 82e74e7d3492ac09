"""GLM-4.5 / 4.6 / 4.7 calls: the name, then each argument as a key and value element:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

(GLM-4.7 writes the same with no newlines.) Values are taken as written, without trimming.
"""
from __future__ import annotations

import re
from typing import Sequence

from .base import CallBody, MarkerParser, Opener, Tool
from .family import Family, Lit, alternatives, param_rules, repeat_calls
from .xml_args import kv_arguments, kv_pairs

__all__ = ["GLM"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END, VAL, VAL_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>", re.S)


def make_body(tools: dict[str, Tool]):
    def body(text: str, final: bool) -> CallBody:
        cut = [i for i in (text.find("\n", 1 if text.startswith("\n") else 0), text.find(KEY)) if i >= 0]
        if not cut and not final:
            return CallBody()
        name = (text[:min(cut)] if cut else text).strip()
        if not name:
            return CallBody()
        pairs = kv_pairs(text, _PAIR, VAL_END, final)
        return CallBody(name, kv_arguments(pairs, tools.get(name), final))

    return body


class _GLM(Family):
    name = "glm-4.5"
    markers = (OPEN, CLOSE, KEY, KEY_END, VAL, VAL_END)

    def detect(self, template: str) -> bool:
        return KEY in template

    def parser(self, tools, *, think, starts_in_reasoning, prefix=""):
        return MarkerParser(reasoning=think, starts_in_reasoning=starts_in_reasoning, prefix=prefix,
                            openers=[Opener(OPEN, (CLOSE,))] if tools is not None else (), body=make_body(tools or {}))

    def call_grammar(self, tools: Sequence[Tool], parallel: bool, lit: Lit) -> str:
        rules, defs = {}, []
        for k, t in enumerate(tools):
            parts = param_rules(t, VAL_END, defs, lambda key, value: f'{lit(KEY)} "{key}" {lit(KEY_END)} "\\n" {lit(VAL)} {value} {lit(VAL_END)} "\\n"')
            rules[f"call{k}"] = f'{lit(OPEN)} "{t.name}\\n" {parts} {lit(CLOSE)}'
        return "\n".join([alternatives(rules), repeat_calls(parallel)] + defs)

    def render_calls(self, calls) -> str:
        import json

        out = []
        for name, args in calls:
            kv = "".join(f"{KEY}{k}{KEY_END}\n{VAL}{v if isinstance(v, str) else json.dumps(v)}{VAL_END}\n"
                         for k, v in args.items())
            out.append(f"{OPEN}{name}\n{kv}{CLOSE}")
        return "".join(out)


GLM = _GLM()
