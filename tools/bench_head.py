#!/usr/bin/env python3
"""A model's output head alone, one token: Clutor's product next to ggml's MUL_MAT on the same bytes.

    python tools/bench_head.py MODEL [--threads 1,2] [--rounds 5] [--calls 50] [--tensor output.weight]

The weight is the file's own tensor (its bytes copied once into each engine's memory); one copy, so
that it may stay in the CPU caches between calls as it does between llama.cpp's decode steps (a 13.7
MB head fits this VM's 32 MiB L3). Per round and thread count: `--calls` calls of each engine, their
median; engines alternate within the round so a burst of other load hits both. Printed: each round's
medians (ms), the median over rounds, GB/s of weight bytes and Clutor / ggml.

The worker threads' wait policy is the process's (OMP_WAIT_POLICY, read at the first parallel
launch): the clutor command runs PASSIVE, llama-bench libgomp's default. Run it under both to tell the
kernel's time from the threads' wake-up. Needs llama-cpp-python (tools/ggml_mulmat.py).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from clutor.model import kernels  # noqa: E402
from clutor.model.gguf import GGUFFile  # noqa: E402
from clutor.model.kernel_settings import KernelSettings  # noqa: E402
from ggml_mulmat import GGMLMulMat  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tensor", default="output.weight")
    ap.add_argument("--threads", default="1,2", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50, help="calls per engine, thread count and round")
    args = ap.parse_args()

    with GGUFFile.open(args.model) as f:
        info = f.tensor(args.tensor)
        w = np.ascontiguousarray(f.read(args.tensor))  # uint8 [n_rows * row_bytes]
    n_rows, n_cols = (int(v) for v in info.shape)  # numpy order (V, D)
    qt = int(info.qtype)
    x = np.random.default_rng(0).standard_normal((1, n_cols)).astype(np.float32)  # [1, D]
    out = np.empty((1, n_rows), np.float32)  # [1, V]
    ggml = GGMLMulMat()
    ref = ggml.product(w, qt, n_rows, n_cols, x)
    got = kernels.matmul(w, qt, n_rows, n_cols, x, out=out)
    if not np.array_equal(ref, got):  # the same bytes, the same product: else the timing compares nothing
        raise SystemExit(f"Clutor's head differs from ggml's (max |d| {np.abs(ref - got).max():.3g})")
    print(f"{args.tensor}: {info.type_name} ({n_rows}, {n_cols}), {w.nbytes / 1e6:.1f} MB, one token, one copy")

    def clutor_ms(threads: int) -> float:
        ks = KernelSettings(threads=threads)
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            kernels.matmul(w, qt, n_rows, n_cols, x, out=out, settings=ks)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def ggml_ms(threads: int) -> float:
        return statistics.median(ggml.pass_times([w], qt, n_rows, n_cols, x, threads, passes=args.calls)) * 1e3

    engines = {"clutor": clutor_ms, "ggml": ggml_ms}
    for th in args.threads:  # warm: compile / load, thread pools up
        for fn in engines.values():
            fn(th)
    res = {(e, th): [] for e in engines for th in args.threads}
    for r in range(args.rounds):
        for th in args.threads:
            for e in (engines if r % 2 == 0 else reversed(engines)):
                res[e, th].append(engines[e](th))
    for th in args.threads:
        med = {e: statistics.median(res[e, th]) for e in engines}
        for e in engines:
            print(f"  {e:6s} {th} thread{'s' if th > 1 else ' '}: median {med[e]:.3f} ms ({w.nbytes / med[e] / 1e6:.1f} GB/s)"
                  f"  rounds {' '.join(f'{v:.3f}' for v in res[e, th])}")
        print(f"  clutor / ggml at {th}: {med['clutor'] / med['ggml']:.2f}x the time")


if __name__ == "__main__":
    main()
