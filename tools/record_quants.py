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

and tests/golden/ggml_dots.npz, per weight type T with an int8 path in ggml (Q8_0 ... IQ4_XS, the
i-quants IQ3_XXS ... IQ1_M):
  T.w      [R, row bytes] uint8   R rows of K = 1024, quantised by llama.cpp's own quantiser
                                  (ggml_quantize_chunk) from Gaussian floats with a few large columns
                                  (with a uniform importance matrix where ggml requires one)
  T.dot    [N, R] f32             ggml's x86 vec_dot of each row with each activation row
                                  x[DOT_ROWS] (quantised by its vec_dot_type's from_float)
  dot_rows [N] int                the rows of x used (those whose blocks have finite scales)

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
    dll.ggml_cpu_init()  # fills ggml's half -> float table, which its dot products read
    for name in ("quantize_row_q8_0", "quantize_row_q8_1", "quantize_row_q8_K"):
        fn = getattr(dll, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
    return dll


# weight type -> (ggml type id, vec_dot symbol, activation kind); ggml-cpu.c's type_traits_cpu
DOT_TYPES = {
    "Q8_0": (8, "ggml_vec_dot_q8_0_q8_0", "q8_0"), "Q4_0": (2, "ggml_vec_dot_q4_0_q8_0", "q8_0"),
    "Q4_1": (3, "ggml_vec_dot_q4_1_q8_1", "q8_1"), "Q5_0": (6, "ggml_vec_dot_q5_0_q8_0", "q8_0"),
    "Q5_1": (7, "ggml_vec_dot_q5_1_q8_1", "q8_1"), "IQ4_NL": (20, "ggml_vec_dot_iq4_nl_q8_0", "q8_0"),
    "MXFP4": (39, "ggml_vec_dot_mxfp4_q8_0", "q8_0"),
    "Q2_K": (10, "ggml_vec_dot_q2_K_q8_K", "q8_K"), "Q3_K": (11, "ggml_vec_dot_q3_K_q8_K", "q8_K"),
    "Q4_K": (12, "ggml_vec_dot_q4_K_q8_K", "q8_K"), "Q5_K": (13, "ggml_vec_dot_q5_K_q8_K", "q8_K"),
    "Q6_K": (14, "ggml_vec_dot_q6_K_q8_K", "q8_K"), "IQ4_XS": (23, "ggml_vec_dot_iq4_xs_q8_K", "q8_K"),
    "IQ2_XXS": (16, "ggml_vec_dot_iq2_xxs_q8_K", "q8_K"), "IQ2_XS": (17, "ggml_vec_dot_iq2_xs_q8_K", "q8_K"),
    "IQ3_XXS": (18, "ggml_vec_dot_iq3_xxs_q8_K", "q8_K"), "IQ1_S": (19, "ggml_vec_dot_iq1_s_q8_K", "q8_K"),
    "IQ3_S": (21, "ggml_vec_dot_iq3_s_q8_K", "q8_K"), "IQ2_S": (22, "ggml_vec_dot_iq2_s_q8_K", "q8_K"),
    "IQ1_M": (29, "ggml_vec_dot_iq1_m_q8_K", "q8_K"),
}
N_DOT_ROWS = 16  # weight rows per type


def ggml_base() -> ctypes.CDLL:
    import llama_cpp

    dll = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    dll.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    dll.ggml_quantize_chunk.restype = ctypes.c_size_t
    dll.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    dll.ggml_row_size.restype = ctypes.c_size_t
    dll.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    dll.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    return dll


def quantize_weights(base: ctypes.CDLL, type_id: int, wf: np.ndarray) -> np.ndarray:
    """float32 [R, K] -> uint8 [R, row bytes] by llama.cpp's quantiser (no importance matrix, or a
    uniform one for the types it refuses to quantise without: IQ2_XXS, IQ2_XS, IQ1_S)."""
    rb = base.ggml_row_size(type_id, wf.shape[1])
    out = np.zeros((wf.shape[0], rb), np.uint8)
    src = np.ascontiguousarray(wf, np.float32)
    imatrix = np.ones(wf.shape[1], np.float32) if base.ggml_quantize_requires_imatrix(type_id) else None
    base.ggml_quantize_chunk(type_id, src.ctypes.data, out.ctypes.data, 0, wf.shape[0], wf.shape[1],
                             None if imatrix is None else imatrix.ctypes.data)
    return out


def vec_dots(dll: ctypes.CDLL, symbol: str, w: np.ndarray, acts: np.ndarray, k: int) -> np.ndarray:
    """ggml's vec_dot of every weight row [R, rb] with every activation row [N, ab] -> f32 [N, R]."""
    fn = getattr(dll, symbol)
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = None
    out = np.zeros((acts.shape[0], w.shape[0]), np.float32)
    s = np.zeros(1, np.float32)
    for n in range(acts.shape[0]):
        for r in range(w.shape[0]):
            fn(k, s.ctypes.data, 0, w[r].ctypes.data, 0, acts[n].ctypes.data, 0, 1)
            out[n, r] = s[0]
    return out


def weight_rows(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    wf = rng.standard_normal((N_DOT_ROWS, K)).astype(np.float32)
    wf[:, rng.integers(0, K, 8)] *= 6.0  # a few large columns, as trained weights have
    return wf


def from_float(dll: ctypes.CDLL, kind: str, x: np.ndarray) -> np.ndarray:
    """x f32 [T, K] -> uint8 [T, K / block * bytes]: ggml's quantize_row_<kind> of each row."""
    elems, nbytes = BLOCK_BYTES[kind]
    out = np.zeros((x.shape[0], x.shape[1] // elems * nbytes), np.uint8)
    fn = getattr(dll, f"quantize_row_{kind}")
    for t in range(x.shape[0]):
        row = np.ascontiguousarray(x[t], np.float32)
        fn(row.ctypes.data, out[t].ctypes.data, x.shape[1])
    return out


def _scales(q8_0_row: np.ndarray) -> np.ndarray:
    return q8_0_row.reshape(-1, 34)[:, :2].copy().view(np.float16)[:, 0]


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

    version = np.array(llama_cpp.__version__)
    np.savez_compressed(out, x=x, llama_cpp_version=version, **blocks)
    print(f"{out}: {x.shape[0]} rows of {K}; " + ", ".join(f"{k} {v.shape}" for k, v in blocks.items()))

    base = ggml_base()
    rows = [i for i in range(x.shape[0]) if np.isfinite(_scales(blocks["q8_0"][i])).all()]
    dots: dict[str, np.ndarray] = {"dot_rows": np.array(rows)}
    for i, (name, (type_id, symbol, kind)) in enumerate(DOT_TYPES.items()):
        w = quantize_weights(base, type_id, weight_rows(100 + i))
        dots[f"{name}.w"] = w
        dots[f"{name}.dot"] = vec_dots(dll, symbol, w, blocks[kind][rows], K)
    out = args.out / "ggml_dots.npz"
    np.savez_compressed(out, llama_cpp_version=version, **dots)
    print(f"{out}: {len(DOT_TYPES)} types x {N_DOT_ROWS} rows x {len(rows)} activation rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
