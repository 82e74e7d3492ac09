"""Run a command under a cgroup memory cap (cgroup v1 or v2), to prove memory bounds and to benchmark
"model larger than RAM" on a machine that has plenty.

Needs root (or a delegated cgroup). For ``clutor bench --cap``, ``clutor bench-serve --cap`` and the tests,
never the model path.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

__all__ = ["unavailable_reason", "CapResult", "run_capped", "capped_popen"]

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")
_seq = itertools.count()


def _mode() -> str | None:
    if (V1 / "memory.limit_in_bytes").exists():
        return "v1"
    if (V2 / "cgroup.controllers").exists() and "memory" in (V2 / "cgroup.controllers").read_text():
        return "v2"
    return None


def unavailable_reason() -> str | None:
    """None when a memory cgroup can be made here, else why not."""
    mode = _mode()
    if mode is None:
        return "no cgroup memory controller mounted at /sys/fs/cgroup"
    root = V1 if mode == "v1" else V2
    if not os.access(root, os.W_OK):
        return f"cannot create cgroups under {root} (needs root)"
    return None


@dataclass(frozen=True)
class CapResult:
    returncode: int
    stdout: str
    stderr: str
    limit: int
    peak: int            # the cgroup's peak charge (anonymous memory + page cache), bytes
    oom_killed: bool
    seconds: float


@contextlib.contextmanager
def _cgroup(limit: int, drop_caches: bool):
    """A fresh memory cgroup of `limit` bytes (no swap): yields (enter, peak) where enter() moves the
    calling process into it (a preexec_fn: the child is capped from its first byte) and peak() reads
    its peak charge (bytes, -1 if the kernel does not say). Removed afterwards."""
    why = unavailable_reason()
    if why:
        raise RuntimeError(why)
    mode = _mode()
    cg = (V1 if mode == "v1" else V2) / f"clutor-{os.getpid()}-{next(_seq)}"
    cg.mkdir()
    try:
        if mode == "v1":
            (cg / "memory.limit_in_bytes").write_text(str(limit))
        else:
            (cg / "memory.max").write_text(str(limit))
            (cg / "memory.swap.max").write_text("0")
        if drop_caches:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1")
        procs = str(cg / "cgroup.procs")

        def enter():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        def peak() -> int:
            f = cg / ("memory.max_usage_in_bytes" if mode == "v1" else "memory.peak")
            return int(f.read_text()) if f.exists() else -1

        def oom_killed() -> bool:
            if mode == "v1":
                return "oom_kill 0" not in (cg / "memory.oom_control").read_text()
            events = dict(l.split() for l in (cg / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0)) > 0

        yield enter, peak, oom_killed
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:  # the last process may still be exiting
                time.sleep(0.1)


def run_capped(cmd: Sequence[str], limit: int, *, timeout: float = 900, env: dict | None = None,
               drop_caches: bool = False) -> CapResult:
    """Run cmd inside a fresh memory cgroup limited to `limit` bytes (no swap here); remove it afterwards."""
    with _cgroup(limit, drop_caches) as (enter, peak, oom_killed):
        t0 = time.perf_counter()
        p = subprocess.run(list(cmd), preexec_fn=enter, capture_output=True, text=True, timeout=timeout, env=env)
        dt = time.perf_counter() - t0
        return CapResult(p.returncode, p.stdout, p.stderr, limit, peak(), oom_killed() or p.returncode == -9, dt)


@contextlib.contextmanager
def capped_popen(cmd: Sequence[str], limit: int, *, drop_caches: bool = False, **popen):
    """Start cmd inside a fresh memory cgroup of `limit` bytes and yield (process, peak) where peak()
    reads the cgroup's peak charge so far (bytes, -1 if the kernel does not say). On exit the process
    is killed if still running and the cgroup removed. For long-lived children (a server under test)."""
    with _cgroup(limit, drop_caches) as (enter, peak, _):
        p = subprocess.Popen(list(cmd), preexec_fn=enter, **popen)
        try:
            yield p, peak
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
