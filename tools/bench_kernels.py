#!/usr/bin/env python3
"""Throughput of clutor.model.kernels next to numpy float32 BLAS on the same shapes.

    python tools/bench_kernels.py [--types Q8_0,Q4_K] [--tokens 1,64] [--runs 30] [--repeat 3] [--json]
    python tools/bench_kernels.py --sweep-t --types Q8_0,Q4_K   # where dequantise+BLAS starts to win
    python tools/bench_kernels.py --vs-llama-cpp --types IQ2_XXS,IQ1_S --threads 1,2 --tokens 1,4,64 --modes q8

Shapes are OLMoE-1B-7B's: an expert's gate/up (1024 x 2048) and down (2048 x 1024), a dense
attention matrix (2048 x 2048) and the output head (50304 x 2048). Each timed call reads a
different copy of the weight (copies summing to > --rotate-mb), so weights come from DRAM as they
do in a real decode, not from the CPU caches. Reported: median time of --runs calls, best median
over --repeat rounds, and the fastest single call (the machine may be shared: take the best, and
say so); GB/s counts the quantised bytes of the weight, GFLOP/s 2*N*K*T. "blas" is x @ W.T with W
float32 in numpy (its GB/s counts its 4-byte weights).

--vs-llama-cpp also times llama.cpp's own product (ggml's CPU MUL_MAT through ctypes, tools/ggml_mulmat.py:
what test-backend-ops' perf mode times) on the same weight copies, x and thread count, in the same run: both
engines are then timed as passes over all the copies (seconds per product = best pass / copies), the two
interleaved over --repeat rounds, so a burst of other load hits both alike. Needs llama-cpp-python.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT  # noqa: E402

from clutor._util import sleeping_kernel_workers  # noqa: E402
from clutor.model import kernels  # noqa: E402
from clutor.model.kernel_settings import KernelSettings  # noqa: E402

SHAPES = {  # name -> (n_rows, n_cols) in numpy order
    "expert_gate_up": (1024, 2048),
    "expert_down": (2048, 1024),
    "dense": (2048, 2048),
    "output": (50304, 2048),
    "q3_q": (4096, 2048),           # Qwen3-30B-A3B's attention q (32 heads x 128)
    "q3_expert_gate_up": (768, 2048),
    "q3_expert_down": (2048, 768),
}
# byte offsets of the f16 scales inside a block, set to small finite values in random blocks
_F16_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
           "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "MXFP4": (),
           "Q2_K": (80, 82), "Q3_K": (108,), "IQ4_XS": (0,), "IQ1_M": (),
           **{t: (0,) for t in ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S")}}


def random_weight(name: str, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid raw bytes of a (n_rows, n_cols) weight; timing does not depend on the values."""
    if name in ("F32", "F16", "BF16"):
        wf = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        if name == "F32":
            return wf.view(np.uint8).reshape(-1)
        if name == "F16":
            return wf.astype(np.float16).view(np.uint8).reshape(-1)
        return (wf.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
    block, nbytes = GGML_QUANT_SIZES[QT[name]]
    blocks = rng.integers(0, 256, size=(n_rows * n_cols // block, nbytes), dtype=np.uint8)
    for at in _F16_AT[name]:
        d = rng.uniform(1e-3, 5e-2, size=len(blocks)).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    if name == "MXFP4":  # an E8M0 exponent byte: 2^(e-128), kept near 1e-2
        blocks[:, 0] = rng.integers(118, 124, size=len(blocks))
    if name == "IQ1_M":  # its f16 scale: the top nibbles of the four u16 scale words at byte 48
        d = rng.uniform(1e-3, 5e-2, size=len(blocks)).astype(np.float16).view(np.uint16)
        sc = blocks[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        blocks[:, 48:56] = sc.view(np.uint8)
    return blocks.reshape(-1)


def _times(fn, copies: list, runs: int, repeat: int) -> tuple[float, float]:
    """-> (best median over `repeat` rounds of `runs` calls, fastest single call), in seconds."""
    medians, fastest = [], float("inf")
    for _ in range(repeat):
        times = []
        for i in range(runs):
            w = copies[i % len(copies)]
            t0 = time.perf_counter()
            fn(w)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
        fastest = min(fastest, min(times))
    return min(medians), fastest


def bench_one(name: str, shape: str, n_tok: int, mode: str, threads: int | None, args, rng, ggml=None) -> dict:
    n_rows, n_cols = SHAPES[shape]
    qt = int(QT[name])
    w = random_weight(name, n_rows, n_cols, rng)
    n_copies = max(2, min(64, int(args.rotate_mb * 2**20 // w.nbytes) + 1))
    copies = [w] + [w.copy() for _ in range(n_copies - 1)]
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    out = np.empty((n_tok, n_rows), np.float32)
    ks = KernelSettings(mode, threads=threads)

    def ours(ww):
        kernels.matmul(ww, qt, n_rows, n_cols, x, out=out, settings=ks)

    ours(w)  # compile / load
    row = {"type": name, "shape": shape, "n_rows": n_rows, "n_cols": n_cols, "tokens": n_tok,
           "mode": kernels.mode(ks), "threads": kernels.info(ks).threads, "weight_bytes": int(w.nbytes)}
    if ggml is None:
        t, fastest = _times(ours, copies, args.runs, args.repeat)
    else:  # passes over the copies, interleaved with llama.cpp's (see the module docstring)
        t = fastest = tg = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            for ww in copies:
                ours(ww)
            t = fastest = min(t, (time.perf_counter() - t0) / len(copies))
            tg = min(tg, ggml.time(copies, qt, n_rows, n_cols, x, row["threads"], passes=1))
        row.update({"llama_ms": tg * 1e3, "llama_GBps": w.nbytes / tg / 1e9, "vs_llama": tg / t})
    del copies
    row.update({"ms": t * 1e3, "ms_min": fastest * 1e3, "GBps": w.nbytes / t / 1e9,
                "GFLOPs": 2.0 * n_rows * n_cols * n_tok / t / 1e9})
    return row


def bench_blas(shape: str, n_tok: int, args, rng) -> dict:
    n_rows, n_cols = SHAPES[shape]
    wf = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    n_copies = max(2, min(16, int(args.rotate_mb * 2**20 // wf.nbytes) + 1))
    copies = [wf] + [wf.copy() for _ in range(n_copies - 1)]
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    out = np.empty((n_tok, n_rows), np.float32)

    def blas(ww):
        np.matmul(x, ww.T, out=out)

    blas(wf)
    t, fastest = _times(blas, copies, args.runs, args.repeat)
    return {"ms": t * 1e3, "ms_min": fastest * 1e3, "GBps": wf.nbytes / t / 1e9,
            "GFLOPs": 2.0 * n_rows * n_cols * n_tok / t / 1e9}


def sweep_t(args, rng) -> list[dict]:
    """Row kernels vs dequantise+BLAS for T = 1..64 on the expert gate/up shape."""
    rows = []
    n_rows, n_cols = SHAPES[args.sweep_shape]
    for name in args.types:
        qt = int(QT[name])
        w = random_weight(name, n_rows, n_cols, rng)
        copies = [w] + [w.copy() for _ in range(max(1, int(args.rotate_mb * 2**20 // w.nbytes)))]
        for mode in args.modes:
            for n_tok in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256):
                x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
                out = np.empty((n_tok, n_rows), np.float32)
                res = {}
                for path, thr in (("rows", 10**9), ("blas", 1)):
                    ks = KernelSettings(mode, threads=thread_counts[0], blas_min_tokens=thr)

                    def call(ww):
                        kernels.matmul(ww, qt, n_rows, n_cols, x, out=out, settings=ks)

                    call(w)
                    res[path] = _times(call, copies, args.runs, args.repeat)[0] * 1e3
                rows.append({"type": name, "mode": kernels.mode(ks), "tokens": n_tok,
                             "rows_ms": res["rows"], "blas_ms": res["blas"]})
                print(f"{name:6s} {kernels.mode(ks):3s} T={n_tok:3d}  rows {res['rows']:8.3f} ms"
                      f"  dequant+blas {res['blas']:8.3f} ms", file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K,Q5_K,Q6_K,F16", type=lambda s: s.split(","))
    ap.add_argument("--shapes", default=",".join(SHAPES), type=lambda s: s.split(","))
    ap.add_argument("--tokens", default="1,64", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--modes", default="q8,f32", type=lambda s: s.split(","))
    ap.add_argument("--runs", type=int, default=30, help="calls per median")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the best median is kept")
    ap.add_argument("--rotate-mb", type=float, default=256, help="weight copies cycled per call (cache-cold)")
    ap.add_argument("--threads", default=None, type=lambda s: [int(v) for v in s.split(",")],
                    help="thread counts, comma-separated (default: the CPUs this process may use)")
    ap.add_argument("--vs-llama-cpp", action="store_true", help="also time llama.cpp's product (ggml MUL_MAT) in the same run")
    ap.add_argument("--sweep-t", action="store_true", help="find the row-kernel / BLAS crossover")
    ap.add_argument("--sweep-shape", default="expert_gate_up", choices=list(SHAPES))
    ap.add_argument("--json", action="store_true", help="print results as JSON on stdout")
    args = ap.parse_args()
    sleeping_kernel_workers()  # as Model.open does
    t0 = time.perf_counter()
    kernels.warmup()
    thread_counts = args.threads or [None]
    info = kernels.info(KernelSettings(threads=thread_counts[0]))
    print(f"backend {info.backend}, {info.threads} threads, warmup {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rng = np.random.default_rng(0)

    if args.sweep_t:
        rows = sweep_t(args, rng)
        if args.json:
            print(json.dumps({"info": info.__dict__, "sweep": rows}, indent=1))
        return

    ggml = None
    if args.vs_llama_cpp:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from ggml_mulmat import GGMLMulMat

        ggml = GGMLMulMat()
    results = []
    for shape in args.shapes:
        for threads in thread_counts:
            for n_tok in args.tokens:
                blas = None if ggml else bench_blas(shape, n_tok, args, rng)
                for name in args.types:
                    modes = args.modes if name not in ("F16", "BF16", "F32") else ["f32"]
                    for mode in modes:
                        r = bench_one(name, shape, n_tok, mode, threads, args, rng, ggml)
                        head = (f"{shape:15s} {r['n_rows']:5d}x{r['n_cols']:<5d} T={n_tok:<3d} {r['threads']}t {name:7s} "
                                f"{r['mode']:3s} {r['ms']:9.3f} ms {r['GBps']:6.2f} GB/s {r['GFLOPs']:7.1f} GFLOP/s")
                        if blas:
                            r["blas_ms"], r["blas_ms_min"], r["blas_GBps"] = blas["ms"], blas["ms_min"], blas["GBps"]
                            r["time_vs_blas"] = r["ms"] / blas["ms"]
                            tail = (f" | blas f32 {blas['ms']:9.3f} ms {blas['GBps']:6.1f} GB/s  time x{r['time_vs_blas']:.2f}")
                        else:
                            tail = f" | llama.cpp {r['llama_ms']:9.3f} ms {r['llama_GBps']:6.2f} GB/s  speed x{r['vs_llama']:.2f}"
                        results.append(r)
                        if not args.json:
                            print(head + tail, flush=True)
    if args.json:
        print(json.dumps({"info": info.__dict__, "results": results}, indent=1))


if __name__ == "__main__":
    main()
