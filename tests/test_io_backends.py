"""Conformance suite for every read backend: io_uring and threads, each with and without O_DIRECT.

Every test runs its coroutine on a fresh event loop whose exception handler records; a test fails
if the loop logged anything (an exception in a callback, a future exception never retrieved).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import hashlib
import os
import random
from pathlib import Path

import numpy as np
import pytest

from conftest import resident_bytes, run_on_loop, smaps_field

from clutor.errors import ClosedError, ClutorError, ClutorIOError
from clutor.io import backend as backend_mod
from clutor.io import uring as uring_mod
from clutor.io import uring_sys as uring_sys_mod
from clutor.io.arena import Arena, round_up, widen
from clutor.io.backend import ReadHandle, ReadRequest, ReadState
from faults import FaultyBackend
from clutor.io.open_backend import open_backend
from clutor.io.threads import ThreadBackend
from clutor.io.uring import UringBackend, UringUnavailable
from clutor.io.uring_sys import SyscallUringBackend, syscall_uring_unavailable

FILE_SIZE = 6 * 1024 * 1024 + 12345  # deliberately not block aligned: the last block is partial
ALIGN = 4096


# -- event loop with a recording exception handler: conftest.run_on_loop
run = run_on_loop


# -- files on a filesystem that takes O_DIRECT --------------------------------------------------
def _direct_ok(d: str) -> bool:
    probe = os.path.join(d, ".odirect_probe")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * ALIGN)
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            buf = Arena(1, ALIGN)
            os.preadv(fd, [buf.buffer(0)], 0)
            buf.close()
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two files of random bytes in a directory where O_DIRECT works (tmp_path, else /var/tmp)."""
    d = str(tmp_path_factory.mktemp("io"))
    if not _direct_ok(d) and os.path.isdir("/var/tmp") and _direct_ok("/var/tmp"):
        d = os.path.join("/var/tmp", f"clutor-io-test-{os.getpid()}")
        os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(1234)
    files, contents = [], []
    for i, size in enumerate((FILE_SIZE, 3 * ALIGN + 100)):
        b = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        p = os.path.join(d, f"data{i}.bin")
        with open(p, "wb") as f:
            f.write(b)
        files.append(p)
        contents.append(b)
    yield {"dir": d, "files": files, "bytes": contents, "direct_ok": _direct_ok(d)}
    for p in files:
        os.unlink(p)


_URING_REASON: list[str | None] = []


def uring_unavailable() -> str | None:
    if not _URING_REASON:
        async def probe():
            try:
                b = UringBackend([], [], direct=False, entries=2)
            except UringUnavailable as err:
                return str(err)
            await b.aclose()
            return None
        # in a thread of its own: callers may already be inside a running event loop
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            _URING_REASON.append(pool.submit(asyncio.run, probe()).result())
    return _URING_REASON[0]


_SYS_REASON: list[str | None] = []


def sys_uring_unavailable() -> str | None:
    """Why the raw-syscall io_uring driver cannot run here (CPU, or the kernel refusing a ring), or None."""
    if not _SYS_REASON:
        why = syscall_uring_unavailable()
        if why is None:
            async def probe():
                try:
                    b = SyscallUringBackend([], [], direct=False, entries=2)
                except UringUnavailable as err:
                    return str(err)
                await b.aclose()
                return None
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                why = pool.submit(asyncio.run, probe()).result()
        _SYS_REASON.append(why)
    return _SYS_REASON[0]


# uring: liburing's wheel; uring-sys: our driver over the raw system calls, with registered buffers
# (READ_FIXED) and, in the -plain case, without them (READ into the same addresses).
CASES = [("uring", True), ("uring", False), ("uring-sys", True), ("uring-sys", False), ("uring-sys-plain", True),
         ("threads", True), ("threads", False)]
URING_KINDS = ("uring", "uring-sys", "uring-sys-plain")


@pytest.fixture(params=CASES, ids=[f"{k}-{'direct' if d else 'buffered'}" for k, d in CASES])
def case(request, data):
    kind, direct = request.param
    if kind == "uring" and (why := uring_unavailable()):
        pytest.skip(why)
    if kind.startswith("uring-sys") and (why := sys_uring_unavailable()):
        pytest.skip(why)
    if direct and not data["direct_ok"]:
        pytest.skip(f"no directory here takes O_DIRECT (tried {data['dir']} and /var/tmp)")
    return kind, direct


