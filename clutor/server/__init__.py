"""`clutor serve`: an OpenAI-compatible HTTP server over one Model (install with ``pip install 'clutor[server]'``).

    from clutor.server import create_app, Limits
    app = create_app(clutor.Model.open("model.gguf"), served_model_name="olmoe")   # any ASGI server runs it

Limits and Defaults import without the server extra (the command line reads their defaults);
create_app and ServerState need Starlette, and load it on first use.
"""
from __future__ import annotations

from .limits import Limits
from .requests import Defaults

__all__ = ["create_app", "Defaults", "Limits", "ServerState"]


def __getattr__(name: str):
    if name in ("create_app", "ServerState"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module 'clutor.server' has no attribute {name!r}")
