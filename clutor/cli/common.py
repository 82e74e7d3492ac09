"""Options and output shared by several sub-commands."""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from ..errors import ClutorError
from ..io.policies import POLICIES
from ..model.generate import GenerationStats
from ..model.options import DEFAULTS, IO_CHOICES, KV_TYPES
from ..model.sampling import SamplingParams
from .parsing import add_llama_cpp_habits


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.HelpFormatter):
    """Each option's default shown once, and only where it means something: not for flags (a
    store_true/store_false "default: True" reads as the opposite of what the flag does), not for
    None (the help says what happens), not when the help already states it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is argparse.SUPPRESS
                or action.default == [] or action.nargs == 0 or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def add_command(sub, name: str, help: str, doc: str | None, *examples: str) -> argparse.ArgumentParser:
    """A sub-command's parser: ``help`` in the command list, the module docstring as its description,
    the examples (command lines) after the options."""
    epilog = ("example:" if len(examples) == 1 else "examples:") + "".join(f"\n  {e}" for e in examples)
    return sub.add_parser(name, help=help, formatter_class=Formatter, description=doc, epilog=epilog)


def add_sampling_args(p: argparse.ArgumentParser, *, temperature: float = SamplingParams.temperature,
                      max_tokens: int = 128) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", "--n-predict", "--predict", dest="max_tokens", type=int, default=max_tokens, metavar="N",
                   help="tokens to generate at most; -1 = until end of text or the context is full")
    g.add_argument("--temperature", "--temp", type=float, default=temperature, metavar="T",
                   help="randomness of sampling; 0 = greedy (always the most likely token)")
    g.add_argument("--top-k", type=int, default=SamplingParams.top_k, metavar="K", help="sample among the k most likely tokens (0 = all)")
    g.add_argument("--top-p", type=float, default=SamplingParams.top_p, metavar="P",
                   help="sample among the most likely tokens whose probabilities sum to p (1 = off)")
    g.add_argument("--min-p", type=float, default=SamplingParams.min_p, metavar="P",
                   help="drop tokens less likely than min-p times the most likely one (0 = off)")
    g.add_argument("--repeat-penalty", type=float, default=SamplingParams.repeat_penalty, metavar="X",
                   help="penalise tokens among the last --repeat-last-n, as llama.cpp does (1 = off)")
    g.add_argument("--repeat-last-n", type=int, default=SamplingParams.repeat_last_n, metavar="N",
                   help="tokens of history the penalties look at (0 = none, -1 = all)")
    g.add_argument("--presence-penalty", type=float, default=SamplingParams.presence_penalty, metavar="X",
                   help="subtract this from a token's logit once it is in that history (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=SamplingParams.frequency_penalty, metavar="X",
                   help="subtract this times its count in that history (0 = off)")
    g.add_argument("-s", "--seed", type=int, default=None, help="random seed (default: a fresh one each run)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens (benchmarks)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    add_llama_cpp_habits(p, server=p.prog.endswith(" serve"))
    p.add_argument("-c", "--ctx-size", "--n-ctx", dest="n_ctx", type=int, default=None, metavar="N",
                   help="context length in tokens (default: the file's context_length, shortened where one "
                        "sequence's KV at it would not fit half the memory left; more only where its YaRN reaches)")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="threads for the compute kernels (default: the CPU cores numba sees)")
    p.add_argument("--activations", choices=("auto", "q8", "f32"), default="auto",
                   help="q8: round activations to int8 and use integer dot products, as llama.cpp does; f32: "
                        "float activations, exact up to float rounding; auto: the faster where the CPU has int8 SIMD")
    g = p.add_argument_group("expert streaming")
    g.add_argument("--expert-cache", default=None, metavar="SIZE",
                   help="memory for routed experts: bytes, '4GiB' or '25%%' of the expert bytes "
                        "(default: half the available memory after the dense weights)")
    g.add_argument("--prefetch", choices=("on", "off", "auto"), default=None,
                   help="during decode, read the next layer's predicted experts while this one computes "
                        "whenever the disk is idle (default: auto = in every decode step when the cache holds "
                        "at least 1.5 tokens' experts, where it won on real routing: docs/benchmarks.md)")
    g.add_argument("--policy", default=DEFAULTS.policy, choices=tuple(POLICIES), help="expert cache replacement policy")
    g.add_argument("--io", choices=IO_CHOICES, default=DEFAULTS.io,
                   help="how experts are read: io_uring, a thread pool, or memory (mmap, no cache)")
    d = g.add_mutually_exclusive_group()
    d.add_argument("--direct", dest="direct", action="store_true", default=True,
                   help="O_DIRECT reads that bypass the page cache (the default)")
    d.add_argument("--buffered", dest="direct", action="store_false", help="reads through the page cache")
    g.add_argument("--trace", default=None, metavar="FILE", help="record routing to FILE (JSONL, see `clutor simulate`)")
    b = p.add_argument_group("batching and KV cache")
    b.add_argument("-np", "--parallel", "--max-sequences", dest="max_sequences", type=int,
                   default=DEFAULTS.max_sequences, metavar="N", help="generations advanced together in one step")
    b.add_argument("-b", "--batch-size", "--step-tokens", dest="step_tokens", type=int, default=DEFAULTS.step_tokens,
                   metavar="N",
                   help="tokens one step computes at most (a long prompt's window runs its attention in tiles of N)")
    b.add_argument("--prefill-window", type=int, default=DEFAULTS.prefill_window, metavar="N",
                   help="tokens of a long prompt one prefill step takes, each layer's experts read once for all "
                        "of them (default: what half of the memory left holds, at most the context; 0: chunks of "
                        "--step-tokens)")
    b.add_argument("--prefill-slice-ms", type=float, default=DEFAULTS.prefill_slice_ms, metavar="MS",
                   help="work a long prompt's window does between the other sequences' decode steps "
                        f"(default {DEFAULTS.prefill_slice_ms:g})")
    b.add_argument("--kv-cache", default=DEFAULTS.kv_cache, metavar="SIZE",
                   help="memory for every sequence's keys and values: bytes, '2GiB' or '10%%' of the available "
                        "memory (default: half of what is left after the dense weights and the expert cache, "
                        "capped at --max-sequences full contexts); when full, the newest request waits")
    b.add_argument("--kv-type", choices=KV_TYPES, default=DEFAULTS.kv_type,
                   help="what keys and values are stored as (llama.cpp's default is f16)")
    for short, long, what in (("-ctk", "--cache-type-k", "keys"), ("-ctv", "--cache-type-v", "values")):
        b.add_argument(short, long, choices=KV_TYPES, default=None, metavar="TYPE",
                       help=f"llama.cpp's name for the {what}' type: keys and values share one type here "
                            "(--kv-type), so -ctk and -ctv must agree")
    b.add_argument("--prefix-cache", default=DEFAULTS.prefix_cache, metavar="SIZE",
                   help="KV memory kept from finished sequences for prompts that start the same (0 = off)")
    b.add_argument("--prefix-cache-disk", default=DEFAULTS.prefix_cache_disk, metavar="DIR",
                   help="also keep every full KV page in files under DIR, so a prompt that starts like one seen "
                        "before (even before a restart) loads them instead of computing them (default: off)")
    b.add_argument("--prefix-cache-disk-size", default=DEFAULTS.prefix_cache_disk_size, metavar="SIZE",
                   help=f"bytes the files under --prefix-cache-disk may take (default {DEFAULTS.prefix_cache_disk_size}); "
                        "the least recently used go first")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative", choices=("ngram", "draft", "off"), default=None,
                   help="draft tokens and verify them in one step (each expert read once for all of them); greedy "
                        "output is unchanged. ngram: from n-grams of the prompt, the reply and earlier requests; "
                        "draft: with the draft model (-md). Default: draft with -md, ngram where --draft-max or "
                        "--draft-min is given, else off")
    s.add_argument("--draft-max", "--draft", "--draft-n", "--spec-draft-n-max", dest="draft_max", type=int, default=None, metavar="N",
                   help="drafted tokens per step at most (default 16; fewer where acceptance or the step's cost "
                        "says so)")
    s.add_argument("--draft-min", "--spec-draft-n-min", dest="draft_min", type=int, default=None, metavar="N",
                   help="fewer drafted tokens than this and the step does not speculate (default 0)")
    s.add_argument("-md", "--model-draft", "--spec-draft-model", dest="model_draft", default=None, metavar="FILE",
                   help="a small GGUF model with this model's vocabulary, run in RAM beside it to draft tokens")
    s.add_argument("--draft-p-min", "--spec-draft-p-min", dest="draft_p_min", type=float, default=None, metavar="P",
                   help="the draft model stops drafting where its next token is less likely than P (default 0)")


def check_sampling_args(args) -> None:
    """Refuse impossible sampling options before anything is loaded."""
    if args.max_tokens == 0 or args.max_tokens < -1:
        raise ClutorError(f"-n/--max-tokens must be >= 1, or -1 for no limit; got {args.max_tokens}")
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                   repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed,
                   presence_penalty=args.presence_penalty,
                   frequency_penalty=args.frequency_penalty)  # raises ClutorError naming the option


def sampling_kwargs(args, n_ctx: int | None = None) -> dict:
    """generate() options; -n -1 becomes the whole context (generate stops where it is full)."""
    max_tokens = args.max_tokens if args.max_tokens != -1 else (n_ctx or 1 << 30)
    return dict(max_tokens=max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, seed=args.seed,
                stop=args.stop, ignore_eos=args.ignore_eos)


def _kv_type(args) -> str:
    """--kv-type, or the one type llama.cpp's -ctk / -ctv name."""
    k, v = getattr(args, "cache_type_k", None), getattr(args, "cache_type_v", None)
    given = {t for t in (k, v) if t is not None}
    if len(given) > 1:
        raise ClutorError(f"-ctk {k} with -ctv {v}: keys and values stored as different types are not supported "
                          "here; give both the same type (or --kv-type TYPE)")
    if not given:
        return args.kv_type
    t = given.pop()
    if args.kv_type not in (DEFAULTS.kv_type, t):
        raise ClutorError(f"--kv-type {args.kv_type} with -ctk/-ctv {t}: give one type")
    return t


