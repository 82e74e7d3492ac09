"""MiniMax-M2's calls: one block holding an ``<invoke>`` element per call, an element per argument:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

A value is taken as written (a string argument raw, any other JSON). The template opens ``<think>``
in the prompt, so a reply starts in its reasoning.
"""
from __future__ import annotations

import re
from typing import Sequence

from .base import CallBody, MarkerParser, Opener, Tool
from .family import Family, Lit, alternatives, param_rules, repeat_calls
from .xml_args import kv_arguments, kv_pairs

__all__ = ["MINIMAX_M2"]

BLOCK, BLOCK_END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE, INVOKE_END = '<invoke name="', "</invoke>"
_NAME = re.compile(r'([^"\n]*)">')
_PARAM = re.compile(r'<parameter name="([^"\n]*)">')
_PCLOSE = "</parameter>"


def make_body(tools: dict[str, Tool]):
    def body(text: str, final: bool) -> CallBody:
        m = _NAME.match(text)
        if not m:
            return CallBody()
        name = m.group(1).strip()
        if not name:
            return CallBody()
        region = text[m.end():]
        pairs = kv_pairs(region, _PARAM, _PCLOSE, final)
        return CallBody(name, kv_arguments(pairs, tools.get(name), final))

    return body


class _MiniMaxM2(Family):
    name = "minimax-m2"
    markers = (BLOCK, BLOCK_END)

    def detect(self, template: str) -> bool:
        return BLOCK in template and INVOKE in template

    def parser(self, tools, *, think, starts_in_reasoning, prefix=""):
        if tools is None:
            return MarkerParser(reasoning=think, starts_in_reasoning=starts_in_reasoning, prefix=prefix)
        return MarkerParser(reasoning=think, starts_in_reasoning=starts_in_reasoning, prefix=prefix,
                            openers=[Opener(INVOKE, (INVOKE_END,))], dropped=(BLOCK, BLOCK_END),
                            body=make_body(tools), keep_unreadable=True)

    def call_grammar(self, tools: Sequence[Tool], parallel: bool, lit: Lit) -> str:
        rules, defs = {}, []
        for k, t in enumerate(tools):
            parts = param_rules(t, _PCLOSE, defs, lambda key, value: f'"<parameter name=\\"{key}\\">" {value} "{_PCLOSE}\\n"')
            rules[f"call{k}"] = f'"{INVOKE.replace(chr(34), chr(92) + chr(34))}{t.name}\\">\\n" {parts} "{INVOKE_END}\\n"'
        inner = repeat_calls(parallel).replace("calls:", "inner:")
        return "\n".join([alternatives(rules), inner, f'calls: {lit(BLOCK)} "\\n" inner {lit(BLOCK_END)}'] + defs)

    def render_calls(self, calls) -> str:
        import json

        out = []
        for name, args in calls:
            ps = "".join(f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}'
                         f"{_PCLOSE}\n" for k, v in args.items())
            out.append(f'{INVOKE}{name}">\n{ps}{INVOKE_END}\n')
        return f"\n{BLOCK}\n" + "".join(out) + BLOCK_END


MINIMAX_M2 = _MiniMaxM2()
