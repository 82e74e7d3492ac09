"""From a chat request to what the generation needs: the prompt, the reply's parser, the grammar.

The tools, tool calls and tool results go through the model's own chat template; the reply comes
back through its family's parser (clutor.formats). Templates that render no tools (the demo model's,
Llama 3's) get the tools described in the system prompt and Hermes-style calls, which is what
Qwen2.5 and most tool-tuned models write; DeepSeek-V3.1's template renders calls but not the tools,
so its system prompt describes them in DeepSeek's words. Where a template cannot render tool calls
or tool results, they are written into the conversation as the family writes them.

Constraints: ``response_format`` json_object / json_schema, llama-server's ``grammar`` (GBNF) and
``json_schema`` fields, and ``tool_choice`` required or a named function all become one llguidance
grammar. A reply that may reason first (an open ``<think>``, harmony's analysis channel) is let
through before the constrained part.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import ClutorError
from ..formats import HARMONY, Family, StreamParser, Tool, family_for, starts_in_reasoning, think_tags
from ..formats.family import text_until
from .errors import APIError, bad_request
from .jsontext import loads
from .labels import shown
from .sizes import check_size

__all__ = ["ChatPlan", "plan_chat", "REASONING_FORMATS"]

# llama-server's --reasoning-format values: auto/deepseek = reasoning apart in reasoning_content;
# none = left in content as the model wrote it
REASONING_FORMATS = ("auto", "deepseek", "none")
TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128


@dataclass
class ChatPlan:
    ids: list[int]
    prompt: str
    family: Family
    tools: dict[str, Tool] | None           # None: calls are not parsed (no tools, or tool_choice none)
    think: tuple[str, str] | None           # the reasoning tags the parser splits on (None: not split)
    open_reasoning: bool                    # the prompt left a reasoning block open
    closed_reasoning: bool = False          # the prompt ends with an empty, closed block: no thinking now
    grammar: object = None                  # clutor.grammar.Grammar or None
    show_tokens: frozenset[int] = field(default_factory=frozenset)
    prefix: str = ""                        # content before the reply (the open tag, when not split)
    keep: tuple[int, ...] = ()              # where a recurrent model keeps its state for the next turn

    def parser(self) -> StreamParser:
        return self.family.parser(self.tools, think=self.think, starts_in_reasoning=self.open_reasoning,
                                  prefix=self.prefix)


def plan_chat(body: dict, messages: list[dict], tokenizer, *, reasoning_format: str = "auto",
              template: str | None = None, recurrent: bool = False, n_ctx: int | None = None,
              special_in_content: bool = False) -> ChatPlan:
    """``messages``: the request's messages already checked for shape (``chat_messages``). Their text,
    the tools' and the template arguments' is tokenised as text, special tokens parsed only in the
    template's markup, unless ``special_in_content`` (llama-server's way).
    recurrent: the model has recurrent layers: ``keep`` says where they keep their state for the next
    turn (clutor.model.chat.chat_turn's rule: the conversation without the generation prompt).
    n_ctx: a prompt that cannot fit it is refused before it is tokenised (sizes.check_size)."""
    template = template or tokenizer.chat_template
    fam = family_for(template)
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    rf = body.get("reasoning_format", reasoning_format)
    if rf not in REASONING_FORMATS:
        raise bad_request("reasoning_format", f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}, "
                                              f"got {shown(rf)}")
    kwargs = _template_kwargs(body)
    gen = body.get("add_generation_prompt", True)  # llama-server's field: false renders no assistant header
    if not isinstance(gen, bool):
        raise bad_request("add_generation_prompt", "'add_generation_prompt' must be a boolean")
    offered = tools if tools and choice != "none" else []

    from ..model.chat import chat_prompt, quote_content

    quote = not special_in_content
    shown_tools = offered
    if quote:  # what the client wrote stays text: quoted before the family's markup joins it
        messages, kwargs = quote_content(tokenizer, messages), quote_content(tokenizer, kwargs)
        shown_tools = [replace(t, description=tokenizer.quote(t.description),
                               parameters=quote_content(tokenizer, t.parameters)) for t in offered]
    msgs = _for_template(messages, fam, template, shown_tools)
    extra = dict(kwargs)
    if offered and fam.native and fam.tools_prompt(shown_tools) is None:
        extra["tools"] = [_openai_tool(t) for t in shown_tools]

    try:
        prompt = chat_prompt(tokenizer, msgs, template=template, add_generation_prompt=gen, **extra)
    except ClutorError as e:
        raise bad_request("messages", f"the model's chat template refused the conversation: {e}") from None
    if n_ctx is not None:
        check_size(prompt, tokenizer, n_ctx, "messages")
    ids = tokenizer.encode(prompt, special=True, quoted=quote)
    keep: tuple[int, ...] = ()
    if recurrent and gen:
        try:
            base = tokenizer.encode(chat_prompt(tokenizer, msgs, add_generation_prompt=False, template=template,
                                                **extra), special=True, quoted=quote)
        except ClutorError:
            base = []
        keep = (len(base),) if 0 < len(base) < len(ids) and ids[: len(base)] == base else ()

    think = think_tags(template) if fam is not HARMONY else ("<|channel|>analysis", "<|end|>")
    open_ = starts_in_reasoning(prompt, think) if fam is not HARMONY else False
    split = rf != "none"
    prefix = ""
    if not split and open_:
        prefix = prompt[prompt.rstrip().rfind(think[0]):]  # the open tag the template wrote, as the model saw it
    plan = ChatPlan(ids, prompt, fam, {t.name: t for t in offered} if offered else None,
                    think if split else None, open_ and split, prefix=prefix, keep=keep)
    plan.closed_reasoning = bool(think) and fam is not HARMONY and prompt.rstrip().endswith(think[1])
    plan.show_tokens = _shown(tokenizer, fam, think)
    plan.grammar = _grammar(body, tokenizer, plan, offered, choice, parallel)
    return plan


def plan_completion(body: dict, ids: list[int], tokenizer) -> ChatPlan | None:
    """A plain completion's constraint (llama-server's ``grammar`` / ``json_schema`` on /completion, or
    ``response_format``): a plan whose reply is all content, None when nothing constrains it."""
    plan = ChatPlan(ids, "", family_for(None), None, None, False)
    plan.grammar = _grammar(body, tokenizer, plan, [], "none", False)
    return plan if plan.grammar is not None else None


# -- the request's fields -------------------------------------------------------------------------
def _tools(raw) -> list[Tool]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad_request("tools", f"'tools' must be an array of at most {MAX_TOOLS} function tools")
    out, names = [], set()
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(where, f"'{where}' must be {{'type': 'function', 'function': {{'name': ..., "
                                     "'parameters': {...}}}} (only function tools are supported)")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-." for c in name):
            raise bad_request(f"{where}.function.name", f"'{where}.function.name' must be 1-64 letters, digits, "
                                                        f"'_', '-' or '.', got {shown(name)}")
        if name in names:
            raise bad_request(f"{where}.function.name", f"the tool name {shown(name)} appears twice in 'tools'")
        names.add(name)
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters", f"'{where}.function.parameters' must be a JSON schema "
                                                              "object")
        desc = f.get("description") or ""
        if not isinstance(desc, str):
            raise bad_request(f"{where}.function.description", f"'{where}.function.description' must be a string")
        out.append(Tool(name, params, desc))
    return out


def _tool_choice(raw, tools: list[Tool]):
    if raw is None:
        return "auto"
    if isinstance(raw, str):
        if raw not in TOOL_CHOICES:
            raise bad_request("tool_choice", f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
                                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {shown(raw)}")
        if raw == "required" and not tools:
            raise bad_request("tool_choice", "'tool_choice' is 'required' but the request offers no 'tools'")
        return raw
    name = raw.get("function", {}).get("name") if isinstance(raw, dict) and isinstance(raw.get("function"), dict) \
        else None
    if not isinstance(name, str):
        raise bad_request("tool_choice", "'tool_choice' must be a string or {'type': 'function', 'function': "
                                         "{'name': ...}}")
    if name not in {t.name for t in tools}:
        raise bad_request("tool_choice", f"'tool_choice' names the function {shown(name)}, which is not in 'tools'")
    return name


def _template_kwargs(body: dict) -> dict:
    kw = body.get("chat_template_kwargs")
    out = {}
    if kw is not None:
        if not isinstance(kw, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kw):
            raise bad_request("chat_template_kwargs", "'chat_template_kwargs' must be an object of template variables")
        reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"} & kw.keys()
        if reserved:
            raise bad_request("chat_template_kwargs", f"'chat_template_kwargs' may not set {sorted(reserved)[0]!r}")
        out.update(kw)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("none", "minimal", "low", "medium", "high"):
            raise bad_request("reasoning_effort", "'reasoning_effort' must be one of none, minimal, low, medium, high")
        out.setdefault("reasoning_effort", effort)
        if effort == "none":
            out.setdefault("enable_thinking", False)  # the Qwen3 / GLM / DeepSeek templates' switch
    return out


def _openai_tool(t: Tool) -> dict:
    return {"type": "function", "function": {"name": t.name, "description": t.description,
                                             "parameters": t.parameters}}


# -- the conversation as the template reads it ----------------------------------------------------
def _for_template(messages: list[dict], fam: Family, template: str | None, tools: list[Tool]) -> list[dict]:
    """OpenAI messages -> what templates read: tool-call arguments as objects, reasoning under both
    names templates use (reasoning_content, thinking); tool calls and results spelled out in the
    family's own markup where the template cannot render them; the tools described in the system
    message where the template does not describe them."""
    t = template or ""
    renders_calls = fam.native and "tool_calls" in t
    renders_results = fam.native and ("'tool'" in t or '"tool"' in t)
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            if renders_calls:
                m["tool_calls"] = [{"id": c["id"], "type": "function",
                                    "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
            else:
                text = fam.render_calls([(c["name"], c["arguments"]) for c in calls])
                m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + text
        if m["role"] == "tool" and not renders_results:
            body = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_results"):
                out[-1]["content"] += "\n" + body
                continue
            m = {"role": "user", "content": body, "_results": True}
        reasoning = m.pop("reasoning", None)
        if reasoning:
            m["reasoning_content"] = reasoning
            m["thinking"] = reasoning
        out.append(m)
    for m in out:
        m.pop("_results", None)
    prompt = fam.tools_prompt(tools) if tools else None
    if prompt:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _shown(tokenizer, fam: Family, think) -> frozenset[int]:
    texts = set(fam.markers) | (set(think) if think else set())
    ids = set()
    for t in texts:
        i = tokenizer.token_id(t)
        if i is not None and not tokenizer.token_bytes(i):
            ids.add(i)
    return frozenset(ids)


# -- the grammar ------------------------------------------------------------------------------------
def _grammar(body: dict, tokenizer, plan: ChatPlan, tools: list[Tool], choice, parallel: bool):
    fmt = body.get("response_format")
    gbnf = body.get("grammar")
    schema_field = body.get("json_schema")
    wants = [n for n, v in (("response_format", fmt if not (isinstance(fmt, dict) and fmt.get("type") == "text")
                            else None), ("grammar", gbnf), ("json_schema", schema_field)) if v is not None]
    forced = choice == "required" or (choice not in TOOL_CHOICES)
    if forced and wants:
        raise bad_request(wants[0], f"'{wants[0]}' cannot be combined with tool_choice {shown(choice)}: both constrain "
                                    "the reply")
    if len(wants) > 1:
        raise bad_request(wants[1], f"give one of 'response_format', 'grammar' and 'json_schema', not "
                                    f"{' and '.join(repr(w) for w in wants)}")
    if not forced and not wants:
        return None
    try:
        from ..grammar import Grammar, GrammarError
        from ..grammar.constraint import json_term
    except ImportError:  # pragma: no cover - llguidance is in the server extra
        raise APIError(400, "constrained decoding needs llguidance: pip install 'clutor[server]'",
                       param=(wants or ["tool_choice"])[0]) from None
    lit = lambda s: _lit(tokenizer, s)  # noqa: E731
    try:
        if forced:
            chosen = tools if choice == "required" else [t for t in tools if t.name == choice]
            rules = plan.family.call_grammar(chosen, parallel and choice == "required", lit)
            return Grammar.lark(tokenizer, _with_reasoning(plan, "calls", lit, calls=True) + "\n" + rules,
                                what="tool_choice")
        name = wants[0]
        if name == "grammar":
            if not isinstance(gbnf, str) or not gbnf.strip():
                raise bad_request("grammar", "'grammar' must be a GBNF grammar (a non-empty string)")
            return Grammar.gbnf(tokenizer, gbnf, what="grammar")
        if name == "json_schema":
            schema, strict = schema_field, True
            if not isinstance(schema, dict):
                raise bad_request("json_schema", "'json_schema' must be a JSON schema object")
        else:
            schema, strict = _response_format(fmt)
        term = json_term(schema, strict=strict)
        return Grammar.lark(tokenizer, _with_reasoning(plan, "answer", lit) + f"\nanswer: {term}", what=name)
    except GrammarError as e:
        param = (wants or ["tools"])[0]
        raise bad_request(param, f"'{param}' cannot be used: {e}") from None


def _response_format(fmt) -> tuple[dict, bool]:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("response_format", "'response_format' must be {'type': 'text'}, {'type': 'json_object'} "
                                             "or {'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
    if fmt["type"] == "json_object":
        return {"type": "object"}, True
    js = fmt.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
        raise bad_request("response_format.json_schema", "'response_format.json_schema' must be an object with "
                                                         "'name' and 'schema' (a JSON schema object)")
    strict = js.get("strict", False)
    if not isinstance(strict, bool) and strict is not None:
        raise bad_request("response_format.json_schema.strict", "'strict' must be a boolean")
    return js.get("schema") or {"type": "object"}, bool(strict)


def _lit(tokenizer, text: str) -> str:
    from ..grammar.constraint import lark_literal

    return lark_literal(tokenizer, text)


def _with_reasoning(plan: ChatPlan, rule: str, lit, calls: bool = False) -> str:
    """The start rule: the constrained part, after any reasoning the model may write first."""
    if plan.family is HARMONY:
        if calls:
            return f"start: {rule}"  # the family's call rule lets an analysis message come first
        return ("start: thought? " + lit("<|channel|>") + ' "final" ' + lit("<|message|>") + f" {rule}\n"
                f"thought: {lit('<|channel|>')} \"analysis\" {lit('<|message|>')} ANALYSIS {lit('<|end|>')} "
                f"{lit('<|start|>')} \"assistant\"\nANALYSIS: {text_until('<|end|>')}")
    if plan.think is None or plan.closed_reasoning:
        return f"start: {rule}"
    open_tag, close = plan.think
    ws = r'/[ \t\r\n]*/'
    if plan.open_reasoning:
        return f"start: REASON {lit(close)} {ws} {rule}\nREASON: {text_until(close)}"
    return f"start: ({lit(open_tag)} REASON {lit(close)} {ws})? {rule}\nREASON: {text_until(close)}"


def chat_messages(raw) -> list[dict]:
    """The request's messages in a checked, canonical shape: role, content (text), and for assistants
    tool_calls [{id, name, arguments (an object)}] and reasoning; for tools tool_call_id."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages", "'messages' must be a non-empty array of {role, content} objects")
    return [_message(m, i) for i, m in enumerate(raw)]


