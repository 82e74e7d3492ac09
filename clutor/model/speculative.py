"""Speculative decoding: tokens drafted cheaply, verified by the model in one step.

A decoding sequence with a drafter feeds its last token and k drafted ones as one segment of the
step: k + 1 rows, whose experts are read once for all of them (clutor.model.engine). Row i's logits
give the token after draft i; the engine samples them in order with the request's own sampler and
keeps drafts while each equals what was sampled at its position. The first mismatch is the step's
last token; the rows after it are cut from the KV pages (KVPool.truncate).

For a deterministic draft this is exactly the target distribution, for greedy and sampled requests
alike: the draft d is kept when the sampler draws d (probability p(d)), and otherwise the token is
the sampler's own draw given it is not d, which is the standard rule's "resample from the
renormalised remainder". The sampler draws once per emitted token in the same order as without
speculation, and in q8 mode a row's logits do not depend on the rows beside it (the kernels sum each
row alone), so a seeded request gives the same tokens with and without it.

Drafters (``Drafter``):
- prompt lookup: the longest of the last ``ngram_max`` .. ``ngram_min`` tokens seen earlier in this
  request (its prompt and what it generated), and what followed it there;
- a session cache (``NgramCache``, one per model): the same lookup over requests that finished, so
  that the keys of a JSON schema or the lines of a file sent again draft from the last time;
- a draft model (mode "draft", clutor.model.draft.ModelDrafter): a small model with the same
  vocabulary, in RAM, decoding greedily.

``Pacer`` picks k per step from the sequence's recent acceptance and the measured cost of a step by its
row count (``Costs``: the expert bytes the rows add when streamed, their compute in RAM): the k that
maximises expected tokens per unit of step cost, 0 where no k pays.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ClutorError

__all__ = ["SpeculativeParams", "Drafter", "NgramCache", "Pacer", "parse_speculative"]

MODES = ("ngram", "draft", "off")


@dataclass(frozen=True)
class SpeculativeParams:
    """How a request drafts; llama.cpp's names where it has them (``--draft-max``, ``--draft-min``)."""

    mode: str = "ngram"      # "ngram" (prompt lookup + the session cache) | "draft" (the draft model) | "off"
    draft_max: int = 16      # drafted tokens per step at most
    draft_min: int = 0       # fewer than this and the step does not speculate
    draft_p_min: float = 0.0   # a draft model stops where its next token is less likely (llama.cpp: 0.0)
    ngram_max: int = 4       # the longest suffix looked up
    ngram_min: int = 1       # the shortest (the pacer drafts less where short matches are wrong)
    adaptive: bool = True    # k from acceptance and step cost (False: always draft_max when a match exists)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ClutorError(f"speculative mode: expected 'ngram', 'draft' or 'off', got {self.mode!r}")
        p = self.draft_p_min
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ClutorError(f"speculative draft_p_min: expected a probability in [0, 1], got {p!r}")
        for name, lo in (("draft_max", 1), ("draft_min", 0), ("ngram_max", 1), ("ngram_min", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ClutorError(f"speculative {name}: expected an integer >= {lo}, got {v!r}")
        if self.draft_max > 64:
            raise ClutorError(f"speculative draft_max: expected at most 64, got {self.draft_max}")
        if self.ngram_min > self.ngram_max:
            raise ClutorError(f"speculative ngram_min ({self.ngram_min}) is larger than ngram_max ({self.ngram_max})")
        if self.draft_min > self.draft_max:
            raise ClutorError(f"speculative draft_min ({self.draft_min}) is larger than draft_max ({self.draft_max})")

    @property
    def on(self) -> bool:
        return self.mode != "off"


def parse_speculative(value) -> SpeculativeParams | None:
    """None / False / "off" -> None; True / "ngram" -> the defaults; a dict or SpeculativeParams as given
    (a dict may use llama-server's names n_max / n_min)."""
    if value is None or value is False or value == "off":
        return None
    if isinstance(value, SpeculativeParams):
        return value if value.on else None
    if value is True:
        return SpeculativeParams()
    if isinstance(value, str):
        return SpeculativeParams(mode=value)
    if isinstance(value, dict):
        names = {"n_max": "draft_max", "n_min": "draft_min", "p_min": "draft_p_min", "type": "mode"}
        fields = set(SpeculativeParams.__dataclass_fields__)
        kw = {}
        for k, v in value.items():
            k = names.get(k, k)
            if k not in fields:
                raise ClutorError(f"speculative: unknown field {k!r} (expected {', '.join(sorted(fields))}, "
                                  "or n_max / n_min / p_min)")
            kw[k] = v
        p = SpeculativeParams(**kw)
        return p if p.on else None
    raise ClutorError(f"speculative: expected 'ngram', 'draft', 'off', a dict or SpeculativeParams, got {value!r}")


class NgramCache:
    """What followed each n-gram in finished requests, most recent kept; bounded in n-grams (one model's)."""

    def __init__(self, max_entries: int = 200_000, follow: int = 16):
        self.max_entries = max_entries
        self.follow = follow  # tokens kept after each n-gram
        self._map: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def add(self, ids: Sequence[int], sizes: range, tail: int) -> None:
        """The n-grams (of the given sizes) of ids' last ``tail`` positions, each with what followed it."""
        ids = list(ids)
        m = self._map
        for e in range(max(1, len(ids) - tail), len(ids)):  # e: where the continuation starts
            nxt = tuple(ids[e : e + self.follow])
            for n in sizes:
                if e >= n:
                    key = tuple(ids[e - n : e])
                    m[key] = nxt
                    m.move_to_end(key)
        while len(m) > self.max_entries:
            m.popitem(last=False)

    def get(self, key: tuple[int, ...]) -> tuple[int, ...] | None:
        return self._map.get(key)


class Drafter:
    """One request's drafts: its own history first (prompt lookup), then the session cache."""

    heavy = False  # proposing is a lookup, cheap enough for the event loop (a draft model's is not)

    def __init__(self, params: SpeculativeParams, cache: NgramCache | None = None):
        self.params = params
        self.cache = cache
        self._sizes = range(params.ngram_min, params.ngram_max + 1)
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation starts
        self._seen = 0       # history positions indexed as continuation starts
        self.drafted = 0     # drafted tokens verified
        self.accepted = 0    # ... of which kept
        self.steps = 0       # steps that verified a draft

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens likely to follow history: what followed the longest recent match of its tail."""
        if k <= 0:
            return []
        L = len(history)
        idx = self._index
        for e in range(max(self._seen, 1), L):  # index the n-grams that now have a continuation
            for n in self._sizes:
                if e >= n:
                    idx[tuple(history[e - n : e])] = e
        self._seen = max(self._seen, L)
        for n in reversed(self._sizes):
            if n > L:
                continue
            key = tuple(history[L - n :])
            e = idx.get(key)
            if e is not None and e < L:
                # what followed the match, through the end of the history and, for a repeating stretch
                # (a loop of period L - e), around again
                return [int(history[e + i % (L - e)]) for i in range(k)]
            if self.cache is not None:
                got = self.cache.get(key)
                if got:
                    return list(got[:k])
        return []

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1

    def close(self) -> None:
        pass


class Pacer:
    """k per step, from a sequence's acceptance and the cost of extra rows.

    Drafts are kept or lost in runs: a lookup that matched the right place is right for many tokens, a
    wrong one is wrong at once. So the pacer keeps two running rates: ``first``, that a draft's first
    token is kept, and ``cont``, that a kept token's successor in the draft is kept too. k drafts then
    give 1 + first * (1 - cont^k) / (1 - cont) tokens in expectation, at cost(k + 1) one-row steps
    (Costs, as measured); the k in [draft_min, cap] that maximises their ratio, 0 where none beats
    plain decoding. A sequence that stopped drafting probes with a short draft every ``probe`` steps,
    so a stretch that becomes predictable is noticed.

    A draft model's tokens are kept or lost one by one, each about as likely as the last (``geometric``):
    one rate then, from every token tried (kept, and the first lost), so that drafts of one token teach
    it as much as long ones."""

    probe = 4

    def __init__(self, params: SpeculativeParams, geometric: bool = False):
        self.params = params
        self.geometric = geometric
        self.first = 0.7   # priors: hopeful, then following the steps
        self.cont = 0.8
        self._idle = 0
        self._kept = self._tried = 0.0  # geometric: recent tokens kept and tried, decayed per step

    def update(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        if self.geometric:
            self._kept = 0.8 * self._kept + accepted
            self._tried = 0.8 * self._tried + accepted + (accepted < drafted)
            self.first = self.cont = (self._kept + 0.7) / (self._tried + 1.0)  # (the prior as one token tried)
            return
        self.first += 0.2 * (float(accepted > 0) - self.first)
        if accepted > 0 and drafted > 1:
            tries = min(drafted - 1, accepted)  # successors tried: each after a kept token
            self.cont += 0.2 * ((accepted - 1) / tries if accepted < drafted else 1.0) - 0.2 * self.cont

    def expected(self, k: int) -> float:
        """Tokens a step with k drafts gives, in expectation."""
        c = min(self.cont, 0.999)
        return 1.0 + (self.first * (1 - c ** k) / (1 - c) if k else 0.0)

    def choose(self, cost, cap: int, measured: int = 0) -> int:
        """measured: the most rows a step has had whose cost is known; k goes at most to twice that
        (past it the cost is a guess: a long draft lost at its first token is a costly way to learn)."""
        p = self.params
        cap = min(cap, p.draft_max)
        if measured and p.adaptive:
            cap = min(cap, max(4, 2 * measured))
        if cap < max(1, p.draft_min):
            return 0
        if not p.adaptive:
            return cap
        best, best_gain = 0, 1.0
        for k in range(max(1, p.draft_min), cap + 1):
            gain = self.expected(k) / cost(k + 1)
            if gain > best_gain * 1.0001:
                best, best_gain = k, gain
        if best == 0:
            self._idle += 1
            if self._idle >= self.probe:
                self._idle = 0
                k = min(max(2, p.draft_min), cap)
                return k if k >= p.draft_min else 0
        else:
            self._idle = 0
        return best


class Costs:
    """What a step of r rows costs against a one-row step, measured on one-segment steps: the median of
    the recent steps of each row count (a step that compiled a kernel or met a busy core is an outlier,
    not a cost). Rows share the dense weights and many of their experts, so the cost is not linear in
    r; a count not measured yet is interpolated between measured ones, and past the last one grows
    by ``prior`` per row (an optimistic start: long drafts get tried, then measured)."""

    window = 15

    def __init__(self, prior: float = 0.1):
        self.prior = prior
        self._steps: dict[int, list[float]] = {}  # rows -> recent steps' seconds

    def observe(self, rows: int, seconds: float) -> None:
        _push(self._steps.setdefault(rows, []), seconds, self.window)

    def cost(self, rows: int) -> float:
        """Seconds of a step of ``rows`` rows over a one-row step's (1.0 at one row, or before any is measured)."""
        one = self._steps.get(1)
        if rows <= 1 or not one:
            return 1.0
        t1 = _median(one)
        known = sorted((r, _median(v) / t1) for r, v in self._steps.items() if r > 1 and v)
        lo, c_lo = 1, 1.0
        for r, c in known:
            if r == rows:
                return max(c, 1.0)
            if r > rows:  # between two measured counts
                return max(1.0, c_lo + (c - c_lo) * (rows - lo) / (r - lo))
            lo, c_lo = r, max(c, c_lo)
        slope = self.prior
        if len(known) >= 2:  # past the last measured count: the slope of the last two
            (r0, c0), (r1, c1) = known[-2], known[-1]
            slope = max(self.prior, (c1 - c0) / (r1 - r0))
        elif known:
            slope = max(self.prior, (known[-1][1] - 1.0) / (known[-1][0] - 1))
        return c_lo + slope * (rows - lo)

    def seconds(self, rows: int = 1) -> float | None:
        """A measured step of ``rows`` rows' seconds (the median), None before any."""
        v = self._steps.get(rows)
        return _median(v) if v else None

    def measured(self) -> int:
        """The most rows a measured step had (1 before any)."""
        return max((r for r, v in self._steps.items() if v), default=1)

    @property
    def beta(self) -> float:
        """An extra row's cost, at two rows (for a report)."""
        return self.cost(2) - 1.0


def _push(xs: list[float], x: float, n: int) -> None:
    xs.append(x)
    if len(xs) > n:
        del xs[0]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


class SpecState:
    """A request's speculation inside the engine: its drafter, its pacer, the draft of the step planned.
    With a draft model (mode "draft", clutor.model.draft) each drafted token costs one of its steps too:
    the pacer weighs k drafts at cost(k + 1) + k * (a draft step over a one-row target step)."""

    def __init__(self, params: SpeculativeParams, cache: NgramCache | None, draft=None):
        self.params = params
        self.drafter = draft.drafter(params) if params.mode == "draft" else Drafter(params, cache)
        self.heavy = self.drafter.heavy
        self.pacer = Pacer(params, geometric=self.heavy)
        self.draft: list[int] = []

    def plan(self, history: Sequence[int], costs: "Costs", cap: int) -> list[int]:
        """The draft for the next step (at most cap tokens; [] when it does not pay or nothing matches)."""
        cost = costs.cost
        if self.heavy:
            d, one = self.drafter.draft.step_seconds(), costs.seconds(1)
            per = d / one if d is not None and one else 0.1  # a draft step over a target step (a guess at first)
            cost = lambda rows: costs.cost(rows) + (rows - 1) * per  # noqa: E731
        k = self.pacer.choose(cost, cap, costs.measured()) if cap > 0 else 0
        d = self.drafter.propose(history, k) if k else []
        self.draft = d if len(d) >= max(1, self.params.draft_min) else []
        return self.draft

    def settle(self, kept: int) -> None:
        """The step verified the draft and kept ``kept`` of its tokens."""
        if self.draft:
            self.drafter.record(len(self.draft), kept)
            self.pacer.update(len(self.draft), kept)
        self.draft = []

    def close(self) -> None:
        """The request left the engine: what its drafter holds (a draft model's sequence) goes back."""
        self.draft = []
        self.drafter.close()


def verifier(req, head, draft: list[int]):
    """The head of a drafted segment (compute thread): its rows' logits [k + 1, V] sampled in order by
    the request's own head (``head``: one row -> (token, extra)), each row seeing the tokens kept before
    it in req.history, until a token differs from the draft, ends the request (a stop id, max_new), or
    the rows run out. -> the tokens sampled, [(token, extra)], 1 .. k + 1 of them."""
    def verify(logits):
        out = []
        n0 = len(req.history)
        try:
            for i in range(len(draft) + 1):
                tok, extra = head(logits[i : i + 1])
                out.append((tok, extra))
                if (i == len(draft) or tok != draft[i] or tok in req.stop_ids
                        or req.n_gen + len(out) >= req.max_new):
                    break
                req.history.append(tok)
        finally:
            del req.history[n0:]
        return out

    return verify
