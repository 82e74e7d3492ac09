"""`clutor serve` over HTTP with the official openai client: shapes, sampling fields, errors, load, faults.

Every server here is a real uvicorn on a free port (tests/server_util.py) over a committed fixture,
its experts streamed from the file through a small cache (threads backend), so requests read the disk.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
pytest.importorskip("uvicorn", reason="the server extra is not installed")
openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
import httpx  # noqa: E402

import clutor  # noqa: E402
from clutor.model.chat import chat_ids  # noqa: E402
from clutor.server import create_app  # noqa: E402
from conftest import fixture_path  # noqa: E402
from server_util import LiveServer  # noqa: E402
from streaming_util import child_env  # noqa: E402

MODEL = fixture_path("qwen3moe", "Q8_0")
NAME = "tiny"
# f32 activations: the cross-talk checks compare each stream with the same request run alone, token
# for token, which needs numerics that do not depend on what a row is batched with; int8 activations
# may differ by an int8 rounding step there (conftest.STEP_TOL), as llama.cpp's do.
OPEN = dict(io="threads", expert_cache="50%", n_ctx=512, activations="f32")
PROMPTS = [f"Story number {i}: the expert cache streams {'fast' if i % 2 else 'slowly'} today" for i in range(16)]


def _client(url: str, **kw) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=60, **kw)


@pytest.fixture(scope="module")
def srv():
    s = LiveServer(create_app(clutor.Model.open(MODEL, **OPEN), served_model_name=NAME, max_sequences=8,
                              max_queue=64))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    with _client(srv.url) as c:
        yield c


def _complete(client, prompt, **kw):
    return client.completions.create(model=NAME, prompt=prompt, temperature=0, **kw)


def _stream_text(stream) -> tuple[str, str | None, object]:
    text, finish, usage = [], None, None
    for ev in stream:
        if ev.usage is not None:
            usage = ev.usage
        for ch in ev.choices:
            piece = ch.delta.content if hasattr(ch, "delta") else ch.text
            text.append(piece or "")
            finish = ch.finish_reason or finish
    return "".join(text), finish, usage


async def _direct(ids, **kw) -> list:
    """The engine's own output for these ids (a separate in-process model, no server)."""
    async with clutor.Model.open(MODEL, **OPEN) as model:
        return [c async for c in model.generate(ids, **kw)]


# -- shapes -------------------------------------------------------------------------------------------
def test_completions_equal_the_engine_streaming_or_not(srv, client):
    tok = srv.state.model.tokenizer
    ids = tok.encode(PROMPTS[0])
    ref = asyncio.run(_direct(ids, max_tokens=12, temperature=0))
    ref_text, ref_stats = "".join(c.text for c in ref), ref[-1].stats

    r = _complete(client, PROMPTS[0], max_tokens=12)
    assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref_text
    assert r.choices[0].finish_reason == ("length" if ref_stats.stop_reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == ref_stats.generated_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0

    text, finish, usage = _stream_text(_complete(client, PROMPTS[0], max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}))
    assert text == ref_text and finish == r.choices[0].finish_reason
    assert usage.prompt_tokens == len(ids) and usage.completion_tokens == ref_stats.generated_tokens
    # token ids as the prompt give the same answer
    assert _complete(client, ids, max_tokens=12).choices[0].text == ref_text


