"""How a model is opened: where experts come from and how much memory they may use."""
from __future__ import annotations

from dataclasses import dataclass

from .._util import cgroup_room, proc_bytes
from ..errors import BudgetError, ClutorError
from ..io.layout import ExpertLayout
from ..io.policies import DEFAULT_POLICY, POLICIES
from ..io.store import slot_bytes  # the store owns slot geometry; budgets are counted in its slots
from ..units import format_bytes, parse_bytes
from .kernel_settings import KernelSettings

KV_TYPES = ("f32", "f16", "q8_0")  # KV pool element types (clutor.model.kv)

__all__ = ["ModelOptions", "DEFAULTS", "IO_CHOICES", "KV_TYPES", "parse_size", "resolve_budget", "resolve_kv_budget",
           "resolve_window", "window_bytes_per_token", "mem_available"]

IO_CHOICES = ("auto", "uring", "threads", "memory")


@dataclass(frozen=True)
class ModelOptions:
    n_ctx: int | None = None
    expert_cache: int | str | None = None  # bytes, "3GiB", "25%" of the expert bytes, None = default share of RAM
    prefetch: bool | None = None           # None = the measured default (see Model.open)
    policy: str = DEFAULT_POLICY  # lrfu; forecast learns from routing (README: Cache policy on real routing)
    io: str = "auto"                       # auto | uring | threads | memory (mmap, no store, no budget)
    direct: bool = True                    # O_DIRECT (bypass the page cache) when the filesystem allows it
    trace: str | None = None               # JSONL routing trace written while running
    max_sequences: int = 16                # live sequences in one batched step
    step_tokens: int = 256                 # tokens one step computes at most (prompts are chunked)
    prefill_window: int | None = None      # tokens of a prompt one prefill step takes (None: from memory, 0: off)
    prefill_slice_ms: float = 100.0        # work a long prefill does between other sequences' decode steps
    prefix_cache: int | str = "256MiB"     # KV bytes of finished sequences kept for prefix reuse
    prefix_cache_disk: str | None = None   # a directory for KV pages on disk (clutor.model.kv_disk), None: off
    prefix_cache_disk_size: int | str = "20GiB"  # the bytes its files may take
    kv_cache: int | str | None = None      # KV pool bytes, "2GiB", "10%" of available memory, None = default
    kv_type: str = "f16"                   # f32 | f16 (llama.cpp's default) | q8_0
    profile: bool = False                  # time each step's spans (clutor.model.profile)
    activations: str = "auto"              # kernels: auto | q8 | f32 (clutor.model.kernel_settings)
    threads: int | None = None             # kernels: threads per product (None: the CPUs allowed)
    speculative: object = None             # clutor.model.speculative.SpeculativeParams for every request, None: off
    draft_model: str | None = None         # a draft model's GGUF (clutor.model.draft), run in RAM beside this one

    @property
    def kernels(self) -> KernelSettings:
        return KernelSettings(self.activations, self.threads)

    @property
    def prefix_cache_bytes(self) -> int:
        return parse_bytes(self.prefix_cache)

    def __post_init__(self):
        for name in ("max_sequences", "step_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ClutorError(f"{name} must be an integer >= 1, got {v!r}")
        w = self.prefill_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise ClutorError(f"prefill_window must be an integer >= 0 (0: off) or None (from memory), got {w!r}")
        ms = self.prefill_slice_ms
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 1 <= ms <= 60_000:
            raise ClutorError(f"prefill_slice_ms must be a number of milliseconds in [1, 60000], got {ms!r}")
        try:
            self.prefix_cache_bytes
        except (ValueError, TypeError, OverflowError) as e:
            raise ClutorError(f"prefix_cache: expected bytes like '256MiB' or 0, got {self.prefix_cache!r} ({e})") from None
        try:
            if parse_bytes(self.prefix_cache_disk_size) <= 0:
                raise ValueError("must be more than 0")
        except (ValueError, TypeError, OverflowError) as e:
            raise ClutorError(f"prefix_cache_disk_size: expected bytes like '20GiB', got "
                              f"{self.prefix_cache_disk_size!r} ({e})") from None
        self.kernels  # raises ClutorError naming a bad activations / threads value
        from .speculative import parse_speculative

        object.__setattr__(self, "speculative", parse_speculative(self.speculative))  # ClutorError when bad
        if self.draft_model is not None and self.speculative is None:
            from .speculative import SpeculativeParams

            object.__setattr__(self, "speculative", SpeculativeParams(mode="draft"))  # a draft model drafts
        if self.speculative is not None and self.speculative.mode == "draft" and self.draft_model is None:
            raise ClutorError("speculative mode 'draft' needs a draft model (draft_model=PATH, -md/--model-draft)")
        if self.kv_type not in KV_TYPES:
            raise ClutorError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {self.kv_type!r}")
        if self.kv_cache is not None:
            parse_size(self.kv_cache, "kv_cache", 1 << 40, "available memory")
        if self.io not in IO_CHOICES:
            raise ClutorError(f"io must be one of {', '.join(IO_CHOICES)}, got {self.io!r}")
        if self.io != "memory" and self.policy not in POLICIES:
            raise ClutorError(f"policy must be one of {', '.join(sorted(POLICIES))}, got {self.policy!r}")


DEFAULTS = ModelOptions()  # the one place Model.open's, the command line's and the server's defaults come from


def mem_available() -> int:
    """MemAvailable from /proc/meminfo (bytes), or 4 GiB where it cannot be read; less where the
    process's memory cgroup has less room left."""
    avail = proc_bytes("/proc/meminfo", "MemAvailable")
    avail = avail if avail is not None else 4 << 30
    room = cgroup_room()
    return avail if room is None else min(avail, room)


def window_bytes_per_token(n_embd: int, top_k: int, n_ff_exp: int) -> int:
    """Memory one prompt token holds through a layer of a long prefill window: its residual, the
    FFN's input and output, the embedding of the next layer's input (float32 [D] each), its routed
    experts' weighted outputs until they are summed (float32 [K, D], clutor.model.resident's
    SlotOutputs), and what one expert computing every row takes per row (its input [D], gate | up
    [2F], activation [F] and output [D] in float32, the int8 copies of input and activation with
    their scales): a chunk of experts is cut to a tile's pairs, but one expert may take every row.
    Attention's scores and temporaries are a tile's, not the window's."""
    D, F = n_embd, n_ff_exp
    return 4 * D * (top_k + 4) + 4 * (2 * D + 3 * F) + 2 * (D + F)


def resolve_ctx(spec: int | None, *, path: str, n_ctx_train: int, limit: int, page: int, page_tokens: int,
                state: int, free: int) -> tuple[int, str]:
    """Context length and a sentence saying how it was chosen. ``n_ctx_train``: the file's
    context_length; ``limit``: the longest context the file's RoPE scaling reaches (YaRN's original
    context times its factor, where that is more; else n_ctx_train). ``page``: the KV bytes of
    ``page_tokens`` tokens in every layer, ``state``: a sequence's fixed state bytes, ``free``: the memory left after
    the dense weights and the expert cache. By default the file's context, shortened (in whole pages,
    to no less than 4096 tokens) where one sequence's KV at it would take more than half of free."""
    if spec is not None:
        n = int(spec)
        if not 1 <= n <= limit:
            reach = (f"its context_length {n_ctx_train}" if limit == n_ctx_train else
                     f"what its RoPE scaling reaches, {limit} (its context_length is {n_ctx_train})")
            raise ClutorError(f"{path}: n_ctx must be between 1 and {reach}, got {n}")
        return n, "as asked" + (f", past the file's context_length {n_ctx_train} by its RoPE scaling"
                                if n > n_ctx_train else "")
    room = max(0, free // 2 - state) // max(1, page) * page_tokens
    n = max(min(n_ctx_train, 4096), min(n_ctx_train, room))
    if n == n_ctx_train:
        return n, "the file's context_length"
    return n, (f"the file's context_length is {n_ctx_train}; one sequence's KV at it would take more than half "
               f"of the {format_bytes(max(0, free))} left after the dense weights and the expert cache "
               f"(-c/n_ctx sets it)")


def resolve_window(spec: int | None, *, per_token: int, free: int, step_tokens: int, n_ctx: int) -> tuple[int, str]:
    """Tokens of a prompt one prefill step takes (each expert read once per layer for all of them)
    and a sentence saying how that was chosen. ``free``: the memory available after the dense
    weights, the expert cache and the KV pool; the window takes at most half of it. 0: prompts go
    in chunks of step_tokens."""
    if spec is not None:
        n = max(0, min(int(spec), n_ctx))
        if n <= step_tokens:
            return 0, f"off (prompts in chunks of step_tokens {step_tokens})"
        return n, f"as asked: {n} tokens ({format_bytes(n * per_token)} of hidden states)"
    n = min(n_ctx, max(0, free // 2) // per_token)
    if n <= step_tokens:
        return 0, (f"off: half of the {format_bytes(max(0, free))} left after the dense weights, expert cache "
                   f"and KV pool holds no more than step_tokens ({step_tokens})")
    return n, (f"default: {n} tokens, half of the {format_bytes(free)} left after the dense weights, expert "
               f"cache and KV pool ({format_bytes(per_token)} per token), at most n_ctx")


def min_budget(layout: ExpertLayout, top_k: int) -> int:
    """One layer's top-k experts: the model pins them all while it computes that layer."""
    return top_k * slot_bytes(layout)


def parse_size(spec: int | str, what: str, total: int, of: str) -> tuple[int, str]:
    """The budget grammar, one for every cache: bytes (an int, "3GiB", "1e9") or a share ("25%") of
    ``total`` (named ``of``). Returns (bytes, how it was read); ClutorError naming ``what`` otherwise."""
    if isinstance(spec, str) and spec.strip().endswith("%"):
        try:
            pct = float(spec.strip()[:-1])
        except ValueError:
            raise ClutorError(f"{what}: expected bytes like '3GiB' or a share like '25%', got {spec!r}") from None
        if not 0 < pct <= 100:
            raise ClutorError(f"{what}: a share must be in (0%, 100%], got {spec!r}")
        n = int(total * pct / 100)
        return n, f"{spec} of {of} ({format_bytes(n)})"
    if isinstance(spec, bool):
        raise ClutorError(f"{what}: expected bytes like '3GiB' or a share like '25%', got {spec!r}")
    try:
        n = parse_bytes(spec)
    except (ValueError, TypeError) as e:
        raise ClutorError(f"{what}: {e}") from None
    return n, f"as asked: {spec} = {format_bytes(n)}"


def resolve_budget(spec: int | str | None, layout: ExpertLayout, top_k: int, dense_bytes: int,
                   avail: int | None = None) -> tuple[int, str]:
    """Expert-cache bytes and a sentence saying how they were chosen.

    The minimum is one layer's top-k experts (the model pins a layer's experts while computing it)."""
    total = layout.n_layers * layout.n_experts * slot_bytes(layout)
    minimum = min_budget(layout, top_k)
    if spec is None:
        # Half of what is free after the dense weights, never more than all the experts need.
        share = ((mem_available() if avail is None else avail) - dense_bytes) // 2
        budget = max(minimum, min(total, share))
        why = f"default: half of available memory after dense weights, capped at all experts ({format_bytes(budget)})"
    else:
        budget, why = parse_size(spec, "expert_cache", total, "the expert bytes")
        if budget > total:
            # More than every expert needs would only be memory asked for and never used (and an
            # absurd size would fail in mmap): hold all the experts, and say so.
            why = f"{spec} asked, capped at what all experts need ({format_bytes(total)})"
            budget = total
    if budget < minimum:
        raise BudgetError(
            f"expert cache of {format_bytes(budget)} is too small: one layer's top-{top_k} experts need "
            f"{format_bytes(minimum)} ({minimum} bytes, {top_k} x {slot_bytes(layout)} per expert slot)")
    return budget, why


def resolve_kv_budget(spec: int | str | None, *, one_context: int, all_contexts: int, free: int,
                      avail: int) -> tuple[int, str]:
    """KV-pool bytes and a sentence saying how they were chosen. ``one_context``: one sequence at
    n_ctx; ``all_contexts``: max_sequences of them; ``free``: the memory available after the dense
    weights and the expert cache; ``avail``: all available memory (what a share is of)."""
    if spec is None:
        # Half of what is left, capped at what max_sequences full contexts can use, at least one context.
        budget = min(all_contexts, max(one_context, free // 2))
        why = (f"default: half of the memory available after the dense weights and the expert cache, capped at "
               f"max_sequences full contexts ({format_bytes(budget)})")
        return budget, why
    budget, why = parse_size(spec, "kv_cache", avail, "available memory")
    if budget > all_contexts:
        why += f", of which max_sequences full contexts use at most {format_bytes(all_contexts)}"
        budget = all_contexts
    return budget, why
