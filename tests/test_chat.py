"""Chat templates: ChatML rendering, the fallback, template errors and the sandbox."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from clutor.errors import ClutorError
from clutor.model.chat import CHATML_TEMPLATE, render_chat

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

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

    path = DATA / "vocab" / "ggml-vocab-qwen2.gguf"
    if not path.exists():
        pytest.skip(f"reference vocab {path} absent (shared/data is not next to this checkout)")
    tok = Tokenizer.from_gguf(path)
    assert tok.chat_template == QWEN_TEMPLATE  # the file's template is the one tested above
    prompt = render_chat(tok.chat_template, MESSAGES)
    ids = tok.encode(prompt, special=True)
    start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert ids.count(start) == 3 and ids.count(end) == 2
    assert tok.decode(ids, special=True) == prompt
