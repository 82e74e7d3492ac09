"""clutor simulate: replay a routing trace through the expert cache's policies, next to Belady's optimum.

The replay uses the store's own ExpertCache and policy code (no I/O), at a byte budget turned into
slots (budget // expert_bytes) or at a slot count. The next-layer predictions a version-2 trace
carries are replayed as the store received them (hints); prefetch is not modelled. The "of OPT" column
is each policy's hits as a share of Belady's at the same size.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import ClutorError
from .common import add_command
from ..units import format_bytes, parse_bytes

EXAMPLES = (
    "clutor simulate trace.jsonl --budget 2GiB",
    "clutor simulate trace.jsonl --budget 1GiB,2GiB,3GiB --expert-bytes 6684672 --json",
    "clutor simulate --synthetic --tokens 200 --layers 16 --experts 64 --top-k 8 --skew 1.0 --reuse 0.4 --budget-slots 256",
)


def _csv(convert):
    def parse(text: str) -> list:
        try:
            return [convert(x) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..io.policies import POLICIES

    p.add_argument("trace", nargs="?", help="routing trace (JSONL, see clutor/io/trace.py); omit with --synthetic")
    p.add_argument("--budget", type=_csv(parse_bytes), default=None, metavar="BYTES[,BYTES...]",
                   help="expert cache budget(s), e.g. 2GiB, 512MiB, 1e9")
    p.add_argument("--budget-slots", type=_csv(int), default=None, metavar="N[,N...]",
                   help="cache size(s) in experts instead of bytes")
    p.add_argument("--expert-bytes", type=parse_bytes, default=None,
                   help="bytes of one expert; when omitted, the trace header's expert_bytes")
    p.add_argument("--policies", type=_csv(str), default=list(POLICIES), metavar="NAME[,NAME...]",
                   help=f"policies to compare (known: {', '.join(POLICIES)})")
    p.add_argument("--no-belady", action="store_true", help="skip the offline optimum")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g = p.add_argument_group("synthetic trace")
    g.add_argument("--synthetic", action="store_true", help="generate a trace instead of reading one")
    g.add_argument("--tokens", type=int, default=200)
    g.add_argument("--layers", type=int, default=16)
    g.add_argument("--experts", type=int, default=64)
    g.add_argument("--top-k", type=int, default=8)
    g.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of expert popularity per layer")
    g.add_argument("--reuse", type=float, default=0.4, help="probability an expert of the previous token is reused")
    g.add_argument("--seed", type=int, default=0)


def add_parser(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "simulate", "replay a routing trace through the cache policies", __doc__, *EXAMPLES)
    add_arguments(p)
    return p


def _load(args):
    from ..io.trace import read_trace, synthetic_trace

    if args.synthetic:
        if args.trace:
            raise ClutorError("simulate: give a TRACE file or --synthetic, not both")
        try:
            return synthetic_trace(args.tokens, args.layers, args.experts, args.top_k,
                                   skew=args.skew, reuse=args.reuse, seed=args.seed,
                                   expert_bytes=args.expert_bytes)
        except ValueError as e:
            raise ClutorError(f"simulate --synthetic: {e}") from None
    if not args.trace:
        raise ClutorError("simulate: expected a TRACE file (or --synthetic)")
    return read_trace(args.trace)


def run(args) -> int:
    from ..io.policies import POLICIES
    from ..io.simulate import compare_policies, slots_for_budget

    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        raise ClutorError(f"simulate: unknown policy {', '.join(unknown)}; expected some of {', '.join(POLICIES)}")
    trace = _load(args)
    header = trace.header
    expert_bytes = args.expert_bytes or (header.expert_bytes if header else None)
    sizes: list[tuple[int | None, int]] = []  # (budget bytes or None, slots)
    if args.budget:
        if not expert_bytes:
            raise ClutorError(
                f"{trace.path or 'trace'}: --budget needs the bytes of one expert: "
                "the trace header has no expert_bytes; pass --expert-bytes"
            )
        sizes += [(b, slots_for_budget(b, expert_bytes)) for b in args.budget]
    if args.budget_slots:
        sizes += [(None, n) for n in args.budget_slots]
    if not sizes:
        raise ClutorError("simulate: expected --budget BYTES or --budget-slots N")
    if any(n < 1 for _, n in sizes):
        raise ClutorError(f"simulate: a budget holds no expert (slots: {[n for _, n in sizes]}); expert_bytes={expert_bytes}")

    rows = []
    for budget, n in sizes:
        for r in compare_policies(trace, n, args.policies, belady=not args.no_belady):
            rows.append((budget, r))

    source = trace.path or (
        f"synthetic(tokens={args.tokens}, layers={args.layers}, experts={args.experts}, top_k={args.top_k}, "
        f"skew={args.skew}, reuse={args.reuse}, seed={args.seed})"
    )
    if args.json:
        out = {
            "trace": source,
            "records": len(trace),
            "tokens": trace.n_tokens,
            "expert_bytes": expert_bytes,
            "results": [dict(r.to_json(), budget_bytes=b) for b, r in rows],
        }
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0

    n_layers = header.n_layers if header else len({rec.layer for rec in trace.records})
    print(f"trace: {source}: {trace.n_tokens} tokens, {len(trace)} (token, layer) records, {n_layers} layers")
    # each policy's hits as a share of Belady's at the same size ("-" without Belady)
    opt = {r.n_slots: r.hits for _, r in rows if r.policy == "belady"}
    print(f"{'budget':>10} {'slots':>6} {'/layer':>7}  {'policy':<8} {'hits':>8} {'misses':>8} {'hit rate':>8} "
          f"{'of OPT':>7} {'evictions':>9}")
    for b, r in rows:
        budget = format_bytes(b) if b is not None else "-"
        share = f"{100 * r.hits / opt[r.n_slots]:>6.1f}%" if opt.get(r.n_slots) else f"{'-':>7}"
        print(
            f"{budget:>10} {r.n_slots:>6} {r.n_slots / n_layers:>7.1f}  {r.policy:<8} {r.hits:>8} {r.misses:>8} "
            f"{100 * r.hit_rate:>7.1f}% {share} {r.evictions:>9}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m clutor.cli.simulate` = `clutor simulate`."""
    from . import main as clutor_main

    return clutor_main(["simulate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
