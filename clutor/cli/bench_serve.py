"""clutor bench-serve [URL]: N concurrent streaming clients against an OpenAI-compatible server.

For each client count: aggregate completion tok/s, time to first token p50/p99 and inter-token
latency p50/p99. Works against any such server (clutor serve, llama-cpp-python's, llama-server);
--serve starts the server itself ({port} in the command becomes a free port), optionally inside a
cgroup memory cap (--cap, needs root), and stops it afterwards. Needs the server extra."""
from __future__ import annotations

import json
import shlex
import signal
import socket
import subprocess
import sys
import time

from ..errors import ClutorError
from .common import add_command


def add_parser(sub):
    p = add_command(
        sub, "bench-serve", "concurrent streaming clients against an OpenAI-compatible server", __doc__,
        "clutor bench-serve http://127.0.0.1:8000 --clients 1,4,8,16",
        "clutor bench-serve --serve 'clutor serve olmoe.gguf --port {port} --max-sequences 16' --cap 3GiB",
        "clutor bench-serve --serve 'python -m llama_cpp.server --model olmoe.gguf --port {port}' --cap 3GiB")
    p.add_argument("url", nargs="?", default=None, help="server base URL (without /v1); omit with --serve")
    p.add_argument("--serve", default=None, metavar="CMD", help="start this server command ({port} = a free port)")
    p.add_argument("--cap", default=None, metavar="SIZE", help="with --serve: run it in a cgroup capped at SIZE")
    p.add_argument("--drop-caches", action="store_true", help="with --cap: drop the page cache before starting")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds to wait for --serve to answer")
    p.add_argument("--clients", default="1,4,8,16", help="client counts to run, one level each")
    p.add_argument("--requests", type=int, default=2, help="requests per client per level, one after another")
    p.add_argument("--max-tokens", type=int, default=32, help="completion tokens per request")
    p.add_argument("--prompt-words", type=int, default=32, help="words per prompt (each client its own text)")
    p.add_argument("--model", default=None, help="model id to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that refuse unknown fields)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the unmeasured first request")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    return p


def _clients(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ClutorError(f"--clients: expected a comma-separated list of counts >= 1, got {text!r}")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_up(url: str, proc, timeout: float) -> None:
    import asyncio

    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=5) as c:
        while True:
            if proc is not None and proc.poll() is not None:
                raise ClutorError(f"the server command exited with {proc.returncode} before answering")
            try:
                if (await c.get("/v1/models")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ClutorError(f"{url} did not answer /v1/models within {timeout:.0f} s")
            await asyncio.sleep(0.25)


async def _bench(args, url: str, proc) -> list:
    import httpx

    from ..bench.serve_load import bench_prompts, run_level, served_model

    await _wait_up(url, proc, args.start_timeout)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as c:
            model = await served_model(c)
    levels = _clients(args.clients)
    prompts = bench_prompts(max(levels) * args.requests + 1, args.prompt_words)
    kw = dict(api_key=args.api_key, ignore_eos=args.ignore_eos)
    if args.warmup:  # first-request costs (page touches, allocations) out of the figures
        await run_level(url, model, prompts[-1:], 1, 1, min(4, args.max_tokens), **kw)
    print(f"{url}  model {model}  {args.max_tokens} tokens/request, {args.prompt_words}-word prompts, "
          f"{args.requests} request(s)/client")
    print(f"{'clients':>7} {'reqs':>5} {'errors':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8}")
    out = []
    for n in levels:
        r = await run_level(url, model, prompts, n, args.requests, args.max_tokens, **kw)
        print(f"{n:>7} {r.requests:>5} {r.errors:>6} {r.tok_s:>8.2f} {r.pct('ttft', 50):>8.3f}s "
              f"{r.pct('ttft', 99):>8.3f}s {r.pct('itl', 50) * 1e3:>6.1f}ms {r.pct('itl', 99) * 1e3:>6.1f}ms",
              flush=True)
        for e in r.error_samples:
            print(f"        error: {e}", file=sys.stderr)
        out.append(r.summary())
    return out


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def run(args) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ClutorError("clutor bench-serve needs the server extra: pip install 'clutor[server]'") from None
    if args.requests < 1 or args.max_tokens < 1 or args.prompt_words < 1:
        raise ClutorError("--requests, --max-tokens and --prompt-words must be >= 1")
    _clients(args.clients)
    if (args.url is None) == (args.serve is None):
        raise ClutorError("give either a server URL or --serve CMD")
    if args.cap and not args.serve:
        raise ClutorError("--cap applies to a server started with --serve")
    report: dict = {"clients": args.clients, "max_tokens": args.max_tokens, "prompt_words": args.prompt_words}
    if args.url:
        report["levels"] = await _bench(args, args.url.rstrip("/"), None)
    else:
        port = _free_port()
        cmd = [part.replace("{port}", str(port)) for part in shlex.split(args.serve)]
        url = f"http://127.0.0.1:{port}"
        report["server"] = " ".join(cmd)
        if args.cap:
            from ..bench.memcap import capped_popen
            from ..units import format_bytes, parse_bytes

            try:
                limit = parse_bytes(args.cap)
            except ValueError as e:
                raise ClutorError(f"--cap: {e}") from None
            with capped_popen(cmd, limit, drop_caches=args.drop_caches, stdin=subprocess.DEVNULL) as (proc, peak):
                try:
                    report["levels"] = await _bench(args, url, proc)
                    report["cap"], report["peak_bytes"] = limit, peak()
                    print(f"server memory: peak {format_bytes(peak())} in a {format_bytes(limit)} cap")
                finally:
                    _stop(proc)
        else:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
            try:
                report["levels"] = await _bench(args, url, proc)
            finally:
                _stop(proc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(level["errors"] == 0 for level in report["levels"]) else 1
