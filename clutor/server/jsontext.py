"""JSON text from a client, read as standard JSON or refused with a 400 naming where it came from.

NaN and Infinity (which Python's decoder accepts) are refused, and so are numbers of more than
4300 digits and nesting too deep for the decoder (a 10^5-deep array): each would otherwise surface
later as a 500 or pass into a prompt. Used for the request body and for the JSON a body carries as
a string (a tool call's ``arguments``).
"""
from __future__ import annotations

import json

from .errors import bad_request

__all__ = ["loads"]


def loads(text: str | bytes, param: str | None, what: str):
    """The JSON value ``text`` holds; ``param``/``what`` name it in the 400 (``what``: "the request body")."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise bad_request(param, f"{what} is not valid JSON for this server: arrays or objects nested too "
                                 "deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(param, f"{what} is not valid JSON: {str(e)[:200]}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
