"""The `clutor` command: one small module per sub-command, each with add_parser(sub) and run(args)."""
from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import os
import sys

from .._util import sleeping_kernel_workers
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
    from .. import __version__

    p.add_argument("--version", action="version", version=f"clutor {__version__}")
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
    """Run one command; every failure ends as one `clutor: error:` line and exit code 1 (Ctrl-C: 130)."""
    sleeping_kernel_workers()
    try:
        args = build_parser().parse_args(argv)
        result = args._run(args)
        if inspect.iscoroutine(result):
            result = run_coro(result)
        return int(result or 0)
    except ClutorError as e:
        if getattr(e, "stdout_failed", False):  # clutor.cli.common.OutputError
            _silence_stdout()  # what is still buffered would fail again at exit
        _error(str(e))
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `clutor ... | head`: the reader left; end quietly (and keep the exit-time flush quiet too)
        _silence_stdout()
        return 0
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        _error(f"{where}{e.strerror or e}")
        return 1
    except MemoryError:
        _error("out of memory")
        return 1


def _error(message: str) -> None:
    print(f"clutor: error: {message}", file=sys.stderr)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's flush at exit does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
