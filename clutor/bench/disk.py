"""Disk read benchmark behind ``clutor bench-io``: random aligned reads through each backend, next to fio.

Pattern (the same for Clutor and fio): one file, random offsets that are multiples of the block
size, ``depth`` reads kept in flight for ``seconds``; bandwidth = bytes completed / wall time from
the first submission to the end of the window, counting reads completed inside it (as fio's
``--time_based`` does; reads still in flight at the end are waited for but not counted).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from clutor.errors import ClutorError
from clutor.io.arena import Arena
from clutor.io.backend import ReadRequest
from clutor.io.open_backend import open_backend

__all__ = [
    "IOBenchResult",
    "measure",
    "run_fio",
    "fio_huge_pages",
    "drop_caches",
    "make_test_file",
    "fs_type",
    "median_result",
]


@dataclass(frozen=True)
class IOBenchResult:
    backend: str            # "uring" | "threads" | "fio"
    mode: str               # "direct" | "buffered" (what really ran)
    block: int              # bytes per read
    depth: int              # reads in flight
    seconds: float          # wall time measured
    nbytes: int             # bytes read
    reads: int
    fallback_reason: str | None = None
    samples_gbps: tuple[float, ...] = field(default=())  # every repetition, when repeated
    loop_cpu_seconds: float | None = None  # CPU time of the event-loop thread (submitting, completing)
    driver: str | None = None  # io_uring's: "liburing" | "syscalls"

    @property
    def loop_cpu_ms_per_gib(self) -> float | None:
        """Event-loop CPU per GiB read: what submitting and completing costs the thread the model runs on."""
        if self.loop_cpu_seconds is None or not self.nbytes:
            return None
        return 1e3 * self.loop_cpu_seconds / (self.nbytes / 2**30)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def iops(self) -> float:
        return self.reads / self.seconds if self.seconds > 0 else 0.0


def median_result(results: list[IOBenchResult]) -> IOBenchResult:
    """The repetition with the median bandwidth, carrying every repetition's GB/s."""
    ordered = sorted(results, key=lambda r: r.gbps)
    mid = ordered[(len(ordered) - 1) // 2]
    return IOBenchResult(
        mid.backend, mid.mode, mid.block, mid.depth, mid.seconds, mid.nbytes, mid.reads,
        mid.fallback_reason, tuple(round(r.gbps, 4) for r in results), mid.loop_cpu_seconds, mid.driver,
    )


async def measure(
    path: str, *, io: str, direct: bool, block: int, depth: int, seconds: float, seed: int = 0
) -> IOBenchResult:
    """Random ``block``-aligned reads of ``path`` with ``depth`` in flight for ``seconds``."""
    size = os.path.getsize(path)
    n_blocks = size // block
    if n_blocks < 1:
        raise ClutorError(f"{path}: file of {size} bytes is smaller than one {block}-byte block")
    arena = Arena(depth, block)
    # Threads: one worker per read in flight, so "depth" means the same as for io_uring and fio.
    backend = open_backend(
        [path], [arena.buffer(i) for i in range(depth)], io=io, direct=direct, entries=depth, workers=depth
    )
    rng = np.random.default_rng(seed)
    offsets = (rng.integers(0, n_blocks, size=1 << 16, dtype=np.int64) * block).tolist()
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    st = {"bytes": 0, "reads": 0, "next": 0, "outstanding": 0}
    deadline = 0.0

    def issue(buf: int) -> None:
        i = st["next"]
        st["next"] = i + 1
        (h,) = backend.submit([ReadRequest(0, offsets[i & 0xFFFF], block, buf)])
        h.done.add_done_callback(lambda f: on_done(buf, f))

    def on_done(buf: int, f: asyncio.Future) -> None:
        if finished.done():
            return
        if f.cancelled() or f.exception() is not None:
            finished.set_exception(f.exception() if not f.cancelled() else ClutorError("bench read cancelled"))
            return
        now = loop.time()
        if now < deadline:
            st["bytes"] += f.result()
            st["reads"] += 1
            issue(buf)
        else:  # like fio's time_based runs: reads completing after the window are not counted
            st["outstanding"] -= 1
            if st["outstanding"] == 0:
                finished.set_result(None)

    try:
        cpu0 = time.thread_time()
        t0 = loop.time()
        deadline = t0 + seconds
        st["outstanding"] = depth
        for buf in range(depth):
            issue(buf)
        await finished
        elapsed = deadline - t0
        cpu = time.thread_time() - cpu0
    finally:
        # On error or Ctrl-C, wait for reads already in flight before the arena goes away.
        await backend.aclose()
        arena.close()
    mode = "direct" if backend.direct else "buffered"
    return IOBenchResult(backend.name, mode, block, depth, elapsed, st["bytes"], st["reads"], backend.fallback_reason,
                         loop_cpu_seconds=cpu, driver=getattr(backend, "driver", None))


def fio_huge_pages(block: int, depth: int, meminfo: str = "/proc/meminfo") -> bool:
    """Whether fio can put its ``depth`` x ``block`` buffers in huge pages (``--iomem=shmhuge``): the
    system has that many reserved huge pages free (vm.nr_hugepages; fio cannot use transparent ones)."""
    try:
        info = dict(line.split(":", 1) for line in open(meminfo) if ":" in line)
        free = int(info["HugePages_Free"].split()[0])
        size = int(info["Hugepagesize"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return False
    return size > 0 and free * size >= block * depth + 2 * size  # fio rounds up and aligns


async def run_fio(
    path: str, *, direct: bool, block: int, depth: int, seconds: float, fio: str = "fio", huge: bool = False
) -> IOBenchResult:
    """fio's io_uring engine on the same pattern; raises ClutorError if fio fails. ``huge``: fio's
    buffers in huge pages (``--iomem=shmhuge``), as Clutor's arena asks for its own (clutor.io.arena):
    on a virtio disk the same reads then run up to twice as fast (fewer, larger segments a read)."""
    cmd = [
        fio, "--name=clutor-bench-io", f"--filename={path}", "--readonly", "--ioengine=io_uring",
        f"--direct={int(direct)}", "--rw=randread", f"--bs={block}", f"--iodepth={depth}",
        f"--runtime={seconds:g}", "--time_based", "--norandommap", "--randrepeat=0",
        "--output-format=json",
    ] + (["--iomem=shmhuge"] if huge else [])
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await proc.communicate()
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    text = out.decode(errors="replace")
    if proc.returncode != 0 or "{" not in text:
        raise ClutorError(f"fio failed (exit {proc.returncode}): {err.decode(errors='replace').strip()[:500]}")
    try:
        job = json.loads(text[text.index("{"):])["jobs"][0]
        rd = job["read"]
        runtime_s = rd["runtime"] / 1000.0
        result = IOBenchResult("fio", "direct" if direct else "buffered", block, depth, runtime_s,
                               int(rd["io_bytes"]), int(rd["total_ios"]))
    except (ValueError, KeyError, IndexError) as e:
        raise ClutorError(f"fio output not understood ({e!r}): {text[:300]}") from e
    return result


def drop_caches() -> bool:
    """Empty the page cache (root only). Returns False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        return False
    return True


def fs_type(path: str) -> str:
    """Filesystem type holding ``path`` (from /proc/self/mounts), or "unknown"."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


async def make_test_file(
    path: str, size: int, *, progress: Callable[[str], None] | None = None, chunk: int = 16 << 20
) -> None:
    """Write ``size`` random bytes to a new file ``path`` (removed again if interrupted).

    Written on the loop thread in chunks with a yield between them, so Ctrl-C stops it promptly.
    """
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    if free < size + (1 << 30):
        raise ClutorError(f"{path}: need {size} bytes plus 1 GiB headroom for the test file, {free} free")
    rng = np.random.default_rng()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    ok = False
    try:
        written = 0
        t0 = last = time.monotonic()
        while written < size:
            n = min(chunk, size - written)
            data = rng.bytes(n)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            written += n
            if progress and (written == size or time.monotonic() - last >= 0.5):
                last = time.monotonic()
                rate = written / max(time.monotonic() - t0, 1e-6) / 1e9
                progress(f"writing test file {written / 2**30:.2f}/{size / 2**30:.2f} GiB ({rate:.2f} GB/s)")
            await asyncio.sleep(0)
        os.fsync(fd)
        ok = True
    finally:
        os.close(fd)
        if not ok:
            os.unlink(path)
