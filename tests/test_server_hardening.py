"""`clutor serve` under abuse: each test reproduces one finding of the second adversarial read (issue 21)
against a real server on 127.0.0.1, over raw sockets where the finding is about the wire, and asserts
the clean outcome. Wire tests run on both HTTP parsers uvicorn can use (httptools' llhttp, h11)."""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import socket
import threading
import time

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
pytest.importorskip("uvicorn", reason="the server extra is not installed")
import httpx  # noqa: E402

import clutor  # noqa: E402
from clutor.server import Limits, create_app  # noqa: E402
from clutor.server.protocol import available  # noqa: E402
from conftest import FIXTURES, fixture_path  # noqa: E402
from server_util import LiveServer  # noqa: E402

MODEL = fixture_path("qwen3moe", "Q8_0")
NAME = "tiny"
OPEN = dict(io="threads", expert_cache="50%", n_ctx=512)
HTTP = available()


def _server(http=None, **kw) -> LiveServer:
    app_kw = {k: kw.pop(k) for k in ("api_key", "cors_origins", "allowed_hosts", "limits", "max_sequences")
              if k in kw}
    return LiveServer(create_app(clutor.Model.open(MODEL, **OPEN), served_model_name=NAME, **app_kw), http=http,
                      **kw)


@pytest.fixture(scope="module", params=HTTP)
def srv(request):
    s = _server(request.param)
    yield s
    s.stop()


