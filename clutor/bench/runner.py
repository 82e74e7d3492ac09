"""Start benchmark workers, each in its own process (optionally inside a cgroup memory cap), and
measure the disk the experts stream from.

A fresh process per configuration keeps runs independent (no cache, allocator or JIT state carried
over) and is what lets a run be capped: the cgroup charges everything the worker touches, its own
memory and the page cache it pulls in.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ClutorError
from ..units import format_bytes, parse_bytes
from .protocol import parse_result

__all__ = [
    "Budget", "parse_budget", "parse_budgets", "RunOutcome", "run_worker", "DiskBandwidth",
    "disk_bandwidth", "cache_bytes_for", "estimate_footprint", "kv_bytes", "drop_page_cache", "preload",
]

WORKERS = {"clutor": "clutor.bench.worker", "llama.cpp": "clutor.bench.llama_worker",
           "speculative": "clutor.bench.spec_worker"}  # (both engines: its "engine" option says which)
FIO_BLOCK = 4 << 20
FIO_DEPTH = 8


# ---- budgets ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Budget:
    """An expert-cache budget as written on the command line: a share of the expert bytes, a size, or auto."""

    text: str
    fraction: float | None = None  # 0.25 for "25%"
    nbytes: int | None = None      # for sizes

    @property
    def worker_value(self) -> int | str | None:
        """What Model.open(expert_cache=...) receives."""
        if self.fraction is not None:
            return self.text
        return self.nbytes  # None for auto: the model's default


def parse_budget(text: str) -> Budget:
    """ "25%" -> a share of the expert bytes; "256MiB", "3GiB", "1e9" -> bytes; "auto" -> the default.

    Raises ValueError with a message naming the text."""
    t = text.strip()
    if t.lower() in ("auto", "default"):
        return Budget("auto")
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            raise ValueError(f"not a budget: {text!r} (expected e.g. 25%, 256MiB, 3GiB or auto)") from None
        if not 0 < pct <= 100:
            raise ValueError(f"a budget share must be in (0%, 100%], got {text!r}")
        return Budget(t, fraction=pct / 100)
    try:
        n = parse_bytes(t)
    except ValueError as e:
        raise ValueError(f"not a budget: {text!r} (expected e.g. 25%, 256MiB, 3GiB or auto): {e}") from None
    if n <= 0:
        raise ValueError(f"a budget must be more than 0 bytes, got {text!r}")
    return Budget(t, nbytes=n)


def parse_budgets(text: str) -> list[Budget]:
    """A comma-separated list of budgets, in order, duplicates removed."""
    out: list[Budget] = []
    for part in text.split(","):
        if part.strip():
            b = parse_budget(part)
            if b not in out:
                out.append(b)
    if not out:
        raise ValueError(f"no budget in {text!r}")
    return out


def cache_bytes_for(path: str, describe: dict, budget: Budget) -> int:
    """Bytes the model's expert cache will hold for this budget.

    Asks the model's own budget resolver when there is one (it sizes by O_DIRECT-aligned slots), so a
    cap computed from this figure matches what the worker really allocates."""
    try:
        from ..model.arch import read_arch
        from ..model.gguf import GGUFFile
        from ..model.options import resolve_budget
        from ..model.weights import expert_layout
    except ImportError:
        resolve_budget = None
    if resolve_budget is not None:
        cfg = describe["config"]
        with GGUFFile.open(path) as f:
            layout = expert_layout(f, read_arch(f))
        nbytes, _why = resolve_budget(budget.worker_value, layout, cfg["n_expert_used"], describe["dense_bytes"])
        return int(nbytes)
    if budget.fraction is not None:
        return int(describe["expert_bytes_total"] * budget.fraction)
    if budget.nbytes is not None:
        return budget.nbytes
    raise ClutorError("cannot tell the size of the default expert cache: pass an explicit budget")


def kv_bytes(describe: dict, n_ctx: int) -> int:
    """Clutor's KV cache: float32, as the architecture lays it out (keys and values, or MLA's latent),
    for every layer that has one (a hybrid's attention layers) and position, plus a recurrent model's
    fixed state (one sequence's, and as much again for its checkpoint at the prompt's end)."""
    c = describe["config"]
    n_layers = c["n_layers"] if c.get("kv_layers") is None else len(c["kv_layers"])
    state = 2 * c.get("recurrent_bytes", 0)
    if "kv_floats" in c:
        return n_layers * c["kv_floats"] * n_ctx * 4 + state
    return n_layers * c["n_head_kv"] * n_ctx * (c["head_dim"] + c["head_dim_v"]) * 4 + state


def estimate_footprint(describe: dict, cache_bytes: int, n_ctx: int, allowance: int) -> int:
    """What a Clutor process should need: dense weights + expert cache + KV cache + runtime allowance
    (interpreter, numpy, numba, tokenizer, scratch)."""
    return describe["dense_bytes"] + cache_bytes + kv_bytes(describe, n_ctx) + allowance


# ---- running workers ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RunOutcome:
    engine: str
    args: dict
    result: dict | None        # the worker's JSON line (None when it printed none)
    error: str | None          # why the run failed, one line; None on success
    detail: str | None         # the worker's traceback when it failed on a bug
    cap: int | None            # cgroup memory limit, bytes
    cgroup_peak: int | None    # the cgroup's peak charge (process memory + page cache), bytes
    oom_killed: bool
    dropped_caches: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None and self.result is not None

    def to_json(self) -> dict:
        return {"engine": self.engine, "args": self.args, "ok": self.ok, "error": self.error, "detail": self.detail,
                "cap": self.cap,
                "cgroup_peak": self.cgroup_peak, "oom_killed": self.oom_killed,
                "dropped_caches": self.dropped_caches, "seconds": self.seconds, "result": self.result}


def _env() -> dict:
    """The parent's environment with this clutor first on the path, so workers import the same code."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def drop_page_cache() -> bool:
    """sync + drop the page cache (root only); False when not permitted."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


def run_worker(model: str, engine: str, args: dict, *, cap: int | None = None, drop_caches: bool = False,
               timeout: float = 1800) -> RunOutcome:
    """Run one worker to completion; failures come back as RunOutcome.error, never as exceptions."""
    cmd = [sys.executable, "-m", WORKERS[engine], model, "--json-args", json.dumps(args)]
    dropped = drop_page_cache() if drop_caches else False
    t0 = time.perf_counter()
    peak, oom = None, False
    try:
        if cap is None:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
            rc, out, err = p.returncode, p.stdout, p.stderr
        else:
            from .memcap import run_capped

            c = run_capped(cmd, cap, timeout=timeout, env=_env())
            rc, out, err, peak, oom = c.returncode, c.stdout, c.stderr, c.peak, c.oom_killed
    except subprocess.TimeoutExpired:
        return RunOutcome(engine, args, None, f"timed out after {timeout:g} s", None, cap, None, False, dropped,
                          time.perf_counter() - t0)
    except (OSError, RuntimeError) as e:  # cgroup creation failed
        return RunOutcome(engine, args, None, f"could not start the worker: {e}", None, cap, None, False,
                          dropped, time.perf_counter() - t0)
    dt = time.perf_counter() - t0
    result = parse_result(out)
    error = detail = None
    if oom or rc == -9:
        error = (f"killed: out of memory inside the {format_bytes(cap)} cgroup cap" if cap is not None
                 else "killed (signal 9; out of memory?)")
    elif result is not None and "error" in result:
        error = result["error"]
    elif rc != 0 or result is None:
        tail = [l for l in err.strip().splitlines() if l.strip()]
        error = f"worker exited with {rc}: " + (tail[-1] if tail else "no output")
    if result is not None and "error" in result:
        detail = result.get("traceback")
        result = None
    return RunOutcome(engine, args, result, error, detail, cap, peak, oom, dropped, dt)


# ---- the disk --------------------------------------------------------------------------------

@dataclass(frozen=True)
class DiskBandwidth:
    bytes_per_second: float | None  # None when not measured
    note: str                       # how it was measured, or why not
    huge_pages: bool = False        # fio's buffers were in huge pages, as Clutor's are


def disk_bandwidth(path: str, seconds: float, on_start: Callable[[str], None] | None = None, *,
                   block: int = FIO_BLOCK, depth: int = FIO_DEPTH) -> DiskBandwidth:
    """Random ``block`` O_DIRECT reads of the model file, ``depth`` in flight, for ``seconds`` with fio
    (io_uring); by default 4 MiB x 8 (the run's headline figure; each streamed row measures its own, deeper).
    ``on_start(message)`` just before fio runs."""
    if seconds <= 0:
        return DiskBandwidth(None, "disk not measured (--fio-seconds 0)")
    fio = shutil.which("fio")
    if fio is None:
        return DiskBandwidth(None, "disk not measured: fio is not installed (apt-get install fio)")
    size = os.path.getsize(path)
    if size < 16 * max(block, FIO_BLOCK):
        return DiskBandwidth(None, f"disk not measured: the model file ({format_bytes(size)}) is too small for "
                                   f"{format_bytes(block)} random reads to mean anything")
    from .disk import fio_huge_pages, run_fio

    if on_start is not None:
        on_start(f"measuring the disk with fio ({seconds:g} s) ...")
    # Clutor reads into huge pages (clutor.io.arena), which a virtio disk serves up to twice as fast as
    # the same reads into small ones: fio's buffers are put in huge pages too wherever the system has
    # them reserved, else the bound is the small-page figure and a row can beat it (the note says so).
    # (huge pages free but not this process's to take, by shmget's permission or shmmax: small pages then)
    refused = ""
    for huge in ([True, False] if fio_huge_pages(block, depth) else [False]):
        try:
            r = asyncio.run(run_fio(path, direct=True, block=block, depth=depth, seconds=seconds, fio=fio, huge=huge))
            break
        except ClutorError as e:
            if not huge:
                return DiskBandwidth(None, f"disk not measured: {e}")
            refused = f"; fio could not take huge pages ({e})"
    if r.seconds <= 0 or r.nbytes <= 0:
        return DiskBandwidth(None, "disk not measured: fio read nothing")
    bps = r.nbytes / r.seconds
    pages = ("buffers in huge pages" if huge else
             "buffers in 4 KiB pages (none reserved free, vm.nr_hugepages; Clutor's reads go to huge pages "
             "and may run faster)")
    return DiskBandwidth(bps, f"fio randread of the model file, {format_bytes(block)} blocks, depth "
                              f"{depth}, O_DIRECT, io_uring, {pages}, {r.seconds:.1f} s: {bps / 2**30:.2f} GiB/s"
                              f"{refused}", huge_pages=huge)


def preload(path: str, chunk: int = 16 << 20) -> float:
    """Read the whole file once so it sits in the page cache ("model in RAM"); returns seconds."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0
