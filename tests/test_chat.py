"""Chat templates: ChatML rendering, the fallback, template errors and the sandbox."""
from __future__ import annotations

import json
from datetime import datetime

import pytest

from clutor.errors import ClutorError
from clutor.model.chat import CHATML_TEMPLATE, render_chat
from conftest import shared_data


# Qwen1.5 / Qwen2's template (as stored in ggml-vocab-qwen2.gguf), written out so this file runs alone.
QWEN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MESSAGES = [{"role": "user", "content": "Grüß dich, 世界!"}]


def test_qwen_chatml():
    out = render_chat(QWEN_TEMPLATE, MESSAGES)
    assert out == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\nGrüß dich, 世界!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    convo = [{"role": "system", "content": "Be brief."}, *MESSAGES, {"role": "assistant", "content": "Hallo."}]
    out = render_chat(QWEN_TEMPLATE, convo, add_generation_prompt=False)
    assert out == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nGrüß dich, 世界!<|im_end|>\n"
        "<|im_start|>assistant\nHallo.<|im_end|>\n"
    )


def test_fallback_is_chatml():
    want = "<|im_start|>user\nGrüß dich, 世界!<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(None, MESSAGES) == want
    assert render_chat("", MESSAGES) == want
    assert render_chat(CHATML_TEMPLATE, MESSAGES, add_generation_prompt=False) == want[: -len("<|im_start|>assistant\n")]


def test_hf_environment_features():
    # trim_blocks / lstrip_blocks: block tags leave no newline or indentation behind
    t = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    assert render_chat(t, MESSAGES) == "[Grüß dich, 世界!]\n"
    assert render_chat("{{ bos_token }}x{{ eos_token }}", MESSAGES, bos_token="<s>", eos_token="</s>") == "<s>x</s>"
    # tojson keeps non-ASCII and does not HTML-escape; extra variables reach the template
    out = render_chat("{{ tools | tojson }}", MESSAGES, tools=[{"name": "a<b>", "d": "ü"}])
    assert json.loads(out) == [{"name": "a<b>", "d": "ü"}] and "ü" in out and "<b>" in out
    assert render_chat("{% if enable_thinking is false %}off{% endif %}", MESSAGES, enable_thinking=False) == "off"
    year = render_chat("{{ strftime_now('%Y') }}", MESSAGES)
    assert year in {str(datetime.now().year - 1), str(datetime.now().year)}
    loop = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }};{% endfor %}"
    assert render_chat(loop, MESSAGES * 3) == "user;"


def test_raise_exception_becomes_clutor_error():
    t = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('System message required') }}{% endif %}"
    with pytest.raises(ClutorError, match="System message required") as info:
        render_chat(t, MESSAGES)
    assert "tokenizer.chat_template" in str(info.value)
    assert render_chat(t, [{"role": "system", "content": "x"}]) == ""


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ m.content }",  # syntax
        "{% endfor %}",  # syntax
        "{{ messages[0].content.nothing.deeper }}",  # undefined
        "{{ undefined_name() }}",  # undefined call
        "{{ 'a' + 1 }}",  # type error inside an expression
    ],
)
def test_template_errors(template):
    with pytest.raises(ClutorError, match="tokenizer.chat_template"):
        render_chat(template, MESSAGES)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",
        "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
        "{{ messages.__getitem__(0) }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{{ messages[0].update({'content': 'changed'}) }}",
    ],
)
def test_sandbox_blocks_escapes(template):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ClutorError, match="tokenizer.chat_template"):
        render_chat(template, messages)
    assert messages == [{"role": "user", "content": "hi"}]  # nothing was mutated


def test_rendered_prompt_encodes_to_special_tokens():
    from clutor.model.tokenizer import Tokenizer

    path = shared_data("vocab/ggml-vocab-qwen2.gguf")
    tok = Tokenizer.from_gguf(path)
    assert tok.chat_template == QWEN_TEMPLATE  # the file's template is the one tested above
    prompt = render_chat(tok.chat_template, MESSAGES)
    ids = tok.encode(prompt, special=True)
    start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert ids.count(start) == 3 and ids.count(end) == 2
    assert tok.decode(ids, special=True) == prompt