# -- raw HTTP -----------------------------------------------------------------------------------------
def _request(method: str, path: str, body: bytes | None = None, headers: dict | None = None,
             host: str | None = "127.0.0.1") -> bytes:
    lines = [f"{method} {path} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    if body is not None and not any(k.lower() in ("content-length", "transfer-encoding") for k in headers or {}):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def _read_until_closed(c: socket.socket, timeout: float) -> tuple[bytes, str]:
    """Everything the server sends, and how it ended: "closed" (EOF), "reset", or "open" (still open
    at the timeout)."""
    out, deadline = b"", time.monotonic() + timeout
    while True:
        c.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            b = c.recv(1 << 16)
        except socket.timeout:
            return out, "open"
        except ConnectionResetError:
            return out, "reset"
        if not b:
            return out, "closed"
        out += b


def _raw(port: int, data: bytes, *, shut: bool = False, timeout: float = 10.0) -> tuple[bytes, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(data)
        if shut:
            c.shutdown(socket.SHUT_WR)
        return _read_until_closed(c, timeout)


def _statuses(raw: bytes) -> list[int]:
    return [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)]


def _json_body(raw: bytes) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return json.loads(body)


def _completion(prompt="Hi", **kw) -> bytes:
    return json.dumps({"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}).encode()


# -- 2. /metrics injection, labels, log lines -----------------------------------------------------------
@pytest.mark.parametrize("api_key", [None, "sesame"])
def test_metrics_labels_are_a_fixed_set_whatever_the_paths(api_key, caplog):
    s = _server(api_key=api_key)
    try:
        caplog.set_level(logging.INFO, logger="clutor.server")
        forged = "/v1/x%22%7D%20999%0Aclutor_model_ready%200%0A"
        raw, _ = _raw(s.port, _request("GET", forged, headers={"Connection": "close"}))
        assert _statuses(raw) == [401 if api_key else 404]
        # 5000 distinct unknown paths, pipelined 500 to a connection
        for batch in range(10):
            data = b"".join(_request("GET", f"/v1/unknown-{batch}-{i}") for i in range(499))
            data += _request("GET", f"/v1/unknown-{batch}-last", headers={"Connection": "close"})
            raw, how = _raw(s.port, data, timeout=60)
            assert len(_statuses(raw)) == 500, (how, raw[-300:])
        text = httpx.get(s.url + "/metrics").text
        assert [line for line in text.splitlines() if line.startswith("clutor_model_ready")] == ["clutor_model_ready 1"]
        series = [line for line in text.splitlines() if line.startswith("clutor_requests_total")]
        assert len(series) <= 3, series  # other/401 or other/404, and nothing per path
        assert f'clutor_requests_total{{endpoint="other",status="{401 if api_key else 404}"}} 5001' in series
        assert len(text) < 10_000
        for line in text.splitlines():  # every line is a comment or one sample
            assert line.startswith("#") or len(line.split(" ")) == 2, line
        # a newline in what a client sends cannot forge a log line: the model name (answered by the one
        # model served) and a bad value, which the refusal's log line quotes
        httpx.post(s.url + "/v1/completions", json={"model": "x\nclutor.server forged line", "prompt": "hi",
                                                     "n": "x\nclutor.server forged line"},
                   headers={"authorization": f"Bearer {api_key}"} if api_key else {})
        msgs = [r.getMessage() for r in caplog.records if r.name == "clutor.server"]
        assert msgs and not any("\n" in m for m in msgs), msgs
        assert any("forged line" in m and "\\n" in m for m in msgs) or api_key, msgs
    finally:
        s.stop()


# -- 3. a huge prompt -------------------------------------------------------------------------------------
class _LoopCPU:
    """The event-loop thread's CPU time in each callback it runs (asyncio's Handle._run, wrapped)."""

    def __init__(self):
        self.worst = 0.0
        self.what = ""
        self.thread = None

    def __enter__(self):
        orig = self._orig = asyncio.events.Handle._run
        me = self

        def run(handle):
            if threading.get_ident() != me.thread:
                return orig(handle)
            t = time.thread_time()
            try:
                return orig(handle)
            finally:
                dt = time.thread_time() - t
                if dt > me.worst:
                    me.worst, me.what = dt, repr(handle)[:200]

        asyncio.events.Handle._run = run
        return self

    def __exit__(self, *exc):
        asyncio.events.Handle._run = self._orig


def test_a_huge_prompt_is_refused_before_tokenising_and_never_holds_the_loop():
    with _LoopCPU() as cpu:
        s = _server(loop="asyncio")
        try:
            cpu.thread = s.thread_id
            tok = s.state.model.tokenizer
            seen = []
            encode = tok.encode
            tok.encode = lambda text, *a, **k: (seen.append(len(text)), encode(text, *a, **k))[1]
            done = {}
            gc.collect()
            gc.disable()  # (a collection's pause lands on whichever thread allocates: not the code under test)
            cpu.worst = 0.0

            def huge():
                text = "The expert cache streams fast today, and the quick brown fox jumps. " * 100_000  # 7 MB
                done["text"] = httpx.post(s.url + "/v1/completions", json={"prompt": text}, timeout=120)
                ids = list(range(1, 400)) * 4000  # 1.6 M token ids: 7 MB of JSON to decode
                done["ids"] = httpx.post(s.url + "/v1/completions", json={"prompt": ids}, timeout=120)

            t = threading.Thread(target=huge)
            t.start()
            n_health = 0
            while t.is_alive():
                assert httpx.get(s.url + "/health", timeout=60).status_code == 200
                n_health += 1
            t.join()
            gc.enable()
            for r in done.values():
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert "at least" in done["text"].json()["error"]["message"]
            assert max(seen, default=0) < 10_000, "the 7 MB prompt went to the tokenizer"
            # the loop thread never spent more than 20 ms of CPU in one callback (decoding 7 MB of JSON
            # on it takes ~100 ms; reading the body in 64 KiB pieces is what it does)
            assert cpu.worst < 0.020, (cpu.worst, cpu.what)
            assert n_health >= 1
            ok = httpx.post(s.url + "/v1/completions", content=_completion(), timeout=60)
            assert ok.status_code == 200 and seen  # a prompt that fits is tokenised as before
        finally:
            gc.enable()
            s.stop()


def test_tokenising_does_not_hold_the_gil():
    # The tokenizer's Rust code must release the GIL: the event loop's thread runs while a worker
    # tokenises. Measured as CPU time of this thread against the worker's, not as wall time.
    from clutor.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(MODEL)
    text = "The expert cache streams fast today, and the quick brown fox jumps. " * 15_000  # 1 MB
    tok.encode(text[:1000])
    worker = {}

    def run():
        t = time.thread_time()
        tok.encode(text)
        worker["cpu"] = time.thread_time() - t

    th = threading.Thread(target=run)
    t0 = time.thread_time()
    th.start()
    n = 0
    while th.is_alive():
        n += 1
    mine = time.thread_time() - t0
    th.join()
    # (held, this thread runs only while the pretokenizer, plain Python, lets it: ~0.2 of the worker's time)
    assert mine > 0.45 * worker["cpu"], (mine, worker["cpu"], n)


# -- 4. slowloris ---------------------------------------------------------------------------------------
SLOW = Limits(header_timeout=1.0, body_timeout=1.0, min_body_rate=1 << 20, max_connections=6)


@pytest.mark.parametrize("http", HTTP)
def test_dribbling_clients_are_cut_off_and_connections_are_capped(http):
    s = _server(http, limits=SLOW)
    try:
        def dribble(data: bytes) -> tuple[bytes, str, float]:
            with socket.create_connection(("127.0.0.1", s.port), timeout=30) as c:
                t0 = time.monotonic()
                for i in range(len(data)):
                    try:
                        c.sendall(data[i:i + 1])
                    except OSError:
                        break
                    c.settimeout(0.3)
                    try:
                        got = c.recv(1 << 16)
                    except socket.timeout:
                        continue
                    rest, how = _read_until_closed(c, 5)
                    return got + rest, how, time.monotonic() - t0
                return b"", "sent it all", time.monotonic() - t0

        head = _request("POST", "/v1/completions", headers={"Content-Type": "application/json",
                                                           "X-Padding": "p" * 80}, body=b"")
        raw, how, dt = dribble(head[: head.index(b"\r\n\r\n")])  # the head, a byte every 0.3 s
        assert how in ("closed", "reset") and _statuses(raw) == [408], (how, raw)
        assert _json_body(raw)["error"]["code"] == "request_timeout"
        body = _completion("x" * 200)
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as c:  # the body, dribbled
            c.sendall(_request("POST", "/v1/completions", body=b"", headers={"Content-Length": str(len(body))}))
            for i in range(30):
                try:
                    c.sendall(body[i:i + 1])
                except OSError:
                    break
                time.sleep(0.3)
            raw, how = _read_until_closed(c, 10)
        assert _statuses(raw) == [408] and how in ("closed", "reset"), (how, raw)

        # the cap: 6 connections that send nothing hold every place; the 7th is refused at once
        idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(SLOW.max_connections)]
        time.sleep(0.2)
        raw, how = _raw(s.port, _request("GET", "/health"))
        assert _statuses(raw) == [503] and how in ("closed", "reset"), raw  # (reset: its request went unread)
        assert _json_body(raw)["error"]["code"] == "too_many_connections"
        for c in idle:  # each idle one is cut after the header timeout, which frees the places
            got, how = _read_until_closed(c, 10)
            assert _statuses(got) == [408] and how in ("closed", "reset")
            c.close()
        assert httpx.get(s.url + "/health").status_code == 200
        m = s.metrics()
        assert m['clutor_connections_closed_total{reason="header_timeout"}'] >= 7
        assert m['clutor_connections_closed_total{reason="body_timeout"}'] == 1
        assert m['clutor_connections_closed_total{reason="over_capacity"}'] >= 1
    finally:
        s.stop()


# -- 5. stalled readers ---------------------------------------------------------------------------------
def _stalled_stream(port: int) -> socket.socket:
    """A client that asks for a long logprobs stream, then never reads."""
    c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.connect(("127.0.0.1", port))
    # Long enough that the engine is still generating when a short write timeout cuts the stream (the
    # cut then cancels the generation: sent < 300; a cut after the engine finished is 499 as well, see
    # 5b): 480 tokens, ~2.5 s on the tiny model at ~190 tok/s, while the buffers fill within ~0.6 s.
    body = json.dumps({"model": NAME, "prompt": "Once upon a time", "max_tokens": 480, "stream": True,
                       "logprobs": 20, "ignore_eos": True, "temperature": 0}).encode()
    c.sendall(_request("POST", "/v1/completions", body, {"Content-Type": "application/json"}))
    return c


@pytest.mark.parametrize("write_timeout", [600.0, 0.4])
def test_stalled_readers_give_back_their_places(write_timeout, caplog):
    caplog.set_level(logging.INFO, logger="clutor.server")
    s = _server(max_sequences=2, limits=Limits(write_timeout=write_timeout))
    # Small kernel buffers on the server's side (accepted sockets inherit them), so that this stream
    # fills them as a long one would fill the default ones
    s.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    try:
        stalled = [_stalled_stream(s.port) for _ in range(2)]
        deadline = time.monotonic() + 120
        # the engine finishes both sequences; the batch places come back though nobody read the streams
        while s.metrics()["clutor_requests_running"] or s.state.model.engine_stats().live_sequences:
            assert time.monotonic() < deadline, s.metrics()
            time.sleep(0.05)
        probe = httpx.post(s.url + "/v1/completions", content=_completion(), timeout=60)
        assert probe.status_code == 200
        if write_timeout > 100:  # still connected, still unread: only the places were given back
            assert s.metrics()["clutor_connections_open"] >= 2
        else:  # both cut off after the write timeout, logged as what they were
            while s.metrics().get('clutor_connections_closed_total{reason="write_timeout"}', 0) < 2:
                assert time.monotonic() < deadline, s.metrics()
                time.sleep(0.05)
            for c in stalled:
                got, how = _read_until_closed(c, 30)
                assert how in ("closed", "reset") and b"[DONE]" not in got
            time.sleep(0.2)
            lines = [r.getMessage() for r in caplog.records if "stopped reading" in r.getMessage()]
            assert len(lines) == 2 and all(" 499 " in m and "sent=" in m for m in lines), lines
            sent = [int(m.split("sent=")[1].split()[0]) for m in lines]
            assert all(n < 300 for n in sent), lines
            assert s.metrics()['clutor_requests_total{endpoint="/v1/completions",status="499"}'] == 2
        for c in stalled:
            c.close()
    finally:
        s.stop()


# -- 5b. a response written whole, then not read ------------------------------------------------------
# The engine finishes and the handler writes the whole response into the transport's buffer before the
# write timeout cuts the client off: the request is logged and counted when its fate is known (the
# last byte leaving our buffer, or the cut), not when the handler returns.
# The write timeout. A JSON reply's, or a small stream's, clock starts once the handler has written it all;
# the 64-token stream's when its ~50th token fills the buffer: its last ~14 tokens come first (~0.1 s here).
CUT_AFTER = 3.0
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module", params=[(h, "uvloop") for h in HTTP] + [(HTTP[0], "asyncio")],
                ids=lambda p: "-".join(p))
def cutting(request):
    # (both loops: uvloop's libuv transport and asyncio's own each count, pause and resume their writes)
    http, loop = request.param
    s = _server(http, loop=loop, limits=Limits(write_timeout=CUT_AFTER))
    s.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # small kernel buffers: the rest waits in ours
    yield s
    s.stop()


def _chat_logprobs(stream: bool, max_tokens: int) -> bytes:
    """A chat request whose reply is ~1.3 KB of JSON a token (20 top logprobs each)."""
    return json.dumps({"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
                       "stream": stream, "logprobs": True, "top_logprobs": 20, "ignore_eos": True,
                       "temperature": 0}).encode()


def _counts(s: LiveServer, path: str = CHAT) -> dict[str, float]:
    m = s.metrics()
    return {"200": m.get(f'clutor_requests_total{{endpoint="{path}",status="200"}}', 0),
            "499": m.get(f'clutor_requests_total{{endpoint="{path}",status="499"}}', 0),
            "disconnects": m.get("clutor_client_disconnects_total", 0),
            "write_timeout": m.get('clutor_connections_closed_total{reason="write_timeout"}', 0)}


def _next_outcome(s: LiveServer, before: dict[str, float], path: str = CHAT) -> dict[str, float]:
    """The counters once the next request on ``path`` is counted, as their growth since ``before``."""
    deadline = time.monotonic() + 120
    while True:
        now = _counts(s, path)
        if now["200"] + now["499"] > before["200"] + before["499"]:
            return {k: now[k] - before[k] for k in now}
        assert time.monotonic() < deadline, now
        time.sleep(0.05)


def _unread_replies(s: LiveServer) -> int:
    """Responses written whole whose last bytes still wait in the server's buffer."""
    async def count():
        return sum(len(getattr(p, "_tails", ())) for p in s.server.server_state.connections)
    return s.call(count)


def _write_limits(s: LiveServer) -> list[tuple[int, int]]:
    """The (low, high) write-buffer marks of the server's open connections' transports."""
    async def limits():
        return [p.transport.get_write_buffer_limits() for p in s.server.server_state.connections
                if not p.transport.is_closing()]
    return s.call(limits)


def _chat_lines(caplog, path: str = CHAT) -> list[str]:
    return [r.getMessage() for r in caplog.records if f" {path} " in r.getMessage()]


@pytest.mark.parametrize("stream, max_tokens", [(True, 64), (True, 24), (False, 64), (False, 24)],
                         ids=["stream", "stream-under-high-water", "json", "json-under-high-water"])
def test_a_reply_written_but_never_read_is_499_cut_off(cutting, stream, max_tokens, caplog):
    # stream (~83 KB): when what the kernel does not take passes the transport's 64 KiB mark (it does here),
    # the handler, its tokens all made, waits to write its last events when the cut comes; the writes the
    # cut drops let it end "normally".
    # The others: the handler has written its whole reply and returned before the cut. Under the high-water
    # mark (~30 KB, most of it left in our buffer) writing was never paused: such a client was never cut,
    # its connection held for good.
    caplog.set_level(logging.INFO, logger="clutor.server")
    before = _counts(cutting)
    c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        c.connect(("127.0.0.1", cutting.port))
        c.sendall(_request("POST", CHAT, _chat_logprobs(stream, max_tokens), {"Content-Type": "application/json"}))
        deadline = time.monotonic() + 120
        handler_returns = not stream or max_tokens < 64
        while handler_returns and not _unread_replies(cutting):  # (reads nothing) it returns before the cut
            assert time.monotonic() < deadline and _counts(cutting) == before and not _chat_lines(caplog)
            time.sleep(0.05)
        grown = _next_outcome(cutting, before)
        assert grown == {"200": 0, "499": 1, "disconnects": 1, "write_timeout": 1}, grown
        got, how = _read_until_closed(c, 30)
        assert how in ("closed", "reset") and b"[DONE]" not in got and b'"finish_reason":"length"' not in got
    finally:
        c.close()
    lines = _chat_lines(caplog)
    # one line, written once the engine had finished (its stats) and the client was cut: 499, not 200
    assert len(lines) == 1, lines
    assert f" {CHAT} 499 " in lines[0] and f"completion={max_tokens} " in lines[0], lines
    assert f"stopped reading for {CUT_AFTER:g} s: cut off" in lines[0], lines
    assert _unread_replies(cutting) == 0  # nothing of it kept past its connection


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"model": NAME, "max_tokens": 200, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/responses", {"model": NAME, "max_output_tokens": 200, "stream": True, "input": "Hi"}),
], ids=["messages", "responses"])
def test_every_api_logs_an_unread_reply_as_499_cut_off(cutting, path, body, caplog):
    # Anthropic's and the Responses API's event streams (~25 / ~45 KB for 200 tokens): written whole,
    # most of it left in our buffer, the handler returned; then the cut.
    caplog.set_level(logging.INFO, logger="clutor.server")
    before = _counts(cutting, path)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(("127.0.0.1", cutting.port))
        c.sendall(_request("POST", path, json.dumps(body | {"ignore_eos": True, "temperature": 0}).encode(),
                           {"Content-Type": "application/json"}))
        deadline = time.monotonic() + 120
        while not _unread_replies(cutting):
            assert time.monotonic() < deadline and _counts(cutting, path) == before and not _chat_lines(caplog, path)
            time.sleep(0.05)
        grown = _next_outcome(cutting, before, path)
        assert grown == {"200": 0, "499": 1, "disconnects": 1, "write_timeout": 1}, grown
    lines = _chat_lines(caplog, path)
    assert len(lines) == 1 and f" {path} 499 " in lines[0] and "completion=200 " in lines[0], lines
    assert f"stopped reading for {CUT_AFTER:g} s: cut off" in lines[0], lines


