"""What agents and apps send, against a real `clutor serve` on 127.0.0.1, with the official clients.

The model is the demo model's structure (``clutor demo``: random weights, a Tulu-style template that
knows no tools, so tools go in the system prompt and calls come back Hermes-style) at test size.
Random weights write no JSON and call no tool on their own: every structured reply here exists
because the grammar allowed nothing else, and is checked by the jsonschema package's validator.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
pytest.importorskip("llguidance", reason="llguidance (constrained decoding, in the server extra) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
jsonschema = pytest.importorskip("jsonschema", reason="the jsonschema validator is in the test extra")

import clutor  # noqa: E402
from clutor.cli.demo_model import ensure_demo_model  # noqa: E402
from clutor.server import create_app  # noqa: E402
from conftest import tiny_demo_spec  # noqa: E402
from server_util import LiveServer  # noqa: E402
from test_grammar import SCHEMAS  # noqa: E402

NAME = "demo"
OPEN = dict(io="threads", expert_cache="50%", n_ctx=2048)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                   "required": ["zone"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -100, "maximum": 100},
        "b": {"type": "integer", "minimum": -100, "maximum": 100}}, "required": ["a", "b"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME, ADD]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory):
    # the tools' description alone is ~800 tokens of this 512-token vocabulary: a 2048-token context
    spec = dataclasses.replace(tiny_demo_spec("demo-agents"), n_ctx=2048)
    return ensure_demo_model(tmp_path_factory.mktemp("demo"), spec=spec)


@pytest.fixture(scope="module")
def srv(demo_path):
    s = LiveServer(create_app(clutor.Model.open(demo_path, **OPEN), served_model_name=NAME, max_sequences=4))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


# -- structured output ----------------------------------------------------------------------------
@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_json_schema_validates_greedy_and_sampled(client, k):
    schema = SCHEMAS[k]
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schema, "strict": True}}
    for kw in (dict(temperature=0), dict(temperature=1.2, seed=k, top_p=1.0)):
        r = client.chat.completions.create(model=NAME, messages=ASK, response_format=fmt, max_tokens=400, **kw)
        ch = r.choices[0]
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), schema)
        assert r.timings["grammar"]["masks"] == r.usage.completion_tokens  # llama-server's timings, with ours


def test_json_object(client):
    """Any JSON object. Its keys, strings and numbers have no bound, and random weights may write one
    for ever (the schemas above bound theirs): a reply that ends is an object; one cut off by
    max_tokens is the start of one."""
    finished = 0
    for seed in range(4):
        r = client.chat.completions.create(model=NAME, messages=ASK, response_format={"type": "json_object"},
                                           max_tokens=200, temperature=1.0, seed=seed)
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
        else:
            assert text.startswith("{") and r.usage.completion_tokens == 200
    assert finished


def test_gbnf_grammar_field(client):
    """llama-server's `grammar` (GBNF), sent as an extra field."""
    r = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=40, temperature=0.8, seed=1,
                                       extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
    assert r.choices[0].message.content in ("yes.", "no.")


def test_streamed_json_is_the_same_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[3]}}
    whole = client.chat.completions.create(model=NAME, messages=ASK, response_format=fmt, max_tokens=300,
                                           temperature=0).choices[0].message.content
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=NAME, messages=ASK, response_format=fmt, max_tokens=300, temperature=0, stream=True) if ch.choices]
    assert "".join(parts) == whole


# -- tool calls -----------------------------------------------------------------------------------
def _check_call(call):
    assert call.type == "function" and (call.id.startswith("call_") or len(call.id) == 9)  # 9: Mistral's
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tool_choice_required_returns_a_valid_call(client, seed):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=seed)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
    _check_call(ch.message.tool_calls[0])


def test_parallel_calls_each_validate(client):
    """With parallel calls a random model may go on calling until max_tokens: every finished call
    validates; only a call cut off by the limit may not, and then finish_reason says "length"."""
    for seed in range(3):
        ch = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=300, temperature=1.0, seed=seed).choices[0]
        calls = ch.message.tool_calls
        assert calls and ch.finish_reason in ("tool_calls", "length")
        for call in calls if ch.finish_reason == "tool_calls" else calls[:-1]:
            _check_call(call)


def test_named_tool_choice_and_no_parallel_calls(client):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=300, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "add"}},
                                       parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"]
    _check_call(calls[0])