def uring_class(kind: str):
    return UringBackend if kind == "uring" else SyscallUringBackend


def make(kind: str, direct: bool, files, buffers, **kw):
    if kind == "uring":
        return UringBackend(files, buffers, direct=direct, entries=kw.get("entries", 64))
    if kind.startswith("uring-sys"):
        b = SyscallUringBackend(files, buffers, direct=direct, entries=kw.get("entries", 64),
                                fixed_buffers=kind == "uring-sys")
        assert b.fixed_buffers is (kind == "uring-sys" and len(buffers) > 0), b.fixed_reason
        return b
    return ThreadBackend(files, buffers, direct=direct, workers=kw.get("workers", 3))


def sha(b) -> str:
    return hashlib.sha256(bytes(b)).hexdigest()


# -- pure helpers -------------------------------------------------------------------------------
def test_widen_covers_wanted_bytes_with_aligned_bounds():
    rng = random.Random(7)
    for _ in range(2000):
        align = rng.choice((512, 4096, 65536))
        off, length = rng.randrange(0, 1 << 30), rng.randrange(0, 1 << 22)
        a_off, a_len, skip = widen(off, length, align)
        assert a_off % align == 0 and a_len % align == 0
        assert a_off + skip == off and 0 <= skip < align
        assert a_off + a_len >= off + length
        assert a_len - (skip + length) < align  # no more than one extra block
    assert widen(8192, 4096, 4096) == (8192, 4096, 0)
    assert widen(8191, 2, 4096) == (4096, 8192, 4095)


def test_arena_slots_are_aligned_disjoint_and_spares_follow():
    with Arena(3, 10_000, n_spare=2) as a:
        assert a.slot_bytes == round_up(10_000, 4096) and a.nbytes == 5 * a.slot_bytes
        addrs = [a.slot(i).ctypes.data for i in range(5)]
        assert all(x % 4096 == 0 for x in addrs)
        assert addrs == sorted(addrs) and all(b - x == a.slot_bytes for x, b in zip(addrs, addrs[1:]))
        assert a.spare(1).ctypes.data == addrs[4] and a.spare_index(0) == 3
        for i in range(5):
            a.slot(i)[:] = i + 1
        assert all(int(a.slot(i).min()) == int(a.slot(i).max()) == i + 1 for i in range(5))
        r = a.region(2, 4096, 5000)
        assert len(r) == 5000 and np.frombuffer(r, np.uint8).ctypes.data == addrs[2] + 4096
        with pytest.raises(ValueError):
            a.region(2, 100, 10)  # unaligned start
        with pytest.raises(ValueError):
            a.region(2, 8192, a.slot_bytes)  # past the slot
        with pytest.raises(IndexError):
            a.slot(5)
    assert a.closed
    with pytest.raises(ClosedError):
        a.slot(0)
    a.close()  # idempotent


def test_arena_close_with_pinned_buffer_releases_pages_without_error():
    liburing = pytest.importorskip("liburing")
    a = Arena(2, 8192)
    iov = liburing.Iovec([a.buffer(1)])  # pins the mapping's export forever
    view = a.slot(1)
    view[:] = 9
    a.close()  # must not raise BufferError
    assert int(view.max()) == 0  # pages returned to the kernel (MADV_DONTNEED): stale view reads zeros
    del iov


def test_arena_asks_for_huge_pages():
    """The slots are advised as transparent huge pages (smaps' VmFlags "hg"): an O_DIRECT read into
    them then pins a few 2 MiB pages, not 544 small ones a slab (clutor.io.arena)."""
    import os
    mode = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists("/proc/self/smaps") or not os.path.exists(mode) or "[never]" in Path(mode).read_text():
        pytest.skip("needs Linux with transparent huge pages (not 'never')")
    with Arena(2, 4 << 20) as a:
        assert "hg" in smaps_field(a.slot(1).ctypes.data, "VmFlags")


def test_arena_populate_faults_every_page_in():
    """populate() makes every slot resident at once: no read's submit faults its buffer in later (on
    the event loop, where a cold slot's first O_DIRECT read cost 70-90 ms a submit)."""
    import os
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("needs Linux's /proc/self/smaps")
    with Arena(3, 4 << 20, n_spare=1) as a:
        addr = a.slot(0).ctypes.data
        assert resident_bytes(addr) < a.nbytes  # an anonymous mapping starts with no page of its own
        a.populate()
        assert resident_bytes(addr) >= a.nbytes
        assert int(a.slot(3).max()) == 0  # still zeros


