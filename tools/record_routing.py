#!/usr/bin/env python3
"""Record decode-order routing traces (version 2: with the next-layer predictions) of a model over text.

The text is fed one token per forward pass (teacher forcing), so every trace record is one decode
step's get() of one layer, in the order a generating model asks its expert store, and each record
carries the experts layer+1's router predicted from that step's hidden state (what the store's
cache policy is told). A fresh sequence starts every ``--window`` tokens (the model's context).

    python tools/record_routing.py MODEL OUT_DIR                     # the three default kinds
    python tools/record_routing.py MODEL OUT_DIR --tokens 3000 --kind notes='/usr/share/doc/*/NEWS*'

Default kinds (Debian files, none used by the tests): Python = third-party packages under
/usr/lib/python3/dist-packages (not the standard library), prose = /usr/share/doc/*/copyright,
C = the kernel's user-space headers /usr/include/linux/*.h. Files are taken in sorted path order;
gzipped files are decompressed. Writes OUT_DIR/KIND.jsonl and OUT_DIR/KIND.sources (files used).
Then: ``clutor simulate OUT_DIR/KIND.jsonl --budget-slots 16,32,64 --policies lru,lfu,lrfu,...``.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import gzip
import os
import sys
import time

DEFAULT_KINDS = {
    "python": "/usr/lib/python3/dist-packages/*/*.py",
    "prose": "/usr/share/doc/*/copyright",
    "c": "/usr/include/linux/*.h",
}


def read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def gather(tokenizer, pattern: str, n_tokens: int, skip_files: int, per_file: int) -> tuple[list[int], list[str]]:
    """n_tokens tokens: at most per_file from each file matching pattern (sorted), after skip_files files."""
    ids: list[int] = []
    used: list[str] = []
    for path in sorted(glob.glob(pattern))[skip_files:]:
        if len(ids) >= n_tokens or not os.path.isfile(path):
            continue
        text = read_text(path).strip()
        if not text:
            continue
        ids.extend(tokenizer.encode(text + "\n\n")[:per_file])
        used.append(path)
    return ids[:n_tokens], used


async def record(model_path: str, out: str, ids: list[int], window: int) -> None:
    import clutor

    async with clutor.Model.open(model_path, io="memory", trace=out) as model:
        for start in range(0, len(ids), window):
            seq = model.new_sequence()
            for tok in ids[start : start + window]:
                await model.forward(seq, [tok])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="GGUF MoE model")
    p.add_argument("out_dir")
    p.add_argument("--tokens", type=int, default=3000, help="tokens per kind")
    p.add_argument("--window", type=int, default=None, help="tokens per sequence (default: the model's n_ctx)")
    p.add_argument("--per-file", type=int, default=1024, help="most tokens taken from one file (more kinds of text)")
    p.add_argument("--skip-files", type=int, default=0, help="skip this many matching files first (another stretch)")
    p.add_argument("--kind", action="append", default=[], metavar="NAME=GLOB",
                   help="a kind of text and its files (repeatable); default: python, prose, c (see above)")
    args = p.parse_args(argv)

    import clutor

    kinds = dict(k.split("=", 1) for k in args.kind) if args.kind else DEFAULT_KINDS
    os.makedirs(args.out_dir, exist_ok=True)
    tok = clutor.Tokenizer.from_gguf(args.model)
    window = args.window
    if window is None:
        async def n_ctx():
            async with clutor.Model.open(args.model, io="memory") as m:
                return m.n_ctx
        window = asyncio.run(n_ctx())
    for name, pattern in kinds.items():
        ids, used = gather(tok, pattern, args.tokens, args.skip_files, args.per_file)
        if len(ids) < args.tokens:
            print(f"{name}: only {len(ids)} tokens in {pattern}", file=sys.stderr)
        if not ids:
            continue
        out = os.path.join(args.out_dir, f"{name}.jsonl")
        t0 = time.perf_counter()
        asyncio.run(record(args.model, out, ids, window))
        with open(os.path.join(args.out_dir, f"{name}.sources"), "w") as f:
            f.write("\n".join(used) + "\n")
        print(f"{name}: {len(ids)} tokens from {len(used)} files ({used[0]} ...) -> {out} "
              f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
