"""io_uring over the raw system calls (ctypes), for CPUs the PyPI liburing wheel cannot run on.

The wheel is built for AVX-512 and dies with SIGILL on most CPUs people own (AMD Zen 2/3, Intel desktops
before 2022's); this backend needs nothing but libc's ``syscall``. Same Backend protocol, same request-id,
batching and short-read rules (``RingBackend``); what differs is how the ring is driven:

* ``io_uring_setup`` gives the ring's fd and the offsets of its fields; the SQ and CQ rings (one mapping
  with IORING_FEAT_SINGLE_MMAP) and the SQE array are mmapped; the ring's u32 fields and the CQEs are read
  and written through memoryviews cast to u32 / u64 (an item access is one plain load or store), an SQE
  is written with one ``struct.pack_into`` in the kernel's layout.
* Buffers are registered once (IORING_REGISTER_BUFFERS): contiguous buffers (an arena's slots) are merged
  into registrations of at most 1 GiB, and reads are IORING_OP_READ_FIXED into them, so the kernel pins
  their pages once at start-up instead of on every O_DIRECT read. Where registration is refused
  (RLIMIT_MEMLOCK for an unprivileged user, an old kernel) reads are IORING_OP_READ into the same
  addresses, pinned per read as liburing's readv does. ``fixed_buffers`` says which.
* ``io_uring_enter`` goes through ctypes, which releases the GIL for the call: the kernel's work of
  taking a batch of reads does not stop the compute thread.
* Completions: a registered non-blocking eventfd watched by the event loop, as with liburing.

Memory ordering. The kernel publishes a completion by writing the CQE and then storing the CQ tail with
release semantics; it consumes submissions by reading our SQ tail with acquire semantics and then the
SQEs. We must (1) see the CQE contents after reading the tail that covers them, (2) finish reading a
CQE before our head store hands its slot back, and (3) have written an SQE and its array entry before
the tail store that publishes them. On x86_64 (TSO) plain loads are not reordered with other loads and
plain stores are not reordered with other stores or with earlier loads, so (1) load-load, (2)
load-store and (3) store-store all hold for ordinary moves; only compiler reordering would break them,
and each access here is a separate numpy call the interpreter performs in program order. That is what
liburing itself does on x86 (its smp_load_acquire / smp_store_release are plain moves plus a compiler
barrier there). Weakly ordered CPUs (arm64, POWER, RISC-V) need real barriers that Python cannot issue,
so this backend refuses to start there and those machines keep liburing (its wheel) or the thread
pool. ``io_uring_enter`` is a system call, a full barrier on every CPU.

Only the loop thread touches the rings (one producer, one consumer), so no locking is needed.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
from typing import Sequence

import numpy as np

from clutor._util import libc
from clutor.errors import ClutorError
from clutor.io.uring import RingBackend, UringUnavailable, _UNAVAILABLE

__all__ = ["SyscallUringBackend", "syscall_uring_unavailable"]

# System call numbers (the same on every architecture since io_uring's introduction, 5.1).
_NR_SETUP, _NR_ENTER, _NR_REGISTER = 425, 426, 427

_IORING_OFF_SQ_RING = 0
_IORING_OFF_CQ_RING = 0x8000000
_IORING_OFF_SQES = 0x10000000
_IORING_FEAT_SINGLE_MMAP = 1 << 0
_IORING_FEAT_NODROP = 1 << 1
_IORING_ENTER_GETEVENTS = 1 << 0
_IORING_SETUP_CQSIZE = 1 << 3
_IORING_REGISTER_BUFFERS = 0
_IORING_REGISTER_EVENTFD = 4
_IORING_REGISTER_PROBE = 8
_IO_URING_OP_SUPPORTED = 1
_OP_READ_FIXED = 4
_OP_READ = 22
_MAX_REGISTRATION = 1 << 30  # the kernel's limit on one registered buffer
_MAX_REGISTRATIONS = 1 << 14  # IORING_MAX_REG_BUFFERS

_TSO_MACHINES = ("x86_64", "amd64", "AMD64")


class _SqringOffsets(ctypes.Structure):
    _fields_ = [("head", ctypes.c_uint32), ("tail", ctypes.c_uint32), ("ring_mask", ctypes.c_uint32),
                ("ring_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("dropped", ctypes.c_uint32),
                ("array", ctypes.c_uint32), ("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64)]


class _CqringOffsets(ctypes.Structure):
    _fields_ = [("head", ctypes.c_uint32), ("tail", ctypes.c_uint32), ("ring_mask", ctypes.c_uint32),
                ("ring_entries", ctypes.c_uint32), ("overflow", ctypes.c_uint32), ("cqes", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32),
                ("features", ctypes.c_uint32), ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                ("sq_off", _SqringOffsets), ("cq_off", _CqringOffsets)]


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


assert ctypes.sizeof(_Params) == 120

# struct io_uring_sqe (64 bytes) and io_uring_cqe (16 bytes), as the kernel lays them out.
# opcode u8, flags u8, ioprio u16, fd s32, off u64, addr u64, len u32, rw_flags u32, user_data u64,
# buf_index u16, personality u16, splice_fd_in s32, addr3 u64, pad u64
_pack_sqe = struct.Struct("<BBHiQQIIQHHiQQ").pack_into
_SQE_BYTES = 64
_CQE_BYTES = 16  # user_data u64, res s32, flags u32
assert struct.calcsize("<BBHiQQIIQHHiQQ") == _SQE_BYTES

_sys_call = None


def _syscall():
    global _sys_call
    if _sys_call is None:
        _sys_call = libc().syscall  # ctypes.CDLL: the GIL is released during each call
        _sys_call.restype = ctypes.c_long
    return _sys_call


def _call(nr: int, *args) -> int:
    """A system call; raises OSError on a negative return (errno from the call)."""
    while True:
        r = _syscall()(ctypes.c_long(nr), *args)
        if r >= 0:
            return r
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))


def syscall_uring_unavailable() -> str | None:
    """None when this backend can run on this machine's CPU, else why not (the kernel is asked at open)."""
    if platform.system() != "Linux":
        return f"io_uring unavailable: not Linux ({platform.system()})"
    if platform.machine() not in _TSO_MACHINES:
        return (f"io_uring over raw system calls needs x86_64's memory ordering (this CPU is {platform.machine()}); "
                "use the liburing wheel or the thread pool")
    return None


