"""ollama's API, so that tools written for ollama work unchanged: ``/api/chat``, ``/api/generate`` (NDJSON
streams, streamed by default as ollama's), ``/api/embed`` and ``/api/embeddings``, ``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/version``.

A chat or generate request is read into the equivalent OpenAI chat request (``to_chat``) and runs as any
other: ``format`` ("json" or a JSON schema) is a response_format, ``tools`` and the messages' tool calls
(arguments as objects) and tool results (``tool_name``) map onto OpenAI's, ``options`` carries the sampling
fields (``num_predict``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``stop``, ``seed``,
``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``, ``frequency_penalty``; the others, such as
``num_ctx`` or ``num_gpu``, are accepted and have no effect here), ``think`` a template's enable_thinking,
``keep_alive`` is accepted (the model stays loaded while the server runs). /api/generate with ``raw``
feeds the prompt as it is; without it the prompt is the user's turn (``system`` before it), and
``context`` (the ids a previous reply returned) goes first. Errors are ollama's ``{"error": message}``;
a bad field is a 400 naming it as the client wrote it (``options.num_predict``).
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from ..formats.base import loads_or
from .errors import OLLAMA, APIError, bad_request
from .labels import shown
from .requests import SPECULATIVE
from .responses import json_bytes

__all__ = ["parse_ollama_chat", "parse_ollama_generate", "OllamaShaper", "ollama_routes"]

# options.X -> the chat request's field
_OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
            "min_p": "min_p", "stop": "stop", "seed": "seed", "repeat_penalty": "repeat_penalty",
            "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}
_FIELD_OF = {v: f"options.{k}" for k, v in _OPTIONS.items()} | {"response_format": "format"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _renamed(e: APIError) -> APIError:
    """A 400 from the chat reader, naming the field as the ollama client wrote it."""
    p = e.param
    if p in _FIELD_OF:
        e.message = e.message.replace(f"'{p}'", f"'{_FIELD_OF[p]}'")
        e.param = _FIELD_OF[p]
    return e


def _common(body: dict) -> dict:
    """The fields chat and generate share, as the chat request's."""
    out: dict = {k: body[k] for k in ("model", *SPECULATIVE) if k in body}
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise bad_request("stream", "'stream' must be a boolean")
    out["stream"] = stream
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise bad_request("options", "'options' must be an object")
    for k, v in opts.items():
        if k in _OPTIONS and v is not None:
            if k == "num_predict" and isinstance(v, int) and not isinstance(v, bool) and v < 0:
                continue  # -1 (and -2): to the end of the context
            out[_OPTIONS[k]] = [v] if k == "stop" and isinstance(v, str) else v
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt,
                                                                           "strict": True}}
    elif fmt not in (None, ""):
        raise bad_request("format", f"'format' must be \"json\" or a JSON schema object, got {shown(fmt)}")
    think = body.get("think")
    if isinstance(think, bool):
        out["chat_template_kwargs"] = {"enable_thinking": think}
    elif isinstance(think, str):
        out["chat_template_kwargs"] = {"reasoning_effort": think}
    elif think is not None:
        raise bad_request("think", "'think' must be a boolean or 'low' / 'medium' / 'high'")
    return out


def _images(m: dict, where: str) -> None:
    if m.get("images"):
        raise bad_request(f"{where}.images", f"'{where}.images': this server reads text only")


