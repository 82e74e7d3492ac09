"""Matrix products computed straight from GGUF-quantised bytes.

    y = matmul(w, qtype, n_rows, n_cols, x)      # x f32 [T, n_cols] -> y f32 [T, n_rows] == x @ W.T

w is the raw bytes of a 2-D weight (numpy shape (n_rows, n_cols), blocks along n_cols) exactly as in
the file or an expert-cache slot. Types: those clutor.model.weight_types.TYPES gives a kernel
(``info().types`` lists them on this machine). Strategies, chosen per call:

Every function takes ``settings`` (clutor.model.kernel_settings.KernelSettings: activations, threads,
BLAS threshold; DEFAULT when omitted). Nothing here is process-wide state.

- "q8" activations (x86 with AVX2): ggml's CPU numerics. Each row of x is rounded to the int8 blocks
  ggml pairs with the weight type (its vec_dot_type: Q8_0 / Q8_1 with a half scale per 32 elements,
  Q8_K with a float scale per 256; activations.py reproduces llama.cpp's bytes bit for bit), then
  int8 x int8 dot products run block by block as ggml's x86 code computes them: float(integer dot)
  times the product of the two scales, per block. F16 / BF16 weights take x rounded to half /
  bfloat16 (as ggml converts it), F32 weights x itself; F16 products then sum in ggml's own order,
  bit for bit (f16dots: "mul_mat" for dense weights, "mul_mat_id" for experts). The result is x' @ W.T up to float rounding,
  x' being x as ggml rounds it (Q4_1 / Q5_1 add each block's min times Q8_1's rounded sum), so it
  differs from x @ W.T by the rounding, per output element r of token t at most
      ||W_r||_2 * sqrt(sum_b n_b * (max|x_tb| * (1/254 + 1/2048))**2)   (+ float rounding)
  (an element moves by at most half a step, d / 2 = max / 254, plus up to 127 times the half
  scale's own rounding of at most d / 2048). tests/test_kernels.py checks the equality with x'.
- "f32" activations: the weight is dequantised on the fly (bit-identical to gguf-py's
  dequantize) and multiplied in float32: x @ W.T up to float rounding. Always available. Tiles of
  2 rows x 8/4/2/1 tokens unpack each block once per tile and keep one accumulator per (row,
  token) in registers (_ir.tile_intrinsic).
- T >= settings.blas_min_tokens (default 32 for float products; never for int8 ones): rows are dequantised
  in chunks into a per-thread scratch buffer (grown once, reused) and multiplied by BLAS sgemm; in q8
  mode with x' (the activation blocks as floats), so that a long prefill rounds as a short one does.
  The int8 kernels keep every token count by default: a token's bits do not depend on the count, so
  a request's rows do not depend on the rows batched beside it (a 256-row step handed to BLAS
  rounded each row otherwise than the same prompt's 200-row step alone).
In q8 mode below that threshold, the row kernels take tokens four at a time, x rounded to int8 in the
same launch.

    out = matmul_jobs([Job(w, qtype, n_rows, t0, n_tok, col), ...], n_cols, x, out)

runs several products that share x and out (a layer's experts on their own rows of x; q/k/v side by
side) in ONE parallel launch: waking the worker threads costs ~0.1 ms per launch here, as much as a
2 MB expert's product. Each job's block of out equals what matmul gives for it alone.

Threads: the numba kernels split rows over ``settings.threads`` threads (default: the CPUs this
process may use; products under 3 MiB of weight bytes x tokens run on one, a byte of the i-quants,
which unpack slowly, counting 2.5-3.5 times). numba's thread count is per calling thread, so
it is applied on every call. BLAS has its own pool: a caller running kernels from several threads
at once should cap BLAS threads (e.g. OPENBLAS_NUM_THREADS=1 or threadpoolctl) and settings.threads
so the total stays at the core count. numba's OpenMP workers spin after each launch unless
OMP_WAIT_POLICY=PASSIVE: the clutor command sets that for its own process (spinning workers fight
BLAS's threads and any other process for the cores); a library user chooses for their process.

Compilation: every kernel is compiled once and cached on disk (numba cache=True); ``warmup()``
loads or compiles all of them (once per machine, then from the cache) so that no token pays.

New to this code? README.md in this package is the design note (what an intrinsic is here, each
block type's layout, how a tile sits in registers, how to add a type);
``python -m clutor.model.kernels.dump tile1 --type Q4_K [--asm]`` prints what one kernel generates.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numba
import numpy as np

from ...errors import ClutorError
from ..kernel_settings import DEFAULT, KernelSettings
from ..weight_types import QT, TYPES, type_name

__all__ = ["has_kernel", "matmul", "matmul_jobs", "Job", "warmup", "compiled", "loaded", "cache_dir", "dequantize", "mode", "info",
           "KernelInfo", "ggml_activations", "array_block", "array_max_tokens", "work_bytes", "check_weight", "run_job_array"]

# The types are weight_types.TYPES; the ids this module names itself.
F32, F16, Q8_0 = int(QT.F32), int(QT.F16), int(QT.Q8_0)  # plain ints: numba would type an IntEnum apart
# int8 path: weight type -> activation elements per scale (32, or 256 for K-quants)
_Q8_BLOCK = {int(q): t.q8_block for q, t in TYPES.items() if t.q8_block}

# Token counts from which dequantise-then-BLAS is used, per activation mode (2 cores, Zen 4, OLMoE's
# 2048 x 2048 and 1024 x 2048 Q8_0, each engine in its own process, GFLOP/s):
#   T          16    32    64   128   256   512
#   int8      181   217   229   230   230   220   (AVX2 code: 201-212)
#   BLAS      120   161   201   222   235   238   (dequantise + numpy's OpenBLAS sgemm)
#   f32 tiles 132   ~145  (tools/bench_kernels.py)
# and, worse than its own speed, OpenBLAS's threads spin for milliseconds after each sgemm: numba's
# threads launched in that time (the experts after a prefill's q/k/v) ran at one core's speed (115
# instead of ~200 GFLOP/s). So float tiles stay below 32 tokens, and int8 never hands over: within
# ~10% of BLAS at any count, it gives a token the same bits whatever the count (see the docstring).
_BLAS_MIN_T = {"q8": 1 << 62, "f32": 32}
# Rows dequantised per BLAS call: small enough to stay in L2/L3 between the two steps.
_CHUNK_BYTES = 4 << 20
# Weight bytes x tokens from which a product is split over the threads. A launch on two threads waits
# for the second one to wake and to finish (~50-100 us on the project's 2-core EPYC VM when Python work
# separates the launches, as between a decode step's products); one thread streams ~10 GB/s, so below
# ~3 MiB one thread is done first (one-token Q8_0 products, K = 2048, quiet machine, one thread vs two:
# 1 MiB 57 vs 83 us, 2 MiB 100 vs 125, 4 MiB 223 vs 189, 8 MiB 483 vs 272).
_PARALLEL_MIN_BYTES = 3 << 20
# ... counted in Q8_0's bytes: the i-quants unpack through grids at 1-2.5 GB/s of weight bytes on one thread
# (Q8_0 ~7-10), so a byte of theirs counts 2.5 (IQ1_S / IQ1_M 3.5). One-token products, 2048 columns, 1 vs 2
# threads, quiet machine, OMP_WAIT_POLICY=PASSIVE as the clutor command runs: a layer's q/k/v in IQ1_S, IQ1_S,
# IQ2_XXS (2.6 MB) 1.79 vs 1.21 ms, two IQ2_XXS matrices (2.1 MB) 1.29 vs 1.04, one IQ2_XXS (1.0 MB) 0.46 vs
# 0.57, one IQ1_S (0.8 MB) 0.62 vs 0.67; the K-quants keep Q8_0's count (one Q3_K, 1.7 MB: 0.36 vs 0.38).
_BYTE_COST = np.ones(max(int(q) for q in TYPES) + 1, np.float64)  # GGML type id -> Q8_0 bytes per byte
for _name in ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S"):
    _BYTE_COST[int(QT[_name])] = 2.5
for _name in ("IQ1_S", "IQ1_M"):
    _BYTE_COST[int(QT[_name])] = 3.5


@dataclass(frozen=True)
class KernelInfo:
    backend: str            # "x86-avx512vnni" | "x86-avx2" | "portable"
    activation_mode: str    # "q8" | "f32" (what matmul will use for T below the BLAS threshold)
    threads: int
    blas_min_tokens: int
    types: tuple[str, ...]


from . import _ir  # noqa: E402
from . import activations as _act  # noqa: E402
from . import f16dots as _f16  # noqa: E402
from . import drivers as _drv  # noqa: E402
from . import routing as _routing  # noqa: E402

log = logging.getLogger("clutor.kernels")
_tls = threading.local()
# numba's "workqueue" threading layer (used when neither TBB nor OpenMP is available) aborts the
# process if two threads launch parallel kernels at once; then launches are serialised.
_serial_lock: threading.Lock | None = None
_layer_checked = False
_cache_checked = False


def _guard_cache() -> None:
    """numba's on-disk cache only watches each function's own file; the drivers are compiled from
    IR written in sibling modules and the type table (weight_types.py), for the ISA _ir targets.
    Before the first launch of this process, drop the drivers' cached code when any of that changed
    since it was compiled. Only Clutor's own cache files are touched, in the directory numba really
    uses for them."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha1(_ir.BACKEND.encode())
    for p in sorted(here.glob("*.py")) + [here.parent / "weight_types.py"]:
        digest.update(p.name.encode() + p.read_bytes())
    where = cache_dir()  # numba's locator (NUMBA_CACHE_DIR aware)
    if where is None:  # caching off or a numba without this attribute: nothing to guard
        return
    stamp = where / "clutor-kernels-sources.sha1"
    try:
        if stamp.exists() and stamp.read_text() == digest.hexdigest():
            return
        where.mkdir(parents=True, exist_ok=True)
        for mod in ("drivers", "activations"):
            for f in where.glob(f"{mod}.*.nb[ic]"):
                f.unlink()
        stamp.write_text(digest.hexdigest())
    except OSError:  # read-only install: numba then caches elsewhere or not at all
        pass


