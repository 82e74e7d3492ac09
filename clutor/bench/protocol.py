"""How the benchmark talks to its workers: ``python -m MODULE MODEL --json-args '{...}'`` in, one JSON
line out on stdout (``{"error": ...}`` and exit 1 on failure), so the parent never parses tracebacks."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from ..errors import ClutorError

__all__ = ["COMMON_OPTIONS", "worker_main", "worker_options", "parse_result"]

EXIT_ERROR = 1

# The options every worker takes: both engines generate the same tokens from the same prompt.
COMMON_OPTIONS: dict = {
    "prompt_tokens": 64,
    "tokens": 32,
    "seed": 0,
    "warmup": True,
    "n_ctx": None,  # None: prompt_tokens + tokens + 8
    "workload": "ids",  # ids (seeded ids, greedy) | text (the bundled corpus, sampled): clutor.bench.prompt
}


def worker_options(defaults: dict, options: dict) -> dict:
    """``options`` over a worker's ``defaults``; an unknown key or ``tokens`` < 1 is an error."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ClutorError(f"unknown benchmark option(s): {', '.join(unknown)}")
    opts = {**defaults, **options}
    if opts["n_ctx"] is None:
        opts["n_ctx"] = int(opts["prompt_tokens"]) + int(opts["tokens"]) + 8
    if int(opts["tokens"]) < 1:
        raise ClutorError(f"tokens must be >= 1, got {opts['tokens']}")
    return opts


def worker_main(prog: str, body: Callable[[str, dict], dict], argv: list[str] | None = None) -> int:
    """Parse MODEL and --json-args, run body(model, args), print its result as one JSON line."""
    p = argparse.ArgumentParser(prog=prog, description="one benchmark run; prints one JSON line")
    p.add_argument("model")
    p.add_argument("--json-args", default="{}", help="options as a JSON object")
    a = p.parse_args(argv)
    try:
        opts = json.loads(a.json_args)
        if not isinstance(opts, dict):
            raise ClutorError(f"--json-args must be a JSON object, got {a.json_args!r}")
        result = body(a.model, opts)
    except json.JSONDecodeError as e:
        return _fail(f"--json-args is not valid JSON: {e}")
    except ClutorError as e:
        return _fail(str(e))
    except MemoryError:
        return _fail("out of memory")
    except Exception as e:  # a bug, not bad input: keep the traceback for the JSON report
        import traceback

        return _fail(f"{type(e).__name__}: {e}", traceback.format_exc())
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


def _fail(message: str, tb: str | None = None) -> int:
    out = {"error": message} if tb is None else {"error": message, "traceback": tb}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return EXIT_ERROR


def parse_result(stdout: str) -> dict | None:
    """The last JSON object line a worker printed, or None when there is none."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    return None