# -- the real templates of the models Clutor runs (shared/data/templates) -------------------------


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "thinking": "Need the tool.",
     "tool_calls": [{"id": "abcdefghi", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "tool_call_id": "abcdefghi", "name": "get_weather", "content": '{"temp": 3}'},
    {"role": "assistant", "content": "3 °C."},
    {"role": "user", "content": "Thanks"},
]


def _template(name: str) -> str:
    return shared_data(f"templates/{name}.jinja").read_text()


def _render(name: str, messages=CONVERSATION, **extra) -> str:
    return render_chat(_template(name), messages, bos_token="<BOS>", eos_token="<EOS>", **extra)


def test_gpt_oss_harmony():
    before = datetime.now().strftime("%Y-%m-%d")
    out = _render("openai-gpt-oss-120b", tools=TOOLS, reasoning_effort="high")
    after = datetime.now().strftime("%Y-%m-%d")
    assert out.startswith("<|start|>system<|message|>") and "Reasoning: high" in out
    assert f"Current date: {before}" in out or f"Current date: {after}" in out  # strftime_now at render time
    # the system message becomes the developer's instructions, next to the tool declarations
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in out
    assert "namespace functions {" in out and "type get_weather = (_: {" in out and "city: string," in out
    # a tool call goes to the commentary channel and ends with <|call|>; its result comes back from the tool
    assert ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Zürich"}<|call|>') in out
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in out
    assert "<|start|>assistant<|channel|>final<|message|>3 °C.<|end|>" in out
    assert out.endswith("<|start|>user<|message|>Thanks<|end|><|start|>assistant")
    plain = _render("openai-gpt-oss-120b", [{"role": "user", "content": "Hi"}])
    assert "Reasoning: medium" in plain and "# Tools" not in plain and "developer" not in plain


def test_deepseek_v31():
    out = _render("deepseek-ai-DeepSeek-V3.1", tools=TOOLS)
    assert out.startswith("<BOS>Be brief.")
    assert "<｜User｜>Weather in Zürich?<｜Assistant｜>" in out
    assert ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            '{"city": "Zürich"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>') in out
    assert '<｜tool▁output▁begin｜>{"temp": 3}<｜tool▁output▁end｜>' in out
    assert out.endswith("<｜User｜>Thanks<｜Assistant｜><think></think>")  # thinking off by default
    hi = [{"role": "user", "content": "Hi"}]
    assert _render("deepseek-ai-DeepSeek-V3.1", hi, thinking=True) == "<BOS><｜User｜>Hi<｜Assistant｜><think>"


def test_glm46():
    out = _render("GLM-4.6", tools=TOOLS)
    assert out.startswith("[gMASK]<sop><|system|>\n# Tools")
    assert "<|system|>\nBe brief.<|user|>\nWeather in Zürich?<|assistant|>" in out
    assert "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n</tool_call>" in out
    assert '<|observation|>\n<tool_response>\n{"temp": 3}\n</tool_response>' in out
    assert out.endswith("<|user|>\nThanks<|assistant|>")
    hi = [{"role": "user", "content": "Hi"}]
    assert _render("GLM-4.6", hi, enable_thinking=False) == "[gMASK]<sop><|user|>\nHi/nothink<|assistant|>\n<think></think>"


def test_kimi_k2():
    out = _render("moonshotai-Kimi-K2", tools=TOOLS)
    assert out.startswith("<|im_system|>tool_declare<|im_middle|>[") and '"name": "get_weather"' in out
    assert "<|im_system|>system<|im_middle|>Be brief.<|im_end|>" in out
    assert ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Zürich"}<|tool_call_end|><|tool_calls_section_end|>') in out
    assert out.endswith("<|im_user|>user<|im_middle|>Thanks<|im_end|><|im_assistant|>assistant<|im_middle|>")
    # without a system message the template supplies its own
    hi = _render("moonshotai-Kimi-K2", [{"role": "user", "content": "Hi"}])
    assert hi.startswith("<|im_system|>system<|im_middle|>") and hi.count("<|im_end|>") == 2


