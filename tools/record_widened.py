#!/usr/bin/env python3
"""Record llama.cpp's logits on the trained small model and on its widened form (tools/widen.py), so a
test can hold Clutor's small model against llama.cpp's widened one without llama.cpp at test time.

    python tools/make_model.py real-olmoe-wide /var/tmp/real-olmoe-wide.gguf
    python tools/record_widened.py /var/tmp/real-olmoe-wide.gguf [--out tests/golden/real-olmoe-wide.npz]

Writes
  prompt_ids     [T] int32    the first T tokens of the bundled corpus (clutor/data/corpus.txt), as tokenized by
                              llama.cpp (no BOS: the file does not add one)
  logits         [T, V] f32   llama.cpp's logits at every position of the WIDENED model
  small_max_diff 0-d f32      max |widened - small| over those logits, both by llama.cpp (printed too)
  wide_name      0-d str      general.name of the widened file
llama.cpp runs with 2 threads and an F32 KV cache (as tools/record_reference.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from widen import default_source  # noqa: E402

N_TOKENS = 8
GGML_TYPE_F32 = 0


def llama_logits(path: Path, ids: list[int] | None, text: str) -> tuple[list[int], np.ndarray]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=2, logits_all=True, seed=0,
                          type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=False)
    try:
        if ids is None:
            ids = llm.tokenize(text.encode(), add_bos=False, special=False)[:N_TOKENS]
        llm.reset()
        llm.eval(ids)
        V = llm.n_vocab()
        out = np.array(llm.scores[: len(ids), :V], dtype=np.float32)  # [T, V]
    finally:
        llm.close()
    return ids, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wide", type=Path, help="the widened model (tools/make_model.py real-olmoe-wide)")
    ap.add_argument("--small", type=Path, default=default_source())
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden" / "real-olmoe-wide.npz")
    a = ap.parse_args(argv)
    from gguf import GGUFReader

    text = (ROOT / "clutor" / "data" / "corpus.txt").read_text(encoding="utf-8")[:2000]
    ids, small = llama_logits(a.small, None, text)
    _, wide = llama_logits(a.wide, ids, text)
    diff = float(np.abs(wide - small).max())
    name = GGUFReader(str(a.wide)).fields["general.name"].contents()
    np.savez_compressed(a.out, prompt_ids=np.array(ids, np.int32), logits=wide, small_max_diff=np.float32(diff),
                        wide_name=np.array(name))
    print(f"{a.out}: {len(ids)} positions; llama.cpp widened vs small: max |diff| {diff:.4g} "
          f"(max |logit| {np.abs(small).max():.3g}), argmax agrees at "
          f"{np.mean(wide.argmax(-1) == small.argmax(-1)):.0%} of positions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
