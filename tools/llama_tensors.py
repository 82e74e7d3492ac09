#!/usr/bin/env python3
"""llama.cpp's own intermediate results, for a per-tensor comparison with Clutor's forward pass.

    python tools/llama_tensors.py MODEL.gguf [--ids 1,2,3 | --golden tests/golden/X.npz] [--list]
    python tools/llama_tensors.py MODEL.gguf --golden G.npz --compare [--activations q8|f32]
    python tools/llama_tensors.py MODEL.gguf --ids 1,2,3 --save OUT.npz --names attn_norm-0,Qcur-0

Runs one batched evaluation of the ids in llama-cpp-python (2 threads, F32 KV cache, the settings of
tools/record_reference.py) with the scheduler's eval callback, and keeps every float32 tensor the
graph computes, by its graph name ("attn_norm-0", "ffn_moe_topk-1", "result_output", ...), as a
numpy array in numpy order (ggml's ne reversed). ``--list`` prints each name, shape and op.

``--compare`` also runs Clutor on the same ids and prints, per layer, where the two first part: the
residual entering each layer, the attention's output, the FFN input, the router's choices and
weights, the experts' sum, and the logits (each as max and mean |diff| against llama.cpp's).
Clutor's intermediates are taken by wrapping its architecture's step methods (clutor.model.arch);
nothing in the package is changed.

``NoisyLlama`` (used by tools/record_reference.py) gives llama.cpp's logits and greedy tokens with
last-bit noise written into every attention output: how much a prompt's results depend on rounding.

Needs llama-cpp-python (tools only, like tools/record_reference.py; tests never run it).
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

GGML_MAX_DIMS, GGML_MAX_OP_PARAMS, GGML_MAX_SRC, GGML_MAX_NAME = 4, 64, 10, 64
GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26


class _Tensor(ctypes.Structure):
    """ggml.h's struct ggml_tensor (the fields read here and everything before them)."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def _read(t: _Tensor) -> np.ndarray | None:
    """The tensor's elements (F32 or I32, any strides) as a numpy array [ne3, ne2, ne1, ne0]."""
    if t.type not in (GGML_TYPE_F32, GGML_TYPE_I32) or not t.data:
        return None
    dtype = np.float32 if t.type == GGML_TYPE_F32 else np.int32
    ne = [int(t.ne[i]) for i in range(GGML_MAX_DIMS)]
    nb = [int(t.nb[i]) for i in range(GGML_MAX_DIMS)]
    span = sum((n - 1) * s for n, s in zip(ne, nb)) + 4
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(t.data))
    view = np.lib.stride_tricks.as_strided(raw.view(dtype) if span % 4 == 0 else raw[: span - span % 4].view(dtype),
                                           shape=ne[::-1], strides=nb[::-1])
    return np.array(view, copy=True)


def _no_log(level, text, user):
    pass


_quiet = None


def _load(path: str | Path):
    """(llama_cpp, the loaded model), llama.cpp's log silenced."""
    import llama_cpp as L

    global _quiet
    if _quiet is None:
        _quiet = L.llama_log_callback(_no_log)
    L.llama_log_set(_quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"{path}: llama.cpp could not load it")
    return L, model


def _context(L, model, n_ctx: int, n_batch: int, n_threads: int, cb):
    """A context as tools/record_reference.py's: F32 KV cache, flash attention off, the eval callback cb."""
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
    cp.n_threads = cp.n_threads_batch = n_threads
    cp.type_k = cp.type_v = GGML_TYPE_F32
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as llama_cpp.Llama(flash_attn=False)
    cp.cb_eval = cb
    cp.cb_eval_user_data = None
    return L.llama_init_from_model(model, cp)


def _decode(L, ctx, batch, ids: list[int], pos: int, all_logits: bool, path) -> None:
    """ids at positions pos, pos + 1, ... of sequence 0; logits for every row, or the last."""
    batch.n_tokens = len(ids)
    for i, tok in enumerate(ids):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos + i, 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = all_logits or i == len(ids) - 1
    if L.llama_decode(ctx, batch) != 0:
        raise SystemExit(f"{path}: llama_decode failed")


def capture(path: str | Path, ids: list[int], n_threads: int = 2, n_ctx: int = 512) -> tuple[dict, dict]:
    """Evaluate ids as one batch (every position an output) -> ({name: array}, {name: op id})."""
    import llama_cpp

    got: dict[str, np.ndarray] = {}
    ops: dict[str, int] = {}

    @llama_cpp.ggml_backend_sched_eval_callback
    def cb(tp, ask, _user):
        t = _Tensor.from_address(tp)
        if ask:
            return True  # every tensor: the scheduler then hands them over one by one
        name = t.name.decode(errors="replace")
        arr = _read(t)
        if arr is not None:
            got[name] = arr
            ops[name] = int(t.op)
        return True

    L, model = _load(path)
    ctx = _context(L, model, n_ctx, max(n_ctx, len(ids)), n_threads, cb)
    batch = L.llama_batch_init(len(ids), 0, 1)
    try:
        _decode(L, ctx, batch, ids, 0, True, path)
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return got, ops


