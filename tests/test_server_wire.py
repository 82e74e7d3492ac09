"""What the server does per streamed token, counted: the bytes it writes and the Python objects it builds
for them (the server's share of a token's cost at many clients, beside the engine's step)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
pytest.importorskip("uvicorn", reason="the server extra is not installed")
import httpx  # noqa: E402

import clutor  # noqa: E402
from clutor.formats import Delta  # noqa: E402
from clutor.server import create_app  # noqa: E402
from clutor.server.responses import Shaper, json_bytes  # noqa: E402
from conftest import fixture_path  # noqa: E402
from server_util import LiveServer  # noqa: E402

MODEL = fixture_path("qwen3moe", "Q8_0")
TEXTS = ["", "a", " the", 'say "hi"', "back\\slash", "line\nbreak\t", "\u00e9\u4e2d\U0001f600", "\ud800 lone",
         "\ue000clutor-content\ue001", "data: [DONE]\n\n", "\x00\x1f"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_content_event_is_the_generic_chunk_byte_for_byte(kind, include_usage):
    fast = Shaper(kind, "cmpl-0123abcd", 1700000000, 'a "quoted" model\u00e9', None, include_usage)
    slow = Shaper(kind, "cmpl-0123abcd", 1700000000, 'a "quoted" model\u00e9', None, include_usage)
    for text in TEXTS:
        events = slow.delta(Delta(content=text), [])
        if not events:  # nothing to send for an empty completion delta: the stream skips it too
            continue
        (name, body), = events
        assert name is None
        assert fast.content_event(text) == b"data: " + json_bytes(body) + b"\n\n"


@pytest.fixture(scope="module")
def srv():
    s = LiveServer(create_app(clutor.Model.open(MODEL, io="threads", expert_cache="50%", n_ctx=256),
                              served_model_name="tiny", max_sequences=4))
    yield s
    s.stop()


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_streamed_token_builds_no_chunk_dict(srv, route, monkeypatch):
    """Each token's event is the stream's pre-rendered frame around the text's JSON: the chunk dicts
    built are the stream's constant few (the frame itself, the opening role, the finish and usage
    chunks), whatever the number of tokens; the client still reads every token's text."""
    built = []
    orig = Shaper._chunk
    monkeypatch.setattr(Shaper, "_chunk", lambda self, choice: built.append(choice) or orig(self, choice))
    n = 24
    body = {"model": "tiny", "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Tell me about the expert cache"}]
    else:
        body["prompt"] = "The expert cache streams"
    texts, usage = [], None
    with httpx.stream("POST", srv.url + route, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for ch in ev["choices"]:
                t = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                if t:
                    texts.append(t)
    assert usage["completion_tokens"] == n
    assert len(texts) >= n // 2  # (a multi-byte character's pieces come as one)
    assert len(built) <= 4, f"{len(built)} chunk dicts for {n} tokens"


def test_serve_takes_short_turns_on_the_gil(monkeypatch):
    """`clutor serve` sets its process's GIL switch interval (clutor.server.run.SWITCH_INTERVAL) before it
    serves: the loop's per-token work and the compute thread's glue then wait at most 0.5 ms for each
    other instead of Python's 5 ms. (Recorded, not applied, so this test process keeps its own.)"""
    import sys

    import clutor.server
    from clutor.cli import main
    from clutor.server import run

    asked, openers = [], []
    monkeypatch.setattr(sys, "setswitchinterval", asked.append)
    real_app = clutor.server.create_app
    monkeypatch.setattr(clutor.server, "create_app", lambda model, **kw: openers.append(model) or real_app(model, **kw))

    async def serve(self, sockets=None):
        asked.append(("serving", len(sockets)))
        for s in sockets:
            s.close()
        for opener in openers:  # the model is never opened: nothing is served
            opener.close()

    monkeypatch.setattr(run.Server, "serve", serve)
    assert main(["serve", str(MODEL), "--port", "0", "--log-level", "warning"]) == 0
    assert asked == [run.SWITCH_INTERVAL, ("serving", 1)] and run.SWITCH_INTERVAL <= 0.001