def to_chat(body: dict) -> dict:
    """An ollama /api/chat request as the equivalent OpenAI chat request."""
    out = _common(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages", "'messages' must be a non-empty array of {role, content} objects")
    msgs, ids_by_name, n_calls = [], {}, 0
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(where, f"'{where}' must be an object with 'role' and 'content'")
        _images(m, where)
        msg = {"role": m.get("role"), "content": m.get("content") or ""}
        if m.get("role") == "assistant":
            if m.get("thinking"):
                msg["reasoning_content"] = m["thinking"]
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise bad_request(f"{where}.tool_calls", f"'{where}.tool_calls' must be an array")
            oai = []
            for j, c in enumerate(calls):
                f = c.get("function") if isinstance(c, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                    raise bad_request(f"{where}.tool_calls[{j}]", f"'{where}.tool_calls[{j}]' must be "
                                      "{'function': {'name': ..., 'arguments': {...}}}")
                cid = c.get("id") if isinstance(c.get("id"), str) and c.get("id") else f"call_{n_calls}"
                n_calls += 1
                ids_by_name.setdefault(f["name"], []).append(cid)
                args = f.get("arguments", {})
                oai.append({"id": cid, "type": "function", "function": {
                    "name": f["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
            if oai:
                msg["tool_calls"] = oai
        elif m.get("role") == "tool":  # ollama names the tool; OpenAI the call: the oldest open call of that name
            name = m.get("tool_name") or m.get("name")
            open_ = ids_by_name.get(name) if isinstance(name, str) else None
            msg["tool_call_id"] = open_.pop(0) if open_ else (m.get("tool_call_id") or f"call_{name or i}")
        msgs.append(msg)
    out["messages"] = msgs
    if body.get("tools") is not None:
        out["tools"] = body["tools"]
    return out


def parse_ollama_chat(body: dict, tokenizer, n_ctx: int, d, recurrent: bool = False):
    from .requests import parse_chat

    try:
        req = parse_chat(to_chat(body), tokenizer, n_ctx, d, recurrent)
    except APIError as e:
        raise _renamed(e) from None
    req.extra = {"ollama": "chat"}
    return req


def parse_ollama_generate(body: dict, tokenizer, n_ctx: int, d, recurrent: bool = False):
    """/api/generate: the prompt as the user's turn (or as it is, with raw); an empty prompt only loads
    the model (ollama's way to warm it): answered at once, done_reason "load"."""
    from .requests import gen_request, parse_chat

    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise bad_request("prompt", "'prompt' must be a string")
    _images(body, "request")
    for name in ("template", "suffix"):
        if body.get(name):
            raise bad_request(name, f"'{name}' is not supported by this server (the file's chat template renders "
                                    "the prompt)")
    context = body.get("context") or []
    if not isinstance(context, list) or not all(isinstance(t, int) and 0 <= t < tokenizer.n_vocab for t in context):
        raise bad_request("context", f"'context' must be the token ids a previous reply returned, in [0, "
                                     f"{tokenizer.n_vocab})")
    if not prompt and not context:
        return {"model": body.get("model"), "created_at": _now(), "response": "", "done": True,
                "done_reason": "load"}
    chat = _common(body)
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise bad_request("raw", "'raw' must be a boolean")
    try:
        if raw:
            ids = tokenizer.encode(prompt, special=True) if prompt else []
            ids = context + ids
            if not ids:
                raise bad_request("prompt", "'prompt' is empty")
            req = gen_request(chat, "completion", ids, n_ctx, d, chat.get("max_tokens"), "max_tokens",
                              default_max=None, logprobs=None)
            from .chat_plan import plan_completion

            req.plan = plan_completion(chat, ids, tokenizer)
        else:
            system = body.get("system")
            if system is not None and not isinstance(system, str):
                raise bad_request("system", "'system' must be a string")
            chat["messages"] = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": prompt}]
            req = parse_chat(chat, tokenizer, n_ctx, d, recurrent)
            if context:
                req.ids = context + req.ids
                if len(req.ids) >= n_ctx:
                    raise bad_request("context", f"'context' and the prompt are {len(req.ids)} tokens, over the "
                                                 f"context of {n_ctx}", code="context_length_exceeded")
                req.max_tokens = min(req.max_tokens, n_ctx - len(req.ids))
    except APIError as e:
        raise _renamed(e) from None
    req.extra = {"ollama": "generate"}
    return req


class OllamaShaper:
    """ollama's chat and generate bodies (the calls of clutor.server.responses.Shaper), one JSON object a
    line when streamed."""

    done = None
    media_type = b"application/x-ndjson"

    def __init__(self, req, rid: str, created: int, model: str, tokenizer):
        self.req, self.model = req, model
        self.chat = req.extra.get("ollama") == "chat"
        self.grammar = None
        self._tokens: list[int] = []  # what the reply generated (generate's context)

    @staticmethod
    def frame(obj: dict) -> bytes:
        return json_bytes(obj) + b"\n"

    @staticmethod
    def error(e) -> dict:
        return e.body(OLLAMA)

    def stream_error(self, e) -> tuple[None, dict]:
        return None, {"error": e.message}

    def seen(self, token: int) -> None:
        self._tokens.append(token)

    def _part(self, content: str, thinking: str = "", calls=None) -> dict:
        out = {"model": self.model, "created_at": _now()}
        if self.chat:
            msg = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = [{"function": {"name": c.name, "arguments": loads_or(c.arguments, {})}}
                                     for c in calls]
            out["message"] = msg
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        return out

    def _final(self, out: dict, stats, message) -> dict:
        ns = lambda s: int(s * 1e9)  # noqa: E731 - ollama's durations are nanoseconds
        out.update(done=True, done_reason="length" if stats.stop_reason == "length" else "stop",
                   total_duration=ns(stats.prefill_seconds + stats.decode_seconds), load_duration=0,
                   prompt_eval_count=stats.prompt_tokens, prompt_eval_duration=ns(stats.prefill_seconds),
                   eval_count=stats.generated_tokens, eval_duration=ns(stats.decode_seconds))
        if not self.chat:
            out["context"] = list(self.req.ids) + self._tokens
        return out

    def whole(self, message, chunks, stats) -> dict:
        self._tokens = [c.token for c in chunks if c.token is not None]
        return self._final(self._part(message.content, message.reasoning, message.tool_calls), stats, message)

    def open(self) -> list:
        return []

    def delta(self, d, chunks) -> list:
        if not (d.content or d.reasoning):
            return []
        return [(None, {**self._part(d.content, d.reasoning), "done": False})]

    def close(self, message, stats) -> list:
        calls = message.tool_calls if message is not None else None
        return [(None, self._final(self._part("", "", calls), stats, message))]


# -- the routes that do not generate ---------------------------------------------------------------
def _details(m) -> dict:
    from .llama_routes import _ftype

    md = m.metadata
    n = md.get("general.size_label") or ""
    return {"parent_model": "", "format": "gguf", "family": m.config.arch, "families": [m.config.arch],
            "parameter_size": str(n), "quantization_level": _ftype(md).replace(" - ", "_")}


def _entry(state) -> dict:
    import os

    m = state.model
    size = os.path.getsize(m.path) if os.path.exists(m.path) else 0
    mtime = os.path.getmtime(m.path) if os.path.exists(m.path) else time.time()
    return {"name": state.name, "model": state.name,
            "modified_at": datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z"),
            "size": size, "digest": f"{abs(hash((m.path, size, mtime))):016x}", "details": _details(m)}


def _info(m) -> dict:
    """The file's metadata, without the vocabulary's arrays (as ollama's model_info)."""
    out = {}
    for k, v in m.metadata.items():
        if k.startswith("tokenizer.") and isinstance(v, (list, tuple)):
            continue
        if isinstance(v, (str, int, float, bool)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)) and len(v) <= 64:
            out[k] = list(v)
    return out


def ollama_routes(state) -> list:
    from starlette.routing import Route

    from .. import __version__
    from .plumbing import ClientLeft, Nothing, read_json, ready
    from .responses import JSON

    def answer(fn, body_of=None):
        async def route(request):
            try:
                ready(state)
                if body_of is None:
                    return JSON(fn())
                try:
                    body = await read_json(request, state, body_of)
                except ClientLeft:
                    return Nothing()
                return JSON(await fn(body))
            except APIError as e:
                return JSON(e.body(OLLAMA), e.status, e.headers)

        return route

    def named(body: dict) -> dict:
        name = body.get("model", body.get("name"))
        if name is not None and name != state.name:
            raise APIError(404, f"model '{name}' not found")
        return body

    async def show(body: dict) -> dict:
        m = state.model
        caps = ["completion"] + (["tools"] if "tools" in (m.tokenizer.chat_template or "") else []) + ["embedding"]
        return {"modelfile": f"FROM {m.path}\n", "parameters": "", "template": m.tokenizer.chat_template or "",
                "details": _details(m), "model_info": _info(m), "capabilities": caps,
                "modified_at": _entry(state)["modified_at"]}

    def ps() -> dict:
        e = _entry(state)
        return {"models": [{**e, "expires_at": "2318-01-01T00:00:00Z", "size_vram": 0,
                            "context_length": state.model.n_ctx}]}

    def embed_body(body: dict) -> list[list[int]]:
        named(body)
        m = state.model
        raw = body.get("input", body.get("prompt"))
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise bad_request("input", "'input' must be a string or an array of strings")
        out = []
        for t in texts:
            ids = m.tokenizer.encode(t)
            if body.get("truncate", True):
                ids = ids[: m.n_ctx]
            elif len(ids) > m.n_ctx:
                raise bad_request("input", f"the input is {len(ids)} tokens, over the context of {m.n_ctx}")
            out.append(ids or [0])
        return out

    async def embed(inputs: list[list[int]]) -> dict:
        from .embeddings import embed_all

        t0 = time.perf_counter()
        vecs = await embed_all(state, inputs)
        return {"model": state.name, "embeddings": [v.tolist() for v in vecs],
                "total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": 0,
                "prompt_eval_count": sum(len(x) for x in inputs)}

    async def embeddings(inputs: list[list[int]]) -> dict:  # the older route: one prompt, one vector
        return {"embedding": (await embed(inputs[:1]))["embeddings"][0]}

    return [
        Route("/api/version", answer(lambda: {"version": __version__}), methods=["GET"]),
        Route("/api/tags", answer(lambda: {"models": [_entry(state)]}), methods=["GET"]),
        Route("/api/ps", answer(ps), methods=["GET"]),
        Route("/api/show", answer(show, named), methods=["POST"]),
        Route("/api/embed", answer(embed, embed_body), methods=["POST"]),
        Route("/api/embeddings", answer(embeddings, embed_body), methods=["POST"]),
    ]
