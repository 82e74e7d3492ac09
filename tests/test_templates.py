"""The chat templates of Gemma 4, MiniMax-M2 and Llama 4 rendered by Clutor equal llama.cpp's renderings.

tests/golden/chat_templates.json holds what llama-server --jinja (llama.cpp's own C++ Jinja engine and
message handling) returned from /apply-template for each template in tests/fixtures/templates/ and each
conversation (system, multi-turn, tools declared, assistant tool calls, tool results, parallel calls,
thinking on and off, with and without the generation prompt); tools/record_templates.py recorded it.
Each request goes through the server's own path here (chat_messages, plan_chat), with the vocabulary of
the fixture model llama-server ran. The tool calls the template wrote into the prompt are then read
back by the family's parser: the calls it gave the template come back.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from clutor.formats import GEMMA4, LLAMA4, MINIMAX_M2, THINK, family_for, think_tags
from clutor.formats.base import Tool

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "golden" / "chat_templates.json").read_text())
TEMPLATES = ROOT / "tests" / "fixtures" / "templates"
FAMILY = {"google-gemma-4-31B-it.jinja": GEMMA4, "google-gemma-4-31B-it-interleaved.jinja": GEMMA4,
          "MiniMax-M2.jinja": MINIMAX_M2, "meta-llama-Llama-4-Scout-17B-16E-Instruct.jinja": LLAMA4}
CASES = [(t, c) for t, v in GOLDEN["templates"].items() for c in v["cases"]]


def _tokenizer(model: str):
    from clutor.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(ROOT / "tests" / "fixtures" / model)


def _plan(template_name: str, request: dict):
    from clutor.server.chat_plan import chat_messages, plan_chat

    tok = _tokenizer(GOLDEN["templates"][template_name]["model"])
    template = (TEMPLATES / template_name).read_text()
    return plan_chat(dict(request), chat_messages(request["messages"]), tok, template=template)


@pytest.mark.parametrize("template,case", CASES, ids=[f"{t.split('.jinja')[0]}:{c}" for t, c in CASES])
def test_renders_as_llama_cpp(template, case):
    rec = GOLDEN["templates"][template]["cases"][case]
    assert "prompt" in rec, f"llama-server refused {case}: {rec.get('error')}"
    assert _plan(template, rec["request"]).prompt == rec["prompt"]


@pytest.mark.parametrize("template", sorted(FAMILY))
def test_format_detected(template):
    text = (TEMPLATES / template).read_text()
    assert family_for(text) is FAMILY[template]
    assert think_tags(text) == (GEMMA4.think if FAMILY[template] is GEMMA4 else
                                THINK if FAMILY[template] is MINIMAX_M2 else None)


def _calls_in(request: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for m in request["messages"] for c in m.get("tool_calls", ())]


# where each template writes an assistant turn's calls: (the text before them, the text after)
TURN = {GEMMA4: ("<|turn>model\n", "<|tool_response>"), MINIMAX_M2: ("]~b]ai\n", "[e~["),
        LLAMA4: ("<|header_start|>assistant<|header_end|>\n\n", "<|eot|>")}


@pytest.mark.parametrize("template,case", [(t, c) for t, c in CASES if c in ("tool_result", "parallel_calls")])
def test_rendered_calls_parse_back(template, case):
    """The template's own writing of the calls (in llama.cpp's rendering) is what the parser reads."""
    rec = GOLDEN["templates"][template]["cases"][case]
    fam = FAMILY[template]
    start, end = TURN[fam]
    prompt = rec["prompt"]
    turn = prompt[prompt.index(start, prompt.index(rec["request"]["messages"][-2 if case == "tool_result" else 0]
                                                      ["content"])) + len(start):]
    turn = turn[:turn.index(end)]
    tools = {t["function"]["name"]: Tool(t["function"]["name"], t["function"]["parameters"])
             for t in rec["request"]["tools"]}
    msg = fam.parser(tools, think=think_tags((TEMPLATES / template).read_text()), starts_in_reasoning=False).parse(turn)
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == _calls_in(rec["request"])


@pytest.mark.parametrize("template", sorted(FAMILY))
def test_file_template_selects_its_format(template, tmp_path, capsys):
    """A GGUF whose tokenizer.chat_template is one of these: the server reads its calls in that format
    with no template given, and `clutor info` names it."""
    from gguf_util import copy_gguf

    from clutor.cli import main
    from clutor.model.tokenizer import Tokenizer
    from clutor.server.chat_plan import chat_messages, plan_chat

    model = GOLDEN["templates"][template]["model"]
    path = tmp_path / model
    text = (TEMPLATES / template).read_text()
    copy_gguf(ROOT / "tests" / "fixtures" / model, path, strings={"tokenizer.chat_template": text})
    tok = Tokenizer.from_gguf(path)
    assert tok.chat_template == text
    req = GOLDEN["templates"][template]["cases"]["tool_result"]["request"]
    plan = plan_chat(dict(req), chat_messages(req["messages"]), tok)
    assert plan.family is FAMILY[template] and plan.prompt == GOLDEN["templates"][template]["cases"]["tool_result"]["prompt"]
    assert main(["info", str(path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("chat format"))
    assert line.split(None, 2)[2].startswith(f"{FAMILY[template].name} tool calls")
    assert ("<|channel>thought ... <channel|>" in line) == (FAMILY[template] is GEMMA4)
