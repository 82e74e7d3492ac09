"""Render a conversation through the model's Jinja2 chat template (``tokenizer.chat_template``).

The environment mirrors Hugging Face's ``apply_chat_template``: a sandbox that cannot mutate
objects or reach Python internals, ``trim_blocks`` + ``lstrip_blocks``, the ``loopcontrols``
extension, the ``{% generation %}`` block (rendered as is), a ``tojson`` that keeps non-ASCII text
and takes ``indent``/``separators``/``sort_keys``, and the globals ``raise_exception`` and
``strftime_now`` that real templates call; ``namespace`` is Jinja's own.

``chat_prompt`` / ``chat_ids`` render for a tokenizer the way llama.cpp does: the template gets the
vocabulary's BOS/EOS texts, and a BOS text the template put first is removed again when encoding adds
BOS itself (likewise a final EOS text), so the prompt never starts with two BOS tokens.
"""
from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ClutorError

__all__ = ["render_chat", "chat_prompt", "chat_ids", "chat_turn", "quote_content", "CHATML_TEMPLATE"]

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


# Bounds on one render. Real templates render a long conversation in a few thousand template lines
# and produce at most the context's worth of text; a template that goes far past these is broken or
# hostile (nested loops over range(100000), a recursive macro, 'a' * 10**10), and is stopped.
MAX_STEPS = 5_000_000          # template source lines executed
MAX_SECONDS = 10.0             # wall time, checked every few thousand lines
MAX_CHARS = 4 << 20            # characters in any string (or items in any list) a template builds
MAX_GROWTH = 1 << 30           # bytes the process may grow by while rendering (checked every 64 lines)


class _TooBig(ClutorError):
    pass


_BIG_WIDTH = re.compile(r"%[-+ #0*]*\d{8,}|%[-+ #0*]*\d*\.\d{8,}")


def _check_len(n: int, what: str) -> None:
    if n > MAX_CHARS:
        raise _TooBig(f"{what} of {n} items (at most {MAX_CHARS})")


def _check_ints(args, kwargs) -> None:
    # A width, count or repeat argument above MAX_CHARS ('x'.center(10**10), 'x'|indent(10**10))
    # would build a string that large: refuse it before the call.
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_CHARS:
            raise _TooBig(f"an argument of {v} (at most {MAX_CHARS})")


