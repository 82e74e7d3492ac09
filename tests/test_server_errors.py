"""Refusals and failures: a 400 (never a 500) for every malformed field, and every error in the shape of
the API its path belongs to (Anthropic's under /v1/messages, OpenAI's elsewhere, the Responses
API's stream event mid-stream), from whichever layer answers."""
from __future__ import annotations

import json
import logging

import httpx
import pytest

import clutor
from clutor.server import Limits, create_app
from conftest import fixture_path
from server_util import LiveServer

MODEL = fixture_path("qwen3moe", "Q8_0")
OPEN = dict(io="threads", expert_cache="50%", n_ctx=512)
HUGE = int("9" * 400)  # a valid JSON number; too large for a float


@pytest.fixture(scope="module")
def srv():
    s = LiveServer(create_app(clutor.Model.open(MODEL, **OPEN), served_model_name="tiny",
                              limits=Limits(max_body=1 << 20)))
    yield s
    s.stop()


def _post(srv, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(srv.url + path, content=content, headers={"content-type": "application/json",
                                                                **kw.pop("headers", {})}, timeout=60, **kw)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 2},
          "/v1/messages": CHAT, "/v1/responses": {"model": "tiny", "input": "Hi", "max_output_tokens": 2}}
SAMPLING = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty"]


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def _anthropic_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    b = r.json()
    assert b["type"] == "error" and set(b["error"]) == {"type", "message"}, b
    return b["error"]


def _error(r: httpx.Response, path: str, status: int) -> str:
    """The error's message, having checked its shape is the one ``path``'s API uses."""
    if path.startswith("/v1/messages"):
        return _anthropic_error(r, status)["message"]
    return _openai_error(r, status)["message"]


# -- 400s that were 500s ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", list(BODIES))
def test_a_huge_integer_in_a_sampling_field_is_a_400_on_every_endpoint(srv, path, caplog):
    fields = SAMPLING if path in ("/v1/chat/completions", "/v1/completions") else ["temperature", "top_p"]
    with caplog.at_level(logging.INFO, logger="clutor.server"):
        for name in fields:
            msg = _error(_post(srv, path, {**BODIES[path], name: HUGE}), path, 400)
            assert name in msg and "999999999999..." in msg, msg
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a refusal logged an error"


def test_tool_call_arguments_nested_too_deep_or_with_nan_are_a_400(srv):
    def call(arguments: str) -> dict:
        return {**CHAT, "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}

    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    err = _openai_error(_post(srv, "/v1/chat/completions", call(deep)), 400)
    assert err["param"] == "messages[1].tool_calls[0].function.arguments" and "nested too deeply" in err["message"]
    for constant in ("NaN", "Infinity", "-Infinity"):
        err = _openai_error(_post(srv, "/v1/chat/completions", call('{"x": %s}' % constant)), 400)
        assert err["param"] == "messages[1].tool_calls[0].function.arguments" and constant.lstrip("-") in err["message"]


def test_x_guidance_of_the_wrong_type_and_its_whitespace_pattern_are_a_400(srv):
    for xg, said in ((5, "must be an object"), ({"whitespace_pattern": " *"}, "cannot be set")):
        body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "x-guidance": xg}}}}
        err = _openai_error(_post(srv, "/v1/chat/completions", body), 400)
        assert err["param"] == "response_format" and said in err["message"], err


def test_n_must_be_the_integer_one(srv):
    for n in (True, 2, "1"):
        err = _openai_error(_post(srv, "/v1/chat/completions", {**CHAT, "n": n}), 400)
        assert err["param"] == "n", err
    assert _post(srv, "/v1/chat/completions", {**CHAT, "n": 1}).status_code == 200


# -- every layer answers in its path's API's shape ------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/responses"])
def test_each_layers_errors_come_in_the_paths_shape(srv, path):
    _error(_post(srv, path, b"{not json"), path, 400)                            # the route
    _error(_post(srv, path, b"x" * (2 << 20)), path, 413)                        # the body limit
    _error(httpx.get(srv.url + path, timeout=10), path, 405)                     # Starlette's router
    _error(_post(srv, path + "/nothing", BODIES[path]), path, 404)
    _error(_post(srv, path, BODIES[path], headers={"host": "evil.example"}), path, 403)  # the front door
    _error(_post(srv, path, BODIES[path], headers={"origin": "http://evil.example"}), path, 403)


def test_an_api_keys_401_comes_in_the_paths_shape():
    s = LiveServer(create_app(clutor.Model.open(MODEL, **OPEN), served_model_name="tiny", api_key="sesame"))
    try:
        assert _anthropic_error(_post(s, "/v1/messages", CHAT), 401)["type"] == "authentication_error"
        assert _openai_error(_post(s, "/v1/chat/completions", CHAT), 401)["code"] == "invalid_api_key"
        assert _post(s, "/v1/messages", CHAT, headers={"x-api-key": "sesame"}).status_code == 200
    finally:
        s.stop()


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses", "/v1/chat/completions"])
def test_an_internal_error_comes_in_the_paths_shape(srv, path, stream, caplog):
    model = srv.state.model
    real = type(model).generate

    def failing(self, *a, **k):
        async def gen():
            async for c in real(self, *a, **k):
                yield c
                raise _Boom("the engine broke")
        return gen()

    model.generate = failing.__get__(model)
    try:
        with caplog.at_level(logging.ERROR, logger="clutor.server"):
            r = _post(srv, path, {**BODIES[path], "stream": stream, **({"max_tokens": 8} if "max_tokens" in
                                                                        BODIES[path] else {"max_output_tokens": 8})})
    finally:
        del model.generate
    if not stream:
        assert "_Boom" in _error(r, path, 500)
        return
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e.strip()]
    last = events[-1]
    data = json.loads(last.split("data: ", 1)[1])
    if path == "/v1/messages":
        assert last.startswith("event: error") and data["type"] == "error" and data["error"]["type"] == "api_error"
    elif path == "/v1/responses":
        assert last.startswith("event: error") and data["type"] == "error" and "_Boom" in data["message"]
    else:
        assert "_Boom" in data["error"]["message"]
    assert any("_Boom" in r.getMessage() for r in caplog.records)  # logged once, with its traceback
