"""OpenAI response bodies: whole completions, stream chunks, usage and logprobs, built from GenerationChunks;
and the one JSON encoding every body of the server goes through."""
from __future__ import annotations

import json

from starlette.responses import JSONResponse

from ..model.generate import GenerationChunk, GenerationStats

__all__ = ["Shaper", "JSON", "json_bytes"]


def json_bytes(obj) -> bytes:
    """UTF-8 JSON; a lone surrogate in a string (JSON allows "\\ud800") comes out as its escape, not an
    encoding error."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


class JSON(JSONResponse):
    """A JSON response: ``JSON(body, status, headers)``."""

    def __init__(self, content, status_code: int = 200, headers: dict[str, str] | None = None):
        super().__init__(content, status_code=status_code, headers=headers)

    def render(self, content) -> bytes:
        return json_bytes(content)


def finish_reason(stats: GenerationStats) -> str:
    return "length" if stats.stop_reason == "length" else "stop"


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": getattr(stats, "cached_tokens", 0)}}


class Shaper:
    """Builds the bodies of one request (chat or completion) in OpenAI's shapes."""

    def __init__(self, kind: str, rid: str, created: int, model: str, tokenizer, include_usage: bool):
        self.kind = kind
        self.rid = rid
        self.created = created
        self.model = model
        self.tok = tokenizer
        self.include_usage = include_usage
        self._offset = 0  # completions' text_offset: characters of completion text so far

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

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
    def whole(self, text: str, chunks: list[GenerationChunk], stats: GenerationStats) -> dict:
        lp = self.logprobs(chunks)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": lp, "finish_reason": finish_reason(stats)}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason(stats)}
            body = self._head("text_completion")
        body["choices"] = [choice]
        body["usage"] = usage(stats)
        return body

    # -- stream chunks ------------------------------------------------------------------------------
    def _chunk(self, choice: dict | None) -> dict:
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = [choice] if choice is not None else []
        if self.include_usage:
            body["usage"] = None  # as OpenAI: null on every chunk but the last
        return body

    def first(self) -> dict | None:
        """Chat streams open with the assistant's role."""
        if self.kind != "chat":
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def delta(self, text: str, chunks: list[GenerationChunk]) -> dict:
        lp = self.logprobs(chunks)
        if self.kind == "chat":
            return self._chunk({"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": None})
        return self._chunk({"index": 0, "text": text, "logprobs": lp, "finish_reason": None})

    def last(self, stats: GenerationStats) -> list[dict]:
        """The chunk carrying finish_reason, then (when asked) the usage chunk with no choices."""
        if self.kind == "chat":
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason(stats)}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason(stats)}
        out = [self._chunk(choice)]
        if self.include_usage:
            u = self._chunk(None)
            u["usage"] = usage(stats)
            out.append(u)
        return out
