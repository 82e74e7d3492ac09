#!/usr/bin/env python3
"""Write a random-weight MoE GGUF (see tools/synth.py), or the trained real-routing model widened to real
expert sizes (see tools/widen.py).

    python tools/make_model.py PRESET OUT.gguf [--seed 0] [--type F16|Q8_0|Q4_K|...]
    python tools/make_model.py PRESET OUT.gguf --quantize Q4_K_M|Q6_K|Q8_0|F16 --llama-quantizer
    python tools/make_model.py olmoe-1b-7b-q8 OUT.gguf --layers 4 --master F16 --quantize IQ2_XXS --llama-quantizer
    python tools/make_model.py real-olmoe-wide OUT.gguf [--source ../shared/data/models/real-olmoe-q8_0.gguf]

--type writes the file directly (random Q8_0 / Q4_K blocks for quantised types). --quantize
writes an F32 (or --master F16) master next to OUT and converts it with llama.cpp's own quantiser
(llama-cpp-python's llama_model_quantize), so the per-tensor type mix is exactly llama.cpp's.
llama.cpp refuses the IQ1_* / IQ2_* / IQ3_XXS file types without an importance matrix; those get a
uniform one (every weight 1 for every matrix), which llama.cpp then also uses for its type choices
(as it would with a real one). --layers N keeps the preset's shapes with N layers.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from synth import PRESETS, write_model  # noqa: E402
from widen import WIDE_PRESETS, default_source, widen_model  # noqa: E402

# llama.cpp's llama_ftype values for the mixes we make.
LLAMA_FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q5_0": 8, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18,
                "MXFP4_MOE": 38, "Q2_K": 10, "Q3_K_M": 12, "IQ4_XS": 30,
                "IQ2_XXS": 19, "IQ2_XS": 20, "IQ3_XXS": 23, "IQ1_S": 24, "IQ3_S": 26, "IQ3_M": 27,
                "IQ2_S": 28, "IQ2_M": 29, "IQ1_M": 31}
# file types whose tensors llama.cpp quantises only with an importance matrix (llama-quant.cpp)
NEEDS_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ1_S", "IQ1_M"}


def uniform_imatrix(master: Path) -> dict[str, np.ndarray]:
    """Tensor name -> an importance of 1 for each column of each expert (llama.cpp's layout: ne[0] *
    ne[2] floats), for every matrix of the master."""
    from gguf import GGUFReader

    out = {}
    for t in GGUFReader(master).tensors:
        ne = [int(v) for v in t.shape]  # ggml order: ne[0] = row length
        if len(ne) >= 2:
            out[t.name] = np.ones(ne[0] * (ne[2] if len(ne) > 2 else 1), np.float32)
    return out


def llama_quantize(master: Path, out: Path, ftype: str, nthread: int = 2,
                   imatrix: dict[str, np.ndarray] | None = None) -> None:
    """Convert ``master`` (an F32/F16 GGUF) to ``out`` with llama.cpp's quantiser (with ``imatrix``:
    tensor name -> float32 importances, e.g. uniform_imatrix(master))."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[ftype]
    params.nthread = nthread
    if imatrix:
        keep = [(name.encode(), np.ascontiguousarray(v, np.float32)) for name, v in imatrix.items()]
        entries = (llama_cpp.llama_model_imatrix_data * (len(keep) + 1))()
        for e, (name, v) in zip(entries, keep):
            e.name, e.data, e.size = name, v.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), v.size
        entries[len(keep)].name = None  # the list ends at a null name
        params.imatrix = entries
    rc = llama_cpp.llama_model_quantize(str(master).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({master} -> {out}, {ftype}) failed with code {rc}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", choices=sorted(PRESETS) + sorted(WIDE_PRESETS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--type", dest="qtype", default=None, help="type of every weight matrix (default: the preset's)")
    ap.add_argument("--quantize", choices=sorted(LLAMA_FTYPES), help="llama.cpp ftype to convert an F32 master to")
    ap.add_argument("--llama-quantizer", action="store_true",
                    help="with --quantize: use llama.cpp's quantiser (the only one; the flag makes the intent explicit)")
    ap.add_argument("--keep-master", action="store_true", help="keep the master as OUT.f32.gguf / OUT.f16.gguf")
    ap.add_argument("--master", choices=("F32", "F16"), default="F32", help="type of the master --quantize converts")
    ap.add_argument("--layers", type=int, default=None, help="the preset with this many layers")
    ap.add_argument("--ctx", type=int, default=None, help="the preset with this context_length (long-prompt benchmarks)")
    ap.add_argument("--source", type=Path, default=None,
                    help=f"real-olmoe-* presets: the trained model to widen (default {default_source()})")
    args = ap.parse_args(argv)
    if args.preset in WIDE_PRESETS:
        if args.qtype or args.quantize:
            ap.error(f"{args.preset} keeps the trained file's Q8_0 blocks: --type and --quantize do not apply")
    elif args.source is not None:
        ap.error("--source applies to the real-olmoe-* presets only")
    if args.preset in WIDE_PRESETS and args.ctx is not None:
        ap.error("--ctx applies to the random-weight presets (a widened model keeps its trained context)")
    if args.quantize and args.qtype:
        ap.error("--type and --quantize are exclusive (--quantize always starts from an F32 master)")
    if args.llama_quantizer and not args.quantize:
        ap.error("--llama-quantizer needs --quantize FTYPE")

    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] > 2 or done == total:
            last[0] = now
            print(f"\r{done / 2**20:9.1f} / {total / 2**20:.1f} MiB", end="", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    if args.preset in WIDE_PRESETS:
        spec = WIDE_PRESETS[args.preset]
        source = args.source or default_source()
        if not source.is_file():
            raise SystemExit(f"{source}: the trained model to widen is not there (see ../shared/data/models)")
        widen_model(source, args.out, spec.n_embd, spec.n_ff, name=spec.name, progress=progress)
        print(file=sys.stderr)
    else:
        preset = PRESETS[args.preset]
        if args.layers is not None:
            preset = dataclasses.replace(preset, n_layer=args.layers, name=f"{preset.name}-{args.layers}l")
        if args.ctx is not None:
            preset = dataclasses.replace(preset, n_ctx=args.ctx)
        if args.quantize:
            master = args.out.with_suffix(f".{args.master.lower()}.gguf")
            write_model(master, preset, seed=args.seed, qtype=args.master, progress=progress)
            print(file=sys.stderr)
            try:
                llama_quantize(master, args.out, args.quantize,
                               imatrix=uniform_imatrix(master) if args.quantize in NEEDS_IMATRIX else None)
            finally:
                if not args.keep_master:
                    master.unlink(missing_ok=True)
        else:
            write_model(args.out, preset, seed=args.seed, qtype=args.qtype, progress=progress)
            print(file=sys.stderr)
    size = args.out.stat().st_size
    print(f"{args.out}: {size} bytes ({size / 2**30:.2f} GiB) in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