def _max_numba_threads() -> int:
    return int(numba.config.NUMBA_NUM_THREADS)


# What a kernel reads at a time, (elements, bytes): drivers.FORMATS' blocks (F16/BF16 rows in 32-element
# groups), F32 one float (BLAS). F16 on x86 without F16C has no kernel: vector half conversion would
# need a runtime library numba does not link.
_BLOCKS: dict[int, tuple[int, int]] = {F32: (1, 4), **{q: (f.elems, f.nbytes) for q, f in _drv.FORMATS.items()}}
_SUPPORTED = frozenset(q for q in _BLOCKS if not (q == F16 and _ir.X86_WITHOUT_F16C))


def has_kernel(qtype: int) -> bool:
    """True when matmul accepts this GGML type id."""
    return int(qtype) in _SUPPORTED


def mode(settings: KernelSettings = DEFAULT) -> str:
    """The activation mode products below the BLAS threshold really use: "q8" or "f32" ("auto" is
    q8 where the machine has int8 SIMD; q8 falls back to f32 without it)."""
    return "q8" if settings.activations in ("q8", "auto") and _ir.HAVE_INT8_SIMD else "f32"


def _blas_from(settings: KernelSettings, int8: bool) -> int:
    """Token count from which a product goes to BLAS, for the int8 or the float-tile path."""
    return settings.blas_min_tokens or _BLAS_MIN_T["q8" if int8 else "f32"]


