"""What the server writes that a client's bytes could shape: metric labels, log lines, error messages.

- Metric labels come from a fixed set: the app's own route templates ("/v1/models/{name:path}"),
  "other" for any path no route matches, and status codes the server chose. A client cannot add
  a series, nor forge a line (label values are escaped all the same).
- A client's text in a log line or an error message goes through ``shown`` (a quoted, escaped,
  shortened rendering of a value) or ``for_log`` (control characters escaped): a newline in a path
  or a model name cannot start a line of its own, a 300-digit number is not echoed back whole.
- ``public`` takes the server's own paths out of a message a client will read.
"""
from __future__ import annotations

import os

__all__ = ["OTHER", "route_label", "prom_label", "shown", "for_log", "public"]

OTHER = "other"  # the label of every request no route matches


def route_label(routes, scope) -> str:
    """The template of the route ``scope`` is for (also when only the method differs), else OTHER."""
    from starlette.routing import Match

    for route in routes:
        try:
            match, _ = route.matches(scope)
        except Exception:  # a path the router cannot even read is no route's
            return OTHER
        if match is not Match.NONE:
            return getattr(route, "path", OTHER)
    return OTHER


def prom_label(value: str) -> str:
    """A label value escaped for the Prometheus text format (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape(s: str) -> str:
    if s.isascii() and s.isprintable():
        return s
    out = []
    for c in s:
        if c.isprintable():
            out.append(c)
        elif c in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c])
        else:  # control characters, line separators, lone surrogates
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    return "".join(out)


def shown(value, limit: int = 60) -> str:
    """A client's value for an error message: strings quoted and escaped, anything cut at ``limit``
    characters (saying how long it was)."""
    if isinstance(value, str):
        text = _escape(value)
        if len(text) > limit:
            return f"'{text[:limit]}...' ({len(value)} characters)"
        return f"'{text}'"
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)  # (JSON numbers past 4300 digits were refused when the body was read)
        return text if len(text) <= limit else f"{text[:12]}... ({len(text)} digits)"
    text = _escape(repr(value))
    return text if len(text) <= limit else text[:limit] + "..."


def for_log(text: str, limit: int = 2000) -> str:
    """A message for one log line: control characters escaped, at most ``limit`` characters."""
    text = _escape(text)
    return text if len(text) <= limit else text[:limit] + "..."


def public(message: str, paths) -> str:
    """``message`` with each of the server's ``paths`` (and their directory) replaced by the file's name."""
    for p in paths:
        p = os.fspath(p)
        if p and p in message:
            message = message.replace(p, os.path.basename(p))
        d = os.path.dirname(os.path.abspath(p)) if p else ""
        if len(d) > 1 and d + os.sep in message:
            message = message.replace(d + os.sep, "")
    return message
