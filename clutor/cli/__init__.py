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
from .parsing import Parser

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
    "pull": "pull",
    "list": "hub_list",
    "rm": "hub_rm",
    "warmup": "warmup",
}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="clutor",
        description="Run Mixture-of-Experts GGUF models larger than RAM.",
        epilog="examples: clutor demo   |   clutor pull Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M   |   "
               "clutor chat Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M",
    )
    from .. import __version__

    p.add_argument("--version", action="version", version=f"clutor {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p.commands = {}  # name -> its parser, for Parser.parse_args's messages
    for name, mod in COMMANDS.items():
        module = importlib.import_module(f"{__name__}.{mod}")
        sp = module.add_parser(sub)
        sp.set_defaults(_run=module.run)
        p.commands[name] = sp
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
    argv = sys.argv[1:] if argv is None else argv
    try:
        if not argv:  # `clutor` alone: the overview, as `clutor --help`
            build_parser().print_help()
            return 0
        args = build_parser().parse_args(argv)
        if args.command != "serve":  # serve logs with timestamps, configured by itself
            _log_to_stderr()
        if getattr(args, "_model_source", False):
            from .source import resolve_model_source

            resolve_model_source(args)  # a Hub name becomes a cached file (downloaded the first time)
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


def _log_to_stderr() -> None:
    """Clutor's INFO records (the kernels' first-run compile, ...) as `clutor: ...` lines on stderr,
    on a terminal or not: a long pause always says why."""
    import logging

    class Stderr(logging.StreamHandler):
        """Writes to sys.stderr as it is when a record comes (a test or a caller may have replaced it)."""

        stream = property(lambda self: sys.stderr, lambda self, _value: None)

    log = logging.getLogger("clutor")
    if not any(isinstance(h, logging.StreamHandler) and type(h).__name__ == "Stderr" for h in log.handlers):
        handler = Stderr()
        handler.setFormatter(logging.Formatter("clutor: %(message)s"))
        log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)


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