def test_llama33():
    out = _render("meta-llama-Llama-3.3-70B-Instruct", tools=TOOLS, date_string="1 Jan 2026")
    assert out.startswith("<BOS><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert "Today Date: 1 Jan 2026\n\nBe brief.<|eot_id|>" in out
    assert '"name": "get_weather"' in out and '    "type": "function",' in out  # tojson(indent=4)
    assert '{"name": "get_weather", "parameters": {"city": "Zürich"}}<|eot_id|>' in out
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in out
    assert out.endswith("Thanks<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert out.count("<|eot_id|>") == 6


def test_mistral_nemo():
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    out = _render("mistralai-Mistral-Nemo-Instruct-2407", convo)
    # the system message goes into the last user turn
    assert out == "<BOS>[INST]Hi[/INST]Hello!<EOS>[INST]Be brief.\n\n2+2?[/INST]"
    with pytest.raises(ClutorError, match="alternate"):
        _render("mistralai-Mistral-Nemo-Instruct-2407", [{"role": "user", "content": "a"}] * 2)
    with pytest.raises(ClutorError, match="alphanumeric strings with length 9"):
        bad = [dict(m) for m in CONVERSATION]
        bad[2] = {**bad[2], "tool_calls": [{**bad[2]["tool_calls"][0], "id": "call_1"}]}
        _render("mistralai-Mistral-Nemo-Instruct-2407", bad, tools=TOOLS)


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "Qwen3.5-4B", "Qwen3-Coder"])
def test_qwen3_family(name):
    out = _render(name, tools=TOOLS)
    assert out.startswith("<|im_start|>system\n") and "<tools>" in out and "get_weather" in out
    assert "<|im_start|>user\nWeather in Zürich?<|im_end|>" in out
    assert '<tool_response>\n{"temp": 3}\n</tool_response>' in out
    assert "<tool_call>" in out and "Zürich" in out
    assert out.count("<|im_start|>") == out.count("<|im_end|>") + 1  # the open assistant turn
    hi = [{"role": "user", "content": "Hi"}]
    if name != "Qwen3-Coder":
        assert _render(name, hi, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert _render(name, hi, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_lfm2():
    out = _render("LFM2-8B-A1B", tools=TOOLS)
    assert out.startswith("<BOS><|im_start|>system\nBe brief.\nList of tools: <|tool_list_start|>[")
    assert '<|tool_response_start|>{"temp": 3}<|tool_response_end|>' in out
    assert out.endswith("<|im_start|>assistant\n")


def test_generation_block():
    t = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert render_chat(t, MESSAGES * 2) == "[Grüß dich, 世界!][Grüß dich, 世界!]"


def test_chat_prompt_drops_the_bos_the_tokenizer_adds():
    """A Llama-3 template writes <|begin_of_text|> and encoding adds BOS too: llama.cpp removes the
    rendered one, so the prompt starts with exactly one BOS."""
    from clutor.model.chat import chat_prompt
    from clutor.model.tokenizer import Tokenizer

    path = shared_data("vocab/ggml-vocab-llama-bpe.gguf")
    md = _gguf_metadata(path)
    md["tokenizer.chat_template"] = _template("meta-llama-Llama-3.3-70B-Instruct")
    tok = Tokenizer.from_metadata(md, str(path))
    text = chat_prompt(tok, [{"role": "user", "content": "Hi"}])
    assert text.startswith("<|start_header_id|>system")
    ids = tok.encode(text, special=True)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids.count(tok.token_id("<|eot_id|>")) == 2
    assert tok.decode(ids, special=True) == "<|begin_of_text|>" + text
    # a vocabulary that does not add BOS keeps the template's
    md["tokenizer.ggml.add_bos_token"] = False
    no_bos = Tokenizer.from_metadata(md, str(path))
    text = chat_prompt(no_bos, [{"role": "user", "content": "Hi"}])
    assert text.startswith("<|begin_of_text|>") and no_bos.encode(text, special=True).count(tok.bos_id) == 1


def test_chat_prompt_with_spm_vocab():
    """Phi-3's own template through its SentencePiece vocabulary: specials parsed, one BOS."""
    from clutor.model.chat import chat_prompt
    from clutor.model.tokenizer import Tokenizer

    path = shared_data("vocab/ggml-vocab-phi-3.gguf")
    tok = Tokenizer.from_gguf(path)
    text = chat_prompt(tok, [{"role": "user", "content": "Hi"}])
    ids = tok.encode(text, special=True)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    for special in ("<|user|>", "<|end|>", "<|assistant|>"):
        assert tok.token_id(special) in ids


def _gguf_metadata(path) -> dict:
    from clutor.model.gguf import GGUFFile

    with GGUFFile.open(path) as f:
        return dict(f.metadata)
