"""Errors as the OpenAI API shapes them: ``{"error": {"message", "type", "param", "code"}}`` and a status.

Everything the server refuses on purpose is an APIError; the app turns it into that JSON body (or,
mid-stream, into an SSE event) so a client library raises its usual exception, never a traceback.
"""
from __future__ import annotations

from ..errors import ClutorError

__all__ = ["APIError", "bad_request", "error_body"]

# status -> the "type" OpenAI gives such errors
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "requests", 500: "server_error",
          503: "server_error"}


class APIError(ClutorError):
    """A request the server answers with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