def test_chat_streaming_and_not(srv, client):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]
    ids = chat_ids(srv.state.model.tokenizer,
                                     [msgs[0], {"role": "user", "content": "Hello there"}])
    ref = asyncio.run(_direct(ids, max_tokens=10, temperature=0))
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "".join(c.text for c in ref)
    assert r.usage.prompt_tokens == len(ids)

    events = list(client.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=10,
                                                 temperature=0, stream=True))
    assert events[0].choices[0].delta.role == "assistant"
    assert all(e.object == "chat.completion.chunk" and e.id == events[0].id for e in events)
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == r.choices[0].message.content
    assert events[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_sse_ends_with_done(srv):
    with httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


def test_stop_strings(client):
    full = _complete(client, PROMPTS[1], max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = full[: full.index(stop)]
    for stops in (stop, [stop, "\u2603never"]):
        r = _complete(client, PROMPTS[1], max_tokens=16, stop=stops)
        assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    text, finish, _ = _stream_text(_complete(client, PROMPTS[1], max_tokens=16, stop=stop, stream=True))
    assert text == cut and finish == "stop"


def test_seed_reproducible(client):
    def sample(seed):
        return client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=24, temperature=1.0,
            top_p=1.0, seed=seed, extra_body={"top_k": 0, "min_p": 0.0, "ignore_eos": True}).choices[0].message.content

    a = sample(1234)
    assert a == sample(1234)
    assert any(sample(s) != a for s in (1, 2, 3))


def test_logprobs_are_log_softmax_of_the_logits(srv, client):
    tok = srv.state.model.tokenizer
    msgs = [{"role": "user", "content": "Count to three"}]
    ids = chat_ids(tok, msgs)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6

    async def engine():
        async with clutor.Model.open(MODEL, **OPEN) as m:
            chunks = [c async for c in m.generate(ids, max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)]
            gen = [c.token for c in chunks if c.token is not None]
            return chunks, gen, await m.logits(ids + gen)

    chunks, gen, lg = asyncio.run(engine())
    x = lg[len(ids) - 1 : len(ids) - 1 + 6].astype(np.float64)  # [6, V] the logits each token was drawn from
    ref = x - (x.max(-1, keepdims=True) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    for t, c in enumerate(content):
        assert bytes(c.bytes) == tok.token_bytes(gen[t], special=True)
        assert c.logprob == pytest.approx(ref[t, gen[t]], abs=1e-4) == chunks[t].logprob
        assert c.logprob == pytest.approx(ref[t].max(), abs=1e-4)  # greedy: the most likely token
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(np.sort(ref[t])[::-1][:3], abs=1e-4)
        assert [i for i, _ in chunks[t].top_logprobs] == np.argsort(-ref[t], kind="stable")[:3].tolist()
        assert c.top_logprobs[0].token == c.token

    rc = _complete(client, PROMPTS[2], max_tokens=4, logprobs=2)
    lp = rc.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(d) <= 2 and max(d.values()) == pytest.approx(v) for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == rc.choices[0].text


def test_cached_tokens_on_a_second_turn(client):
    msgs = [{"role": "user", "content": "Remember the word expert."}]
    first = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Which word?"}]
    second = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # at least the first turn's prompt is shared verbatim by the second's
    assert first.usage.prompt_tokens - 1 <= cached < second.usage.prompt_tokens


def test_models_and_health(srv, client):
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}


def test_mounted_in_another_asgi_app():
    from starlette.applications import Starlette
    from starlette.routing import Mount

    async def main():
        async with clutor.Model.open(MODEL, **OPEN) as model:
            app = create_app(model, served_model_name=NAME, api_key="k", cors_origins=("https://ui.example",))
            parent = Starlette(routes=[Mount("/llm", app=app)])
            transport = httpx.ASGITransport(app=parent)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
                assert (await c.get("/llm/health")).json() == {"status": "ok"}
                body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
                assert (await c.post("/llm/v1/completions", json=body)).status_code == 401
                pre = await c.options("/llm/v1/completions", headers={
                    "origin": "https://ui.example", "access-control-request-method": "POST",
                    "access-control-request-headers": "authorization, content-type"})
                assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://ui.example"
                r = await c.post("/llm/v1/completions", json=body, headers={"authorization": "Bearer k"})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

    asyncio.run(main())


# -- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, param", [
    (dict(n=2), "n"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=[1, 2]), "stop"),
    (dict(extra_body={"top_k": 1.5}), "top_k"),
    (dict(extra_body={"tools": [{"type": "function"}]}), "tools[0]"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]"),
    (dict(messages=[]), "messages"),
])
def test_bad_fields_are_400_naming_the_field(client, kw, param):
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, max_tokens=kw.pop("max_tokens", 4), **kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_over_context_says_by_how_much(srv, client):
    n_ctx = srv.state.model.n_ctx
    ids = [7] * (n_ctx + 5)
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, ids, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and f"{6} too many" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, [7] * 100, max_tokens=n_ctx)
    assert f"{100} in the prompt, {n_ctx} for the completion): 100 too many" in e.value.body["message"]


def test_any_model_name_is_answered_by_the_one_served(client):
    """As llama-server: a client's own name for the model (the README's, a front-end's default) is served by
    the one model, and the response names it by its real id."""
    r = client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.model == NAME and r.choices[0].message.content is not None
    assert _complete(client, "Hello", max_tokens=2).model == NAME
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=7, prompt="hi", max_tokens=1)  # a name must still be a string
    assert e.value.body["param"] == "model"
    assert [m.id for m in client.models.list().data] == [NAME]


