"""Tools, tool calls and tool results through the real chat templates (../shared/data/templates), and the
tool-call grammar of every family: what the server sends each model family, checked template by template."""
from __future__ import annotations

import json

import pytest

from clutor.formats import FAMILIES, HERMES_FALLBACK, family_for
from clutor.model.tokenizer import Tokenizer
from clutor.server.chat_plan import chat_messages, plan_chat
from clutor.server.errors import APIError
from conftest import SHARED_DATA, fixture_path

TEMPLATES = SHARED_DATA / "templates"
pytestmark = pytest.mark.skipif(not TEMPLATES.is_dir(), reason=f"the real chat templates are not at {TEMPLATES}")

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}, "days": {"type": "integer"}},
                                             "required": ["city"]}}}
CONVO = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abc123def", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "abc123def", "content": "SUNNY-21C"},
    {"role": "assistant", "content": "Sunny, 21 C."},
    {"role": "user", "content": "Thanks. And Rome?"},
]
NAMES = sorted(p.name for p in TEMPLATES.glob("*.jinja")) if TEMPLATES.is_dir() else []


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(fixture_path("qwen3moe", "Q8_0"))


@pytest.mark.parametrize("name", NAMES)
def test_tools_and_results_go_through_the_template(tok, name):
    template = (TEMPLATES / name).read_text()
    plan = plan_chat({"tools": [TOOL]}, chat_messages(CONVO), tok, template=template)
    p = plan.prompt
    assert "get_weather" in p and "Weather in a city" in p, "the tool is described"
    assert "SUNNY-21C" in p, "the tool result is in the conversation"
    assert "Paris" in p and "Rome" in p
    fam = family_for(template)
    if fam is not HERMES_FALLBACK and fam.name != "harmony":
        # the earlier call is written back in the family's own markup
        assert any(m in p for m in fam.markers), fam


@pytest.mark.parametrize("name", NAMES)
def test_required_tool_call_grammar_compiles(tok, name):
    pytest.importorskip("llguidance")
    template = (TEMPLATES / name).read_text()
    for body in ({"tools": [TOOL], "tool_choice": "required"},
                 {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                  "parallel_tool_calls": False},
                 {"response_format": {"type": "json_object"}}):
        plan = plan_chat(body, chat_messages(CONVO[:2]), tok, template=template)
        assert plan.grammar is not None


@pytest.mark.parametrize("fam", FAMILIES + (HERMES_FALLBACK,), ids=lambda f: f.name)
def test_rendered_calls_parse_back(fam):
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]
    if fam.name == "harmony":
        calls = calls[:1]  # one call per reply
    text = fam.render_calls(calls)
    tools = {"get_weather": __import__("clutor.formats", fromlist=["Tool"]).Tool(
        "get_weather", TOOL["function"]["parameters"])}
    msg = fam.parser(tools, think=None, starts_in_reasoning=False).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == calls


def test_reasoning_effort_reaches_the_template(tok):
    template = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
    plan = plan_chat({"reasoning_effort": "high"}, chat_messages(CONVO[:2]), tok, template=template)
    assert "Reasoning: high" in plan.prompt
    plan = plan_chat({}, chat_messages(CONVO[:2]), tok, template=template)
    assert "Reasoning: medium" in plan.prompt


def test_thinking_switch_and_open_reasoning(tok):
    template = (TEMPLATES / "Qwen3.5-4B.jinja").read_text()
    on = plan_chat({}, chat_messages(CONVO[:2]), tok, template=template)
    off = plan_chat({"chat_template_kwargs": {"enable_thinking": False}}, chat_messages(CONVO[:2]), tok,
                    template=template)
    assert on.open_reasoning and not off.open_reasoning
    none = plan_chat({"reasoning_format": "none"}, chat_messages(CONVO[:2]), tok, template=template)
    assert none.think is None and none.prefix.startswith("<think>")
    msg = none.parser().parse("hmm</think>\n\nHi")
    assert msg.reasoning == "" and msg.content.startswith("<think>") and msg.content.endswith("Hi")


def test_tool_choice_none_hides_the_tools(tok):
    template = (TEMPLATES / "Qwen3-Coder.jinja").read_text()
    plan = plan_chat({"tools": [TOOL], "tool_choice": "none"}, chat_messages(CONVO[:2]), tok, template=template)
    assert "get_weather" not in plan.prompt and plan.tools is None


def test_bad_tool_arguments_name_the_field(tok):
    bad = [CONVO[1], {"role": "assistant", "tool_calls": [{"id": "x", "type": "function",
                                                          "function": {"name": "f", "arguments": "{nope"}}]}]
    with pytest.raises(APIError) as e:
        chat_messages(bad)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"


MEASURE = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["n", "unit"],
           "additionalProperties": False}
# the same, as Pydantic writes it: each argument's schema in $defs, referred to from the root
MEASURE_REFS = {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}, "unit": {"$ref": "#/$defs/Unit"}},
                "required": ["n", "unit"], "additionalProperties": False,
                "$defs": {"N": {"type": "integer", "minimum": 0, "maximum": 50}, "Unit": {"enum": ["c", "f"]}}}


@pytest.mark.parametrize("params", [MEASURE, MEASURE_REFS], ids=["inline", "refs"])
@pytest.mark.parametrize("fam", FAMILIES + (HERMES_FALLBACK,), ids=lambda f: f.name)
def test_what_the_call_grammar_allows_the_parser_reads(tok, fam, params):
    """Walk each family's tool-call grammar at random (uniform among the allowed tokens): the text is
    always one call its own parser reads, with arguments valid for the tool (its $refs resolved where
    the grammar embeds its schema)."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    from clutor.formats import Tool
    from clutor.grammar import Grammar
    from clutor.grammar.constraint import lark_literal

    tool = Tool("measure", params)
    g = Grammar.lark(tok, "start: calls\n" + fam.call_grammar([tool], False, lambda s: lark_literal(tok, s)))
    rng = np.random.default_rng(0)
    for _ in range(5):
        m, ids = g.matcher(), []
        for _ in range(400):
            logits = m(ids, np.zeros(tok.n_vocab, dtype=np.float32))
            t = int(rng.choice(np.flatnonzero(np.isfinite(logits))))
            if t in tok.stop_ids:
                break
            ids.append(t)
        assert m.error is None and m.done
        msg = fam.parser({"measure": tool}, think=None, starts_in_reasoning=False).parse(tok.decode(ids))
        assert [c.name for c in msg.tool_calls] == ["measure"], tok.decode(ids)
        jsonschema.validate(json.loads(msg.tool_calls[0].arguments), params)
