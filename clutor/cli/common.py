"""Options and output shared by several sub-commands."""
from __future__ import annotations

import argparse
import sys

from ..io.policies import DEFAULT_POLICY, POLICIES
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
    g = p.add_argument_group("expert streaming")
    g.add_argument("--expert-cache", default=None, metavar="SIZE",
                   help="memory for routed experts: bytes, '4GiB' or '25%%' of the expert bytes "
                        "(default: half the available memory after the dense weights)")
    g.add_argument("--prefetch", choices=("on", "off"), default=None,
                   help="during decode, read the next layer's predicted experts while this one computes (default: off)")
    g.add_argument("--policy", default=DEFAULT_POLICY, choices=tuple(POLICIES), help="expert cache replacement policy")
    g.add_argument("--io", choices=("auto", "uring", "threads", "memory"), default="auto",
                   help="how experts are read: io_uring, a thread pool, or memory (mmap, no cache)")
    d = g.add_mutually_exclusive_group()
    d.add_argument("--direct", dest="direct", action="store_true", default=True,
                   help="O_DIRECT reads that bypass the page cache (default)")
    d.add_argument("--buffered", dest="direct", action="store_false", help="reads through the page cache")
    g.add_argument("--trace", default=None, metavar="FILE", help="record routing to FILE (JSONL, see `clutor simulate`)")


def sampling_kwargs(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop,
                ignore_eos=args.ignore_eos)


def model_kwargs(args) -> dict:
    prefetch = None if args.prefetch is None else args.prefetch == "on"
    return dict(n_ctx=args.n_ctx, expert_cache=args.expert_cache, prefetch=prefetch, policy=args.policy,
                io=args.io, direct=args.direct, trace=args.trace, progress=load_progress())


def load_progress():
    """A tqdm bar for loading dense weights, shown on a terminal once the load is big enough to wait for."""
    if not sys.stderr.isatty():
        return None
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            if total < (256 << 20):
                return
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="dense weights",
                       file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return progress


def print_stats(stats: GenerationStats, file=None) -> None:
    """The per-run report: speed, then (when experts stream) what the cache and the disk did."""
    from ..units import format_bytes

    lines = [
        f"\n[{stats.prompt_tokens} prompt tokens, {stats.prefill_tps:.1f} tok/s prefill | "
        f"{stats.generated_tokens} generated, {stats.decode_tps:.2f} tok/s decode | stop: {stats.stop_reason}]"
    ]
    io = stats.io
    if io is not None:
        total = io.wait_seconds + io.compute_seconds
        lines += [
            f"[experts: {io.backend} {io.mode}, cache {format_bytes(io.cache_bytes)} ({stats.cache_note}) | "
            f"hit rate {io.hit_rate:.1%}, prefetch accuracy {io.prefetch_accuracy:.1%} "
            f"({io.prefetch_issued} prefetched, {io.prefetch_wasted} wasted = {format_bytes(io.bytes_wasted)})]",
            f"[read {format_bytes(io.bytes_read)} = {format_bytes(stats.bytes_per_token)}/token | "
            f"time: waiting on disk {io.wait_seconds:.2f}s ({io.wait_seconds / total:.0%}), "
            f"computing {io.compute_seconds:.2f}s | peak RSS {format_bytes(stats.peak_rss)}]"
            if total > 0 else f"[read {format_bytes(io.bytes_read)} | peak RSS {format_bytes(stats.peak_rss)}]",
        ]
    else:
        lines.append(f"[experts mapped from the file | peak RSS {format_bytes(stats.peak_rss)}]")
    print("\n".join(lines), file=file or sys.stderr)
