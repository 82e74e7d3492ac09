"""OpenAI's Responses API (``POST /v1/responses``), stateless: read into a chat request, answered in its shapes.

Requests: ``input`` (a string, or items: messages with input_text / output_text parts,
function_call, function_call_output, reasoning), ``instructions``, ``tools`` (function tools, flat:
name, description, parameters), ``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens``,
``text.format`` (text / json_object / json_schema), ``reasoning.effort``, sampling fields. Nothing is
stored: ``previous_response_id`` and ``store: true`` on a retrieval are refused, the client sends the
whole conversation (as the client libraries' stateless mode does).
Replies: output items (reasoning, message with output_text, function_call); streamed, the event
sequence response.created / in_progress, output_item.added, content_part.added, output_text.delta
... done, function_call_arguments.delta / done, reasoning_text.delta / done, response.completed.
"""
from __future__ import annotations

import json

from ..formats import Delta, Message
from .blocks import Blocks, Fill, Start, Stop
from .errors import bad_request
from .labels import shown
from .requests import SPECULATIVE

__all__ = ["parse_responses", "ResponsesShaper"]


def parse_responses(body: dict, tokenizer, n_ctx: int, d, recurrent: bool = False):
    from .requests import parse_chat

    req = parse_chat(to_chat(body), tokenizer, n_ctx, d, recurrent)
    req.include_usage = False
    req.extra = {k: body.get(k) for k in ("instructions", "metadata", "temperature", "top_p", "text", "reasoning",
                                          "max_output_tokens", "tool_choice", "parallel_tool_calls", "tools", "user")}
    return req


