"""Read an OpenAI request body into what model.generate needs, refusing anything wrong with a 4xx.

Each field is checked for its type and range and named in the message (``param``), as OpenAI does.
Fields Clutor cannot honour (n > 1, logit_bias, echo, ...) are refused rather than ignored, so a
client never silently gets something other than what it asked for. Unknown fields are ignored
(clients send vendor extras freely). A chat's tools, tool calls, response format and reasoning are
read in chat_plan.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ..model.sampling import SamplingParams
from .errors import bad_request
from .jsontext import loads
from .labels import shown
from .sizes import check_size

__all__ = ["Defaults", "GenRequest", "decode_body", "parse_chat", "parse_completion", "check_model", "gen_request",
           "int_field"]

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
# a request's drafting (_speculative): the fields the Responses and Messages routes pass on to the chat's
SPECULATIVE = ("speculative", "n_draft", "speculative.n_max", "speculative.n_min", "speculative.p_min",
               "speculative.type")


@dataclass(frozen=True)
class Defaults:
    """What a request that omits a sampling field gets (llama.cpp server's defaults unless the operator
    says otherwise on the command line)."""

    temperature: float = SamplingParams.temperature
    top_k: int = SamplingParams.top_k
    top_p: float = SamplingParams.top_p
    min_p: float = SamplingParams.min_p
    repeat_penalty: float = SamplingParams.repeat_penalty
    repeat_last_n: int = SamplingParams.repeat_last_n
    frequency_penalty: float = SamplingParams.frequency_penalty
    presence_penalty: float = SamplingParams.presence_penalty
    completion_max_tokens: int = 16  # /v1/completions without max_tokens, as OpenAI; chat: rest of the context
    reasoning_format: str = "auto"   # --reasoning-format: reasoning apart (auto, deepseek) or left in content (none)
    chat_template: str | None = None  # --chat-template: the file's own template when None
    special_in_content: bool = False  # --special-in-content: control-token texts in messages are tokens


@dataclass
class GenRequest:
    """One validated request."""

    kind: Literal["chat", "completion"]
    ids: list[int]                     # the prompt's token ids
    max_tokens: int
    options: dict = field(default_factory=dict)  # sampling keywords for model.generate
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None        # None = off; n = the chosen token's logprob and n alternatives
    user: str | None = None
    plan: object = None                # a chat's ChatPlan (chat_plan.py): parser, grammar, shown tokens
    extra: dict = field(default_factory=dict)  # what an API echoes back (the Responses API's settings)
    id_slot: int | None = None         # llama-server's slot this request's tokens are kept as (/slots)


def decode_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it (run off the event loop:
    a body may be megabytes). Standard JSON only: NaN and Infinity are refused, and so are numbers of
    more than 4300 digits and nesting too deep for the decoder (a 10^5-deep array)."""
    body = loads(raw, None, "the request body")
    if not isinstance(body, dict):
        raise bad_request(None, f"the request body must be a JSON object, got {_kind(body)}")
    return body


def check_model(body: dict, served: str) -> None:
    """Any model name is answered by the one model served, as llama-server does (clients and front-ends
    send a name of their own); the response's "model" says which it is. Only its type is checked."""
    _text(body, "model")


def parse_chat(body: dict, tokenizer, n_ctx: int, d: Defaults, recurrent: bool = False) -> GenRequest:
    """recurrent: the model has recurrent layers, which keep their state where the next turn of this
    conversation will depart from this one (clutor.model.chat.chat_turn)."""
    from .chat_plan import chat_messages, plan_chat

    if "functions" in body and body["functions"]:
        raise bad_request("functions", "'functions' is OpenAI's deprecated form: send 'tools' instead")
    plan = plan_chat(body, chat_messages(body.get("messages")), tokenizer, reasoning_format=d.reasoning_format,
                     template=d.chat_template, recurrent=recurrent, n_ctx=n_ctx,
                     special_in_content=d.special_in_content)
    logprobs = None
    if _bool(body, "logprobs", False):
        logprobs = int_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    limit = body.get("max_completion_tokens", None)
    name = "max_completion_tokens"
    if limit is None:
        limit, name = body.get("max_tokens"), "max_tokens"
    req = gen_request(body, "chat", plan.ids, n_ctx, d, limit, name, default_max=None, logprobs=logprobs)
    req.plan = plan
    if plan.keep:
        req.options["checkpoints"] = plan.keep
    return req


