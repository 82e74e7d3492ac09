"""The model ``clutor demo`` runs: a random-weight OLMoE-shaped GGUF, built once into the user's cache.

The weights are random but deterministic from a seed and scaled so the network is numerically sane
(activations O(1) through the layers, router logits spread enough that top-k choices are rarely
near-ties, final logits with a standard deviation near 3 so the greedy token is rarely a near-tie).
The tokenizer is a real byte-level BPE trained on the small corpus shipped in ``clutor/data``.

The file is written with gguf-py's ``GGUFWriter`` (header, metadata, tensor table); each tensor's
data follows in chunks of about a million values, so building a model never holds a whole tensor.
Q8_0 matrices are written as random *blocks* (random scales and random quants) instead of quantising
floats, which is what makes building fast; their dequantised values are close to N(0, sigma).

The pieces below the demo's own plan (tokenizer, ``TensorPlan``, the random blocks, ``write_gguf``)
are generic: ``tools/synth.py`` builds the test fixtures and the benchmark-sized models of every
architecture on them.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import os
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType

from clutor.errors import ClutorError, UnsupportedError

__all__ = ["DEMO", "DemoSpec", "ensure_demo_model", "write_demo_model"]

# Bump when the bytes written for the same arguments change: it invalidates cached demo models.
GENERATOR_VERSION = 3

ALIGNMENT = GGUF_DEFAULT_ALIGNMENT  # of the data section and of each tensor in it (32)

# Target standard deviation of the final logits (see module docstring).
LOGIT_STD = 3.0
# Target standard deviation of the router logits; with 8..128 experts this keeps the k-th and
# (k+1)-th scores apart by a few tenths at most positions.
ROUTER_STD = 2.0
# Output rows of "quiet" tokens are scaled by this, so their logits stay near 0 and greedy decoding
# emits readable text: control tokens (specials, the <|unused_N|> padding that fills most of a 50k or
# 150k vocabulary) and tokens whose bytes are not valid UTF-8 on their own (stray bytes >= 0x80).
QUIET_ROW_GAIN = 0.1

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# OLMoE-Instruct's own (Tulu) style: role tags as plain text, eos closing each assistant turn.
OLMOE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class DemoSpec:
    """Shape of the demo model (OLMoE: QK-norm over whole q/k vectors, no shared expert, every matrix Q8_0)."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    vocab_size: int
    n_ctx: int = 4096
    eps: float = 1e-5


# About 1 GB, most of it in experts, so a 256 MiB expert cache has to stream.
DEMO = DemoSpec(name="demo", n_layer=16, n_embd=1024, n_head=8, head_dim=128, n_expert=32, n_expert_used=4,
                n_ff_exp=512, vocab_size=4096)


# ----------------------------------------------------------------------------------------------
# Tokenizer


def byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (byte b is shown as this character in token text)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _corpus_text() -> str:
    return importlib.resources.files("clutor").joinpath("data/corpus.txt").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=8)
