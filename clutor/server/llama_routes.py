"""llama-server's own routes, for tools written against it (its ``/completion`` is in llama_completion):
``POST /tokenize``, ``POST /detokenize``,
``POST /apply-template``, ``GET /props`` (``POST /props`` answers 501, as llama-server without --props)
and ``GET /slots``, in llama-server's field names and shapes (checked against its recorded answers,
tests/golden/llama_server/).

Where llama-server answers a bad value with a 500 (a token id outside the vocabulary), these answer a
400 naming the field.
"""
from __future__ import annotations

from .errors import APIError, bad_request
from .labels import shown
from .plumbing import ClientLeft, Nothing, read_json, ready
from .responses import JSON

__all__ = ["llama_routes"]

MEDIA_MARKER = "<__media__>"  # llama-server's marker for media in a prompt (no media here: never replaced)


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        got = shown(v) if isinstance(v, str) else type(v).__name__
        raise bad_request(name, f"'{name}' must be a boolean, got {got}")
    return v


def _ids(v, name: str, n_vocab: int) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad_request(name, f"'{name}' must be an array of token ids")
    bad = [t for t in v if not 0 <= t < n_vocab]
    if bad:
        raise bad_request(name, f"token ids in '{name}' must be in [0, {n_vocab}) (the model's vocabulary), "
                                f"got {bad[0]}")
    return v


def mixed_ids(content, tok, *, add_special: bool, parse_special: bool, field: str) -> list[int]:
    """llama-server's tokenize_mixed: a string, or an array of strings and ids (BOS, where add_special and
    the file adds one, only before a first element that is a string)."""
    ids: list[int] = []
    parts = content if isinstance(content, list) else [content]
    for i, part in enumerate(parts):
        if isinstance(part, str):
            special = add_special and i == 0
            ids += tok.encode(part, special=parse_special, add_bos=None if special else False)
        elif isinstance(part, int) and not isinstance(part, bool) and isinstance(content, list):
            ids += _ids([part], field, tok.n_vocab)
        else:
            raise bad_request(field, f"'{field}' must be a string, or an array of strings and token ids")
    return ids


def tokenize(body: dict, tok) -> dict:
    """Ids of ``content`` (mixed_ids); pieces as text, or as byte values where not UTF-8."""
    content = body.get("content")
    add_special = _flag(body, "add_special", False)
    parse_special = _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)
    ids = [] if content is None else mixed_ids(content, tok, add_special=add_special, parse_special=parse_special,
                                               field="content")
    if not with_pieces:
        return {"tokens": ids}
    out = []
    for t in ids:
        b = tok.token_bytes(t, special=True)
        try:
            piece = b.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(b)
        out.append({"id": t, "piece": piece})
    return {"tokens": out}


def detokenize(body: dict, tok) -> dict:
    """Every token's piece (control tokens' text included) joined, as llama-server's tokens_to_str."""
    ids = _ids(body.get("tokens", []), "tokens", tok.n_vocab)
    return {"content": b"".join(tok.token_bytes(t, special=True) for t in ids).decode("utf-8", errors="replace")}


def apply_template(body: dict, tok, n_ctx: int, d) -> dict:
    """The prompt a chat request renders (tools, template arguments and add_generation_prompt included)."""
    from .chat_plan import chat_messages, plan_chat

    plan = plan_chat(body, chat_messages(body.get("messages")), tok, reasoning_format=d.reasoning_format,
                     template=d.chat_template, n_ctx=n_ctx, special_in_content=d.special_in_content)
    return {"prompt": tok.unquote(plan.prompt)}