# ------------------------------------------------------------------------------------------------
# llama.cpp with rounding noise in its attention: how well-conditioned a fixture's prompt is

NOISE = 1.2e-7  # relative, about one float32 ulp: what a different summation order changes


class NoisyLlama:
    """llama.cpp's logits and greedy tokens, optionally with every attention layer's softmax-weighted sum
    (the graph's contiguous F32 "kqv-N") multiplied by 1 + NOISE * N(0, 1) before the next op reads it.

    Two correct implementations differ by such last-bit noise (summation order), so a prompt whose
    logits move by more than a test's tolerance under it cannot tell a right forward pass from a
    wrong one: tools/record_reference.py screens its prompts with this. Settings as ``capture``."""

    def __init__(self, path: str | Path, n_threads: int = 2, n_ctx: int = 512):
        L, self._model = _load(path)
        self._L, self.path, self.n_threads, self.n_ctx = L, path, n_threads, n_ctx
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self._model))
        self._rng: np.random.Generator | None = None
        self.noised = 0  # tensors the noise was written into, over every run so far
        self._cb = L.ggml_backend_sched_eval_callback(self._eval)

    def _eval(self, tp, ask, _user) -> bool:
        t = _Tensor.from_address(tp)
        name = t.name.decode(errors="replace")
        ne = [int(t.ne[i]) for i in range(GGML_MAX_DIMS)]
        nb = [int(t.nb[i]) for i in range(GGML_MAX_DIMS)]
        contiguous = nb == [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]]
        wanted = (self._rng is not None and t.type == GGML_TYPE_F32 and not t.view_src and contiguous
                  and name.startswith("kqv-") and name[4:].isdigit())
        if ask or not wanted:
            return bool(wanted) if ask else True
        n = ne[0] * ne[1] * ne[2] * ne[3]
        a = np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctypes.c_float)), shape=(n,))
        a *= (1.0 + NOISE * self._rng.standard_normal(n)).astype(np.float32)
        self.noised += 1
        return True

    def _new_context(self, seed: int | None):
        self._rng = None if seed is None else np.random.default_rng(seed)
        return _context(self._L, self._model, self.n_ctx, self.n_ctx, self.n_threads, self._cb)

    def logits(self, ids: list[int], seed: int | None = None) -> np.ndarray:
        """[T, V] logits of ids evaluated as one batch; seed None: no noise."""
        L = self._L
        ctx, batch = self._new_context(seed), L.llama_batch_init(len(ids), 0, 1)
        try:
            _decode(L, ctx, batch, ids, 0, True, self.path)
            return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(ids), self.n_vocab)).copy()
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)

    def greedy(self, ids: list[int], n: int, seed: int | None = None) -> list[int]:
        """n argmax tokens after ids, each evaluated in turn (llama.cpp's top_k 1 sampler's choice)."""
        L = self._L
        ctx, batch = self._new_context(seed), L.llama_batch_init(max(len(ids), 1), 0, 1)
        try:
            out: list[int] = []
            feed, pos = list(ids), 0
            while len(out) < n:
                _decode(L, ctx, batch, feed, pos, False, self.path)
                pos += len(feed)
                row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,))
                feed = [int(row.argmax())]
                out.append(feed[0])
            return out
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)

    def close(self) -> None:
        if self._model:
            self._L.llama_model_free(self._model)
            self._model = None


# ------------------------------------------------------------------------------------------------
# Clutor's side: its intermediates by wrapping the architecture's step methods

def clutor_intermediates(path: str | Path, ids: list[int], activations: str) -> dict[str, np.ndarray]:
    """Clutor's residual stream and FFN pieces per layer, under llama.cpp's names where one exists."""
    import asyncio

    sys.path.insert(0, str(ROOT))
    import clutor
    from clutor.model import model as model_mod

    out: dict[str, np.ndarray] = {}

    async def go():
        async with clutor.Model.open(path, activations=activations) as m:
            arch = m.arch
            orig_attn, orig_in, orig_route, orig_extra = arch.attention, arch.ffn_input, arch.route, arch.ffn_extra
            layer = {"l": 0}

            def attention(lw, l, x, step, rope):
                layer["l"] = l
                out[f"inp-{l}"] = np.array(x)
                y = orig_attn(lw, l, x, step, rope)
                out[f"attn_out-{l}"] = np.array(y)
                return y

            orig_qkv = arch.qkv

            def qkv(lw, h):
                q, k, v = orig_qkv(lw, h)
                l = layer["l"]
                out[f"attn_norm-{l}"], out[f"Qcur-{l}"], out[f"Kcur-{l}"], out[f"Vcur-{l}"] = (
                    np.array(h), np.array(q), np.array(k), np.array(v))
                return q, k, v

            class _Wo:  # records the attention output before and after the output projection
                def __init__(self, w, l):
                    self.w, self.l = w, l

                def __call__(self, o):
                    y = self.w(o)
                    out[f"kqv_out-{self.l}"] = np.array(o)
                    return y

            for i, lw in enumerate(m._w.layers):
                if getattr(lw, "wo", None) is not None:
                    lw.wo = _Wo(lw.wo, i)

            def ffn_input(lw, x):
                h = orig_in(lw, x)
                out[f"ffn_inp-{layer['l']}"] = np.array(x)
                out[f"ffn_norm-{layer['l']}"] = np.array(h)
                return h

            def route(lw, h):
                sel, w = orig_route(lw, h)
                out[f"ffn_moe_topk-{layer['l']}"] = np.array(sel)
                out[f"ffn_moe_weights-{layer['l']}"] = np.array(w)
                return sel, w

            def ffn_extra(lw, h):
                y = orig_extra(lw, h)
                if y is not None:
                    out[f"ffn_extra-{lw_index(lw)}"] = np.array(y)
                return y

            lw_index = {id(lw): i for i, lw in enumerate(m._w.layers)}.__getitem__
            lw_index = (lambda f: (lambda lw: f(id(lw))))(lw_index)
            arch.attention, arch.ffn_input, arch.route, arch.ffn_extra = attention, ffn_input, route, ffn_extra
            arch.qkv = qkv
            moe_add = m._moe_add

            def _moe_add(l, x, h, ys, step):
                y = moe_add(l, x, h, ys, step)
                out[f"l_out-{l}"] = np.array(y)
                return y

            m._moe_add = _moe_add
            out["result_output"] = np.array(await m.logits(ids))

    asyncio.run(go())
    del model_mod
    return out