def speculative_arg(args):
    """Model.open(speculative=...) from --speculative / --draft-max / --draft-min (ClutorError naming the flag)."""
    mode, draft = getattr(args, "speculative", None), getattr(args, "model_draft", None)
    dmax, dmin, pmin = getattr(args, "draft_max", None), getattr(args, "draft_min", None), getattr(args, "draft_p_min", None)
    if mode == "draft" and not draft:
        raise ClutorError("--speculative draft needs a draft model: -md/--model-draft FILE")
    if pmin is not None and not 0.0 <= pmin <= 1.0:
        raise ClutorError(f"--draft-p-min must be a probability in [0, 1], got {pmin}")
    if mode == "off" or (mode is None and not draft and dmax is None and dmin is None):
        return None
    from ..model.speculative import SpeculativeParams

    for flag, v in (("--draft-max", dmax), ("--draft-min", dmin)):
        if v is not None and not (0 if flag == "--draft-min" else 1) <= v <= 64:
            raise ClutorError(f"{flag} must be in [{0 if flag == '--draft-min' else 1}, 64], got {v}")
    kw = {k: v for k, v in (("draft_max", dmax), ("draft_min", dmin), ("draft_p_min", pmin)) if v is not None}
    kw["mode"] = mode or ("draft" if draft else "ngram")
    if kw.get("draft_min", 0) > kw.get("draft_max", SpeculativeParams.draft_max):
        raise ClutorError(f"--draft-min {kw['draft_min']} is larger than --draft-max "
                          f"{kw.get('draft_max', SpeculativeParams.draft_max)}")
    return SpeculativeParams(**kw)


