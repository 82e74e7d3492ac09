"""Anthropic's Messages API (``POST /v1/messages``), read into a chat request and answered in its shapes.

Requests: ``system`` (a string or text blocks), ``messages`` whose content is a string or blocks
(text, tool_use, tool_result, thinking), ``tools`` with ``input_schema``, ``tool_choice`` (auto, any,
tool, none; ``disable_parallel_tool_use``), ``max_tokens`` (required, as Anthropic's), ``stop_sequences``,
``temperature``/``top_p``/``top_k``, ``thinking`` ({"type": "disabled"} turns a template's thinking
off). Replies: content blocks (thinking, text, tool_use), ``stop_reason`` end_turn / max_tokens /
stop_sequence / tool_use, and when streamed the event sequence message_start, content_block_start /
_delta / _stop per block, message_delta, message_stop. Errors: ``{"type": "error", "error": {...}}``.
"""
from __future__ import annotations

import json

from ..formats import Delta, Message
from ..formats.base import loads_or
from .blocks import Blocks, Fill, Start, Stop
from .errors import ANTHROPIC, bad_request
from .labels import shown
from .requests import SPECULATIVE

__all__ = ["parse_messages", "MessagesShaper", "anthropic_error"]

def anthropic_error(e) -> dict:
    return e.body(ANTHROPIC)


def parse_messages(body: dict, tokenizer, n_ctx: int, d, recurrent: bool = False):
    from .requests import parse_chat

    req = parse_chat(to_chat(body), tokenizer, n_ctx, d, recurrent)
    req.include_usage = False
    return req


def to_chat(body: dict) -> dict:
    """An Anthropic request as the equivalent OpenAI chat request."""
    if body.get("max_tokens") is None:
        raise bad_request("max_tokens", "'max_tokens' is required")
    out: dict = {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream",
                                      *SPECULATIVE) if k in body}
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    msgs: list[dict] = []
    system = body.get("system")
    if system is not None:
        msgs.append({"role": "system", "content": _text_blocks(system, "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages", "'messages' must be a non-empty array of {role, content} objects")
    for i, m in enumerate(raw):
        msgs.extend(_message(m, f"messages.{i}"))
    out["messages"] = msgs
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools", "'tools' must be an array")
        out["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise bad_request(f"tools.{i}", f"'tools.{i}' must be {{'name': ..., 'input_schema': {{...}}}}")
            out["tools"].append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description") or "",
                "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}})
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise bad_request("tool_choice", "'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'}")
        kind = choice["type"]
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
            {"type": "function", "function": {"name": choice.get("name")}}
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        out["chat_template_kwargs"] = {"enable_thinking": False}
    return out


def _text_blocks(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, b in enumerate(content):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise bad_request(f"{where}.{j}", f"'{where}.{j}' must be a text block")
            parts.append(b["text"])
        return "".join(parts)
    raise bad_request(where, f"'{where}' must be a string or an array of text blocks")


def _message(m, where: str) -> list[dict]:
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad_request(f"{where}.role", f"'{where}.role' must be 'user' or 'assistant'")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content", f"'{where}.content' must be a string or an array of content blocks")
    texts, calls, results, thinking = [], [], [], []
    for j, b in enumerate(content):
        w = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "thinking" and role == "assistant":
            thinking.append(str(b.get("thinking") or ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("id"), str):
                raise bad_request(w, f"'{w}' must have 'id', 'name' and 'input'")
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad_request(w, f"'{w}' must name the 'tool_use_id' it answers")
            c = b.get("content", "")
            text = c if isinstance(c, str) else _text_blocks(c, f"{w}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        else:
            raise bad_request(w, f"'{w}' is a {shown(kind)} block, which this server does not read in a {role} message "
                                 "(it reads text, tool_use, tool_result and thinking)")
    if role == "user":
        return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])
    msg = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return [msg]


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(stats, message: Message | None) -> str:
    if stats.stop_reason == "length":
        return "max_tokens"
    if message is not None and message.tool_calls:
        return "tool_use"
    return "stop_sequence" if stats.stop_reason == "stop" else "end_turn"


class MessagesShaper:
    done = None

    def __init__(self, req, rid: str, created: int, model: str, tokenizer):
        self.rid = rid
        self.model = model
        self.n_prompt = len(req.ids)
        self.blocks = Blocks()

    error = staticmethod(anthropic_error)

    def stream_error(self, e) -> tuple[str, dict]:
        return "error", anthropic_error(e)

    def _usage(self, stats) -> dict:
        return {"input_tokens": stats.prompt_tokens, "output_tokens": stats.generated_tokens,
                "cache_read_input_tokens": stats.cached_tokens, "cache_creation_input_tokens": 0}

    def whole(self, message: Message, chunks, stats) -> dict:
        content = []
        if message.reasoning:
            content.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
        if message.content or not (message.reasoning or message.tool_calls):
            content.append({"type": "text", "text": message.content})
        for c in message.tool_calls:
            content.append({"type": "tool_use", "id": _tool_id(c.id), "name": c.name,
                            "input": loads_or(c.arguments, {})})
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason(stats, message), "stop_sequence": None, "usage": self._usage(stats)}

    def open(self) -> list:
        msg = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": msg})]

    def _events(self, items) -> list:
        out = []
        for it in items:
            if isinstance(it, Start):
                if it.kind == "reasoning":
                    block = {"type": "thinking", "thinking": "", "signature": ""}
                elif it.kind == "text":
                    block = {"type": "text", "text": ""}
                else:
                    block = {"type": "tool_use", "id": _tool_id(it.call.id), "name": it.call.name, "input": {}}
                out.append(("content_block_start", {"type": "content_block_start", "index": it.index,
                                                    "content_block": block}))
            elif isinstance(it, Fill):
                delta = {"reasoning": {"type": "thinking_delta", "thinking": it.text},
                         "text": {"type": "text_delta", "text": it.text},
                         "call": {"type": "input_json_delta", "partial_json": it.text}}[it.kind]
                out.append(("content_block_delta", {"type": "content_block_delta", "index": it.index,
                                                    "delta": delta}))
            elif isinstance(it, Stop):
                if it.kind == "reasoning":  # Anthropic closes a thinking block with its signature
                    out.append(("content_block_delta", {"type": "content_block_delta", "index": it.index,
                                                        "delta": {"type": "signature_delta", "signature": ""}}))
                out.append(("content_block_stop", {"type": "content_block_stop", "index": it.index}))
        return out

    def delta(self, d: Delta, chunks) -> list:
        return self._events(self.blocks.feed(d))

    def close(self, message: Message | None, stats) -> list:
        out = self._events(self.blocks.finish())
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": stop_reason(stats, message), "stop_sequence": None},
                                      "usage": {"output_tokens": stats.generated_tokens}}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out