class SyscallUringBackend(RingBackend):
    """Backend protocol over one io_uring driven by raw system calls. Construct inside the running loop."""

    driver = "syscalls"

    def __init__(self, files: Sequence[str | os.PathLike], buffers: Sequence[memoryview], *, direct: bool,
                 entries: int = 256, fixed_buffers: bool = True):
        why = syscall_uring_unavailable()
        if why:
            raise UringUnavailable(why)
        if not 1 <= entries <= 32768:
            raise ValueError(f"SyscallUringBackend: entries must be in [1, 32768], got {entries}")
        self._ring_fd = -1
        self._efd = -1
        self._maps: list[mmap.mmap] = []
        self._open_tables(files, buffers, direct)
        self._init_slots(entries)
        self._ring_open = False
        try:
            self._setup(entries)
            self._ring_open = True
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            fd_arg = ctypes.c_int32(self._efd)
            _call(_NR_REGISTER, ctypes.c_int(self._ring_fd), ctypes.c_uint(_IORING_REGISTER_EVENTFD),
                  ctypes.byref(fd_arg), ctypes.c_uint(1))
            self._register_buffers(fixed_buffers)
            self._start_ring()
        except BaseException:
            self._release()
            raise

    # -- setup ----------------------------------------------------------------------------------
    def _setup(self, entries: int) -> None:
        p = _Params()
        p.flags = _IORING_SETUP_CQSIZE
        p.cq_entries = 2 * entries  # reads owned by the kernel never exceed entries: no overflow
        try:
            self._ring_fd = _call(_NR_SETUP, ctypes.c_uint(entries), ctypes.byref(p))
        except OSError as err:
            if err.errno in _UNAVAILABLE:
                raise UringUnavailable(f"io_uring unavailable: io_uring_setup: {err.strerror}") from err
            raise ClutorError(f"io_uring_setup({entries}) failed: {err.strerror}") from err
        os.set_inheritable(self._ring_fd, False)
        if not p.features & _IORING_FEAT_SINGLE_MMAP:
            raise UringUnavailable("io_uring unavailable: the kernel is older than 5.4 (no IORING_FEAT_SINGLE_MMAP)")
        self._check_ops()
        so, co = p.sq_off, p.cq_off
        ring_bytes = max(so.array + p.sq_entries * 4, co.cqes + p.cq_entries * _CQE_BYTES)
        ring_bytes = -(-ring_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages: viewable as u64
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        rings = mmap.mmap(self._ring_fd, ring_bytes, flags=flags, prot=prot, offset=_IORING_OFF_SQ_RING)
        self._maps.append(rings)
        sqes = mmap.mmap(self._ring_fd, p.sq_entries * _SQE_BYTES, flags=flags, prot=prot, offset=_IORING_OFF_SQES)
        self._maps.append(sqes)

        # Python-level views: a memoryview item is a plain load or store (cheaper than a numpy scalar access).
        self._ring32 = memoryview(rings).cast("I")  # the rings' u32 fields
        self._sq_head_i, self._sq_tail_i = so.head // 4, so.tail // 4
        self._cq_head_i, self._cq_tail_i = co.head // 4, co.tail // 4
        self._sq_array_i = so.array // 4
        self._sq_mask = self._ring32[so.ring_mask // 4]
        self._sq_entries = self._ring32[so.ring_entries // 4]
        self._cq_mask = self._ring32[co.ring_mask // 4]
        if co.cqes % 8:
            raise ClutorError(f"io_uring: CQ entries at offset {co.cqes}, not 8-byte aligned")
        self._cqe64 = memoryview(rings).cast("Q")   # a CQE is two u64: user_data, then res | flags << 32
        self._cqe_i = co.cqes // 8
        self._sqes_mm = sqes
        self._tail = self._ring32[self._sq_tail_i]  # our SQ tail: SQEs prepped up to here
        self._published = self._tail                # ... and handed to the kernel's view of the ring up to here
        self.nodrop = bool(p.features & _IORING_FEAT_NODROP)

    def _check_ops(self) -> None:
        """The kernel must know IORING_OP_READ (5.6): asked with IORING_REGISTER_PROBE (also 5.6)."""
        n_ops = 256
        buf = (ctypes.c_uint8 * (16 + 8 * n_ops))()
        try:
            _call(_NR_REGISTER, ctypes.c_int(self._ring_fd), ctypes.c_uint(_IORING_REGISTER_PROBE), buf,
                  ctypes.c_uint(n_ops))
        except OSError as err:
            raise UringUnavailable(f"io_uring unavailable: the kernel cannot be probed for its operations "
                                   f"(older than 5.6?): {err.strerror}") from err
        ops = np.frombuffer(buf, dtype=np.uint8, offset=16).reshape(n_ops, 8)
        last = buf[0]
        for op in (_OP_READ, _OP_READ_FIXED):
            if op > last or not int.from_bytes(bytes(ops[op, 2:4]), "little") & _IO_URING_OP_SUPPORTED:
                raise UringUnavailable(f"io_uring unavailable: the kernel lacks opcode {op} (IORING_OP_READ*)")

    def _register_buffers(self, want: bool) -> None:
        """Each buffer's address, and where registration worked, its registration index (module doc)."""
        addrs = [np.frombuffer(b, dtype=np.uint8).ctypes.data if len(b) else 0 for b in self._buffers]
        self._addr = addrs
        self._reg_of: list[int] = [-1] * len(addrs)
        self.fixed_buffers = False
        self.fixed_reason: str | None = "not asked" if not want else None
        if not want or not addrs:
            return
        # Merge buffers that touch into ranges of at most _MAX_REGISTRATION bytes.
        order = sorted(range(len(addrs)), key=lambda i: addrs[i])
        ranges: list[list[int]] = []  # [start, end]
        of: list[int] = [0] * len(addrs)
        for i in order:
            a, n = addrs[i], len(self._buffers[i])
            if n == 0:
                continue
            if ranges and ranges[-1][0] <= a <= ranges[-1][1] and max(ranges[-1][1], a + n) - ranges[-1][0] <= _MAX_REGISTRATION:
                ranges[-1][1] = max(ranges[-1][1], a + n)
            else:
                ranges.append([a, a + n])
            of[i] = len(ranges) - 1
        if len(ranges) > _MAX_REGISTRATIONS:
            self.fixed_reason = f"{len(ranges)} separate buffers, more than io_uring registers"
            return
        iovs = (_Iovec * len(ranges))(*[_Iovec(a, b - a) for a, b in ranges])
        try:
            _call(_NR_REGISTER, ctypes.c_int(self._ring_fd), ctypes.c_uint(_IORING_REGISTER_BUFFERS), iovs,
                  ctypes.c_uint(len(ranges)))
        except OSError as err:  # ENOMEM: RLIMIT_MEMLOCK; EFAULT/EOPNOTSUPP: memory it cannot pin
            self.fixed_reason = f"buffer registration refused ({err.strerror}); reads pin their buffer each time"
            return
        self._reg_of = [of[i] if len(self._buffers[i]) else -1 for i in range(len(addrs))]
        self.fixed_buffers = True

    # -- driver -----------------------------------------------------------------------------------
    def _prep(self, rid: int, fd: int, buf: int, start: int, length: int, offset: int) -> bool:
        r32 = self._ring32
        if _wrap(self._tail - r32[self._sq_head_i]) >= self._sq_entries:  # the SQ is full
            return False
        idx = self._tail & self._sq_mask
        reg = self._reg_of[buf] if self.fixed_buffers else -1
        _pack_sqe(self._sqes_mm, idx * _SQE_BYTES, _OP_READ_FIXED if reg >= 0 else _OP_READ, 0, 0, fd, offset,
                  self._addr[buf] + start, length, 0, rid, max(reg, 0), 0, 0, 0, 0)
        r32[self._sq_array_i + idx] = idx
        self._tail = _wrap(self._tail + 1)
        return True

    def _enter(self) -> None:
        r32 = self._ring32
        if self._tail != self._published:
            r32[self._sq_tail_i] = self._tail  # publish: every SQE and array entry above was stored first (TSO)
            self._published = self._tail
        # What the kernel has not consumed yet (a previous enter may have taken fewer).
        todo = _wrap(self._tail - r32[self._sq_head_i])
        if not todo:
            return
        try:
            _call(_NR_ENTER, ctypes.c_int(self._ring_fd), ctypes.c_uint(todo), ctypes.c_uint(0), ctypes.c_uint(0),
                  None, ctypes.c_size_t(0))
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EBUSY):
                raise ClutorError(f"io_uring_enter failed: {err.strerror}") from err
        if _wrap(self._tail - r32[self._sq_head_i]):
            # The rest stay in the SQ ring and go with the next enter; make sure there is one.
            self._loop.call_later(0.001, self._schedule_flush)

    def _reap(self) -> list[tuple[int, int]]:
        r32, q = self._ring32, self._cqe64
        head = r32[self._cq_head_i]
        tail = r32[self._cq_tail_i]  # load the tail, then the CQEs it covers (TSO: load-load order)
        out = []
        mask, base = self._cq_mask, self._cqe_i
        while head != tail:
            i = base + 2 * (head & mask)
            res = q[i + 1] & 0xFFFFFFFF
            out.append((q[i], res - (1 << 32) if res & 0x80000000 else res))
            head = _wrap(head + 1)
        r32[self._cq_head_i] = tail  # after every CQE above was read: the kernel may reuse them now
        return out

    def _close_ring(self) -> None:
        for name in ("_ring32", "_cqe64", "_sqes_mm"):
            view = self.__dict__.pop(name, None)
            if isinstance(view, memoryview):
                view.release()  # the views export the mappings: release them before closing
        for m in self._maps:
            m.close()
        self._maps.clear()
        if self._ring_fd >= 0:
            fd, self._ring_fd = self._ring_fd, -1
            os.close(fd)  # unregisters the buffers and eventfd with the ring

    def _release(self) -> None:
        super()._release()
        if self._ring_fd >= 0 or self._maps:  # setup failed half-way, before the ring counted as open
            self._close_ring()

    def __repr__(self) -> str:
        return (f"SyscallUringBackend(files={len(self.paths)}, direct={self.direct}, entries={self.entries}, "
                f"fixed_buffers={self.fixed_buffers})")


def _wrap(x: int) -> int:
    """Ring indices are u32 that wrap: differences modulo 2**32."""
    return x & 0xFFFFFFFF