def test_a_client_that_leaves_with_its_reply_unread_is_499_left(caplog):
    caplog.set_level(logging.INFO, logger="clutor.server")
    s = _server(limits=Limits(write_timeout=600.0))  # no cut: the client's own leaving settles it
    s.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    try:
        before = _counts(s)
        c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(("127.0.0.1", s.port))
        c.sendall(_request("POST", CHAT, _chat_logprobs(False, 64), {"Content-Type": "application/json"}))
        deadline = time.monotonic() + 120
        while not _unread_replies(s):  # the handler has returned; its reply waits, unread
            assert time.monotonic() < deadline and not _chat_lines(caplog), _chat_lines(caplog)
            time.sleep(0.05)
        assert _counts(s) == before and not _chat_lines(caplog)  # not counted, not logged: its fate is open
        c.close()  # with unread bytes in its receive buffer: the kernel resets the connection
        grown = _next_outcome(s, before)
        assert grown == {"200": 0, "499": 1, "disconnects": 1, "write_timeout": 0}, grown
        lines = _chat_lines(caplog)
        assert len(lines) == 1 and f" {CHAT} 499 " in lines[0] and "completion=64 " in lines[0], lines
        assert "the client left" in lines[0], lines
        assert _unread_replies(s) == 0
    finally:
        s.stop()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_reply_read_to_its_end_is_200(cutting, stream, caplog):
    caplog.set_level(logging.INFO, logger="clutor.server")
    before = _counts(cutting)
    r = httpx.post(cutting.url + CHAT, content=_chat_logprobs(stream, 64), timeout=120,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200
    assert (b"data: [DONE]" in r.content) if stream else r.json()["choices"][0]["finish_reason"] == "length"
    grown = _next_outcome(cutting, before)
    assert grown == {"200": 1, "499": 0, "disconnects": 0, "write_timeout": 0}, grown
    lines = _chat_lines(caplog)
    assert len(lines) == 1 and f" {CHAT} 200 " in lines[0] and "completion=64 " in lines[0], lines


def _read_response(c: socket.socket, timeout: float) -> bytes:
    """One whole HTTP/1.1 response (Content-Length or chunked) from c."""
    out, deadline = b"", time.monotonic() + timeout
    while True:
        head, sep, body = out.partition(b"\r\n\r\n")
        if sep:
            m = re.search(rb"(?i)\r\ncontent-length: (\d+)", head)
            if (len(body) >= int(m.group(1))) if m else body.endswith(b"\r\n0\r\n\r\n"):
                return out
        c.settimeout(max(0.01, deadline - time.monotonic()))
        b = c.recv(1 << 16)
        assert b, out[-200:]
        out += b


@pytest.mark.parametrize("close", [False, True], ids=["keep-alive", "close"])
@pytest.mark.parametrize("stream, max_tokens", [(True, 24), (False, 64)], ids=["stream", "json"])
def test_a_reply_read_after_it_waited_is_200(cutting, stream, max_tokens, close, caplog):
    caplog.set_level(logging.INFO, logger="clutor.server")
    before = _counts(cutting)
    headers = {"Content-Type": "application/json"} | ({"Connection": "close"} if close else {})
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(("127.0.0.1", cutting.port))
        c.sendall(_request("POST", CHAT, _chat_logprobs(stream, max_tokens), headers))
        deadline = time.monotonic() + 120
        while not _unread_replies(cutting):  # written whole, unread: not counted, not logged yet
            assert time.monotonic() < deadline and _counts(cutting) == before and not _chat_lines(caplog)
            time.sleep(0.05)
        got = _read_response(c, 30)  # well inside the write timeout: the client takes it all
        assert got.startswith(b"HTTP/1.1 200 ")
        assert (b"data: [DONE]" in got) if stream else b'"finish_reason":"length"' in got
        grown = _next_outcome(cutting, before)
        assert grown == {"200": 1, "499": 0, "disconnects": 0, "write_timeout": 0}, grown
        if close:
            assert _read_until_closed(c, 30)[1] == "closed"
        else:  # the connection serves the next request, with the transport's usual write limits back
            c.sendall(_request("GET", "/health"))
            assert _read_response(c, 30).startswith(b"HTTP/1.1 200 ")
            assert (0, 0) not in _write_limits(cutting), _write_limits(cutting)
    lines = _chat_lines(caplog)
    assert len(lines) == 1 and f" {CHAT} 200 " in lines[0] and f"completion={max_tokens} " in lines[0], lines
    assert _unread_replies(cutting) == 0


# -- 8. other origins, other hosts --------------------------------------------------------------------
def test_cross_origin_and_foreign_host_requests_are_refused(srv):
    body = _completion()
    evil = _request("POST", "/v1/completions", body, {"Content-Type": "text/plain", "Origin": "http://evil.example",
                                                      "Connection": "close"})
    raw, _ = _raw(srv.port, evil)
    assert _statuses(raw) == [403] and _json_body(raw)["error"]["code"] == "origin_not_allowed"
    for host in ("evil.example", "evil.example:%d" % srv.port, "localhost.evil.example"):
        raw, _ = _raw(srv.port, _request("GET", "/v1/models", host=host, headers={"Connection": "close"}))
        assert _statuses(raw) == [403] and _json_body(raw)["error"]["code"] == "host_not_allowed", host
    ok_hosts = [f"127.0.0.1:{srv.port}", f"localhost:{srv.port}", "localhost", f"[::1]:{srv.port}",
                f"LocalHost.:{srv.port}", f"x.localhost:{srv.port}"]
    for host in ok_hosts:
        raw, _ = _raw(srv.port, _request("GET", "/v1/models", host=host, headers={"Connection": "close"}))
        assert _statuses(raw) == [200], host
    same = _request("POST", "/v1/completions", body, {"Origin": f"http://localhost:{srv.port}", "Connection": "close"},
                    host=f"localhost:{srv.port}")
    assert _statuses(_raw(srv.port, same)[0]) == [200]  # a page served by this server itself


def test_allow_origin_and_allow_host_let_them_in():
    s = _server(cors_origins=("http://app.example",), allowed_hosts=("box.lan",))
    try:
        r = httpx.post(s.url + "/v1/completions", content=_completion(), headers={"Origin": "http://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = httpx.post(s.url + "/v1/completions", content=_completion(), headers={"Origin": "http://other.example"})
        assert r.status_code == 403
        raw, _ = _raw(s.port, _request("GET", "/health", host=f"box.lan:{s.port}", headers={"Connection": "close"}))
        assert _statuses(raw) == [200]
    finally:
        s.stop()


# -- 10. HTTP parsing ------------------------------------------------------------------------------------
def test_content_length_with_transfer_encoding_is_refused_and_closed(srv):
    smuggled = b"0\r\n\r\n" + _request("GET", "/v1/models")
    req = _request("POST", "/v1/completions", smuggled,
                   {"Content-Length": str(len(smuggled)), "Transfer-Encoding": "chunked"})
    raw, how = _raw(srv.port, req)
    assert _statuses(raw) == [400] and how == "closed", raw  # one answer: the pipelined GET is not served
    assert "error" in _json_body(raw)


@pytest.mark.parametrize("body, param", [
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    (b'{"model": "\\ud800", "prompt": "hi"}', "model"),
    (b'{"prompt": "hi", "stop": ["\\udfff"]}', "stop"),
    (b'{"prompt": "hi", "temperature": NaN}', None),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 300 + b"}", "max_tokens"),
])
def test_bombs_surrogates_and_odd_numbers_are_400_json(srv, body, param):
    m0 = srv.metrics().get('clutor_requests_total{endpoint="/v1/completions",status="400"}', 0)
    r = httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["param"] == param and len(err["message"]) < 300, err
    assert "got a number" not in err["message"]
    assert srv.metrics()['clutor_requests_total{endpoint="/v1/completions",status="400"}'] == m0 + 1


# -- 11. smaller -----------------------------------------------------------------------------------------
def test_non_ascii_api_key_sent_as_utf8():
    key = "clé-secrète"
    s = _server(api_key=key)
    try:
        for sent, status in ((key.encode("utf-8"), 200), (key.encode("latin-1"), 200), (b"cle-secrete", 401)):
            raw, _ = _raw(s.port, _request("GET", "/v1/models", headers={"Connection": "close"}).replace(
                b"\r\n\r\n", b"\r\nAuthorization: Bearer " + sent + b"\r\n\r\n"))
            assert _statuses(raw) == [status], sent
    finally:
        s.stop()


def test_client_leaving_during_upload_logs_no_traceback(srv, caplog):
    caplog.set_level(logging.INFO)
    with socket.create_connection(("127.0.0.1", srv.port)) as c:
        c.sendall(_request("POST", "/v1/completions", b'{"prompt": "', {"Content-Length": "100000"}))
        time.sleep(0.3)
    time.sleep(0.5)
    bad = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]
    assert srv.metrics()['clutor_requests_total{endpoint="/v1/completions",status="499"}'] >= 1


def test_io_error_message_does_not_carry_the_model_path():
    from faults import FaultyBackend

    async def open_faulty():
        model = await clutor.Model.open(MODEL, io="threads", expert_cache="25%", n_ctx=512)
        store = model._experts
        store.backend = FaultyBackend(store.backend, fail=lambda r: "injected fault")
        return model

    s = LiveServer(create_app(open_faulty(), served_model_name=NAME))
    try:
        r = httpx.post(s.url + "/v1/completions", content=_completion(), timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "io_error"
        msg = r.json()["error"]["message"]
        assert "injected fault" in msg and MODEL.name in msg and str(FIXTURES) not in msg, msg
    finally:
        s.stop()


# -- the command's flags ---------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [("--header-timeout", "0"), ("--write-timeout", "nan"),
                                         ("--max-connections", "-3"), ("--max-body", "0")])
def test_serve_flags_out_of_range_are_one_line_errors(flag, value, capsys):
    from clutor.cli import main

    assert main(["serve", str(MODEL), "--port", "0", flag, value]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and flag in err and "positive" in err, err
