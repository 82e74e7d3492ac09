"""OpenAI response bodies: whole completions, stream chunks, usage, logprobs, tool calls and reasoning.

Every API's shaper (this one; Anthropic's Messages in messages_api.py, OpenAI's Responses in
responses_api.py) answers the same calls, so one generation loop (app._Generation) serves them all:

    whole(message, chunks, stats) -> the JSON body of a non-streamed reply
    open() / delta(delta, chunks) / close(message, stats) -> stream events [(event name or None, body)]
    error(e) -> the body of an error in this API's shape; done: the bytes that end the stream, if any

``message`` and ``delta`` are the reply as its chat format's parser read it (clutor.formats): content,
reasoning and tool calls apart. A completion (no chat format) is all content. Every body goes out
through ``json_bytes`` (``JSON`` for whole responses).
"""
from __future__ import annotations

import json

from starlette.responses import JSONResponse

from ..formats import Delta, Message
from ..model.generate import GenerationChunk, GenerationStats

__all__ = ["Shaper", "timings", "usage", "JSON", "json_bytes"]


def json_bytes(obj) -> bytes:
    """UTF-8 JSON, the one encoding of every body the server sends; a lone surrogate in a string (JSON
    allows "\\ud800") comes out as its escape, not an encoding error."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


class JSON(JSONResponse):
    """A JSON response: ``JSON(body, status, headers)``."""

    def __init__(self, content, status_code: int = 200, headers: dict[str, str] | None = None):
        super().__init__(content, status_code=status_code, headers=headers)

    def render(self, content) -> bytes:
        return json_bytes(content)


def finish_reason(stats: GenerationStats, message: Message | None = None) -> str:
    if stats.stop_reason == "length":
        return "length"  # as OpenAI: also when a tool call was cut off
    return "tool_calls" if message is not None and message.tool_calls else "stop"


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": getattr(stats, "cached_tokens", 0)}}


def timings(stats: GenerationStats, grammar=None) -> dict:
    """llama-server's per-reply ``timings`` (what its web UI shows), plus the expert store's side."""
    out = {"prompt_n": stats.prompt_tokens - stats.cached_tokens, "cache_n": stats.cached_tokens,
           "prompt_ms": 1000 * stats.prefill_seconds, "prompt_per_second": stats.prefill_tps,
           "predicted_n": stats.generated_tokens, "predicted_ms": 1000 * stats.decode_seconds,
           "predicted_per_second": stats.decode_tps}
    if getattr(stats, "drafted_tokens", 0):  # llama-server's names; absent when nothing was drafted, as there
        out["draft_n"] = stats.drafted_tokens
        out["draft_n_accepted"] = stats.accepted_tokens
    io = stats.io
    if io is not None:
        out["experts"] = {"hit_rate": io.hit_rate, "bytes_read": io.bytes_read, "accesses": io.accesses,
                          "misses": io.misses, "wait_ms": 1000 * io.wait_seconds, "cache_bytes": io.cache_bytes}
    if grammar is not None:  # clutor.grammar.MaskStats
        out["grammar"] = {"masks": grammar.masks, "mask_us": grammar.us_per_mask,
                          "apply_ms": 1000 * grammar.apply_seconds}
    return out


class Shaper:
    """Builds the bodies of one OpenAI request (chat or completion)."""

    done = b"data: [DONE]\n\n"

    def __init__(self, kind: str, rid: str, created: int, model: str, tokenizer, include_usage: bool):
        self.kind = kind
        self.rid = rid
        self.created = created
        self.model = model
        self.tok = tokenizer
        self.include_usage = include_usage
        self._offset = 0  # completions' text_offset: characters of completion text so far
        self.grammar = None  # the reply's MaskStats, set by the generation before whole() / close()
        self._content_frame: tuple[bytes, bytes] | None = None  # content_event's bytes around the text

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    @staticmethod
    def error(e) -> dict:
        return e.body()

    def stream_error(self, e) -> tuple[None, dict]:
        return None, {"error": e.body()["error"]}

    # -- logprobs -----------------------------------------------------------------------------------
    def _token(self, token: int) -> tuple[str, list[int]]:
        b = self.tok.token_bytes(token, special=True)
        return b.decode("utf-8", errors="replace"), list(b)

    def logprobs(self, chunks: list[GenerationChunk]) -> dict | None:
        """The logprobs object for these chunks (None when the request did not ask for logprobs)."""
        chunks = [c for c in chunks if c.token is not None and c.logprob is not None]
        if not chunks:
            return None
        if self.kind == "chat":
            content = []
            for c in chunks:
                s, b = self._token(c.token)
                top = []
                for i, lp in c.top_logprobs or ():
                    ts, tb = self._token(i)
                    top.append({"token": ts, "logprob": lp, "bytes": tb})
                content.append({"token": s, "logprob": c.logprob, "bytes": b, "top_logprobs": top})
            return {"content": content, "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in chunks:
            s, _ = self._token(c.token)
            out["tokens"].append(s)
            out["token_logprobs"].append(c.logprob)
            out["top_logprobs"].append({self._token(i)[0]: lp for i, lp in c.top_logprobs or ()})
            out["text_offset"].append(self._offset)
            self._offset += len(s)
        return out

    # -- whole response -----------------------------------------------------------------------------
    def whole(self, message: Message, chunks: list[GenerationChunk], stats: GenerationStats) -> dict:
        lp = self.logprobs(chunks)
        if self.kind == "chat":
            msg = {"role": "assistant", "content": message.content, "refusal": None}
            if message.reasoning:
                msg["reasoning_content"] = message.reasoning
            if message.tool_calls:
                msg["content"] = message.content or None  # as OpenAI: null beside tool calls when empty
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in message.tool_calls]
            choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish_reason(stats, message)}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": message.content, "logprobs": lp, "finish_reason": finish_reason(stats)}
            body = self._head("text_completion")
        body["choices"] = [choice]
        body["usage"] = usage(stats)
        body["timings"] = timings(stats, self.grammar)
        return body

    # -- stream chunks ------------------------------------------------------------------------------
    def _chunk(self, choice: dict | None) -> dict:
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = [choice] if choice is not None else []
        if self.include_usage:
            body["usage"] = None  # as OpenAI: null on every chunk but the last
        return body

    def open(self) -> list[tuple[str | None, dict]]:
        """Chat streams open with the assistant's role."""
        if self.kind != "chat":
            return []
        return [(None, self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}))]

    def delta(self, d: Delta, chunks: list[GenerationChunk]) -> list[tuple[str | None, dict]]:
        lp = self.logprobs(chunks)
        if self.kind != "chat":
            if not d.content and lp is None:
                return []
            return [(None, self._chunk({"index": 0, "text": d.content, "logprobs": lp, "finish_reason": None}))]
        out = []
        if d.reasoning:
            out.append({"reasoning_content": d.reasoning})
        if d.content or (lp is not None and not d.reasoning and not d.calls):
            out.append({"content": d.content})
        for c in d.calls:
            if c.name is not None:  # OpenAI's first delta of a call: id, type, name, arguments so far
                call = {"index": c.index, "id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}}
            else:
                call = {"index": c.index, "function": {"arguments": c.arguments}}
            out.append({"tool_calls": [call]})
        events = []
        for k, delta in enumerate(out):
            events.append((None, self._chunk({"index": 0, "delta": delta, "logprobs": lp if k == 0 else None,
                                              "finish_reason": None})))
        return events

    def content_event(self, text: str) -> bytes:
        """The server-sent event of a delta that is only content and carries no logprobs, as bytes:
        exactly what ``delta(Delta(content=text), [])`` framed as ``data: JSON\n\n`` is. The chunk's
        constant parts (id, model, the choice's other fields) are rendered once per stream; each token
        then costs one string's JSON escape instead of a dict of dicts encoded."""
        if self._content_frame is None:
            mark = "\ue000clutor-content\ue001"
            body = json_bytes(self.delta(Delta(content=mark), [])[0][1])
            pre, sep, post = body.partition(json_bytes(mark))
            if not sep or sep in post:  # (cannot happen: the ids and names are escaped JSON)
                raise AssertionError("content_event: the placeholder was not found once")
            self._content_frame = (b"data: " + pre, post + b"\n\n")
        pre, post = self._content_frame
        return b"".join((pre, json_bytes(text), post))

    def close(self, message: Message | None, stats: GenerationStats) -> list[tuple[str | None, dict]]:
        """The chunk carrying finish_reason (and the reply's timings), then (when asked) the usage chunk."""
        if self.kind == "chat":
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason(stats, message)}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason(stats)}
        last = self._chunk(choice)
        last["timings"] = timings(stats, self.grammar)
        out = [(None, last)]
        if self.include_usage:
            u = self._chunk(None)
            u["usage"] = usage(stats)
            out.append((None, u))
        return out