def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text") \
                    and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise bad_request(f"{where}[{j}]", f"'{where}[{j}]' must be a text part {{'type': 'text', 'text': "
                                                   "...}} (this server reads text only)")
        return "".join(texts)
    raise bad_request(where, f"'{where}' must be a string or an array of text parts")


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(where, f"'{where}' must be an object with 'role' and 'content'")
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise bad_request(f"{where}.role", f"'{where}.role' must be 'system', 'developer', 'user', 'assistant' or "
                                           f"'tool', got {shown(role)}")
    out = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
    if role == "assistant":
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise bad_request(f"{where}.tool_calls", f"'{where}.tool_calls' must be an array")
            out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        r = m.get("reasoning_content", m.get("reasoning"))
        if isinstance(r, str) and r:
            out["reasoning"] = r
    elif role == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise bad_request(f"{where}.tool_call_id", f"'{where}.tool_call_id' must name the call it answers")
        out["tool_call_id"] = tid
    return out


def _call(c, where: str) -> dict:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise bad_request(where, f"'{where}' must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                                 "'arguments': '...'}}}}")
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        args = loads(args, f"{where}.function.arguments", f"'{where}.function.arguments'") if args.strip() else {}
    if not isinstance(args, dict):
        raise bad_request(f"{where}.function.arguments", f"'{where}.function.arguments' must be a JSON object")
    cid = c.get("id")
    return {"id": cid if isinstance(cid, str) and cid else "call_0", "name": f["name"], "arguments": args}