def to_chat(body: dict) -> dict:
    """A Responses request as the equivalent chat request."""
    if body.get("previous_response_id") is not None:
        raise bad_request("previous_response_id", "this server stores no responses: send the whole conversation "
                                                  "in 'input' instead of 'previous_response_id'")
    if body.get("conversation") is not None:
        raise bad_request("conversation", "this server stores no conversations: send them in 'input'")
    out: dict = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user",
                                      "top_logprobs", "seed", *SPECULATIVE) if k in body}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    msgs: list[dict] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad_request("instructions", "'instructions' must be a string")
        msgs.append({"role": "system", "content": body["instructions"]})
    msgs.extend(_input(body.get("input")))
    out["messages"] = msgs
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list):
            raise bad_request("tools", "'tools' must be an array")
        out["tools"] = []
        for i, t in enumerate(body["tools"]):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise bad_request(f"tools[{i}]", f"'tools[{i}]' must be a function tool {{'type': 'function', 'name': "
                                                 "..., 'parameters': {...}} (this server runs no built-in tools)")
            out["tools"].append({"type": "function", "function": {
                "name": t.get("name"), "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object", "properties": {}}}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        out["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "schema"), "schema": fmt.get("schema"), "strict": fmt.get("strict", False)}}
    elif fmt is not None:
        out["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        out["reasoning_effort"] = reasoning["effort"]
    return out


def _parts(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(p.get("text"), str):
                raise bad_request(f"{where}[{j}]", f"'{where}[{j}]' must be a text part (input_text / output_text); "
                                                   "this server reads text only")
            out.append(p["text"])
        return "".join(out)
    raise bad_request(where, f"'{where}' must be a string or an array of text parts")


def _input(raw) -> list[dict]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input", "'input' must be a string or a non-empty array of input items")
    msgs: list[dict] = []
    reasoning = None
    for i, it in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad_request(where, f"'{where}' must be an object")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role", f"'{where}.role' must be user, assistant, system or developer")
            m = {"role": role, "content": _parts(it.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning:
                m["reasoning_content"], reasoning = reasoning, None
            msgs.append(m)
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("call_id"), str):
                raise bad_request(where, f"'{where}' must have 'call_id', 'name' and 'arguments'")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it.get("arguments") or "{}"}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":  # calls of the same turn
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning:
                    msgs[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            out = it.get("output")
            if not isinstance(it.get("call_id"), str):
                raise bad_request(where, f"'{where}' must name the 'call_id' it answers")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                         "content": out if isinstance(out, str) else json.dumps(out)})
        elif kind == "reasoning":
            texts = [p.get("text", "") for p in (it.get("content") or it.get("summary") or []) if isinstance(p, dict)]
            reasoning = "".join(texts) or None
        else:
            raise bad_request(f"{where}.type", f"'{where}.type' {shown(kind)} is not an input item this server reads "
                                               "(message, function_call, function_call_output, reasoning)")
    return msgs


def _ids(rid: str, kind: str, index: int) -> str:
    return {"reasoning": "rs_", "text": "msg_", "call": "fc_"}[kind] + rid.removeprefix("resp_") + f"_{index}"


class ResponsesShaper:
    done = None

    def __init__(self, req, rid: str, created: int, model: str, tokenizer):
        self.req = req
        self.rid = rid
        self.created = created
        self.model = model
        self.blocks = Blocks()
        self.seq = 0
        self.items: dict[int, dict] = {}     # output index -> the item as built so far
        self.texts: dict[int, str] = {}

    @staticmethod
    def error(e) -> dict:
        return e.body()

    def stream_error(self, e) -> tuple[str, dict]:
        b = e.body()["error"]
        return self._ev("error", {"code": b["code"], "message": b["message"], "param": b["param"]})

    def _response(self, status: str, output: list, stats=None) -> dict:
        x = getattr(self.req, "extra", {}) or {}
        r = {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
             "model": self.model, "output": output, "error": None, "incomplete_details": None,
             "instructions": x.get("instructions"), "metadata": x.get("metadata") or {},
             "parallel_tool_calls": x.get("parallel_tool_calls") is not False,
             "tool_choice": x.get("tool_choice") or "auto", "tools": x.get("tools") or [],
             "temperature": x.get("temperature"), "top_p": x.get("top_p"),
             "max_output_tokens": x.get("max_output_tokens"), "text": x.get("text") or {"format": {"type": "text"}},
             "reasoning": x.get("reasoning"), "store": False, "background": False, "usage": None}
        if stats is not None:
            r["usage"] = {"input_tokens": stats.prompt_tokens, "output_tokens": stats.generated_tokens,
                          "total_tokens": stats.prompt_tokens + stats.generated_tokens,
                          "input_tokens_details": {"cached_tokens": stats.cached_tokens},
                          "output_tokens_details": {"reasoning_tokens": 0}}
            if stats.stop_reason == "length":
                r["status"] = "incomplete"
                r["incomplete_details"] = {"reason": "max_output_tokens"}
        return r

    @staticmethod
    def _item(kind: str, iid: str, text: str = "", call=None, status: str = "completed") -> dict:
        if kind == "reasoning":
            return {"type": "reasoning", "id": iid, "summary": [],
                    "content": [{"type": "reasoning_text", "text": text}], "status": status}
        if kind == "text":
            return {"type": "message", "id": iid, "status": status, "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}
        return {"type": "function_call", "id": iid, "call_id": call[0], "name": call[1], "arguments": text,
                "status": status}

    def whole(self, message: Message, chunks, stats) -> dict:
        out, k = [], 0
        if message.reasoning:
            out.append(self._item("reasoning", _ids(self.rid, "reasoning", k), message.reasoning))
            k += 1
        if message.content or not message.tool_calls:
            out.append(self._item("text", _ids(self.rid, "text", k), message.content))
            k += 1
        for c in message.tool_calls:
            out.append(self._item("call", _ids(self.rid, "call", k), c.arguments, (c.id, c.name)))
            k += 1
        r = self._response("completed", out, stats)
        r["output_text"] = message.content
        return r

    def _ev(self, name: str, body: dict) -> tuple[str, dict]:
        body = {"type": name, **body, "sequence_number": self.seq}
        self.seq += 1
        return name, body

    def open(self) -> list:
        r = self._response("in_progress", [])
        return [self._ev("response.created", {"response": r}), self._ev("response.in_progress", {"response": r})]

    def _events(self, items) -> list:
        out = []
        for it in items:
            k = it.index
            if isinstance(it, Start):
                iid = _ids(self.rid, it.kind, k)
                call = (it.call.id, it.call.name) if it.call else None
                self.items[k] = self._item(it.kind, iid, "", call, status="in_progress")
                self.texts[k] = ""
                out.append(self._ev("response.output_item.added", {"output_index": k, "item": self.items[k]}))
                if it.kind == "text":
                    out.append(self._ev("response.content_part.added", {
                        "item_id": iid, "output_index": k, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}}))
            elif isinstance(it, Fill):
                iid = self.items[k]["id"]
                self.texts[k] += it.text
                if it.kind == "text":
                    out.append(self._ev("response.output_text.delta", {
                        "item_id": iid, "output_index": k, "content_index": 0, "delta": it.text, "logprobs": []}))
                elif it.kind == "reasoning":
                    out.append(self._ev("response.reasoning_text.delta", {
                        "item_id": iid, "output_index": k, "content_index": 0, "delta": it.text}))
                else:
                    out.append(self._ev("response.function_call_arguments.delta", {
                        "item_id": iid, "output_index": k, "delta": it.text}))
            elif isinstance(it, Stop):
                item = self.items[k]
                iid, text = item["id"], self.texts[k]
                if it.kind == "text":
                    out.append(self._ev("response.output_text.done", {
                        "item_id": iid, "output_index": k, "content_index": 0, "text": text, "logprobs": []}))
                    part = {"type": "output_text", "text": text, "annotations": []}
                    out.append(self._ev("response.content_part.done", {
                        "item_id": iid, "output_index": k, "content_index": 0, "part": part}))
                elif it.kind == "reasoning":
                    out.append(self._ev("response.reasoning_text.done", {
                        "item_id": iid, "output_index": k, "content_index": 0, "text": text}))
                else:
                    out.append(self._ev("response.function_call_arguments.done", {
                        "item_id": iid, "output_index": k, "arguments": text, "name": item["name"]}))
                done = self._item(it.kind, iid, text, (item.get("call_id"), item.get("name")))
                self.items[k] = done
                out.append(self._ev("response.output_item.done", {"output_index": k, "item": done}))
        return out

    def delta(self, d: Delta, chunks) -> list:
        return self._events(self.blocks.feed(d))

    def close(self, message: Message | None, stats) -> list:
        out = self._events(self.blocks.finish())
        r = self._response("completed", [self.items[k] for k in sorted(self.items)], stats)
        r["output_text"] = message.content if message is not None else ""
        name = "response.completed" if r["status"] == "completed" else "response.incomplete"
        out.append(self._ev(name, {"response": r}))
        return out

