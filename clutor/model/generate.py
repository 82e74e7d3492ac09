"""Token-by-token generation as streamed records; the steps themselves run in clutor.model.engine."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

import numpy as np

from .._util import proc_bytes
from ..errors import ClutorError
from .engine import Request
from .sampling import Sampler, SamplingParams, token_logprobs
from .speculative import parse_speculative

_MODEL = object()  # generate(speculative=...) not given: the model's setting

__all__ = ["GenerationChunk", "GenerationStats", "IOReport", "generate", "peak_rss"]


def peak_rss() -> int:
    """VmHWM of this process (what the kernel reports as its peak resident set), bytes."""
    hwm = proc_bytes("/proc/self/status", "VmHWM")
    if hwm is not None:
        return hwm
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def _io_report(before, after, seconds: float, own) -> IOReport | None:
    """This generation's I/O: its own share of its steps' accesses, hits, bytes and waits (own, a
    clutor.model.accounting.Ledger); prefetch counts are the store's over the same time."""
    if before is None or after is None:
        return None
    d = {k: getattr(after, k) - getattr(before, k) for k in (
        "misses", "prefetch_issued", "prefetch_late", "prefetch_wasted", "bytes_demand", "bytes_prefetch")}
    reads = d["misses"] + d["prefetch_issued"]
    avg = (d["bytes_demand"] + d["bytes_prefetch"]) / reads if reads else 0
    accesses = round(own.accesses)
    hits = min(round(own.hits), accesses)
    return IOReport(
        backend=after.backend, mode=after.mode, cache_bytes=after.arena_bytes, accesses=accesses,
        hits=hits, misses=accesses - hits, prefetch_issued=d["prefetch_issued"],
        prefetch_late=d["prefetch_late"], prefetch_wasted=d["prefetch_wasted"],
        bytes_read=round(own.bytes_read), bytes_wasted=int(d["prefetch_wasted"] * avg),
        wait_seconds=own.wait_seconds, compute_seconds=max(seconds - own.wait_seconds, 0.0),
    )