def train_bpe(n_learned: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(learned token strings, merges) of a byte-level BPE with at most ``n_learned`` symbols
    (256 byte symbols included), trained on the shipped corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=n_learned,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # One document per paragraph: the counts are what matter, the order does not.
    tok.train_from_iterator(_corpus_text().split("\n\n"), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = tuple(m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"])
    vocab: dict[str, int] = model["vocab"]
    # Our own id order: the 256 byte symbols by byte value, then one token per merge in rank order.
    tokens = byte_chars() + [m.replace(" ", "", 1) for m in merges]
    if set(tokens) != set(vocab) or len(tokens) != len(vocab):
        raise RuntimeError("BPE trainer produced a vocabulary that is not bytes + one token per merge")
    return tuple(tokens), merges


def train_tokenizer(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of exactly ``vocab_size`` tokens, in GGUF table form.

    Returns (tokens, token_types, merges): tokens as byte-level strings (``Ġthe``), token types
    1 (normal) or 3 (control), merges as ``"a b"`` strings in rank order. Layout: 256 byte
    symbols, learned merges, ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, then control
    tokens ``<|unused_N|>`` when the corpus cannot fill the requested size. BPE training has no
    randomness, so the vocabulary depends on the size alone.
    """
    n_special = len(SPECIAL_TOKENS)
    if vocab_size < 256 + n_special:
        raise UnsupportedError("<synth>", "vocab_size", f"at least {256 + n_special}", vocab_size)
    learned, merges = train_bpe(vocab_size - n_special)
    tokens = list(learned) + list(SPECIAL_TOKENS)
    types = [1] * len(learned) + [3] * n_special
    n_pad = vocab_size - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(n_pad)]
    types += [3] * n_pad
    return tokens, types, list(merges)


@functools.lru_cache(maxsize=8)
def quiet_tokens(vocab_size: int) -> np.ndarray:
    """[vocab_size] bool: control tokens, tokens whose bytes are not valid UTF-8 by themselves, and
    tokens holding ASCII control characters other than newline and tab."""
    tokens, types, _ = train_tokenizer(vocab_size)
    to_byte = {c: b for b, c in enumerate(byte_chars())}
    quiet = np.array([t == 3 for t in types])
    for i, tok in enumerate(tokens):
        if not quiet[i]:
            try:
                text = bytes(to_byte[c] for c in tok).decode("utf-8")
            except UnicodeDecodeError:
                quiet[i] = True
                continue
            quiet[i] = any((ord(ch) < 32 and ch not in "\n\t") or ord(ch) == 127 for ch in text)
    return quiet


# ----------------------------------------------------------------------------------------------
# GGUF metadata and the tensor plan

# One metadata entry: (key, value, type, item type of an array).
KV = tuple[str, object, GGUFValueType, "GGUFValueType | None"]


def kv(key: str, vtype: GGUFValueType, value: object, sub: GGUFValueType | None = None) -> KV:
    return (key, value, vtype, sub)


def tokenizer_metadata(vocab_size: int, pre: str, template: str) -> list[KV]:
    """The trained BPE as GGUF ``tokenizer.*`` keys: ``<|endoftext|>`` is bos, eos and padding, no BOS added."""
    U32, STR, BOOL, ARR = GGUFValueType.UINT32, GGUFValueType.STRING, GGUFValueType.BOOL, GGUFValueType.ARRAY
    tokens, types, merges = train_tokenizer(vocab_size)
    eos = tokens.index("<|endoftext|>")
    return [
        kv("tokenizer.ggml.model", STR, "gpt2"),
        kv("tokenizer.ggml.pre", STR, pre),
        kv("tokenizer.ggml.tokens", ARR, tokens, GGUFValueType.STRING),
        kv("tokenizer.ggml.token_type", ARR, types, GGUFValueType.INT32),
        kv("tokenizer.ggml.merges", ARR, merges, GGUFValueType.STRING),
        kv("tokenizer.ggml.bos_token_id", U32, eos),
        kv("tokenizer.ggml.eos_token_id", U32, eos),
        kv("tokenizer.ggml.padding_token_id", U32, eos),
        kv("tokenizer.ggml.add_bos_token", BOOL, False),
        kv("tokenizer.chat_template", STR, template),
    ]


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write. ``shape`` is numpy order (ne reversed); ``init`` says how to fill it:
    "normal" N(0, std), "norm" 1 + 0.1 N(0, 1) (RMSNorm weights). In an output matrix
    (``quiet`` set) the rows of quiet tokens get QUIET_ROW_GAIN times the spread."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    init: str
    std: float = 0.0
    quiet: bool = False

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        n = int(np.prod(self.shape))
        return n // block * size


def file_type(plans: Sequence[TensorPlan]) -> int:
    """general.file_type from the type that holds most of the bytes (the experts)."""
    by_type: dict[GGMLQuantizationType, int] = {}
    for p in plans:
        by_type[p.qtype] = by_type.get(p.qtype, 0) + p.nbytes
    main = max(by_type, key=by_type.__getitem__)
    names = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_K": "MOSTLY_Q4_K_M", "MXFP4": "MOSTLY_MXFP4_MOE"}
    return int(LlamaFileType[names.get(main.name, "MOSTLY_" + main.name)])


def fingerprint(ident: dict) -> str:
    """Hex digest of what decides a generated file's bytes (``ident`` is JSON-able), generator version included."""
    return hashlib.sha256(json.dumps({**ident, "version": GENERATOR_VERSION}, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# Random data, chunk by chunk. Each tensor has its own generator seeded from (seed, name), so a
# tensor's bytes do not depend on which tensors come before it.

CHUNK = 1 << 20  # values per chunk: keeps temporaries to a few MB


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))


def float_chunks(plan: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """float32 values of the tensor, whole rows per chunk."""
    row = plan.shape[-1]
    n_rows = int(np.prod(plan.shape)) // row
    rows_per = max(1, CHUNK // row)
    for r0 in range(0, n_rows, rows_per):
        n = (min(n_rows, r0 + rows_per) - r0) * row
        x = rng.standard_normal(n, dtype=np.float32).reshape(-1, row)  # [rows, row]
        if plan.init == "norm":
            x = 1.0 + 0.1 * x
        else:
            x *= plan.std * _row_gain(plan, r0, x.shape[0])[:, None]
        yield x


def _row_gain(plan: TensorPlan, first_row: int, n_rows: int) -> np.ndarray:
    """[n_rows] spread factor of rows first_row.. (QUIET_ROW_GAIN for quiet tokens' rows, else 1)."""
    if not plan.quiet:
        return np.ones(n_rows, dtype=np.float32)
    quiet = quiet_tokens(plan.shape[0])[first_row : first_row + n_rows]
    return np.where(quiet, QUIET_ROW_GAIN, 1.0).astype(np.float32)


def block_gain(plan: TensorPlan, first_block: int, n_blocks: int, block: int) -> np.ndarray:
    """[n_blocks] spread factor of blocks first_block.. (blocks never straddle rows)."""
    per_row = plan.shape[-1] // block
    rows = np.arange(first_block, first_block + n_blocks) // per_row
    return _row_gain(plan, int(rows[0]), int(rows[-1]) - int(rows[0]) + 1)[rows - rows[0]].astype(np.float64)


_M6 = np.uint64(0x3F3F3F3F3F3F3F3F)
_C2 = np.uint64(0x0202020202020202)
_X80 = np.uint64(0x8080808080808080)
_S2 = np.uint64(2)
# std of the random int8 quants below: a sum of four uniform 6-bit values has variance 4 * (64^2 - 1) / 12
_Q8_STD = float(np.sqrt(4 * (64**2 - 1) / 12))


def _random_int8(rng: np.random.Generator, n: int) -> np.ndarray:
    """n near-Gaussian int8 values in [-126, 126], mean 0, std _Q8_STD (n a multiple of 8).

    Eight values per uint64 word: each byte lane sums four uniform 6-bit values (max 252, so no
    carry crosses into the next lane), then is re-centred to 128 and flipped to two's complement.
    """
    r = rng.bit_generator.random_raw(4 * (n // 8)).reshape(4, -1)  # [4, n/8] uint64
    s = (r[0] >> _S2) & _M6
    for k in range(1, 4):
        s += (r[k] >> _S2) & _M6
    s += _C2
    s ^= _X80
    return s.view(np.int8)


def q8_0_chunks(plan: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Random Q8_0 blocks: [f16 d][32 x int8], value = d * q, so std = plan.std."""
    n_blocks = int(np.prod(plan.shape)) // 32
    per = CHUNK // 32
    # The per-block jitter exp(0.1 N) inflates E[d^2] by exp(0.02); divide it back out.
    base = plan.std / _Q8_STD / np.exp(0.01)
    for b0 in range(0, n_blocks, per):
        nb = min(n_blocks, b0 + per) - b0
        out = np.empty((nb, 34), dtype=np.uint8)
        d = (base * np.exp(0.1 * rng.standard_normal(nb)) * block_gain(plan, b0, nb, 32)).astype(np.float16)
        out[:, :2] = d.view(np.uint8).reshape(nb, 2)
        out[:, 2:] = _random_int8(rng, nb * 32).view(np.uint8).reshape(nb, 32)
        yield out


# What the demo model needs; tools/synth.py adds F16, Q4_K, MXFP4 and gguf-py's float quantisers.
WRITERS: dict[GGMLQuantizationType, Callable[[TensorPlan, np.random.Generator], Iterator[np.ndarray]]] = {
    GGMLQuantizationType.F32: float_chunks,
    GGMLQuantizationType.Q8_0: q8_0_chunks,
}


# ----------------------------------------------------------------------------------------------
# Writing: gguf-py's writer for everything before the data, then the data chunk by chunk


def _writer(path: Path, arch: str, kvs: Sequence[KV], plans: Sequence[TensorPlan]) -> GGUFWriter:
    w = GGUFWriter(path, arch)  # it writes general.architecture itself
    w.add_custom_alignment(ALIGNMENT)  # written out, so readers need not know the default
    for key, value, vtype, sub in kvs:
        w.add_key_value(key, value, vtype, sub)
    for p in plans:
        block, size = GGML_QUANT_SIZES[p.qtype]
        byte_shape = (*p.shape[:-1], p.shape[-1] // block * size)  # the writer takes raw data as bytes per row
        w.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), p.nbytes, raw_dtype=p.qtype)
    return w


def _write_head(w: GGUFWriter):
    """Write the header, metadata and tensor table, padded to where the data starts; return the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    w.write_padding(f, f.tell())
    return f


def header_bytes(arch: str, kvs: Sequence[KV], plans: Sequence[TensorPlan]) -> bytes:
    """Everything before the first tensor's data (padded to the alignment), as ``write_gguf`` writes it."""
    with tempfile.TemporaryDirectory(prefix="clutor-header-") as d:
        path = Path(d) / "h.gguf"
        w = _writer(path, arch, kvs, plans)
        try:
            _write_head(w)
        finally:
            w.close()
        return path.read_bytes()


def file_size(header_size: int, plans: Sequence[TensorPlan]) -> int:
    """Size of the file ``write_gguf`` writes, from its header's size: each tensor padded to the alignment."""
    return header_size + sum(GGUFWriter.ggml_pad(p.nbytes, ALIGNMENT) for p in plans)


def write_gguf(
    path: str | os.PathLike,
    arch: str,
    kvs: Sequence[KV],
    plans: Sequence[TensorPlan],
    chunks: Callable[[TensorPlan], Iterable[np.ndarray]],
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a GGUF: ``kvs`` and the tensor table through ``GGUFWriter``, then each tensor's bytes
    from ``chunks(plan)`` (arrays whose raw bytes are the tensor's, in order), each tensor padded to
    the alignment. ``progress(done, total)`` gets byte counts after each chunk."""
    path = Path(path)
    w = _writer(path, arch, kvs, plans)
    try:
        # GGUFWriter takes a whole tensor at a time; a few-GB expert tensor goes through in chunks
        # instead, written to its file with the writer's padding rule.
        f = _write_head(w)
        done, total = f.tell(), file_size(f.tell(), plans)
        for p in plans:
            written = 0
            for chunk in chunks(p):
                f.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
                written += chunk.nbytes
                if progress is not None:
                    progress(done + written, total)
            if written != p.nbytes:
                raise RuntimeError(f"{p.name}: wrote {written} bytes, planned {p.nbytes}")
            w.write_padding(f, written)
            done = f.tell()
    finally:
        w.close()
    if done != total:
        raise RuntimeError(f"{path}: wrote {done} bytes, planned {total}")
    return path


def seeded_chunks(seed: int, writers: dict = WRITERS) -> Callable[[TensorPlan], Iterator[np.ndarray]]:
    """``chunks`` for ``write_gguf``: each tensor's random data from its own (seed, name) generator."""
    return lambda plan: writers[plan.qtype](plan, tensor_rng(seed, plan.name))


# ----------------------------------------------------------------------------------------------
# The demo model


def _demo_plans(spec: DemoSpec) -> list[TensorPlan]:
    q8, f32 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32
    D, V, E, F, Q = spec.n_embd, spec.vocab_size, spec.n_expert, spec.n_ff_exp, spec.n_head * spec.head_dim

    def w(name: str, shape: tuple[int, ...], std: float, qt: GGMLQuantizationType = q8) -> TensorPlan:
        return TensorPlan(name, shape, qt, "normal", std)

    def norm(name: str, size: int) -> TensorPlan:
        return TensorPlan(name, (size,), f32, "norm")

    plans = [w("token_embd.weight", (V, D), 1.0)]
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        plans += [
            norm(b + "attn_norm.weight", D),
            w(b + "attn_q.weight", (Q, D), 1 / np.sqrt(D)),
            w(b + "attn_k.weight", (Q, D), 1 / np.sqrt(D)),
            w(b + "attn_v.weight", (Q, D), 1 / np.sqrt(D)),
            w(b + "attn_output.weight", (D, Q), 1 / np.sqrt(Q)),
            norm(b + "attn_q_norm.weight", Q),  # OLMoE's QK-norm is over the whole q / k vectors
            norm(b + "attn_k_norm.weight", Q),
            norm(b + "ffn_norm.weight", D),
            w(b + "ffn_gate_inp.weight", (E, D), ROUTER_STD / np.sqrt(D), f32),
            w(b + "ffn_gate_exps.weight", (E, F, D), 1 / np.sqrt(D)),
            w(b + "ffn_up_exps.weight", (E, F, D), 1 / np.sqrt(D)),
            w(b + "ffn_down_exps.weight", (E, D, F), 1 / np.sqrt(F)),
        ]
    plans += [norm("output_norm.weight", D),
              TensorPlan("output.weight", (V, D), q8, "normal", LOGIT_STD / np.sqrt(D), quiet=True)]
    return plans


def _demo_metadata(spec: DemoSpec, seed: int, plans: Sequence[TensorPlan]) -> list[KV]:
    U32, F32, STR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    fp = demo_fingerprint(spec, seed)
    return [
        kv("general.name", STR, f"clutor-synth {spec.name} seed {seed} ({fp[:12]})"),
        kv("general.file_type", U32, file_type(plans)),
        kv("general.quantization_version", U32, 2),
        kv("clutor.synth.fingerprint", STR, fp),
        kv("olmoe.context_length", U32, spec.n_ctx),
        kv("olmoe.embedding_length", U32, spec.n_embd),
        kv("olmoe.block_count", U32, spec.n_layer),
        kv("olmoe.attention.head_count", U32, spec.n_head),
        kv("olmoe.attention.head_count_kv", U32, spec.n_head),
        kv("olmoe.attention.key_length", U32, spec.head_dim),
        kv("olmoe.attention.value_length", U32, spec.head_dim),
        kv("olmoe.rope.freq_base", F32, 10000.0),
        kv("olmoe.attention.layer_norm_rms_epsilon", F32, spec.eps),
        kv("olmoe.expert_count", U32, spec.n_expert),
        kv("olmoe.expert_used_count", U32, spec.n_expert_used),
        kv("olmoe.feed_forward_length", U32, spec.n_ff_exp),  # olmoe has no expert-specific key
        *tokenizer_metadata(spec.vocab_size, "olmo", OLMOE_TEMPLATE),
    ]


def demo_fingerprint(spec: DemoSpec, seed: int) -> str:
    return fingerprint({"spec": asdict(spec), "seed": seed})


def write_demo_model(path: str | os.PathLike, spec: DemoSpec = DEMO, *, seed: int = 0,
                     progress: Callable[[int, int], None] | None = None) -> Path:
    plans = _demo_plans(spec)
    return write_gguf(path, "olmoe", _demo_metadata(spec, seed, plans), plans, seeded_chunks(seed), progress)


def demo_size(spec: DemoSpec = DEMO, seed: int = 0) -> int:
    """Size in bytes of the file :func:`write_demo_model` writes."""
    plans = _demo_plans(spec)
    return file_size(len(header_bytes("olmoe", _demo_metadata(spec, seed, plans), plans)), plans)


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "clutor"


def _is_valid(path: Path, spec: DemoSpec, seed: int) -> bool:
    """Cheap check that ``path`` is the complete file write_demo_model would produce: same header
    (it carries the fingerprint of everything that decides the bytes) and same size."""
    try:
        size = path.stat().st_size
        plans = _demo_plans(spec)
        want = header_bytes("olmoe", _demo_metadata(spec, seed, plans), plans)
        if size != file_size(len(want), plans):
            return False
        with open(path, "rb") as f:
            return f.read(len(want)) == want
    except OSError:
        return False


_TMP_SUFFIX = ".tmp"
_STALE_SECONDS = 24 * 3600  # a temp file without a live writer's pid in its name, this old, is garbage


def _remove_stale_temps(root: Path) -> None:
    """Delete half-written demo models left by killed runs: `.NAME.PID.RANDOM.tmp` whose PID no longer
    runs (older versions wrote `.NAME.RANDOM.tmp`: those go once a day old)."""
    for p in root.glob(f".*.gguf.*{_TMP_SUFFIX}"):
        fields = p.name[: -len(_TMP_SUFFIX)].split(".")
        pid = fields[-2] if len(fields) >= 2 else ""
        try:
            if pid.isdigit():
                if _alive(int(pid)):
                    continue
            elif time.time() - p.stat().st_mtime < _STALE_SECONDS:
                continue
            p.unlink()
        except OSError:
            pass  # gone already, or not ours to remove


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def ensure_demo_model(
    cache_dir: str | os.PathLike | None = None,
    *,
    spec: DemoSpec = DEMO,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Path of the demo model in ``cache_dir`` (default ``$XDG_CACHE_HOME/clutor`` or
    ``~/.cache/clutor``), writing it first if it is missing or stale.

    The file name carries the fingerprint of (spec, seed, generator version); it is written to a
    temporary name in the same directory and renamed into place, so a crash never leaves a
    half-written file under the final name. ``spec`` overrides the demo's shape (for tests).
    """
    root = Path(cache_dir) if cache_dir is not None else _cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ClutorError(f"{root}: cannot create the demo model's directory: {e.strerror or e}") from None
    if not root.is_dir():
        raise ClutorError(f"{root}: cannot write the demo model: not a directory")
    path = root / f"{spec.name}-{demo_fingerprint(spec, seed)[:16]}.gguf"
    _remove_stale_temps(root)
    if _is_valid(path, spec, seed):
        return path
    try:
        # the pid in the name lets a later run tell a dead writer's leftover from a live writer's file
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=_TMP_SUFFIX, dir=root)
    except OSError as e:
        raise ClutorError(f"{root}: cannot write the demo model: {e.strerror or e}") from None
    os.close(fd)
    try:
        write_demo_model(tmp, spec, seed=seed, progress=progress)
        os.replace(tmp, path)
    except OSError as e:
        raise ClutorError(f"{path}: cannot write the demo model: {e.strerror or e}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)  # after the rename there is nothing left under this name
    return path