def test_the_default_model_id():
    from clutor.cli.serve import model_id

    assert model_id("/m/Qwen3-30B-A3B-Q4_K_M-00001-of-00003.gguf") == "Qwen3-30B-A3B-Q4_K_M"
    assert model_id("olmoe-1b-7b-0924-Q8_0.gguf") == "olmoe-1b-7b-0924-Q8_0"
    assert model_id("/root/.cache/clutor/demo-0123456789abcdef.gguf") == "clutor-demo"


def test_malformed_and_huge_bodies(srv):
    for body, status in ((b"{not json", 400), (b"[1, 2]", 400), (b"\xff\xfe", 400),
                         (b'{"prompt": "' + b"x" * (9 << 20) + b'"}', 413)):
        r = httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(srv.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(srv.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_api_key():
    s = LiveServer(create_app(clutor.Model.open(MODEL, **OPEN), served_model_name=NAME, api_key="sesame"))
    try:
        with _client(s.url, api_key="wrong") as bad, _client(s.url, api_key="sesame") as good:
            with pytest.raises(openai.AuthenticationError) as e:
                bad.models.list()
            assert e.value.status_code == 401
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=NAME, prompt="hi", max_tokens=2)
            assert httpx.get(s.url + "/v1/models").status_code == 401
            assert good.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(s.url + "/health").status_code == 200  # open without the key
        assert httpx.get(s.url + "/metrics").status_code == 200
        for path in ("/tokenize", "/detokenize", "/apply-template"):  # llama-server's routes need it too
            assert httpx.post(s.url + path, json={}).status_code == 401, path
            assert httpx.post(s.url + path, json={}, headers={"authorization": "Bearer sesame"}).status_code != 401
        assert httpx.get(s.url + "/props").status_code == 401
    finally:
        s.stop()


def test_queue_limit_429_with_retry_after():
    s = LiveServer(create_app(clutor.Model.open(MODEL, **OPEN), served_model_name=NAME, max_sequences=1,
                              max_queue=1))
    adm = s.state.admission
    try:
        async def take():
            await adm.acquire()

        s.call(take)  # the one running place is taken: the next request queues, the one after is refused
        with _client(s.url) as c:
            results = {}
            t = threading.Thread(target=lambda: results.setdefault("queued", _complete(c, "hi", max_tokens=2)))
            t.start()
            deadline = time.monotonic() + 10
            while adm.queued < 1:
                assert time.monotonic() < deadline, "the request never queued"
                time.sleep(0.01)
            assert s.metrics()["clutor_queue_depth"] == 1
            with pytest.raises(openai.RateLimitError) as e:
                _complete(c, "hi", max_tokens=2)
            assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1

            async def give_back():
                adm.release()

            s.call(give_back)
            t.join(30)
            assert results["queued"].usage.completion_tokens >= 1
        m = s.metrics()
        assert m["clutor_rejected_total"] == 1 and m["clutor_queue_depth"] == 0 and m["clutor_requests_running"] == 0
    finally:
        s.stop()


def test_drain_is_bounded_in_time():
    s = LiveServer(create_app(clutor.Model.open(MODEL, **OPEN), served_model_name=NAME, max_sequences=1),
                   drain_timeout=0.5)
    adm = s.state.admission

    async def take():
        await adm.acquire()  # never given back: the next request waits until the drain gives up on it

    s.call(take)
    outcome = {}

    def stuck():
        try:
            outcome["r"] = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        except httpx.HTTPError as e:
            outcome["r"] = e

    t = threading.Thread(target=stuck)
    t.start()
    while adm.queued < 1:
        time.sleep(0.01)
    t0 = time.monotonic()
    s.stop()
    assert time.monotonic() - t0 < 5, "the drain did not give up after --drain-timeout"
    t.join(10)
    r = outcome["r"]  # answered, not dropped: 503 in OpenAI's shape
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert adm.queued == 0


def test_health_is_503_while_loading():
    gate = asyncio.Event

    class Slow:
        """Opens the model only once the test says so."""

        def __init__(self):
            self.go = None

        def __await__(self):
            return self._open().__await__()

        async def _open(self):
            self.go = gate()
            await self.go.wait()
            return await clutor.Model.open(MODEL, **OPEN)

    slow = Slow()
    s = LiveServer(create_app(slow, served_model_name=NAME), ready=False)
    try:
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        while slow.go is None:
            time.sleep(0.01)

        async def release():
            slow.go.set()

        s.call(release)
        s.wait_ready(60)
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        s.stop()


# -- load ---------------------------------------------------------------------------------------------
def _solo(client, prompt: str, max_tokens: int) -> str:
    return _complete(client, prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True}).choices[0].text


