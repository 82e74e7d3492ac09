"""Arguments written one XML element each (Qwen3-Coder's <parameter=k>, GLM's <arg_key>/<arg_value>),
turned into a JSON object's text as they stream.

A value is raw text when its schema type is string (or the tool is unknown), else JSON (a number, a
boolean, an object); JSON that does not parse stays a string, as llama.cpp reads it. A string value
streams as it arrives; any other value is written once complete.
"""
from __future__ import annotations

import json
import re

from .base import Tool, held_suffix

__all__ = ["kv_arguments", "kv_pairs"]


def kv_pairs(region: str, opener: re.Pattern, close: str, final: bool) -> list[tuple[str, str, bool]]:
    """The (key, value so far, complete?) pairs of `region`: each value starts after a match of `opener`
    (group 1 the key) and ends at `close`; a last value without its `close` is complete only when `final`,
    and while streaming it holds back a tail that may be the start of `close`."""
    pairs: list[tuple[str, str, bool]] = []
    pos = 0
    while (m := opener.search(region, pos)) is not None:
        key = m.group(1).strip()
        vend = region.find(close, m.end())
        if vend >= 0:
            pairs.append((key, region[m.end():vend], True))
            pos = vend + len(close)
            continue
        v = region[m.end():]
        pairs.append((key, v if final else v[:len(v) - held_suffix(v, [close])], final))
        break
    return pairs


def kv_arguments(pairs: list[tuple[str, str, bool]], tool: Tool | None, closed: bool) -> str:
    """pairs: (key, value so far, complete?) in order; only the last may be incomplete."""
    parts = []
    for key, value, complete in pairs:
        head = json.dumps(key, ensure_ascii=False) + ": "
        if tool is None or tool.is_string(key):
            js = json.dumps(value, ensure_ascii=False)
            parts.append(head + (js if complete else js[:-1]))
        elif complete:
            try:
                v = json.loads(value.strip())
            except ValueError:
                v = value
            parts.append(head + json.dumps(v, ensure_ascii=False))
        else:
            parts.append(head)
    return "{" + ", ".join(parts) + ("}" if closed else "")
