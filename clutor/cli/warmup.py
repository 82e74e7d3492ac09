"""clutor warmup: compile the compute kernels now (the first run on a machine takes about a minute on
two cores), so the first generate, chat or serve starts at once. Afterwards they load from numba's
cache (NUMBA_CACHE_DIR, else __pycache__ beside Clutor's kernels) in about a second."""
from __future__ import annotations

import sys

from .common import add_command, warm_kernels


def add_parser(sub):
    return add_command(sub, "warmup", "compile the compute kernels ahead of the first run", __doc__,
                       "clutor warmup")


def run(args) -> int:
    from ..model import kernels

    if kernels.compiled(every_architecture=True):
        print(f"clutor: the compute kernels are already compiled ({kernels.cache_dir()})", file=sys.stderr)
        return 0
    warm_kernels(every_architecture=True)
    state = kernels.compiled(every_architecture=True)
    print(f"clutor: compute kernels compiled and cached in {kernels.cache_dir()}"
          + ("" if state is not False else " (numba did not keep them: is that directory writable?)"),
          file=sys.stderr)
    return 0
