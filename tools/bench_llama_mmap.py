#!/usr/bin/env python3
"""llama.cpp (llama-cpp-python) on a GGUF, weights mmapped, prompt then greedy decode; prints tok/s.

    python tools/bench_llama_mmap.py MODEL.gguf N_PROMPT N_GEN repack|norepack

norepack turns off llama.cpp's CPU "extra buffers" (repacked copies of Q4_K etc. in anonymous memory,
its default on AVX2): then the weights stay file pages of the mmap, which is what lets it run at all in a
memory cap smaller than the file (with repack it is OOM-killed there). Run it inside a cap with
clutor.bench.memcap.run_capped (docs/benchmarks.md shows how). The prompt is N_PROMPT seeded ids, as
`clutor bench` uses for both engines."""
import sys, time
import numpy as np
import llama_cpp
path, n_prompt, n_gen, repack = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "repack"
if not repack:
    from clutor.bench.llama_worker import without_extra_buffers
    without_extra_buffers(llama_cpp)
llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=2, n_threads_batch=2, n_batch=512, use_mmap=True, verbose=False)
V = llm.n_vocab()
ids = np.random.default_rng(0).integers(0, min(V, 700), n_prompt).tolist()
llm.eval(ids[:1]); llm.reset()  # warm-up
t0 = time.perf_counter(); llm.eval(ids); t1 = time.perf_counter()
tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
t2 = time.perf_counter()
for _ in range(n_gen - 1):
    llm.eval([tok]); tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
t3 = time.perf_counter()
print(f"prefill {n_prompt / (t1 - t0):.2f} tok/s decode {(n_gen - 1) / (t3 - t2):.3f} tok/s")
