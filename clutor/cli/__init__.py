"""The `clutor` command: one small module per sub-command, each with add_parser(sub) and run(args)."""
from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import sys

from ..errors import ClutorError

# sub-command -> module; imported lazily so `clutor --help` stays fast
COMMANDS = {
    "generate": "generate",
    "chat": "chat",
    "info": "info",
    "demo": "demo",
    "bench-io": "bench_io",
    "simulate": "simulate",
    "bench": "bench",
    "serve": "serve",
    "bench-serve": "bench_serve",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clutor",
        description="Run Mixture-of-Experts GGUF models larger than RAM.",
        epilog="example: clutor demo   |   clutor generate model.gguf 'Hello' --max-tokens 32",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, mod in COMMANDS.items():
        module = importlib.import_module(f"{__name__}.{mod}")
        sp = module.add_parser(sub)
        sp.set_defaults(_run=module.run)
    return p


def run_coro(coro):
    """Run on uvloop where installed (faster loop, same semantics), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args._run(args)
        if inspect.iscoroutine(result):
            result = run_coro(result)
        return int(result or 0)
    except ClutorError as e:
        print(f"clutor: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