def _n_threads(settings: KernelSettings) -> int:
    return max(1, min(settings.n_threads, _max_numba_threads()))


def info(settings: KernelSettings = DEFAULT) -> KernelInfo:
    m = mode(settings)
    return KernelInfo(_ir.BACKEND, m, _n_threads(settings), _blas_from(settings, m == "q8"),
                      tuple(type_name(q) for q in _BLOCKS if has_kernel(q)))


def _apply_threads(n: int) -> None:
    """numba's thread count is per calling thread; remember what this thread last set, because
    numba.get_num_threads() alone costs ~1 us."""
    if getattr(_tls, "nthreads", None) != n:
        numba.set_num_threads(n)
        _tls.nthreads = n


def _launch(fn, *args) -> None:
    """Run a parallel driver, serialised when the threading layer needs it."""
    global _serial_lock, _layer_checked, _cache_checked
    if not _cache_checked:
        _cache_checked = True
        _guard_cache()
    if _serial_lock is not None:
        with _serial_lock:
            fn(*args)
        return
    fn(*args)
    if not _layer_checked:
        try:
            layer = numba.threading_layer()
        except ValueError:  # no parallel region has started yet
            return
        _layer_checked = True
        if layer == "workqueue":
            _serial_lock = threading.Lock()


def _scratch(name: str, n: int, dtype) -> np.ndarray:
    """A per-thread, grow-only buffer of at least n elements (no allocation once warm)."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    buf = bufs.get(name)
    if buf is None or buf.size < n:
        buf = bufs[name] = np.empty(max(n, 1), dtype=dtype)
    return buf[:n]


def _act_buffers(n_tok: int, n_cols: int, block: int) -> tuple[np.ndarray, ...]:
    """Per-thread int8-activation scratch for this shape: xq [T, K], xd [T, K/block], xs1 [T, K/32]
    (Q8_1's s), xs16 [T, K/16] (Q8_K's bsums); activations.py says what each holds. One grow-only
    set per (K, block), its first T rows given: a long prompt's expert groups each have another T,
    and a set per T would keep every size seen."""
    cache = getattr(_tls, "act", None)
    if cache is None:
        cache = _tls.act = {}
    key = (n_cols, block)
    bufs = cache.get(key)
    if bufs is None or bufs[0].shape[0] < n_tok:
        T = max(n_tok, 1)
        bufs = cache[key] = (np.empty((T, n_cols), np.int8), np.empty((T, n_cols // block), np.float32),
                             np.empty((T, n_cols // 32), np.float32), np.empty((T, n_cols // 16), np.int16))
    return tuple(b[:n_tok] for b in bufs)


def _row_bytes(qtype: int, n_cols: int) -> int:
    elems, nbytes = _BLOCKS[qtype]
    if n_cols <= 0 or n_cols % elems:
        raise ClutorError(f"kernels: a {type_name(qtype)} row must hold a positive multiple of {elems} "
                          f"elements, got {n_cols}")
    return n_cols // elems * nbytes


# The generated code has no bounds checks (_ir.py): every offset it uses derives from shapes checked
# here, in Python, before any launch. What it relies on, and where that is checked:
# - the type has a kernel on this machine (else its type switch does nothing and out keeps garbage): _check
# - w C-contiguous 1-D uint8 of exactly n_rows * row_bytes bytes, so every row read lies inside it: _check
# - n_cols a positive multiple of the kernel's block (loops run n_cols / block blocks; the int8 scratch
#   holds n_cols / block scales and n_cols / 16 and / 32 sums per token): _row_bytes
# - x C-contiguous, aligned float32 [T, n_cols] (each token's row is read whole, 4-byte aligned vector
#   loads); out C-contiguous, aligned float32 [T, n_rows] (matmul) or [S, M] with S = x's rows
#   (matmul_jobs): matmul, matmul_jobs; a read-only x is copied (numba would compile another variant)
# - each job's rows t0 .. t0 + n_tok inside x and out, columns col .. col + n_rows inside out: matmul_jobs
# - dequantize's out C-contiguous, aligned float32 [n_rows, n_cols]: dequantize
# - the int8 scratch (xq, xd, xs1, xs16) shaped for x and the activation block: _run_jobs_q8
# - a job's weight alive while the driver uses its address: the caller's Job holds the array for the call


def _check(w: np.ndarray, qtype: int, n_rows: int, n_cols: int) -> int:
    """-> bytes per row, after checking the weight matches (type, shape). On every product's path (a
    decode step makes ~50 jobs): the row bytes are looked up once per (type, columns), and a uint8
    array's dtype is numpy's one uint8 instance."""
    rb = _RB.get((qtype, n_cols))
    if rb is None:
        if qtype not in _SUPPORTED:
            raise ClutorError(f"kernels: no kernel for {type_name(qtype)}; check has_kernel() first")
        rb = _RB[(int(qtype), int(n_cols))] = _row_bytes(qtype, n_cols)
    if (w.dtype is not _U8 and w.dtype != _U8) or w.ndim != 1 or not w.flags.c_contiguous:
        raise ClutorError(f"kernels: weight must be C-contiguous 1-D uint8, got {w.dtype} {w.shape}")
    if w.size != n_rows * rb:
        raise ClutorError(f"kernels: {type_name(qtype)} weight ({n_rows}, {n_cols}) needs {n_rows * rb} bytes, "
                          f"got {w.size}")
    return rb


_RB: dict[tuple[int, int], int] = {}  # (type, columns) -> bytes per row, of types with a kernel
_U8 = np.dtype(np.uint8)


def dequantize(w: np.ndarray, qtype: int, n_rows: int, n_cols: int, out: np.ndarray | None = None,
               settings: KernelSettings = DEFAULT) -> np.ndarray:
    """The whole weight as float32 [n_rows, n_cols] (bit-identical to gguf.quants.dequantize)."""
    qtype = int(qtype)
    rb = _check(w, qtype, n_rows, n_cols)
    if out is None:
        out = np.empty((n_rows, n_cols), np.float32)
    if out.dtype != np.float32 or out.shape != (n_rows, n_cols) or not (out.flags.c_contiguous and out.flags.aligned):
        raise ClutorError(f"kernels: out must be C-contiguous, aligned float32 [{n_rows}, {n_cols}], "
                          f"got {out.dtype} {out.shape}")
    if qtype == F32:
        out[...] = w.view(np.float32).reshape(n_rows, n_cols)
        return out
    n = _n_threads(settings)
    if n == 1:
        _drv.dequantize_rows_serial(w, qtype, rb, 0, n_rows, n_cols, out)
        return out
    _apply_threads(n)
    _launch(_drv.dequantize_rows, w, qtype, rb, 0, n_rows, n_cols, out)
    return out


def matmul(w: np.ndarray, qtype: int, n_rows: int, n_cols: int, x: np.ndarray,
           out: np.ndarray | None = None, settings: KernelSettings = DEFAULT) -> np.ndarray:
    """x @ W.T. w: uint8 [n_rows * row_bytes]; x: f32 [T, n_cols] (or [n_cols]); out: f32 [T, n_rows].

    Returns `out` when given (nothing allocated on the hot path)."""
    qtype = int(qtype)
    n_rows = int(n_rows)
    n_cols = int(n_cols)
    rb = _check(w, qtype, n_rows, n_cols)
    squeeze = x.ndim == 1
    x2 = x.reshape(1, -1) if squeeze else x
    if x2.dtype != np.float32 or x2.ndim != 2 or x2.shape[1] != n_cols or not (x2.flags.c_contiguous and x2.flags.aligned):
        raise ClutorError(f"kernels: x must be C-contiguous, aligned float32 [T, {n_cols}], got {x.dtype} {x.shape}")
    if not x2.flags.writeable:  # a read-only x would make numba compile a second variant
        xc = _scratch("xcopy", x2.size, np.float32).reshape(x2.shape)
        xc[...] = x2
        x2 = xc
    n_tok = x2.shape[0]
    if out is None:
        out = np.empty((n_rows,) if squeeze else (n_tok, n_rows), np.float32)
    out2 = out.reshape(1, -1) if out.ndim == 1 else out
    if out2.dtype != np.float32 or out2.shape != (n_tok, n_rows) or not (out2.flags.c_contiguous and out2.flags.aligned):
        raise ClutorError(f"kernels: out must be C-contiguous, aligned float32 [{n_tok}, {n_rows}], "
                          f"got {out.dtype} {out.shape}")
    if n_tok == 0:
        return out

    if qtype == F32:
        np.matmul(x2, w.view(np.float32).reshape(n_rows, n_cols).T, out=out2)
        return out
    # Below _PARALLEL_MIN_BYTES of (Q8_0-equivalent) weight bytes x tokens one thread is done first.
    _apply_threads(1 if w.size * n_tok * _BYTE_COST[qtype] < _PARALLEL_MIN_BYTES else _n_threads(settings))
    ggml = mode(settings) == "q8"
    q8 = ggml and qtype in _Q8_BLOCK
    if ggml and qtype in _ROUNDED:  # F16 / BF16: ggml multiplies them with activations of their own type
        x2 = _rounded(x2, qtype, "xround")
    if ggml and qtype == F16 and settings.ggml_f16:  # summed in ggml's order (f16dots: one ulp grows through a model)
        _f16.matmul(x2, w.view(np.uint16).reshape(n_rows, n_cols), out2, "mul_mat")
        return out
    if n_tok >= _blas_from(settings, q8) and q8:  # BLAS on ggml's activation blocks as floats
        xf, blocks = _q8_floats(x2, _Q8_BLOCK[qtype])
        _blas(w, qtype, rb, n_rows, n_cols, xf, out2)
        if qtype in _WITH_MIN:
            _q8_1_sums(w, n_rows, rb, blocks, out2)
    elif n_tok >= _blas_from(settings, q8):
        _blas(w, qtype, rb, n_rows, n_cols, x2, out2)
    elif q8:
        _run_jobs_q8(_Q8_BLOCK[qtype], [(_drv.address(w), qtype, rb, n_rows, 0, n_tok, 0)], n_cols, x2, out2)
    else:
        _run_jobs([(_drv.address(w), qtype, rb, n_rows, 0, n_tok, 0)], n_cols, x2, out2)
    return out


class Job(NamedTuple):
    """One product of a matmul_jobs call: rows t0 .. t0+n_tok of x times W.T into out's rows
    t0 .. t0+n_tok, columns col .. col+n_rows."""
    w: np.ndarray   # uint8 [n_rows * row_bytes]
    qtype: int
    n_rows: int
    t0: int
    n_tok: int
    col: int = 0


def matmul_jobs(jobs: Sequence[Job], n_cols: int, x: np.ndarray, out: np.ndarray,
                settings: KernelSettings = DEFAULT, order: str = "mul_mat") -> np.ndarray:
    """Several products sharing x [S, n_cols] and out [S, M] (C-contiguous float32), e.g. a layer's
    experts (each on its own rows of x) or q/k/v (same rows, side by side in out).

    Each (row, token) result equals what matmul() gives for that job alone. All jobs below the BLAS
    threshold run in ONE parallel launch (one per activation block size in q8 mode): waking the worker threads costs ~0.1 ms per
    launch on a 2-core VM, as much as a 2 MB expert's product itself. order: which of llama.cpp's
    products the F16 jobs stand for in q8 mode, "mul_mat" (dense) or "mul_mat_id" (experts), whose
    sums run in different orders (f16dots). Returns out."""
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != n_cols or not (x.flags.c_contiguous and x.flags.aligned):
        raise ClutorError(f"kernels: x must be C-contiguous, aligned float32 [S, {n_cols}], got {x.dtype} {x.shape}")
    if (out.dtype != np.float32 or out.ndim != 2 or not (out.flags.c_contiguous and out.flags.aligned)
            or out.shape[0] != x.shape[0]):
        raise ClutorError(f"kernels: out must be C-contiguous, aligned float32 [{x.shape[0]}, M], "
                          f"got {out.dtype} {out.shape}")
    if not x.flags.writeable:  # a read-only x would make numba compile a second variant
        xc = _scratch("xcopy", x.size, np.float32).reshape(x.shape)
        xc[...] = x
        x = xc
    # float tiles, by the rounding their activations take (0: none; F16 / BF16 in q8 mode: their type)
    batched: dict[int, list[tuple[int, int, int, int, int, int, int]]] = {}
    by_block: dict[int, list[tuple[int, int, int, int, int, int, int]]] = {}  # int8 path: activation block -> jobs
    work = 0
    q8 = mode(settings) == "q8"
    f16_ordered = q8 and settings.ggml_f16
    blas_int8, blas_float = _blas_from(settings, True), _blas_from(settings, False)
    S, M = x.shape[0], out.shape[1]
    address = _drv.address
    for w, qtype, n_rows, t0, n_tok, col in jobs:
        qtype, n_rows = int(qtype), int(n_rows)
        rb = _check(w, qtype, n_rows, n_cols)
        if t0 < 0 or n_tok < 0 or t0 + n_tok > S or col < 0 or col + n_rows > M:
            raise ClutorError(f"kernels: job rows {t0}+{n_tok} / columns {col}+{n_rows} outside "
                              f"x {x.shape} / out {out.shape}")
        if n_tok == 0:
            continue
        if qtype == F16 and f16_ordered:
            rows = slice(t0, t0 + n_tok)
            _f16.matmul(_rounded(x[rows], F16, "xround16"), w.view(np.uint16).reshape(n_rows, n_cols),
                        out[rows, col : col + n_rows], order)
            continue
        block = _Q8_BLOCK.get(qtype) if q8 else None
        if qtype == F32 or n_tok >= (blas_float if block is None else blas_int8):
            y = matmul(w, qtype, n_rows, n_cols, x[t0 : t0 + n_tok], settings=settings)  # [n_tok, n_rows] (BLAS)
            out[t0 : t0 + n_tok, col : col + n_rows] = y
            continue
        job = (address(w), qtype, rb, n_rows, t0, n_tok, col)
        if block is not None:
            by_block.setdefault(block, []).append(job)
        else:
            batched.setdefault(qtype if q8 and qtype in _ROUNDED else 0, []).append(job)
        work += w.size * n_tok * _BYTE_COST[qtype]
    if batched or by_block:
        _apply_threads(1 if work < _PARALLEL_MIN_BYTES else _n_threads(settings))
    for rounding, group in batched.items():
        _run_jobs(group, n_cols, _rounded(x, rounding, "xround") if rounding else x, out)
    for block, group in by_block.items():
        _run_jobs_q8(block, group, n_cols, x, out)
    return out


def _run_jobs(jobs: list[tuple[int, int, int, int, int, int, int]], n_cols: int, x: np.ndarray,
              out: np.ndarray) -> None:
    """The float tile driver on checked jobs (address, type, row bytes, rows, t0, n_tok, col); the
    caller keeps the weights alive and has set the thread count."""
    _launch(_drv.matmul_jobs_f32, np.array(jobs, np.int64), n_cols, x, out)


def _run_jobs_q8(block: int, jobs: list[tuple[int, int, int, int, int, int, int]], n_cols: int, x: np.ndarray,
                 out: np.ndarray) -> None:
    """The int8 driver on checked jobs whose types all take activation blocks of `block` elements:
    x is rounded once for all of them, in the same launch; on the calling thread alone when the
    caller set one thread."""
    _run_array_q8(block, np.array(jobs, np.int64), n_cols, x, out)


def _run_array_q8(block: int, jobs_a: np.ndarray, n_cols: int, x: np.ndarray, out: np.ndarray) -> None:
    """_run_jobs_q8 on the jobs as an array [n_jobs, 7] (drivers.py's columns)."""
    xq, xd, xs1, xs16 = _act_buffers(x.shape[0], n_cols, block)
    # quantize_activations and the int8 kernels index these without bounds checks
    assert n_cols % block == 0 and n_cols % 32 == 0 and xq.shape == x.shape, (block, n_cols, xq.shape, x.shape)
    assert xd.shape[1] * block == xs1.shape[1] * 32 == xs16.shape[1] * 16 == n_cols
    if getattr(_tls, "nthreads", None) == 1:
        _drv.matmul_jobs_q8_serial(jobs_a, n_cols, x, block, xq, xd, xs1, xs16, out)
    else:
        _launch(_drv.matmul_jobs_q8, jobs_a, n_cols, x, block, xq, xd, xs1, xs16, out)


def array_block(qtypes, settings: KernelSettings = DEFAULT) -> int | None:
    """How run_job_array runs products of these weight types (all in one array) in this mode: the
    int8 activation block they share (q8 mode), 0 for the float tiles (f32 mode), None when
    matmul_jobs would take another path for some of them (F32: BLAS; F16 / BF16 in q8 mode: rounded
    activations) or their blocks differ."""
    qtypes = {int(q) for q in qtypes}
    if not all(q in _SUPPORTED and q != F32 for q in qtypes):
        return None
    if mode(settings) != "q8":
        return 0
    blocks = {_Q8_BLOCK.get(q) for q in qtypes}
    return blocks.pop() if len(blocks) == 1 and None not in blocks else None


def array_max_tokens(block: int, settings: KernelSettings = DEFAULT) -> int:
    """Tokens a job of run_job_array may have at most: matmul_jobs hands longer ones to BLAS."""
    return _blas_from(settings, block > 0) - 1


def work_bytes(qtype: int, nbytes: int) -> float:
    """A product's weight bytes as the thread rule counts them per token (run_job_array's work)."""
    return nbytes * float(_BYTE_COST[int(qtype)])


def check_weight(w: np.ndarray, qtype: int, n_rows: int, n_cols: int) -> int:
    """-> bytes per row, after checking w is a C-contiguous uint8 (n_rows, n_cols) weight of a type
    with a kernel (ClutorError otherwise): what a job of run_job_array relies on."""
    return _check(w, int(qtype), int(n_rows), int(n_cols))


def run_job_array(jobs: np.ndarray, n_cols: int, x: np.ndarray, out: np.ndarray, block: int, work: float,
                  settings: KernelSettings = DEFAULT) -> None:
    """matmul_jobs for a caller that built the jobs itself, as the drivers take them (int64 [n_jobs, 7],
    drivers.py's columns: address, type, row bytes, rows, t0, n_tok, col), from weights it checked
    (check_weight) and keeps alive, every job inside x f32 [S, n_cols] and out f32 [S, M] (both
    C-contiguous, writable) and of at most array_max_tokens tokens: nothing here checks them again.
    block: array_block of the jobs' types; work: their weight bytes x tokens (work_bytes), which
    decides one thread or settings' threads as matmul_jobs decides."""
    _apply_threads(1 if work < _PARALLEL_MIN_BYTES else _n_threads(settings))
    if block:
        _run_array_q8(block, jobs, n_cols, x, out)
    else:
        _launch(_drv.matmul_jobs_f32, jobs, n_cols, x, out)


# q8 mode: the float types whose activations ggml rounds to their own type first (vec_dot_type F16 / BF16)
_ROUNDED = {F16: _act.as_half, int(QT.BF16): _act.as_bf16}


def _rounded(x: np.ndarray, qtype: int, name: str) -> np.ndarray:
    """x rounded as ggml rounds the activations of a `qtype` (F16 or BF16) weight, in per-thread scratch."""
    return _ROUNDED[qtype](x, _scratch(name, x.size, np.float32).reshape(x.shape))


def _q8_floats(x: np.ndarray, block: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """x as the int8 kernels see it, for BLAS: (d * q f32 [T, K], the blocks (xq, xd, xs1, xs16)) of
    ggml's activation blocks of `block` elements, in per-thread scratch."""
    blocks = _act_buffers(x.shape[0], x.shape[1], block)
    _act.quantize_activations(x, block, *blocks)
    return _act.dequantised(blocks[0], blocks[1], _scratch("xq8f", x.size, np.float32).reshape(x.shape)), blocks


# Q4_1 / Q5_1: ggml adds m * s per block, with Q8_1's s = half(d * sum q) rounded apart from d
_WITH_MIN = frozenset((int(QT.Q4_1), int(QT.Q5_1)))


def _q8_1_sums(w: np.ndarray, n_rows: int, rb: int, blocks: tuple[np.ndarray, ...], out2: np.ndarray) -> None:
    """After a BLAS product with d * q (which counts each block's min as m * d * sum(q)): add
    m * (s - d * sum(q)), so the result is what ggml's Q4_1 / Q5_1 dot product computes. blocks:
    the activation blocks (xq, xd, xs1, xs16) the product's floats were made from."""
    xq, xd, xs1, _ = blocks
    T, K = xq.shape
    nb = K // 32
    gap = xs1 - xd * xq.reshape(T, nb, 32).sum(axis=2, dtype=np.int32)  # [T, nb]
    mins = w.reshape(n_rows, nb, rb // nb)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, nb]
    out2 += gap @ mins.T


def ggml_activations(x: np.ndarray, qtype: int, settings: KernelSettings = DEFAULT) -> np.ndarray:
    """x f32 [T, K] as a product with a `qtype` weight sees it in this mode (a new array): in q8 mode
    ggml's activation blocks of that type as floats (d * q) or x rounded to half / bfloat16 for F16 /
    BF16; x itself for F32 and in f32 mode. For a computation that multiplies in float what llama.cpp
    multiplies as a quantised product (MLA's latents through the absorbed key projection)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    qtype = int(qtype)
    if mode(settings) != "q8" or x.size == 0:
        return x.copy()
    if qtype in _ROUNDED:
        return _ROUNDED[qtype](x, np.empty_like(x))
    if qtype in _Q8_BLOCK and x.shape[-1] % _Q8_BLOCK[qtype] == 0:
        x2 = x.reshape(-1, x.shape[-1])
        return _q8_floats(x2, _Q8_BLOCK[qtype])[0].copy().reshape(x.shape)
    return x.copy()


def _blas(w, qtype, rb, n_rows, n_cols, x2, out2) -> None:
    rows = max(1, min(n_rows, _CHUNK_BYTES // (4 * n_cols)))
    buf = _scratch("wf32", rows * n_cols, np.float32)
    for r0 in range(0, n_rows, rows):
        r1 = min(n_rows, r0 + rows)
        wc = buf[: (r1 - r0) * n_cols].reshape(r1 - r0, n_cols)  # [R, K]
        _launch(_drv.dequantize_rows, w, qtype, rb, r0, r1, n_cols, wc)
        np.matmul(x2, wc.T, out=out2[:, r0:r1])


def _warm_drivers(every_architecture: bool = False):
    """The compiled kernels warmup() launches (each compiles its helpers with it): the products' drivers,
    the layer's (_warm_layer), and with every_architecture those only some architectures call."""
    from . import dsa, ggmlmath, kvpages, norms, paged, rowwise, topk

    layer = (norms._rmsnorm, rowwise._rowdot, topk._topk, paged._rope_write, paged._attend_pages, kvpages._gather,
             rowwise._attend, _routing.negated_gate)
    own = (ggmlmath._attend, _f16._dots, dsa._index_topk) if every_architecture else ()
    return [d for d in (_drv.dequantize_rows, _drv.dequantize_rows_serial, _drv.matmul_jobs_f32, _drv.matmul_jobs_q8, _drv.matmul_jobs_q8_serial,
                        _drv.address, _act.quantize_activations, _routing.route_jobs, _routing.slot_sum) + layer + own
            if d is not None]


def _architecture_warmups():
    """Arch.warmup's kernels, for `clutor warmup` (no model): Gemma 4's and the sparse attention's."""
    from . import dsa, ggmlmath

    return (ggmlmath.warmup, _f16.warmup, dsa.warmup)


def compiled(every_architecture: bool = False) -> bool | None:
    """Whether numba's on-disk cache holds this machine's code for every kernel warmup() needs (then
    warmup only loads it, in about a second); None when that cannot be told (caching off, another numba)."""
    global _cache_checked
    if not _cache_checked:
        _cache_checked = True
        _guard_cache()
    try:
        for d in _warm_drivers(every_architecture):
            index = d._cache._cache_file._load_index()  # numba's: {(signature, machine, code hash): file}
            codegen = d.targetctx.codegen()
            if not any(key == d._cache._index_key(key[0], codegen) for key in index):
                return False
        return True
    except Exception:  # numba's cache internals are not an API: when they move, say "don't know"
        return None


def warmup(settings: KernelSettings = DEFAULT, *, every_architecture: bool = False) -> None:
    """Compile (or load from the on-disk cache) every kernel, for writable and read-only weights;
    with every_architecture also those only some architectures call (their Arch.warmup's).

    The first run on a machine compiles them (about a minute on two cores) and says so before and
    after, as INFO records of the ``clutor.kernels`` logger; afterwards they load from numba's cache.
    The weight type is a runtime argument of each compiled driver, so one call per driver and
    weight flavour covers every type."""
    import time

    global _warm
    if every_architecture:
        warmup(settings)
        for arch_warmup in _architecture_warmups():
            arch_warmup()
        return
    if _warm:  # compiled or loaded already in this process: nothing to say
        _warmup(settings)
        return
    cached = compiled()
    if cached is not True:
        log.info("compiling the compute kernels for %s%s: once per machine and version, about a minute on "
                 "two cores (`clutor warmup` does it ahead of time); cached in %s", _ir.BACKEND,
                 "" if cached is False else " (or loading them)", cache_dir() or "memory only")
    t0 = time.perf_counter()
    _warmup(settings)
    _warm_layer()  # (no settings in these: once a process)
    took = time.perf_counter() - t0
    if cached is not True or took > 5:
        log.info("compute kernels ready in %.0f s", took)
    _warm = True


_warm = False  # warmup() has run in this process


def loaded() -> set[str]:
    """Every compiled kernel specialisation this process has compiled or loaded from numba's cache, as
    "module.function(signature)": what a warm-up prepared, or what a call then had to load."""
    import sys

    from numba.core.dispatcher import Dispatcher

    found = set()
    for name, mod in list(sys.modules.items()):
        if name.startswith("clutor.") and mod is not None:
            for d in vars(mod).values():
                if isinstance(d, Dispatcher):
                    found.update(f"{d.py_func.__module__}.{d.py_func.__qualname__}{sig}" for sig in d.overloads)
    return found


def cache_dir() -> Path | None:
    """Where numba keeps the compiled kernels (NUMBA_CACHE_DIR, else __pycache__ beside them)."""
    try:
        return Path(_drv.matmul_jobs_f32._cache._cache_path)
    except AttributeError:
        return None


def _warmup(settings: KernelSettings) -> None:
    _apply_threads(_n_threads(settings))
    n_cols = 256
    x = np.zeros((1, n_cols), np.float32)
    out = np.zeros((1, 1), np.float32)
    wf = np.zeros((1, n_cols), np.float32)
    w = np.zeros(n_cols // 32 * 34, np.uint8)  # one Q8_0 row
    ro = w.copy()
    ro.flags.writeable = False
    for ww in (w, ro):
        _launch(_drv.dequantize_rows, ww, Q8_0, w.size, 0, 1, n_cols, wf)
        _drv.dequantize_rows_serial(ww, Q8_0, w.size, 0, 1, n_cols, wf)
    for ww in (w, ro):
        _drv.address(ww)
    job = [(_drv.address(w), Q8_0, w.size, 1, 0, 1, 0)]  # addresses: one flavour
    _run_jobs(job, n_cols, x, out)
    if _drv.matmul_jobs_q8 is not None:
        n = _tls.nthreads
        for threads in sorted({1, min(2, _max_numba_threads())}):  # the serial and the parallel launch
            _apply_threads(threads)
            _run_jobs_q8(32, job, n_cols, x, out)
        _apply_threads(n)
    _warm_routing()


def _warm_routing() -> None:
    """routing.py's functions, for the runner's in-memory and streamed experts (one expert of one row)."""
    sel, w, h = np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32), np.zeros((1, 32), np.float32)
    addr, parts = np.zeros((1, 2), np.int64), np.zeros((2, 4), np.int64)
    xg, wf, pair = np.empty((1, 32), np.float32), np.empty(1, np.float32), np.empty(1, np.int64)
    _routing.route_jobs(sel, w, h, False, addr, parts, xg, wf, pair, np.empty(2, np.int64),
                        np.empty((1, 7), np.int64), np.empty((1, 7), np.int64))
    _routing.slot_sum(xg, sel, pair, wf, np.empty(0, np.float32), True, np.empty((1, 32), np.float32))
    # ... and a streamed source's groups (clutor.model.resident.StreamedExperts)
    _routing.route_group(sel, w, h, False, np.zeros(1, np.int64), addr, parts, np.empty(1, np.int64), xg, wf, pair,
                         np.empty((1, 7), np.int64), np.empty((1, 7), np.int64))
    _routing.put_slots(xg, sel, pair, wf, np.empty(0, np.float32), True, 1, np.empty((1, 32), np.float32))
    _routing.sum_slots(xg, np.empty((1, 32), np.float32))


def _warm_layer() -> None:
    """The compiled kernels of a layer around its products, as the runner calls them: the BLAS path's
    activation blocks, the norms (rows
    contiguous and strided), the router's row dots (one thread and several) and top-k, rotary attention
    over KV pages (values contiguous and a fused projection's strided ones) and the general attention
    (f16 pages gathered, keys and values as column ranges of them), the SwiGLU helpers. Without these a
    process's first prompt loaded them (or on a new machine compiled them: 17 s) inside its first
    generation, holding the GIL, so the caller's event loop stalled up to 0.3 s. An architecture's own
    kernels are its Arch.warmup's."""
    from . import kvpages, norms, paged, rowwise, topk

    _q8_floats(np.zeros((1, 256), np.float32), 32)  # a long prompt's activation blocks for BLAS (q8 mode)
    x = np.zeros((2, 64), np.float32)
    w = np.ones(32, np.float32)
    for rows in (x[:, :32], np.ascontiguousarray(x[:, :32])):  # a row block's strided and contiguous views
        norms.rmsnorm_rows(rows, w, 1e-6)
    router = np.zeros((4, 32), np.float32)
    rowwise._rowdot_serial(x[:, :32].copy(), router, np.empty((2, 4), np.float32))
    rowwise._rowdot(x[:, :32].copy(), router, np.empty((2, 4), np.float32))
    topk.softmax_topk(np.zeros((1, 4), np.float32), 2, False)
    # one f16 page group of one layer (kv.KVPool's storage): a row at position 0 written, then attended
    data = np.zeros((1, 1, 1, 16, 64), np.float16)  # [page, layer, Hkv, PAGE, k | v]
    store = paged.storage(data, None)
    q = np.zeros((2, 1, 32), np.float32)  # [R, H, dk]: two rows, or a slice of one would count as contiguous
    cos, sin = np.ones((2, 16), np.float32), np.zeros((2, 16), np.float32)
    pages, offs = np.zeros(2, np.int64), np.arange(2, dtype=np.int64)
    qkv = np.zeros((2, 1, 96), np.float32)  # [R, H, q | k | v]: a fused projection's output
    fused = qkv[..., :32], qkv[..., 32:64], qkv[..., 64:]
    for q_, k_, v_ in ((q, q.copy(), q.copy()), (q, q.copy(), fused[2]), fused):  # arrays of their own, or column ranges
        qr = paged.rope_write(q_, k_, v_, cos, sin, True, pages, offs, 0, store)
    paged.attend_pages(qr, np.zeros((1, 1), np.int64), np.zeros(2, np.int64), offs, 0, store, 32, 32, 1.0)
    full = kvpages.gather_f16(data, 0, np.zeros(1, np.int64), 2)  # [Hkv, n, k | v]
    for q_, K, V in ((q, full[..., :32], full[..., 32:]),  # keys and values: column ranges of the pages
                     (np.zeros((2, 1, 64), np.float32), full, full[..., :32]),  # latent rows (MLA): values their first columns
                     fused[:1] + (full[..., :32], full[..., 32:])):  # queries a fused projection's columns
        rowwise.attend(q_, K, V, 0, 0, 1.0)
    gu, e, a = np.zeros((1, 64), np.float32), np.empty((1, 32), np.float32), np.empty((1, 32), np.float32)
    _routing.negated_gate(gu, e)
    _routing.swiglu_from_exp(gu, e, a)
