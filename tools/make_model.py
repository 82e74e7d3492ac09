#!/usr/bin/env python3
"""Write a random-weight MoE GGUF (see tools/synth.py), or the trained real-routing model widened to real
expert sizes (see tools/widen.py).

    python tools/make_model.py PRESET OUT.gguf [--seed 0] [--type F16|Q8_0|Q4_K|...]
    python tools/make_model.py PRESET OUT.gguf --quantize Q4_K_M|Q6_K|Q8_0|F16 --llama-quantizer
    python tools/make_model.py real-olmoe-wide OUT.gguf [--source ../shared/data/models/real-olmoe-q8_0.gguf]

--type writes the file directly (random Q8_0 / Q4_K blocks for quantised types). --quantize
writes an F32 master next to OUT and converts it with llama.cpp's own quantiser
(llama-cpp-python's llama_model_quantize), so the per-tensor type mix is exactly llama.cpp's.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from synth import PRESETS, write_model  # noqa: E402
from widen import WIDE_PRESETS, default_source, widen_model  # noqa: E402

# llama.cpp's llama_ftype values for the mixes we make.
LLAMA_FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q5_0": 8, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18,
                "MXFP4_MOE": 38, "Q2_K": 10, "Q3_K_M": 12, "IQ4_XS": 30}


def llama_quantize(master: Path, out: Path, ftype: str, nthread: int = 2) -> None:
    """Convert ``master`` (an F32 GGUF) to ``out`` with llama.cpp's quantiser."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[ftype]
    params.nthread = nthread
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
    ap.add_argument("--keep-master", action="store_true", help="keep the F32 master as OUT.f32.gguf")
    ap.add_argument("--source", type=Path, default=None,
                    help=f"real-olmoe-* presets: the trained model to widen (default {default_source()})")
    args = ap.parse_args(argv)
    if args.preset in WIDE_PRESETS:
        if args.qtype or args.quantize:
            ap.error(f"{args.preset} keeps the trained file's Q8_0 blocks: --type and --quantize do not apply")
    elif args.source is not None:
        ap.error("--source applies to the real-olmoe-* presets only")
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
    elif args.quantize:
        master = args.out.with_suffix(".f32.gguf")
        write_model(master, args.preset, seed=args.seed, qtype="F32", progress=progress)
        print(file=sys.stderr)
        try:
            llama_quantize(master, args.out, args.quantize)
        finally:
            if not args.keep_master:
                master.unlink(missing_ok=True)
    else:
        write_model(args.out, args.preset, seed=args.seed, qtype=args.qtype, progress=progress)
        print(file=sys.stderr)
    size = args.out.stat().st_size
    print(f"{args.out}: {size} bytes ({size / 2**30:.2f} GiB) in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