@dataclass(frozen=True)
class IOReport:
    """What the expert store did for one generation. Accesses, hits, misses, bytes read and the wait
    are this generation's own: each expert a step read, and each wait, shared by the requests whose
    rows needed it (clutor.model.accounting), so concurrent generations' reports add up to the store's
    counters. The prefetch counts are the store's over the generation's time."""

    backend: str                 # "uring" | "threads"
    mode: str                    # "direct" | "buffered"
    cache_bytes: int             # the arena: the expert cache's whole memory
    accesses: int                # experts demanded (per layer, per step), this generation's share
    hits: int
    misses: int
    prefetch_issued: int
    prefetch_late: int           # demanded while their prefetch read was still in flight
    prefetch_wasted: int         # prefetched and dropped or evicted unused
    bytes_read: int              # demand + prefetch bytes transferred, this generation's share
    bytes_wasted: int            # an estimate: wasted prefetches x average expert bytes read
    wait_seconds: float          # the model waited for reads, this generation's share
    compute_seconds: float       # everything else in prefill + decode

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        """Share of demanded experts that were already resident or on their way (hits + late prefetches)."""
        return (self.hits + self.prefetch_late) / self.accesses if self.accesses else 0.0


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stop_reason: str  # "eos" | "stop" | "length"
    io: IOReport | None = None   # None when experts are mapped from the file
    peak_rss: int = 0            # the process's peak resident set (VmHWM), bytes
    cache_note: str = ""         # how the expert cache size was chosen
    cached_tokens: int = 0       # prompt tokens whose KV cache was reused, not computed (prefix cache)
    prompt_windows: int = 0      # steps the prompt took as windows (each expert read once per layer per window)
    disk_tokens: int = 0         # of cached_tokens, those loaded from the prefix cache on disk
    drafted_tokens: int = 0      # speculative decoding: drafted tokens its steps verified
    accepted_tokens: int = 0     # ... of which kept (each a token without a step of its own)
    draft_steps: int = 0         # steps that verified a draft
    stop_word: str = ""          # the stop string the text met (stop_reason "stop")

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def bytes_per_token(self) -> float:
        n = self.prompt_tokens + max(self.generated_tokens - 1, 0)
        return self.io.bytes_read / n if self.io and n else 0.0

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens computed (not reused from the prefix cache) per second."""
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # the first generated token comes from the prefill's logits, so decode steps = generated - 1
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass(frozen=True)
class GenerationChunk:
    text: str                 # new text (may be "" while a multi-byte character or stop string is pending)
    token: int | None         # the token sampled at this step; None on the final record
    stats: GenerationStats | None = None  # set on the final record only
    logprob: float | None = None  # log-probability of token (raw logits), when generate(logprobs=n)
    top_logprobs: list[tuple[int, float]] | None = None  # the n most likely (id, logprob) at this step

    @property
    def done(self) -> bool:
        return self.stats is not None


class _StopMatcher:
    """Holds back text that could still become a stop string, so stop strings are never emitted."""

    def __init__(self, stops: str | Sequence[str]):
        if isinstance(stops, str):  # one stop string, not one per character
            stops = [stops]
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit = ""  # the stop string met (the earliest in the text)

    def push(self, text: str) -> tuple[str, bool]:
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.hit = min(hits)
            out, self.pending = self.pending[:at], ""
            return out, True
        keep = 0  # longest suffix of pending that is a prefix of some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:n]):
                    keep = n
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


async def generate(model, prompt: str | Sequence[int], *, max_tokens: int = 256,
                   temperature: float = SamplingParams.temperature, top_k: int = SamplingParams.top_k,
                   top_p: float = SamplingParams.top_p, min_p: float = SamplingParams.min_p,
                   repeat_penalty: float = SamplingParams.repeat_penalty,
                   repeat_last_n: int = SamplingParams.repeat_last_n, seed: int | None = None,
                   stop: str | Sequence[str] = (), ignore_eos: bool = False, special: bool = False,
                   frequency_penalty: float = SamplingParams.frequency_penalty,
                   presence_penalty: float = SamplingParams.presence_penalty,
                   logprobs: int | None = None, logits_processor: Callable | None = None,
                   show_tokens: Sequence[int] = (), checkpoints: Sequence[int] = (),
                   speculative=_MODEL) -> AsyncIterator[GenerationChunk]:
    """Yield one GenerationChunk per sampled token, then a final one with the stats.

    The sampling options and their defaults are clutor.model.sampling.SamplingParams' (llama.cpp's).

    prompt: text (tokenized with BOS per the file; control tokens parsed only when special=True) or ids.
    max_tokens: at most this many tokens, and never past the context: a prompt that leaves less room
        generates what fits and ends with stop_reason "length"; a prompt longer than n_ctx is an error.
    stop: a stop string or several; generation ends before the first one, which is not emitted.
    ignore_eos: keep going past end-of-generation tokens, generating exactly max_tokens (benchmarks).
    logprobs: None = off; n >= 0 = each chunk also carries its token's logprob and the n most likely.
    logits_processor: called as logits_processor(ids so far, logits [V]) -> logits [V] on the compute
        thread before each sampling (a grammar's mask, clutor.grammar.Matcher: disallowed tokens set
        to -inf); what it returns is sampled from. An exception it raises ends this generation alone
        with that error.
    show_tokens: ids of control tokens whose text the reply shows (a chat format's markers, e.g.
        Mistral's [TOOL_CALLS]); other control tokens decode to nothing.
    checkpoints: prompt positions where a model with recurrent layers keeps a copy of its state, so a
        later prompt that shares only that prefix reuses it (the prompt's end is always kept).
    speculative: this request's drafting (clutor.model.speculative: "ngram", "draft", "off", a dict of
        SpeculativeParams' fields, whose mode is the model's where it names none); default: the
        model's (Model.open(speculative=..., draft_model=...)).

    The request joins the model's batch (clutor.model.engine): concurrent calls advance together, one
    forward per step, and a prompt that starts like a recently finished sequence reuses its KV cache.
    """
    tok = model.tokenizer
    if max_tokens < 1:
        raise ClutorError(f"max_tokens must be >= 1, got {max_tokens}")
    if isinstance(speculative, dict) and not {"mode", "type"} & speculative.keys():
        own = model.options.speculative  # fields without a mode: the model's drafter, with these settings
        speculative = {**speculative, "mode": own.mode if own is not None else "ngram"}
    spec = model.options.speculative if speculative is _MODEL else parse_speculative(speculative)
    if spec is not None and spec.mode == "draft" and model.draft is None:
        raise ClutorError(f"speculative mode 'draft': {model.path} was opened without a draft model "
                          "(Model.open(draft_model=PATH), -md/--model-draft)")
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                     repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed,
                                     frequency_penalty=frequency_penalty, presence_penalty=presence_penalty))
    if isinstance(prompt, str):
        # Tokenising (and rendering a chat template) is CPU-bound Python: off the event loop.
        ids = await asyncio.to_thread(tok.encode, prompt, special=special)
    elif callable(prompt):
        ids = await asyncio.to_thread(prompt)
        if isinstance(ids, tuple):  # (ids, where to keep a recurrent state): a chat turn
            ids, more = ids
            checkpoints = tuple(checkpoints) + tuple(more)
    else:
        ids = prompt
    ids = model.engine.check(ids)  # this caller's error, before it can join a step
    # n tokens generated feed n - 1 of them back: prompt + n - 1 positions must fit
    max_new = min(max_tokens, model.n_ctx - len(ids) + 1)
    stream = tok.stream(show=show_tokens)
    stopper = _StopMatcher(stop)
    io_before = model.io_stats()
    t0 = time.perf_counter()
    req = model.engine.submit(Request(
        ids, sampler=sampler, max_new=max_new, stop_ids=frozenset() if ignore_eos else frozenset(tok.stop_ids),
        sample=None if logprobs is None else _with_logprobs(logprobs),
        logits_processor=logits_processor, speculative=spec,
        checkpoints=tuple(checkpoints)))
    n_gen, reason = 0, "length"
    try:
        while True:
            token, extra, end = await req.next()
            lp, top = extra if extra is not None else (None, None)
            n_gen += 1
            if end == "eos":
                reason = "eos"
                break
            text, hit = stopper.push(stream.push(token))
            if hit:
                reason = "stop"
                if text:
                    yield GenerationChunk(text, token, None, lp, top)
                break
            yield GenerationChunk(text, token, None, lp, top)
            if end is not None:
                break
    finally:
        model.engine.release(req)
    t_end = time.perf_counter()
    t_first = req.t_first or t_end
    tail = "" if reason == "stop" else stopper.push(stream.flush())[0] + stopper.flush()
    stats = GenerationStats(len(ids), n_gen, t_first - t0, t_end - t_first, reason,
                            io=_io_report(io_before, model.io_stats(), t_end - t0, req.ledger),
                            peak_rss=peak_rss(), cache_note=model.cache_note, cached_tokens=req.cached_tokens,
                            prompt_windows=req.ledger.windows, disk_tokens=req.disk_tokens,
                            stop_word=stopper.hit, **_spec_stats(req))
    yield GenerationChunk(tail, None, stats)


def _with_logprobs(n: int):
    """The engine's sample hook (run on the compute thread): the sampled token, plus its logprob and the n
    most likely from the raw logits, before any logits processor or penalty (as OpenAI and llama.cpp's
    server report them)."""

    def sample(req, row, raw):
        token = req.sampler.sample(row, req.history)
        return token, token_logprobs(raw, token, n)

    return sample


def _spec_stats(req) -> dict:
    if req.spec is None:
        return {}
    d = req.spec.drafter
    return dict(drafted_tokens=d.drafted, accepted_tokens=d.accepted, draft_steps=d.steps)
