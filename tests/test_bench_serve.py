"""The load generator's bookkeeping (clutor.bench.serve_load) against scripted streams: what it counts as
decoded is what the server's usage says, and a stream that stops before max_tokens is counted short."""
import asyncio
import json

import httpx
import pytest

from clutor.bench.serve_load import run_level


def _sse(events) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _server(n_tokens: int, *, chat: bool, usage: bool = True, seen=None):
    """A fake OpenAI server streaming n_tokens one-token events, then usage."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if seen is not None:
            seen.append((request.url.path, body))
        piece = (lambda t: {"delta": {"content": t}}) if chat else (lambda t: {"text": t})
        events = [{"choices": [{"index": 0, **piece(f" w{i}")}]} for i in range(n_tokens)]
        if usage:
            events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n_tokens}})
        return httpx.Response(200, content=_sse(events), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_full_stream_counts_its_usage(route):
    seen = []
    res = asyncio.run(run_level("http://x", "m", [[1, 2, 3], [4, 5]], 2, 3, 6, route=route, first=1,
                                transport=_server(6, chat=route == "chat", seen=seen)))
    assert res.errors == 0 and res.short == 0
    assert res.completion_tokens == 2 * 3 * 6 and res.events == 2 * 3 * 6 and res.prompt_tokens == 2 * 3 * 5
    assert len(res.ttft) == 6 and len(res.itl) == 6 * 5
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[route]
    assert {p for p, _ in seen} == {path}
    for _, body in seen:
        assert body["max_tokens"] == 6 and body["temperature"] == 0 and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    sent = [b["messages"][0]["content"] if route == "chat" else b["prompt"] for _, b in seen]
    # client i's request j sends prompts[(first + i * requests + j) % len]: 1, 2, 3 (=1), 4 (=0), ...
    assert sorted(map(str, sent)) == sorted(map(str, [[4, 5], [1, 2, 3]] * 3))


def test_a_stream_that_stops_early_is_short():
    res = asyncio.run(run_level("http://x", "m", ["a prompt"], 1, 2, 8, transport=_server(5, chat=False)))
    assert res.short == 2 and res.errors == 0 and res.completion_tokens == 10


def test_a_stream_without_usage_is_short_and_counts_its_events():
    res = asyncio.run(run_level("http://x", "m", ["a prompt"], 1, 1, 8, transport=_server(8, chat=False, usage=False)))
    assert res.short == 1 and res.completion_tokens == 8 and res.events == 8


def test_an_unknown_route_is_refused():
    from clutor.errors import ClutorError

    with pytest.raises(ClutorError, match="route"):
        asyncio.run(run_level("http://x", "m", ["p"], 1, 1, 4, route="embeddings"))
