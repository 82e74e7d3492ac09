"""A body over the limit gets its 413 and JSON even from a client still writing it (httpx: the OpenAI and
Anthropic clients): the server reads and drops the rest, within bounds, before it closes. Both parsers."""
from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
pytest.importorskip("uvicorn", reason="the server extra is not installed")
import httpx  # noqa: E402

from clutor.server.protocol import _LINGER_BYTES  # noqa: E402
from test_server_hardening import _json_body, _read_until_closed, _request, _statuses, srv  # noqa: E402,F401


def _check_413(r: httpx.Response, path: str) -> None:
    assert r.status_code == 413, r.text[:300]
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large", body
    else:
        assert body["error"]["code"] == "request_too_large", body


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/embeddings"])
def test_httpx_posting_a_body_over_the_limit_reads_the_413(srv, path):
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (9 << 20) + b'"}]}'
    for _ in range(3):
        _check_413(httpx.post(srv.url + path, content=big, headers={"content-type": "application/json"},
                              timeout=60), path)
    # without a Content-Length (chunked), refused as the bytes pass the limit
    chunks = (big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20))
    _check_413(httpx.post(srv.url + path, content=chunks, timeout=60), path)
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_a_refused_body_is_read_to_its_end_and_the_close_is_clean(srv):
    # The server reads and drops the rest of the body, so the client's writes all succeed, and the
    # connection ends with a FIN after the 413, not a reset (which, on a real network, can destroy the
    # 413 before the client reads it).
    body = b"y" * (9 << 20)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as c:
        c.sendall(_request("POST", "/v1/completions", None, {"Content-Length": str(len(body))}))
        for i in range(0, len(body), 1 << 20):
            c.sendall(body[i:i + (1 << 20)])  # no broken pipe, no reset
            time.sleep(0.005)
        raw, how = _read_until_closed(c, 10)
    assert _statuses(raw) == [413] and how == "closed", (how, raw[:300])
    assert _json_body(raw)["error"]["code"] == "request_too_large"


def test_lingering_is_bounded(srv):
    # A client that never stops sending is cut once the server has dropped _LINGER_BYTES: it has the
    # 413 in its receive buffer, and its writes fail long before its 1 GB is out.
    sent = 0
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as c:
        c.sendall(_request("POST", "/v1/completions", None, {"Content-Length": str(1 << 30)}))
        chunk = b"z" * (1 << 20)
        t0 = time.monotonic()
        try:
            while sent < 1 << 30:
                c.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        took = time.monotonic() - t0
        raw, how = _read_until_closed(c, 10)
    assert sent < _LINGER_BYTES + (64 << 20), sent
    assert took < 30
    assert _statuses(raw)[:1] == [413] and how in ("closed", "reset"), raw[:300]
    assert _json_body(raw)["error"]["code"] == "request_too_large"
