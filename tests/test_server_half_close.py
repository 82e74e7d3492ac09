"""A client that half-closes (sends FIN after its request) gets its answer; one that closed its socket and
left is told apart (a 100 Continue it answers with a reset) and its generation is cancelled. Neither
ever sees uvicorn's text/plain 500. Both HTTP parsers."""
from __future__ import annotations

import re
import socket
import time

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
pytest.importorskip("uvicorn", reason="the server extra is not installed")

from test_server_hardening import _completion, _raw, _request, _statuses, srv  # noqa: E402,F401 (srv: the fixture)


def _final(raw: bytes) -> tuple[int, bytes]:
    """The final (non-1xx) response's status and body."""
    statuses = _statuses(raw)
    assert statuses and all(s == 100 for s in statuses[:-1]), statuses
    last = raw[raw.rindex(b"HTTP/1.1 "):]
    return statuses[-1], last.partition(b"\r\n\r\n")[2]


def test_half_closed_clients_get_their_answer(srv):
    raw, how = _raw(srv.port, _request("GET", "/v1/models"), shut=True)
    assert _statuses(raw) == [200] and how == "closed"
    raw, how = _raw(srv.port, _request("POST", "/v1/completions", b"{bad json"), shut=True)
    assert _final(raw)[0] == 400 and how == "closed"
    raw, how = _raw(srv.port, _request("POST", "/v1/completions", _completion(stream=True)), shut=True, timeout=60)
    assert _final(raw)[0] == 200 and b"data: [DONE]" in raw and raw.endswith(b"0\r\n\r\n"), raw[-200:]
    assert how == "closed"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", _completion(max_tokens=60, ignore_eos=True)),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60, '
                             b'"ignore_eos": true}'),
])
def test_a_half_closed_whole_generation_is_answered(srv, path, body):
    before = srv.metrics()
    raw, how = _raw(srv.port, _request("POST", path, body), shut=True, timeout=120)
    status, payload = _final(raw)
    assert status == 200 and how == "closed", raw[:400]
    assert b"text/plain" not in raw and b'"usage"' in payload
    assert b'"completion_tokens":60' in payload.replace(b" ", b"")
    after = srv.metrics()
    assert after.get("clutor_client_disconnects_total", 0) == before.get("clutor_client_disconnects_total", 0)


def test_http10_half_closed_gets_its_answer_without_interim_responses(srv):
    req = _request("POST", "/v1/completions", _completion(max_tokens=20, ignore_eos=True)).replace(
        b"HTTP/1.1", b"HTTP/1.0", 1)
    raw, how = _raw(srv.port, req, shut=True, timeout=120)
    assert re.findall(rb"HTTP/1\.[01] (\d{3}) ", raw) == [b"200"] and how == "closed", raw[:300]


def test_a_client_that_closed_and_left_is_cancelled_not_answered(srv):
    # The client sends its request and closes the socket: its FIN looks like a half-close, but it
    # will read nothing. The generation is cancelled long before its 400 tokens.
    before = srv.metrics()
    with socket.create_connection(("127.0.0.1", srv.port)) as c:
        c.sendall(_request("POST", "/v1/completions", _completion(max_tokens=400, ignore_eos=True)))
    deadline = time.monotonic() + 30
    while True:
        m = srv.metrics()
        if not m["clutor_requests_running"] and m.get("clutor_client_disconnects_total", 0) > \
                before.get("clutor_client_disconnects_total", 0):
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    made = m["clutor_completion_tokens_total"] - before.get("clutor_completion_tokens_total", 0)
    assert made < 400, made
    assert m.get('clutor_requests_total{endpoint="/v1/completions",status="499"}', 0) == \
        before.get('clutor_requests_total{endpoint="/v1/completions",status="499"}', 0) + 1
