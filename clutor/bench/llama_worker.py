"""The same benchmark run through llama.cpp (llama-cpp-python), for comparison with Clutor.

    python -m clutor.bench.llama_worker MODEL --json-args '{"prompt_tokens": 64, "tokens": 32}'

Same prompt ids as ``clutor.bench.worker`` (built by Clutor's tokenizer from the same file), same
warm-up, the same decoding measured the same way: prefill = one ``eval`` of the prompt; decode = a
token from the prefill's logits, then ``tokens - 1`` steps of ``eval([token])`` + the next token, so
decode tok/s counts ``tokens - 1`` forward passes like Clutor's GenerationStats.decode_tps. Tokens are
the argmax (workload "ids") or drawn by Clutor's own sampler with the same options and seed as Clutor's
first stream (workload "text"): on equal logits both engines then generate the same tokens. With
``forced`` (a list of ``tokens`` ids, the tokens Clutor generated), every step evaluates the given
token instead of one of its own (forced decoding): both engines then run the same forward passes over
the same positions and, on a model whose experts stream, the same routing, which a sampled stream of
llama.cpp's own need not follow (on wide.gguf one fell into runs of whitespace and read a tenth of the
bytes). ``agree`` then counts the steps whose forced token is also llama.cpp's argmax.
llama.cpp reads the model through mmap (its default), so capped runs show its page-cache behaviour.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from ..errors import ClutorError
from .process import peak_memory, storage_read_bytes
from .prompt import WARMUP_PROMPT_TOKENS, prompt_digest, sampling_options, workload_prompts
from .protocol import COMMON_OPTIONS, worker_main, worker_options

__all__ = ["DEFAULTS", "run", "without_extra_buffers"]

DEFAULTS: dict = {
    **COMMON_OPTIONS,
    "n_threads": None,  # None: os.cpu_count()
    "n_batch": 512,  # n_batch and n_ubatch (llama-cpp-python's defaults: 512 both)
    # llama.cpp's CPU "extra buffers": repacked copies of Q4_K etc. in anonymous memory, its default on
    # AVX2. Off, the weights stay file pages of the mmap, the only way it runs in a cap below the file.
    "extra_buffers": True,
    # Clutor's generated ids to decode instead of choosing (forced decoding); None: choose (greedy or
    # sampled as the workload says).
    "forced": None,
    "forced_prompt_digest": None,  # the prompt the forced ids followed (prompt_digest): must be this run's
}


def _import_llama():
    try:
        import llama_cpp
    except ImportError as e:
        raise ClutorError(
            f"llama-cpp-python is not importable ({e}); install it with `pip install llama-cpp-python` "
            "(or `pip install clutor[bench]`) to compare against llama.cpp") from None
    return llama_cpp


def without_extra_buffers(llama_cpp) -> None:
    """Make the model parameters llama-cpp-python starts from say use_extra_bufts = false (its Llama
    class takes no argument for it; this worker process loads one model and exits)."""
    module = llama_cpp.llama_cpp
    default = module.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    module.llama_model_default_params = params


def _last_logits(llm, llama_cpp, n_vocab: int) -> np.ndarray:
    """Logits of the last evaluated token, float32 [V].

    Since llama-cpp-python 0.3 ``eval`` no longer copies logits into ``scores`` unless
    logits_all=True, so read llama.cpp's output buffer directly."""
    ctx = getattr(llm, "_ctx", None)
    if ctx is not None and hasattr(ctx, "get_logits_ith"):
        ptr = ctx.get_logits_ith(-1)
    else:
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    if not ptr:
        raise ClutorError("llama.cpp returned no logits for the last token")
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,))  # [V], a view of llama.cpp's buffer


def _greedy(llm, llama_cpp, n_vocab: int) -> int:
    return int(np.argmax(_last_logits(llm, llama_cpp, n_vocab)))


def _chooser(workload: str, seed: int, prompt: list[int]):
    """next(llm, llama_cpp, n_vocab) -> token: greedy, or Clutor's sampler as Clutor's stream 0 uses it."""
    opts = sampling_options(workload, seed)
    if opts["temperature"] == 0:
        return _greedy
    from ..model.sampling import Sampler, SamplingParams

    sampler = Sampler(SamplingParams(**opts))
    history = list(prompt)

    def pick(llm, llama_cpp, n_vocab: int) -> int:
        token = sampler.sample(np.array(_last_logits(llm, llama_cpp, n_vocab), dtype=np.float32), history)
        history.append(token)
        return token

    return pick


def _forcer(forced: list[int]):
    """next(llm, llama_cpp, n_vocab) -> the next of the forced tokens; counts in .agree the steps whose
    forced token is also llama.cpp's own argmax (how close its logits lead to the same stream)."""
    it = iter(forced)

    def pick(llm, llama_cpp, n_vocab: int) -> int:
        token = next(it)
        pick.agree += int(_greedy(llm, llama_cpp, n_vocab) == token)
        return token

    pick.agree = 0
    return pick


