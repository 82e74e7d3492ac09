"""clutor bench-io [PATH]: random-read bandwidth of each I/O backend, beside fio on the same pattern.

For every mode x block size x depth, fio (when installed) runs first, then each Clutor backend.
Without PATH a file of --size random bytes is written (in --dir) and removed afterwards, also on
Ctrl-C. The file's size and the run's length are said before anything starts. The page cache (the
whole machine's) is emptied before each buffered row only with --drop-caches (root).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import asdict

from clutor.errors import ClutorError

from .common import add_command
from clutor.units import format_bytes, parse_bytes

MODES = ("direct", "buffered")
BACKENDS = ("uring", "threads")


def _list(parse):
    def inner(text: str):
        try:
            items = [parse(t) for t in text.split(",") if t.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
        if not items:
            raise argparse.ArgumentTypeError(f"empty list: {text!r}")
        return items
    return inner


def _choices(allowed):
    def parse(t: str) -> str:
        t = t.strip()
        if t not in allowed:
            raise ValueError(f"{t!r} is not one of {', '.join(allowed)}")
        return t
    return _list(parse)


def add_parser(sub):
    p = add_command(sub, "bench-io", "measure disk read bandwidth of the I/O backends (vs fio)", __doc__,
                    "clutor bench-io --block 1MiB,4MiB --depth 8,32 --mode direct --seconds 5")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", default=argparse.SUPPRESS,
                   help="file to read; without it a temporary file of --size is written and removed")
    p.add_argument("--size", type=parse_bytes, default="4GiB", help="size of the temporary test file")
    p.add_argument("--dir", default=argparse.SUPPRESS, help="where to write the test file: /var/tmp, else $TMPDIR")
    p.add_argument("--block", type=_list(parse_bytes), default="128KiB,1MiB,4MiB", help="read sizes")
    p.add_argument("--depth", type=_list(int), default="1,8,32", help="reads in flight")
    p.add_argument("--seconds", type=float, default=5.0, help="duration of each row")
    p.add_argument("--io", type=_choices(BACKENDS), default="uring,threads", help="backends to measure")
    p.add_argument("--mode", type=_choices(MODES), default="direct,buffered", help="O_DIRECT and/or page cache")
    p.add_argument("--repeat", type=int, default=1, help="run each row N times, report the median")
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    p.add_argument("--no-fio", action="store_true", help="do not run fio beside each row")
    p.add_argument("--drop-caches", action="store_true",
                   help="empty the machine's page cache before each buffered row (root; every process's cached "
                        "files go with it)")


def _progress(msg: str) -> None:
    if sys.stderr.isatty():
        print(f"\r\033[K{msg}", end="", file=sys.stderr, flush=True)
    else:
        print(msg, file=sys.stderr, flush=True)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _end_progress() -> None:
    if sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr, flush=True)


def _check_args(args) -> None:
    if args.seconds <= 0:
        raise ClutorError(f"--seconds: expected > 0, got {args.seconds}")
    if args.repeat < 1:
        raise ClutorError(f"--repeat: expected >= 1, got {args.repeat}")
    for b in args.block:
        if b <= 0 or b % 4096:
            raise ClutorError(f"--block: expected positive multiples of 4096 (O_DIRECT), got {b}")
    for d in args.depth:
        if not 1 <= d <= 4096:
            raise ClutorError(f"--depth: expected 1..4096, got {d}")
    if not getattr(args, "path", None) and args.size < max(args.block):
        # refused before the test file is written, not after
        raise ClutorError(f"--size {args.size} bytes is smaller than block {max(args.block)}: "
                          "the test file must hold at least one block")
    if args.drop_caches and os.geteuid() != 0:
        raise ClutorError("--drop-caches needs root (it writes /proc/sys/vm/drop_caches)")


def _plan(args, fio: bool, n_backends: int) -> str:
    """What the run will take, said before it starts."""
    rows = len(args.mode) * len(args.block) * len(args.depth)
    runs = rows * (n_backends + fio) * args.repeat
    seconds = runs * args.seconds
    took = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    return (f"{rows} patterns x {n_backends} backend{'s' if n_backends > 1 else ''}{' + fio' if fio else ''}"
                  f"{f' x {args.repeat} runs' if args.repeat > 1 else ''}, {args.seconds:g} s each: about {took} "
                  "of measuring")


async def run(args) -> int:
    from clutor.bench.disk import drop_caches, fio_huge_pages, fs_type, make_test_file, measure, median_result, run_fio

    _check_args(args)
    created = None
    try:
        fio = None if args.no_fio else shutil.which("fio")
        ios = list(args.io)
        if "uring" in ios and (why_uring := await _uring_unavailable()):
            ios.remove("uring")
            if not ios:
                raise ClutorError(f"--io uring: {why_uring}")
        length = _plan(args, fio is not None, len(ios))
        if getattr(args, "path", None):
            path = args.path
            if not os.path.isfile(path):
                raise ClutorError(f"{path}: not a regular file (expected a file to read)")
            if not os.access(path, os.R_OK):
                raise ClutorError(f"{path}: not readable")
            _say(f"clutor bench-io: reading {path} ({format_bytes(os.path.getsize(path))}); {length}")
        else:
            d = getattr(args, "dir", None) or ("/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir())
            if not os.path.isdir(d):
                raise ClutorError(f"--dir {d}: not a directory")
            free = shutil.disk_usage(d).free
            if args.size > free:
                raise ClutorError(f"--dir {d}: the {format_bytes(args.size)} test file does not fit "
                                  f"({format_bytes(free)} free; --size or --dir)")
            _say(f"clutor bench-io: writing a {format_bytes(args.size)} test file of random bytes in {d} (removed "
                 f"afterwards; --size, --dir, or give a file to read), then {length}")
            fd, created = tempfile.mkstemp(prefix="clutor-bench-io-", suffix=".bin", dir=d)
            os.close(fd)
            os.unlink(created)
            await make_test_file(created, args.size, progress=_progress)
            path = created
        size = os.path.getsize(path)
        too_big = [b for b in args.block if b > size]
        if too_big:
            raise ClutorError(f"{path}: {size} bytes is smaller than block {too_big[0]}")

        drop = args.drop_caches
        notes = [f"file {path}: {format_bytes(size)} on {fs_type(path)}; kernel {platform.release()}"]
        if "buffered" in args.mode:
            notes.append("page cache emptied before each buffered row (--drop-caches)" if drop else
                         "page cache not emptied: buffered rows may be flattered by cached data (--drop-caches, "
                         "as root, empties it before each)")
        if args.repeat > 1:
            notes.append(f"each row: median of {args.repeat} runs (fio and Clutor interleaved); --json has every run")
        if not args.no_fio and fio is None:
            notes.append("fio not installed: no fio column (apt-get install fio)")

        if len(ios) < len(args.io):
            notes.append(f"skipping uring: {why_uring}")
        patterns = [(m, b, d) for m in args.mode for b in args.block for d in args.depth]
        total = len(patterns) * (len(ios) + (fio is not None)) * args.repeat
        step = 0
        rows: list[dict] = []
        for mode, block, depth in patterns:
            direct = mode == "direct"
            fio_runs, ours = [], {io: [] for io in ios}
            for _ in range(args.repeat):
                if fio:
                    step += 1
                    _progress(f"[{step}/{total}] fio {mode} {format_bytes(block)} depth {depth} ...")
                    if not direct and drop:
                        drop_caches()
                    # fio's buffers in huge pages where reserved ones are free, as Clutor's arena's are
                    fio_runs.append(await run_fio(path, direct=direct, block=block, depth=depth, seconds=args.seconds,
                                                  fio=fio, huge=fio_huge_pages(block, depth)))
                for io in ios:
                    step += 1
                    _progress(f"[{step}/{total}] {io} {mode} {format_bytes(block)} depth {depth} ...")
                    if not direct and drop:
                        drop_caches()
                    ours[io].append(await measure(path, io=io, direct=direct, block=block, depth=depth, seconds=args.seconds))
            ref = median_result(fio_runs) if fio_runs else None
            for io in ios:
                r = median_result(ours[io])
                rows.append({
                    **{k: v for k, v in asdict(r).items() if k != "samples_gbps"},
                    "requested_backend": io, "requested_mode": mode,
                    "gbps": round(r.gbps, 4), "iops": round(r.iops, 1), "samples_gbps": list(r.samples_gbps),
                    "loop_cpu_ms_per_gib": None if r.loop_cpu_ms_per_gib is None else round(r.loop_cpu_ms_per_gib, 2),
                    "fio_gbps": round(ref.gbps, 4) if ref else None,
                    "fio_iops": round(ref.iops, 1) if ref else None,
                    "fio_samples_gbps": list(ref.samples_gbps) if ref else None,
                    "ratio": round(r.gbps / ref.gbps, 3) if ref and ref.gbps > 0 else None,
                })
        _end_progress()
        if args.json:
            print(json.dumps({"path": path, "file_bytes": size, "seconds": args.seconds, "repeat": args.repeat,
                              "dropped_caches": drop, "notes": notes, "rows": rows}, indent=2))
        else:
            _print_table(rows, notes)
        return 0
    finally:
        _end_progress()
        if created and os.path.exists(created):
            os.unlink(created)


async def _uring_unavailable() -> str | None:
    from clutor.io.open_backend import open_backend

    try:
        backend = open_backend([], [], io="uring", direct=False, entries=1)
    except ClutorError as e:
        return str(e)
    await backend.aclose()
    return None


def _print_table(rows: list[dict], notes: list[str]) -> None:
    for n in notes:
        print(f"# {n}")
    reasons = sorted({r["fallback_reason"] for r in rows if r["fallback_reason"]})
    for reason in reasons:
        print(f"# fallback: {reason}")
    head = (f"{'backend':<16} {'mode':<9} {'block':>9} {'depth':>5} {'GB/s':>7} {'IOPS':>9} {'fio GB/s':>9} {'ratio':>6}"
            f" {'loop CPU ms/GiB':>15}")
    print(head)
    print("-" * len(head))
    for r in rows:
        fio = f"{r['fio_gbps']:9.3f}" if r["fio_gbps"] is not None else f"{'-':>9}"
        ratio = f"{r['ratio']:6.2f}" if r["ratio"] is not None else f"{'-':>6}"
        backend = r["backend"] if r["backend"] == r["requested_backend"] else f"{r['backend']}*"
        if r.get("driver"):
            backend += f" ({r['driver']})"
        cpu = f"{r['loop_cpu_ms_per_gib']:15.1f}" if r.get("loop_cpu_ms_per_gib") is not None else f"{'-':>15}"
        print(f"{backend:<16} {r['mode']:<9} {format_bytes(r['block']):>9} {r['depth']:>5} "
              f"{r['gbps']:7.3f} {r['iops']:9.0f} {fio} {ratio} {cpu}")


def main(argv: list[str] | None = None) -> int:
    """`python -m clutor.cli.bench_io` = `clutor bench-io`."""
    from . import main as clutor_main

    return clutor_main(["bench-io", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
