"""Render a conversation through the model's Jinja2 chat template (``tokenizer.chat_template``).

The environment mirrors Hugging Face's ``apply_chat_template``: a sandbox that cannot mutate
objects or reach Python internals, ``trim_blocks`` + ``lstrip_blocks``, the ``loopcontrols``
extension, the ``{% generation %}`` block (rendered as is), a ``tojson`` that keeps non-ASCII text
and takes ``indent``/``separators``/``sort_keys``, and the globals ``raise_exception`` and
``strftime_now`` that real templates call; ``namespace`` is Jinja's own.

``chat_prompt`` renders for a tokenizer the way llama.cpp does: the template gets the vocabulary's
BOS/EOS texts, and a BOS text the template put first is removed again when encoding adds BOS itself
(likewise a final EOS text), so the prompt never starts with two BOS tokens.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ClutorError

__all__ = ["render_chat", "chat_prompt", "CHATML_TEMPLATE"]

_FIELD = "tokenizer.chat_template"

# Used when the file has no template: ChatML, the format of the Qwen models (and a common default).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: object) -> None:
    # Jinja lets exceptions from globals through unchanged, so this reaches the caller as is.
    raise ClutorError(f"{_FIELD}: the template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and '; templates expect plain JSON (as in HF).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: Hugging Face marks the assistant's own text with
    it (to build training masks); for a prompt it is just its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The stock sandbox turns an unsafe attribute into a silent Undefined ("" when printed); a
    template probing Python internals is broken or hostile, so fail loudly instead."""

    def unsafe_undefined(self, obj: object, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ClutorError(f"{_FIELD}: template syntax error at line {e.lineno}: {e.message}") from None


def render_chat(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: object,
) -> str:
    """The prompt text for ``messages`` (dicts with "role" and "content") under ``template``.

    ``template`` None or empty falls back to ChatML (``CHATML_TEMPLATE``): the file carries no
    template, and ChatML is what the Qwen models (and many others) were trained on. ``extra``
    keyword arguments become template variables too (e.g. ``tools=...``, ``enable_thinking=False``).
    The result still holds special-token text ("<|im_start|>"): encode it with ``special=True``.
    Any template failure (syntax, undefined value, sandbox violation, ``raise_exception``) raises
    ClutorError naming ``tokenizer.chat_template``.
    """
    compiled = _compile(template or CHATML_TEMPLATE)
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except SecurityError as e:
        raise ClutorError(f"{_FIELD}: the template tried an unsafe operation: {e}") from None
    except jinja2.TemplateError as e:
        raise ClutorError(f"{_FIELD}: rendering failed: {type(e).__name__}: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
        # Python errors raised inside template expressions (e.g. 'a' + 1) are template bugs too.
        raise ClutorError(f"{_FIELD}: rendering failed: {type(e).__name__}: {e}") from None


def chat_prompt(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True, **extra: object) -> str:
    """The prompt text for ``messages`` under ``tokenizer``'s own template, ready for
    ``tokenizer.encode(text, special=True)`` (which adds BOS per the file).

    As llama.cpp: the template sees the vocabulary's BOS/EOS texts; a BOS text at the very start is
    dropped when the tokenizer adds BOS anyway, an EOS text at the very end when it adds EOS.
    """
    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    text = render_chat(tokenizer.chat_template, messages, add_generation_prompt=add_generation_prompt,
                       bos_token=bos, eos_token=eos, **extra)
    if tokenizer.add_bos and bos and text.startswith(bos):
        text = text[len(bos):]
    if tokenizer.add_eos and eos and text.endswith(eos):
        text = text[: -len(eos)]
    return text