def _ftype(metadata) -> str:
    """general.file_type in llama.cpp's words (llama_model_ftype_name): Q8_0, Q4_K - Medium, ..."""
    import gguf

    v = metadata.get("general.file_type")
    try:
        name = gguf.LlamaFileType(int(v)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return "unknown, may not work"
    size = {"S": "Small", "M": "Medium", "L": "Large"}
    head, _, tail = name.rpartition("_")
    return f"{head} - {size[tail]}" if head.endswith("_K") and tail in size else name


def _caps(tok, template: str | None) -> dict:
    """What the chat template renders, found as llama.cpp finds it: by rendering probes."""
    from ..model.chat import chat_prompt

    def renders(messages, needle: str, **extra) -> bool:
        try:
            return needle in chat_prompt(tok, messages, template=template, add_generation_prompt=False, **extra)
        except Exception:  # noqa: BLE001 - a template that refuses a probe lacks that capability
            return False

    user = {"role": "user", "content": "Hi"}
    call = lambda name, args: {"type": "function", "id": "call_0",  # noqa: E731
                               "function": {"name": name, "arguments": args}}
    tool = {"type": "function", "function": {"name": "probe_tool", "description": "d",
                                             "parameters": {"type": "object", "properties": {}}}}
    text = template or ""
    return {
        "supports_object_arguments": renders([user, {"role": "assistant", "content": "",
                                                     "tool_calls": [call("probe_tool", {"probe_arg": 1})]}],
                                             "probe_arg"),
        "supports_parallel_tool_calls": renders(
            [user, {"role": "assistant", "content": "", "tool_calls": [call("probe_one", "{}"), call("probe_two", "{}")]}],
            "probe_two"),
        "supports_preserve_reasoning": "reasoning_content" in text,
        "supports_reasoning_effort": "reasoning_effort" in text,
        "supports_string_content": renders([{"role": "user", "content": "probe_text"}], "probe_text"),
        "supports_system_role": renders([{"role": "system", "content": "probe_system"}, user], "probe_system"),
        "supports_tool_calls": renders([user, {"role": "assistant", "content": "",
                                               "tool_calls": [call("probe_tool", "{}")]}], "probe_tool"),
        "supports_tools": renders([user], "probe_tool", tools=[tool]),
        "supports_typed_content": renders([{"role": "user", "content": [{"type": "text", "text": "probe_typed"}]}],
                                          "probe_typed"),
    }


def props(state) -> dict:
    from .. import __version__

    m, d = state.model, state.defaults
    tok = m.tokenizer
    spec = m.options.speculative
    params = {"seed": 4294967295, "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
              "min_p": d.min_p, "repeat_last_n": d.repeat_last_n, "repeat_penalty": d.repeat_penalty,
              "presence_penalty": d.presence_penalty, "frequency_penalty": d.frequency_penalty,
              "max_tokens": -1, "n_predict": -1, "ignore_eos": False, "stream": False, "n_probs": 0,
              "reasoning_format": d.reasoning_format, "speculative.types": spec.mode if spec else "none"}
    template = d.chat_template or tok.chat_template
    name = lambda t: tok.token_bytes(t, special=True).decode("utf-8", "replace") if t is not None else ""  # noqa: E731
    return {
        "default_generation_settings": {"params": params, "n_ctx": m.n_ctx},
        "total_slots": state.admission.max_live,
        "model_alias": state.name,
        "model_ftype": _ftype(m.metadata),
        "model_path": m.path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": MEDIA_MARKER,
        "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
        "ui": state.page, "ui_settings": {},
        "chat_template": template or "",
        "chat_template_caps": _caps(tok, template),
        "bos_token": name(tok.bos_id), "eos_token": name(tok.eos_id),
        "build_info": f"clutor {__version__}",
        "is_sleeping": False, "cors_proxy_enabled": False,
    }


def slots(state) -> list[dict]:
    """One entry per sequence served at once; the first ``live`` of them busy (the engine does not pin a
    request to a slot: llama-server's per-slot task details are not given)."""
    m = state.model
    busy = state.admission.live
    return [{"id": i, "n_ctx": m.n_ctx, "speculative": m.options.speculative is not None, "is_processing": i < busy}
            for i in range(state.admission.max_live)]


def llama_routes(state) -> list:
    from starlette.routing import Route

    def posted(fn, extra):
        async def route(request):
            try:
                ready(state)
                m = state.model
                try:
                    out = await read_json(request, state, fn, m.tokenizer, *extra(m))
                except ClientLeft:
                    return Nothing()
            except APIError as e:
                return JSON(e.body(request.url.path), e.status, e.headers)
            return JSON(out)

        return route

    def got(fn):
        async def route(request):
            try:
                ready(state)
            except APIError as e:
                return JSON(e.body(request.url.path), e.status, e.headers)
            return JSON(fn(state))

        return route

    async def props_post(request):
        e = APIError(501, "this server does not change its properties while it runs", code="not_supported")
        return JSON(e.body(request.url.path), e.status, e.headers)

    return [
        Route("/tokenize", posted(tokenize, lambda m: ()), methods=["POST"]),
        Route("/detokenize", posted(detokenize, lambda m: ()), methods=["POST"]),
        Route("/apply-template", posted(apply_template, lambda m: (m.n_ctx, state.defaults)), methods=["POST"]),
        Route("/props", got(props), methods=["GET"]),
        Route("/props", props_post, methods=["POST"]),
        Route("/slots", got(slots), methods=["GET"]),
    ]
