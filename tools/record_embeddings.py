#!/usr/bin/env python3
"""Record llama.cpp's embeddings (its pooled final hidden states, as llama-server's /v1/embeddings returns
them) as the reference Model.embed and the server's /v1/embeddings are tested against.

    python tools/record_embeddings.py MODEL.gguf [--out tests/golden/NAME-embeddings.npz]

llama-cpp-python runs the model with embeddings on (2 threads, n_ctx 512, an F32 KV cache), once per
pooling, over a fixed set of texts; llama.cpp tokenizes each text itself (its BOS rule, no special
parsing), and those ids are stored, so the test feeds Clutor exactly what llama.cpp read. Written:
  texts                 [N] str
  ids, offsets          text i's ids are ids[offsets[i]:offsets[i+1]] (int32)
  mean, last            [N, n_embd] f32: the pooled vectors, not normalised
  llama_cpp_version     0-d str
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

TEXTS = [
    "The expert cache keeps the experts a model reads most.",
    "Streams experts from disk while the next layer computes.",
    "The miller watched the river in 1961.",
    "A list of numbers: 3, 1, 4, 1, 5, 9, 2, 6.",
    "Once upon a time there was a small village by the sea, and every morning the fishermen went out.",
    "x",
]


def record(path: Path) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    out: dict = {}
    for name, pooling in (("mean", llama_cpp.LLAMA_POOLING_TYPE_MEAN), ("last", llama_cpp.LLAMA_POOLING_TYPE_LAST)):
        llm = Llama(str(path), embedding=True, pooling_type=pooling, n_ctx=512, n_batch=512, n_threads=2,
                    type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
        ids = [llm.tokenize(t.encode("utf-8")) for t in TEXTS]
        vecs = [np.asarray(llm.embed(t, normalize=False), dtype=np.float32) for t in TEXTS]
        out.setdefault("ids", ids)
        assert out["ids"] == ids, "llama.cpp tokenized the texts differently between its two runs"
        out[name] = np.stack(vecs)
        del llm
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import llama_cpp

    out = args.out or ROOT / "tests" / "golden" / f"{args.model.stem}-embeddings.npz"
    r = record(args.model)
    flat = np.concatenate([np.asarray(i, dtype=np.int32) for i in r["ids"]])
    offsets = np.cumsum([0] + [len(i) for i in r["ids"]]).astype(np.int32)
    np.savez_compressed(out, texts=np.array(TEXTS), ids=flat, offsets=offsets, mean=r["mean"], last=r["last"],
                        llama_cpp_version=np.array(llama_cpp.__version__))
    print(f"{out}: {len(TEXTS)} texts, n_embd {r['mean'].shape[1]}, {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