def parse_completion(body: dict, tokenizer, n_ctx: int, d: Defaults) -> GenRequest:
    ids = _prompt_ids(body.get("prompt"), tokenizer, n_ctx)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = int_field(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    for name, ok in (("echo", lambda v: v is False), ("suffix", lambda v: v in ("", None)),
                     ("best_of", lambda v: v == 1)):
        if name in body and body[name] is not None and not ok(body[name]):
            raise bad_request(name, f"'{name}' is not supported by this server")
    return gen_request(body, "completion", ids, n_ctx, d, body.get("max_tokens"), "max_tokens",
                       default_max=d.completion_max_tokens, logprobs=logprobs)


# -- shared fields ----------------------------------------------------------------------------------
def gen_request(body: dict, kind, ids: list[int], n_ctx: int, d: Defaults, limit, limit_name: str,
                default_max: int | None, logprobs: int | None) -> GenRequest:
    """The fields every generating route reads (sampling, stop, stream, the token limit against the
    context, speculative, id_slot), checked, around the prompt's ids."""
    n = body.get("n", 1)
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise bad_request("n", f"'n' must be 1 (one choice per request), got {shown(n)}")
    if body.get("logit_bias"):
        raise bad_request("logit_bias", "'logit_bias' is not supported by this server")
    stream = _bool(body, "stream", False)
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("stream_options", f"'stream_options' must be an object, got {_kind(so)}")
        if not stream:
            raise bad_request("stream_options", "'stream_options' is only allowed with 'stream': true")
        include_usage = _bool(so, "include_usage", False, prefix="stream_options.")

    # Context: the prompt must leave room for at least one token, and an explicit limit must fit.
    P = len(ids)
    room = n_ctx - P
    if room < 1:
        raise bad_request("messages" if kind == "chat" else "prompt",
                          f"This model's maximum context length is {n_ctx} tokens, but the prompt is {P} "
                          f"tokens: {P - n_ctx + 1} too many (at least one token must be left to generate). "
                          "Shorten the prompt.", code="context_length_exceeded")
    if limit is None:
        max_tokens = room if default_max is None else min(default_max, room)
    else:
        max_tokens = int_field({limit_name: limit}, limit_name, None, 1, None)
        if max_tokens > n_ctx:
            raise bad_request(limit_name, f"'{limit_name}' is {shown(max_tokens)}, more than this model's whole "
                                          f"context of {n_ctx} tokens. Reduce '{limit_name}'.",
                              code="context_length_exceeded")
        if P + max_tokens > n_ctx:
            raise bad_request(limit_name,
                              f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                              f"{P + max_tokens} tokens ({P} in the prompt, {max_tokens} for the completion): "
                              f"{P + max_tokens - n_ctx} too many. Reduce the prompt or '{limit_name}'.",
                              code="context_length_exceeded")

    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        stops = list(stop)
    else:
        raise bad_request("stop", f"'stop' must be a string or an array of at most {MAX_STOPS} strings")
    for s in stops:
        _text({"stop": s}, "stop")

    seed = body.get("seed")
    if seed is not None:
        seed = int_field(body, "seed", None, -1, 2**63 - 1)
        seed = None if seed == -1 else seed  # llama.cpp's "random"
    options = dict(
        temperature=_num(body, "temperature", d.temperature, 0.0, None),
        top_p=_num(body, "top_p", d.top_p, 0.0, 1.0, open_low=True),
        top_k=int_field(body, "top_k", d.top_k, 0, None),
        min_p=_num(body, "min_p", d.min_p, 0.0, 1.0),
        repeat_penalty=_num(body, "repeat_penalty", d.repeat_penalty, 0.0, None, open_low=True),
        frequency_penalty=_num(body, "frequency_penalty", d.frequency_penalty, -2.0, 2.0),
        presence_penalty=_num(body, "presence_penalty", d.presence_penalty, -2.0, 2.0),
        repeat_last_n=int_field(body, "repeat_last_n", d.repeat_last_n, -1, None),
        seed=seed, stop=stops, ignore_eos=_bool(body, "ignore_eos", False),
    )
    spec = _speculative(body)
    if spec is not None:  # (absent: the model's own setting, Model.open(speculative=...))
        options["speculative"] = spec
    user = _text(body, "user")
    id_slot = int_field(body, "id_slot", -1, -1, 1 << 30)
    return GenRequest(kind, ids, max_tokens, options, stream, include_usage, logprobs, user,
                      id_slot=None if id_slot == -1 else id_slot)


# A request's drafting: llama-server's field -> SpeculativeParams' (clutor's own names are taken too)
_SPEC_NAMES = {"n_max": "draft_max", "n_min": "draft_min", "type": "mode"}
_SPEC_INTS = {"draft_max": (1, 64), "draft_min": (0, 64), "ngram_max": (1, 64), "ngram_min": (1, 64)}


def _speculative(body: dict):
    """This request's drafting for model.generate(speculative=...): a dict of SpeculativeParams' fields
    (without a type, the model's drafter with them), "off", or None when the request says nothing (the
    model's own setting).

    As llama-server: ``speculative`` an object {n_max, n_min, p_min, type} (or "ngram", "off", false),
    the flat spelling llama-server itself reads (``"speculative.n_max"``, ...) and ``n_draft`` (n_max;
    0: off), the last two over the object's fields. n_max 0 is off too (llama-server drafts nothing
    then). p_min is the draft model's cut (an n-gram draft has no probability to cut at).
    Each value is checked here, so the 400 names its field (``speculative.n_max``)."""
    from ..errors import ClutorError
    from ..model.speculative import SpeculativeParams, parse_speculative

    v = body.get("speculative")
    flat = {k: body[f"speculative.{k}"] for k in ("n_max", "n_min", "p_min", "type")
            if body.get(f"speculative.{k}") is not None}
    if v is None and not flat and body.get("n_draft") is None:
        return None
    if v is None or v is True or v == "ngram":
        given: dict = {}
    elif v is False or v == "off":
        return "off"
    elif isinstance(v, dict):
        given = {k: x for k, x in v.items() if x is not None}
    else:
        raise bad_request("speculative", "'speculative' must be an object {n_max, n_min, p_min, type}, 'ngram', "
                                         f"'off' or false, got {shown(v) if isinstance(v, str) else _kind(v)}")
    given.update(flat)
    if body.get("n_draft") is not None:
        given["n_max"] = int_field(body, "n_draft", None, 0, 64)
    fields, off = {}, False
    for k, x in given.items():
        name, field_ = f"speculative.{k}", _SPEC_NAMES.get(k, k)
        if k == "p_min":
            fields["draft_p_min"] = _num({name: x}, name, 0.0, 0.0, 1.0)
            continue
        if field_ not in SpeculativeParams.__dataclass_fields__:
            raise bad_request("speculative", f"'speculative' has no field {shown(k)} (n_max, n_min, p_min, type; "
                                             "or draft_max, draft_min, ngram_max, ngram_min, adaptive)")
        if field_ == "mode":
            if x not in ("ngram", "draft", "off"):
                raise bad_request(name, f"'{name}' must be 'ngram', 'draft' or 'off' (the drafts this server makes), "
                                        f"got {shown(x) if isinstance(x, str) else _kind(x)}")
            off |= x == "off"
        elif field_ == "adaptive":
            x = _bool({name: x}, name, True)
        elif k == "n_max":  # (0 drafts nothing: off)
            x = int_field({name: x}, name, None, 0, 64)
            if x == 0:
                off = True
                continue
        else:
            x = int_field({name: x}, name, None, *_SPEC_INTS[field_])
        fields[field_] = x
    if off:
        return "off"
    try:
        parse_speculative(fields)  # how the fields combine; the mode, where not given, is the model's
        return fields
    except ClutorError as e:  # how the fields combine (n_min over n_max): its message shows only integers
        raise bad_request("speculative", str(e)) from None


def _prompt_ids(prompt, tokenizer, n_ctx: int) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        check_size(prompt, tokenizer, n_ctx, "prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < tokenizer.n_vocab]
        if bad:
            raise bad_request("prompt", f"token ids in 'prompt' must be in [0, {tokenizer.n_vocab}), "
                                        f"got {shown(bad[0])}")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("prompt", f"'prompt' holds {len(prompt)} prompts: this server answers one per request")
    else:
        raise bad_request("prompt", "'prompt' must be a string or an array of token ids, got "
                                    f"{_kind(prompt)}")
    if not ids:
        raise bad_request("prompt", "'prompt' is empty: give at least one token")
    return ids


def _text(body: dict, name: str) -> str | None:
    """A string field (None when absent) that must be valid Unicode: a lone surrogate ("\\ud800", which
    JSON can spell) is refused rather than carried into a comparison, a log or a reply."""
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_request(name, f"'{name}' must be a string, got {_kind(v)}")
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(name, f"'{name}' is not valid Unicode text (it holds a lone surrogate, "
                                    f"{shown(v, 24)})") from None
    return v


def _kind(v) -> str:
    return "null" if v is None else {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                                     list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def _bool(body: dict, name: str, default: bool, prefix: str = "") -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(prefix + name, f"'{prefix}{name}' must be a boolean, got {_kind(v)}")
    return v


def _num(body: dict, name: str, default: float, lo: float | None, hi: float | None,
         open_low: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(name, f"'{name}' must be a number, got {_kind(v)}")
    if isinstance(v, int) and abs(v) > 1.7e308 or isinstance(v, float) and not math.isfinite(v):
        # (an integer is exact in JSON, and may be too large for a float: math.isfinite would overflow)
        raise bad_request(name, f"'{name}' must be a finite number, got {shown(v)}")
    if lo is not None and (v <= lo if open_low else v < lo) or hi is not None and v > hi:
        lo_s = "-inf" if lo is None else f"{lo:g}"
        hi_s = "inf" if hi is None else f"{hi:g}"
        raise bad_request(name, f"'{name}' must be in {'(' if open_low else '['}{lo_s}, {hi_s}], got {shown(v)}")
    return float(v)


def int_field(body: dict, name: str, default: int | None, lo: int | None, hi: int | None) -> int:
    v = body.get(name)
    if v is None:
        if default is None:
            raise bad_request(name, f"'{name}' must be an integer, got null")
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(name, f"'{name}' must be an integer, got {_kind(v)}")
    if lo is not None and v < lo or hi is not None and v > hi:
        raise bad_request(name, f"'{name}' must be in [{lo}, {'inf' if hi is None else hi}], got {shown(v)}")
    return v
