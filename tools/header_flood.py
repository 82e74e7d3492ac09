"""A `clutor serve` process under a flood of request headers: its RSS and /health's latency.

Starts the server on a model (a subprocess, so its RSS is its own), measures /health for a few
seconds at rest, then while clients send header bytes that never end a head:
  - ``--small``: lines of 30 bytes;
  - ``--value``: one header value;
on ``--conns`` clients at once, each head up to ``--bytes`` / ``--conns`` bytes (a client opens a new
connection when the server closes its own), for at least ``--seconds`` and ``--bytes`` in all.
Prints RSS before, at peak and after, and /health's p50 / p99 / max during the flood.

    python tools/header_flood.py tests/fixtures/tiny-qwen3moe-Q8_0.gguf --small --bytes 105e6 --conns 2
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time

import httpx


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flood(port: int, per_conn: int, small: bool, sent: list[int], stop: threading.Event) -> None:
    # sent: [bytes the kernel took from this client, connections opened]
    """Heads of up to ``per_conn`` bytes that never end, one connection after another, until ``stop``."""
    chunk = (b"X-Flood: " + b"f" * 19 + b"\r\n") * 2200 if small else b"v" * (64 << 10)
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
                sent[1] += 1
                c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + (b"" if small else b"X-Big: "))
                mine = 0
                while mine < per_conn and not stop.is_set():
                    c.sendall(chunk)
                    mine += len(chunk)
                    sent[0] += len(chunk)
        except OSError:  # the server closed it: the next connection
            pass


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    kind = ap.add_mutually_exclusive_group(required=True)
    kind.add_argument("--small", action="store_true", help="many short header lines")
    kind.add_argument("--value", action="store_true", help="one long header value per connection")
    ap.add_argument("--bytes", type=float, default=105e6)
    ap.add_argument("--conns", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=10.0, help="the flood lasts at least this long")
    a = ap.parse_args()
    port = _free_port()
    srv = subprocess.Popen([sys.executable, "-m", "clutor", "serve", a.model, "--port", str(port),
                            "--log-level", "warning", "--no-webui"])
    url = f"http://127.0.0.1:{port}/health"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or srv.poll() is not None:
                sys.exit("the server did not start")
            time.sleep(0.2)
        client = httpx.Client(timeout=120)
        rest = []
        for _ in range(200):
            t = time.perf_counter()
            client.get(url)
            rest.append(time.perf_counter() - t)
            time.sleep(0.01)
        rss0 = _rss(srv.pid)
        stop, sent, peak, lat = threading.Event(), [0, 0], [rss0], []
        per_conn = int(a.bytes) // a.conns
        floods = [threading.Thread(target=_flood, args=(port, per_conn, a.small, sent, stop)) for _ in range(a.conns)]
        t0 = time.perf_counter()
        for t in floods:
            t.start()
        while sent[0] < a.bytes or time.perf_counter() - t0 < a.seconds:
            t = time.perf_counter()
            client.get(url)
            lat.append(time.perf_counter() - t)
            peak[0] = max(peak[0], _rss(srv.pid))
            time.sleep(0.01)
        stop.set()
        for t in floods:
            t.join()
        took = time.perf_counter() - t0
        time.sleep(2)
        after = _rss(srv.pid)
        mb = 1e6
        print(f"flood: {sent[0] / mb:.0f} MB of {'short header lines' if a.small else 'header values'} on "
              f"{a.conns} clients ({sent[1]} connections) in {took:.1f} s")
        print(f"RSS: {rss0 / mb:.0f} MB before, {peak[0] / mb:.0f} MB at peak, {after / mb:.0f} MB after")
        print(f"/health at rest: p50 {_pct(rest, .5) * 1e3:.1f} ms, p99 {_pct(rest, .99) * 1e3:.1f} ms")
        print(f"/health in the flood ({len(lat)} requests): p50 {_pct(lat, .5) * 1e3:.1f} ms, "
              f"p99 {_pct(lat, .99) * 1e3:.1f} ms, max {max(lat, default=float('nan')) * 1e3:.1f} ms")
    finally:
        srv.terminate()
        srv.wait(30)


if __name__ == "__main__":
    main()
