"""clutor demo: build a small random-weight MoE model once (nothing is downloaded), then generate from it.

The model's weights are random, so the text is gibberish: the demo shows the machinery and its
statistics, not language."""
from __future__ import annotations

import os
import shutil
import sys
import textwrap

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
    print(introduction(path, args.expert_cache), file=sys.stderr)
    warm_kernels()
    return _generate(args, path)


def introduction(path, expert_cache: str) -> str:
    """What the demo runs and what to expect of its text, said before it runs."""
    from ..units import format_bytes
    from .info import describe

    d = describe(str(path))
    c = d["config"]
    width = max(60, min(shutil.get_terminal_size().columns, 110))
    return "\n".join(textwrap.fill(para, width, subsequent_indent="  ", break_long_words=False,
                                               break_on_hyphens=False) for para in (
        f"clutor demo: {format_bytes(os.path.getsize(path))} OLMoE-shaped model, {c['n_layers']} layers x "
            f"{c['n_expert']} experts (top-{c['n_expert_used']}), built here once (nothing was downloaded): {path}",
        f"  Its weights are random: the text is gibberish by design. What the demo shows is the machinery: "
            f"{format_bytes(d['dense_bytes'])} of dense weights resident, {format_bytes(d['expert_bytes_total'])} of "
            f"experts streamed from disk through a {expert_cache} expert cache, and what that costs (below)."))


LEGEND = """how to read the report:
  prefill / decode     prompt tokens computed per second / generated tokens per second after the first
  experts: uring|threads direct|buffered
                       how experts were read from disk: io_uring or a thread pool; direct = O_DIRECT,
                       bypassing the page cache (so the figures are the disk's, not the page cache's)
  cache N (...)        the memory the expert cache holds (whole expert slots that fit in what was asked)
  hit rate             routed experts found in the cache; each miss was a read from disk
  read N = N/token     expert bytes read from disk, in all and per token
  waiting on disk / computing
                       where the time went: waiting for expert reads vs the model's own arithmetic
  peak RSS             the most memory the process held"""


def next_steps(path) -> str:
    return f"""\
next (DEMO = {path}):
  clutor pull Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M   a real MoE model from the Hugging Face Hub (about 19 GB)
  clutor chat Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M   talk to it (`clutor info NAME` first says what streaming it costs)
  clutor serve DEMO                            this model behind an OpenAI-compatible API (model id clutor-demo)
  clutor bench DEMO --budgets 10%,50%,100%     its speed at other expert-cache sizes"""


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
    print(f"\n{LEGEND}\n{next_steps(path)}", file=sys.stderr)
    return 0