def test_arena_larger_alignment():
    with Arena(2, 100, align=1 << 16) as a:
        assert a.slot_bytes == 1 << 16
        assert all(a.slot(i).ctypes.data % (1 << 16) == 0 for i in range(2))


# -- conformance --------------------------------------------------------------------------------
def test_random_aligned_reads_match_file(case, data):
    kind, direct = case
    path, content = data["files"][0], data["bytes"][0]
    rng = random.Random(1)

    async def main():
        arena = Arena(24, 256 * 1024)
        b = make(kind, direct, [path], [arena.buffer(i) for i in range(24)])
        assert b.direct is direct and b.align == (ALIGN if direct else 1)
        for _ in range(15):
            reqs = []
            for buf in range(24):
                length = rng.randrange(1, 64) * ALIGN
                off = rng.randrange(0, (FILE_SIZE - length) // ALIGN) * ALIGN
                reqs.append(ReadRequest(0, off, length, buf))
            got = await asyncio.gather(*(h.wait() for h in b.submit(reqs)))
            for r, n in zip(reqs, got):
                assert n == r.length
                assert sha(arena.slot(r.buf)[:n]) == sha(content[r.offset:r.offset + r.length])
        assert b.inflight() == 0
        await b.aclose()
        arena.close()

    run(main)


def test_unaligned_wanted_bytes_through_widen(case, data):
    kind, direct = case
    paths, contents = data["files"], data["bytes"]
    rng = random.Random(2)

    async def main():
        arena = Arena(8, 128 * 1024)
        b = make(kind, direct, paths, [arena.buffer(i) for i in range(8)])
        align = max(b.align, ALIGN)
        for _ in range(10):
            wanted, reqs = [], []
            for buf in range(8):
                f = rng.randrange(2)
                size = len(contents[f])
                length = rng.randrange(1, min(size, 100_000))
                off = rng.randrange(0, size - length)
                a_off, a_len, skip = widen(off, length, align)
                assert a_len <= arena.slot_bytes
                reqs.append(ReadRequest(f, a_off, a_len, buf))
                wanted.append((f, off, length, skip))
            got = await asyncio.gather(*(h.wait() for h in b.submit(reqs)))
            for (f, off, length, skip), r, n in zip(wanted, reqs, got):
                assert n >= skip + length  # widened past EOF is fine: the bytes we need are there
                assert arena.slot(r.buf)[skip:skip + length].tobytes() == contents[f][off:off + length]
        await b.aclose()
        arena.close()

    run(main)


def test_reads_at_and_across_eof(case, data):
    kind, direct = case
    path, content = data["files"][0], data["bytes"][0]
    last_block = FILE_SIZE - FILE_SIZE % ALIGN

    async def main():
        arena = Arena(4, 64 * 1024)
        b = make(kind, direct, [path], [arena.buffer(i) for i in range(4)])
        for buf in range(4):
            arena.slot(buf)[:] = 0xEE
        reqs = [
            ReadRequest(0, last_block - 2 * ALIGN, 8 * ALIGN, 0),  # spans EOF
            ReadRequest(0, last_block, ALIGN, 1),                  # the partial last block
            ReadRequest(0, last_block + ALIGN, ALIGN, 2),           # wholly past EOF
            ReadRequest(0, last_block - ALIGN, ALIGN, 3),           # ends just before the last block
        ]
        n = await asyncio.gather(*(h.wait() for h in b.submit(reqs)))
        assert n == [FILE_SIZE - (last_block - 2 * ALIGN), FILE_SIZE - last_block, 0, ALIGN]
        for r, k in zip(reqs, n):
            assert arena.slot(r.buf)[:k].tobytes() == content[r.offset:r.offset + k]
        assert int(arena.slot(2).min()) == 0xEE  # nothing read, nothing written
        await b.aclose()
        arena.close()

    run(main)


def test_more_reads_than_ring_entries_complete_in_order(case, data):
    kind, direct = case
    path, content = data["files"][0], data["bytes"][0]
    rng = random.Random(3)

    async def main():
        n_buf = 200
        arena = Arena(n_buf, 4 * ALIGN)
        # One kernel slot (uring) / one worker (threads): reads must then complete in submission order.
        b = make(kind, direct, [path], [arena.buffer(i) for i in range(n_buf)], entries=1, workers=1)
        reqs = [ReadRequest(0, rng.randrange(0, FILE_SIZE // ALIGN - 4) * ALIGN, 4 * ALIGN, i) for i in range(n_buf)]
        handles = b.submit(reqs)
        assert b.inflight() == n_buf
        order: list[int] = []
        for i, h in enumerate(handles):
            h.done.add_done_callback(lambda _f, i=i: order.append(i))
        await asyncio.gather(*(h.wait() for h in handles))
        assert order == list(range(n_buf))
        assert all(h.state is ReadState.DONE for h in handles) and b.inflight() == 0
        for r in reqs:
            assert arena.slot(r.buf).tobytes() == content[r.offset:r.offset + r.length]
        await b.aclose()

        # A wide ring with far more reads than entries: all complete and correct.
        b = make(kind, direct, [path], [arena.buffer(i) for i in range(n_buf)], entries=16, workers=4)
        for _ in range(3):
            handles = b.submit(reqs)
            assert sum(await asyncio.gather(*(h.wait() for h in handles))) == n_buf * 4 * ALIGN
            assert all(sha(arena.slot(r.buf)) == sha(content[r.offset:r.offset + r.length]) for r in reqs)
        await b.aclose()
        arena.close()

    run(main)


def test_cancellation_never_frees_a_buffer_before_its_read_completes(case, data):
    """1000 rounds of readers cancelled at random points while their reads are queued or in flight.

    The test owns the buffers: one goes back to the pool only when its read's ``done`` has resolved,
    is then poisoned, and must still hold the poison when handed out again (a late kernel write
    would show). Reads that finish are checked against the file.
    """
    kind, direct = case
    path, content = data["files"][0], data["bytes"][0]
    rng = random.Random(4)
    POISON = 0xA5

    async def main():
        n_buf, buf_bytes = 12, 64 * 1024
        arena = Arena(n_buf, buf_bytes)
        # A tiny ring (2 kernel slots / 1 worker) so that some reads are still queued when cancelled.
        b = make(kind, direct, [path], [arena.buffer(i) for i in range(n_buf)], entries=2, workers=1)
        free = list(range(n_buf))
        owner: dict[int, ReadHandle | None] = {}
        freed = asyncio.Event()
        for i in range(n_buf):
            arena.slot(i)[:] = POISON
        stats = {"ok": 0, "cancelled_inflight": 0, "dropped": 0}

        def release(buf: int, h: ReadHandle) -> None:
            assert h.done.done() and h.state in (ReadState.DONE, ReadState.DROPPED)
            assert owner.pop(buf) is h
            arena.slot(buf)[:] = POISON
            free.append(buf)
            freed.set()

        async def acquire() -> int:
            while not free:
                freed.clear()
                await freed.wait()
            buf = free.pop(rng.randrange(len(free)))
            assert buf not in owner
            # Nobody wrote into this buffer since it was released and poisoned.
            assert int(arena.slot(buf).min()) == int(arena.slot(buf).max()) == POISON
            owner[buf] = None
            return buf

        async def reader():
            buf = await acquire()
            length = rng.randrange(1, buf_bytes // ALIGN + 1) * ALIGN
            r = ReadRequest(0, rng.randrange(0, FILE_SIZE // ALIGN - 16) * ALIGN, length, buf)
            (h,) = b.submit([r])
            owner[buf] = h
            try:
                n = await h.wait()
            except asyncio.CancelledError:
                if rng.random() < 0.5 and h.drop():
                    stats["dropped"] += 1
                    assert int(arena.slot(buf).min()) == int(arena.slot(buf).max()) == POISON
                else:
                    stats["cancelled_inflight"] += 1
                # The buffer returns to the pool only when the backend says the read is over.
                h.done.add_done_callback(lambda _f: release(buf, h))
                raise
            assert n == length
            assert arena.slot(buf)[:n].tobytes() == content[r.offset:r.offset + n]
            stats["ok"] += 1
            release(buf, h)

        for _ in range(1000):
            tasks = [asyncio.ensure_future(reader()) for _ in range(rng.randrange(1, 7))]
            for _ in range(rng.randrange(0, 4)):
                await asyncio.sleep(0)
            for t in tasks:
                if rng.random() < 0.5:
                    t.cancel()
            for res in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
                    raise res
        # Reads whose waiters were cancelled finish on their own; then every buffer is back.
        for _ in range(2000):
            if b.inflight() == 0 and len(free) == n_buf:
                break
            await asyncio.sleep(0.001)
        assert b.inflight() == 0 and sorted(free) == list(range(n_buf)) and not owner
        await b.aclose()
        return stats

    stats = run(main)
    assert stats["ok"] > 100 and stats["cancelled_inflight"] > 10 and stats["dropped"] > 10, stats


def test_injected_errors_fail_only_chosen_reads(case, data):
    kind, direct = case
    path, content = data["files"][0], data["bytes"][0]
    rng = random.Random(5)

    async def main():
        arena = Arena(32, 8 * ALIGN)
        inner = make(kind, direct, [path], [arena.buffer(i) for i in range(32)])
        bad = set(rng.sample(range(32), 6))
        short = set(rng.sample(sorted(set(range(32)) - bad), 3))
        fb = FaultyBackend(
            inner, fail=lambda r: "injected EIO" if r.buf in bad else ("short" if r.buf in short else None)
        )
        assert fb.direct is direct and fb.name == f"faulty({inner.name})"
        reqs = [ReadRequest(0, rng.randrange(0, FILE_SIZE // ALIGN - 8) * ALIGN, 8 * ALIGN, i) for i in range(32)]
        handles = fb.submit(reqs)
        results = await asyncio.gather(*(h.wait() for h in handles), return_exceptions=True)
        for r, h, res in zip(reqs, handles, results):
            assert h.state is ReadState.DONE
            if r.buf in bad:
                assert isinstance(res, ClutorIOError)
                assert (res.path, res.offset, res.length) == (path, r.offset, r.length)
                assert path in str(res) and str(r.offset) in str(res) and "injected EIO" in str(res)
            elif r.buf in short:
                assert res == r.length // 2
            else:
                assert res == r.length
                assert arena.slot(r.buf).tobytes() == content[r.offset:r.offset + r.length]
        assert fb.injected == len(bad) + len(short)
        # Later reads through the same backend still work.
        later = [ReadRequest(0, r.offset, r.length, r.buf) for r in reqs if r.buf not in bad | short]
        got = await asyncio.gather(*(h.wait() for h in fb.submit(later)))
        assert got == [r.length for r in later]
        assert fb.inflight() == 0
        await fb.aclose()

    run(main)


def test_real_kernel_error_names_file_offset_length(case, data, tmp_path):
    """A read the kernel refuses (EISDIR) fails alone; reads of other files keep working."""
    kind, direct = case
    path, content = data["files"][0], data["bytes"][0]

    async def main():
        arena = Arena(4, 4 * ALIGN)
        b = make(kind, direct, [path, data["files"][1]], [arena.buffer(i) for i in range(4)])
        # Swap file 1's descriptor for a directory's behind the backend's back.
        dfd = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
        os.dup2(dfd, b._files.fds[1])
        os.close(dfd)
        h_bad, h_ok = b.submit([ReadRequest(1, ALIGN, ALIGN, 0), ReadRequest(0, 2 * ALIGN, 4 * ALIGN, 1)])
        with pytest.raises(ClutorIOError) as ei:
            await h_bad.wait()
        err = ei.value
        assert (err.path, err.offset, err.length) == (data["files"][1], ALIGN, ALIGN)
        assert "directory" in err.reason.lower()
        assert await h_ok.wait() == 4 * ALIGN
        assert arena.slot(1).tobytes() == content[2 * ALIGN:6 * ALIGN]
        (h,) = b.submit([ReadRequest(0, 0, ALIGN, 2)])
        assert await h.wait() == ALIGN
        await b.aclose()

    run(main)


def test_aclose_waits_for_inflight_reads(case, data):
    kind, direct = case
    path, content = data["files"][0], data["bytes"][0]

    async def main():
        arena = Arena(64, 64 * ALIGN)
        fds_before = set(os.listdir("/proc/self/fd"))
        b = make(kind, direct, [path], [arena.buffer(i) for i in range(64)], entries=16, workers=3)
        reqs = [ReadRequest(0, (i * 37 % 1000) * ALIGN, 64 * ALIGN, i) for i in range(64)]
        handles = b.submit(reqs)
        await asyncio.sleep(0)  # let the backend hand a first batch to the kernel / workers
        assert any(h.state is ReadState.INFLIGHT for h in handles)
        await b.aclose()
        assert b.inflight() == 0
        assert set(os.listdir("/proc/self/fd")) <= fds_before  # file, ring and eventfd closed
        n_done = 0
        for r, h in zip(reqs, handles):
            assert h.done.done()
            if h.state is ReadState.DONE:
                n_done += 1
                assert h.done.result() == r.length
                assert arena.slot(r.buf).tobytes() == content[r.offset:r.offset + r.length]
            else:  # still queued at close: never touched the buffer, told why
                assert h.state is ReadState.DROPPED
                assert isinstance(h.done.exception(), ClosedError)
        assert n_done >= 1
        with pytest.raises(ClosedError):
            b.submit([ReadRequest(0, 0, ALIGN, 0)])
        await b.aclose()  # idempotent

    run(main)


def test_drop_before_submission_and_bad_requests(case, data):
    kind, direct = case
    path = data["files"][0]

    async def main():
        arena = Arena(40, 2 * ALIGN)
        for i in range(40):
            arena.slot(i)[:] = 0x5A
        b = make(kind, direct, [path], [arena.buffer(i) for i in range(40)], entries=2, workers=1)
        handles = b.submit([ReadRequest(0, i * ALIGN, ALIGN, i) for i in range(40)])
        dropped = [h for h in handles[20:] if h.drop()]
        assert len(dropped) == 20 and all(h.state is ReadState.DROPPED for h in dropped)
        assert not any(h.drop() for h in dropped)
        await asyncio.gather(*(h.wait() for h in handles[:20]))
        assert all(int(arena.slot(i).min()) == 0x5A for i in range(20, 40))  # never touched
        assert b.inflight() == 0
        bad = [
            ReadRequest(5, 0, ALIGN, 0),            # no such file
            ReadRequest(0, 0, ALIGN, 99),           # no such buffer
            ReadRequest(0, 0, 3 * ALIGN, 0),        # longer than the buffer
            ReadRequest(0, -ALIGN, ALIGN, 0),       # negative offset
        ]
        if direct:
            bad += [ReadRequest(0, 100, ALIGN, 0), ReadRequest(0, 0, 100, 0)]
        for r in bad:
            with pytest.raises(ClutorIOError):
                b.submit([ReadRequest(0, 0, ALIGN, 1), r])  # all or nothing
            assert b.inflight() == 0
        await b.aclose()

    run(main)


class _Short:
    """Pretends the kernel stopped early: reports fewer bytes and scribbles over the rest (mixed into
    either io_uring driver)."""

    always = False

    def _on_cqe(self, rid, res):
        h = self._slot_handle[rid]
        got = self._slot_got[rid]
        if res > ALIGN and (self.always or got == 0):
            cut = (res // 2) // ALIGN * ALIGN
            view = np.frombuffer(self._buffers[h.request.buf], np.uint8)
            view[got + cut:got + res] = 0xEE  # whatever is claimed unread must be read again
            res = cut
        super()._on_cqe(rid, res)


def _short_preadv(real, always, first_len):
    """os.preadv reading half of what is asked: on a request's first call only, or always."""

    def preadv(fd, bufs, offset):
        (mv,) = bufs
        if len(mv) > ALIGN and (always or len(mv) == first_len):
            return real(fd, [mv[:(len(mv) // 2) // ALIGN * ALIGN]], offset)
        return real(fd, [mv], offset)

    return preadv


@pytest.mark.parametrize("always", [False, True], ids=["once", "always"])
def test_short_reads_before_eof_are_finished_or_fail_loudly(case, data, monkeypatch, always):
    kind, direct = case
    path, content = data["files"][0], data["bytes"][0]
    if kind == "threads":
        import clutor.io.threads as threads_mod

        monkeypatch.setattr(threads_mod.os, "preadv", _short_preadv(os.preadv, always, 32 * ALIGN))

    async def main():
        arena = Arena(8, 32 * ALIGN)
        bufs = [arena.buffer(i) for i in range(8)]
        if kind in URING_KINDS:
            short = type("ShortUring", (_Short, uring_class(kind)), {})
            kw = {} if kind == "uring" else {"fixed_buffers": kind == "uring-sys"}
            b = short([path], bufs, direct=direct, entries=8, **kw)
            b.always = always
        else:
            b = ThreadBackend([path], bufs, direct=direct, workers=2)
        reqs = [ReadRequest(0, (100 + 40 * i) * ALIGN, 32 * ALIGN, i) for i in range(8)]
        results = await asyncio.gather(*(h.wait() for h in b.submit(reqs)), return_exceptions=True)
        for r, res in zip(reqs, results):
            if always:  # never completes: a loud error naming the read, not a silent short count
                assert isinstance(res, ClutorIOError), res
                assert (res.path, res.offset, res.length) == (path, r.offset, r.length)
                assert "short read" in res.reason
            else:
                assert res == r.length
                assert arena.slot(r.buf)[:res].tobytes() == content[r.offset:r.offset + r.length]
        assert b.inflight() == 0
        await b.aclose()

    run(main)


def test_uring_under_uvloop(data):
    if (why := uring_unavailable()) and (why_sys := sys_uring_unavailable()):
        pytest.skip(f"{why}; {why_sys}")
    path, content = data["files"][0], data["bytes"][0]

    async def main():
        arena = Arena(16, 16 * ALIGN)
        b = open_backend([path], [arena.buffer(i) for i in range(16)], io="uring", direct=data["direct_ok"])
        rng = random.Random(6)
        for _ in range(10):
            reqs = [ReadRequest(0, rng.randrange(0, FILE_SIZE // ALIGN - 16) * ALIGN, 16 * ALIGN, i) for i in range(16)]
            await asyncio.gather(*(h.wait() for h in b.submit(reqs)))
            assert all(arena.slot(r.buf).tobytes() == content[r.offset:r.offset + r.length] for r in reqs)
        await b.aclose()

    run(main, "uvloop")


# -- the chooser --------------------------------------------------------------------------------
def test_open_backend_choices_and_direct_fallback(data, monkeypatch):
    path, content = data["files"][0], data["bytes"][0]

    async def main():
        arena = Arena(2, ALIGN)
        bufs = [arena.buffer(i) for i in range(2)]
        with pytest.raises(ClutorError):
            open_backend([path], bufs, io="bogus")
        b = open_backend([path], bufs, io="threads", direct=False)
        assert (b.name, b.direct, b.align, b.fallback_reason) == ("threads", False, 1, None)
        await b.aclose()
        # buffered reads are page-cache copies: auto gives them to the pool's workers, not the loop
        b = open_backend([path], bufs, io="auto", direct=False)
        assert (b.name, b.direct) == ("threads", False)
        await b.aclose()
        b = open_backend([path], bufs, io="auto")
        assert b.name == ("threads" if uring_unavailable() and sys_uring_unavailable() else "uring")
        if b.name == "uring":
            assert b.driver == ("liburing" if not uring_unavailable() else "syscalls")
        await b.aclose()

        # A filesystem that refuses O_DIRECT at open: buffered reads, and the reason says so.
        real_open = os.open

        def refusing_open(p, flags, *a):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument", p)
            return real_open(p, flags, *a)

        monkeypatch.setattr(backend_mod.os, "open", refusing_open)
        b = open_backend([path], bufs, io="auto", direct=True)
        monkeypatch.undo()
        assert b.direct is False and b.align == 1
        assert path in b.fallback_reason and "O_DIRECT" in b.fallback_reason
        (h,) = b.submit([ReadRequest(0, 10, 100, 0)])  # unaligned is fine once buffered
        assert await h.wait() == 100 and arena.slot(0)[:100].tobytes() == content[10:110]
        await b.aclose()

        # io_uring missing: auto falls back and says why; forcing it is an error naming the reason.
        def no_uring():
            raise UringUnavailable("io_uring unavailable: cannot import liburing (test)")

        monkeypatch.setattr(uring_mod, "_import_liburing", no_uring)
        b = open_backend([path], bufs, io="auto")
        if not sys_uring_unavailable():  # the wheel is missing but our own driver runs
            assert (b.name, b.driver, b.fallback_reason) == ("uring", "syscalls", None)
            await b.aclose()
            monkeypatch.setattr(uring_sys_mod, "syscall_uring_unavailable", lambda: "io_uring unavailable: (test)")
            b = open_backend([path], bufs, io="auto")
        assert b.name == "threads" and "liburing" in b.fallback_reason
        await b.aclose()
        with pytest.raises(ClutorError, match="liburing"):
            open_backend([path], bufs, io="uring")
        with pytest.raises(ClutorIOError, match="cannot open"):
            open_backend([path + ".missing"], bufs, io="threads")

    run(main)


def test_liburing_that_dies_with_sigill_falls_back(tmp_path, monkeypatch):
    """A liburing wheel built for instructions this CPU lacks kills the process that uses it: the probe
    (a child process) sees the signal, and io="auto" reads with our own io_uring driver where it runs,
    else with the thread pool, saying why."""
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(b"x" * 8192)
    monkeypatch.setattr(uring_mod, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    monkeypatch.setattr(uring_mod, "_probe_result", None)

    async def main():
        with Arena(1, 4096) as arena:
            if not sys_uring_unavailable():
                for io in ("auto", "uring"):
                    b = open_backend([path], [arena.buffer(0)], io=io)
                    assert (b.name, b.driver) == ("uring", "syscalls")
                    (h,) = b.submit([ReadRequest(0, 0, 4096, 0)])
                    assert await h.wait() == 4096 and arena.slot(0).tobytes() == b"x" * 4096
                    await b.aclose()
                monkeypatch.setattr(uring_sys_mod, "syscall_uring_unavailable", lambda: "no raw ring (test)")
            b = open_backend([path], [arena.buffer(0)], io="auto")
            assert b.name == "threads" and "SIGILL" in b.fallback_reason
            await b.aclose()
            with pytest.raises(ClutorError, match="SIGILL"):
                open_backend([path], [arena.buffer(0)], io="uring")

    run(main)
    # A probe that exits normally lets the ring be made in this process (an OSError there is classified
    # as before); the result is kept for the process.
    monkeypatch.setattr(uring_mod, "_PROBE", "pass")
    monkeypatch.setattr(uring_mod, "_probe_result", None)
    assert uring_mod._probe_liburing() == "" and uring_mod._probe_result == ""


# -- the raw-syscall io_uring driver ---------------------------------------------------------------
def test_raw_uring_registers_an_arena_as_few_buffers_and_falls_back_when_refused(data, monkeypatch):
    """The store's buffers (every slot's gate/up/down regions of one arena) are registered as a few merged
    ranges, so reads are READ_FIXED; where the kernel refuses registration (RLIMIT_MEMLOCK) the same reads
    go as plain READs, pinned per read, and return the same bytes."""
    if why := sys_uring_unavailable():
        pytest.skip(why)
    path, content = data["files"][0], data["bytes"][0]
    direct = data["direct_ok"]

    async def main(refuse: bool):
        arena = Arena(6, 12 * ALIGN)
        bufs = [arena.region(i, p * 4 * ALIGN, 4 * ALIGN) for i in range(6) for p in range(3)]
        b = SyscallUringBackend([path], bufs, direct=direct, entries=4)
        assert b.fixed_buffers is not refuse
        if refuse:
            assert "refused" in b.fixed_reason
        else:
            assert len(set(b._reg_of)) == 1  # 18 buffers, one contiguous range
        rng = random.Random(8)
        for _ in range(5):
            reqs = [ReadRequest(0, rng.randrange(0, FILE_SIZE // ALIGN - 4) * ALIGN, 4 * ALIGN, i) for i in range(18)]
            got = await asyncio.gather(*(h.wait() for h in b.submit(reqs)))  # more reads than ring entries
            assert got == [4 * ALIGN] * 18
            for r in reqs:
                region = np.frombuffer(bufs[r.buf], np.uint8)
                assert region.tobytes() == content[r.offset:r.offset + r.length]
        await b.aclose()
        arena.close()

    run(lambda: main(False))
    real = uring_sys_mod._call

    def no_register(nr, fd, op, *rest):
        if nr == uring_sys_mod._NR_REGISTER and op.value == uring_sys_mod._IORING_REGISTER_BUFFERS:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(nr, fd, op, *rest)

    monkeypatch.setattr(uring_sys_mod, "_call", no_register)
    run(lambda: main(True))
