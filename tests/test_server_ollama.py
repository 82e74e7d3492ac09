"""ollama's API through the ``ollama`` Python client (PyPI ``ollama``), unchanged, against clutor serve:
generate and chat (whole and streamed, with tools and a JSON schema), embed, list, show, ps and version.
The client's own models validate every reply; the texts are checked against the OpenAI routes' on the
same request (greedy), so the mapping of fields is what decides, not the model."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
pytest.importorskip("uvicorn", reason="the server extra is not installed")
ollama = pytest.importorskip("ollama", reason="the ollama client is not installed (pip install ollama)")
import httpx  # noqa: E402

import clutor  # noqa: E402
from clutor.server import create_app  # noqa: E402
from conftest import fixture_path  # noqa: E402
from server_util import LiveServer  # noqa: E402

MODEL = fixture_path("qwen3moe", "Q8_0")
NAME = "tiny"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def srv():
    s = LiveServer(create_app(clutor.Model.open(MODEL, io="memory", n_ctx=512), served_model_name=NAME,
                              max_sequences=2))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return ollama.Client(host=srv.url)


def _openai_chat(srv, **extra) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, "max_tokens": 12,
                                                            "temperature": 0, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_whole_and_streamed_give_the_openai_routes_text(srv, client):
    want = _openai_chat(srv)["choices"][0]["message"]["content"]
    r = client.chat(model=NAME, messages=MESSAGES, options=GREEDY, stream=False)
    assert r.message.role == "assistant" and r.message.content == want
    assert r.done and r.done_reason == "length" and r.eval_count == 12 and r.prompt_eval_count > 0
    assert r.eval_duration > 0 and r.total_duration >= r.eval_duration
    parts = list(client.chat(model=NAME, messages=MESSAGES, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == want
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == 12


def test_chat_with_a_schema_answers_json_that_fits(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    r = client.chat(model=NAME, messages=MESSAGES, format=schema, options={"temperature": 0, "num_predict": 40},
                    stream=False)
    assert json.loads(r.message.content)["colour"] in ("red", "blue")
    parts = list(client.chat(model=NAME, messages=MESSAGES, format="json", options={"temperature": 0,
                                                                                    "num_predict": 40}, stream=True))
    assert isinstance(json.loads("".join(p.message.content for p in parts)), dict)


def test_chat_with_tools_round_trips_a_call(srv, client):
    """A conversation with a call (arguments as an object) and its result (tool_name) in ollama's shapes gives
    the reply the same conversation in OpenAI's shapes gives (sent as JSON here: the client re-serialises the
    tools, and their key order is part of the prompt); the client reads the reply."""
    tools = [{"type": "function", "function": {"name": "get_colour", "description": "The colour of a thing.",
                                               "parameters": {"type": "object", "properties": {
                                                   "thing": {"type": "string"}}, "required": ["thing"]}}}]
    r = client.chat(model=NAME, messages=MESSAGES, tools=tools, options=GREEDY, stream=False)
    assert r.done
    convo = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_colour", "arguments": {"thing": "sky"}}}]},
        {"role": "tool", "tool_name": "get_colour", "content": "blue"}]
    assert client.chat(model=NAME, messages=convo, tools=tools, options=GREEDY, stream=False).done
    r = httpx.post(srv.url + "/api/chat", json={"model": NAME, "messages": convo, "tools": tools, "options": GREEDY,
                                                "stream": False}, timeout=60).json()
    oai = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_colour", "arguments": '{"thing": "sky"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "blue"}]
    want = httpx.post(srv.url + "/v1/chat/completions", json={"model": NAME, "messages": oai, "tools": tools,
                                                               "max_tokens": 12, "temperature": 0}).json()
    assert r["message"]["content"] == want["choices"][0]["message"]["content"]


def test_generate_whole_streamed_raw_and_its_context(srv, client):
    want = httpx.post(srv.url + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12,
        "temperature": 0}).json()["choices"][0]["message"]["content"]
    r = client.generate(model=NAME, prompt="Name a colour.", options=GREEDY, stream=False)
    assert r.response == want and r.done and r.context and len(r.context) == r.prompt_eval_count + 12
    parts = list(client.generate(model=NAME, prompt="Name a colour.", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == want
    assert list(parts[-1].context) == list(r.context)  # every token, also those whose text came later
    raw = client.generate(model=NAME, prompt="The quick brown fox", raw=True, options=GREEDY, stream=False)
    oai = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "The quick brown fox",
                                                         "max_tokens": 12, "temperature": 0}).json()
    assert raw.response == oai["choices"][0]["text"]
    more = client.generate(model=NAME, prompt="And another?", context=r.context, options=GREEDY, stream=False)
    assert more.prompt_eval_count > len(r.context)
    assert client.generate(model=NAME, prompt="").done_reason == "load"


def test_embed_list_show_ps_version(client, srv):
    e = client.embed(model=NAME, input=["a red thing", "a blue thing"])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) == srv.state.model.config.n_embd
    v = httpx.post(srv.url + "/v1/embeddings", json={"model": NAME, "input": "a red thing"}).json()
    assert e.embeddings[0] == pytest.approx(v["data"][0]["embedding"], abs=1e-6)
    assert len(client.embeddings(model=NAME, prompt="a red thing").embedding) == len(e.embeddings[0])
    models = client.list().models
    assert [m.model for m in models] == [NAME] and models[0].details.format == "gguf"
    assert models[0].details.quantization_level == "Q8_0" and models[0].size > 0
    s = client.show(NAME)
    assert s.template == srv.state.model.tokenizer.chat_template and s.modelinfo["general.architecture"] == "qwen3moe"
    assert "completion" in s.capabilities
    ps = client.ps().models
    assert ps[0].model == NAME and ps[0].context_length == 512
    assert httpx.get(srv.url + "/api/version").json()["version"] == clutor.__version__


@pytest.mark.parametrize("route,body,said", [
    ("/api/chat", {"model": NAME, "messages": MESSAGES, "options": {"num_predict": 0}}, "options.num_predict"),
    ("/api/chat", {"model": NAME, "messages": MESSAGES, "options": {"temperature": "hot"}}, "options.temperature"),
    ("/api/chat", {"model": NAME, "messages": MESSAGES, "format": "yaml"}, "format"),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
    ("/api/generate", {"model": NAME, "prompt": "hi", "suffix": "x"}, "suffix"),
    ("/api/show", {"model": "other"}, "not found"),
])
def test_bad_requests_are_ollama_errors_naming_the_field(srv, route, body, said):
    r = httpx.post(srv.url + route, json=body)
    assert r.status_code in (400, 404), r.text
    assert set(r.json()) == {"error"} and said in r.json()["error"]


def test_a_bad_request_raises_the_clients_own_error(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=NAME, messages=MESSAGES, options={"num_predict": 0}, stream=False)
    assert e.value.status_code == 400 and "num_predict" in e.value.error
