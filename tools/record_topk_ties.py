#!/usr/bin/env python3
"""Record which keys a top-k with ties keeps, as llama.cpp's CPU keeps them: ggml_top_k runs
std::partial_sort over the indices 0 .. n-1 with "score greater" (ggml-cpu/ops.cpp, cmp_top_k), so
among equal scores the C++ standard library decides. This compiles a few lines that make the same
call with the system's C++ compiler (GCC's libstdc++, which llama-cpp-python's wheel links) and runs
them on score rows full of ties; tests/test_glm_dsa.py holds Clutor's DSA selection
(clutor.model.kernels.dsa) to the recorded choices.

    python tools/record_topk_ties.py [--out tests/golden/topk_ties.npz]
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

SOURCE = r"""
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>
// reads: rows; then per row n k and n floats; writes per row the k indices partial_sort leaves first
struct cmp_top_k { const float * data; bool operator()(int32_t a, int32_t b) const { return data[a] > data[b]; } };
int main() {
    int rows; if (std::scanf("%d", &rows) != 1) return 1;
    for (int r = 0; r < rows; r++) {
        int n, k; if (std::scanf("%d %d", &n, &k) != 2) return 1;
        std::vector<float> s(n); std::vector<int32_t> idx(n);
        for (int j = 0; j < n; j++) { if (std::scanf("%f", &s[j]) != 1) return 1; idx[j] = j; }
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), cmp_top_k{s.data()});
        for (int j = 0; j < k; j++) std::printf("%d ", idx[j]);
        std::printf("\n");
    }
    return 0;
}
"""


def rows(seed: int = 0) -> list[tuple[np.ndarray, int]]:
    """Score rows with heavy ties: values from a handful of levels (many exact zeros, as ReLU'd
    indexer scores have), lengths 2 .. 300, k from 1 to n."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(400):
        n = int(rng.integers(2, 300))
        k = int(rng.integers(1, n + 1))
        levels = rng.choice([0.0, 0.0, 0.0, 1.0, -1.0, 0.5, 2.0, -np.inf], size=int(rng.integers(1, 6)))
        s = rng.choice(levels, size=n).astype(np.float32)
        if rng.random() < 0.3:  # some distinct values among the ties
            m = rng.random(n) < 0.3
            s[m] = rng.standard_normal(int(m.sum())).astype(np.float32)
        out.append((s, k))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden" / "topk_ties.npz")
    args = ap.parse_args(argv)
    data = rows()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "topk.cpp", Path(tmp) / "topk"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O2", "-o", str(exe), str(src)], check=True)
        text = f"{len(data)}\n" + "".join(f"{len(s)} {k} " + " ".join("-inf" if np.isneginf(v) else repr(float(v)) for v in s)
                                           + "\n" for s, k in data)
        res = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.splitlines()
        version = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    chosen = [np.array(sorted(int(x) for x in line.split()), np.int64) for line in res]
    lens = np.array([len(s) for s, _ in data], np.int64)
    np.savez_compressed(args.out, scores=np.concatenate([s for s, _ in data]), lens=lens,
                        ks=np.array([k for _, k in data], np.int64), chosen=np.concatenate(chosen),
                        compiler=np.array(version))
    print(f"{args.out}: {len(data)} rows, {int(lens.sum())} scores ({version})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
