"""What the running process has cost: peak resident memory and bytes it made the kernel read from storage."""
from __future__ import annotations

import resource

from .._util import proc_bytes

__all__ = ["peak_memory", "storage_read_bytes"]


def peak_memory() -> dict:
    """Peak resident set, two ways: getrusage's ru_maxrss (KiB on Linux) and /proc VmHWM.

    Both count file pages the process has mapped and touched (a model read through mmap), not only
    its own allocations; VmRSS is the current value, for comparison."""
    return {
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "vm_hwm": proc_bytes("/proc/self/status", "VmHWM"),
        "vm_rss": proc_bytes("/proc/self/status", "VmRSS"),
    }


def storage_read_bytes() -> int | None:
    """Bytes this process (all its threads) caused to be fetched from storage: /proc/self/io read_bytes.

    Counts O_DIRECT reads and page-cache misses, including mmap page faults; not page-cache hits."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None
