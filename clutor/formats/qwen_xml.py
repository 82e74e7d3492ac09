"""The XML function form of Qwen3-Coder and Qwen3.5/3.6:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value loses one newline on each side (the delimiters' own). Some models leave out the opening
<tool_call> and start at <function=; that is read too.
"""
from __future__ import annotations

import re
from typing import Sequence

from .base import CallBody, MarkerParser, Opener, Tool, held_suffix
from .family import Family, Lit, alternatives, param_rules, repeat_calls
from .xml_args import kv_arguments

__all__ = ["QWEN_XML"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNC = re.compile(r"<function=([^>\n]*)>")
_PARAM = re.compile(r"<parameter=([^>\n]*)>")
_PCLOSE = "</parameter>"


def _trim(v: str) -> str:
    v = v[1:] if v.startswith("\n") else v
    return v[:-1] if v.endswith("\n") else v


def make_body(tools: dict[str, Tool]):
    def body(text: str, final: bool) -> CallBody:
        m = _FUNC.search(text)
        if not m:
            return CallBody()
        name = m.group(1).strip()
        rest = text[m.end():]
        fend = rest.find("</function>")
        region = rest if fend < 0 else rest[:fend]
        closed = fend >= 0 or final
        pairs: list[tuple[str, str, bool]] = []
        pos = 0
        while (pm := _PARAM.search(region, pos)) is not None:
            key = pm.group(1).strip()
            vend = region.find(_PCLOSE, pm.end())
            if vend >= 0:
                pairs.append((key, _trim(region[pm.end():vend]), True))
                pos = vend + len(_PCLOSE)
                continue
            v = region[pm.end():]
            if closed:
                pairs.append((key, _trim(v), True))
            else:
                v = v[:len(v) - held_suffix(v, ["\n" + _PCLOSE, _PCLOSE])]  # a newline may be the delimiter's
                pairs.append((key, v[1:] if v.startswith("\n") else v, False))
            break
        return CallBody(name, kv_arguments(pairs, tools.get(name), closed))

    return body


class _QwenXML(Family):
    name = "qwen3-coder"
    markers = (OPEN, CLOSE)

    def detect(self, template: str) -> bool:
        return "<function=" in template and "<parameter=" in template

    def parser(self, tools, *, think, starts_in_reasoning, prefix=""):
        openers = [Opener(OPEN, (CLOSE,)), Opener("<function=", (CLOSE,), keep=True)] if tools is not None else ()
        return MarkerParser(reasoning=think, starts_in_reasoning=starts_in_reasoning, prefix=prefix, openers=openers,
                            body=make_body(tools or {}))

    def call_grammar(self, tools: Sequence[Tool], parallel: bool, lit: Lit) -> str:
        rules, defs = {}, []
        for k, t in enumerate(tools):
            inner = param_rules(t, "\n" + _PCLOSE, defs, lambda key, value: f'"<parameter={key}>\\n" {value} "\\n{_PCLOSE}\\n"')
            rules[f"call{k}"] = f'{lit(OPEN)} "\\n<function={t.name}>\\n" {inner} "</function>\\n" {lit(CLOSE)}'
        return "\n".join([alternatives(rules), repeat_calls(parallel, '"\\n"')] + defs)

    def render_calls(self, calls) -> str:
        out = []
        for name, args in calls:
            ps = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
            out.append(f"{OPEN}\n<function={name}>\n{ps}</function>\n{CLOSE}")
        return "\n".join(out)


QWEN_XML = _QwenXML()