@pytest.mark.parametrize("parallel", [False, True])
def test_streamed_tool_call_deltas_reassemble_into_the_same_call(client, parallel):
    kw = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0,
              parallel_tool_calls=parallel)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for ch in client.chat.completions.create(**kw, stream=True):
        if not ch.choices:
            continue
        finish = ch.choices[0].finish_reason or finish
        for tc in ch.choices[0].delta.tool_calls or ():
            if tc.id is not None:  # the first delta of a call: id, type and name
                assert tc.index not in calls and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    got = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert got == [(c.function.name, c.function.arguments) for c in whole]
    assert finish == "tool_calls" or parallel and finish == "length"  # greedy may call on until the limit
    for name, args in got if finish == "tool_calls" else got[:-1]:
        jsonschema.validate(json.loads(args), SCHEMA_OF[name])
    assert len(got) == 1 or parallel


def test_tool_round_trip(client):
    """The call and its result go back through the template; the reply is text again."""
    first = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=300, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    msgs = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > first.usage.prompt_tokens


def test_tool_choice_none_is_plain_text(client):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}),
     "response_format"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(extra_body={"grammar": "root ::= nothing_defined"}), "grammar"),
    (dict(extra_body={"reasoning_format": "sideways"}), "reasoning_format"),
])
def test_bad_agent_fields_are_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=ASK, max_tokens=4, **kw)
    assert e.value.body["param"] == param


def test_models_list_context_length(client):
    m = client.models.list().data[0]
    assert m.id == NAME and m.meta["n_ctx"] == 2048


# -- Anthropic's Messages API, with the anthropic client ---------------------------------------------
anthropic = pytest.importorskip("anthropic", reason="the anthropic client is in the test extra")

A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def aclient(srv):
    with anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


GREEDY = {"extra_body": {"temperature": 0}}  # the anthropic client has no temperature argument any more


def test_messages_text(aclient):
    r = aclient.messages.create(model=NAME, max_tokens=12, system="Be brief.", **GREEDY,
                                messages=[{"role": "user", "content": "Hello"}])
    assert r.type == "message" and r.role == "assistant" and r.model == NAME
    assert r.stop_reason in ("end_turn", "max_tokens") and r.content[0].type == "text"
    assert r.usage.output_tokens >= 1 and r.usage.input_tokens > 3


def test_messages_stream_is_the_same_text(aclient):
    kw = dict(model=NAME, max_tokens=12, **GREEDY, messages=[{"role": "user", "content": "Hello"}])
    whole = aclient.messages.create(**kw)
    with aclient.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason


def test_messages_tool_round_trip(aclient):
    kw = dict(model=NAME, max_tokens=300, tools=A_TOOLS, **GREEDY,
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = aclient.messages.create(messages=msgs, **kw)
    assert r.stop_reason == "tool_use"
    use = [b for b in r.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].id.startswith("toolu_")
    jsonschema.validate(use[0].input, SCHEMA_OF[use[0].name])
    with aclient.messages.stream(messages=msgs, **kw) as stream:  # the same call, streamed
        final = stream.get_final_message()
    s_use = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in s_use] == [(use[0].name, use[0].input)]
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "21 C"}]}]
    r2 = aclient.messages.create(model=NAME, max_tokens=8, tools=A_TOOLS, messages=msgs, **GREEDY)
    assert r2.stop_reason in ("end_turn", "max_tokens") and r2.usage.input_tokens > r.usage.input_tokens


