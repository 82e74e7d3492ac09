"""Widen a trained OLMoE GGUF to larger matrices that compute the same network (tools/make_model.py's
``real-olmoe-*`` presets).

The small model trained on real text (../shared/data/models/real-olmoe-q8_0.gguf: n_embd 256, expert ff
256) routes like a real MoE but its experts are 70 KB each, too small to say anything about streaming.
Widened to OLMoE-1B-7B's expert size (n_embd 2048, ff 1024) every expert costs what an OLMoE expert costs on
disk and in the kernels (6.7 MB in Q8_0), and the function, hence the routing, stays the trained one:

* the residual stream keeps the trained values in its first n dims and zeros in the other N - n;
* every Q8_0 matrix keeps its trained blocks (copied byte for byte) and gains zero blocks for the padded
  inputs and zero rows for the padded outputs, so each product over the trained dims is the trained one
  (a zero block is a zero scale and zero quants: it adds exactly 0, in float and in int8 activations);
* the router gains zero columns;
* an RMS norm over N dims of a vector that is zero outside n of them divides by sqrt(n/N) times the
  trained RMS when its epsilon is scaled by n/N (mean_N(x^2) + eps n/N = n/N (mean_n(x^2) + eps)), so
  the norms' weights are scaled by sqrt(n/N) on the trained dims (zero elsewhere) and the file's epsilon
  (one key for every norm) by n/N;
* attention keeps its heads, each widened from hd = n/heads to HD = N/heads dims (llama.cpp's olmoe
  loader wants head_dim = n_embd / n_head). NEOX RoPE rotates dim i with dim i + HD/2 at frequency
  base^(-2i/HD), so trained q/k dim j < hd/2 goes to j*HD/hd and dim j >= hd/2 to (j - hd/2)*HD/hd + HD/2:
  each keeps its partner and its frequency (HD/hd must be a whole number). v dims go to the front of
  their head, so attn_output's input blocks (hd a multiple of 32) are copied whole. The q/k norms work
  over the whole q and k vectors (as the residual norms do) and are further scaled by (HD/hd)^(1/4)
  each, so that q.k / sqrt(HD) equals the trained q.k / sqrt(hd).

llama.cpp loads the result (it is the benchmarks' peer file too); tests/test_widened.py checks that a
narrower widening by this same code gives the small model's logits.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

__all__ = ["WIDE_PRESETS", "WideSpec", "widen_model", "default_source"]

Q8_0 = GGMLQuantizationType.Q8_0
F32 = GGMLQuantizationType.F32
QK = 32          # Q8_0 values per block
BLOCK = 34       # Q8_0 bytes per block: f16 scale + 32 int8


@dataclass(frozen=True)
class WideSpec:
    name: str
    n_embd: int
    n_ff: int


WIDE_PRESETS: dict[str, WideSpec] = {
    # OLMoE-1B-7B's expert size: 6.7 MB per expert in Q8_0, ~1.2 GB in all.
    "real-olmoe-wide": WideSpec("real-olmoe-wide", 2048, 1024),
    # The same code path at 2x (the test's: ~170 MB, seconds to write and run).
    "real-olmoe-wide-512": WideSpec("real-olmoe-wide-512", 512, 512),
}


def default_source() -> Path:
    """The shared trained model, next to the checkout (../shared/data/models) as CI has it."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "data" / "models" / "real-olmoe-q8_0.gguf"


class WidenError(ValueError):
    pass


def _field(r: GGUFReader, key: str):
    f = r.fields.get(key)
    if f is None:
        raise WidenError(f"{r.path}: no metadata key {key}")
    return f.contents()


@dataclass(frozen=True)
class _Dims:
    n: int    # trained n_embd
    N: int    # widened
    f: int    # trained expert ff
    F: int
    heads: int

    @property
    def hd(self) -> int:
        return self.n // self.heads

    @property
    def HD(self) -> int:
        return self.N // self.heads


def _check(path: str, d: _Dims, n_head_kv: int) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise WidenError(f"{path}: cannot widen to n_embd {d.N}, ff {d.F}: {what}")

    need(n_head_kv == d.heads, f"needs as many kv heads as heads (have {n_head_kv} and {d.heads})")
    need(d.N >= d.n and d.F >= d.f, f"widths must not shrink (trained n_embd {d.n}, ff {d.f})")
    need(d.N % d.heads == 0 and d.n % d.heads == 0, f"n_embd must divide into {d.heads} heads")
    need(d.HD % d.hd == 0 and d.hd % 2 == 0, f"the wide head ({d.HD}) must be a multiple of the trained one ({d.hd})")
    need(d.hd % QK == 0, f"the trained head dim ({d.hd}) must be whole Q8_0 blocks")
    need(d.N % QK == 0 and d.F % QK == 0 and d.f % QK == 0 and d.n % QK == 0, "widths must be whole Q8_0 blocks")


