"""A model family's chat format: how it writes tool calls and reasoning, and how to ask for them.

Each family module (hermes, qwen_xml, glm, deepseek, mistral, harmony) defines one ``Family``:
- ``detect(template)``: whether a chat template is this family's (by the markup it writes);
- ``parser(...)``: a fresh StreamParser for one reply;
- ``call_grammar(tools, parallel, lit)``: a Lark rule ``calls`` admitting exactly this family's
  well-formed calls to these tools (constrained decoding for tool_choice required / named);
- ``tools_prompt(tools)``: the system text describing the tools, for templates that do not render
  ``tools`` themselves (None when the template does);
- ``render_calls(calls)``: an assistant's calls as this family writes them, for templates that do
  not render ``tool_calls``;
- ``template_messages(messages, template)`` / ``template_prompt(prompt, add_generation_prompt)``: what
  llama.cpp does around this family's template (clutor.model.chat.chat_prompt applies both): the
  messages in the shape the template reads, and the prompt made whole where the template leaves it
  short. Most families change nothing.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .base import StreamParser, Tool, new_call_id

__all__ = ["Family", "Lit", "json_rule", "nested", "part", "text_until"]

# lit(text) -> a Lark term producing exactly this text: the special token when the vocabulary has it
# as a control token (it cannot be spelled in bytes), else the quoted string.
Lit = Callable[[str], str]


def json_rule(schema: dict) -> str:
    """An llguidance Lark term for one JSON value matching ``schema`` (bounded whitespace, as every
    JSON constraint here)."""
    from ..grammar.constraint import json_term

    return json_term(schema)


def text_until(stop: str) -> str:
    """A Lark regex for any text that does not contain ``stop`` (so ``stop`` ends it). llguidance
    allows '&' and '~' in terminals only: use it as ``NAME: text_until(...)`` and refer to NAME."""
    esc = "".join("\\" + c if c in r"\/.^$*+?()[]{}|-" else c for c in stop).replace("\n", "\\n")
    return f"/(?s:.*)/ & ~/(?s:.*{esc}.*)/"


def param_rules(tool: Tool, stop: str, defs: list[str], element: Callable[[str, str], str]) -> str:
    """The grammar of one call's arguments in an XML form: each parameter in the schema's order, written by
    ``element(key, value_rule)``, optional unless required; a string value is raw text up to ``stop``, any
    other value JSON."""
    props = (tool.parameters or {}).get("properties") or {}
    required = set((tool.parameters or {}).get("required") or ())
    parts = []
    for key, spec in props.items():
        if tool.is_string(key):
            value = raw_text(tool.spec(key) or spec, stop, defs)
        else:
            value = json_rule(part(object_schema(tool), spec) if isinstance(spec, dict) else {})
        one = element(key, value)
        parts.append(one if key in required else f"({one})?")
    return " ".join(parts)


def raw_text(spec, stop: str, defs: list[str]) -> str:
    """A string argument written as raw text up to ``stop`` (the XML forms' delimiter): one of its
    enum's values when it has one; else any text without ``stop``, of the schema's minLength..maxLength
    and matching its pattern when it gives them. Terminals it needs are appended to ``defs``."""
    import json

    spec = spec if isinstance(spec, dict) else {}
    enum = spec.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in enum) + ")"
    lo, hi = spec.get("minLength"), spec.get("maxLength")
    pattern = spec.get("pattern")
    if isinstance(pattern, str) and pattern:
        body = pattern[1:] if pattern.startswith("^") else "(?s:.*)" + pattern
        body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body + "(?s:.*)"
        core = "/" + body.replace("/", "\\/") + "/"
    elif isinstance(lo, int) or isinstance(hi, int):
        core = "/(?s:.{%d,%s})/" % (lo if isinstance(lo, int) else 0, hi if isinstance(hi, int) else "")
    else:
        core = "/(?s:.*)/"
    name = f"RAW{len(defs)}"
    no_stop = text_until(stop).split(" & ", 1)[1]
    defs.append(f"{name}: {core} & {no_stop}")
    return name


def object_schema(tool: Tool) -> dict:
    p = tool.parameters if isinstance(tool.parameters, dict) and tool.parameters else {"type": "object"}
    return p


# A tool's schema may refer into itself ("$ref": "#/$defs/Item", as Pydantic writes them, or "#"). When
# the grammar embeds it in a larger schema (the call's {"name", "arguments"} object) or uses one of its
# properties alone, those pointers would resolve against the wrong document. So the tool's schema moves
# whole into the new document's $defs under a key, and its local pointers are prefixed to point there.
def nested(schema: dict, key: str, defs: dict) -> dict:
    """What to put where ``schema`` is embedded in another schema: ``schema`` itself when it has no
    local ``$ref``, else a reference to ``defs[key]``, a copy of it whose pointers lead there (the
    caller puts ``defs`` in its root's ``$defs``)."""
    moved = _rerooted(schema, f"#/$defs/{key}")
    if moved is None:
        return schema
    defs[key] = moved
    return {"$ref": f"#/$defs/{key}"}


def part(tool_schema: dict, spec: dict) -> dict:
    """``spec``, one part of ``tool_schema`` (a property's schema), as a schema of its own whose local
    ``$ref``s still lead into ``tool_schema``."""
    moved = _rerooted(spec, "#/$defs/tool")
    if moved is None:
        return spec
    moved["$defs"] = {**(moved.get("$defs") or {}), "tool": _rerooted(tool_schema, "#/$defs/tool") or tool_schema}
    return moved


def _rerooted(schema: dict, prefix: str) -> dict | None:
    """A copy of ``schema`` with each local pointer ("#", "#/...") under ``prefix``; None when it has none.
    (Iterative: a client's schema may nest as deep as JSON allows.)"""
    import json

    text = json.dumps(schema, ensure_ascii=False)
    if '"$ref"' not in text:
        return None
    copy = json.loads(text)
    found, stack = False, [copy]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                node["$ref"] = prefix + ref[1:]
                found = True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return copy if found else None


class Family:
    name = "plain"
    markers: tuple[str, ...] = ()       # texts the parser reads: shown even when they are control tokens
    native = True                       # the template renders tools and tool calls itself

    def detect(self, template: str) -> bool:  # pragma: no cover - overridden
        return False

    def new_id(self) -> str:
        return new_call_id()

    def parser(self, tools: dict[str, Tool] | None, *, think: tuple[str, str] | None, starts_in_reasoning: bool,
               prefix: str = "") -> StreamParser:  # pragma: no cover - overridden
        raise NotImplementedError

    def call_grammar(self, tools: Sequence[Tool], parallel: bool, lit: Lit) -> str:  # pragma: no cover
        raise NotImplementedError

    def tools_prompt(self, tools: Sequence[Tool]) -> str | None:
        return None

    def render_calls(self, calls: Sequence[tuple[str, dict]]) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def template_messages(self, messages: list[dict], template: str) -> list[dict]:
        return messages

    def template_prompt(self, prompt: str, add_generation_prompt: bool) -> str:
        return prompt

    def __repr__(self) -> str:
        return f"<chat format {self.name}>"


def alternatives(rules: dict[str, str]) -> str:
    """Lark text defining one rule per tool and ``call`` as their alternatives."""
    lines = [f"{name}: {body}" for name, body in rules.items()]
    lines.append("call: " + " | ".join(rules))
    return "\n".join(lines)


def repeat_calls(parallel: bool, sep: str = "") -> str:
    if not parallel:
        return "calls: call"
    return f"calls: call ({sep} call)*" if sep else "calls: call+"