def test_messages_errors_are_anthropic_shaped(aclient):
    with pytest.raises(anthropic.BadRequestError) as e:
        aclient.messages.create(model=NAME, max_tokens=8, messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    # any model name is answered by the one model served (as llama-server does), which the reply names
    r = aclient.messages.create(model="claude-other", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert r.model == NAME


# -- OpenAI's Responses API ----------------------------------------------------------------------------
R_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_text(client):
    r = client.responses.create(model=NAME, input="Hello", instructions="Be brief.", max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens >= 1


def test_responses_stream_is_the_same_text(client):
    kw = dict(model=NAME, input="Hello", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    kinds, text, final = [], [], None
    for ev in client.responses.create(**kw, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "".join(text) == whole.output_text == final.output_text


def test_responses_tool_round_trip(client):
    kw = dict(model=NAME, tools=R_TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=300,
              temperature=0)
    r = client.responses.create(input="What is the weather in Paris?", **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA_OF[calls[0].name])
    args = []
    for ev in client.responses.create(input="What is the weather in Paris?", stream=True, **kw):
        if ev.type == "response.function_call_arguments.delta":
            args.append(ev.delta)
        if ev.type == "response.function_call_arguments.done":
            assert ev.arguments == "".join(args)
    assert "".join(args) == calls[0].arguments
    follow = [{"role": "user", "content": "What is the weather in Paris?"},
              {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
               "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"}]
    r2 = client.responses.create(model=NAME, input=follow, tools=R_TOOLS, max_output_tokens=8, temperature=0)
    assert r2.output[0].type == "message" and r2.usage.input_tokens > r.usage.input_tokens


def test_responses_json_schema(client):
    schema = SCHEMAS[0]
    r = client.responses.create(model=NAME, input="A person", max_output_tokens=300, temperature=0,
                                text={"format": {"type": "json_schema", "name": "p", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_responses_refuses_stored_state(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAME, input="x", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"


# -- embeddings -------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(clutor.Model, "embed"),
                    reason="this build's engine has no Model.embed (the engine's pooled hidden states, issue 22)")
def test_embeddings(client, srv):
    import numpy as np

    r = client.embeddings.create(model=NAME, input=["the expert cache", "streams experts", "the expert cache"])
    vecs = [np.array(d.embedding) for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens > 3
    assert all(abs(np.linalg.norm(v) - 1) < 1e-4 for v in vecs)
    assert np.allclose(vecs[0], vecs[2], atol=1e-5) and not np.allclose(vecs[0], vecs[1], atol=1e-3)
    b = client.embeddings.create(model=NAME, input="the expert cache", encoding_format="base64")
    import base64  # asked for explicitly, the client hands the base64 string on as it came

    assert np.allclose(np.frombuffer(base64.b64decode(b.data[0].embedding), np.float32), vecs[0], atol=1e-5)
    direct = srv.call(lambda: srv.state.model.embed(srv.state.model.tokenizer.encode("the expert cache")))
    assert np.allclose(direct, vecs[0], atol=1e-4)  # the route pools what the model pools


def test_embeddings_bad_input_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=NAME, input=[[]])
    assert e.value.body["param"] == "input[0]"


# -- each family end to end: the demo model under real templates (--chat-template) -------------------
from conftest import SHARED_DATA  # noqa: E402

FAMILY_TEMPLATES = ["Qwen3-Coder.jinja", "Qwen3.5-4B.jinja", "GLM-4.6.jinja", "deepseek-ai-DeepSeek-V3.1.jinja",
                    "mistralai-Mistral-Nemo-Instruct-2407.jinja", "openai-gpt-oss-120b.jinja",
                    "Qwen-Qwen3-0.6B.jinja"]


# the 2026 families' templates, committed with the tests (tests/fixtures/templates)
FIXTURE_TEMPLATES = ["google-gemma-4-31B-it.jinja", "MiniMax-M2.jinja", "meta-llama-Llama-4-Scout-17B-16E-Instruct.jinja"]
_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "templates"


@pytest.mark.parametrize("name", FAMILY_TEMPLATES + FIXTURE_TEMPLATES)
def test_required_call_under_each_familys_template(demo_path, name):
    """The demo model served with a family's real template: the call is written in that family's markup
    (constrained), parsed back, streamed as the same deltas, and its result goes back through the template."""
    from clutor.server import Defaults

    path = _FIXTURES / name if name in FIXTURE_TEMPLATES else SHARED_DATA / "templates" / name
    if not path.is_file():
        pytest.skip(f"the real chat templates are not at {SHARED_DATA / 'templates'}")
    template = path.read_text()
    s = LiveServer(create_app(clutor.Model.open(demo_path, **OPEN), served_model_name=NAME, max_sequences=2,
                              defaults=Defaults(chat_template=template)))
    try:
        with openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            kw = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                      max_tokens=300, temperature=0.7, seed=3, extra_body={"chat_template_kwargs":
                                                                           {"enable_thinking": False}})
            if name == "MiniMax-M2.jinja":
                # its template always opens <think> (no switch), and random weights reason until max_tokens:
                # with the reasoning not split the call comes right away
                kw["extra_body"]["reasoning_format"] = "none"
            ch = c.chat.completions.create(**kw).choices[0]
            assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
            call = ch.message.tool_calls[0]
            _check_call(call)
            args = "".join(tc.function.arguments or "" for ev in c.chat.completions.create(**kw, stream=True)
                           if ev.choices for tc in ev.choices[0].delta.tool_calls or ())
            assert args == call.function.arguments
            msgs = ASK + [ch.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "21 C"},
                          ]
            r = c.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS, max_tokens=4, temperature=0)
            assert r.usage.prompt_tokens > 0
    finally:
        s.stop()