def _bounded_join(parts) -> str:
    """The template's '~' operator (str_join in Jinja's generated code), bounded by MAX_CHARS."""
    parts = [str(p) for p in parts]
    _check_len(sum(map(len, parts)), "a '~' concatenation")
    return "".join(parts)


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator with '~' routed through _bounded_join (there is no sandbox hook for it)."""

    def visit_Concat(self, node, frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:  # never in ours: autoescape is off
            return super().visit_Concat(node, frame)
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _bounded_filter(f):
    @functools.wraps(f)
    def bounded(*args, **kwargs):
        _check_ints(args, kwargs)
        out = f(*args, **kwargs)
        if isinstance(out, str):
            _check_len(len(out), f"the output of filter {f.__name__}")
        return out

    return bounded


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
    template probing Python internals is broken or hostile, so fail loudly instead. It also refuses
    '*' and '+' results larger than MAX_CHARS before they are built (the stock sandbox only bounds
    range())."""

    intercepted_binops = frozenset(["*", "+", "**", "%"])
    code_generator_class = _CodeGenerator
    bounded_join = staticmethod(_bounded_join)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the stock signature)
        _check_ints(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def unsafe_undefined(self, obj: object, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context, operator: str, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
                    raise _TooBig(f"a repetition of {len(seq) * n} items (at most {MAX_CHARS})")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > MAX_CHARS:
                    raise _TooBig(f"a concatenation of {len(left) + len(right)} items (at most {MAX_CHARS})")
        elif operator == "%":
            if isinstance(left, str) and _BIG_WIDTH.search(left):
                raise _TooBig("a %-format width or precision of 8 digits or more")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 4096:
                raise _TooBig(f"a power {left} ** {right}")
        return super().call_binop(context, operator, left, right)


def _rss() -> int:
    """Resident bytes of this process (0 where /proc is missing: the other bounds still hold)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Steps:
    """A trace function counting the lines of template code (and only those) one render executes:
    the one bound that also stops loops with empty bodies, which call nothing we could intercept."""

    def __init__(self, code_file: str):
        self.code_file = code_file
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS
        self.rss0 = _rss()

    def __call__(self, frame, event, arg):
        return self.line if frame.f_code.co_filename == self.code_file else None

    def line(self, frame, event, arg):
        if event == "line":
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise _TooBig(f"more than {MAX_STEPS} template steps (an endless or huge loop?)")
            if not self.steps & 63:
                # strings stay below MAX_CHARS each, but a loop could keep many: bound the total
                if _rss() - self.rss0 > MAX_GROWTH:
                    raise _TooBig(f"rendering grew the process by over {MAX_GROWTH >> 20} MiB")
                if time.monotonic() > self.deadline:
                    raise _TooBig(f"rendering took over {MAX_SECONDS:.0f} s")
        return self.line


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_filter(f)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=8)
def _compile(template: str, name: str = _FIELD) -> jinja2.Template:
    if len(template) > MAX_CHARS:
        raise ClutorError(f"{name}: a template of {len(template)} characters (at most {MAX_CHARS})")
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ClutorError(f"{name}: template syntax error at line {e.lineno}: {e.message}") from None
    except RecursionError:
        raise ClutorError(f"{name}: template nested too deeply to compile") from None


def render_chat(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    name: str = _FIELD,
    **extra: object,
) -> str:
    """The prompt text for ``messages`` (dicts with "role" and "content") under ``template``.

    ``template`` None or empty falls back to ChatML (``CHATML_TEMPLATE``): the file carries no
    template, and ChatML is what the Qwen models (and many others) were trained on. ``extra``
    keyword arguments become template variables too (e.g. ``tools=...``, ``enable_thinking=False``).
    The result still holds special-token text ("<|im_start|>"): encode it with ``special=True``.
    Any template failure (syntax, undefined value, sandbox violation, ``raise_exception``) raises
    ClutorError naming the template (``name``: ``tokenizer.chat_template`` unless given, e.g. the
    file of a --chat-template override). Rendering is bounded: MAX_STEPS template lines, MAX_SECONDS,
    and MAX_CHARS per string built or output; a template that goes past them raises ClutorError.
    """
    compiled = _compile(template or CHATML_TEMPLATE, name)
    steps = _Steps(compiled.root_render_func.__code__.co_filename)
    previous = sys.gettrace()
    out: list[str] = []
    size = 0
    try:
        sys.settrace(steps)
        try:
            for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=bos_token, eos_token=eos_token, **extra):
                size += len(piece)
                if size > MAX_CHARS:
                    raise _TooBig(f"output longer than {MAX_CHARS} characters")
                out.append(piece)
        finally:
            sys.settrace(previous)
    except _TooBig as e:
        raise ClutorError(f"{name}: rendering stopped: {e}") from None
    except ClutorError:
        raise
    except SecurityError as e:
        raise ClutorError(f"{name}: the template tried an unsafe operation: {e}") from None
    except jinja2.TemplateError as e:
        raise ClutorError(f"{name}: rendering failed: {type(e).__name__}: {e}") from None
    except RecursionError:
        raise ClutorError(f"{name}: rendering failed: recursion too deep (a macro calling itself?)") from None
    except (MemoryError, OverflowError) as e:
        raise ClutorError(f"{name}: rendering stopped: {type(e).__name__}: {str(e) or 'out of memory'}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
        # Python errors raised inside template expressions (e.g. 'a' + 1) are template bugs too.
        raise ClutorError(f"{name}: rendering failed: {type(e).__name__}: {e}") from None
    return "".join(out)


def chat_prompt(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                template: str | None = None, name: str = _FIELD, **extra: object) -> str:
    """The prompt text for ``messages`` under ``tokenizer``'s own template (or ``template``, named
    ``name`` in errors), ready for ``tokenizer.encode(text, special=True)``, which adds BOS per the file.

    As llama.cpp: the template sees the vocabulary's BOS/EOS texts; a BOS text at the very start is
    dropped when the tokenizer adds BOS anyway, an EOS text at the very end when it adds EOS; and what
    llama.cpp does around the template of the chat format it reads (clutor.formats: Gemma 4's first
    templates get the tool results inline) is done here too.
    """
    from ..formats import family_for

    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    template = template or tokenizer.chat_template
    family = family_for(template)
    if template:
        messages = family.template_messages(messages, template)
    text = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                       bos_token=bos, eos_token=eos, name=name, **extra)
    text = family.template_prompt(text, add_generation_prompt)
    if tokenizer.add_bos and bos and text.startswith(bos):
        text = text[len(bos):]
    if tokenizer.add_eos and eos and text.endswith(eos):
        text = text[: -len(eos)]
    return text


def quote_content(tokenizer, value):
    """``value`` (messages, tools, template arguments: JSON-like) with every string in it quoted
    (Tokenizer.quote): what a conversation's authors wrote stays text in the prompt, whatever control
    tokens it spells."""
    if isinstance(value, str):
        return tokenizer.quote(value)
    if isinstance(value, dict):
        return {k: quote_content(tokenizer, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [quote_content(tokenizer, v) for v in value]
    return value


def chat_ids(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True, template: str | None = None,
             name: str = _FIELD, special_in_content: bool = False, **extra: object) -> list[int]:
    """The token ids of a conversation rendered through the tokenizer's chat template (``chat_prompt``),
    BOS/EOS added per the file. Special tokens are parsed in the template's markup only; the messages'
    own text (and the tools', and ``extra``'s) is text, unless ``special_in_content`` (llama-server's
    way: a user's "<|im_start|>" is then a token)."""
    if not special_in_content:
        messages = quote_content(tokenizer, messages)
        extra = quote_content(tokenizer, extra)
    text = chat_prompt(tokenizer, messages, add_generation_prompt=add_generation_prompt, template=template, name=name,
                       **extra)
    return tokenizer.encode(text, special=True, quoted=not special_in_content)


def chat_turn(tokenizer, messages: list[dict], **extra: object) -> tuple[list[int], tuple[int, ...]]:
    """(the prompt ids of this turn, where a model with recurrent layers should keep its state).

    The next turn renders this conversation as it is now and then the reply; a template may render the
    reply's turn differently from this turn's generation prompt (Qwen3.5's drops the thinking once
    another user message follows), so what the next turn surely shares is the conversation without
    the assistant's header: its length, when its ids are a prefix of the prompt's. A recurrent state
    cannot be cut back from the prompt's end, so it is kept there too (clutor.model.engine)."""
    ids = chat_ids(tokenizer, messages, **extra)
    base = chat_ids(tokenizer, messages, add_generation_prompt=False, **extra)
    keep = (len(base),) if 0 < len(base) < len(ids) and ids[: len(base)] == base else ()
    return ids, keep