def _diff(a: np.ndarray, b: np.ndarray) -> str:
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return f"max {d.max():10.6f}  mean {d.mean():10.7f}  (max|ref| {np.abs(b).max():8.3f})"


def compare(path: Path, ids: list[int], activations: str) -> None:
    ref, _ = capture(path, ids)
    ours = clutor_intermediates(path, ids, activations)
    n_layers = 1 + max(int(k.rsplit("-", 1)[1]) for k in ours if k.startswith("l_out-"))
    T = len(ids)
    for l in range(n_layers):
        rows = []
        # llama.cpp's name for the final router weights depends on the architecture's options
        weights = next((n for n in (f"ffn_moe_weights_scaled-{l}", f"ffn_moe_weights_norm-{l}",
                                    f"ffn_moe_weights-{l}") if n in ref), None)
        for mine, theirs in ((f"inp-{l}", f"l_out-{l - 1}" if l else "inp_embd"),
                             (f"attn_norm-{l}", f"attn_norm-{l}"),
                             (f"Qcur-{l}", f"Qcur-{l}"), (f"Kcur-{l}", f"Kcur-{l}"), (f"Vcur-{l}", f"Vcur-{l}"),
                             (f"kqv_out-{l}", f"kqv_out-{l}"),
                             (f"ffn_inp-{l}", f"ffn_inp-{l}"), (f"ffn_norm-{l}", f"ffn_norm-{l}"),
                             (f"ffn_moe_weights-{l}", weights), (f"l_out-{l}", f"l_out-{l}")):
            if mine in ours and theirs in ref and ref[theirs].size == ours[mine].size:
                rows.append(f"  {mine:24s} vs {theirs:28s} {_diff(ours[mine], ref[theirs].reshape(ours[mine].shape))}")
        if f"ffn_moe_topk-{l}" in ours and f"ffn_moe_topk-{l}" in ref:
            a = np.sort(ours[f"ffn_moe_topk-{l}"], -1)
            b = np.sort(ref[f"ffn_moe_topk-{l}"].reshape(T, -1), -1)
            bad = np.nonzero((a != b).any(-1))[0]
            rows.append(f"  experts chosen: {T - len(bad)}/{T} positions agree"
                        + (f" (differ at {bad[:12].tolist()})" if len(bad) else ""))
        print(f"layer {l}")
        print("\n".join(rows))
    print(f"logits {_diff(ours['result_output'], ref['result_output'].reshape(T, -1))}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--ids", help="comma-separated token ids")
    ap.add_argument("--golden", type=Path, help="take prompt_ids from a tests/golden .npz")
    ap.add_argument("--list", action="store_true", help="print every captured tensor's name, shape and op")
    ap.add_argument("--compare", action="store_true", help="compare with Clutor's forward pass, layer by layer")
    ap.add_argument("--activations", default="q8", choices=("q8", "f32"))
    ap.add_argument("--save", type=Path, help="write the tensors --names lists (and the ids) to this .npz")
    ap.add_argument("--names", help="comma-separated graph names for --save")
    args = ap.parse_args(argv)
    if args.golden:
        ids = np.load(args.golden)["prompt_ids"].tolist()
    elif args.ids:
        ids = [int(i) for i in args.ids.split(",")]
    else:
        ap.error("give --ids or --golden")
    if args.compare:
        compare(args.model, ids, args.activations)
        return 0
    got, ops = capture(args.model, ids)
    if args.save:
        names = (args.names or "").split(",")
        missing = [n for n in names if n not in got]
        if missing:
            raise SystemExit(f"not in the graph: {missing}")
        np.savez_compressed(args.save, ids=np.array(ids, np.int32),
                            **{n.replace("-", "_"): got[n] for n in names})
    for name, arr in got.items():
        if args.list:
            print(f"{name:40s} {str(arr.shape):24s} op {ops[name]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
