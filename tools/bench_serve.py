"""The servers' row: clutor serve against llama-server on one file, the same requests, rounds interleaved.

    python tools/bench_serve.py MODEL [--clients 1,8] [--rounds 4] [--max-tokens 128]
        [--engine NAME=CMD ...]   (default: clutor = this checkout's `clutor serve`, llama = llama-server -np 8)

Every engine is started once ({model} and {port} in its command are filled in), warmed with one
request, then the rounds run: round r visits the engines in order when r is even and in reverse when
it is odd (A B B A ...), so a drift of the machine over the sitting shows up as spread between rounds,
not as a bias for one engine. In each round every engine runs every client count; each request has
its own prompt (--prompt-tokens token ids cut from the bundled corpus by the file's own tokenizer,
clutor.bench.prompt.text_prompts: the same ids for every engine; the chat route sends their text), so
no prefix is reused, and asks for max_tokens greedy tokens with ignore_eos: a request that comes back with fewer
completion tokens (usage.completion_tokens) than it asked for is counted as short and the run fails.

Per engine and client count it prints the median over rounds of: time to first token (p50), the
inter-token latency (median and p99 of the gaps between streamed text events), and aggregate decode
tok/s (completion tokens of the level over its wall time); then each engine's ratio to the last engine
named (llama-server by default). Run it under /work/bin/quiet for figures you report.

The llama-server command follows llama.cpp's usual serving set-up: -np 8 slots, a context of 8 x the
per-request context (so each slot holds one request), -t 2 threads (this machine's cores).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clutor.bench.prompt import text_prompts  # noqa: E402
from clutor.bench.serve_load import run_level, served_model  # noqa: E402
from clutor.model.tokenizer import Tokenizer  # noqa: E402

LLAMA_SERVER = "/work/build/llama.cpp-src/build/bin/llama-server"
DEFAULT_ENGINES = [
    f"clutor={sys.executable} -m clutor serve {{model}} --io memory --port {{port}} --n-ctx {{ctx}} "
    "--max-sequences 8 --log-level warning --no-webui",
    f"llama={LLAMA_SERVER} -m {{model}} --port {{port}} -np 8 -c {{ctx8}} -t 2 --no-webui --log-disable",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    def __init__(self, spec: str, fill: dict):
        name, sep, cmd = spec.partition("=")
        if not sep or not name or not cmd:
            raise SystemExit(f"--engine: expected NAME=CMD, got {spec!r}")
        self.name = name
        self.port = _free_port()
        self.cmd = [part.format(port=self.port, **fill) for part in shlex.split(cmd)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.model = ""
        self.levels: dict[int, list] = {}

    def start(self, cwd: str | None) -> None:
        env = dict(os.environ)
        if cwd:  # a checkout of clutor: run its own code
            env["PYTHONPATH"] = cwd
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=cwd,
                                     env=env, start_new_session=True)

    async def wait_up(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as c:
            while True:
                if self.proc.poll() is not None:
                    raise SystemExit(f"{self.name}: the server exited with {self.proc.returncode}: {self.cmd}")
                try:
                    if (await c.get("/health")).status_code == 200:
                        self.model = await served_model(c)
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"{self.name}: no answer within {timeout:.0f} s")
                await asyncio.sleep(0.25)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _median(xs):
    return float(np.median(xs)) if xs else float("nan")


async def main_async(args) -> int:
    levels = [int(x) for x in args.clients.split(",")]
    fill = {"model": args.model, "ctx": args.ctx, "ctx8": 8 * args.ctx}
    engines = [Engine(s, fill) for s in (args.engine or DEFAULT_ENGINES)]
    cwds = dict(c.split("=", 1) for c in args.cwd)
    per_round = sum(levels) * args.requests
    tok = Tokenizer.from_gguf(args.model)
    prompts = text_prompts(tok, per_round * args.rounds + 1, args.prompt_tokens, seed=args.seed)  # [n][tokens]
    if args.route == "chat":
        prompts = [tok.decode(p) for p in prompts]
    failed = False
    try:
        for e in engines:
            e.start(cwds.get(e.name))
        for e in engines:
            await e.wait_up(args.start_timeout)
            # warm-up: first-request costs (compiles, page touches) out of the figures
            await run_level(e.url, e.model, prompts[-1:], 1, 1, 8, route=args.route)
            print(f"{e.name}: {' '.join(e.cmd)}", flush=True)
        for r in range(args.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            for e in order:
                first = r * per_round
                for n in levels:
                    res = await run_level(e.url, e.model, prompts, n, args.requests, args.max_tokens,
                                          route=args.route, first=first)
                    first += n * args.requests
                    e.levels.setdefault(n, []).append(res)
                    bad = res.errors or res.short
                    failed |= bool(bad)
                    print(f"round {r} {e.name:>8} clients {n}: {res.tok_s:8.1f} tok/s  TTFT p50 "
                          f"{res.pct('ttft', 50) * 1e3:7.1f} ms  ITL p50 {res.pct('itl', 50) * 1e3:6.2f} ms "
                          f"p99 {res.pct('itl', 99) * 1e3:6.2f} ms  tokens {res.completion_tokens} "
                          f"(events {res.events}, prompt {res.prompt_tokens})"
                          + (f"  ERRORS {res.errors} SHORT {res.short} {res.error_samples}" if bad else ""),
                          flush=True)
    finally:
        for e in engines:
            e.stop()
    ref = engines[-1]
    print(f"\nmedians over {args.rounds} rounds ({args.max_tokens} tokens/request, {args.requests} request(s) per "
          f"client, {args.route}); ratio = tok/s over {ref.name}'s, [min..max] over rounds")
    print(f"{'engine':>8} {'clients':>7} {'tok/s':>8} {'[range]':>15} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'ratio':>6}")
    report = {"model": args.model, "max_tokens": args.max_tokens, "rounds": args.rounds, "route": args.route,
              "engines": {}}
    for e in engines:
        rows = report["engines"].setdefault(e.name, {"cmd": e.cmd, "levels": {}})
        for n in levels:
            rs = e.levels.get(n, [])
            tok = [x.tok_s for x in rs]
            ref_tok = _median([x.tok_s for x in ref.levels.get(n, [])])
            row = {"tok_s": _median(tok), "tok_s_rounds": tok,
                   "ttft_p50": _median([x.pct("ttft", 50) for x in rs]),
                   "itl_p50": _median([x.pct("itl", 50) for x in rs]),
                   "itl_p99": _median([x.pct("itl", 99) for x in rs]),
                   "ratio": _median(tok) / ref_tok if ref_tok else float("nan"),
                   "completion_tokens": sum(x.completion_tokens for x in rs),
                   "events": sum(x.events for x in rs), "prompt_tokens": sum(x.prompt_tokens for x in rs),
                   "errors": sum(x.errors for x in rs), "short": sum(x.short for x in rs)}
            rows["levels"][n] = row
            print(f"{e.name:>8} {n:>7} {row['tok_s']:8.1f} [{min(tok, default=0):6.1f}..{max(tok, default=0):6.1f}] "
                  f"{row['ttft_p50'] * 1e3:7.1f}ms {row['itl_p50'] * 1e3:6.2f}ms {row['itl_p99'] * 1e3:6.2f}ms "
                  f"{row['ratio']:6.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if failed:
        print("some requests failed or stopped early: see the rounds above", file=sys.stderr)
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--engine", action="append", default=None, metavar="NAME=CMD",
                    help="a server command ({model}, {port}, {ctx}, {ctx8} filled in); repeatable; the last "
                         "one named is the reference of the ratios")
    ap.add_argument("--cwd", action="append", default=[], metavar="NAME=DIR",
                    help="run engine NAME in DIR with PYTHONPATH=DIR (another clutor checkout)")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=1, help="requests per client per level, one after another")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="where in the corpus the prompts are cut")
    ap.add_argument("--ctx", type=int, default=256, help="context per request (llama-server gets 8x it for -np 8)")
    ap.add_argument("--route", default="completions", choices=("completions", "chat"))
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--json", default=None)
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
