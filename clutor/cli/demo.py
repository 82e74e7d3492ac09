"""clutor demo: build a small random-weight MoE model once (nothing is downloaded), then generate from it.

The model's weights are random, so the text is gibberish: the demo shows the machinery and its
statistics, not language."""
from __future__ import annotations

import sys

from ..errors import ClutorError
from .common import add_command, byte_progress, print_stats, warm_kernels, write_out


def add_parser(sub):
    p = add_command(sub, "demo", "generate from a built-in random-weight model", __doc__, "clutor demo -n 32")
    p.add_argument("-n", "--max-tokens", type=int, default=48, help="tokens to generate")
    p.add_argument("--prompt", default="Once upon a time, in a land of many experts,", help="the prompt")
    p.add_argument("--cache-dir", default=None,
                   help="where the demo model is written (default: $XDG_CACHE_HOME/clutor or ~/.cache/clutor)")
    p.add_argument("--expert-cache", default="256MiB", help="memory for routed experts (the model has ~900 MB)")
    p.add_argument("--io", choices=("auto", "uring", "threads"), default="auto", help="how experts are read")
    return p


def run(args):
    """Build the model here, in the main thread, before any event loop runs: Ctrl-C then stops the
    write at once (and its temporary file is removed) instead of waiting for a worker thread."""
    from .demo_model import ensure_demo_model

    if args.max_tokens < 1:
        raise ClutorError(f"-n/--max-tokens must be >= 1, got {args.max_tokens}")
    path = ensure_demo_model(args.cache_dir, progress=byte_progress("building the demo model", 0))
    print(f"demo model: {path}", file=sys.stderr)
    warm_kernels()
    return _generate(args, path)


async def _generate(args, path) -> int:
    from ..model.model import Model

    async with Model.open(path, expert_cache=args.expert_cache, io=args.io) as model:
        write_out(args.prompt)
        async for out in model.generate(args.prompt, max_tokens=args.max_tokens, temperature=0.8, seed=0,
                                        ignore_eos=True):
            if out.text:
                write_out(out.text)
            if out.stats:
                print_stats(out.stats)
    return 0
