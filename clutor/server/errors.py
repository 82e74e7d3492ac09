"""Errors as each API shapes them, and a status.

OpenAI's (chat, completions, Responses, embeddings, and everything else):
``{"error": {"message", "type", "param", "code"}}``; Anthropic's (``/v1/messages`` and below):
``{"type": "error", "error": {"type", "message"}}``; ollama's (``/api/``): ``{"error": message}``. Everything the server refuses on purpose is an
APIError; whoever answers (a route, the app's handlers, the front door, the connection layer) shapes
it by the request's path through ``error_body``, so a client library raises its usual exception,
never a traceback, whichever layer refused it.
"""
from __future__ import annotations

from ..errors import ClutorError

__all__ = ["APIError", "bad_request", "error_body"]

ANTHROPIC = "/v1/messages"  # the routes that speak Anthropic's Messages API: this path and below
OLLAMA = "/api/"            # ... and ollama's API: ``{"error": message}``

# status -> the "type" OpenAI gives such errors
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "requests", 500: "server_error",
          501: "not_supported_error", 503: "server_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


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

    def body(self, path: str | None = None) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code, path=path)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               path: str | None = None) -> dict:
    """The error's JSON in the shape of the API ``path`` belongs to (OpenAI's when None)."""
    if path is not None and path.startswith(OLLAMA):
        return {"error": message}
    if path is not None and (path == ANTHROPIC or path.startswith(ANTHROPIC + "/")):
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
