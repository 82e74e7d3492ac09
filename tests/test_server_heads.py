"""Request heads are bounded (``Limits.max_head`` bytes, ``max_headers`` lines) as their bytes arrive,
on both HTTP parsers: past a bound the client gets a JSON 431 and the connection closes, before the
parser holds the head, so a flood of headers neither grows the server's memory nor holds its loop."""
from __future__ import annotations

import gc
import resource
import socket
import threading
import time

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed (pip install 'clutor[server]')")
pytest.importorskip("uvicorn", reason="the server extra is not installed")
import httpx  # noqa: E402

from clutor.server import Limits  # noqa: E402
from test_server_hardening import (_json_body, _LoopCPU, _raw, _read_until_closed, _request,  # noqa: E402,F401
                                   _server, _statuses, srv)  # (srv: the fixture, one server per HTTP parser)

REFUSED = 'clutor_connections_closed_total{reason="head_too_large"}'


def _headers(n: int, size: int = 20) -> dict[str, str]:
    return {f"X-Filler-{i}": "v" * size for i in range(n)}


def _assert_431(raw: bytes, how: str, what: str) -> None:
    assert _statuses(raw) == [431] and how in ("closed", "reset"), (how, raw[:300])
    err = _json_body(raw)["error"]
    assert err["code"] == "headers_too_large" and what in err["message"], err


def test_a_head_over_its_bytes_is_431_json_and_closed(srv):
    before = srv.metrics().get(REFUSED, 0)
    raw, how = _raw(srv.port, _request("GET", "/v1/models", headers={"X-Big": "a" * (20 << 10)}))
    _assert_431(raw, how, f"over {16 << 10} bytes")
    raw, how = _raw(srv.port, _request("GET", "/v1/models?" + "q" * (20 << 10)))  # a long request line counts too
    _assert_431(raw, how, "bytes")
    assert srv.metrics()[REFUSED] == before + 2
    # just inside the bound, the request is served
    raw, how = _raw(srv.port, _request("GET", "/v1/models", headers={"X-Big": "a" * (15 << 10),
                                                                    "Connection": "close"}))
    assert _statuses(raw) == [200], raw[:300]


def test_a_head_over_its_lines_is_431_and_a_hundred_are_served(srv):
    raw, how = _raw(srv.port, _request("GET", "/v1/models", headers=_headers(100)))  # Host + 100
    _assert_431(raw, how, "over 100 header lines")
    raw, _ = _raw(srv.port, _request("GET", "/v1/models", headers={**_headers(98), "Connection": "close"}))
    assert _statuses(raw) == [200], raw[:300]


def test_the_count_starts_again_for_each_request_and_follows_split_reads(srv):
    # Three requests on one kept-alive connection, each with a head near the bound, each sent in
    # small pieces so that the blank line ending a head straddles two reads.
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as c:
        for i in range(3):
            last = i == 2
            data = _request("GET", "/v1/models", headers={"X-Big": "b" * (12 << 10),
                                                          **({"Connection": "close"} if last else {})})
            for k in range(0, len(data), 1001):
                c.sendall(data[k:k + 1001])
                time.sleep(0.001)
            if last:
                raw, how = _read_until_closed(c, 30)
            else:
                raw = b""
                while b'"object":"list"' not in raw and b'"object": "list"' not in raw:
                    raw += c.recv(1 << 16)
        assert _statuses(raw) == [200] and how == "closed", raw[:300]


def test_bounds_are_settings(srv):
    s = _server(limits=Limits(max_head=64 << 10, max_headers=400))
    try:
        raw, _ = _raw(s.port, _request("GET", "/v1/models", headers={**_headers(300, 150), "Connection": "close"}))
        assert _statuses(raw) == [200], raw[:300]  # 300 lines, 50 KiB
        raw, how = _raw(s.port, _request("GET", "/v1/models", headers=_headers(401)))
        _assert_431(raw, how, "over 400 header lines")
    finally:
        s.stop()
    for bad in (dict(max_head=0), dict(max_headers=1.5)):
        with pytest.raises(ValueError, match="Limits.max_head"):
            Limits(**bad)


def _flood(port: int, total: int, stop: threading.Event, sent: list[int]) -> None:
    """Headers of 30 bytes each, never ending the head, on one connection after another, ``total`` bytes
    in all or until ``stop``."""
    line = b"X-Flood: " + b"f" * 19 + b"\r\n"
    chunk = line * 2200  # 66 KB
    while sent[0] < total and not stop.is_set():
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            try:
                c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                while sent[0] < total and not stop.is_set():
                    c.sendall(chunk)
                    sent[0] += len(chunk)
            except OSError:  # the server answered 431 and closed: open the next one
                pass


def test_a_flood_of_headers_holds_no_memory_and_never_holds_the_loop(srv):
    # Two connections' worth of clients sending 40 MB of small headers between them: each connection is
    # cut at the bound, the process's peak RSS stays where it was, and the loop thread spends no more
    # than 20 ms of CPU in any one callback (so /health keeps answering at once).
    with _LoopCPU() as cpu:
        cpu.thread = srv.thread_id
        before = srv.metrics().get(REFUSED, 0)
        gc.collect()
        peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
        stop, sent = threading.Event(), [[0], [0]]
        floods = [threading.Thread(target=_flood, args=(srv.port, 20 << 20, stop, s)) for s in sent]
        for t in floods:
            t.start()
        n_health = 0
        try:
            while any(t.is_alive() for t in floods):
                assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
                n_health += 1
        finally:
            stop.set()
            for t in floods:
                t.join(60)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0
    assert sum(s[0] for s in sent) >= 40 << 20
    refused = srv.metrics()[REFUSED] - before
    assert refused >= 2, refused
    assert grown < 64 << 10, f"peak RSS grew {grown} KiB during the flood"
    assert n_health >= 1
    assert cpu.worst < 0.020, (cpu.worst, cpu.what)
