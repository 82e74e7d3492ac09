"""Options and output shared by several sub-commands."""
from __future__ import annotations

import argparse
import sys

from ..model.generate import GenerationStats


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def add_sampling_args(p: argparse.ArgumentParser, *, temperature: float = 0.8) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens (benchmarks)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-ctx", type=int, default=None, help="context length (default: min(model's, 4096))")


def sampling_kwargs(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop,
                ignore_eos=args.ignore_eos)


def model_kwargs(args) -> dict:
    return dict(n_ctx=args.n_ctx)


def print_stats(stats: GenerationStats, file=sys.stderr) -> None:
    print(
        f"\n[{stats.prompt_tokens} prompt tokens, {stats.prefill_tps:.1f} tok/s prefill | "
        f"{stats.generated_tokens} generated, {stats.decode_tps:.2f} tok/s decode | stop: {stats.stop_reason}]",
        file=file,
    )
