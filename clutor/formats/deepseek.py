"""DeepSeek-V3.1's tool-call tokens:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Several calls chain inside one begin/end pair. The older R1 form (``function<｜tool▁sep｜>NAME`` and
the arguments in a ```json fence) is read too. Its template does not describe the tools, so the
system prompt does, in the words of DeepSeek's own tool-use guide.
"""
from __future__ import annotations

import json
import re
from typing import Sequence

from .base import CallBody, MarkerParser, Opener, Tool, held_suffix
from .family import Family, Lit, alternatives, json_rule, object_schema, repeat_calls

__all__ = ["DEEPSEEK"]

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCE = re.compile(r"([^\n]*)\n```[A-Za-z]*\n")


def deepseek_body(text: str, final: bool) -> CallBody:
    i = text.find(SEP)
    if i < 0:
        return CallBody()
    name, rest = text[:i].strip(), text[i + len(SEP):]
    if name == "function":  # R1: function<｜tool▁sep｜>NAME\n```json\n{...}\n```
        m = _FENCE.match(rest)
        if m is None:
            return CallBody(rest.strip() or None, "{}") if final else CallBody()
        name, rest = m.group(1).strip(), rest[m.end():]
        k = rest.find("```")
        if k >= 0:
            rest = rest[:k]
        elif not final:
            rest = rest[:len(rest) - held_suffix(rest, ["```"])]
    args = rest.strip()
    return CallBody(name or None, args or ("{}" if final else ""))


class _DeepSeek(Family):
    name = "deepseek-v3.1"
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def detect(self, template: str) -> bool:
        return "tool▁calls▁begin" in template

    def parser(self, tools, *, think, starts_in_reasoning, prefix=""):
        if tools is None:
            return MarkerParser(reasoning=think, starts_in_reasoning=starts_in_reasoning, prefix=prefix)
        return MarkerParser(reasoning=think, starts_in_reasoning=starts_in_reasoning, prefix=prefix,
                            openers=[Opener(CALL_BEGIN, (CALL_END,))], dropped=(CALLS_BEGIN, CALLS_END),
                            body=deepseek_body)

    def call_grammar(self, tools: Sequence[Tool], parallel: bool, lit: Lit) -> str:
        rules = {f"call{k}": f'{lit(CALL_BEGIN)} "{t.name}" {lit(SEP)} {json_rule(object_schema(t))} {lit(CALL_END)}'
                 for k, t in enumerate(tools)}
        return (alternatives(rules) + "\n" + repeat_calls(parallel).replace("calls:", "inner:")
                + f"\ncalls: {lit(CALLS_BEGIN)} inner {lit(CALLS_END)}")

    def tools_prompt(self, tools: Sequence[Tool]) -> str | None:
        parts = ["## Tools\nYou have access to the following tools:\n"]
        for t in tools:
            parts.append(f"### {t.name}\nDescription: {t.description}\n\n"
                         f"Parameters: {json.dumps(t.parameters, ensure_ascii=False)}\n")
        parts.append("IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
                     f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}"
                     "{{additional_tool_calls}}" + CALLS_END + "\n\nWhere:\n"
                     "- `tool_call_name` must be an exact match to one of the available tools\n"
                     "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
                     "- For multiple tool calls, chain them directly without separators or spaces")
        return "\n".join(parts)

    def render_calls(self, calls) -> str:
        inner = "".join(f"{CALL_BEGIN}{n}{SEP}{json.dumps(a, ensure_ascii=False)}{CALL_END}" for n, a in calls)
        return CALLS_BEGIN + inner + CALLS_END


DEEPSEEK = _DeepSeek()
