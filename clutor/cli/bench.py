"""clutor bench MODEL: end-to-end prefill and decode speed over expert-cache budgets x prefetch x policy,
each configuration in a fresh process, with cache hit rate, bytes read per token and peak memory.

With --vs-llama-cpp the same prompt ids and token count also run through llama.cpp (llama-cpp-python):
(a) unconstrained, the model file warm in the page cache, and (b) where cgroups are available, Clutor
and llama.cpp each inside the same cgroup memory cap (Clutor's own footprint: dense weights + expert
cache + KV cache + a runtime allowance, or --cap SIZE), with the page cache dropped before each run.
Every streamed row is reported against its bounds, measured in the same run (clutor.bench.bounds): the
compute bound (the same workload with the experts in RAM), the disk bound (fio's O_DIRECT bandwidth,
measured just before and after the row, the faster of the two, over Belady's minimal bytes per token replayed on the row's own routing
trace at its cache size), the row's tok/s over min(both), and the same with the row's own bytes per token.
--workload text takes the prompts from the bundled corpus and samples (llama.cpp's default chain), so a
model trained on real text routes as it does on real requests instead of looping greedily; llama.cpp's
rows then decode the ids Clutor's run generated (forced decoding), so both engines run the same forward
passes and routing."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from ..errors import ClutorError
from ..io.policies import DEFAULT_POLICY
from ..model.options import DEFAULTS, IO_CHOICES, KV_TYPES
from .common import add_command
from .source import add_model_source

SLACK_TOKENS = 8  # n_ctx = prompt + generated + this


# ---- argument types (argparse turns ValueError/ArgumentTypeError into a usage message) ----------

def _budgets(text: str):
    from ..bench.runner import parse_budgets

    try:
        return parse_budgets(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _budget(text: str):
    from ..bench.runner import parse_budget

    try:
        return parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _prefetch(text: str) -> list[bool | None]:
    table = {"on": True, "off": False, "auto": None, "default": None}
    out: list[bool | None] = []
    for part in (p.strip().lower() for p in text.split(",")):
        if part not in table:
            raise argparse.ArgumentTypeError(f"prefetch values are on, off or auto; got {part!r}")
        if table[part] not in out:
            out.append(table[part])
    return out


def _names(text: str) -> list[str]:
    out = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not out:
        raise argparse.ArgumentTypeError(f"no name in {text!r}")
    return out


def _cap(text: str) -> int | str:
    t = text.strip().lower()
    if t in ("auto", "none"):
        return t
    from ..units import parse_bytes

    try:
        n = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--cap is auto, none or a size like 3GiB: {e}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError("--cap must be more than 0 bytes")
    return n


def _size(text: str) -> int:
    from ..units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _counts(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected stream counts like 1,4,16, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected stream counts >= 1 like 1,4,16, got {text!r}")
    return out


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {n}")
    return n


def add_parser(sub):
    p = add_command(sub, "bench", "end-to-end tok/s over cache budgets, prefetch and policies (optionally vs llama.cpp)",
                    __doc__, "clutor bench olmoe.gguf --budgets 10%,25%,50%,100% --prefetch on,off",
                    "clutor bench olmoe.gguf --budgets 25% --prefetch on --vs-llama-cpp --cap 3GiB",
                    "clutor bench olmoe.gguf --budgets 256MiB,1GiB --policy lru,lfu --json > bench.json")
    add_model_source(p)
    g = p.add_argument_group("configurations (every combination is one run)")
    g.add_argument("--budgets", type=_budgets, default="10%,25%,50%,100%",
                   help="expert-cache budgets: shares of the expert bytes (25%%), sizes (256MiB) or auto")
    g.add_argument("--prefetch", type=_prefetch, default="on,off", help="on, off and/or auto")
    g.add_argument("--policy", type=_names, default=DEFAULT_POLICY, help="cache eviction policies, comma-separated")
    g.add_argument("--io", choices=IO_CHOICES, default="auto", help="read backend (memory: mmap, no cache)")
    g.add_argument("--buffered", action="store_true", help="read through the page cache instead of O_DIRECT")
    g.add_argument("--activations", choices=("auto", "q8", "f32"), default="auto",
                   help="kernels: int8 activations with integer dot products (q8), float (f32), or auto")
    g.add_argument("--kv-cache", default=None, metavar="SIZE",
                   help="KV pool memory: bytes, '2GiB' or '10%%' of the available memory (default: Model.open's)")
    g.add_argument("--kv-type", choices=KV_TYPES, default=DEFAULTS.kv_type, help="what keys and values are stored as")
    g.add_argument("--prefill-window", type=int, default=None, metavar="N",
                   help="tokens of a long prompt one prefill step takes (default: Model.open's, from memory; 0: "
                        "chunks of step_tokens, each reading the experts again: compare the two on --prompt-tokens 2048)")
    w = p.add_argument_group("workload")
    w.add_argument("--prompt-tokens", type=_positive, default=64, help="prompt length (seeded token ids)")
    w.add_argument("--tokens", type=_positive, default=32, help="tokens to generate (greedy, EOS ignored)")
    w.add_argument("--seed", type=int, default=0, help="seed of the prompts and of sampling")
    w.add_argument("--workload", choices=("ids", "text"), default="ids",
                   help="ids: seeded token ids, greedy decode; text: slices of the bundled corpus, sampled decode "
                        "(llama.cpp's default sampler chain, seeded per stream)")
    w.add_argument("--concurrency", type=_counts, default=None, metavar="N,N,...",
                   help="instead of the sweep: N streams at once (each its own prompt), one run per N and per "
                        "budget/prefetch/policy given (a table each); aggregate and per-stream decode, bytes per step "
                        "and per token, hit rate, event-loop lag, disk-bound limit (capped with --cap SIZE)")
    w.add_argument("--during-prefill", type=_positive, default=None, metavar="N",
                   help="instead of the sweep: N short streams decode alone for --tokens tokens each, then again "
                        "while the prompt prefills; their inter-token latency, p50 and p99, in both phases")
    w.add_argument("--speculative", action="store_true",
                   help="instead of the sweep: decoding with n-gram drafts against without, on an edit, JSON filling "
                        "and prose, in RAM and streamed at the first --budgets under --cap (with --vs-llama-cpp: "
                        "llama.cpp's prompt-lookup decoding beside it)")
    w.add_argument("-md", "--model-draft", dest="model_draft", default=None, metavar="FILE",
                   help="with --speculative: also draft with this small model of the same vocabulary (llama.cpp: "
                        "llama-server -md, found as $CLUTOR_LLAMA_SERVER or on PATH)")
    c = p.add_argument_group("comparison with llama.cpp")
    c.add_argument("--vs-llama-cpp", action="store_true", help="also run llama.cpp, unconstrained and capped")
    c.add_argument("--llama-extra-buffers", choices=("on", "off"), default="on",
                   help="llama.cpp's repacked weight copies in anonymous memory (its default: on); off keeps its "
                        "weights as mmapped file pages, which a cap below the file size needs")
    c.add_argument("--llama-batch", type=int, default=512, metavar="N",
                   help="llama.cpp's n_batch and n_ubatch: the prompt tokens one of its graphs takes, each reading "
                        "every expert once (llama-cpp-python's default: 512; 2048 for long prompts)")
    c.add_argument("--cap", type=_cap, default="auto",
                   help="memory cap of the capped runs: auto (Clutor's estimated footprint), none, or a size")
    c.add_argument("--cap-budget", type=_budget, default=None,
                   help="Clutor's expert cache in the capped run (default: what --cap SIZE leaves, else 25%%)")
    c.add_argument("--allowance", type=_size, default="768MiB",
                   help="runtime memory (interpreter, libraries, scratch) counted in an auto cap")
    m = p.add_argument_group("measurement")
    m.add_argument("--drop-caches", action="store_true", help="drop the page cache before every run (root)")
    m.add_argument("--repeat", type=_positive, default=1,
                   help="run each configuration N times, rounds interleaved; rows show the median, and a fastest "
                        "is named only when its runs all beat every other row's (needs N >= 2). With "
                        "--concurrency, each round runs every stream count's in-RAM bound and its streamed row "
                        "side by side; a row is its median round, and every round's ratios are listed")
    m.add_argument("--fio-seconds", type=float, default=5.0,
                   help="fio disk measurement length, before the run and before each streamed row (0: skip)")
    m.add_argument("--no-bounds", action="store_true",
                   help="skip the bounds: no in-RAM run of the same workload, no trace replay (Belady), no fio per row")
    m.add_argument("--timeout", type=float, default=1800.0, help="seconds before a run is abandoned")
    m.add_argument("--json", action="store_true", help="print the full report as JSON on stdout")
    m.add_argument("--prefix-cache-disk", default=None, metavar="DIR",
                   help="also run the first configuration with its KV pages kept on disk under DIR: cold (an empty "
                        "store), then again in a new process, as after a server restart (warm)")
    m.add_argument("--profile", action="store_true",
                   help="also time each step's spans (attention, router, experts and their kernels, waiting "
                        "for reads, sampling, hand-off) and print where a decode step's time goes")
    return p


# ---- the run ---------------------------------------------------------------------------------

def _say(msg: str, end: str = "\n") -> None:
    print(msg, end=end, file=sys.stderr, flush=True)


def _outcome_line(o) -> str:
    if not o.ok:
        return f"error: {o.error}"
    if "aggregate_decode_tps" in o.result:
        return f"{o.result['aggregate_decode_tps']:.3g} tok/s aggregate ({o.seconds:.0f} s)"
    s = o.result["stats"]
    return f"prefill {s['prefill_tps']:.3g} tok/s, decode {s['decode_tps']:.3g} tok/s ({o.seconds:.0f} s)"


def _best(sweep: list[dict]) -> dict | None:
    ok = [r for r in sweep if r["ok"]]
    return max(ok, key=lambda r: r["result"]["stats"]["decode_tps"]) if ok else None


def _plan_cap(args, path: str, desc: dict, n_ctx: int):
    """(cap bytes, Budget for Clutor in the capped run) or None with the reason the capped runs are skipped."""
    from ..bench.runner import Budget, cache_bytes_for, estimate_footprint, kv_bytes
    from ..bench.memcap import unavailable_reason
    from ..units import format_bytes

    if args.cap == "none":
        return None, "capped comparison skipped (--cap none)"
    why = unavailable_reason()
    if why is not None:
        return None, f"capped comparison skipped: {why}"
    if args.cap == "auto":
        budget = args.cap_budget or Budget("25%", fraction=0.25)
        cache = cache_bytes_for(path, desc, budget)
        return (estimate_footprint(desc, cache, n_ctx, args.allowance), budget), None
    cap = int(args.cap)
    if args.cap_budget is not None:
        return (cap, args.cap_budget), None
    fixed = estimate_footprint(desc, 0, n_ctx, args.allowance)
    left = cap - fixed
    if left < desc["min_expert_cache"]:
        raise ClutorError(
            f"--cap {format_bytes(cap)} leaves {format_bytes(max(left, 0))} for the expert cache after dense weights "
            f"({format_bytes(desc['dense_bytes'])}), KV cache ({format_bytes(kv_bytes(desc, n_ctx))}) and the runtime "
            f"allowance ({format_bytes(args.allowance)}); the minimum is {format_bytes(desc['min_expert_cache'])}: "
            f"raise --cap, lower --allowance, or set --cap-budget")
    return (cap, Budget(format_bytes(left), nbytes=left)), None


class _Progress:
    """One "[k/n] what ... result" line per run on stderr."""

    def __init__(self, total: int):
        self.k, self.total = 0, total

    def start(self, what: str) -> None:
        self.k += 1
        _say(f"[{self.k}/{self.total}] {what} ... ", end="")

    def done(self, outcome) -> None:
        _say(_outcome_line(outcome))


def _check(args) -> tuple[dict, int]:
    """Everything that can be refused before any run starts: (describe(model), n_ctx)."""
    from .info import describe

    if not os.path.isfile(args.model):
        raise ClutorError(f"{args.model}: no such model file")
    desc = describe(args.model)
    n_ctx = args.prompt_tokens + args.tokens + SLACK_TOKENS
    if n_ctx > desc["config"]["n_ctx_train"]:
        raise ClutorError(f"--prompt-tokens + --tokens + {SLACK_TOKENS} = {n_ctx} exceeds the model's context "
                          f"length {desc['config']['n_ctx_train']}")
    if not 1 <= args.llama_batch <= 1 << 16:
        raise ClutorError(f"--llama-batch must be between 1 and 65536 tokens, got {args.llama_batch}")
    if args.drop_caches and os.geteuid() != 0:
        raise ClutorError("--drop-caches needs root (it writes /proc/sys/vm/drop_caches)")
    try:
        from ..io.policies import POLICIES
    except ImportError:
        POLICIES = None
    bad = [p for p in args.policy if POLICIES is not None and p not in POLICIES]
    if bad:
        raise ClutorError(f"unknown cache policy {', '.join(bad)}; expected one of {', '.join(sorted(POLICIES))}")
    if args.vs_llama_cpp and importlib.util.find_spec("llama_cpp") is None:
        raise ClutorError("--vs-llama-cpp needs llama-cpp-python: pip install llama-cpp-python")
    return desc, n_ctx


def run(args) -> int:
    from ..bench.report import render_report
    from ..bench.runner import Budget, disk_bandwidth

    if args.model_draft is not None and not (args.speculative and os.path.isfile(args.model_draft)):
        raise ClutorError(f"-md/--model-draft {args.model_draft}: " + ("no such file" if args.speculative else
                          "drafts are measured with --speculative"))
    desc, n_ctx = _check(args)
    args._slab_bytes = max(1, desc["expert_bytes_one"] // 3)  # one of an expert's three slabs: the store's read
    # (the sweep's capped comparison; --concurrency caps every run at --cap SIZE itself)
    plan, skip_note = (_plan_cap(args, args.model, desc, n_ctx) if args.vs_llama_cpp and not args.concurrency
                       and not args.speculative else (None, None))
    common = {"prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "seed": args.seed, "n_ctx": n_ctx,
              "workload": args.workload}
    file_bytes = sum(os.path.getsize(f) for f in desc["files"])
    report: dict = {
        "model": {"path": args.model, "arch": desc["config"]["arch"], "file_bytes": file_bytes,
                  "dense_bytes": desc["dense_bytes"], "expert_bytes_total": desc["expert_bytes_total"],
                  "expert_bytes_one": desc["expert_bytes_one"]},
        "settings": {**common, "io": args.io, "direct": not args.buffered, "threads": os.cpu_count(),
                     "budgets": [b.text for b in args.budgets], "prefetch": args.prefetch, "policies": args.policy},
    }
    disk = disk_bandwidth(args.model, args.fio_seconds, on_start=_say)
    report["disk"] = {"bytes_per_second": disk.bytes_per_second, "note": disk.note}

    if args.speculative:
        from .bench_spec import run_speculative

        report["settings"]["model_draft"] = args.model_draft

        spec_plan = _plan_cap(args, args.model, desc, n_ctx)[0] if args.io != "memory" else None
        return run_speculative(args, report, spec_plan)

    if args.during_prefill:
        from ..bench.report import render_during
        from ..bench.runner import run_worker

        combos = _combos(args) if args.io != "memory" else [(Budget("none (io memory)"), "-", "-")]
        progress = _Progress(len(combos))
        report["during"] = []
        for combo in combos:
            progress.start(f"clutor budget {combo[0].text}, {args.during_prefill} streams during the prefill")
            o = run_worker(args.model, "clutor", {**_clutor_args(args, common, *combo), "during": args.during_prefill},
                           drop_caches=args.drop_caches, timeout=args.timeout)
            progress.done(o)
            report["during"].append({"budget": combo[0].text, "prefetch": combo[1], "policy": combo[2], **o.to_json()})
        print(json.dumps(report, indent=2) if args.json else render_during(report))
        return 0 if all(r["ok"] for r in report["during"]) else 1

    if args.concurrency:
        # One table per (budget, prefetch, policy). None of these changes the in-RAM bound or llama.cpp's rows:
        # each stream count's bound is measured once (with the first table) and llama.cpp runs with the first.
        combos = _combos(args)
        n_llama = (2 if isinstance(args.cap, int) else 1) if args.vs_llama_cpp else 0
        n = len(args.concurrency) * args.repeat
        progress = _Progress(len(combos) * n + _bounded(args) * n + n_llama)
        computes: dict[int, list[dict]] = {}
        report["concurrency"] = [_concurrency(args, common, report["disk"]["bytes_per_second"], file_bytes,
                                              combo, progress, computes, llama=i == 0 and args.vs_llama_cpp)
                                 for i, combo in enumerate(combos)]
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            from ..bench.report import render_concurrency

            print(render_concurrency(report))
        return 0 if all(r["ok"] for c in report["concurrency"] for r in c["rows"]) else 1

    if args.io == "memory":  # experts read from the mapped file: no cache, so nothing to sweep
        combos = [(Budget("none (io memory)"), "-", "-")]
    else:
        combos = _combos(args)
    bounded = _bounded(args)
    progress = _Progress(len(combos) * args.repeat + bounded + (0 if not args.vs_llama_cpp else 1 if plan is None else 3)
                         + (2 if args.prefix_cache_disk else 0))
    report["compute"] = _compute_run(args, common, None, progress) if bounded else None
    report["sweep"] = sweep = _sweep(args, desc, common, combos, progress, report["compute"])
    report["comparison"] = (_compare(args, common, file_bytes, sweep, plan, skip_note, progress)
                            if args.vs_llama_cpp else None)
    report["restart"] = _restart(args, common, combos[0], progress) if args.prefix_cache_disk else None

    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render_report(report))
    return 0 if any(r["ok"] for r in sweep) else 1


def _restart(args, common: dict, combo: tuple, progress: "_Progress") -> dict:
    """The disk prefix cache across a restart: the same prompt in a process with an empty store (cold),
    then in a new process finding what the first wrote (warm)."""
    import shutil

    from ..bench.runner import run_worker

    where = os.path.join(args.prefix_cache_disk, f"clutor-bench-{os.getpid()}")
    shutil.rmtree(where, ignore_errors=True)
    out = {"dir": where}
    try:
        for phase in ("cold", "warm"):
            progress.start(f"clutor budget {combo[0].text}, prefix cache on disk, {phase}")
            o = run_worker(args.model, "clutor", {**_clutor_args(args, common, *combo), "prefix_cache_disk": where},
                           drop_caches=args.drop_caches, timeout=args.timeout)
            progress.done(o)
            out[phase] = o.to_json()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return out


def _bounded(args) -> bool:
    """Whether the rows get bounds: a streamed run (not io=memory) and not --no-bounds."""
    return not args.no_bounds and args.io != "memory"


def _combos(args) -> list[tuple]:
    """Every (budget, prefetch, policy) asked for, in the order the report lists them."""
    return [(b, pf, pol) for b in args.budgets for pf in args.prefetch for pol in args.policy]


def _compute_run(args, common: dict, streams: int | None, progress: "_Progress") -> dict:
    """The compute bound: the same workload with every expert in RAM (io=memory, page cache warm, uncapped)."""
    from ..bench.runner import preload, run_worker

    progress.start(f"clutor in RAM (the compute bound)" + (f", {streams} stream(s)" if streams else ""))
    preload(args.model)
    opts = {**common, "io": "memory", "direct": True, "activations": args.activations, "trace": True}
    if streams is not None:
        opts["concurrency"] = streams
    o = run_worker(args.model, "clutor", opts, timeout=args.timeout)
    progress.done(o)
    return o.to_json()


def _row_disk(args) -> dict | None:
    """fio just before (or after) a streamed row: the disk it streams from, as it is now (a shared disk
    drifts). Reads of one expert slab (the store's read size), each pattern ``--fio-seconds``: 32 in flight
    and 128 (this shared virtio disk's bandwidth grows with the reads in flight: AMD EPYC here, slab x 32
    0.57-0.62 GiB/s, x 96 0.92-1.13, x 192 1.17, 4 MiB x 8 0.32-0.60; a batched step keeps ~100 in flight);
    the faster is the disk's."""
    from ..bench.runner import disk_bandwidth

    if args.fio_seconds <= 0:
        return None
    slab = -(-args._slab_bytes // 4096) * 4096
    runs = [disk_bandwidth(args.model, args.fio_seconds, block=slab, depth=d) for d in (32, 128)]
    best = max(runs, key=lambda d: d.bytes_per_second or 0)
    return {"bytes_per_second": best.bytes_per_second, "note": best.note, "samples": [d.bytes_per_second for d in runs],
            "huge_pages": all(d.huge_pages for d in runs)}


def _row_disk_after(args, disk: dict | None) -> dict | None:
    """fio again just after the row: the disk bound uses the faster of the two (a bound must not be beaten
    because the disk happened to be slow for fio's few seconds)."""
    after = _row_disk(args)
    if disk is None or after is None:
        return disk or after
    samples = [x for x in disk["samples"] + after["samples"] if x]
    return {"bytes_per_second": max(samples) if samples else None, "note": disk["note"] + " (before; then after)",
            "samples": samples, "huge_pages": disk.get("huge_pages", False) and after.get("huge_pages", False)}


def _concurrency(args, common: dict, disk_bps: float | None, file_bytes: int, combo: tuple,
                 progress: "_Progress", computes: dict[int, list[dict]], *, llama: bool) -> dict:
    """One run per stream count and round (--repeat) at one (budget, prefetch, policy), capped when --cap
    SIZE is given; with the bounds, fio around each and the in-RAM run of the same workload in the same
    round (from ``computes``, stream count -> one result per round, run and kept there the first time a
    count is met: no budget changes it). A row is its median round (by tok/s) with that round's bounds,
    and lists every round's. With llama, llama.cpp's one stream in the same cap and in RAM."""
    from ..bench.runner import preload, run_worker

    budget, prefetch, policy = combo
    cap = args.cap if isinstance(args.cap, int) else None
    bounded = _bounded(args)
    rounds: dict[int, list[dict]] = {n: [] for n in args.concurrency}
    for k in range(args.repeat):
        # Rounds interleaved: a slow spell of a shared machine lands on the in-RAM run and its streamed twin
        # alike, instead of on one row's every run.
        for n in args.concurrency:
            if bounded and len(computes.setdefault(n, [])) <= k:
                computes[n].append(_compute_run(args, common, n, progress))
            compute = computes[n][k] if bounded else None
            disk = _row_disk(args) if bounded else None
            progress.start(f"clutor {n} stream(s), budget {budget.text}, prefetch {_onoff(prefetch)}, {policy}"
                           + (", capped" if cap else "") + (f", round {k + 1}/{args.repeat}" if args.repeat > 1 else ""))
            opts = {**_clutor_args(args, common, budget, prefetch, policy), "concurrency": n, "trace": bounded}
            o = run_worker(args.model, "clutor", opts, cap=cap, drop_caches=cap is not None or args.drop_caches,
                           timeout=args.timeout)
            r = o.result or {}
            _say(f"{r['aggregate_decode_tps']:.3g} tok/s aggregate ({o.seconds:.0f} s)" if o.ok else f"FAILED: {o.error}")
            disk = _row_disk_after(args, disk) if bounded else None
            row = {"streams": n, **o.to_json(), "compute": compute, "disk": disk}
            row["bounds"] = _row_bounds(o.result, compute, disk, "aggregate_decode_tps") if bounded and o.ok else None
            rounds[n].append(row)
    rows = []
    for n in args.concurrency:
        done = sorted((row for row in rounds[n] if row["ok"]), key=lambda row: row["result"]["aggregate_decode_tps"])
        row = dict(done[(len(done) - 1) // 2] if done else rounds[n][0])  # the median round (the lower of an even count)
        row["rounds"] = [{"tps": x["result"]["aggregate_decode_tps"] if x["ok"] else None,
                          "of_bound": (x.get("bounds") or {}).get("of_bound"),
                          "of_own": (x.get("bounds") or {}).get("of_own_bound")} for x in rounds[n]]
        rows.append(row)
    llama_rows = []
    if llama:
        lcommon = {**_llama_args(args, common), **_forced(args, _one_stream(rows))}
        if cap:
            progress.start(f"llama.cpp 1 stream, mmap, capped at {cap}")
            ol = run_worker(args.model, "llama.cpp", lcommon, cap=cap, drop_caches=True, timeout=args.timeout)
            progress.done(ol)
            llama_rows.append({"setting": "capped", **ol.to_json()})
        progress.start("llama.cpp 1 stream, in RAM (page cache warm)")
        preload(args.model)
        ol = run_worker(args.model, "llama.cpp", lcommon, timeout=args.timeout)
        progress.done(ol)
        llama_rows.append({"setting": "in RAM", **ol.to_json()})
    return {"budget": budget.text, "prefetch": prefetch, "policy": policy, "cap": cap, "workload": args.workload,
            "disk_bytes_per_second": disk_bps, "file_bytes": file_bytes, "rows": rows, "llama": llama_rows}


def _row_bounds(result: dict | None, compute: dict | None, disk: dict | None, tps_key: str) -> dict | None:
    """The row's bounds (clutor.bench.bounds) from its own run, its in-RAM twin and the fio before it."""
    from ..bench.bounds import bounds

    if not result:
        return None
    c = (compute or {}).get("result") or {}
    compute_tps = c.get(tps_key) if tps_key in c else (c.get("stats") or {}).get("decode_tps")
    achieved = result.get(tps_key) if tps_key in result else (result.get("stats") or {}).get("decode_tps")
    replay = result.get("replay") or {}
    io = result.get("decode_io") or {}
    return bounds(achieved, compute_tps, (disk or {}).get("bytes_per_second"), replay.get("belady_bytes_per_token"),
                  io.get("bytes_per_token")).to_json()


def _prefill_bounds(result: dict | None, compute: dict | None, disk: dict | None) -> dict | None:
    """The row's time to first token against its bound (clutor.bench.bounds.prefill_bounds): its
    in-RAM twin's prefill, and the distinct experts its prompt routed to over the fio around it."""
    from ..bench.bounds import prefill_bounds

    if not result:
        return None
    c = ((compute or {}).get("result") or {}).get("stats") or {}
    read = (result.get("storage_read_bytes_by_phase") or {}).get("prefill")
    return prefill_bounds(result["stats"]["prefill_seconds"], c.get("prefill_seconds"), (disk or {}).get("bytes_per_second"),
                          (result.get("replay") or {}).get("prefill_distinct_bytes"), read)


def _forced(args, result: dict | None) -> dict:
    """llama.cpp's options to decode the ids a Clutor run generated (forced decoding), so both rows run
    the same forward passes and routing: a sampled stream of llama.cpp's own need not follow Clutor's.
    Only for the text workload, where a single run's (and a 1-stream row's) prompt is llama.cpp's
    (greedy rows choose the argmax: the same ids where the logits agree)."""
    if args.workload != "text" or not result or len(result.get("tokens") or ()) != args.tokens:
        return {}
    digest = result.get("prompt_digest") or (result.get("prompt_digests") or [None])[0]
    return {"forced": result["tokens"], "forced_prompt_digest": digest}


def _forced_note(o) -> str:
    r = o.result or {}
    return f", forced on Clutor's ids (argmax agreed {r['forced_argmax_agree']}/{len(r['tokens'])})" if r.get("forced") else ""


def _one_stream(rows: list[dict]) -> dict | None:
    """The 1-stream row's result, if it ran."""
    return next((r["result"] for r in rows if r["streams"] == 1 and r["ok"]), None)


def _llama_args(args, common: dict) -> dict:
    """llama.cpp's worker options: the workload both engines share, and its own extra-buffers setting."""
    return {**common, "extra_buffers": args.llama_extra_buffers == "on", "n_batch": args.llama_batch}


def _llama_config(args, how: str) -> str:
    how += "" if args.llama_batch == 512 else f", n_batch = n_ubatch = {args.llama_batch}"
    return how if args.llama_extra_buffers == "on" else f"{how}, extra buffers off"


def _clutor_args(args, common: dict, budget, prefetch, policy) -> dict:
    opts = {**common, "io": args.io, "direct": not args.buffered, "profile": args.profile,
            "activations": args.activations, "kv_cache": args.kv_cache, "kv_type": args.kv_type,
            "prefill_window": args.prefill_window}
    if args.io != "memory":
        opts.update(expert_cache=budget.worker_value, prefetch=prefetch, policy=policy)
    return opts


def _sweep(args, desc: dict, common: dict, combos: list, progress: _Progress, compute: dict | None) -> list[dict]:
    """--repeat uncapped Clutor runs per (budget, prefetch, policy), in interleaved rounds (a slow spell of
    the machine then lands on every row alike); each row is its median run, with every run's decode tok/s,
    and against its bounds when asked (fio around that run, the in-RAM run's compute bound)."""
    from ..bench.runner import cache_bytes_for, preload, run_worker

    bounded = compute is not None
    runs: list[list] = [[] for _ in combos]
    for _ in range(args.repeat):
        for i, (budget, prefetch, policy) in enumerate(combos):
            disk = _row_disk(args) if bounded else None
            progress.start(f"clutor budget {budget.text}, prefetch {_onoff(prefetch)}, policy {policy}")
            if args.io == "memory" and not args.drop_caches:
                # The same warm page cache llama.cpp's unconstrained row gets: fio's O_DIRECT reads
                # (and earlier rows) can leave part of the file uncached, which the run would then
                # read from disk and count as compute time.
                preload(args.model)
            o = run_worker(args.model, "clutor", {**_clutor_args(args, common, budget, prefetch, policy), "trace": bounded},
                           drop_caches=args.drop_caches, timeout=args.timeout)
            progress.done(o)
            runs[i].append((o, _row_disk_after(args, disk) if bounded else None))
    sweep: list[dict] = []
    for (budget, prefetch, policy), outcomes in zip(combos, runs):
        try:
            cache = None if args.io == "memory" else cache_bytes_for(args.model, desc, budget)
        except ClutorError:
            cache = None  # the worker says why
        ok = sorted((od for od in outcomes if od[0].ok), key=lambda od: od[0].result["stats"]["decode_tps"])
        row, disk = ok[(len(ok) - 1) // 2] if ok else outcomes[0]  # the median run (the lower one of an even count)
        sweep.append({"budget": budget.text, "cache_bytes": cache, "prefetch": prefetch, "policy": policy,
                      **row.to_json(), "decode_runs": [o.result["stats"]["decode_tps"] for o, _ in ok],
                      "failed_runs": len(outcomes) - len(ok), "disk": disk,
                      "bounds": _row_bounds(row.result, compute, disk, "decode_tps") if bounded and row.ok else None,
                      "prefill_bounds": _prefill_bounds(row.result, compute, disk) if bounded and row.ok else None})
    return sweep


def _compare(args, common: dict, file_bytes: int, sweep: list[dict], plan, skip_note: str | None,
             progress: _Progress) -> dict:
    """llama.cpp unconstrained (vs the fastest sweep row), then Clutor and llama.cpp in the same cap."""
    from ..bench.runner import preload, run_worker
    from ..model.options import mem_available
    from ..units import format_bytes

    notes: list[str] = []
    rows: list[dict] = []
    best = _best(sweep)
    avail = mem_available()
    if avail < file_bytes * 1.1:
        notes.append(f"unconstrained: only {format_bytes(avail)} free for a {format_bytes(file_bytes)} model, "
                     f"so llama.cpp reads part of it from disk")
    progress.start("llama.cpp unconstrained (model preloaded into the page cache)")
    preload(args.model)
    o = run_worker(args.model, "llama.cpp", {**_llama_args(args, common), **_forced(args, (best or {}).get("result"))},
                   timeout=args.timeout)
    progress.done(o)
    rows.append({"setting": "unconstrained", "cap": None,
                 "clutor_config": _config_text(best) + " (the sweep's highest median decode)" if best
                 else "no successful run",
                 "clutor": best, "llama_config": _llama_config(args, "mmap, page cache warm") + _forced_note(o), "llama": o.to_json()})
    if plan is None:
        notes.append(skip_note)
        return {"rows": rows, "notes": notes}

    cap, budget = plan
    # Clutor's prefetch and policy in the cap: those of the fastest sweep row at this budget, else overall.
    like = next((r for r in sweep if r["ok"] and r["budget"] == budget.text), None) or best
    prefetch = like["prefetch"] if like else args.prefetch[0]
    policy = like["policy"] if like else args.policy[0]
    progress.start(f"clutor capped at {format_bytes(cap)}, budget {budget.text}")
    oc = run_worker(args.model, "clutor", _clutor_args(args, common, budget, prefetch, policy), cap=cap,
                    drop_caches=True, timeout=args.timeout)
    progress.done(oc)
    progress.start(f"llama.cpp capped at {format_bytes(cap)}")
    ol = run_worker(args.model, "llama.cpp", {**_llama_args(args, common), **_forced(args, oc.result)}, cap=cap,
                    drop_caches=True, timeout=args.timeout)
    progress.done(ol)
    shown = "none (io memory)" if args.io == "memory" else budget.text
    rows.append({"setting": "capped", "cap": cap, "clutor_config": f"{shown}, prefetch {_onoff(prefetch)}, {policy}",
                 "clutor": oc.to_json(), "llama_config": _llama_config(args, "mmap") + _forced_note(ol), "llama": ol.to_json()})
    how = "--cap" if args.cap != "auto" else (
        f"Clutor's footprint: dense + {budget.text} expert cache + KV + {format_bytes(args.allowance)} allowance")
    notes.append(f"capped: cgroup memory limit {format_bytes(cap)} ({100 * cap / file_bytes:.0f}% of the "
                 f"model file), from {how}; page cache dropped before each run: "
                 f"{'yes' if oc.dropped_caches and ol.dropped_caches else 'no (needs root)'}")
    if like is not None and like["result"]["peak_rss"] > cap:
        notes.append(f"capped: Clutor's uncapped peak RSS at a like configuration was "
                     f"{format_bytes(like['result']['peak_rss'])}, above the cap: expect reclaim or OOM "
                     f"(raise --allowance or --cap)")
    if cap >= file_bytes:
        notes.append("capped: the cap is larger than the model file, so it does not constrain llama.cpp")
    return {"rows": rows, "notes": notes}


def _onoff(v) -> str:
    return {True: "on", False: "off", None: "auto"}.get(v, str(v))


def _config_text(run: dict) -> str:
    return f"{run['budget']}, prefetch {_onoff(run['prefetch'])}, {run['policy']}"
