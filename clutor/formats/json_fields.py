"""Reading the top-level fields of a JSON object that may still be arriving (Hermes and Mistral calls)."""
from __future__ import annotations

import json

from .base import scan_json_value

__all__ = ["object_fields", "string_field"]

_WS = " \t\r\n"


def object_fields(s: str, i: int = 0) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The fields of the JSON object starting at s[i]: key -> (value start, value end or None while the
    value is unfinished), and the object's end (None while unfinished). Keys are read once complete."""
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    if i >= n or s[i] != "{":
        return {}, None
    i += 1
    fields: dict[str, tuple[int, int | None]] = {}
    while True:
        while i < n and (s[i] in _WS or s[i] == ","):
            i += 1
        if i >= n:
            return fields, None
        if s[i] == "}":
            return fields, i + 1
        if s[i] != '"':
            return fields, None  # not JSON: nothing more can be read
        kend = scan_json_value(s, i)
        if kend is None:
            return fields, None
        try:
            key = json.loads(s[i:kend])
        except ValueError:
            return fields, None
        i = kend
        while i < n and s[i] in _WS:
            i += 1
        if i >= n or s[i] != ":":
            return fields, None
        i += 1
        while i < n and s[i] in _WS:
            i += 1
        vend = scan_json_value(s, i) if i < n else None
        fields[key] = (i, vend)
        if vend is None:
            return fields, None
        i = vend


def string_field(s: str, span: tuple[int, int | None] | None) -> str | None:
    """The value of a finished string field, else None."""
    if span is None or span[1] is None:
        return None
    try:
        v = json.loads(s[span[0]:span[1]])
    except ValueError:
        return None
    return v if isinstance(v, str) else None