def test_16_concurrent_streams_each_equal_its_solo_output(srv, client):
    n_tok = 24
    solo = [_solo(client, p, n_tok) for p in PROMPTS]
    assert len(set(solo)) > 8, "prompts must lead to distinct outputs for the check to mean anything"

    async def one(c: openai.AsyncOpenAI, prompt: str) -> tuple[str, int]:
        stream = await c.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=n_tok, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = [], None
        async for ev in stream:
            usage = ev.usage or usage
            text += [ch.text for ch in ev.choices]
        return "".join(text), usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in PROMPTS)), 120)

    out = asyncio.run(main())
    for i, (text, n) in enumerate(out):
        assert text == solo[i], f"client {i} got another stream's tokens or lost some"
        assert n == n_tok
    m = srv.metrics()
    assert m["clutor_live_sequences"] == 0 and m["clutor_requests_running"] == 0


def test_50_disconnects_free_everything(srv, client):
    rng = random.Random(7)
    before = srv.metrics().get("clutor_client_disconnects_total", 0)

    async def drop(c: httpx.AsyncClient, i: int) -> None:
        body = {"model": NAME, "prompt": PROMPTS[i % 16], "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        k = rng.randrange(0, 30)

        async def read():
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n > k:
                        return  # leave mid-stream: the connection is closed unread

        try:  # some leave at a random moment instead (while queued, during the prefill, mid-stream)
            await asyncio.wait_for(read(), rng.uniform(0.01, 1.0) if i % 3 == 0 else 60)
        except asyncio.TimeoutError:
            pass

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            await asyncio.wait_for(asyncio.gather(*(drop(c, i) for i in range(50))), 120)

    asyncio.run(main())
    deadline = time.monotonic() + 15
    while True:
        m = srv.metrics()
        idle = (m["clutor_live_sequences"], m["clutor_kv_bytes"], m["clutor_requests_running"], m["clutor_queue_depth"])
        if idle == (0, 0, 0, 0):
            break
        assert time.monotonic() < deadline, f"not freed after the disconnects: live, kv, running, queued = {idle}"
        time.sleep(0.05)
    assert m["clutor_client_disconnects_total"] - before >= 10
    es = srv.state.model.engine_stats()
    assert es.live_sequences == 0 and es.kv_bytes == 0 and es.queued == 0
    assert _solo(client, PROMPTS[3], 24) == _solo(client, PROMPTS[3], 24)
    r = _complete(client, PROMPTS[0], max_tokens=12)
    assert r.choices[0].text == "".join(c.text for c in asyncio.run(
        _direct(srv.state.model.tokenizer.encode(PROMPTS[0]), max_tokens=12, temperature=0)))


def test_metrics_count_requests_and_tokens(srv, client):
    m0 = srv.metrics()
    _complete(client, "hi", max_tokens=3, extra_body={"ignore_eos": True})
    m1 = srv.metrics()
    assert m1['clutor_requests_total{endpoint="/v1/completions",status="200"}'] == \
        m0.get('clutor_requests_total{endpoint="/v1/completions",status="200"}', 0) + 1
    assert m1["clutor_completion_tokens_total"] == m0["clutor_completion_tokens_total"] + 3
    assert m1["clutor_expert_accesses_total"] > m0["clutor_expert_accesses_total"]
    assert 0 <= m1["clutor_expert_cache_hit_rate"] <= 1 and m1["clutor_expert_bytes_read_total"] > 0
    assert m1["clutor_event_loop_lag_seconds"] >= 0 and m1["clutor_model_ready"] == 1


def test_bench_serve_against_the_server(srv, tmp_path, capsys):
    from clutor.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench-serve", srv.url, "--clients", "1,3", "--requests", "2", "--max-tokens", "5",
                 "--prompt-words", "8", "--json", str(out)]) == 0
    levels = json.loads(out.read_text())["levels"]
    assert [lv["clients"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["errors"] == 0 and lv["completion_tokens"] == lv["clients"] * 2 * 5 and lv["tok_s"] > 0
        assert 0 < lv["ttft_p50"] <= lv["ttft_p99"] and 0 <= lv["itl_p50"] <= lv["itl_p99"]
    table = capsys.readouterr().out
    assert "TTFT p50" in table and "ITL p99" in table


# -- faults -------------------------------------------------------------------------------------------
def test_read_faults_fail_only_the_requests_they_hit():
    from faults import FaultyBackend

    fault = {"p": 0.0}
    rng = random.Random(3)

    async def open_faulty():
        model = await clutor.Model.open(MODEL, io="threads", expert_cache="25%", n_ctx=512)
        store = model._experts  # the wrapper goes between the store and its backend
        store.backend = FaultyBackend(store.backend, fail=lambda r: "injected fault" if rng.random() < fault["p"] else None)
        return model

    s = LiveServer(create_app(open_faulty(), served_model_name=NAME, max_sequences=8))
    try:
        with _client(s.url) as c:
            refs = [_solo(c, p, 8) for p in PROMPTS[:8]]
            fault["p"] = 1.0  # every read fails: a request that misses the cache fails with 500
            for stream in (False, True):
                with pytest.raises(openai.InternalServerError) as e:
                    _complete(c, PROMPTS[9], max_tokens=8, stream=stream)
                assert e.value.status_code == 500 and "injected fault" in e.value.body["message"]
                assert e.value.body["type"] == "server_error"
            fault["p"] = 0.2  # some reads fail: those requests get a 500, every other one its exact output

            async def one(ac, i):
                try:
                    r = await ac.completions.create(model=NAME, prompt=PROMPTS[i], temperature=0, max_tokens=8,
                                                    extra_body={"ignore_eos": True})
                    return r.choices[0].text
                except openai.InternalServerError as err:
                    assert "injected fault" in err.body["message"]
                    return None

            async def batch():
                async with openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60) as ac:
                    return await asyncio.wait_for(asyncio.gather(*(one(ac, i % 8) for i in range(24))), 120)

            out = asyncio.run(batch())
            assert any(o is None for o in out), "no request hit a fault: the test proves nothing"
            assert all(o == refs[i % 8] for i, o in enumerate(out) if o is not None)
            fault["p"] = 0.0  # and the server keeps serving, correctly
            assert [_solo(c, p, 8) for p in PROMPTS[:8]] == refs
        m = s.metrics()
        assert m["clutor_live_sequences"] == 0 and m["clutor_requests_running"] == 0
        assert m['clutor_requests_total{endpoint="/v1/completions",status="500"}'] >= 3
    finally:
        s.stop()


# -- the command --------------------------------------------------------------------------------------
def _spawn(*args: str) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "clutor", "serve", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env())
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return proc, lines


