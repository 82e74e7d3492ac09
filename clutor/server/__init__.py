"""`clutor serve`: an OpenAI-compatible HTTP server over one Model (install with ``pip install 'clutor[server]'``).

    from clutor.server import create_app
    app = create_app(clutor.Model.open("model.gguf"), served_model_name="olmoe")   # any ASGI server runs it
"""
from __future__ import annotations

from .app import ServerState, create_app
from .requests import Defaults

__all__ = ["create_app", "Defaults", "ServerState"]
