"""Each family's reply parser on recorded output strings of that family.

The strings are the formats as their documentation and llama.cpp's parser tests
(tests/test-chat.cpp) write them; the expected messages are llama.cpp's. Every case is parsed whole,
then streamed cut at every position (two pieces) and one character at a time: the deltas must add up
to the same message, calls announced once with their name, arguments only ever appended.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from clutor.formats import (DEEPSEEK, FAMILIES, GEMMA4, GLM, HARMONY, HERMES, HERMES_FALLBACK, LLAMA4, MINIMAX_M2,
                            MISTRAL, MISTRAL_ARGS, QWEN_XML, THINK, Tool, family_for, starts_in_reasoning)
from clutor.formats.base import Message
from conftest import SHARED_DATA

TEMPLATES = SHARED_DATA / "templates"

SPECIAL = Tool("special_function", {"type": "object", "properties": {"arg1": {"type": "integer"}},
                                    "required": ["arg1"]})
SPECIAL_OPT = Tool("special_function_with_opt", {"type": "object", "properties": {
    "arg1": {"type": "integer"}, "arg2": {"type": "integer"}}, "required": ["arg1"]})
PYTHON = Tool("python", {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]})
EDIT = Tool("edit", {"type": "object", "properties": {
    "filename": {"type": "string"}, "oldString": {"type": "string"}, "newString": {"type": "string"},
    "replaceAll": {"type": "boolean"}}, "required": ["filename", "oldString", "newString"]})
GET_TIME = Tool("get_time", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
GET_WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]})
EMPTY_ARGS = Tool("empty_args", {"type": "object", "properties": {}})
AMOUNT = Tool("amount", {"type": "object", "properties": {"orig": {"type": "number"}}, "required": ["orig"]})
TOGGLE = Tool("toggle", {"type": "object", "properties": {"enabled": {"type": "boolean"}}, "required": ["enabled"]})
NULLABLE = Tool("set_nullable", {"type": "object", "properties": {"value": {"type": "null"}}, "required": ["value"]})
TODO = Tool("todo_list", {"type": "object", "properties": {"todos": {"type": "array"}}, "required": ["todos"]})
CONFIG = Tool("set_config", {"type": "object", "properties": {"config": {"type": "object"}}, "required": ["config"]})
TOOLS = {t.name: t for t in (SPECIAL, SPECIAL_OPT, PYTHON, EDIT, GET_TIME, GET_WEATHER, EMPTY_ARGS, AMOUNT, TOGGLE,
                             NULLABLE, TODO, CONFIG)}
G4 = GEMMA4.think  # Gemma 4's thought channel

HELLO = "Hello, world!\nWhat's up?"
CALL1 = [("special_function", {"arg1": 1})]

# (family, text, think tags, prompt left reasoning open, content, reasoning, calls [(name, arguments)])
CASES = [
    # -- Hermes (Qwen2.5 / Qwen3 / Hermes 2 Pro) --
    (HERMES, '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>', None, False,
     "", "", CALL1),
    (HERMES, HELLO + '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>', None, False,
     HELLO, "", CALL1),
    (HERMES, '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>', None, False,
     "", "", CALL1),
    (HERMES, "<think>\nI'm\nthinking\n</think>\n\n" + HELLO, THINK, False, HELLO, "I'm\nthinking", []),
    (HERMES, "<think>\nI'm\nthinking\n</think>\n\n<tool_call>\n"
             '{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
             '{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>', THINK, False,
     "", "I'm\nthinking", [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]),
    (HERMES, '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>', None,
     False, "", "", [("python", {"code": "print(1)"})]),
    (HERMES, '<tool_call>\n{"name": "python", "parameters": {"code": "a = \\"}\\""}}\n</tool_call>', None, False,
     "", "", [("python", {"code": 'a = "}"'})]),
    # QwQ / Qwen3 with the prompt's <think> left open
    (HERMES, "Let me think about this...\n</think>\nThe answer is 42.", THINK, True, "The answer is 42.",
     "Let me think about this...", []),
    (HERMES, "</think>Hello, world!", THINK, True, "Hello, world!", "", []),
    # -- Qwen3-Coder / Qwen3.5 XML function form --
    (QWEN_XML, "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
               "</tool_call>", None, False, "", "", CALL1),
    (QWEN_XML, "I'm\nthinking\n</think>\n\n<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n"
               "</parameter>\n</function>\n</tool_call>", THINK, True, "", "I'm\nthinking", CALL1),
    (QWEN_XML, "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
               "</tool_call>\n<tool_call>\n<function=special_function_with_opt>\n<parameter=arg1>\n1\n"
               "</parameter>\n<parameter=arg2>\n2\n</parameter>\n</function>\n</tool_call>", None, False, "", "",
     [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    (QWEN_XML, "<tool_call>\n<function=python>\n<parameter=code>\ndef hello():\n    print(\"Hello, world!\")\n\n"
               "hello()\n</parameter>\n</function>\n</tool_call>", None, False, "", "",
     [("python", {"code": "def hello():\n    print(\"Hello, world!\")\n\nhello()"})]),
    (QWEN_XML, "<tool_call>\n<function=edit>\n<parameter=filename>\nfoo.c\n</parameter>\n<parameter=oldString>\n"
               "#iclunde\n</parameter>\n<parameter=newString>\n#include\n\n</parameter>\n</function>\n</tool_call>",
     None, False, "", "", [("edit", {"filename": "foo.c", "oldString": "#iclunde", "newString": "#include\n"})]),
    (QWEN_XML, "<tool_call>\n<function=python>\n<parameter=code>\n    print(\"Hello, world!\")\n</parameter>\n"
               "</function>\n</tool_call>", None, False, "", "", [("python", {"code": "    print(\"Hello, world!\")"})]),
    # a model that leaves out the opening <tool_call>, after some text
    (QWEN_XML, "Let me call it.\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
               "</tool_call>", None, False, "Let me call it.\n", "", CALL1),
    (QWEN_XML, HELLO, None, False, HELLO, "", []),
    # -- gpt-oss harmony --
    (HARMONY, "<|channel|>final<|message|>" + HELLO, THINK, False, HELLO, "", []),
    (HARMONY, "<|channel|>commentary<|message|>" + HELLO, THINK, False, HELLO, "", []),
    (HARMONY, "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>"
              + HELLO, THINK, False, HELLO, "I'm\nthinking", []),
    (HARMONY, "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>"
              + HELLO, None, False, "<|channel|>analysis<|message|>I'm\nthinking<|end|>" + HELLO, "", []),
    (HARMONY, "<|channel|>analysis<|message|>I'm\nthinking", THINK, False, "", "I'm\nthinking", []),
    (HARMONY, ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', THINK, False, "", "", CALL1),
    (HARMONY, '<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', THINK, False, "", "", CALL1),
    (HARMONY, ' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}', THINK,
     False, "", "", CALL1),
    (HARMONY, '<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', THINK, False, "", "",
     CALL1),
    (HARMONY, "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant to=functions.special_function"
              '<|channel|>analysis<|message|>{"arg1": 1}', THINK, False, "", "I'm\nthinking", CALL1),
    (HARMONY, "<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.edit <|constrain|>json<|message|>{"oldString": "if (part < railCount - 1) {", '
              '"newString": "if (part < 4) {", "replaceAll": false}', THINK, False, "", "Thinking about edit...",
     [("edit", {"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": False})]),
    (HARMONY, "<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant "
              "to=container.exec<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'", THINK, False, "",
     "I will execute python to say hello", []),
    (HARMONY, "<|channel|>commentary to=assistant<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant"
              "<|channel|>final<|message|>" + HELLO, THINK, False, HELLO, "I'm\nthinking", []),
    # -- GLM-4.5 / 4.6 --
    (GLM, "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", THINK,
     False, "", "", CALL1),
    (GLM, "<think>Checking</think>\nSure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
          "</arg_value>\n</tool_call>", THINK, False, "Sure.", "Checking", [("get_weather", {"city": "Paris"})]),
    (GLM, "<tool_call>special_function_with_opt<arg_key>arg1</arg_key><arg_value>1</arg_value><arg_key>arg2"
          "</arg_key><arg_value>2</arg_value></tool_call>", THINK, False, "", "",
     [("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    # -- DeepSeek-V3.1 --
    (DEEPSEEK, '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "XYZCITY"}'
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", THINK, False, "", "", [("get_time", {"city": "XYZCITY"})]),
    (DEEPSEEK, 'REASONING</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "Tokyo"}'
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", THINK, True, "", "REASONING", [("get_time", {"city": "Tokyo"})]),
    (DEEPSEEK, 'REASONING</think>CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>'
               '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", THINK, True, "CONTENT", "REASONING",
     [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]),
    (DEEPSEEK, "REASONING</think>\nCONTENT", THINK, True, "CONTENT", "REASONING", []),
    (DEEPSEEK, "CONTENT", THINK, False, "CONTENT", "", []),
    (DEEPSEEK, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
               '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', THINK, False, "", "",
     [("get_time", {"city": "Oslo"})]),
    # -- Mistral --
    (MISTRAL, '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]', None,
     False, "", "", CALL1),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {"city": "Paris"}}, {"name": "get_weather", '
              '"arguments": {"city": "Rome"}}]', None, False, "", "",
     [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    (MISTRAL, HELLO, None, False, HELLO, "", []),
    (MISTRAL_ARGS, '[TOOL_CALLS]special_function[ARGS]{"arg1":1}', None, False, "", "", CALL1),
    (MISTRAL_ARGS, '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}[TOOL_CALLS]special_function_with_opt[ARGS]'
                   '{"arg1": 1, "arg2": 2}', None, False, "", "",
     [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    (MISTRAL_ARGS, 'Calling it.[TOOL_CALLS]get_time[ARGS]{"city": "a [TOOL_CALLS] b"}', None, False, "Calling it.",
     "", [("get_time", {"city": "a [TOOL_CALLS] b"})]),
    # -- Gemma 4 (llama.cpp's tests/test-chat.cpp, google-gemma-4-31B-it.jinja) --
    (GEMMA4, "Hello, world!", G4, False, "Hello, world!", "", []),
    (GEMMA4, "<|channel>thought\nI'm\nthinking<channel|>" + HELLO, G4, False, HELLO, "I'm\nthinking", []),
    (GEMMA4, "<|channel>thought<channel|>" + HELLO, G4, False, HELLO, "", []),
    (GEMMA4, "<|channel>thought\nI'm\nthinking<channel|>" + HELLO, None, False,
     "<|channel>thought\nI'm\nthinking<channel|>" + HELLO, "", []),
    (GEMMA4, '<|tool_call>call:get_time{city:<|"|>London<|"|>}<tool_call|>', G4, False, "", "",
     [("get_time", {"city": "London"})]),
    (GEMMA4, '<|tool_call>call:get_time{city:<|"|>San Francisco<|"|>}<tool_call|>', G4, False, "", "",
     [("get_time", {"city": "San Francisco"})]),
    (GEMMA4, "<|tool_call>call:empty_args{}<tool_call|>", G4, False, "", "", [("empty_args", {})]),
    (GEMMA4, HELLO + '<|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|>', G4, False, HELLO, "",
     [("get_time", {"city": "Paris"})]),
    (GEMMA4, "<|channel>thought\nI'm\nthinking<channel|><|tool_call>call:get_time{city:<|\"|>Paris<|\"|>}<tool_call|>",
     G4, False, "", "I'm\nthinking", [("get_time", {"city": "Paris"})]),
    (GEMMA4, '<|tool_call>call:get_time{city:<|"|>London<|"|>}<tool_call|><|tool_call>call:get_weather{city:<|"|>Paris'
             '<|"|>}<tool_call|>', G4, False, "", "", [("get_time", {"city": "London"}), ("get_weather", {"city": "Paris"})]),
    (GEMMA4, "<|tool_call>call:special_function{arg1:42}<tool_call|>", G4, False, "", "", [("special_function", {"arg1": 42})]),
    (GEMMA4, "<|tool_call>call:special_function{arg1:-7}<tool_call|>", G4, False, "", "", [("special_function", {"arg1": -7})]),
    (GEMMA4, "<|tool_call>call:amount{orig:3.14}<tool_call|>", G4, False, "", "", [("amount", {"orig": 3.14})]),
    (GEMMA4, "<|tool_call>call:toggle{enabled:true}<tool_call|>", G4, False, "", "", [("toggle", {"enabled": True})]),
    (GEMMA4, "<|tool_call>call:toggle{enabled:false}<tool_call|>", G4, False, "", "", [("toggle", {"enabled": False})]),
    (GEMMA4, "<|tool_call>call:set_nullable{value:null}<tool_call|>", G4, False, "", "", [("set_nullable", {"value": None})]),
    (GEMMA4, '<|tool_call>call:todo_list{todos:[<|"|>buy milk<|"|>,<|"|>walk dog<|"|>]}<tool_call|>', G4, False, "", "",
     [("todo_list", {"todos": ["buy milk", "walk dog"]})]),
    (GEMMA4, '<|tool_call>call:set_config{config:{theme:<|"|>dark<|"|>,count:3}}<tool_call|>', G4, False, "", "",
     [("set_config", {"config": {"theme": "dark", "count": 3}})]),
    (GEMMA4, "<|tool_call>call:todo_list{todos:[]}<tool_call|>", G4, False, "", "", [("todo_list", {"todos": []})]),
    (GEMMA4, "<|tool_call>call:set_config{config:{}}<tool_call|>", G4, False, "", "", [("set_config", {"config": {}})]),
    (GEMMA4, "<|tool_call>call:amount{orig:1.5e10}<tool_call|>", G4, False, "", "", [("amount", {"orig": 1.5e10})]),
    (GEMMA4, "<|channel>thought\n<channel|>" + HELLO + "<channel|>", G4, False, HELLO, "", []),
    (GEMMA4, "<|channel>thought\n<channel|>" + HELLO + "<|channel>thought\n<channel|>", G4, False, HELLO, "", []),
    (GEMMA4, "<|channel>thought\n<channel|>" + HELLO + "<|channel>thought\n<channel|><channel|>", G4, False, HELLO, "",
     []),
    (GEMMA4, "<|channel><|channel>thought\n<channel|>" + HELLO, G4, False, HELLO, "", []),
    # -- MiniMax-M2 (llama.cpp's tests/test-chat.cpp; the template leaves '<think>' open) --
    (MINIMAX_M2, "\n</think>\n\n" + HELLO, THINK, True, HELLO, "", []),
    (MINIMAX_M2, "I'm\nthinking\n</think>\n\n" + HELLO, THINK, True, HELLO, "I'm\nthinking", []),
    (MINIMAX_M2, 'Let\'s call a tool:\n</think>\n\n<minimax:tool_call>\n<invoke name="empty_args">\n</invoke>\n'
                 "</minimax:tool_call>", THINK, True, "", "Let's call a tool:", [("empty_args", {})]),
    (MINIMAX_M2, '\n</think>\n\n<minimax:tool_call>\n<invoke name="special_function">\n<parameter name="arg1">1'
                 "</parameter>\n</invoke>\n</minimax:tool_call>", THINK, True, "", "", CALL1),
    # two invokes in one block, as the template writes parallel calls; a string value kept as written
    (MINIMAX_M2, 'Both.\n</think>\n\n<minimax:tool_call>\n<invoke name="get_time">\n<parameter name="city">'
                 'New York, NY</parameter>\n</invoke>\n<invoke name="special_function_with_opt">\n<parameter '
                 'name="arg1">1</parameter>\n<parameter name="arg2">2</parameter>\n</invoke>\n</minimax:tool_call>',
     THINK, True, "", "Both.", [("get_time", {"city": "New York, NY"}),
                                ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    # -- Llama 4: the JSON its template asks for and writes back (no llama.cpp parser reads it) --
    (LLAMA4, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, False, "", "",
     [("get_weather", {"city": "Paris"})]),
    (LLAMA4, '<|python_start|><|python_end|>{"name": "get_time", "parameters": {"city": "Paris"}}{"name": '
             '"special_function", "parameters": {"arg1": 1}}', None, False, "", "",
     [("get_time", {"city": "Paris"}), ("special_function", {"arg1": 1})]),
    (LLAMA4, '<|python_start|>Both at once.<|python_end|>{"name": "get_time", "parameters": {"city": "a } b"}}', None,
     False, "Both at once.", "", [("get_time", {"city": "a } b"})]),
    (LLAMA4, '{"name": "python", "arguments": {"code": "print(1)"}}', None, False, "", "",
     [("python", {"code": "print(1)"})]),
    # JSON that names no tool is the model's text; a call cut off is reported with what arrived
    (LLAMA4, 'Here: {"name": "Bob", "age": 3} and {"name": "get_time"', None, False,
     'Here: {"name": "Bob", "age": 3} and ', "", [("get_time", {})]),
    (LLAMA4, HELLO, None, False, HELLO, "", []),
    # -- a call that cannot be read is given back as the text the model wrote, not dropped --
    (GEMMA4, "Sure.<|tool_call>call:get_time<tool_call|>", G4, False, "Sure.<|tool_call>call:get_time<tool_call|>", "",
     []),
    (MINIMAX_M2, 'x\n</think>\n\n<minimax:tool_call>\n<invoke name="">\n</invoke>\n</minimax:tool_call>', THINK,
     True, '<invoke name="">\n</invoke>\n', "x", []),
]


def _ids(case):
    fam, text = case[0], case[1]
    return f"{fam.name}:{text[:40]!r}"


def _parser(fam, think, open_):
    return fam.parser(TOOLS, think=think, starts_in_reasoning=open_)


def _check(msg: Message, content, reasoning, calls):
    assert msg.content == content
    assert msg.reasoning == reasoning
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == calls
    assert all(c.id for c in msg.tool_calls) and len({c.id for c in msg.tool_calls}) == len(msg.tool_calls)


def _stream(fam, think, open_, pieces) -> Message:
    p = _parser(fam, think, open_)
    out = Message()
    seen: dict[int, str] = {}
    for piece in pieces:
        d = p.feed(piece)
        _check_delta(d, seen)
        out.add(d)
    d = p.finish()
    _check_delta(d, seen)
    out.add(d)
    assert out == p.message
    return out


def _check_delta(d, seen):
    for c in d.calls:
        if c.name is not None:
            assert c.index == len(seen) and c.id, "each call is announced once, in order, with an id"
            seen[c.index] = c.name
        else:
            assert c.index in seen, "arguments come after the call's name"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_parse_whole(case):
    fam, text, think, open_, content, reasoning, calls = case
    _check(_parser(fam, think, open_).parse(text), content, reasoning, calls)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_parse_streamed_at_every_cut(case):
    fam, text, think, open_, content, reasoning, calls = case
    whole = _parser(fam, think, open_).parse(text)
    for cut in range(1, len(text)):
        got = _stream(fam, think, open_, [text[:cut], text[cut:]])
        assert (got.content, got.reasoning) == (whole.content, whole.reasoning), f"cut at {cut}"
        assert [(c.name, c.arguments) for c in got.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    got = _stream(fam, think, open_, list(text))
    _check(got, content, reasoning, calls)
    assert [c.arguments for c in got.tool_calls] == [c.arguments for c in whole.tool_calls]


def test_arguments_stream_before_the_call_ends():
    """A long argument streams: the name comes first, then the value in pieces, before the call closes."""
    p = QWEN_XML.parser(TOOLS, think=None, starts_in_reasoning=False)
    text = "<tool_call>\n<function=python>\n<parameter=code>\n" + "x = 1\n" * 20
    deltas = [p.feed(c) for c in text]
    names = [c.name for d in deltas for c in d.calls if c.name]
    frags = "".join(c.arguments for d in deltas for c in d.calls)
    assert names == ["python"]
    assert frags.startswith('{"code": "x = 1\\nx = 1') and len(frags) > 100
    p = HERMES.parser(TOOLS, think=None, starts_in_reasoning=False)
    text = '<tool_call>\n{"name": "python", "arguments": {"code": "' + "y" * 50
    frags = "".join(c.arguments for ch in text for c in p.feed(ch).calls)
    assert frags == '{"code": "' + "y" * 50


def test_without_tools_markup_is_content():
    """A request without tools does not parse calls: the markup is the model's text."""
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    msg = HERMES.parser(None, think=None, starts_in_reasoning=False).parse(text)
    assert msg.content == text and not msg.tool_calls


