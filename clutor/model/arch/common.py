"""What every architecture shares: metadata reading with sanity bounds, the tensor table, and the
`Arch` base class whose methods are the steps an architecture may compute differently.

The layer loop (clutor.model.runner) calls, for each layer, on the compute thread:
    arch.attention(lw, l, x, step, rope)   -> [R, D] added to the residual (step: clutor.model.step.Step)
    arch.ffn_input(lw, x)                  -> h [R, D], what the FFN (router, experts) reads
    arch.route(lw, h)                      -> (experts [R, K], weights [R, K])   (MoE layers only)
    arch.expert_act(gu, F)                 -> [S, F] from gate | up [S, 2F]       (each routed expert)
    arch.ffn_extra(lw, h)                  -> [R, D] or None: shared expert(s) or a dense layer's FFN
and, where an architecture differs (Gemma 4): arch.embed(rows) on the token embeddings,
arch.router_input(lw, x, h) for what the router reads, arch.ffn_out(lw, x, h, routed) for the layer's
output (default x + routed + ffn_extra), arch.final_logits(logits) on the output projection.
``arch.layer_states()`` says what each layer keeps per sequence (FullKV, WindowKV, LatentKV,
Recurrent: clutor.model.state). The base class implements the GQA attention over every position's
keys and values, softmax top-k routing and SwiGLU experts; an architecture module overrides what it
does differently.

Metadata follows llama.cpp's load_hparams (src/llama-model.cpp and src/models/<arch>.cpp): a key
llama.cpp reads with a default is read here with the same default (read_int / read_float's default=,
derived defaults such as head size = n_embd / n_head computed the same way); a key it requires is
read without one, so a file lacking it is a ModelFileError naming that key. A new architecture module
does the same for each key its llama.cpp counterpart reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...errors import ModelFileError, UnsupportedError
from ..config import MAX_CTX, MAX_DIM, MAX_EXPERTS, MAX_HEAD_DIM, MAX_LAYERS, MAX_VOCAB, ModelConfig
from ..layers import Rope, Yarn, gate, rmsnorm, silu
from ..state import FullKV, LayerState
from ..quants import apply_all

__all__ = ["Arch", "T", "TableView", "read_int", "read_float", "read_common"]


# ---- metadata -----------------------------------------------------------------------------------
_MISSING = object()


def read_int(f, key: str, lo: int, hi: int, default=_MISSING) -> int:
    full = f"{f.arch}.{key}"
    v = f.get(full) if default is _MISSING else f.get(full, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ModelFileError(f.path, full, f"an integer in [{lo}, {hi}]", repr(v))
    return v


# The keys llama.cpp reads as one number or an array of one per layer (get_key_or_arr, block_count long)
PER_LAYER_KEYS = frozenset({"attention.head_count", "attention.head_count_kv", "feed_forward_length", "expert_used_count"})


def read_layer_int(f, key: str, lo: int, hi: int, default=_MISSING) -> int:
    """read_int for a key of PER_LAYER_KEYS: an array must be block_count long, as llama.cpp requires,
    and hold one value, since these architectures run one shape in every layer (a file whose layers
    differ is refused, naming the key; nemotron_h reads its per-layer kinds itself)."""
    full = f"{f.arch}.{key}"
    v = f.get(full) if default is _MISSING else f.get(full, default)
    if isinstance(v, list):
        n = f.get(f"{f.arch}.block_count")
        if len(v) != n:
            raise ModelFileError(f.path, full, f"one number or an array of {n} (block_count)", f"an array of {len(v)}")
        if len(set(map(repr, v))) > 1:
            raise UnsupportedError(f.path, full, "the same value in every layer (one layer shape)",
                                   repr(v) if len(v) <= 16 else repr(v[:16])[:-1] + ", ...]")
        v = v[0] if v else None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ModelFileError(f.path, full, f"an integer in [{lo}, {hi}]", repr(v))
    return v


def read_float(f, key: str, default=_MISSING, *, positive: bool = True) -> float:
    full = f"{f.arch}.{key}"
    v = f.get(full) if default is _MISSING else f.get(full, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v == v) or (positive and v <= 0):
        raise ModelFileError(f.path, full, "a positive number" if positive else "a number", repr(v))
    return float(v)


def read_bool(f, key: str, default: bool) -> bool:
    full = f"{f.arch}.{key}"
    v = f.get(full, default)
    if not isinstance(v, bool):
        raise ModelFileError(f.path, full, "a boolean", repr(v))
    return v


def _ff_over_k(f, k: int) -> int:
    """feed_forward_length / expert_used_count (0, refused by the caller's range, without an integer one)."""
    if f"{f.arch}.feed_forward_length" not in f.metadata:
        return 0
    return read_layer_int(f, "feed_forward_length", 0, MAX_DIM) // k


def read_common(f, *, ff_key: str, n_layers: int | None = None, n_dense_lead: int = 0, n_ff_shexp: int = 0,
                n_ff: int = 0, head_dim: int | None = None, head_dim_v: int | None = None,
                n_head_kv: int | None = None, kv_floats: int | None = None, eps: float | None = None,
                ff_from_dense: bool = False) -> ModelConfig:
    """The ModelConfig fields every architecture reads the same way; the arguments are what an
    architecture reads its own way (layer count without MTP layers, MLA head sizes, ...).
    ff_from_dense: an absent ff_key means feed_forward_length / expert_used_count (llama.cpp's
    default for the Qwen MoE architectures)."""
    n_embd = read_int(f, "embedding_length", 1, MAX_DIM)
    n_head = read_layer_int(f, "attention.head_count", 1, 4096)
    if n_head_kv is None:
        n_head_kv = read_layer_int(f, "attention.head_count_kv", 1, n_head, default=n_head)
    if n_head % n_head_kv:
        raise ModelFileError(f.path, f"{f.arch}.attention.head_count_kv", f"a divisor of head_count {n_head}", n_head_kv)
    default_hd = n_embd // n_head
    if head_dim is None:
        head_dim = read_int(f, "attention.key_length", 2, MAX_HEAD_DIM, default=default_hd)
    if head_dim_v is None:
        head_dim_v = read_int(f, "attention.value_length", 1, MAX_HEAD_DIM, default=default_hd)
    n_rot = read_int(f, "rope.dimension_count", 2, head_dim, default=head_dim)
    if n_rot % 2:
        raise ModelFileError(f.path, f"{f.arch}.rope.dimension_count", "an even number", n_rot)
    n_expert = read_int(f, "expert_count", 1, MAX_EXPERTS)
    n_expert_used = read_layer_int(f, "expert_used_count", 1, n_expert)
    if n_layers is None:
        n_layers = read_int(f, "block_count", 1, MAX_LAYERS)
    if not 0 <= n_dense_lead < n_layers:
        raise ModelFileError(f.path, f"{f.arch}.leading_dense_block_count", f"an integer in [0, {n_layers})", n_dense_lead)
    tok = f.tensor("token_embd.weight")
    if len(tok.shape) != 2 or tok.shape[1] != n_embd:
        raise ModelFileError(f.path, "tensor token_embd.weight", f"shape (n_vocab, {n_embd})", tok.shape)
    if tok.shape[0] > MAX_VOCAB:
        raise ModelFileError(f.path, "tensor token_embd.weight", f"at most {MAX_VOCAB} vocabulary rows", tok.shape[0])
    return ModelConfig(
        arch=f.arch,
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_rot=n_rot,
        n_vocab=tok.shape[0],
        n_ctx_train=read_int(f, "context_length", 1, MAX_CTX),
        rope_base=read_float(f, "rope.freq_base", default=10000.0),
        eps=read_float(f, "attention.layer_norm_rms_epsilon") if eps is None else eps,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=(read_layer_int if ff_key in PER_LAYER_KEYS else read_int)(
            f, ff_key, 1, MAX_DIM, default=_ff_over_k(f, n_expert_used) if ff_from_dense else _MISSING),
        n_ff_shexp=n_ff_shexp,
        n_ff=n_ff,
        moe_layers=tuple(range(n_dense_lead, n_layers)),
        kv_floats=n_head_kv * (head_dim + head_dim_v) if kv_floats is None else kv_floats,
        tied_output="output.weight" not in f.tensors,
    )


# ---- tensors ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class T:
    """One tensor of an architecture's files. kind: "weight" (a matrix kept in its file type), "heads"
    (a matrix per head [H, R, K] kept in its file type, as one Weight of H * R rows), "vector" (read as
    float32), "expert" (a routed-expert tensor: checked here, streamed by the expert store; ``part``
    says which slab of each expert it holds: "gate", "up", "down", "gate+up" (both, fused), "gate
    bias", "up bias", "down bias").

    The table of these (``Arch.file_tensors``) is the one statement of an architecture's tensors:
    the loader reads it, the expert layout is built from its expert entries, the fixture writers
    (tools/synth.py, tools/make_bench_model.py) write it."""

    name: str
    shape: tuple[int, ...]  # numpy order
    kind: str = "weight"
    required: bool = True
    part: str = ""

    @property
    def resident(self) -> bool:
        """Read into memory at open: every tensor but the routed experts, which the expert store streams.
        The one place that decides what is dense."""
        return self.kind != "expert"


class _Shape:
    def __init__(self, shape):
        self.shape = tuple(shape)


class TableView:
    """A file that is not written yet, as an architecture reads it: its metadata, and the numpy
    shapes of the tensors whose presence the architecture decides by (``token_embd``, an untied
    ``output``, fused experts, a selection bias). A writer builds the Arch from this (``read_arch``)
    and writes the Arch's ``file_tensors()``: the names, shapes and expert parts are never restated."""

    def __init__(self, arch: str, metadata: dict, shapes: dict[str, tuple[int, ...]], path: str = "<writer>"):
        self.arch, self.path = arch, path
        self.metadata = {"general.architecture": arch, **metadata}
        self.tensors = {name: _Shape(shape) for name, shape in shapes.items()}

    def get(self, key: str, default=_MISSING):
        if key in self.metadata:
            return self.metadata[key]
        if default is _MISSING:
            raise ModelFileError(self.path, key, "present", "absent")
        return default

    def tensor(self, name: str):
        if name not in self.tensors:
            raise ModelFileError(self.path, f"tensor {name}", "present", "absent")
        return self.tensors[name]


class Arch:
    """One architecture: its hyper-parameters (``cfg`` and its own attributes) and its computation.

    Subclasses set ``name`` and implement ``read(f)``; they override the compute methods where they
    differ from the default (GQA attention, softmax top-k routing, SwiGLU experts)."""

    name: ClassVar[str] = ""
    attention_kind: ClassVar[str] = "GQA"
    fused_gate_up: bool = False  # the file has ffn_gate_up_exps (set by read_arch)
    yarn: "Yarn | None" = None  # the file's YaRN RoPE scaling (the architectures that read it set it)
    rope_style: ClassVar[str] = "neox"  # "neox": pairs (i, i + n_rot/2); "norm": adjacent pairs (2i, 2i+1)
    weight_before_ffn: ClassVar[bool] = False  # True: each routed expert reads its input times its weight (llama4)
    # llama.cpp's own rounding where it rounds besides the products (Gemma's GELU table): in the q8
    # activation mode, whose point is llama.cpp's arithmetic; the f32 mode keeps floats exact (set by
    # the runner from the model's kernel settings)
    ggml_numerics: bool = True
    # F16 products summed in llama.cpp's own order in the q8 mode (KernelSettings.ggml_f16: slower;
    # for an architecture whose F16 files need it to meet llama.cpp's logits)
    ggml_f16_sums: ClassVar[bool] = False

    def __init__(self, path: str, cfg: ModelConfig):
        self.path = path
        self.cfg = cfg

    @classmethod
    def read(cls, f) -> "Arch":
        raise NotImplementedError

    # -- what the file must hold ------------------------------------------------------------------
    def global_tensors(self) -> dict[str, T]:
        cfg = self.cfg
        want = {"tok_embd": T("token_embd.weight", (cfg.n_vocab, cfg.n_embd)),
                "output_norm": T("output_norm.weight", (cfg.n_embd,), "vector")}
        if not cfg.tied_output:
            want["output"] = T("output.weight", (cfg.n_vocab, cfg.n_embd))
        return want

    def layer_tensors(self, l: int) -> dict[str, T]:
        """attribute -> tensor of layer l; LayerWeights gets one attribute per entry (None when an
        optional tensor is absent)."""
        return {**self.attention_tensors(l), **self.ffn_tensors(l)}

    def attention_tensors(self, l: int) -> dict[str, T]:
        cfg, b = self.cfg, f"blk.{l}."
        D = cfg.n_embd
        qd, kd = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        vd, od = cfg.n_head_kv * cfg.head_dim_v, cfg.n_head * cfg.head_dim_v
        return {
            "attn_norm": T(b + "attn_norm.weight", (D,), "vector"),
            "wq": T(b + "attn_q.weight", (qd, D)), "wk": T(b + "attn_k.weight", (kd, D)),
            "wv": T(b + "attn_v.weight", (vd, D)), "wo": T(b + "attn_output.weight", (D, od)),
            # llama.cpp reads q/k/v biases wherever they are present
            "bq": T(b + "attn_q.bias", (qd,), "vector", False), "bk": T(b + "attn_k.bias", (kd,), "vector", False),
            "bv": T(b + "attn_v.bias", (vd,), "vector", False),
        }

    ffn_norm_name: ClassVar[str] = "ffn_norm"  # glm4moe: post_attention_norm

    def ffn_tensors(self, l: int) -> dict[str, T]:
        cfg, b = self.cfg, f"blk.{l}."
        D, E, F = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp
        want = {"ffn_norm": T(b + self.ffn_norm_name + ".weight", (D,), "vector")}
        if l in cfg.moe_layers:
            want["router"] = T(b + "ffn_gate_inp.weight", (E, D), "vector")
            if self.fused_gate_up:  # gate and up of each expert in one tensor (llama.cpp's ffn_gate_up_exps)
                want["gate_up_exps"] = T(b + "ffn_gate_up_exps.weight", (E, 2 * F, D), "expert", part="gate+up")
            else:
                want |= {"gate_exps": T(b + "ffn_gate_exps.weight", (E, F, D), "expert", part="gate"),
                         "up_exps": T(b + "ffn_up_exps.weight", (E, F, D), "expert", part="up")}
            want["down_exps"] = T(b + "ffn_down_exps.weight", (E, D, F), "expert", part="down")
            if cfg.n_ff_shexp:
                S = cfg.n_ff_shexp
                want |= {"sh_gate": T(b + "ffn_gate_shexp.weight", (S, D)), "sh_up": T(b + "ffn_up_shexp.weight", (S, D)),
                         "sh_down": T(b + "ffn_down_shexp.weight", (D, S))}
        else:
            Fd = cfg.n_ff
            want |= {"ffn_gate": T(b + "ffn_gate.weight", (Fd, D)), "ffn_up": T(b + "ffn_up.weight", (Fd, D)),
                     "ffn_down": T(b + "ffn_down.weight", (D, Fd))}
        return want

    def unread_tensors(self) -> list[T]:
        """Tensors a file of this architecture carries that the forward pass does not read (MTP layers)."""
        return []

    def file_tensors(self) -> list[T]:
        """Every tensor a file of this architecture holds (optional ones marked so), in the order
        llama.cpp's converter writes them: the embedding, each layer's, the unread (MTP) layers,
        then the output norm and matrix."""
        glob = self.global_tensors()
        out = [t for t in glob.values() if t.name == "token_embd.weight"]
        for l in range(self.cfg.n_layers):
            out += self.layer_tensors(l).values()
        return out + self.unread_tensors() + [t for t in glob.values() if t.name != "token_embd.weight"]

    def prepare_global(self, glob: dict) -> None:
        """See the freshly loaded global tensors (by table key) before the model is built."""

    def prepare(self, lw) -> None:
        """Rearrange a layer's freshly loaded tensors (deepseek2 splits its older attn_kv_b)."""

    def check_file(self, f) -> None:
        """Refuse what the file holds that this architecture would silently ignore (llama.cpp reads it)."""

    # -- compute (all on the compute thread) ----------------------------------------------------
    def warmup(self) -> None:
        """Load (or compile) the compiled kernels only this architecture's layers call, at open: the
        shared ones are kernels.warmup's."""

    def context_limit(self) -> int:
        """The longest context this file supports: its context_length, or what its YaRN scaling
        reaches (original context x factor) where that is more, as llama.cpp extends it."""
        y = self.yarn
        return max(self.cfg.n_ctx_train, int(y.n_ctx_orig * y.factor) if y is not None else 0)

    def make_rope(self, n_ctx: int) -> Rope:
        return Rope(self.cfg.n_rot, self.cfg.rope_base, n_ctx, style=self.rope_style)

    def layer_states(self) -> list[LayerState]:
        """What each layer keeps per sequence (clutor.model.state): keys and values of every position here."""
        cfg = self.cfg
        return [FullKV(cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v)] * cfg.n_layers

    def layer_kind(self, l: int) -> str:
        """What layer l computes besides its FFN: "attention", "window" (sliding-window attention),
        "linear attention" (Gated DeltaNet) or "SSM" (Mamba-2)."""
        return "attention"

    def qkv(self, lw, h: np.ndarray):
        """Projections of the normed input h [R, D]: q [R, H, hd], k [R, Hkv, hd], v [R, Hkv, hdv]."""
        cfg, R = self.cfg, h.shape[0]
        q, k, v = self.qkv_rows(lw, h)
        return (q.reshape(R, cfg.n_head, cfg.head_dim), k.reshape(R, cfg.n_head_kv, cfg.head_dim),
                v.reshape(R, cfg.n_head_kv, cfg.head_dim_v))

    def qkv_rows(self, lw, h: np.ndarray):
        """qkv before the head split: q [R, H*hd], k [R, Hkv*hd], v [R, Hkv*hdv], biases added."""
        q, k, v = products(lw, "qkv", (lw.wq, lw.wk, lw.wv), h)
        if lw.bq is not None:
            q = q + lw.bq
        if lw.bk is not None:
            k = k + lw.bk
        if lw.bv is not None:
            v = v + lw.bv
        return q, k, v

    def attention(self, lw, l: int, x: np.ndarray, step, rope: Rope) -> np.ndarray:
        """GQA self-attention of the residual x [R, D]: each sequence of the step over its own KV
        (``step``: clutor.model.step.Step writes k, v into each sequence's state and attends)."""
        cfg = self.cfg
        q, k, v = self.qkv(lw, rmsnorm(x, lw.attn_norm, cfg.eps))
        o = step.attend_rotary(l, rope, q, k, v, 1.0 / np.sqrt(cfg.head_dim))  # [R, H*hdv]
        return products(lw, "wo", (lw.wo,), o)[0]

    def embed(self, x: np.ndarray) -> np.ndarray:
        """The token embeddings' rows [R, D] as the first layer reads them (Gemma scales them)."""
        return x

    def ffn_input(self, lw, x: np.ndarray) -> np.ndarray:
        return rmsnorm(x, lw.ffn_norm, self.cfg.eps)  # [R, D]

    def router_input(self, lw, x: np.ndarray, h: np.ndarray) -> np.ndarray:
        """What the router reads, given the residual x and the experts' input h (h: most architectures)."""
        return h

    def ffn_out(self, lw, x: np.ndarray, h: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """The layer's output from the residual x [R, D], the experts' input h and the routed experts'
        weighted sum [R, D]: x + routed + ffn_extra(h)."""
        extra = self.ffn_extra(lw, h)
        return x + routed if extra is None else x + (routed + extra)

    def final_logits(self, logits: np.ndarray) -> np.ndarray:
        """The output projection's logits [rows, V] as returned (Gemma soft-caps them)."""
        return logits

    def route(self, lw, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Softmax over all experts, top-k, weights not renormalised (olmoe, qwen2moe)."""
        return gate(h, lw.router, self.cfg.n_expert_used)

    def expert_scale(self, lw) -> np.ndarray | None:
        """Each expert's own output scale [E] (Gemma 4's ffn_down_exps.scale), applied to its down
        product before the router's weight, as llama.cpp applies it; None: none."""
        return None

    def expert_act(self, gu: np.ndarray, F: int) -> np.ndarray:
        """SwiGLU of gate | up [S, 2F] -> [S, F]."""
        return silu(gu[:, :F]) * gu[:, F:]

    def ffn_extra(self, lw, h: np.ndarray) -> np.ndarray | None:
        """What the layer's FFN adds besides routed experts: a leading dense layer's FFN, the
        ungated shared expert(s) of glm4moe/deepseek2 (overridden by qwen2moe's gated one)."""
        if lw.ffn_gate is not None:  # a dense layer
            return lw.ffn_down(silu(lw.ffn_gate(h)) * lw.ffn_up(h))
        if lw.sh_gate is not None:
            return lw.sh_down(silu(lw.sh_gate(h)) * lw.sh_up(h))
        return None

    # -- what `clutor info` says ---------------------------------------------------------------------
    def gating(self) -> str:
        return "softmax, top-k"

    def describe(self) -> dict:
        cfg = self.cfg
        n_dense = cfg.n_layers - len(cfg.moe_layers)
        return {
            "attention": self.attention_kind,
            "rope": f"{self.rope_style}, {cfg.n_rot} of {cfg.head_dim} dims",
            "gating": self.gating(),
            "dense_layers": n_dense,
            "shared_expert": cfg.n_ff_shexp,
            "sliding_window": None,
            "fused_gate_up": self.fused_gate_up,
            "kv_bytes_per_token": cfg.kv_bytes_per_token,
            "layer_kinds": [self.layer_kind(l) for l in range(cfg.n_layers)],
            "recurrent_bytes": cfg.recurrent_bytes,
        }


def products(lw, key: str, weights: tuple, x: np.ndarray) -> list[np.ndarray]:
    """apply_all(weights, x): [w(x) for w in weights], column blocks of one array. A decode step's
    few rows go through a kernels.prepared.Prepared kept on the layer's weights under key (its job
    rows built once, not per token), with the same bits; other steps, or weights it does not take,
    through apply_all."""
    from ..kernels.prepared import Prepared

    kept = lw.__dict__.setdefault("_prepared", {})  # LayerWeights: key -> (weights, Prepared)
    hit = kept.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], weights)):
        hit = kept[key] = (weights, Prepared([w.raw for w in weights], [w.qtype for w in weights],
                                             [w.shape[0] for w in weights], weights[0].shape[1], weights[0].kernels)
                           if all(w._f32 is None for w in weights) and len({w.shape[1] for w in weights}) == 1
                           else None)
    out = None if hit[1] is None else hit[1](x)
    if out is None:
        return [weights[0](x)] if len(weights) == 1 else apply_all(weights, x)
    if len(weights) == 1:
        return [out]
    cols = hit[1].cols
    return [out[:, a:b] for a, b in zip(cols[:-1], cols[1:])]


def mtp_layer_tensors(arch: Arch, l: int) -> list[T]:
    """An MTP (nextn) layer l as llama.cpp's converter writes it for glm4moe and deepseek2: a MoE
    layer's tensors plus its own projection and norms (not read: the forward pass skips it)."""
    from dataclasses import replace

    saved = arch.cfg
    arch.cfg = replace(saved, moe_layers=saved.moe_layers + (l,))
    try:
        out = list(arch.layer_tensors(l).values())
    finally:
        arch.cfg = saved
    b, D = f"blk.{l}.", saved.n_embd
    return out + [T(b + "nextn.eh_proj.weight", (D, 2 * D)), T(b + "nextn.enorm.weight", (D,), "vector"),
                  T(b + "nextn.hnorm.weight", (D,), "vector"), T(b + "nextn.shared_head_norm.weight", (D,), "vector")]


def refuse_tensor(f, name: str, why: str) -> None:
    if name in f.tensors:
        raise UnsupportedError(f.path, f"tensor {name}", why, "present")