def run(path: str, options: dict) -> dict:
    opts = worker_options(DEFAULTS, options)
    P, N, n_ctx = int(opts["prompt_tokens"]), int(opts["tokens"]), int(opts["n_ctx"])
    threads = opts["n_threads"] or os.cpu_count() or 1
    if not os.path.isfile(path):
        raise ClutorError(f"{path}: no such model file")

    from ..model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    ids, warm = workload_prompts(tok, opts["workload"], 2, P, opts["seed"])  # the same as Clutor's worker
    forced = opts["forced"]
    if forced is not None:
        if not isinstance(forced, list) or len(forced) != N or not all(isinstance(t, int) for t in forced):
            raise ClutorError(f"forced: expected a list of {N} token ids (the run's tokens), got "
                              f"{type(forced).__name__} of {len(forced) if isinstance(forced, list) else '?'}")
        bad = [t for t in forced if not 0 <= t < tok.n_vocab]
        if bad:
            raise ClutorError(f"forced: token id {bad[0]} is not in the vocabulary (0..{tok.n_vocab - 1})")
        want = opts["forced_prompt_digest"]
        if want is not None and want != prompt_digest(ids):
            raise ClutorError(f"forced: the ids followed another prompt (digest {want}) than this run's "
                              f"({prompt_digest(ids)}): the same workload, prompt length and seed are needed")
        choose = _forcer(forced)
    else:
        choose = _chooser(opts["workload"], opts["seed"], ids)
    llama_cpp = _import_llama()
    if not opts["extra_buffers"]:
        without_extra_buffers(llama_cpp)
    t0 = time.perf_counter()
    try:
        llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                              n_batch=int(opts["n_batch"]), n_ubatch=int(opts["n_batch"]), logits_all=False, use_mmap=True, verbose=False)
    except (ValueError, RuntimeError) as e:
        raise ClutorError(f"{path}: llama.cpp could not load the model: {e}") from None
    t_open = time.perf_counter() - t0
    try:
        n_vocab = int(llm.n_vocab())
        if n_vocab != tok.n_vocab:
            raise ClutorError(f"{path}: llama.cpp sees {n_vocab} tokens, Clutor's tokenizer {tok.n_vocab}")
        t_warm = 0.0
        if opts["warmup"]:
            t1 = time.perf_counter()
            llm.reset()
            llm.eval(warm[:WARMUP_PROMPT_TOKENS])
            _greedy(llm, llama_cpp, n_vocab)
            t_warm = time.perf_counter() - t1
        llm.reset()

        read0 = storage_read_bytes()
        t2 = time.perf_counter()
        llm.eval(ids)
        t_prefill = time.perf_counter() - t2
        read1 = storage_read_bytes()

        steps: list[float] = []  # seconds of each decode forward pass (+ its argmax)
        t3 = time.perf_counter()
        tokens = [choose(llm, llama_cpp, n_vocab)]
        while len(tokens) < N:
            ts = time.perf_counter()
            llm.eval([tokens[-1]])
            tokens.append(choose(llm, llama_cpp, n_vocab))
            steps.append(time.perf_counter() - ts)
        t_decode = time.perf_counter() - t3
        read2 = storage_read_bytes()
    finally:
        close = getattr(llm, "close", None)  # frees llama.cpp's buffers now, not at interpreter exit
        if close is not None:
            close()
    t_total = time.perf_counter() - t0

    decode_steps = N - 1
    reads = None if None in (read0, read1, read2) else {"prefill": read1 - read0, "decode": read2 - read1}
    return {
        "engine": "llama.cpp",
        "llama_cpp_version": getattr(llama_cpp, "__version__", "?"),
        "model": path,
        "options": {**opts, "n_ctx": n_ctx, "n_threads": threads},
        "n_ctx": n_ctx,
        "prompt_digest": prompt_digest(ids),
        "stats": {
            "prompt_tokens": len(ids),
            "generated_tokens": len(tokens),
            "prefill_seconds": t_prefill,
            "decode_seconds": t_decode,
            "prefill_tps": len(ids) / t_prefill if t_prefill > 0 else 0.0,
            "decode_tps": decode_steps / t_decode if t_decode > 0 and decode_steps > 0 else 0.0,
            "decode_step_median_seconds": float(np.median(steps)) if steps else None,
            "stop_reason": "length",
        },
        "io": None,
        "tokens": tokens,
        "forced": forced is not None,
        "forced_argmax_agree": choose.agree if forced is not None else None,
        "peak_rss": peak_memory()["ru_maxrss"],
        "memory": peak_memory(),
        "storage_read_bytes": None if reads is None else reads["prefill"] + reads["decode"],
        "storage_read_bytes_by_phase": reads,
        "seconds": {"open": t_open, "warmup": t_warm, "generate": t_prefill + t_decode, "total": t_total},
        "threads": threads,
    }


if __name__ == "__main__":
    sys.exit(worker_main("python -m clutor.bench.llama_worker", run))
