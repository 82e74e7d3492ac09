"""``POST /v1/embeddings``: the model's final normed hidden states (what its output projection reads),
mean-pooled over the input's tokens by default (``--pooling last`` takes the last token's, as
llama-server's ``--pooling last``), L2-normalised, in OpenAI's list shape (floats or base64).

The vectors come from ``Model.embed`` (the engine's embed requests, batched with generations).
"""
from __future__ import annotations

import base64
import time

import numpy as np

from .errors import APIError, bad_request
from .requests import check_model
from .sizes import check_size

__all__ = ["embeddings_route", "POOLINGS"]

POOLINGS = ("mean", "last")
MAX_INPUTS = 256


def _inputs(body: dict, tokenizer, n_ctx: int) -> list[list[int]]:
    raw = body.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw or len(raw) > MAX_INPUTS:
        raise bad_request("input", f"'input' must be a string, an array of token ids, or an array of at most "
                                   f"{MAX_INPUTS} of either")
    out = []
    for i, x in enumerate(raw):
        if isinstance(x, str):
            check_size(x, tokenizer, n_ctx, f"input[{i}]", room=0)  # (before a text that cannot fit is tokenised)
            ids = tokenizer.encode(x)
        elif isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            if not all(0 <= t < tokenizer.n_vocab for t in x):
                raise bad_request(f"input[{i}]", f"token ids in 'input[{i}]' must be in [0, {tokenizer.n_vocab})")
            ids = list(x)
        else:
            raise bad_request(f"input[{i}]", f"'input[{i}]' must be a string or a non-empty array of token ids")
        if not ids:
            raise bad_request(f"input[{i}]", f"'input[{i}]' is empty")
        if len(ids) > n_ctx:
            raise bad_request(f"input[{i}]", f"'input[{i}]' is {len(ids)} tokens, over the context of {n_ctx}",
                              code="context_length_exceeded")
        out.append(ids)
    return out


def _request(body: dict, state) -> tuple[str, list[list[int]]]:
    """(encoding format, the inputs' ids) of an embeddings request (in a worker thread)."""
    model = state.model
    check_model(body, state.name)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_request("encoding_format", "'encoding_format' must be 'float' or 'base64'")
    if body.get("dimensions") is not None and body["dimensions"] != model.config.n_embd:
        raise bad_request("dimensions", f"this model's embeddings have {model.config.n_embd} "
                                        "dimensions; 'dimensions' cannot shorten them")
    return fmt, _inputs(body, model.tokenizer, model.n_ctx)


async def embed_all(state, inputs: list[list[int]]) -> list[np.ndarray]:
    """The inputs' vectors (L2-normalised, float32 [n_embd] each, pooled as the server's --pooling says),
    holding a place in the batch while they are computed; APIError 429 when the server is full."""
    from .admission import QueueFull

    model = state.model
    if not hasattr(model, "embed"):
        raise APIError(501, "this build's engine cannot return hidden states", code="not_implemented")
    t0 = time.perf_counter()
    try:
        await state.admission.acquire()
    except QueueFull as e:
        raise APIError(429, f"the server is at capacity; retry after {e.retry_after} s",
                       code="rate_limit_exceeded", headers={"retry-after": str(e.retry_after)}) from None
    try:
        return [await model.embed(ids, pooling=state.pooling, normalize=True) for ids in inputs]
    finally:
        state.admission.release(time.perf_counter() - t0)


def embeddings_route(state):
    from .plumbing import ClientLeft, Nothing, read_json, ready
    from .responses import JSON

    async def route(request):
        try:
            ready(state)
            try:
                fmt, inputs = await read_json(request, state, _request, state)
            except ClientLeft:
                return Nothing()
            vecs = await embed_all(state, inputs)
        except APIError as e:
            return JSON(e.body(), e.status, e.headers)
        data = []
        for i, v in enumerate(vecs):
            v = np.asarray(v, dtype=np.float32)  # [n_embd]
            emb = base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(x) for x in inputs)
        state.metrics.prompt_tokens += n
        return JSON({"object": "list", "data": data, "model": state.name,
                     "usage": {"prompt_tokens": n, "total_tokens": n}})

    return route