def _port(proc, lines, timeout=120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ln in list(lines):
            if "listening on http://127.0.0.1:" in ln:
                return int(ln.split("127.0.0.1:")[1].split()[0])
        assert proc.poll() is None, "".join(lines)
        time.sleep(0.05)
    raise TimeoutError("".join(lines))


def test_serve_command_drains_on_sigterm():
    proc, lines = _spawn(str(MODEL), "--port", "0", "--io", "memory", "--served-model-name", NAME,
                         "--drain-timeout", "20")
    try:
        url = f"http://127.0.0.1:{_port(proc, lines)}"
        deadline = time.monotonic() + 120
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        body = {"prompt": "Once", "max_tokens": 450, "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            events = r.iter_lines()
            first = next(ln for ln in events if ln)
            proc.send_signal(signal.SIGTERM)  # mid-stream: this request still completes
            rest = [ln for ln in events if ln]
        assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
        assert json.loads(rest[-3][6:])["choices"][0]["finish_reason"] == "length"
        assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 450
        assert proc.wait(30) == 0
        log = "".join(lines)
        assert "SIGTERM: draining" in log and "completion=450" in log and "Traceback" not in log
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_command_bad_file_exits_with_a_message(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    proc, lines = _spawn(str(bad), "--port", "0")
    assert proc.wait(60) == 1
    time.sleep(0.1)
    err = "".join(lines)
    assert "clutor: error: " in err and "bad.gguf" in err and "Traceback" not in err


@pytest.mark.parametrize("freeze", [True, False])
def test_freeze_heap_freezes_what_the_process_holds_once_the_model_is_open(freeze):
    """create_app(freeze_heap=True) (what `clutor serve` passes): once the model has loaded, the heap is
    collected and frozen, so the collector no longer walks the model's tables on the loop; without it the
    process's collector is left as it was."""
    import gc

    gc.unfreeze()
    s = LiveServer(create_app(clutor.Model.open(MODEL, **OPEN), served_model_name=NAME, freeze_heap=freeze))
    try:
        assert httpx.get(s.url + "/health").status_code == 200
        frozen = gc.get_freeze_count()
        with _client(s.url) as c:
            assert c.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        s.stop()
        gc.unfreeze()
    assert (frozen > 10_000) if freeze else frozen == 0
