"""A load generator for any OpenAI-compatible server: N concurrent streaming clients over HTTP.

Each client sends its own prompt (a slice of the bundled corpus, the same text for every server) to
/v1/completions with ``stream: true`` and times every server-sent event that carries text: time to
first token (from sending the request) and the gaps between tokens (inter-token latency). A level's
aggregate speed is all completion tokens over the level's wall time. A request counts as decoded only by
what the server says it decoded (``usage.completion_tokens``); one that stopped before ``max_tokens``
(an end-of-generation token despite ``ignore_eos``, a stop string) is counted as ``short``, so a
comparison can tell a server that decodes every token from one that stops early.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from importlib import resources

import httpx
import numpy as np

from ..errors import ClutorError

__all__ = ["LevelResult", "bench_prompts", "run_level", "served_model"]


@dataclass
class LevelResult:
    clients: int
    requests: int
    errors: int
    seconds: float
    completion_tokens: int
    ttft: list[float] = field(default_factory=list)  # seconds, one per request that got a token
    itl: list[float] = field(default_factory=list)   # seconds between consecutive text events of a stream
    error_samples: list[str] = field(default_factory=list)
    prompt_tokens: int = 0   # as the server counted them (usage), summed
    events: int = 0          # stream events that carried text (fewer than tokens: a server joined some)
    short: int = 0           # requests that ended before max_tokens, or without usage

    @property
    def tok_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def pct(self, which: str, q: float) -> float:
        xs = getattr(self, which)
        return float(np.percentile(xs, q)) if xs else float("nan")

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("ttft", "itl")}
        d.update(tok_s=self.tok_s, ttft_p50=self.pct("ttft", 50), ttft_p99=self.pct("ttft", 99),
                 itl_p50=self.pct("itl", 50), itl_p99=self.pct("itl", 99))
        return d


def bench_prompts(n: int, words: int) -> list[str]:
    """n distinct prompts of `words` words each, cut from the bundled corpus (skipping its header)."""
    text = resources.files("clutor").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    body = text.split("\n\n", 2)[-1].split()
    if len(body) < words:
        raise ClutorError(f"the corpus has {len(body)} words, fewer than --prompt-words {words}")
    step = max(1, (len(body) - words) // max(n, 1))
    return [" ".join(body[i * step % (len(body) - words + 1):][:words]) for i in range(n)]


async def served_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    if r.status_code != 200:
        raise ClutorError(f"GET /v1/models answered {r.status_code}: {r.text[:200]}")
    data = r.json().get("data") or []
    if not data:
        raise ClutorError("GET /v1/models lists no model: pass --model")
    return data[0]["id"]


ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def _text(choice: dict) -> str | None:
    return choice.get("text") or (choice.get("delta") or {}).get("content")


async def _one(client: httpx.AsyncClient, route: str, body: dict, res: LevelResult) -> None:
    t0 = time.perf_counter()
    last, n_events, usage = None, 0, None
    try:
        async with client.stream("POST", ROUTES[route], json=body) as r:
            if r.status_code != 200:
                await r.aread()
                raise ClutorError(f"HTTP {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise ClutorError(f"stream error: {ev['error']}")
                usage = ev.get("usage") or usage
                if any(_text(ch) for ch in ev.get("choices") or ()):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft.append(now - t0)
                    else:
                        res.itl.append(now - last)
                    last = now
                    n_events += 1
    except (httpx.HTTPError, ClutorError, ValueError) as e:
        res.errors += 1
        if len(res.error_samples) < 3:
            res.error_samples.append(f"{type(e).__name__}: {e}")
        return
    res.events += n_events
    if usage is None:
        res.short += 1
        res.completion_tokens += n_events
        return
    res.completion_tokens += usage["completion_tokens"]
    res.prompt_tokens += usage.get("prompt_tokens", 0)
    if usage["completion_tokens"] < body["max_tokens"]:
        res.short += 1


async def run_level(url: str, model: str, prompts: list, clients: int, requests: int, max_tokens: int,
                    *, api_key: str | None = None, ignore_eos: bool = True, timeout: float = 600,
                    route: str = "completions", first: int = 0, seed: int | None = None,
                    transport: httpx.AsyncBaseTransport | None = None) -> LevelResult:
    """`clients` concurrent clients, each sending `requests` streaming requests one after another.

    Client i's j-th request sends prompts[first + i * requests + j] (cycled), so a caller that runs
    several levels or rounds can give each request its own text (no prefix cache between them).
    prompts: strings, or (completions) lists of token ids.
    route: "completions" (the prompt as text or ids) or "chat" (the prompt as one user message)."""
    if route not in ROUTES:
        raise ClutorError(f"route: expected one of {sorted(ROUTES)}, got {route!r}")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    res = LevelResult(clients, clients * requests, 0, 0.0, 0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits,
                                 transport=transport) as client:

        async def worker(i: int) -> None:
            for j in range(requests):
                text = prompts[(first + i * requests + j) % len(prompts)]
                body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                if route == "chat":
                    body["messages"] = [{"role": "user", "content": text}]
                else:
                    body["prompt"] = text
                if seed is not None:
                    body["seed"] = seed
                if ignore_eos:
                    body["ignore_eos"] = True
                await _one(client, route, body, res)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        res.seconds = time.perf_counter() - t0
    return res