def model_kwargs(args) -> dict:
    if args.threads is not None and args.threads < 1:
        raise ClutorError(f"-t/--threads must be >= 1, got {args.threads}")
    if args.io == "memory" and (args.expert_cache is not None or args.prefetch is not None):
        print("clutor: note: --expert-cache and --prefetch do not apply with --io memory "
              "(experts are mapped from the file, nothing is cached or prefetched)", file=sys.stderr)
    prefetch = None if args.prefetch in (None, "auto") else args.prefetch == "on"
    return dict(n_ctx=args.n_ctx, expert_cache=args.expert_cache, prefetch=prefetch, policy=args.policy,
                io=args.io, direct=args.direct, trace=args.trace, max_sequences=args.max_sequences,
                step_tokens=args.step_tokens, prefill_window=args.prefill_window,
                prefill_slice_ms=args.prefill_slice_ms, prefix_cache=args.prefix_cache,
                prefix_cache_disk=args.prefix_cache_disk, prefix_cache_disk_size=args.prefix_cache_disk_size,
                kv_cache=args.kv_cache,
                kv_type=_kv_type(args), activations=args.activations, threads=args.threads,
                speculative=speculative_arg(args), draft_model=getattr(args, "model_draft", None),
                progress=load_progress())


def read_text_file(path: str, what: str) -> str:
    """A text file's contents (invalid UTF-8 replaced by U+FFFD), or ClutorError naming it."""
    try:
        if not os.path.isfile(path) and os.path.exists(path):  # checked first: a FIFO would block open()
            raise ClutorError(f"{path}: cannot read the {what}: not a regular file")
        with open(path, "rb") as f:
            data = f.read(64 << 20)
    except OSError as e:
        raise ClutorError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    return data.decode("utf-8", errors="replace")


