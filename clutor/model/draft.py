"""A draft model: a small model with the target's vocabulary, in RAM beside it, drafting greedily.

    draft = await DraftModel.open(path, target)          # Model.open(target, draft_model=path)
    d = draft.drafter(params)                            # one per request (speculative mode "draft")
    tokens = d.propose(history, k)                       # compute thread: up to k tokens

Each request's drafter keeps its own sequence in the draft model's KV pool: a proposal first cuts it back
to where it still agrees with the request's history (what the target kept), feeds the rest, then decodes
greedily up to k tokens, stopping early where the draft's most likely token has less than ``p_min`` of
its probability (llama.cpp's --draft-p-min; 0 by default, as there: the pacer sizes drafts from their
acceptance). A greedy draft is a deterministic one, so the engine's
verifier keeps the target's distribution exactly (clutor.model.speculative): the standard rule with a
one-hot draft distribution accepts d with the target's p(d) and otherwise samples the target's
remainder, which is what sampling each row and comparing does.

A draft that fails (its pool full, a kernel error) drafts nothing for that request from then on, with one
log line; it never fails the request.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ModelFileError, UnsupportedError
from .plan import StepPlan, Want

if TYPE_CHECKING:
    from .model import Model
    from .speculative import SpeculativeParams
    from .tokenizer import Tokenizer

__all__ = ["DraftModel", "ModelDrafter", "check_compatible"]

log = logging.getLogger("clutor.draft")

VOCAB_SIZE_SLACK = 128  # vocabularies may differ in length by this much (padding rows), as llama.cpp allows
VOCAB_CHECK_FROM = 5    # ... and must agree from this id on (llama.cpp skips the first few special ids)


def check_compatible(draft: "Tokenizer", target: "Tokenizer") -> None:
    """Refuse a draft whose tokens mean something else than the target's (llama.cpp's test:
    same tokenizer type, BOS / EOS, lengths within VOCAB_SIZE_SLACK, every token text equal)."""
    where = f"{draft.path} as a draft for {target.path}"
    if draft.model != target.model:
        raise ModelFileError(where, "tokenizer.ggml.model", f"{target.model!r} (the target's)", repr(draft.model))
    for name in ("add_bos", "add_eos", "bos_id", "eos_id"):
        a, b = getattr(draft, name, None), getattr(target, name, None)
        if a != b:
            raise ModelFileError(where, f"tokenizer {name}", f"{b!r} (the target's)", repr(a))
    if abs(draft.n_vocab - target.n_vocab) > VOCAB_SIZE_SLACK:
        raise ModelFileError(where, "tokenizer.ggml.tokens",
                             f"{target.n_vocab} tokens (the target's) within {VOCAB_SIZE_SLACK}", str(draft.n_vocab))
    for i in range(VOCAB_CHECK_FROM, min(draft.n_vocab, target.n_vocab)):
        if draft.token_text(i) != target.token_text(i):
            raise ModelFileError(where, f"tokenizer.ggml.tokens[{i}]", repr(target.token_text(i)),
                                 repr(draft.token_text(i)))


class DraftModel:
    """The draft model and what its requests share: its KV pool, its measured step time."""

    def __init__(self, model: "Model", n_vocab: int):
        self.model = model
        self.path = model.path
        self.n_vocab = n_vocab  # the target's: a draft token at or past it is never proposed
        self._lock = threading.Lock()  # the pool's sequences: proposals on the compute thread, releases on the loop
        self._steps: list[float] = []  # recent one-token draft steps' seconds

    @classmethod
    async def open(cls, path: str, target: "Model") -> "DraftModel":
        """Open path in RAM (io=memory) at the target's context and parallel sequences, for target."""
        from .model import Model

        m = await Model.open(path, io="memory", n_ctx=target.n_ctx, max_sequences=target.options.max_sequences,
                             prefix_cache=0, prefill_window=0, kv_type=target.options.kv_type,
                             activations=target.options.activations, threads=target.options.threads)
        try:
            if m.kv.recurrent:
                raise UnsupportedError(m.path, "general.architecture",
                                       "a draft model without recurrent layers (its drafts are cut back)",
                                       m.config.arch)
            check_compatible(m.tokenizer, target.tokenizer)
            if m.n_ctx < target.n_ctx:
                raise ModelFileError(f"{m.path} as a draft for {target.path}", "context_length",
                                     f"at least the target's context ({target.n_ctx})", str(m.n_ctx))
        except BaseException:
            await m.aclose()
            raise
        return cls(m, target.config.n_vocab)

    async def aclose(self) -> None:
        await self.model.aclose()

    def drafter(self, params: "SpeculativeParams") -> "ModelDrafter":
        return ModelDrafter(self, params)

    def step_seconds(self) -> float | None:
        """A one-token draft step's time (the median of the recent ones), None before any."""
        s = sorted(self._steps)
        return s[len(s) // 2] if s else None

    def _timed(self, seconds: float) -> None:
        self._steps.append(seconds)
        if len(self._steps) > 31:
            del self._steps[0]


class ModelDrafter:
    """One request's drafts from the draft model (the Drafter interface: propose, record)."""

    heavy = True  # proposing runs the draft model: on the compute thread, never on the event loop

    def __init__(self, draft: DraftModel, params: "SpeculativeParams"):
        self.draft = draft
        self.params = params
        self.seq = None               # the request's sequence in the draft's pool (made at the first proposal)
        self._fed: list[int] = []     # the tokens that sequence holds
        self._failed = False
        self._closed = False          # the request ended: nothing more is proposed, the sequence goes back
        self.drafted = 0              # drafted tokens verified
        self.accepted = 0             # ... of which kept
        self.steps = 0                # steps that verified a draft

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Compute thread: up to k tokens the draft model expects after history, greedily."""
        if k <= 0 or self._failed or self._closed or not history:
            return []
        d = self.draft
        out: list[int] = []
        with d._lock:
            try:
                out = self._propose(list(history), k)
            except Exception as e:  # noqa: BLE001 - a draft that fails drafts nothing, the request goes on
                self._failed = True
                log.warning("draft model %s: drafting stopped for this request (%s: %s)", d.path,
                            type(e).__name__, e)
        if self._failed or self._closed:  # (a close that found the lock held left the release to here)
            with d._lock:
                self._release()
        return out

    def _propose(self, history: list[int], k: int) -> list[int]:
        m = self.draft.model
        if self.seq is None:
            self.seq = m.kv.sequence()
        same = 0  # the fed tokens still agreeing with the history
        for a, b in zip(self._fed, history):
            if a != b:
                break
            same += 1
        same = min(same, len(history) - 1)  # the history's last token is fed again for its logits
        if self.seq.n > same:
            m.kv.truncate(self.seq, same)
            del self._fed[same:]
        k = min(k, m.n_ctx - len(history))
        if k <= 0:
            return []
        logits = self._feed(history[same:])
        out: list[int] = []
        p_min = self.params.draft_p_min
        while True:
            row = logits[0]  # [V] float32
            tok = int(np.argmax(row))
            p = 1.0 / float(np.sum(np.exp(row - row[tok])))  # its softmax probability
            if p < p_min or tok >= self.draft.n_vocab:
                break
            out.append(tok)
            if len(out) >= k:
                break
            t0 = time.perf_counter()
            logits = self._feed([tok])
            self.draft._timed(time.perf_counter() - t0)
        return out

    def _feed(self, ids: list[int]) -> np.ndarray:
        """ids appended to the draft's sequence (in chunks of its step_tokens); the last row's logits [1, V]."""
        m = self.draft.model
        chunk = m.options.step_tokens
        out = None
        for a in range(0, len(ids), chunk):
            part = ids[a : a + chunk]
            copies = m.kv.reserve(self.seq, self.seq.n + len(part))
            try:
                want = Want.LAST if a + chunk >= len(ids) else Want.NOTHING
                oc = m.runner.run_now(StepPlan.build([(self.seq, part, want)], copies=copies))[0]
            finally:
                m.kv.done(copies)
            if oc.error is not None:
                raise oc.error
            self._fed.extend(part)
            out = oc.value
        return out

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1

    def close(self) -> None:
        """The request ended: its sequence back to the draft's pool, now or (when a proposal is under
        way on the compute thread: the loop does not wait for it) as that proposal ends."""
        self._closed = True
        if self.draft._lock.acquire(blocking=False):
            try:
                self._release()
            finally:
                self.draft._lock.release()

    def _release(self) -> None:
        if self.seq is not None:
            seq, self.seq = self.seq, None
            self._fed = []
            self.draft.model.kv.release(seq)
