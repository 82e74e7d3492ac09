#!/usr/bin/env python3
"""Record ggml's own activation blocks and dot products, as references the kernel tests compare with.

    python tools/record_quants.py [--out tests/golden]

Writes tests/golden/ggml_activations.npz:
  x        [T, 1024] f32   activation rows: Gaussian, heavy-tailed, exact rounding ties, zero and
                           all-equal blocks, magnitudes from 1e-8 to 1e7, +a and -a both largest
  q8_0     [T, 32 * 34]    uint8, what llama.cpp's CPU quantize_row_q8_0 writes for each row
  q8_1     [T, 32 * 36]    uint8, quantize_row_q8_1
  q8_K     [T, 4 * 292]    uint8, quantize_row_q8_K
  llama_cpp_version 0-d str  llama-cpp-python's version (its libggml-cpu, built for this CPU)

These are the functions ggml's CPU matmul calls on its second operand (ggml-cpu.c: type_traits_cpu[
weight type].vec_dot_type's from_float), here taken from llama-cpp-python's libggml-cpu with ctypes.
Needs llama-cpp-python (tools only; the tests read the .npz).
"""
from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
K = 1024
BLOCK_BYTES = {"q8_0": (32, 34), "q8_1": (32, 36), "q8_K": (256, 292)}


def ggml_cpu() -> ctypes.CDLL:
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"
    dll = ctypes.CDLL(str(lib))
    for name in ("quantize_row_q8_0", "quantize_row_q8_1", "quantize_row_q8_K"):
        fn = getattr(dll, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
    return dll


def from_float(dll: ctypes.CDLL, kind: str, x: np.ndarray) -> np.ndarray:
    """x f32 [T, K] -> uint8 [T, K / block * bytes]: ggml's quantize_row_<kind> of each row."""
    elems, nbytes = BLOCK_BYTES[kind]
    out = np.zeros((x.shape[0], x.shape[1] // elems * nbytes), np.uint8)
    fn = getattr(dll, f"quantize_row_{kind}")
    for t in range(x.shape[0]):
        row = np.ascontiguousarray(x[t], np.float32)
        fn(row.ctypes.data, out[t].ctypes.data, x.shape[1])
    return out


def activation_rows(seed: int = 0) -> np.ndarray:
    """Rows that exercise every rounding branch of the activation quantisers: [T, K] f32."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(K).astype(np.float32) * s for s in (1.0, 0.01, 30.0)]
    rows.append((rng.standard_t(2, K) * 3).astype(np.float32))  # heavy tails: one large element per block
    # exact half-way points: x * (127 / amax) lands on k + 0.5 for amax = 127 (id = 1)
    tie = (rng.integers(-126, 126, K) + 0.5).astype(np.float32)
    tie[::32] = 127.0
    tie[::256] = 127.0
    rows.append(tie)
    mixed = rng.standard_normal(K).astype(np.float32)
    mixed[0:32] = 0.0                       # an all-zero Q8_0 block
    mixed[256:512] = 0.0                    # an all-zero Q8_K block
    mixed[512:544] = 0.75                   # all equal
    mixed[544:576] *= 1e-8                  # a scale that is a subnormal half
    mixed[576:608] *= 3e7                   # a scale past the largest half (65504): llama.cpp stores inf
    mixed[768] = 5.0                        # + and - the block's largest magnitude: the first wins
    mixed[800] = -5.0
    mixed[900] = -7.0                       # the Q8_K block of 768..1023 now has max -7 (first) and +7
    mixed[1000] = 7.0
    rows.append(mixed)
    for s in np.geomspace(1e-6, 1e4, 6):
        rows.append((rng.standard_normal(K) * s).astype(np.float32))
    return np.stack(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    args = ap.parse_args(argv)
    dll = ggml_cpu()
    x = activation_rows()
    blocks = {kind: from_float(dll, kind, x) for kind in BLOCK_BYTES}
    out = args.out / "ggml_activations.npz"
    import llama_cpp

    np.savez_compressed(out, x=x, llama_cpp_version=np.array(llama_cpp.__version__), **blocks)
    print(f"{out}: {x.shape[0]} rows of {K}; " + ", ".join(f"{k} {v.shape}" for k, v in blocks.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