class OutputError(ClutorError):
    """stdout cannot be written (a full disk, a vanished terminal): the command cannot go on."""

    stdout_failed = True  # main() then points stdout at /dev/null so the exit-time flush stays quiet


def write_out(text: str, out=None) -> None:
    """Write generated text to stdout at once; a full disk or a dead terminal becomes ClutorError (a
    closed pipe stays BrokenPipeError: `| head` is a normal way to stop, ended quietly by main)."""
    out = out or sys.stdout
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(f"cannot write the output: {e.strerror or e}") from None


def read_stdin() -> str:
    """All of stdin as text; invalid UTF-8 becomes U+FFFD (the tokenizer's rule for bad bytes)."""
    buf = getattr(sys.stdin, "buffer", None)
    return buf.read().decode("utf-8", errors="replace") if buf is not None else sys.stdin.read()


def warm_kernels(every_architecture: bool = False) -> None:
    """Compile the compute kernels (the first run on a machine, which takes a while) or load
    them from numba's cache, here in the main thread before any event loop, so Ctrl-C stops it at
    once; on a terminal, a line says what is going on if it takes more than two seconds. (Model.open
    warms them too; afterwards that is instant, and no prefill speed ever includes compilation.)
    every_architecture: also the kernels only some architectures call (kernels.warmup)."""
    from ..model import kernels

    done = threading.Event()

    def tell() -> None:
        t0 = time.monotonic()
        if done.wait(2.0):
            return
        while not done.wait(1.0):
            print(f"\rclutor: compiling the compute kernels (once per machine; cached afterwards)... "
                  f"{time.monotonic() - t0:.0f} s", end="", file=sys.stderr, flush=True)
        print("\r\x1b[K", end="", file=sys.stderr, flush=True)

    teller = threading.Thread(target=tell, daemon=True) if sys.stderr.isatty() else None
    if teller is not None:
        teller.start()
    try:
        kernels.warmup(every_architecture=every_architecture)
    finally:
        done.set()
        if teller is not None:
            teller.join()


def byte_progress(desc: str, min_total: int = 256 << 20):
    """progress(done, total) drawing a tqdm bar on a terminal once the work is big enough to wait for
    (None when stderr is not a terminal: logs stay clean)."""
    if not sys.stderr.isatty():
        return None
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            if total < min_total:
                return
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                       file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return progress


def load_progress():
    """A tqdm bar for loading dense weights, shown on a terminal once the load is big enough to wait for."""
    return byte_progress("dense weights")


def print_stats(stats: GenerationStats, file=None) -> None:
    """The per-run report: speed, then (when experts stream) what the cache and the disk did."""
    from ..units import format_bytes

    lines = [
        f"\n[{stats.prompt_tokens} prompt tokens"
        + (f" ({stats.cached_tokens} reused from the prefix cache)" if stats.cached_tokens else "")
        + (f" in {stats.prompt_windows} window{'s' if stats.prompt_windows > 1 else ''}" if stats.prompt_windows else "")
        + f", {stats.prefill_tps:.1f} tok/s prefill | "
        f"{stats.generated_tokens} generated, {stats.decode_tps:.2f} tok/s decode | stop: {stats.stop_reason}]"
    ]
    if stats.draft_steps:
        lines.append(f"[speculative: {stats.drafted_tokens} drafted, {stats.accepted_tokens} kept "
                     f"({stats.acceptance:.0%}) in {stats.draft_steps} steps that drafted]")
    io = stats.io
    if io is not None:
        total = io.wait_seconds + io.compute_seconds
        lines += [
            f"[experts: {io.backend} {io.mode}, cache {format_bytes(io.cache_bytes)} ({stats.cache_note}) | "
            f"hit rate {io.hit_rate:.1%}" + (
                f", {io.prefetch_accuracy:.1%} with prefetches in flight ({io.prefetch_issued} prefetched, "
                f"{io.prefetch_wasted} unused = {format_bytes(io.bytes_wasted)})" if io.prefetch_issued else "") + "]",
            f"[read {format_bytes(io.bytes_read)} = {format_bytes(stats.bytes_per_token)}/token | "
            f"time: waiting on disk {io.wait_seconds:.2f}s ({io.wait_seconds / total:.0%}), "
            f"computing {io.compute_seconds:.2f}s | peak RSS {format_bytes(stats.peak_rss)}]"
            if total > 0 else f"[read {format_bytes(io.bytes_read)} | peak RSS {format_bytes(stats.peak_rss)}]",
        ]
    else:
        lines.append(f"[experts mapped from the file | peak RSS {format_bytes(stats.peak_rss)}]")
    print("\n".join(lines), file=file or sys.stderr)