def test_reasoning_only_at_the_start():
    """'<think>' after the reply has begun is text, not a reasoning block."""
    msg = HERMES.parser(TOOLS, think=THINK, starts_in_reasoning=False).parse("Use <think> tags.</think>")
    assert msg.content == "Use <think> tags.</think>" and msg.reasoning == ""


def test_unfinished_call_is_reported_with_what_arrived():
    """A reply cut off by max_tokens inside a call still reports the call (arguments as far as written)."""
    msg = HERMES.parser(TOOLS, think=None, starts_in_reasoning=False).parse(
        '<tool_call>\n{"name": "get_time", "arguments": {"city": "Par')
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_time", '{"city": "Par')]


def test_mistral_ids_are_nine_characters():
    msg = MISTRAL_ARGS.parser(TOOLS, think=None, starts_in_reasoning=False).parse(
        '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}')
    assert len(msg.tool_calls[0].id) == 9 and msg.tool_calls[0].id.isalnum()


# -- which family a real template is --------------------------------------------------------------
REAL = {
    "openai-gpt-oss-120b.jinja": HARMONY,
    "Qwen3-Coder.jinja": QWEN_XML,
    "Qwen3.5-4B.jinja": QWEN_XML,
    "GLM-4.6.jinja": GLM,
    "deepseek-ai-DeepSeek-V3.1.jinja": DEEPSEEK,
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": MISTRAL,
    "Qwen-Qwen3-0.6B.jinja": HERMES,
    "meta-llama-Llama-3.3-70B-Instruct.jinja": HERMES_FALLBACK,
}


@pytest.mark.skipif(not TEMPLATES.is_dir(), reason=f"the real chat templates are not at {TEMPLATES}")
@pytest.mark.parametrize("name", sorted(REAL))
def test_family_of_real_templates(name):
    assert family_for((TEMPLATES / name).read_text()) is REAL[name]


def test_families_are_distinct():
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


def test_starts_in_reasoning():
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n", None)