def _qk_rows(d: _Dims) -> np.ndarray:
    """Wide position of each trained q/k dim [n]: its RoPE pair and frequency kept (module doc)."""
    hd, HD, r = d.hd, d.HD, d.HD // d.hd
    j = np.arange(hd)
    within = np.where(j < hd // 2, j * r, (j - hd // 2) * r + HD // 2)  # [hd]
    return (np.arange(d.heads)[:, None] * HD + within[None, :]).reshape(-1)  # [n]


def _v_rows(d: _Dims) -> np.ndarray:
    """Wide position of each trained v dim [n]: the front of its head."""
    return (np.arange(d.heads)[:, None] * d.HD + np.arange(d.hd)[None, :]).reshape(-1)  # [n]


def _q8(data: np.ndarray, out_rows: int, out_cols: int, rows: np.ndarray, col_blocks: np.ndarray) -> np.ndarray:
    """A Q8_0 matrix's blocks [..., R, C/32*34] bytes placed at ``rows`` x ``col_blocks`` of a zero matrix
    [..., out_rows, out_cols/32*34]; leading (expert) dims kept."""
    lead = data.shape[:-2]
    R, nb = data.shape[-2], data.shape[-1] // BLOCK
    blocks = data.reshape(*lead, R, nb, BLOCK)
    out = np.zeros((*lead, out_rows, out_cols // QK, BLOCK), np.uint8)
    out[..., rows[:, None], col_blocks[None, :], :] = blocks
    return out.reshape(*lead, out_rows, out_cols // QK * BLOCK)


def _vec(w: np.ndarray, size: int, at: np.ndarray, scale: float) -> np.ndarray:
    out = np.zeros(size, np.float32)
    out[at] = w.astype(np.float64) * scale
    return out


def _base(name: str) -> str:
    """A tensor's kind: "attn_q" for blk.3.attn_q.weight, "output_norm" for output_norm.weight."""
    return name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]


def _widened(name: str, ttype: GGMLQuantizationType, data: np.ndarray, d: _Dims) -> np.ndarray:
    """One tensor of the widened file (numpy shape, raw bytes for Q8_0)."""
    n, N, f, F = d.n, d.N, d.f, d.F
    first = np.arange(n)
    nblk, fblk = np.arange(n // QK), np.arange(f // QK)
    norm_gain = np.sqrt(n / N)
    base = _base(name)

    def want(t: GGMLQuantizationType) -> None:
        if ttype != t:
            raise WidenError(f"{name}: expected {t.name}, found {ttype.name}")

    if base in ("token_embd", "output"):  # [V, n]
        want(Q8_0)
        return _q8(data, data.shape[0], N, np.arange(data.shape[0]), nblk)
    if base in ("attn_norm", "ffn_norm", "output_norm"):
        want(F32)
        return _vec(data, N, first, norm_gain)
    if base in ("attn_q_norm", "attn_k_norm"):
        want(F32)
        return _vec(data, N, _qk_rows(d), norm_gain * (d.HD / d.hd) ** 0.25)
    if base in ("attn_q", "attn_k"):  # [n_out, n_in]
        want(Q8_0)
        return _q8(data, N, N, _qk_rows(d), nblk)
    if base == "attn_v":
        want(Q8_0)
        return _q8(data, N, N, _v_rows(d), nblk)
    if base == "attn_output":  # input: v dims, block h -> the front of wide head h
        want(Q8_0)
        return _q8(data, N, N, first, _v_rows(d)[:: QK] // QK)
    if base == "ffn_gate_inp":  # [E, n] float
        want(F32)
        out = np.zeros((data.shape[0], N), np.float32)
        out[:, :n] = data
        return out
    if base in ("ffn_gate_exps", "ffn_up_exps"):  # [E, f, n]
        want(Q8_0)
        return _q8(data, F, N, np.arange(f), nblk)
    if base == "ffn_down_exps":  # [E, n, f]
        want(Q8_0)
        return _q8(data, N, F, first, fblk)
    raise WidenError(f"{name}: no rule to widen this tensor")


def _copy_metadata(r: GGUFReader, w: GGUFWriter, arch: str, d: _Dims, name: str) -> None:
    eps_key = f"{arch}.attention.layer_norm_rms_epsilon"
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer writes these itself
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        value = field.contents()
        if key == f"{arch}.embedding_length":
            value = d.N
        elif key == f"{arch}.feed_forward_length":
            value = d.F
        elif key == eps_key:
            value = float(np.float32(value) * d.n / d.N)
        elif key == "general.name":
            value = f"{value} widened to n_embd {d.N}, ff {d.F} ({name})"
        w.add_key_value(key, value, vtype, sub)


def widen_model(src: str | os.PathLike, dst: str | os.PathLike, n_embd: int, n_ff: int, *, name: str = "",
                progress: Callable[[int, int], None] | None = None) -> Path:
    """Write ``dst``: the olmoe model ``src`` widened to ``n_embd`` x ``n_ff`` (see the module doc)."""
    src, dst = os.fspath(src), Path(dst)
    r = GGUFReader(src)
    arch = _field(r, "general.architecture")
    if arch != "olmoe":
        raise WidenError(f"{src}: general.architecture is {arch!r}; only olmoe files can be widened")
    heads = int(_field(r, f"{arch}.attention.head_count"))
    d = _Dims(int(_field(r, f"{arch}.embedding_length")), n_embd, int(_field(r, f"{arch}.feed_forward_length")),
              n_ff, heads)
    _check(src, d, int(_field(r, f"{arch}.attention.head_count_kv")))
    alignment = r.alignment
    if alignment != 32:
        raise WidenError(f"{src}: alignment {alignment}; the writer here keeps llama.cpp's default of 32")

    # Tensor shapes first (the header is written before any data), then the data tensor by tensor.
    def wide_shape(t) -> tuple[int, ...]:
        shape = [int(x) for x in reversed(t.shape.tolist())]  # numpy order
        base = _base(t.name)
        if base in ("ffn_gate_exps", "ffn_up_exps"):
            return (shape[0], d.F, d.N)
        if base == "ffn_down_exps":
            return (shape[0], d.N, d.F)
        if len(shape) == 1:
            return (d.N,)
        return (shape[0], d.N) if base in ("token_embd", "output", "ffn_gate_inp") else (d.N, d.N)

    plans = []
    for t in r.tensors:
        shape = wide_shape(t)
        qt = GGMLQuantizationType(t.tensor_type)
        if qt == Q8_0:
            byte_shape = (*shape[:-1], shape[-1] // QK * BLOCK)
            nbytes = int(np.prod(byte_shape))
            plans.append((t, byte_shape, np.dtype(np.uint8), nbytes, qt))
        elif qt == F32:
            plans.append((t, shape, np.dtype(np.float32), int(np.prod(shape)) * 4, None))
        else:
            raise WidenError(f"{src}: {t.name} is {qt.name}; only Q8_0 and F32 tensors can be widened")

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    w = GGUFWriter(tmp, arch)
    try:
        _copy_metadata(r, w, arch, d, name or dst.stem)
        for t, shape, dtype, nbytes, raw in plans:
            w.add_tensor_info(t.name, shape, dtype, nbytes, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        out = w.fout[0]
        w.write_padding(out, out.tell())
        total = sum(p[3] for p in plans)
        done = 0
        for t, shape, dtype, nbytes, raw in plans:
            arr = np.ascontiguousarray(_widened(t.name, GGMLQuantizationType(t.tensor_type), np.asarray(t.data), d))
            if arr.nbytes != nbytes or arr.dtype != dtype:
                raise WidenError(f"{t.name}: widened to {arr.nbytes} bytes of {arr.dtype}, planned {nbytes} of {dtype}")
            out.write(memoryview(arr).cast("B"))
            w.write_padding(out, nbytes)
            done += nbytes
            if progress is not None:
                progress(done, total)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    w.close()
    os.replace(tmp, dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", choices=sorted(WIDE_PRESETS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--source", type=Path, default=default_source())
    a = ap.parse_args(argv)
    spec = WIDE_PRESETS[a.preset]
    widen_model(a.source, a.out, spec.n_embd, spec.n_ff, name=spec.name)
    print(f"{a.out}: {a.out.stat().st_size} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
